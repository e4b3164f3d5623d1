"""`vitmask predict` on hostile inputs: damaged packs, files that are not what their name says.

- a pack with damaged rows (a flipped bit, zeroed rows, two blocks swapped) is refused in one line
  whether predict reads it whole or one split, and nothing is written; a truncated rows file is
  refused when the pack is opened; a split whose blocks are whole is still read;
- a plain .npy (any version, any name's case) given as an .npz is one line naming the npy format;
  other files named .npz (a pickle, text, nothing) are one line too.

Expectations: the pack's rows edited by hand.
"""

import shutil

import numpy as np
import pytest
import torch

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
