"""Faults, races and hostile input: every one ends in one line (exit 2, or 130/143 for a signal),
and nothing is lost or overwritten.

Most scenarios run in process: `verbs.train` (what `vitmask train` calls) on a tiny config, or
`commands.main` with its exit code and stderr. Subprocesses only where a real second process or a real
signal is the point: two trainers racing, and a signal during start-up and data loading.
"""

import errno
import gzip
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from tests.conftest import ROOT, TINY, run_main, write_config
from vitmask import outputs
from vitmask.cli import commands, verbs
from vitmask.config import config_from_dict, load_config
from vitmask.data import sources
from vitmask.data.imagefile import gray_levels
from vitmask.data.preprocess import load_image_file
from vitmask.errors import Stopped, UserError
from vitmask.model import memory_estimate
from vitmask.model.vit import build_model
from vitmask.store import rundir
from vitmask.store.checkpoint import load_checkpoint, save_checkpoint, write_checkpoint_file
from vitmask.train import loggers
from vitmask.train import run as training_run

ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
SHORT = {"train": {"max_steps": 4, "eval_every": 2, "checkpoint_every": 2, "log_every": 2}}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoints at steps 2 and 4), made by `verbs.train`; copy it to change it."""
    root = tmp_path_factory.mktemp("trained")
    cfg = write_config(root / "c.yaml", SHORT)
    run_dir, _ = verbs.train(cfg, [], root / "run", None, "cpu")
    return run_dir


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def snapshot(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run.iterdir()) if p.is_file()}


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def user_error(capsys, *args) -> str:
    """Run `vitmask ARGS` in process; assert exit 2 with one line on stderr; return the line."""
    code, _, err = run_main(capsys, *args)
    assert code == 2, err
    return one_line(err)


# ---- the run dir: a lock, foreign runs, changed config, corrupt checkpoints -------------------------
def test_a_second_run_dir_owner_is_refused_with_the_holders_pid_and_a_stale_lock_never_blocks(tmp_path):
    run = tmp_path / "run"
    with rundir.RunDir(run, fresh=True):
        with pytest.raises(UserError, match=rf"in use by another vitmask process \(pid {os.getpid()}\)"):
            with rundir.RunDir(run, fresh=False):
                pass
        assert (run / rundir.LOCK_NAME).read_text().strip() == str(os.getpid())
    assert not (run / rundir.LOCK_NAME).exists()  # released and removed on exit
    (run / rundir.LOCK_NAME).write_text("999999\n")  # left by a killed process: nobody holds it
    with rundir.RunDir(run, fresh=False):
        assert (run / rundir.LOCK_NAME).read_text().strip() == str(os.getpid())


def test_two_trainers_racing_for_one_run_dir(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 100000, "eval_every": 100000, "log_every": 1}})
    run = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "vitmask", "train", "--config", str(cfg), "--run-dir", str(run), "--device", "cpu"],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in first.stdout:  # the first trainer is past start-up and owns the run dir
            if line.startswith("step 2/"):
                break
        for resume in (None, "auto"):
            with pytest.raises(
                UserError, match=rf"run dir {run} is in use by another vitmask process \(pid {first.pid}\)"
            ):
                verbs.train(cfg, [], run, resume, "cpu")
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 143, err
    stopped = load_checkpoint(run / "last.pt")["step"]  # the first run is whole: its checkpoint, its config
    assert load_config(run / "config.yaml").train.max_steps == 100000
    verbs.train(None, [f"train.max_steps={stopped + 1}"], run, "auto", "cpu")  # the lock went with the process
    assert load_checkpoint(run / "last.pt")["step"] == stopped + 1


def test_resume_into_a_foreign_run_dir_is_refused_and_a_fork_gets_its_own_id(trained, tmp_path, capsys):
    a = copy_run(trained, tmp_path / "a")
    b = tmp_path / "b"
    verbs.train(write_config(tmp_path / "b.yaml", {**SHORT, "seed": 1}), [], b, None, "cpu")
    before = snapshot(b)
    line = user_error(capsys, "train", "--resume", a / "last.pt", "--run-dir", b)
    assert f"run dir {b} holds the checkpoints of another run" in line and str(a) in line
    assert snapshot(b) == before  # nothing overwritten, nothing deleted

    fork = tmp_path / "fork"  # into a dir without checkpoints: a new run from a's state
    verbs.train(None, ["train.max_steps=6"], fork, str(a / "last.pt"), "cpu")
    assert "starting a new run in" in capsys.readouterr().out
    ids = {load_checkpoint(p / "last.pt")["run_id"] for p in (a, b, fork)}
    assert len(ids) == 3 and None not in ids
    before = snapshot(a)
    with pytest.raises(UserError, match="holds the checkpoints of another run"):
        verbs.train(None, [], a, str(fork / "last.pt"), "cpu")
    assert snapshot(a) == before

    backup = tmp_path / "backup.pt"  # a copy of a's own checkpoint, kept elsewhere, may go back
    shutil.copy(a / "last.pt", backup)
    verbs.train(None, ["train.max_steps=5"], a, str(backup), "cpu")
    assert load_checkpoint(a / "last.pt")["step"] == 5
    assert load_checkpoint(a / "last.pt")["run_id"] == load_checkpoint(backup)["run_id"]

    legacy = load_checkpoint(fork / "last.pt")  # from before run ids, kept outside its dir: not a's
    del legacy["run_id"]
    save_checkpoint({k: v for k, v in legacy.items() if k != "format"}, tmp_path / "legacy.pt")
    with pytest.raises(UserError, match="holds the checkpoints of another run"):
        verbs.train(None, [], a, str(tmp_path / "legacy.pt"), "cpu")


def test_without_run_dir_a_run_writes_to_runs_name(tmp_path, monkeypatch):
    cfg = write_config(tmp_path / "tiny.yaml", {"train": {"max_steps": 1, "eval_every": 1, "checkpoint_every": 1}})
    monkeypatch.chdir(tmp_path)
    run_dir, _ = verbs.train(cfg, [], None, None, "cpu")
    assert run_dir == Path("runs") / "tiny" and (tmp_path / "runs" / "tiny" / "last.pt").is_file()


def test_resume_path_without_run_dir_writes_into_the_checkpoints_folder(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "run")
    run_dir, _ = verbs.train(None, ["train.max_steps=5"], None, str(run / "step_0000004.pt"), "cpu")
    assert run_dir == run
    assert f"resuming {run} from step 4" in capsys.readouterr().out
    assert (run / "step_0000005.pt").is_file() and load_checkpoint(run / "last.pt")["step"] == 5


def test_resume_with_a_changed_key_is_refused_and_an_allowed_change_is_recorded(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "run")
    before = snapshot(run)
    line = user_error(capsys, "train", "--run-dir", run, "--resume", "auto", "--set", "train.lr=0.01")
    assert "keeps the config it was trained with" in line and "train.lr (0.003 -> 0.01)" in line
    edited = write_config(tmp_path / "edited.yaml", {**SHORT, "model": {**TINY["model"], "depth": 3}})
    line = user_error(capsys, "train", "--config", edited, "--run-dir", run, "--resume", "auto")
    assert "model.depth (2 -> 3)" in line
    assert snapshot(run) == before

    verbs.train(None, ["train.max_steps=6", "train.keep_last=5"], run, "auto", "cpu")
    assert "changed: train.max_steps 4 -> 6; train.keep_last 3 -> 5" in capsys.readouterr().out
    state = load_checkpoint(run / "last.pt")
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert state["step"] == 6
    assert state["config"]["train"]["max_steps"] == recorded["train"]["max_steps"] == 6
    assert state["config"]["train"]["keep_last"] == recorded["train"]["keep_last"] == 5
    assert state["config"]["train"]["lr"] == recorded["train"]["lr"] == 3e-3
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [3e-3] * len(state["optimizer"]["param_groups"])
    line = user_error(capsys, "train", "--run-dir", run, "--resume", "auto", "--set", "train.max_steps=5")
    assert "past train.max_steps (5)" in line


def test_a_corrupt_last_pt_falls_back_to_the_newest_good_step_file_with_one_warning(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "run")  # copytree: last.pt is its own file here, not a link
    (run / "last.pt").write_bytes((run / "last.pt").read_bytes()[:1000])  # truncated
    verbs.train(None, ["train.max_steps=5"], run, "auto", "cpu")
    out, err = capsys.readouterr()
    warning = one_line(err)
    assert warning.startswith("vitmask: warning: last.pt cannot be used") and "resuming from step_0000004.pt" in warning
    assert "resuming" in out and "from step 4" in out
    assert load_checkpoint(run / "last.pt")["step"] == 5  # last.pt is whole again

    for p in run.glob("*.pt"):
        p.write_bytes(b"")
    before = snapshot(run)
    line = user_error(capsys, "train", "--run-dir", run, "--resume", "auto", "--set", "train.max_steps=9")
    assert f"no checkpoint in {run} can be resumed" in line
    assert snapshot(run) == before  # never started afresh over them


def test_an_early_error_or_signal_leaves_no_files_that_block_the_run_dir(tmp_path, monkeypatch):
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    empty = tmp_path / "no-images"
    empty.mkdir()
    run = tmp_path / "runs" / "new"
    with pytest.raises(UserError, match="no PNG, JPEG or BMP files"):
        verbs.train(cfg, ["data.source=folder", f"data.path={empty}"], run, None, "cpu")
    assert not (tmp_path / "runs").exists()  # the folders it made are gone too

    def stopped(_cfg):
        raise Stopped(signal.SIGTERM)

    existing = tmp_path / "existing"
    existing.mkdir()
    monkeypatch.setattr(training_run, "load_labelled_splits", stopped)
    with pytest.raises(Stopped):
        verbs.train(cfg, [], existing, None, "cpu")
    assert existing.is_dir() and not list(existing.iterdir())
    monkeypatch.undo()
    verbs.train(cfg, [], existing, None, "cpu")  # the same command now just works
    assert load_checkpoint(existing / "last.pt")["step"] == 4


def test_resume_auto_may_restart_over_the_leftovers_of_a_start_without_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "events.out.tfevents.1.host.1.0").write_bytes(b"x")
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    verbs.train(cfg, [], run, "auto", "cpu")
    assert load_checkpoint(run / "last.pt")["step"] == 4
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    line = user_error(capsys, "train", "--config", cfg, "--run-dir", other, "--resume", "auto")
    assert "holds files that are not a vitmask run's (notes.txt)" in line
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_a_run_dir_that_is_a_file_or_read_only(tmp_path, capsys, monkeypatch):
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    assert "is a file, not a folder" in user_error(capsys, "train", "--config", cfg, "--run-dir", blocker)
    assert blocker.read_text() == "mine"
    ro, access = tmp_path / "ro", os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != ro and access(path, mode))  # no permission
    line = user_error(capsys, "train", "--config", cfg, "--run-dir", ro)
    assert "is not writable" in line and not ro.exists()


# ---- a full disk ------------------------------------------------------------------------------------
class FullDisk:
    """Patch `outputs.open` so that writes fail with ENOSPC once `budget` bytes went to files named like `match`."""

    def __init__(self, monkeypatch, budget: int, match: str = ""):
        self.left = budget
        self.match = match
        real = open

        def fake_open(path, mode="r", *args, **kwargs):
            f = real(path, mode, *args, **kwargs)
            if "w" not in mode or match not in Path(path).name:
                return f
            write = f.write

            def limited(data):
                if len(data) > self.left:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self.left -= len(data)
                return write(data)

            f.write = limited
            return f

        monkeypatch.setattr(outputs, "open", fake_open, raising=False)


def test_a_full_disk_during_training_names_the_intact_checkpoint_and_leaves_no_partial_file(tmp_path, monkeypatch):
    cfg = write_config(tmp_path / "c.yaml", {**SHORT, "train": {**SHORT["train"], "max_steps": 8}})
    run = tmp_path / "run"
    probe = tmp_path / "probe"
    verbs.train(cfg, ["train.max_steps=2"], probe, None, "cpu")
    per_file = (probe / "step_0000002.pt").stat().st_size  # every checkpoint file of this config is this big
    FullDisk(monkeypatch, budget=3 * per_file + per_file // 2, match=".pt")  # room for 3 of them
    with pytest.raises(UserError) as err:
        verbs.train(cfg, [], run, None, "cpu")
    kept = load_checkpoint(run / "last.pt")["step"]
    assert kept in (2, 4)  # best.pt takes one or two of the three
    msg = str(err.value)
    assert f"in {run}: the disk is full" in msg and msg.startswith(f"training stopped at step {kept + 2}: cannot write")
    assert f"the last checkpoint, {run / 'last.pt'} (step {kept}), is intact" in msg
    assert f"vitmask train --run-dir {run} --resume auto" in msg
    assert not list(run.glob(".*tmp*")) and all(p.stat().st_size > 0 for p in run.iterdir() if p.is_file())
    monkeypatch.undo()  # room again: the printed command resumes it
    verbs.train(None, [], run, "auto", "cpu")
    assert load_checkpoint(run / "last.pt")["step"] == 8


def test_a_full_disk_for_tensorboard_or_before_the_first_checkpoint(tmp_path, monkeypatch):
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    FullDisk(monkeypatch, budget=0, match=".pt")
    run = tmp_path / "run"
    with pytest.raises(UserError, match="no checkpoint had been written yet, so the run left nothing behind"):
        verbs.train(cfg, [], run, None, "cpu")
    assert not run.exists()
    monkeypatch.undo()

    def full(self, metrics, step):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loggers.TensorBoardLogger, "log", full)
    with pytest.raises(UserError, match="cannot write the TensorBoard event file .* the disk is full"):
        verbs.train(cfg, [], run, None, "cpu")


# ---- non-finite checkpoints ------------------------------------------------------------------------
def test_a_checkpoint_with_non_finite_weights_is_never_written_and_never_read(trained, tmp_path, capsys):
    state = load_checkpoint(trained / "last.pt")
    state.pop("format")
    bad = {
        **state,
        "model": {**state["model"], "head.bias": torch.full_like(state["model"]["head.bias"], float("nan"))},
    }
    with pytest.raises(UserError, match=r"model weight head\.bias holds NaN or inf values at step 4"):
        save_checkpoint(bad, tmp_path / "bad.pt")
    assert not list(tmp_path.iterdir())  # not even a temp file

    write_checkpoint_file({"format": "vitmask-checkpoint/1", **bad}, tmp_path / "bad.pt")  # by something else
    line = user_error(capsys, "eval", "--checkpoint", tmp_path / "bad.pt")
    assert "holds NaN or inf values (model weight head.bias)" in line
    with pytest.raises(UserError, match="holds NaN or inf"):
        verbs.train(None, [], tmp_path / "r", str(tmp_path / "bad.pt"), "cpu")

    moments = state["optimizer"]["state"][0]
    moments["exp_avg_sq"] = torch.full_like(moments["exp_avg_sq"], float("inf"))
    with pytest.raises(UserError, match=r"optimizer state state\.0\.exp_avg_sq holds NaN or inf"):
        save_checkpoint(state, tmp_path / "bad2.pt")


def test_weights_gone_non_finite_after_a_finite_loss_stop_the_run_before_the_write(trained, tmp_path, monkeypatch):
    run = copy_run(trained, tmp_path / "run")
    before = snapshot(run)
    step = torch.optim.Adam.step

    def poisoned(self, *args, **kwargs):  # the update of step 5 makes every weight NaN; its loss was finite
        out = step(self, *args, **kwargs)
        if self.state[self.param_groups[0]["params"][0]]["step"] == 5:
            for p in self.param_groups[0]["params"]:
                p.data.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.Adam, "step", poisoned)
    with pytest.raises(UserError, match="holds NaN or inf values at step 5"):
        verbs.train(None, ["train.max_steps=5"], run, "auto", "cpu")
    after = snapshot(run)
    assert {k: v for k, v in after.items() if k.endswith(".pt")} == {
        k: v for k, v in before.items() if k.endswith(".pt")
    }


# ---- damaged checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda s: s.pop("optimizer"), "has no 'optimizer' entry, so it cannot be resumed"),
        (lambda s: s.update(step="four"), "'step' is str, not an integer"),
        (lambda s: s.update(rng=[1, 2]), "'rng' is list, not a dict"),
        (lambda s: s.update(sampler={"seed": "x", "step": 4}), "is damaged or from another version"),
        (lambda s: s["optimizer"].update(param_groups=[]), "optimizer state does not fit this run"),
        (lambda s: s["optimizer"]["state"][0].update(exp_avg=torch.zeros(3)), r"optimizer exp_avg of shape \(3,\)"),
        (lambda s: s.update(scheduler={"last_epoch": "x"}), "'scheduler' entry is not a schedule"),
        (lambda s: s.update(best_val_loss=float("nan")), "best_val_loss is NaN"),
    ],
)
def test_a_damaged_checkpoint_is_refused_on_resume_in_one_line(trained, tmp_path, damage, needle):
    run = copy_run(trained, tmp_path / "run")
    state = load_checkpoint(run / "last.pt")
    state.pop("format")
    damage(state)
    save_checkpoint(state, tmp_path / "damaged.pt")
    with pytest.raises(UserError, match=needle):
        verbs.train(None, [], run, str(tmp_path / "damaged.pt"), "cpu")


def test_a_damaged_checkpoint_is_refused_by_eval_and_count_params(trained, tmp_path, capsys):
    state = load_checkpoint(trained / "last.pt")
    state.pop("format")
    cases = {
        "model-not-dict.pt": {**state, "model": [1, 2]},
        "config-unknown-key.pt": {**state, "config": {**state["config"], "colour": "red"}},
        "config-not-dict.pt": {**state, "config": "tiny"},
        "wrong-shape.pt": {**state, "model": {**state["model"], "head.bias": torch.zeros(3)}},
    }
    needles = {
        "model-not-dict.pt": "its 'model' entry is not a dict of tensors",
        "config-unknown-key.pt": "holds a config this version cannot use (config: unknown key 'colour'",
        "config-not-dict.pt": "its 'config' entry is not a mapping",
        "wrong-shape.pt": "head.bias (3,) vs (16,)",
    }
    for name, damaged in cases.items():
        write_checkpoint_file({"format": "vitmask-checkpoint/1", **damaged}, tmp_path / name)
        assert needles[name] in user_error(capsys, "eval", "--checkpoint", tmp_path / name), name
    assert "is a folder" in user_error(capsys, "eval", "--checkpoint", trained)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert "not a PyTorch zip file" in user_error(capsys, "count-params", "--checkpoint", empty)


# ---- numbers in the config -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("train.lr", ".inf", "train.lr must be a finite number"),
        ("train.lr", ".nan", "train.lr must be a finite number"),
        ("train.lr", "1e6", "train.lr must be in (0, 1]"),
        ("train.weight_decay", ".inf", "train.weight_decay must be a finite number"),
        ("train.weight_decay", "50", "train.weight_decay must be in [0, 1]"),
        ("train.eps", "0", "train.eps must be in (0, 1]"),
        ("train.eps", "1e10", "train.eps must be in (0, 1]"),
        ("train.beta2", ".nan", "train.beta2 must be a finite number"),
        ("train.grad_clip", ".inf", "train.grad_clip must be a finite number"),
        ("train.min_lr", "-.inf", "train.min_lr must be a finite number"),
        ("mask.ratio", ".nan", "mask.ratio must be a finite number"),
        ("mask.block_aspect", "[0.3, .inf]", "mask.block_aspect must be a finite number"),
        ("mask.ratio_range", "[0.1, .nan]", "mask.ratio_range must be a finite number"),
        ("mask.fill", ".nan", "mask.fill must be a finite number"),
        ("model.dropout", ".nan", "model.dropout must be a finite number"),
        ("data.threshold", ".inf", "data.threshold must be a finite number"),
        ("data.val_fraction", ".nan", "data.val_fraction must be a finite number"),
        ("data.image_size", "2", "must hold at least 2 patches"),
        ("seed", str(2**70), "seed must be an integer in"),
        ("name", "../elsewhere", "name must be a plain folder name"),
        ("model.depth", "0", "model.depth must be >= 1"),
        ("model.depth", "5000", "model.depth must be <= 1024"),
    ],
)
def test_numbers_must_be_finite_and_in_range(key, value, needle):
    with pytest.raises(UserError) as err:
        config_from_dict(TINY, [f"{key}={value}"])
    assert needle in str(err.value)


def test_cli_numbers_out_of_range_are_one_line(trained, tmp_path, capsys):
    line = user_error(capsys, "eval", "--checkpoint", trained / "last.pt", "--seed", str(2**70))
    assert "--seed must be an integer in" in line
    line = user_error(
        capsys, "reconstruct", "--checkpoint", trained / "last.pt", "--out", tmp_path / "r.png", "--n", 10**6
    )
    assert "--n must be at least 1 and at most 256" in line
    cfg = write_config(tmp_path / "c.yaml")
    assert "--count must be at least 1" in user_error(capsys, "preview", "--config", cfg, "--count", 0)
    sample = ["sample", "--checkpoint", trained / "last.pt", "--out", tmp_path / "s.png"]
    assert "--temperature must be >= 0 and finite" in user_error(capsys, *sample, "--temperature", "inf")
    assert "--n must be at least 1 and at most 256" in user_error(capsys, *sample, "--n", 10**5)
    assert not list(tmp_path.glob("*.png"))


def test_an_allocation_no_estimate_foresaw_is_one_line(trained, capsys, monkeypatch):
    def too_big(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 128000000000 bytes.")

    monkeypatch.setattr(verbs, "evaluate_split", too_big)
    line = user_error(capsys, "eval", "--checkpoint", trained / "last.pt")
    assert f"out of memory while eval (one allocation of {128e9 / 2**30:,.1f} GiB)" in line


# ---- memory ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model",
    [
        {},
        {"norm": "rmsnorm", "activation": "swiglu", "num_kv_heads": 1, "pos": "rope2d"},
        {"norm": "none", "qkv_bias": False, "out_proj": False, "pos": "sincos2d", "norm_position": "post"},
        {"decoder": "self", "decoder_depth": 2, "decoder_dim": 16},
        {"decoder": "cross", "decoder_self_attn": True, "decoder_ffn_dim": 24},
    ],
)
def test_the_estimate_counts_the_parameters_torch_builds(model):
    cfg = config_from_dict({**TINY, "model": {**TINY["model"], **model}, "mask": {"ratio": 0.5, "fill": "learned"}})
    assert memory_estimate.param_count(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


def test_a_config_that_cannot_fit_is_refused_before_anything_is_made_with_the_figure(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(memory_estimate, "available_bytes", lambda device: 8 * 2**30)
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    overrides = ["data.image_size=256", "data.batch_size=64", "model.attention=explicit"]
    est = memory_estimate.estimate(config_from_dict(TINY, overrides))
    n = (256 // 2) ** 2  # patches
    assert est.parts[f"attention scores (B, H, N, N) = 64 x 2 x {n} x {n}"] == 2 * 64 * 2 * n * n * 4  # depth 2, fp32
    line = user_error(
        capsys, "train", "--config", cfg, "--run-dir", tmp_path / "run", *sum((["--set", o] for o in overrides), [])
    )
    assert f"needs about {est.total / 2**30:,.1f} GiB" in line and "attention scores (B, H, N, N)" in line
    assert "only 8.0 GiB is free" in line and "data.batch_size" in line
    assert not (tmp_path / "run").exists()
    line = user_error(
        capsys, "count-params", "--config", cfg, "--set", "model.hidden_dim=1000000", "--set", "model.num_heads=1"
    )
    assert "parameters needs" in line and "for its weights alone" in line
    line = user_error(
        capsys, "train", "--config", cfg, "--run-dir", tmp_path / "run", "--set", f"data.image_size={10**20}"
    )
    assert "data.image_size must be an integer in [-9223372036854775808, 9223372036854775807]" in line  # int64


@pytest.mark.parametrize("slowdown, scores_bytes", [(0.5, 2), (95.0, 0)])
def test_the_estimate_of_auto_precision_is_that_of_what_it_runs(monkeypatch, slowdown, scores_bytes):
    from vitmask.runtime import process

    # auto on a CPU with bf16 instructions runs bf16, and CPU bf16 writes the (B, H, N, N) scores out
    # (2 bytes each); on one without, fp32 through SDPA, which writes none
    monkeypatch.setattr(process, "cpu_bf16_slowdown", lambda: slowdown)
    process.auto_precision.cache_clear()
    try:
        est = memory_estimate.estimate(config_from_dict(TINY, ["train.precision=auto", "data.batch_size=8"]))
    finally:
        process.auto_precision.cache_clear()
    n = (TINY["data"]["image_size"] // 2) ** 2
    assert est.parts[f"attention scores (B, H, N, N) = 8 x 2 x {n} x {n}"] == scores_bytes * 2 * 8 * 2 * n * n


# ---- image files ---------------------------------------------------------------------------------------
def gray_of(mode: str, pixels: list, **info) -> list[int]:
    im = Image.new(mode, (len(pixels), 1))
    im.putdata(pixels)
    im.info.update(info)
    return gray_levels(im, Path(f"x.{mode}")).ravel().tolist()


def test_every_image_mode_binarizes_by_its_own_meaning_or_is_refused():
    # hand values: 601-2 luma (299 R + 587 G + 114 B) / 1000, rounded; deep modes scaled to their full range
    assert gray_of("1", [0, 1]) == [0, 255]
    assert gray_of("L", [0, 77, 255]) == [0, 77, 255]
    assert gray_of("RGB", [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)]) == [76, 150, 29, 255]
    assert gray_of("RGBA", [(255, 0, 0, 255), (255, 255, 255, 255)]) == [76, 255]  # opaque: alpha dropped
    assert gray_of("LA", [(10, 255), (200, 255)]) == [10, 200]
    assert gray_of("RGB", [(255, 255, 255)], transparency=(0, 0, 0)) == [255]  # a transparent colour nobody uses
    assert gray_of("CMYK", [(0, 0, 0, 0), (0, 0, 0, 255), (255, 255, 255, 0)]) == [255, 0, 0]
    assert gray_of("YCbCr", [(0, 128, 128), (255, 128, 128)]) == [0, 255]
    assert gray_of("I;16", [0, 257 * 128, 65535]) == [0, 128, 255]  # Pillow's own L would clip these to 0, 255, 255
    assert gray_of("I", [0, 257 * 100, 65535]) == [0, 100, 255]
    assert gray_of("F", [0.0, 0.5, 1.0]) == [0, 128, 255]  # Pillow's own L would give 0, 0, 1
    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 255, 255, 255])
    pal.putdata([0, 1])
    assert gray_levels(pal, Path("p.png")).ravel().tolist() == [0, 255]
    lab = Image.new("LAB", (2, 1))
    lab.putdata([(30, 128, 128), (220, 0, 255)])
    assert gray_levels(lab, Path("lab.tif")).ravel().tolist() == [30, 220]
    for mode, pixels, info, needle in [
        ("RGBA", [(255, 255, 255, 0), (0, 0, 0, 255)], {}, "has transparent pixels (mode RGBA)"),
        ("LA", [(255, 128)], {}, "has transparent pixels (mode LA)"),
        ("P", [0, 1], {"transparency": 0}, "has transparent pixels (mode P with a transparent colour)"),
        ("L", [0, 255], {"transparency": 255}, "has transparent pixels (mode L with a transparent colour)"),
        ("RGB", [(1, 2, 3), (9, 9, 9)], {"transparency": (9, 9, 9)}, "(mode RGB with a transparent colour)"),
        ("I", [-5, 70000], {}, "holds 32-bit values in [-5, 70000]"),
        ("F", [0.0, 2.0], {}, "floating-point values outside [0, 1]"),
        ("F", [float("nan")], {}, "floating-point values outside [0, 1]"),
    ]:
        with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            gray_of(mode, pixels, **info)


def test_image_files_deep_modes_orientation_and_bombs(tmp_path, monkeypatch):
    deep = np.array([[0, 65535], [257 * 64, 257 * 200]], dtype=np.uint16)
    Image.fromarray(deep).save(tmp_path / "deep.png")  # a 16-bit grayscale PNG
    assert load_image_file(tmp_path / "deep.png").tolist() == [[0, 255], [64, 200]]
    stored = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint8) * 40  # 3 wide, 2 high
    exif = Image.Exif()
    exif[0x0112] = 6  # EXIF orientation 6: show it turned 90 degrees clockwise
    Image.fromarray(stored).save(tmp_path / "turned.png", exif=exif)
    assert load_image_file(tmp_path / "turned.png").tolist() == [[160, 40], [200, 80], [240, 120]]

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    Image.new("L", (40, 40), 255).save(tmp_path / "warned.png")  # over the limit: Pillow warns
    Image.new("L", (100, 100), 255).save(tmp_path / "bomb.png")  # over twice the limit: Pillow raises
    for name in ("warned.png", "bomb.png"):
        with pytest.raises(UserError, match="too large to open safely"):
            load_image_file(tmp_path / name)


def test_a_decompression_bomb_in_a_folder_is_skipped_as_a_bad_file(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(20):
        Image.new("L", (16, 16), 255 * (i % 2)).save(folder / f"ok{i:02d}.png")
    Image.new("L", (100, 100), 255).save(folder / "bomb.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    cfg = config_from_dict(TINY, ["data.source=folder", f"data.path={folder}"])
    from vitmask.data.batches import load_splits

    splits = load_splits(cfg)
    assert sum(len(v) for v in splits.values()) == 20
    warning = one_line(capsys.readouterr().err)
    assert "skipped 1 of 21 image files" in warning and "bomb.png" in warning


def test_a_folder_of_images_too_big_for_memory_is_refused_while_reading(tmp_path, monkeypatch):
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(10):
        Image.new("L", (100, 100), 255).save(folder / f"{i}.png")
    monkeypatch.setattr(sources, "available_bytes", lambda device: 2 * 30_000)  # half of it: 3 of the 10
    cfg = config_from_dict(TINY, ["data.source=folder", f"data.path={folder}"])
    with pytest.raises(UserError, match="take more than 0.0 GiB at full size, over half the free memory"):
        sources.read_folder(cfg.data)


def test_inpaint_refuses_a_bomb_and_writing_over_its_input(trained, tmp_path, capsys, monkeypatch):
    image = tmp_path / "me.png"
    Image.new("L", (16, 16), 0).save(image)
    before = image.read_bytes()
    base = ["inpaint", "--checkpoint", trained / "last.pt", "--box", "0,0,4,4"]
    line = user_error(capsys, *base, "--image", image, "--out", image)
    assert "is the input file" in line and image.read_bytes() == before
    (tmp_path / "link.png").symlink_to(image)
    assert "is the input file" in user_error(capsys, *base, "--image", image, "--out", tmp_path / "link.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    assert "too large to open safely" in user_error(capsys, *base, "--image", image, "--out", tmp_path / "o.png")
    assert not (tmp_path / "o.png").exists()


# ---- data files not quite as expected ------------------------------------------------------------------
def test_data_files_not_quite_as_expected_are_one_line(tmp_path):
    def load(**data):
        from vitmask.data.batches import load_splits

        return load_splits(config_from_dict(TINY, [f"data.{k}={v}" for k, v in data.items()]))

    cases = {
        "nan.npz": (np.full((20, 16, 16), np.nan, dtype=np.float32), "holds NaN or inf values"),
        "channels.npz": (np.zeros((20, 16, 16, 2), dtype=np.uint8), "has shape (20, 16, 16, 2)"),
        "complex.npz": (np.zeros((20, 16, 16), dtype=np.complex64), "has dtype complex64"),
        "negative.npz": (np.full((20, 16, 16), -3, dtype=np.int16), "holds integers in [-3, -3]"),
    }
    for name, (array, needle) in cases.items():
        np.savez(tmp_path / name, images=array)
        with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            load(source="npz", path=tmp_path / name)
    huge = tmp_path / "huge.npz"  # a header promising 10^13 pixels: refused before any of them is read
    with zipfile.ZipFile(huge, "w") as z, z.open("images.npy", "w") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "|u1", "fortran_order": False, "shape": (10**7, 10**3, 10**3)}
        )
    need = f"{10**13 * (1 + 8) / 2**30:,.1f} GiB"  # a byte a pixel, and 8 more for the conversion
    with pytest.raises(UserError, match=rf"array 'images' of .*\(10000000, 1000, 1000\) uint8, need about {need}"):
        load(source="npz", path=huge)
    np.savez(tmp_path / "objects.npz", images=np.array([{"a": 1}] * 3, dtype=object))
    with pytest.raises(UserError, match="is not a readable .npz archive"):
        load(source="npz", path=tmp_path / "objects.npz")

    header = bytes([0, 0, 8, 3]) + (20).to_bytes(4, "big") + (16).to_bytes(4, "big") * 2
    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / "train-images-idx3-ubyte").write_bytes(header + bytes(16 * 16 * 5))  # 5 of 20 images
    with pytest.raises(UserError, match="is not a readable idx image file"):
        load(source="idx", path=idx)
    (idx / "train-images-idx3-ubyte").unlink()
    with gzip.open(idx / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(header + bytes(16 * 16 * 20))
    (idx / "train-images-idx3-ubyte.gz").write_bytes((idx / "train-images-idx3-ubyte.gz").read_bytes()[:40])
    with pytest.raises(UserError, match="is not a readable idx image file"):
        load(source="idx", path=idx)
    labels = bytes([0, 0, 8, 1]) + (20).to_bytes(4, "big") + bytes(20)  # a labels file named like images
    (idx / "train-images-idx3-ubyte.gz").unlink()
    (idx / "train-images-idx3-ubyte").write_bytes(labels)
    with pytest.raises(UserError, match="is not a readable idx image file"):
        load(source="idx", path=idx)


# ---- output paths --------------------------------------------------------------------------------------
def test_out_paths_that_cannot_be_written_are_refused_before_the_work(trained, tmp_path, capsys, monkeypatch):
    ckpt = trained / "last.pt"
    file = tmp_path / "file"
    file.write_text("mine")
    (tmp_path / "dir.png").mkdir()
    cases = [
        (tmp_path / "dir.png", "is a folder"),
        (file / "r.png", "is a file"),
        (tmp_path / "r.jpg", "must end in .png"),
    ]
    for out, needle in cases:
        assert needle in user_error(capsys, "reconstruct", "--checkpoint", ckpt, "--out", out), out
    assert file.read_text() == "mine"
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path and access(path, mode))  # read-only
    assert "permission denied" in user_error(capsys, "reconstruct", "--checkpoint", ckpt, "--out", tmp_path / "r.png")


def test_a_full_disk_while_writing_an_out_file_leaves_the_old_file_whole(trained, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.png"
    out.write_bytes(b"the old picture")
    FullDisk(monkeypatch, budget=100, match="r.png")
    line = user_error(capsys, "reconstruct", "--checkpoint", trained / "last.pt", "--out", out, "--n", "4")
    assert f"cannot write --out {out}: the disk is full" in line
    assert out.read_bytes() == b"the old picture" and sorted(p.name for p in tmp_path.iterdir()) == ["r.png"]
    monkeypatch.undo()
    code, stdout, _ = run_main(capsys, "reconstruct", "--checkpoint", trained / "last.pt", "--out", out, "--n", "4")
    assert code == 0 and Image.open(out).size[0] > 0


# ---- signals and usage -----------------------------------------------------------------------------------
SLOW_DATA = """
import sys, time
from vitmask.train import run
from vitmask.cli.entry import main
def slow(cfg):
    print("loading", flush=True)
    time.sleep(60)
run.load_labelled_splits = slow
sys.argv = ["vitmask", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("sig, code, moment", [(signal.SIGINT, 130, "import"), (signal.SIGTERM, 143, "data")])
def test_a_signal_at_start_up_or_during_data_loading_is_one_line_and_leaves_nothing(tmp_path, sig, code, moment):
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    run = tmp_path / "run"
    args = ["train", "--config", str(cfg), "--run-dir", str(run)]
    head = ["-m", "vitmask"] if moment == "import" else ["-c", SLOW_DATA]
    proc = subprocess.Popen(
        [sys.executable, *head, *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if moment == "import":
        time.sleep(0.3)  # the interpreter is up and importing torch
    else:
        assert proc.stdout.readline().strip() == "loading"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert f"stopped by {signal.Signals(sig).name}" in one_line(err)
    assert not run.exists()


SLOW_EVAL = """
import sys, time
from vitmask.evaluate import scores
from vitmask.cli.entry import main
batches = scores.eval_batches
def slow(*args, **kwargs):  # the model takes a minute over each batch
    for batch in batches(*args, **kwargs):
        print("evaluating", flush=True)
        time.sleep(60)
        yield batch
scores.eval_batches = slow
sys.argv = ["vitmask", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_eval_is_one_line_and_leaves_no_partial_report(trained, tmp_path, sig, code):
    before = snapshot(trained)
    args = ["eval", "--checkpoint", str(trained / "last.pt"), "--split", "test"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_EVAL, *args], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout.readline() == b"evaluating\n"  # in the batch loop, the baselines fitted, the model scoring
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert f"stopped by {signal.Signals(sig).name}" in one_line(err.decode())  # no progress bar, no traceback
    assert out == b""  # no half a report
    assert snapshot(trained) == before and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("buffered", [True, False])
def test_a_closed_stdout_ends_eval_quietly_with_the_status_of_sigpipe(trained, tmp_path, buffered):
    # buffered: the report is written when the command is over; unbuffered: each print fails inside the command
    env = {k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"} | ({} if buffered else {"PYTHONUNBUFFERED": "1"})
    read, write = os.pipe()
    os.close(read)  # the reader is gone before vitmask writes a byte (`vitmask eval | head -c 0`, a closed pager)
    try:
        res = subprocess.run(
            [sys.executable, "-m", "vitmask", "eval", "--checkpoint", str(trained / "last.pt"), "--split", "test"],
            cwd=tmp_path,
            env=env,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (res.returncode, res.stderr) == (128 + signal.SIGPIPE, "")  # 141, as the shell shows `yes | head -1`


def test_a_closed_stdout_ends_every_verb_and_its_help_quietly(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # put back after: the parser wraps both streams on EPIPE
    cfg = write_config(tmp_path / "c.yaml")
    verbs = [c.name or c.callback.__name__ for c in commands.app.registered_commands]
    for args in [["--help"], *([v, "--help"] for v in verbs), ["config", "--config", cfg], ["count-params", "-c", cfg]]:
        read, write = os.pipe()
        os.close(read)  # the reader is gone; line-buffered, so the first line fails inside the command
        with open(write, "w", buffering=1) as stdout:
            monkeypatch.setattr(sys, "stdout", stdout)
            code, _, err = run_main(capsys, *args)
        assert (code, err) == (128 + signal.SIGPIPE, ""), args


def test_paths_the_file_system_refuses_are_one_line(trained, tmp_path, capsys):
    long = "x" * 300  # longer than any file name may be
    assert long in user_error(capsys, "eval", "--checkpoint", f"{long}.pt")
    assert long in user_error(capsys, "reconstruct", "--checkpoint", trained / "last.pt", "--out", f"{long}.png")
    assert long in user_error(capsys, "train", "--config", write_config(tmp_path / "c.yaml"), "--run-dir", long)
    line = user_error(
        capsys,
        "train",
        "--config",
        tmp_path / "c.yaml",
        "--run-dir",
        tmp_path / "r",
        "--set",
        "data.source=npz",
        "--set",
        f"data.path={long}",
    )
    assert "cannot read the npz data under data.path" in line and not (tmp_path / "r").exists()


def test_vitmask_without_a_command_names_the_commands(capsys):
    line = user_error(capsys)
    assert "no command given; use one of train, eval, " in line
    assert all(f" {c.name or c.callback.__name__}" in line for c in commands.app.registered_commands)


def test_a_closed_stdout_stops_training_like_a_signal_with_a_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    cfg = write_config(
        tmp_path / "c.yaml", {"train": {"max_steps": 6, "eval_every": 6, "checkpoint_every": 6, "log_every": 2}}
    )
    run = tmp_path / "run"
    read, write = os.pipe()
    os.close(read)  # `vitmask train ... | head -1` after head has gone: the first log line (step 2) fails
    with open(write, "w", buffering=1) as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        code, _, err = run_main(capsys, "train", "--config", cfg, "--run-dir", run)
    line = one_line(err)
    assert code == 128 + signal.SIGPIPE, err
    assert f"stopped by SIGPIPE at step 2; checkpoint written to {run / 'last.pt'}" in line and "--resume auto" in line
    assert load_checkpoint(run / "last.pt")["step"] == 2  # not due before step 6: written because of the stop
    monkeypatch.undo()
    code, out, err = run_main(capsys, "train", "--run-dir", run, "--resume", "auto")
    assert code == 0, err
    assert "from step 2" in out and load_checkpoint(run / "last.pt")["step"] == 6
