"""Every verb that writes: no output replaces a file nobody asked to replace, and missing folders
are made and removed again on failure.

- `outputs.rename_new` never replaces what stands at the target, whatever it is (a file, a folder,
  an empty folder, a link, a dangling link), on renameat2 and on each fallback;
- a race at the last step, made deterministic by planting the intruder from inside the last step
  (`outputs.rename_new` or `outputs.place` wrapped): every verb (sample, reconstruct, inpaint,
  predict, eval --confusion, preview, export, pack) ends in one line, exit 2, the intruder as it
  was, no temp file left; two predicts to one path: the second to finish is refused;
- a file the user named, swapped for another while the verb ran: refused, the other file kept;
- `--out a/b/OUT` makes a/ and a/b/ for every verb (and train's --run-dir), and a failure at the
  write removes them again.

Expectations are the bytes and kinds of files planted by hand.
"""

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import TINY, assert_user_error, train_tiny, write_config
from tests.test_classifier import some_images
from vitmask import outputs

pytestmark = pytest.mark.usefixtures("one_thread")
TAKEN = "was created or changed by someone else while this command ran"


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """10 steps of the tiny masked-patch model on 16x16 shapes."""
    return train_tiny(tmp_path_factory.mktemp("pre"), {"train": {"max_steps": 10, "eval_every": 10}})


@pytest.fixture(scope="module")
def finetuned(pretrained, tmp_path_factory):
    """4 steps of fine-tuning it on the shapes' labels: its last.pt."""
    import torch

    from vitmask.config import config_from_dict
    from vitmask.data.batches import load_labelled_splits
    from vitmask.store.checkpoint import load_checkpoint
    from vitmask.train.finetune import FinetuneTrainer

    cfg = config_from_dict({**TINY, "train": {**TINY["train"], "max_steps": 4, "eval_every": 4}})
    run = tmp_path_factory.mktemp("ft")
    FinetuneTrainer(cfg, load_labelled_splits(cfg), torch.device("cpu"), load_checkpoint(pretrained)["model"]).fit(
        run, progress=False
    )
    return run / "last.pt"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A user's image and a tiny config (the shapes source)."""
    root = tmp_path_factory.mktemp("inputs")
    Image.fromarray(some_images(1)[0]).save(root / "in.png")
    return {"image": root / "in.png", "config": write_config(root / "tiny.yaml")}


VERBS = {  # verb -> (what --out is: file suffix or "dir", the arguments before --out)
    "sample": (".png", lambda c: ["sample", "--checkpoint", c["pretrained"], "--n", "1", "--steps", "2"]),
    "reconstruct": (".png", lambda c: ["reconstruct", "--checkpoint", c["pretrained"], "--n", "2"]),
    "inpaint": (
        ".png",
        lambda c: ["inpaint", "--checkpoint", c["pretrained"], "--image", c["image"], "--box", "0,0,4,4"],
    ),
    "predict": (".csv", lambda c: ["predict", "--checkpoint", c["finetuned"], "--input", c["image"]]),
    "eval --confusion": (
        ".png",
        lambda c: ["eval", "--checkpoint", c["finetuned"], "--split", "test", "--device", "cpu"],
    ),
    "preview": (".png", lambda c: ["preview", "--config", c["config"], "--count", "2"]),
    "export": ("dir", lambda c: ["export", "--checkpoint", c["pretrained"]]),
    "pack": ("dir", lambda c: ["pack", "--config", c["config"]]),
}
OUT_FLAG = {"eval --confusion": "--confusion"}


def verb(name: str, out: Path, context: dict) -> list:
    return [*VERBS[name][1](context), OUT_FLAG.get(name, "--out"), out]


def out_path(folder: Path, name: str) -> Path:
    kind = VERBS[name][0]
    return folder / ("out" if kind == "dir" else f"out{kind}")


@pytest.fixture
def context(pretrained, finetuned, inputs):
    return {"pretrained": pretrained, "finetuned": finetuned, **inputs}


# ---- rename_new ---------------------------------------------------------------------------------------
def plant(kind: str, at: Path, victim: Path) -> None:
    """Something nobody asked vitmask to replace, at `at`."""
    if kind == "file":
        at.write_text("someone's file")
    elif kind == "folder":
        at.mkdir()
        (at / "theirs.txt").write_text("someone's file")
    elif kind == "empty folder":
        at.mkdir()
    elif kind == "link":
        at.symlink_to(victim)
    elif kind == "dangling link":
        at.symlink_to(victim.parent / "nowhere")


def planted_as_it_was(kind: str, at: Path, victim: Path) -> bool:
    if kind == "file":
        return at.is_file() and not at.is_symlink() and at.read_text() == "someone's file"
    if kind == "folder":
        return at.is_dir() and [p.name for p in at.iterdir()] == ["theirs.txt"]
    if kind == "empty folder":
        return at.is_dir() and not at.is_symlink() and not any(at.iterdir())
    target = victim if kind == "link" else victim.parent / "nowhere"
    return at.is_symlink() and Path(os.readlink(at)) == target and victim.read_text() == "keep"


INTRUDERS = ["file", "folder", "empty folder", "link", "dangling link"]
FALLBACKS = ["renameat2", "hard link", "exclusive create"]


@pytest.mark.parametrize("fallback", FALLBACKS)
@pytest.mark.parametrize("intruder", INTRUDERS)
def test_rename_new_never_replaces_what_stands_at_the_target(tmp_path, monkeypatch, intruder, fallback):
    if fallback != "renameat2":
        monkeypatch.setattr(outputs, "_renameat2", lambda src, dst: errno.ENOSYS)
    if fallback == "exclusive create":

        def no_links(*args, **kwargs):
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_links)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    for source_kind in ("file", "folder"):
        src, dst = tmp_path / f"src-{source_kind}", tmp_path / f"dst-{source_kind}"
        src.mkdir() if source_kind == "folder" else src.write_text("ours")
        plant(intruder, dst, victim)
        with pytest.raises(FileExistsError):
            outputs.rename_new(src, dst)
        assert planted_as_it_was(intruder, dst, victim), (source_kind, intruder)
        assert src.exists()  # ours is still where it was
        fresh = tmp_path / f"new-{source_kind}"
        outputs.rename_new(src, fresh)  # nothing there: moved
        assert fresh.exists() and not src.exists()
        assert fresh.is_dir() if source_kind == "folder" else fresh.read_text() == "ours"


# ---- a race at the last step --------------------------------------------------------------------------
def intruding(monkeypatch, at: Path, intruder: str, victim: Path) -> list:
    """Wrap outputs.rename_new so that the intruder appears at `at` just before the move; returns the
    list of targets the wrapped function was called with."""
    real, calls = outputs.rename_new, []

    def racing(src, dst):
        calls.append(Path(dst))
        if Path(dst) == at and not os.path.lexists(at):
            plant(intruder, at, victim)
        return real(src, dst)

    monkeypatch.setattr(outputs, "rename_new", racing)
    return calls


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("intruder", INTRUDERS)
@pytest.mark.parametrize("name", VERBS)
def test_an_output_that_appears_while_a_verb_runs_is_left_as_it_is(
    run_cli, context, tmp_path, monkeypatch, name, intruder
):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    folder = tmp_path / "outs"
    folder.mkdir()
    out = out_path(folder, name)
    calls = intruding(monkeypatch, out, intruder, victim)
    res = run_cli(*verb(name, out, context))
    assert_user_error(res, str(out), TAKEN, "result was not written")
    assert out in calls  # the last step was reached, and refused
    assert planted_as_it_was(intruder, out, victim)
    assert leftovers(folder) == []  # no temp file or temp dir left


def test_two_predicts_to_one_path_keep_the_first_to_finish(run_cli, finetuned, tmp_path, monkeypatch):
    from vitmask.cli.predict import predict

    gray = some_images(3)
    folder = tmp_path / "images"
    folder.mkdir()
    for i, image in enumerate(gray):
        Image.fromarray(image).save(folder / f"{i}.png")
    Image.fromarray(gray[0]).save(tmp_path / "one.png")
    out = tmp_path / "p.csv"
    real = outputs.rename_new

    def the_other_predict_finishes_first(src, dst):
        monkeypatch.setattr(outputs, "rename_new", real)
        predict(finetuned, tmp_path / "one.png", out, progress=False)  # the whole of another predict
        return real(src, dst)

    monkeypatch.setattr(outputs, "rename_new", the_other_predict_finishes_first)
    assert_user_error(run_cli("predict", "--checkpoint", finetuned, "--input", folder, "--out", out), TAKEN)
    rows = out.read_text().splitlines()
    assert rows[0].startswith("name,class_1") and [r.split(",")[0] for r in rows[1:]] == ["one.png"]
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("name", ["sample", "reconstruct", "inpaint", "eval --confusion", "preview"])
def test_a_named_file_swapped_for_another_while_a_verb_runs_is_left_as_it_is(
    run_cli, context, tmp_path, monkeypatch, name
):
    out = tmp_path / "out.png"
    out.write_bytes(b"the user's old picture, which the verb may replace")
    real = outputs.place

    def swapped(tmp, path, replaces, what=""):
        (tmp_path / "theirs").write_text("someone else's file")
        os.replace(tmp_path / "theirs", path)  # a new file (a new inode) where the named one was
        return real(tmp, path, replaces, what)

    monkeypatch.setattr(outputs, "place", swapped)
    assert_user_error(run_cli(*verb(name, out, context)), TAKEN)
    assert out.read_text() == "someone else's file" and leftovers(tmp_path) == []
    monkeypatch.undo()  # untouched, the named file is replaced as asked
    out.write_bytes(b"the user's old picture")
    assert run_cli(*verb(name, out, context)).returncode == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_into_an_empty_folder_that_gets_files_meanwhile_leaves_them(run_cli, pretrained, tmp_path, monkeypatch):
    from vitmask.store import export as exports

    out = tmp_path / "export"
    out.mkdir()
    real = exports.save_weights

    def and_someone_writes_into_out(tensors, file):
        (out / "theirs.txt").write_text("someone's file")
        return real(tensors, file)

    monkeypatch.setattr(exports, "save_weights", and_someone_writes_into_out)
    assert_user_error(run_cli("export", "--checkpoint", pretrained, "--out", out), TAKEN)
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and leftovers(tmp_path) == []


def test_pack_over_a_pack_swapped_for_something_else_leaves_it(run_cli, inputs, tmp_path, monkeypatch):
    from vitmask.data import pack as packs

    out = tmp_path / "pack"
    assert run_cli("pack", "--config", inputs["config"], "--out", out).returncode == 0  # a pack: may be replaced
    real = packs._replace

    def swapped(tmp, target, replaces):
        shutil.rmtree(target)
        target.mkdir()
        (target / "theirs.txt").write_text("someone's file")
        return real(tmp, target, replaces)

    monkeypatch.setattr(packs, "_replace", swapped)
    assert_user_error(run_cli("pack", "--config", inputs["config"], "--out", out), TAKEN)
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and leftovers(tmp_path) == []


@pytest.mark.parametrize("swap", ["another pack", "a new empty folder"])
def test_pack_over_a_pack_swapped_for_another_pack_or_an_empty_folder_leaves_it(
    run_cli, inputs, tmp_path, monkeypatch, swap
):
    """Each may be replaced where it is what --out named; swapped in by someone else, it is theirs."""
    from vitmask.data import pack as packs

    out, other = tmp_path / "pack", tmp_path / "other"
    assert run_cli("pack", "--config", inputs["config"], "--out", out).returncode == 0
    if swap == "another pack":
        res = run_cli("pack", "--config", inputs["config"], "--set", "data.num_train=100", "--out", other)
        assert res.returncode == 0, res.stderr
        theirs = (other / "header.json").read_text()
        assert json.loads(theirs)["count"] < json.loads((out / "header.json").read_text())["count"]
    real = packs._replace

    def swapped(tmp, target, replaces):
        if swap == "a new empty folder":
            other.mkdir()  # made while the pack still stands, so it is another folder (another inode)
        shutil.rmtree(target)
        os.rename(other, target)
        return real(tmp, target, replaces)

    monkeypatch.setattr(packs, "_replace", swapped)
    assert_user_error(run_cli("pack", "--config", inputs["config"], "--out", out), TAKEN)
    if swap == "another pack":
        assert (out / "header.json").read_text() == theirs  # theirs, of fewer train images than ours
    else:
        assert out.is_dir() and list(out.iterdir()) == []
    assert leftovers(tmp_path) == []


def test_pack_over_its_own_pack_emptied_meanwhile_replaces_the_folder_named(run_cli, inputs, tmp_path, monkeypatch):
    """The folder --out named, still there and empty: nothing of anyone's is lost, so it is replaced."""
    from vitmask.data import pack as packs

    out, want = tmp_path / "pack", tmp_path / "want"
    assert run_cli("pack", "--config", inputs["config"], "--out", want).returncode == 0  # what the pack writes
    assert run_cli("pack", "--config", inputs["config"], "--set", "data.num_train=100", "--out", out).returncode == 0
    real = packs._replace

    def emptied(tmp, target, replaces):
        for p in target.iterdir():
            p.unlink()
        return real(tmp, target, replaces)

    monkeypatch.setattr(packs, "_replace", emptied)
    res = run_cli("pack", "--config", inputs["config"], "--out", out)
    assert res.returncode == 0, res.stderr
    assert (out / "header.json").read_text() == (want / "header.json").read_text() and leftovers(tmp_path) == []


# ---- missing folders ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", VERBS)
def test_a_verb_makes_the_missing_folders_of_its_output_and_removes_them_when_it_fails(
    run_cli, context, tmp_path, monkeypatch, name
):
    out = out_path(tmp_path / "a" / "b", name)
    res = run_cli(*verb(name, out, context))
    assert res.returncode == 0, res.stderr
    assert out.is_dir() if VERBS[name][0] == "dir" else out.is_file()

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(outputs, "rename_new", disk_full)
    again = out_path(tmp_path / "c" / "d", name)
    res = run_cli(*verb(name, again, context))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "Traceback" not in res.stderr and ("disk is full" in res.stderr or "no space" in res.stderr.lower())
    assert not (tmp_path / "c").exists()  # c/ and c/d/ made for it, removed again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_train_makes_the_missing_folders_of_its_run_dir_and_removes_them_when_it_fails(
    run_cli, inputs, tmp_path, monkeypatch
):
    from vitmask.errors import UserError
    from vitmask.train.trainer import Trainer

    short = ["--set", "train.max_steps=1", "--set", "train.eval_every=1", "--set", "train.checkpoint_every=1"]
    run = tmp_path / "a" / "b" / "run"
    res = run_cli("train", "--config", inputs["config"], "--run-dir", run, "--device", "cpu", *short)
    assert res.returncode == 0, res.stderr
    assert (run / "last.pt").is_file()

    def fails(self, *args, **kwargs):
        raise UserError("the run failed before its first checkpoint")

    monkeypatch.setattr(Trainer, "fit", fails)
    res = run_cli("train", "--config", inputs["config"], "--run-dir", tmp_path / "c" / "d" / "run", *short)
    assert_user_error(res, "the run failed before its first checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_predict_of_a_folder_into_a_new_folder_writes_no_file_when_an_image_is_bad(
    run_cli,
    finetuned,
    tmp_path,
):
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((16, 16), np.uint8)).save(folder / "good.png")
    (folder / "bad.png").write_bytes(b"\x89PNG not really")
    res = run_cli("predict", "--checkpoint", finetuned, "--input", folder, "--out", tmp_path / "new" / "p.csv")
    assert_user_error(res, "bad.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images"]  # new/ was never made
