"""Hostile input, round three: paths that would write over what a command reads, links where
vitmask keeps its own files, a closed stdout, link loops, unbounded counts, changed checkpoint
bytes, numbers out of range, deep YAML, a .npy as npz, failed resumes, and the subtle rules (the
lock replaced under it, the NLL strata weights, the probe's fit from train and val only).

Each hostile input ends in one line on stderr and exit code 2 (or one warning line and success),
with nothing left behind or overwritten. Most run in process (`commands.main`); a closed stdout
needs a real process.
"""

import errno
import fcntl
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import ROOT, run_main, write_config
from vitmask.cli import verbs
from vitmask.errors import UserError
from vitmask.evaluate import likelihood, probe
from vitmask.outputs import write_bytes
from vitmask.store import rundir
from vitmask.store.checkpoint import (
    CHECKSUM_TAIL,
    END_RECORD,
    ChecksumMismatch,
    load_checkpoint,
    save_checkpoint,
    verify_checksum,
    write_checkpoint_file,
)
from vitmask.train import loggers
from vitmask.train import run as training_run

SHORT = {"train": {"max_steps": 4, "eval_every": 2, "checkpoint_every": 2, "log_every": 2}}
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 4-step run of shapes (checkpoints at steps 2 and 4); copy it to change it."""
    root = tmp_path_factory.mktemp("trained")
    run_dir, _ = verbs.train(write_config(root / "c.yaml", SHORT), [], root / "run", None, "cpu")
    return run_dir


def one_error(capsys, *args) -> str:
    """Run `vitmask ARGS` in process; assert exit 2 and one line on stderr, no traceback; return it."""
    code, _, err = run_main(capsys, *args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    return lines[0]


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.is_symlink()}


def image_folder(root: Path, n: int = 12) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir()
    for i in range(n):
        Image.fromarray((rng.random((16, 16)) > 0.5).astype(np.uint8) * 255).save(root / f"{i}.png")
    return root


# ---- paths: every --out against every file read; links in the run dir ---------------------------------
def test_an_out_naming_a_dataset_file_directly_or_through_a_link_is_refused(tmp_path, capsys):
    data = image_folder(tmp_path / "imgs", 40)
    (data / "deep").mkdir()
    Image.fromarray(np.full((16, 16), 255, np.uint8)).save(data / "deep" / "x.png")  # read too: folders recurse
    before = {**files_of(data), "deep": (data / "deep" / "x.png").read_bytes()}
    cfg = write_config(tmp_path / "c.yaml", {**SHORT, "data": {"source": "folder", "path": str(data), "batch_size": 8}})
    (tmp_path / "link.png").symlink_to(data / "3.png")
    for out in (data / "0.png", tmp_path / "link.png", data / "deep" / "x.png"):
        line = one_error(capsys, "preview", "--config", cfg, "--out", out)
        assert f"--out {out} is a file of the data folder {data}, which the command reads" in line
    named_png = write_config(tmp_path / "config.png")  # a config under a .png name: the --out would replace it
    assert "is the input file" in one_error(capsys, "preview", "--config", named_png, "--out", named_png)
    ckpt = tmp_path / "run"
    verbs.train(cfg, [], ckpt, None, "cpu")
    line = one_error(capsys, "reconstruct", "--checkpoint", ckpt / "last.pt", "--out", data / "5.png")
    assert f"is a file of the data folder {data}" in line
    npz = tmp_path / "d.npz"
    np.savez(npz, images=np.zeros((20, 16, 16), np.uint8))
    line = one_error(
        capsys, "preview", "--config", cfg, "--set", "data.source=npz", "--set", f"data.path={npz}", "--out", npz
    )
    assert "must end in .png" in line
    png_npz = tmp_path / "d.png"  # an npz under a .png name: the --out would replace it
    npz.rename(png_npz)
    line = one_error(
        capsys,
        "preview",
        "--config",
        cfg,
        "--set",
        "data.source=npz",
        "--set",
        f"data.path={png_npz}",
        "--out",
        png_npz,
    )
    assert "is the input file" in line
    assert {**files_of(data), "deep": (data / "deep" / "x.png").read_bytes()} == before
    code, _, err = run_main(capsys, "preview", "--config", cfg, "--out", data / "new.png")  # a new file is no input
    assert code == 0, err


def test_a_lock_or_an_own_file_that_is_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's")
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    for name in (rundir.LOCK_NAME, "config.yaml", "last.pt", "events.out.tfevents.1.host.2.0"):
        run = tmp_path / f"run-{name}"
        run.mkdir()
        (run / name).symlink_to(victim)
        line = one_error(capsys, "train", "--config", cfg, "--run-dir", run)
        assert f"{name} is a symbolic link" in line and "remove the link, or pick another --run-dir" in line
        assert victim.read_text() == "someone else's" and (run / name).is_symlink()  # neither written nor removed


def test_a_temp_file_planted_as_a_link_is_not_written_through(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    out = tmp_path / "out.txt"
    monkeypatch.setattr(os, "getpid", lambda: 4242)  # the temp name an attacker would predict
    (tmp_path / ".out.txt.tmp-4242.txt").symlink_to(victim)
    write_bytes(out, b"mine")
    assert out.read_bytes() == b"mine" and victim.read_text() == "keep"
    assert not (tmp_path / ".out.txt.tmp-4242.txt").exists()


def test_the_lock_file_replaced_between_open_and_lock_is_locked_anew(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    lock = run / rundir.LOCK_NAME
    real = fcntl.flock
    calls = []

    def replace_first(fd, op):  # someone swaps the file at the path after our open, before our lock
        calls.append(os.fstat(fd).st_ino)
        if len(calls) == 1:
            lock.unlink()
            lock.write_text("swapped\n")
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", replace_first)
    with rundir.RunDir(run, fresh=True):
        assert len(calls) == 2 and calls[1] == lock.stat().st_ino  # the second lock is on the file at the path
        assert lock.read_text() == f"{os.getpid()}\n"
        monkeypatch.setattr(fcntl, "flock", real)
        with pytest.raises(UserError, match=rf"in use by another vitmask process \(pid {os.getpid()}\)"):
            with rundir.RunDir(run, fresh=False):
                pass

    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    calls.clear()

    def link_first(fd, op):  # ... or swaps it for a link to someone's file
        calls.append(fd)
        if len(calls) == 1:
            lock.unlink()
            lock.symlink_to(victim)
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", link_first)
    with pytest.raises(UserError, match="is a symbolic link, where vitmask keeps its lock file"):
        with rundir.RunDir(run, fresh=False):
            pass
    assert victim.read_text() == "keep" and lock.is_symlink()


def test_a_lock_with_another_hard_link_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    os.link(victim, run / rundir.LOCK_NAME)
    with pytest.raises(UserError, match="has other hard links"):
        with rundir.RunDir(run, fresh=False):
            pass
    assert victim.read_text() == "keep"


# ---- the process: a closed stdout, link loops, bounds ------------------------------------------------
def test_a_closed_stdout_is_one_line_and_nothing_is_made(trained, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    for args in (
        ["eval", "--checkpoint", trained / "last.pt"],
        ["sample", "--checkpoint", trained / "last.pt", "--out", tmp_path / "s.png", "--n", "1"],
        ["train", "--config", cfg, "--run-dir", tmp_path / "run"],
    ):
        res = subprocess.run(
            [sys.executable, "-m", "vitmask", *map(str, args)],
            cwd=tmp_path,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            preexec_fn=lambda: os.close(1),  # `vitmask ... >&-`
        )
        lines = res.stderr.splitlines()
        assert res.returncode == 2 and len(lines) == 1 and "stdout is closed" in lines[0], (args, res.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a file every write to fails)")
@pytest.mark.parametrize(
    "args, code",
    [
        (["sample", "--checkpoint", "missing.pt", "--out", "s.png"], 2),  # bad input
        (["sample", "--no-such-option"], 2),  # a usage error
        (["models"], 0),
    ],
)
def test_a_stderr_that_cannot_be_written_leaves_the_exit_code_as_documented(tmp_path, args, code):
    """`vitmask ... 2>/dev/full`: the error line cannot be written (as on a full disk, or a pipe whose
    reader is gone), and the exit code still says what happened: 2 for bad input, not 1."""
    with open("/dev/full", "w") as full:
        res = subprocess.run(
            [sys.executable, "-m", "vitmask", *args], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=full,
            timeout=300,
        )  # fmt: skip
    assert res.returncode == code
    assert list(tmp_path.iterdir()) == []


def test_a_loop_of_symbolic_links_is_one_line_wherever_a_path_goes(trained, tmp_path, capsys):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.symlink_to(b)
    b.symlink_to(a)
    ckpt = trained / "last.pt"
    out = tmp_path / "o.png"
    assert f"--out {a} is a loop of symbolic links" in one_error(capsys, "sample", "--checkpoint", ckpt, "--out", a)
    assert "--out" in one_error(capsys, "reconstruct", "--checkpoint", ckpt, "--out", a)
    line = one_error(capsys, "inpaint", "--checkpoint", ckpt, "--image", a, "--box", "0,0,4,4", "--out", out)
    assert f"--image {a} is a loop of symbolic links" in line
    assert "loop of symbolic links" in one_error(capsys, "eval", "--checkpoint", a)
    assert not out.exists()


def test_nll_draws_are_bounded_in_one_line(trained, capsys):
    line = one_error(capsys, "eval", "--checkpoint", trained / "last.pt", "--nll", "--nll-samples", 2**63 - 1)
    assert f"must be at most {likelihood.MAX_NLL_DRAWS:,} draws per image" in line
    with pytest.raises(UserError, match="--nll-samples 4096 or fewer"):
        likelihood.check_nll_args(64, 16, 16, 4097)
    likelihood.check_nll_args(64, 16, 16, 4096)  # the bound itself is allowed


def test_preview_count_beyond_one_grid_is_clamped_with_a_note(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", {"data": {"num_train": 40}})
    code, out, err = run_main(capsys, "preview", "--config", cfg, "--count", 100000, "--out", tmp_path / "p.png")
    assert code == 0, err
    notes = err.splitlines()
    assert notes[0].startswith("vitmask: warning: --count 100000 is more than one PNG grid holds (256 images")
    assert notes[1].startswith("vitmask: warning: --count 256 is more than the ") and len(notes) == 2
    train = int(next(ln.split()[1].replace(",", "") for ln in out.splitlines() if ln.startswith("train ")))
    width, height = Image.open(tmp_path / "p.png").size
    cell = 16 * 4 + 2  # image side x scale + padding
    assert width == 8 * cell + 2 and height == 2 * math.ceil(train / 8) * cell + 2  # every train image shown


# ---- checkpoint integrity ----------------------------------------------------------------------------
def flipped(src: Path, dst: Path, at: int) -> Path:
    data = bytearray(src.read_bytes())
    data[at] ^= 0x01
    dst.write_bytes(bytes(data))
    return dst


def test_a_checkpoint_with_one_byte_changed_is_refused_by_every_verb(trained, tmp_path, capsys):
    bad = flipped(trained / "last.pt", tmp_path / "bad.pt", (trained / "last.pt").stat().st_size // 2)
    assert torch.load(bad, weights_only=True)["step"] == 4  # torch alone reads it, weights changed
    image = tmp_path / "i.png"
    Image.fromarray(np.zeros((16, 16), np.uint8)).save(image)
    commands_ = [
        ["eval", "--checkpoint", bad],
        ["probe", "--checkpoint", bad],
        ["count-params", "--checkpoint", bad],
        ["reconstruct", "--checkpoint", bad, "--out", tmp_path / "r.png"],
        ["sample", "--checkpoint", bad, "--out", tmp_path / "s.png"],
        ["inpaint", "--checkpoint", bad, "--image", image, "--box", "0,0,4,4", "--out", tmp_path / "f.png"],
        ["train", "--resume", bad, "--run-dir", tmp_path / "run"],
    ]
    for args in commands_:
        line = one_error(capsys, *args)
        assert f"checkpoint {bad} is damaged: its bytes changed after it was written" in line, args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt", "i.png"]


def test_resume_auto_passes_over_a_changed_last_pt_with_one_warning(trained, tmp_path, capsys):
    import shutil

    run = Path(shutil.copytree(trained, tmp_path / "run"))
    flipped(trained / "last.pt", run / "last.pt", (run / "last.pt").stat().st_size // 3)
    code, out, err = run_main(capsys, "train", "--run-dir", run, "--resume", "auto", "--set", "train.max_steps=5")
    assert code == 0, err
    (warning,) = err.splitlines()
    assert "last.pt cannot be used" in warning and "its bytes changed" in warning and "step_0000004.pt" in warning


def test_the_checksum_covers_every_byte_of_the_file(tmp_path):
    state = {"format": "vitmask-checkpoint/1", "model": {"w": torch.arange(6.0), "b": torch.ones(2)}, "config": {}}
    path = write_checkpoint_file(state, tmp_path / "small.pt")
    data = path.read_bytes()
    assert verify_checksum(data) is True
    for at in range(len(data)):  # every single bit flip, wherever it is, is found
        changed = bytearray(data)
        changed[at] ^= 0x04
        with pytest.raises(ChecksumMismatch):
            verify_checksum(bytes(changed))
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.arange(6.0))


def test_the_checksum_is_right_from_the_mapped_file_and_from_the_file_read_in_pieces(trained, tmp_path, monkeypatch):
    from vitmask.store import checkpoint

    state = load_checkpoint(trained / "last.pt")
    state.pop("format")
    mapped = save_checkpoint(state, tmp_path / "mapped.pt").read_bytes()

    def no_map(*args, **kwargs):  # a file system that cannot map files: the file is read instead
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(checkpoint.mmap, "mmap", no_map)
    monkeypatch.setattr(checkpoint, "READ_CHUNK", 4096)  # in many reads, as a file over 2 GiB is
    read = save_checkpoint(state, tmp_path / "read.pt").read_bytes()
    assert verify_checksum(mapped) is True and verify_checksum(read) is True  # each digest checked anew
    assert len(read) > 10 * 4096


def test_an_old_checkpoint_without_checksum_loads_with_one_warning(trained, tmp_path, capsys):
    data = (trained / "last.pt").read_bytes()
    old = data[: -CHECKSUM_TAIL - 2] + b"\x00\x00"  # the file torch.save wrote, before the comment
    assert old[-22:-18] == END_RECORD
    (tmp_path / "old.pt").write_bytes(old)
    assert verify_checksum(old) is False
    code, out, err = run_main(capsys, "eval", "--checkpoint", tmp_path / "old.pt", "--json")
    assert code == 0 and '"results"' in out
    (warning,) = err.splitlines()
    assert warning.startswith(f"vitmask: warning: checkpoint {tmp_path / 'old.pt'} has no checksum")
    changed = bytearray(old)
    changed[len(old) // 2] ^= 0x01  # its records' CRC-32s still catch a change in the weights
    (tmp_path / "old.pt").write_bytes(bytes(changed))
    assert "its bytes changed" in one_error(capsys, "eval", "--checkpoint", tmp_path / "old.pt")


# ---- numbers and YAML ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**400])
def test_a_split_seed_out_of_range_is_one_line_from_yaml_set_and_a_checkpoint(trained, tmp_path, capsys, value):
    cfg = write_config(tmp_path / "c.yaml", {"data": {"split_seed": value}})
    for args in (["config"], ["preview", "--out", tmp_path / "p.png"], ["train", "--run-dir", tmp_path / "run"]):
        line = one_error(capsys, *args, "--config", cfg)
        assert "config: data.split_seed must be an integer in [-9223372036854775808, 18446744073709551613]" in line
    line = one_error(
        capsys, "config", "--config", write_config(tmp_path / "d.yaml"), "--set", f"data.split_seed={value}"
    )
    assert "data.split_seed must be an integer in" in line
    state = load_checkpoint(trained / "last.pt")
    state["config"]["data"]["split_seed"] = value
    save_checkpoint({k: v for k, v in state.items() if k != "format"}, tmp_path / "seed.pt")
    for verb in ("eval", "probe", "count-params"):
        line = one_error(capsys, verb, "--checkpoint", tmp_path / "seed.pt")
        assert "holds a config this version cannot use (config: data.split_seed must be an integer" in line


@pytest.mark.parametrize(
    "key", ["model.token_conv", "train.max_steps", "data.batch_size", "data.num_train", "train.keep_last"]
)
def test_an_integer_too_large_for_its_field_is_one_line(tmp_path, capsys, key):
    cfg = write_config(tmp_path / "c.yaml")
    line = one_error(capsys, "config", "--config", cfg, "--set", f"{key}={2**64 + 1}")
    assert f"config: {key} must be an integer in [-9223372036854775808, 9223372036854775807]" in line
    deep = tmp_path / "d.yaml"
    deep.write_text(f"{key.split('.')[0]}:\n  {key.split('.')[1]}: {2**64 + 1}\n")
    assert f"config: {key} must be an integer in" in one_error(capsys, "count-params", "--config", deep)


@pytest.mark.parametrize("key", ["train.lr", "data.val_fraction", "data.threshold"])
def test_an_integer_past_the_largest_float_is_one_line(tmp_path, capsys, key):
    line = one_error(capsys, "config", "--config", write_config(tmp_path / "c.yaml"), "--set", f"{key}={10**400}")
    assert f"config: {key} must be a finite number, got a number of about 401 digits" in line
    line = one_error(capsys, "config", "--config", tmp_path / "c.yaml", "--set", f"mask.block_aspect=[1, {10**400}]")
    assert "mask.block_aspect must be a finite number" in line


def test_a_token_conv_wider_than_the_grid_is_refused(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml")  # 16-pixel images of 2-pixel patches: an 8x8 grid
    assert "must be at most 2 * the grid's side - 1 (15)" in one_error(
        capsys, "config", "--config", cfg, "--set", "model.token_conv=17"
    )
    code, _, err = run_main(capsys, "config", "--config", cfg, "--set", "model.token_conv=15")
    assert code == 0, err


@pytest.mark.parametrize(
    "body",
    [
        "model: " + "[" * 3000 + "]" * 3000,
        "model:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(200)),
        "model: " + "{a: " * 3000 + "1" + "}" * 3000,
    ],
    ids=["lists", "maps", "flow-maps"],
)
def test_yaml_nested_thousands_deep_is_one_line(tmp_path, capsys, body):
    deep = tmp_path / "deep.yaml"
    deep.write_text(body)
    for args in (["config"], ["count-params"], ["train", "--run-dir", tmp_path / "run"]):
        line = one_error(capsys, *args, "--config", deep)
        assert f"bad YAML in {deep}: nested more than 32 levels deep" in line
    assert not (tmp_path / "run").exists()
    value = "[" * 3000 + "]" * 3000
    line = one_error(capsys, "config", "--config", write_config(tmp_path / "c.yaml"), "--set", f"model.depth={value}")
    assert "--set model.depth: nested more than 32 levels deep" in line


def test_a_config_file_too_large_is_one_line(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    big.write_text("seed: 0\n" + "# padding\n" * 200_000)
    assert "more than a config may be" in one_error(capsys, "config", "--config", big)


# ---- data, resumes, count-params, a full disk ---------------------------------------------------------
@pytest.mark.parametrize("name", ["images.npy", "images.npz"])
def test_a_plain_npy_as_npz_source_names_the_npy_source(tmp_path, capsys, name):
    path = tmp_path / name
    with open(path, "wb") as f:
        np.save(f, np.zeros((20, 16, 16), np.uint8))
    cfg = write_config(tmp_path / "c.yaml", {"data": {"source": "npz", "path": str(path)}})
    line = one_error(capsys, "preview", "--config", cfg, "--out", tmp_path / "p.png")
    assert f"{path} is a single NumPy array (.npy), not an .npz archive; set data.source: npy" in line
    assert "set data.source: npy" in one_error(capsys, "train", "--config", cfg, "--run-dir", tmp_path / "run")
    assert not (tmp_path / "run").exists() and not (tmp_path / "p.png").exists()


def extra_key_checkpoint(trained: Path, path: Path) -> Path:
    state = load_checkpoint(trained / "last.pt")
    state.pop("format")
    state["model"]["extra"] = torch.zeros(2)
    return save_checkpoint(state, path)


def test_a_refused_resume_into_a_new_run_dir_leaves_nothing_and_the_dir_is_free(trained, tmp_path, capsys):
    new = tmp_path / "new"
    cases = [
        (["--resume", trained / "last.pt", "--set", "model.hidden_dim=64"], "asks to change model.hidden_dim"),
        (["--resume", extra_key_checkpoint(trained, tmp_path / "extra.pt")], "unexpected: extra"),
    ]
    for args, needle in cases:
        assert needle in one_error(capsys, "train", "--run-dir", new, *args)
        assert not new.exists()
    new.mkdir()  # an empty dir the user made stays, and empty
    assert "unexpected: extra" in one_error(capsys, "train", "--run-dir", new, "--resume", tmp_path / "extra.pt")
    assert list(new.iterdir()) == []
    code, _, err = run_main(capsys, "train", "--config", write_config(tmp_path / "c.yaml", SHORT), "--run-dir", new)
    assert code == 0, err  # a fresh run there is not refused as "not empty"


def test_leftovers_go_after_a_failed_fresh_start_but_a_failed_resume_keeps_every_file(
    trained, tmp_path, capsys, monkeypatch
):
    import shutil

    def stop(self, run_dir):
        raise UserError("stop")

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "notes.txt").write_text("mine")
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    assert "already exists and is not empty" in one_error(capsys, "train", "--config", cfg, "--run-dir", fresh)
    (fresh / "notes.txt").unlink()
    monkeypatch.setattr(training_run.Trainer, "fit", stop)  # after config.yaml and the event file are written
    assert "stop" in one_error(capsys, "train", "--config", cfg, "--run-dir", fresh)
    assert list(fresh.iterdir()) == []  # config.yaml and the event file it wrote are gone

    run = Path(shutil.copytree(trained, tmp_path / "run"))
    (run / "events.out.tfevents.0.old.1.0").write_bytes(b"")  # even an empty file of the run stays
    before = files_of(run)
    assert "stop" in one_error(capsys, "train", "--run-dir", run, "--resume", "auto")
    after = files_of(run)
    assert {k: v for k, v in after.items() if k in before} == before  # config.yaml rewritten with the same text
    assert set(after) - set(before) <= {n for n in after if n.startswith("events.out.tfevents.")}


def test_a_full_disk_at_the_start_of_a_resumed_run_names_its_step_and_leaves_no_empty_file(
    trained, tmp_path, capsys, monkeypatch
):
    import shutil

    run = Path(shutil.copytree(trained, tmp_path / "run"))
    before = files_of(run)

    def full(run_dir):
        (Path(run_dir) / "events.out.tfevents.9.host.9.0").write_bytes(b"")  # created, then nothing fits
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(run_dir) / "events.out.tfevents.9.host.9.0"))

    monkeypatch.setattr(loggers, "TensorBoardLogger", full)
    line = one_error(capsys, "train", "--run-dir", run, "--resume", "auto", "--set", "train.max_steps=8")
    assert line.startswith("vitmask: error: training stopped at step 4: cannot write events.out.tfevents.9.host.9.0")
    assert f"the last checkpoint, {run / 'last.pt'} (step 4), is intact" in line
    assert files_of(run) == before  # no 0-byte event file, nothing else changed


def test_count_params_refuses_weights_that_are_not_the_model_its_config_describes(trained, tmp_path, capsys):
    line = one_error(capsys, "count-params", "--checkpoint", extra_key_checkpoint(trained, tmp_path / "x.pt"))
    assert "checkpoint does not fit this model (unexpected: extra)" in line
    state = load_checkpoint(trained / "last.pt")
    state.pop("format")
    state["config"]["model"]["ffn_dim"] = 128  # the weights are of ffn_dim 64
    save_checkpoint(state, tmp_path / "y.pt")
    assert "shape mismatch" in one_error(capsys, "count-params", "--checkpoint", tmp_path / "y.pt")
    code, out, err = run_main(capsys, "count-params", "--checkpoint", trained / "last.pt")
    assert code == 0 and "total" in out, err


# ---- the subtle rules: NLL strata weights, the probe's fit ----------------------------------------------
class HiddenCountModel(torch.nn.Module):
    """Logits [L(m), 0] for every patch of a row with m hidden patches, so a blank patch (class 0)
    costs softplus(-L(m)) nats; records each row's m."""

    def __init__(self, logit_by_count: dict[int, float]):
        super().__init__()
        self.logit = logit_by_count
        self.seen: list[int] = []

    def forward(self, patches: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # (B, N, P), (B, N)
        m = mask.sum(1).tolist()  # (B,)
        self.seen += m
        first = torch.tensor([self.logit[k] for k in m]).view(-1, 1).expand(-1, mask.shape[1])  # (B, N)
        return torch.stack([first, torch.zeros_like(first)], -1)  # (B, N, 2)


def test_the_nll_estimate_weights_each_stratum_by_its_size(capsys):
    logit = {1: 0.25, 2: -1.0, 3: 2.0, 4: 0.75}  # exact in float32  # four 1x1 patches, two classes
    model = HiddenCountModel(logit)
    n, strata, samples = 3, 3, 6
    assert likelihood.strata_edges(4, strata) == [0, 1, 3, 4]  # strata of sizes 1, 2 and 1
    est = likelihood.nll_bound(model, torch.zeros(n, 2, 2, dtype=torch.uint8), 1, strata, samples, seed=5)
    m = torch.tensor(model.seen).view(n, strata, samples)  # rows go image, stratum, draw
    assert bool((m[:, 0] == 1).all() and (m[:, 2] == 4).all() and ((m[:, 1] == 2) | (m[:, 1] == 3)).all())
    assert {2, 3} <= set(m[:, 1].flatten().tolist())  # both counts of the wide stratum drawn
    for i in range(n):
        want, var = 0.0, 0.0
        for s, size in enumerate((1, 2, 1)):
            cost = [math.log1p(math.exp(-logit[k])) for k in m[i, s].tolist()]  # softplus(-L(m)) per draw
            mean = sum(cost) / samples
            want += size * mean
            var += size**2 * sum((c - mean) ** 2 for c in cost) / (samples - 1) / samples
        assert est["per_image"][i].item() == pytest.approx(want, rel=1e-6)
        assert est["variance"][i].item() == pytest.approx(var, rel=1e-5, abs=1e-12)
    exact = sum(math.log1p(math.exp(-v)) for v in logit.values())  # the bound itself: sum over m of L_m
    assert abs(est["per_image"].mean().item() - exact) < 1.0


def clusters(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n points of 3 classes in 4 features, centres far apart and features of unequal scales."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    centres = torch.tensor([[0.0, 0, 0, 0], [2, 1, 0, 5], [0, 3, 1, -4]])
    x = centres[y] + torch.randn(n, 4, generator=g) * torch.tensor([1.0, 0.5, 2.0, 3.0])
    return x * torch.tensor([1.0, 10.0, 0.1, 100.0]) + torch.tensor([5.0, -3, 0, 50]), y


def test_the_probe_is_fitted_on_train_and_tuned_on_val_only(monkeypatch):
    (xt, yt), (xv, yv), (xe, ye) = clusters(90, 0), clusters(45, 1), clusters(45, 2)
    fits = []
    real_fit = probe.fit_linear

    def recording_fit(x, y, num_classes, l2, iters=300):
        fits.append((x.clone(), y.clone(), l2))
        return real_fit(x, y, num_classes, l2, iters)

    monkeypatch.setattr(probe, "fit_linear", recording_fit)
    labels = {"train": yt, "val": yv, "test": ye}
    first = probe.probe_features({"train": xt, "val": xv, "test": xe}, labels, "test", 5, 3)
    first_fits, fits[:] = list(fits), []
    shuffled = ye[torch.randperm(len(ye), generator=torch.Generator().manual_seed(3))]
    second = probe.probe_features(
        {"train": xt, "val": xv, "test": xe * 7 - 40}, {**labels, "test": shuffled}, "test", 5, 3
    )
    # nothing of the fit moved with the scored split: the standardised inputs, the L2 chosen, its val score
    assert len(fits) == len(first_fits) == len(probe.L2_GRID)
    for (x1, y1, l1), (x2, y2, l2) in zip(first_fits, fits, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2) and l1 == l2
    assert (first["l2"], first["val_linear_acc"]) == (second["l2"], second["val_linear_acc"])

    # the inputs are the train features standardised by the train split's own mean and (population) std
    mean = xt.sum(0) / len(xt)
    std = ((xt - mean) ** 2).sum(0).div(len(xt)).sqrt()
    assert torch.allclose(first_fits[0][0], (xt - mean) / std, atol=1e-5)
    # and the L2 is the strongest of those best on val, scored by hand with val standardised the same way
    val_std = (xv - mean) / std
    scores = [
        int(((val_std @ w.T + b).argmax(1) == yv).sum()) / len(yv)
        for w, b in (real_fit(x, y, 3, l2) for x, y, l2 in first_fits)
    ]
    best = max(scores)
    assert first["l2"] == probe.L2_GRID[scores.index(best)] and first["val_linear_acc"] == best


def test_a_run_that_fails_after_a_checkpoint_keeps_the_event_file_it_wrote(trained, tmp_path, capsys, monkeypatch):
    import shutil

    run = Path(shutil.copytree(trained, tmp_path / "run"))
    before = set(files_of(run))
    log = loggers.TensorBoardLogger.log

    def full_at_step_8(self, metrics, step):
        if step >= 8:
            raise OSError(errno.ENOSPC, "No space left on device")
        log(self, metrics, step)

    monkeypatch.setattr(loggers.TensorBoardLogger, "log", full_at_step_8)
    line = one_error(capsys, "train", "--run-dir", run, "--resume", "auto", "--set", "train.max_steps=10")
    assert "training stopped at step 8" in line and "(step 6), is intact" in line
    new = {n: b for n, b in files_of(run).items() if n not in before}
    events = [n for n in new if n.startswith("events.out.tfevents.")]
    assert (
        "step_0000006.pt" in new and events and all(len(new[n]) > 0 for n in events)
    )  # what it logged before step 8 stays


def test_a_disk_where_no_file_can_be_written_at_start_up_is_one_line(tmp_path):
    """RLIMIT_FSIZE 0: every write fails as on a full disk, so torch's import finds no temporary directory."""
    import resource

    def no_writes():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR")}  # torch looks for a temp dir
    env["TMPDIR"] = str(tmp_path)
    res = subprocess.run(
        [sys.executable, "-m", "vitmask", "config", "--config", str(ROOT / "configs" / "default.yaml")],
        preexec_fn=no_writes,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert lines[0].startswith("vitmask: cannot start:") and "TMPDIR" in lines[0]
