"""A run you can leave overnight: exact resume after SIGKILL, signals, kills mid-save, NaN, rotation, TensorBoard."""

import dataclasses
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from vitmask.config import load_config
from vitmask.data.batches import load_splits
from vitmask.errors import UserError
from vitmask.store.checkpoint import load_checkpoint
from vitmask.train.loggers import TensorBoardLogger
from vitmask.train.trainer import Trainer

from .conftest import ROOT, run_cli, write_config

ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


pytestmark = pytest.mark.usefixtures("one_thread")


def run1(*args) -> subprocess.CompletedProcess:
    return run_cli(*args, env={"OMP_NUM_THREADS": "1"})


def start(*args, script: str | None = None) -> subprocess.Popen:
    """Start `python -m vitmask ARGS` (or `python -c script ARGS`) with stdout piped line by line."""
    head = ["-c", script] if script else ["-m", "vitmask"]
    return subprocess.Popen(
        [sys.executable, *head, *map(str, args)],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 120) -> str:
    """Read stdout until a line starting with `prefix`; fail if the process ends first."""
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
        assert time.monotonic() < deadline, f"no line starting {prefix!r} in time"
    raise AssertionError(f"process ended (rc {proc.wait()}) before a line starting {prefix!r}: {proc.stderr.read()}")


def train_in_process(config_path: Path, run_dir: Path) -> None:
    """What `vitmask train --config C --run-dir R` does, without starting a process."""
    cfg = load_config(config_path)
    run_dir.mkdir()
    Trainer(cfg, load_splits(cfg), torch.device("cpu")).fit(run_dir, progress=False)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def test_sigkill_then_resume_ends_bit_identical_to_an_unbroken_run(tmp_path):
    n, k = 20, 3
    cfg = write_config(
        tmp_path / "c.yaml",
        {
            "data": {"batch_size": 64},
            "train": {
                "max_steps": 2 * n,
                "checkpoint_every": n,
                "eval_every": n,
                "log_every": 1,
                "deterministic": True,
                "optimizer": "adamw",
                "weight_decay": 0.01,
                "schedule": "cosine",
                "warmup_steps": 5,
                "grad_clip": 1.0,
                "ema_decay": 0.9,
            },
            "model": {"dropout": 0.1},  # so every step draws from the torch RNG too
        },
    )
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    train_in_process(cfg, whole)  # the unbroken run

    proc = start("train", "--config", cfg, "--run-dir", broken, "--device", "cpu")
    wait_for_line(proc, f"step {n + k}/")
    proc.send_signal(signal.SIGKILL)  # a real kill: no handler runs
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert load_checkpoint(broken / "last.pt")["step"] == n, "the kill must land between checkpoints"

    res = run1("train", "--run-dir", broken, "--resume", "auto", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    assert f"from step {n}" in res.stdout
    a, b = weights(whole / "last.pt"), weights(broken / "last.pt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ema_a, ema_b = (torch.load(run / "last.pt", weights_only=True)["ema"] for run in (whole, broken))
    assert ema_a.keys() == a.keys()
    for key in ema_a:  # the EMA of the weights too
        assert torch.equal(ema_a[key], ema_b[key]), key
    assert load_checkpoint(broken / "last.pt")["step"] == 2 * n


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_finishes_the_step_writes_a_checkpoint_and_says_how_to_resume(tmp_path, sig, code):
    cfg = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 100000, "log_every": 1, "eval_every": 100000}})
    run = tmp_path / "run"
    proc = start("train", "--config", cfg, "--run-dir", run, "--device", "cpu")
    wait_for_line(proc, "step 5/")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    name = signal.Signals(sig).name
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"stopped by {name} at step" in lines[0] and f"{run}/last.pt" in lines[0]
    assert f"vitmask train --run-dir {run} --resume auto" in lines[0]
    stopped = int(lines[0].split(" at step ")[1].split(";")[0])
    assert stopped >= 5
    assert load_checkpoint(run / "last.pt")["step"] == stopped
    if sig == signal.SIGTERM:  # and the printed command really resumes it
        res = run1("train", "--run-dir", run, "--resume", "auto", "--set", f"train.max_steps={stopped + 2}")
        assert res.returncode == 0, res.stderr
        assert f"from step {stopped}" in res.stdout
        assert load_checkpoint(run / "last.pt")["step"] == stopped + 2


SLOW_SAVE = """
import os, sys, time
from vitmask.cli import commands
def stuck_fsync(fd):
    print("saving", flush=True)
    time.sleep(120)
os.fsync = stuck_fsync  # every checkpoint write now hangs after writing its temp file, before os.replace
commands.main(sys.argv[1:])
"""


def test_a_kill_during_a_save_leaves_every_checkpoint_intact(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 15, "checkpoint_every": 15, "eval_every": 15}})
    run = tmp_path / "run"
    train_in_process(cfg, run)
    before = {p.name: p.read_bytes() for p in run.glob("*.pt")}
    assert {"last.pt", "best.pt", "step_0000015.pt"} <= set(before)

    proc = start("train", "--run-dir", run, "--resume", "auto", "--set", "train.max_steps=30", script=SLOW_SAVE)
    wait_for_line(proc, "saving")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    temps = list(run.glob(".*.tmp-*"))
    assert temps, "the kill should have caught a save half-way"
    after = {p.name: p.read_bytes() for p in run.glob("*.pt")}
    assert after == before  # nothing half-written, nothing lost
    assert load_checkpoint(run / "last.pt")["step"] == 15

    res = run1("train", "--run-dir", run, "--resume", "auto", "--set", "train.max_steps=30")
    assert res.returncode == 0, res.stderr
    assert not list(run.glob(".*.tmp-*"))  # the stale temp files are cleaned up on resume
    assert load_checkpoint(run / "last.pt")["step"] == 30


def test_a_nan_loss_names_its_step_and_no_checkpoint_follows_it(tmp_path):
    cfg = load_config(
        write_config(
            tmp_path / "c.yaml", {"train": {"max_steps": 30, "checkpoint_every": 5, "log_every": 10, "eval_every": 50}}
        )
    )
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    sample = trainer.sampler.sample
    calls = []

    def poisoned():
        batch = sample()
        calls.append(1)
        if len(calls) == 13:  # the batch of step 13 carries NaN pixels
            batch.patches.fill_(float("nan"))
        return batch

    trainer.sampler.sample = poisoned
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(UserError, match=r"NaN or inf at step 13\b"):
        trainer.fit(run, progress=False)
    assert trainer.step == 15  # caught before the step-15 checkpoint, the first write after the bad step
    assert sorted(p.name for p in run.glob("step_*.pt")) == ["step_0000005.pt", "step_0000010.pt"]
    good = load_checkpoint(run / "last.pt")
    assert good["step"] == 10
    assert all(torch.isfinite(v).all() for v in good["model"].values())


def test_checkpoints_rotate_and_last_points_at_the_newest(tmp_path):
    cfg = load_config(
        write_config(
            tmp_path / "c.yaml", {"train": {"max_steps": 20, "checkpoint_every": 4, "keep_last": 2, "eval_every": 10}}
        )
    )
    run = tmp_path / "run"
    run.mkdir()
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    trainer.fit(run, progress=False)
    assert sorted(p.name for p in run.glob("step_*.pt")) == ["step_0000016.pt", "step_0000020.pt"]
    assert (run / "last.pt").read_bytes() == (run / "step_0000020.pt").read_bytes()
    state = load_checkpoint(run / "last.pt")
    assert set(state) >= {"model", "optimizer", "scheduler", "scaler", "sampler", "rng", "step", "best_val_loss"}
    assert set(state["rng"]) >= {"torch", "python", "numpy"}
    n = len(trainer.sampler.images)  # the 512 shapes less repeats
    assert state["sampler"] == {"seed": 1, "epoch": 20 * 32 // n, "position": 20 * 32 % n, "step": 20}
    assert state["scheduler"]["last_epoch"] == 20
    best = load_checkpoint(run / "best.pt")
    assert best["best_val_loss"] == min(best["best_val_loss"], state["best_val_loss"])
    (run / "last.pt").unlink()  # --resume auto falls back to the newest step file
    res = run1("train", "--run-dir", run, "--resume", "auto", "--set", "train.max_steps=21")
    assert res.returncode == 0, res.stderr
    assert "from step 20" in res.stdout


def test_tensorboard_gets_every_scalar_the_grid_and_hparams(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    cfg = load_config(write_config(tmp_path / "c.yaml", {"train": {"max_steps": 10, "log_every": 5, "eval_every": 5}}))
    run = tmp_path / "run"
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"), logger=TensorBoardLogger(run))
    trainer.fit(run, progress=False)
    trainer.close()
    seen: dict[str, list[int]] = {}  # tag -> steps
    plugins: dict[str, str] = {}  # tag -> plugin
    image = None
    for path in run.rglob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            for v in event.summary.value:
                seen.setdefault(v.tag, []).append(event.step)
                if v.metadata.plugin_data.plugin_name:
                    plugins[v.tag] = v.metadata.plugin_data.plugin_name
                if v.tag == "val/reconstruction":
                    image = v
    for name in ("loss", "acc", "acc_nonempty", "bit_acc", "lr", "grad_norm", "images_per_s"):
        assert seen.get(f"train/{name}") == [5, 10], name
    for name in ("loss", "acc", "acc_nonempty"):
        assert seen.get(f"val/{name}") == [5, 10], name
    assert seen["val/reconstruction"] == [5, 10]  # a grid at every evaluation
    assert plugins["val/reconstruction"] == "images"
    width, height, png = image.tensor.string_val  # how TensorBoard stores an image
    assert png.startswith(b"\x89PNG")
    assert int(height) == 4 * 16 + 5 * 2  # four rows of 16-pixel images, 2-pixel padding
    assert int(width) == 8 * 16 + 9 * 2  # the eight fixed val images
    assert "hparams" in plugins.values()  # the hparams session, with the final metrics beside it
    assert seen["hparam/val_loss"] == seen["hparam/best_val_loss"] == [10]  # the final metrics, at the last step


def uniform_image(k: int, size: int = 8) -> torch.Tensor:
    """A (size, size) image whose every 2x2 patch is class k: [[a, b], [c, d]] is 8a + 4b + 2c + d."""
    bits = torch.tensor([[(k >> 3) & 1, (k >> 2) & 1], [(k >> 1) & 1, k & 1]], dtype=torch.uint8)
    return bits.repeat(size // 2, size // 2)  # (size, size)


def test_tensorboard_holds_the_hand_counted_values_and_the_grid_pixel_for_pixel(tmp_path):
    """What the event file holds, read back with TensorBoard's own reader: train/ scalars equal to the
    hand counts of tests/test_train_metrics.py, val/ scalars counted by hand on val images whose
    patches are all one class, and the reconstruction grid equal to the picture written out pixel by
    pixel (tests/test_render.py) for a model that predicts class 15 everywhere."""
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, EventAccumulator

    from tests.test_render import reference_picture
    from tests.test_train_metrics import CFG, LN3, LN6, LN18, A, B

    cfg = dataclasses.replace(CFG, train=dataclasses.replace(CFG.train, eval_every=2))  # val at steps 2 and 3
    kinds = [15, 0, 9, 6, 15, 0, 10, 0]  # one class per val image: what a masked patch is does not depend on the mask
    val = torch.stack([uniform_image(k) for k in kinds])  # (8, 8, 8)
    blank = torch.zeros(4, 8, 8, dtype=torch.uint8)
    run = tmp_path / "run"
    trainer = Trainer(cfg, {"train": blank, "val": val}, torch.device("cpu"), logger=TensorBoardLogger(run))
    with torch.no_grad():  # every logit is the head's bias: 0, and ln 3 for class 15 (so 15 is predicted)
        trainer.model.head.weight.zero_()
        trainer.model.head.bias.zero_()
        trainer.model.head.bias[15] = LN3
    trainer.sampler.sample = iter([A, A, B]).__next__  # lr 1e-9: the prediction stays 15 throughout
    trainer.fit(progress=False)
    trainer.close()

    events = EventAccumulator(str(run), size_guidance={SCALARS: 0, IMAGES: 0})
    events.Reload()
    scalar = lambda tag: [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars(tag)]  # noqa: E731
    # train/: window 1 (steps 1-2, batch A twice) and window 2 (step 3, batch B), as counted in test_train_metrics
    assert scalar("train/acc") == [(2, 2 / 8), (3, 1 / 8)]
    assert scalar("train/acc_nonempty") == [(2, 2 / 5), (3, 1 / 3)]
    assert scalar("train/bit_acc") == [(2, 13 / 32), (3, 6 / 32)]
    assert scalar("train/loss") == [(2, (6 * LN18 + 2 * LN6) / 8), (3, (7 * LN18 + LN6) / 8)]
    assert scalar("train/lr") == [(2, 1e-9), (3, 1e-9)]
    # val/: every image hides 4 of its 16 patches, all of its one class. Right: the two class-15 images
    # (2 of 8); non-empty images: 15, 9, 6, 15, 10 (2 of 5); pixels right against 1111: the 1 bits of
    # 15, 0, 9, 6, 15, 0, 10, 0 = 4+0+2+2+4+0+2+0 = 14 of 32; loss ln 6 on the 15s, ln 18 elsewhere
    for step in (2, 3):
        assert (step, 2 / 8) in scalar("val/acc")
        assert (step, 2 / 5) in scalar("val/acc_nonempty")
        assert (step, 14 / 32) in scalar("val/bit_acc")
        assert (step, (2 * LN6 + 6 * LN18) / 8) in scalar("val/loss")

    grids = events.Images("val/reconstruction")
    assert [g.step for g in grids] == [2, 3]
    assert grids[0].encoded_image_string == grids[1].encoded_image_string  # fixed images, fixed masks
    got = np.asarray(Image.open(io.BytesIO(grids[1].encoded_image_string)).convert("RGB")).astype(int)  # (H', W', 3)
    assert got.shape == (4 * (8 + 2) + 2, 8 * (8 + 2) + 2, 3)  # rows: original, masked, predicted, errors
    # the masks, read off the masked-input row (grey 0.5 = 127 or 128): M = round(0.25 * 16) = 4 per image
    masked_row = got[2 + 10 : 2 + 10 + 8]  # (8, W', 3)
    mask = torch.zeros(8, 16, dtype=torch.bool)
    for col in range(8):
        cell = masked_row[:, 2 + col * 10 : 2 + col * 10 + 8]  # (8, 8, 3)
        grey = (np.abs(cell - 127.5) <= 1).all(-1)  # (8, 8)
        patches = grey.reshape(4, 2, 4, 2).transpose(0, 2, 1, 3).reshape(16, 4)  # (16 patches, 4 pixels)
        assert (patches.all(1) | ~patches.any(1)).all(), "a patch is grey as a whole or not at all"
        mask[col] = torch.from_numpy(patches.all(1))
    assert mask.sum(1).tolist() == [4] * 8
    want = reference_picture(val, mask, torch.full((8, 16), 15), 2, scale=1)
    assert np.abs(got - want).max() <= 1  # TensorBoard truncates to uint8 where the reference rounds
    # class 15 pasted over empty patches: spurious pixels, orange, in the error row
    assert (got[2 + 30 : 2 + 38] == [255, 153, 0]).all(-1).any()


def test_last_pt_is_a_hard_link_to_the_newest_step_file(tmp_path):
    cfg = load_config(
        write_config(
            tmp_path / "c.yaml", {"train": {"max_steps": 6, "checkpoint_every": 2, "keep_last": 2, "eval_every": 6}}
        )
    )
    run = tmp_path / "run"
    run.mkdir()
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    save, seen = trainer._save, []

    def save_and_look(checkpointer):  # after every checkpoint: which file is last.pt?
        path = save(checkpointer)
        newest = run / f"step_{trainer.step:07d}.pt"
        seen.append((os.stat(path).st_ino, os.stat(newest).st_ino, os.stat(newest).st_nlink))
        return path

    trainer._save = save_and_look
    trainer.fit(run, progress=False)
    assert len(seen) == 3  # steps 2, 4, 6
    for last_inode, newest_inode, links in seen:
        assert last_inode == newest_inode  # the same file, not a copy
        assert links == 2  # step_<step>.pt and last.pt
    assert len({inode for inode, _, _ in seen}) == 3  # each save points last.pt at the new file
    assert os.stat(run / "last.pt").st_ino == os.stat(run / "step_0000006.pt").st_ino
    assert os.stat(run / "step_0000004.pt").st_nlink == 1  # the older step file is no longer linked
