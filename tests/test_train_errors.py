"""Bad input to `vitmask train`: one clear line on stderr, exit code 2, nothing lost."""

import pytest
import torch

from vitmask.config import config_from_dict
from vitmask.errors import UserError
from vitmask.runtime import distributed, process
from vitmask.runtime.distributed import World
from vitmask.store.checkpoint import load_checkpoint
from vitmask.train.trainer import Trainer

from .conftest import TINY, assert_user_error, run_cli, write_config

ONE = {"OMP_NUM_THREADS": "1"}


def test_resuming_with_a_different_model_shape_is_refused_naming_the_key(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 2, "eval_every": 2, "checkpoint_every": 2}})
    run = tmp_path / "run"
    assert run_cli("train", "--config", cfg, "--run-dir", run, env=ONE).returncode == 0
    before = (run / "last.pt").read_bytes()
    res = run_cli(
        "train", "--config", cfg, "--run-dir", run, "--resume", "auto", "--set", "model.hidden_dim=16", env=ONE
    )
    assert_user_error(res, "keeps the config it was trained with", "model.hidden_dim (32 -> 16)")
    assert (run / "last.pt").read_bytes() == before
    assert load_checkpoint(run / "last.pt")["step"] == 2


@pytest.mark.parametrize(
    "setting, needles",
    [
        ("train.precision=fp16", ("fp16 needs a CUDA GPU", "train.precision=bf16")),
        ("train.accum_steps=5", ("train.accum_steps (5) must divide data.batch_size (32)",)),
    ],
)
def test_settings_that_cannot_work_here(tmp_path, setting, needles):
    cfg = write_config(tmp_path / "c.yaml")
    res = run_cli("train", "--config", cfg, "--run-dir", tmp_path / "run", "--device", "cpu", "--set", setting, env=ONE)
    assert_user_error(res, *needles)
    assert not list((tmp_path / "run").glob("*.pt"))


def test_compile_without_a_compiler(tmp_path, monkeypatch):
    from torch._inductor import config as inductor_config

    cfg = write_config(tmp_path / "c.yaml")
    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/g++"))  # what CXX=/nonexistent/g++ gives
    res = run_cli(
        "train",
        "--config",
        cfg,
        "--run-dir",
        tmp_path / "run",
        "--device",
        "cpu",
        "--set",
        "train.compile=true",
    )
    assert_user_error(res, "train.compile=true", "C++ compiler", "train.compile=false")


def test_a_run_dir_that_is_not_writable(tmp_path):
    cfg = write_config(tmp_path / "c.yaml")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    res = run_cli("train", "--config", cfg, "--run-dir", blocker / "run", env=ONE)
    assert_user_error(res, "is not writable", "--run-dir")
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize(
    "processes, accum, divisible",
    [(4, 2, False), (3, 2, True), (2, 3, True), (2, 4, False), (5, 1, False), (1, 12, True)],
)
def test_batch_size_must_be_divisible_by_processes_times_accum_steps(processes, accum, divisible):
    # a global batch of 12: 12 % (processes x accum_steps) by hand
    cfg = config_from_dict(TINY, ["data.batch_size=12", f"train.accum_steps={accum}"])
    world = World(rank=0, local_rank=0, size=processes)
    if divisible:
        process.prepare_process(cfg, torch.device("cpu"), world)  # the trainer's checks pass
        return
    images = torch.zeros(16, 16, 16, dtype=torch.uint8)
    with pytest.raises(UserError) as e:
        Trainer(cfg, {"train": images, "val": images}, torch.device("cpu"), world=world)
    assert f"data.batch_size (12) must be divisible by processes x train.accum_steps ({processes} x {accum})" in str(
        e.value
    )


def test_an_indivisible_batch_under_torchrun_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    from tests.test_sources import run_inproc

    # what torchrun with 4 processes gives the run, without starting them: a world of 4, this rank 0
    monkeypatch.setattr(distributed, "init", lambda device: (World(rank=0, local_rank=0, size=4), device))
    cfg = write_config(tmp_path / "c.yaml", {"data": {"batch_size": 12}, "train": {"accum_steps": 2}})
    res = run_inproc(capsys, "train", "--config", cfg, "--run-dir", tmp_path / "run", "--device", "cpu")
    assert_user_error(res, "data.batch_size (12) must be divisible by processes x train.accum_steps (4 x 2)")
    assert not list((tmp_path / "run").glob("*.pt"))
