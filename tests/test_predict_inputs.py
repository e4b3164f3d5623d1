"""`vitmask predict` and `eval --confusion` on hostile inputs: damaged packs, files that are not what
their name says, names of every kind.

- a pack with damaged rows (a flipped bit, zeroed rows, two blocks swapped) is refused in one line
  whether predict reads it whole or one split, and nothing is written; a truncated rows file is
  refused when the pack is opened; a split whose blocks are whole is still read;
- a plain .npy (any version, any name's case) given as an .npz is one line naming the npy format;
  other files named .npz (a pickle, text, nothing) are one line too;
- file names that are not UTF-8, or hold commas, quotes, line breaks, control characters,
  right-to-left text: the CSV and the JSON give every name back (the CSV in UTF-8, undecodable bytes
  as \\xNN; the JSON exactly);
- class names of every kind (a line break, 5,000 characters, control characters, right-to-left
  overrides, an empty name, undecodable bytes): eval --confusion draws them, the text report keeps
  one line per class, predict and export keep them whole.

Expectations: the pack's rows edited by hand, names written out by hand, files read back with
Python's csv and json modules.
"""

import csv
import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import TINY, assert_user_error, train_tiny
from tests.test_classifier import some_images
from vitmask.config import config_from_dict
from vitmask.data import pack as pack_module
from vitmask.data.pack import pack

pytestmark = pytest.mark.usefixtures("one_thread")
ROWS_PER_BLOCK = 4  # 16x16 images are 32 bytes a row
KINDS = ["rectangle", "ellipse", "line", "triangle"]


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """The tiny model, 10 steps, then fine-tuned 4 steps on the shapes' labels (with an EMA): its last.pt."""
    from vitmask.data.batches import load_labelled_splits
    from vitmask.store.checkpoint import load_checkpoint
    from vitmask.train.finetune import FinetuneTrainer

    pretrained = train_tiny(tmp_path_factory.mktemp("pre"), {"train": {"max_steps": 10, "eval_every": 10}})
    train = {**TINY["train"], "max_steps": 4, "eval_every": 4, "ema_decay": 0.5}
    cfg = config_from_dict({**TINY, "train": train})
    run = tmp_path_factory.mktemp("ft")
    FinetuneTrainer(cfg, load_labelled_splits(cfg), torch.device("cpu"), load_checkpoint(pretrained)["model"]).fit(
        run, progress=False
    )
    return run / "last.pt"


def shapes_cfg():
    return config_from_dict({**TINY, "data": {**TINY["data"], "num_train": 96, "num_val": 16, "num_test": 16}})


@pytest.fixture(scope="module")
def made_pack(tmp_path_factory):
    """A pack of 128 shapes (train rows 0-95, val 96-111, test 112-127) in blocks of 4 rows."""
    root = tmp_path_factory.mktemp("pack")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pack_module, "BLOCK_BYTES", 32 * ROWS_PER_BLOCK)
        pack(shapes_cfg(), root / "p", progress=False)
    return root / "p"


@pytest.fixture
def a_pack(made_pack, tmp_path):
    shutil.copytree(made_pack, tmp_path / "p")
    return tmp_path / "p"


# ---- damaged packs ------------------------------------------------------------------------------------
def rows_of(d):
    return np.load(d / "rows.npy", mmap_mode="r+")


def flip_a_bit(d):
    rows = rows_of(d)
    rows[5, 3] ^= 0x10  # block 1
    rows.flush()
    return 1


def zero_rows(d):
    rows = rows_of(d)
    row = next(i for i in range(len(rows)) if rows[i].any())
    rows[row] = 0
    rows.flush()
    return row // ROWS_PER_BLOCK


def swap_blocks(d):
    rows = rows_of(d)
    a, b = np.array(rows[0:4]), np.array(rows[4:8])
    assert not np.array_equal(a, b)
    rows[0:4], rows[4:8] = b, a
    rows.flush()
    return 0


TAMPERS = {"a flipped bit": flip_a_bit, "zeroed rows": zero_rows, "two blocks swapped": swap_blocks}


@pytest.mark.parametrize("tamper", TAMPERS)
def test_predict_refuses_a_pack_with_damaged_rows_whole_or_by_split(run_cli, finetuned, a_pack, tmp_path, tamper):
    block = TAMPERS[tamper](a_pack)
    first = block * ROWS_PER_BLOCK
    where = f"rows {first} to {first + ROWS_PER_BLOCK - 1} (block {block} of 32)"
    out = tmp_path / "p.csv"
    for split in ([], ["--split", "train"]):
        res = run_cli("predict", "--checkpoint", finetuned, "--input", a_pack, *split, "--out", out)
        assert_user_error(res, f"{a_pack / 'rows.npy'} is damaged", where, "vitmask pack --verify")
        assert not out.exists()
    # a split none of whose blocks is damaged is read, and classified
    res = run_cli("predict", "--checkpoint", finetuned, "--input", a_pack, "--split", "test", "--out", out)
    assert res.returncode == 0, res.stderr
    assert len(out.read_text().splitlines()) == 1 + 16


def test_predict_refuses_a_pack_whose_rows_file_is_truncated_before_reading_it(run_cli, finetuned, a_pack, tmp_path):
    rows = a_pack / "rows.npy"
    rows.write_bytes(rows.read_bytes()[:-5])
    res = run_cli("predict", "--checkpoint", finetuned, "--input", a_pack, "--out", tmp_path / "p.csv")
    assert_user_error(res, "rows.npy")
    assert not (tmp_path / "p.csv").exists()


# ---- files named .npz that are no archive --------------------------------------------------------------
def npy_v2(path, array):
    with open(path, "wb") as f:
        np.lib.format.write_array(f, array, version=(2, 0))


NOT_ARCHIVES = {  # name: (how to write it, what the line says)
    "a plain .npy named .npz": (lambda p: np.save(open(p, "wb"), some_images(3)), "single NumPy array (.npy)"),
    "a plain .npy named .NPZ": (lambda p: np.save(open(p, "wb"), some_images(3)), "single NumPy array (.npy)"),
    "an .npy of format 2.0": (lambda p: npy_v2(p, some_images(3)), "single NumPy array (.npy)"),
    "an .npy of objects": (
        lambda p: np.save(open(p, "wb"), np.array([{}, 1], dtype=object), allow_pickle=True),
        "single NumPy array (.npy)",
    ),
    "a pickle": (lambda p: p.write_bytes(b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x01."), "not a readable .npz"),
    "text": (lambda p: p.write_text("images: 1, 2, 3\n"), "not a readable .npz"),
    "an empty file": (lambda p: p.write_bytes(b""), "not a readable .npz"),
}


@pytest.mark.parametrize("name", NOT_ARCHIVES)
def test_a_file_named_npz_that_is_no_archive_is_one_line(run_cli, finetuned, tmp_path, name):
    write, needle = NOT_ARCHIVES[name]
    path = tmp_path / ("x.NPZ" if ".NPZ" in name else "x.npz")
    write(path)
    res = run_cli("predict", "--checkpoint", finetuned, "--input", path, "--out", tmp_path / "p.csv")
    assert_user_error(res, f"--input {path}", needle)
    assert not (tmp_path / "p.csv").exists()


def test_the_npz_source_refuses_an_npy_with_the_same_check(tmp_path):
    from vitmask.data.sources import read_npz
    from vitmask.errors import UserError

    np.save(open(tmp_path / "x.npz", "wb"), some_images(3))
    with pytest.raises(UserError, match=r"is a single NumPy array \(\.npy\), not an \.npz archive; set data.source"):
        read_npz(config_from_dict({**TINY, "data": {"source": "npz", "path": str(tmp_path / "x.npz")}}).data)


# ---- image names -------------------------------------------------------------------------------------
ODD_FILE_NAMES = [
    os.fsdecode(b"caf\xe9.png"),  # Latin-1: not UTF-8
    os.fsdecode(b"\xff\xfe.png"),
    "a,b.png",
    'say "hi".png',
    "two\nlines.png",
    "carriage\rreturn.png",
    "tab\there.png",
    "\u202eevil.png",  # a right-to-left override
    "שלום.png",
    " leading space.png",
    "x" * 240 + ".png",
]


def shown_in_csv(name: str) -> str:
    """What the CSV holds for a file name: each byte that is not UTF-8 as \\xNN, all else as it is."""
    raw = os.fsencode(name)
    out, i = [], 0
    while i < len(raw):
        for width in (4, 3, 2, 1):
            try:
                out.append(raw[i : i + width].decode("utf-8"))
                i += width
                break
            except UnicodeDecodeError:
                continue
        else:
            out.append(f"\\x{raw[i]:02x}")
            i += 1
    return "".join(out)


def test_predict_writes_every_file_name_back_in_csv_and_json(run_cli, finetuned, tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for name, image in zip(ODD_FILE_NAMES, some_images(len(ODD_FILE_NAMES)), strict=True):
        Image.fromarray(image).save(folder / name, format="PNG")
    order = sorted(folder / n for n in ODD_FILE_NAMES)  # predict reads a folder in sorted order
    names = [p.name for p in order]
    for suffix in (".csv", ".json"):
        out = tmp_path / f"p{suffix}"
        res = run_cli("predict", "--checkpoint", finetuned, "--input", folder, "--out", out)
        assert res.returncode == 0, res.stderr
        text = out.read_bytes().decode("utf-8")  # strict: the file is UTF-8
        if suffix == ".csv":
            with open(out, newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
            assert [r["name"] for r in rows] == [shown_in_csv(n) for n in names]
            assert all(r["class_1"] in KINDS for r in rows)
        else:
            records = json.loads(text)
            assert [r["name"] for r in records] == names
            assert [os.fsencode(r["name"]) for r in records] == [os.fsencode(n) for n in names]  # the bytes back


# ---- class names -------------------------------------------------------------------------------------
ODD_CLASS_NAMES = ["two\nlines", "y" * 5000, "\u202eevil\x07bell", ""]
MORE_ODD_CLASS_NAMES = [os.fsdecode(b"caf\xe9"), 'a,"b"\r', "\t", "שלום"]


def with_class_names(finetuned, path, names):
    from vitmask.store.checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint(finetuned)
    state.pop("format")
    state["labels"] = {"values": [0, 1, 2, 3], "names": names}
    return save_checkpoint(state, path)


@pytest.mark.parametrize("names", [ODD_CLASS_NAMES, MORE_ODD_CLASS_NAMES], ids=["breaks-long-rtl-empty", "bytes-csv"])
def test_odd_class_names_are_drawn_printed_and_written_back(run_cli, finetuned, tmp_path, names):
    import vitmask
    from vitmask.evaluate.classify import confusion_layout

    ckpt = with_class_names(finetuned, tmp_path / "odd.pt", names)
    png = tmp_path / "cm.png"
    res = run_cli("eval", "--checkpoint", ckpt, "--split", "test", "--device", "cpu", "--confusion", png)
    assert res.returncode == 0, res.stderr
    assert Image.open(png).size == confusion_layout(4).size
    table = res.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.split()[:2] == ["class", "images"])
    rows, after = table[header + 1 : header + 5], table[header + 5]
    assert all(line.startswith("  ") and len(line.split()) >= 4 for line in rows) and after == "", rows
    assert not any(c in res.stdout for c in "\r\x07\u202e")  # shown as escapes, each class on one line
    res = run_cli("eval", "--checkpoint", ckpt, "--split", "test", "--device", "cpu", "--json")
    assert [row["name"] for row in json.loads(res.stdout)["per_class"]] == names

    image = tmp_path / "in.png"
    Image.fromarray(some_images(1)[0]).save(image)
    for suffix in (".json", ".csv"):
        out = tmp_path / f"p{suffix}"
        res = run_cli("predict", "--checkpoint", ckpt, "--input", image, "--out", out, "--top-k", "4")
        assert res.returncode == 0, res.stderr
        if suffix == ".json":
            assert sorted(json.loads(out.read_text())[0]["classes"]) == sorted(names)
        else:
            with open(out, newline="", encoding="utf-8") as f:
                (row,) = list(csv.DictReader(f))
            assert sorted(row[f"class_{k}"] for k in (1, 2, 3, 4)) == sorted(shown_in_csv(n) for n in names)

    exported = tmp_path / "export"
    assert run_cli("export", "--checkpoint", ckpt, "--out", exported).returncode == 0
    assert vitmask.load_classifier(exported).names == names


def test_a_class_name_is_shown_on_one_line_as_written_out_by_hand():
    from vitmask.evaluate.classify import shown_name

    assert shown_name("cat") == "cat"
    assert shown_name("two\nlines") == "two\\nlines"
    assert shown_name("\u202eevil\x07") == "\\u202eevil\\x07"
    assert shown_name("tab\tand\r") == "tab\\tand\\r"
    assert shown_name(os.fsdecode(b"caf\xe9")) == "caf\\xe9"
    assert shown_name("") == "''"
    assert shown_name("y" * 5000) == "y" * 61 + "..."
    assert shown_name("y" * 64) == "y" * 64
    assert shown_name("abcdefghijklmnopqrstuvwxyz", 19) == "abcdefghijklmnop..."
    assert shown_name("שלום") == "שלום"
