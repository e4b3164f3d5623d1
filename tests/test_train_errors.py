"""Bad input to `vitmask train`: one clear line on stderr, exit code 2, nothing lost."""

import pytest

from vitmask.checkpoint import load_checkpoint

from .conftest import assert_user_error, run_cli, write_config

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


def test_compile_without_a_compiler(tmp_path):
    cfg = write_config(tmp_path / "c.yaml")
    env = {**ONE, "CXX": "/nonexistent/g++"}
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
        env=env,
    )
    assert_user_error(res, "train.compile=true", "C++ compiler", "train.compile=false")


def test_a_run_dir_that_is_not_writable(tmp_path):
    cfg = write_config(tmp_path / "c.yaml")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    res = run_cli("train", "--config", cfg, "--run-dir", blocker / "run", env=ONE)
    assert_user_error(res, "is not writable", "--run-dir")
    assert blocker.read_text() == "not a folder"
