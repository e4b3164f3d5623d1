"""A damaged or malformed pack is never used without a word: every tampering, malformed field and
non-regular file refused in one line at open; damaged rows found by their block checksums as they
are first read (a run stops in one line and keeps its last checkpoint) and by `pack --verify`; a
pack stopped by a signal or written through a link leaves nothing behind; images of a size that
is not a multiple of 8 bits and subsets of index splits read back exactly."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, TINY, assert_user_error, write_config
from vitmask.config import config_from_dict
from vitmask.data import pack as pack_module
from vitmask.data.batches import BatchSampler, EpochOrder, load_labelled_splits
from vitmask.data.pack import pack
from vitmask.data.packed import BlockSums, header_digest, open_packed, seal, spread, verify_packed
from vitmask.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS_PER_BLOCK = 2  # 16x16 images are 32 bytes a row: BLOCK_BYTES 64 gives blocks of 2 rows


class Hung(BaseException):
    """Raised by the alarm in a test that would otherwise block forever (a FIFO read)."""


@pytest.fixture
def no_hang():
    def ring(signum, frame):
        raise Hung("blocked for 30 s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def shapes_cfg(**data):
    return config_from_dict({**TINY, "data": {**TINY["data"], "num_train": 96, "num_val": 16, "num_test": 16, **data}})


def npy_folder(root, n=48):
    """Two classes, a and b, of n random 16x16 0/1 images each (3-D files)."""
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        np.save(root / f"{name}.npy", (rng.random((n, 16, 16)) < 0.4).astype(np.uint8))
    return root


def npy_cfg(path):
    data = {**TINY["data"], "source": "npy", "path": str(path), "val_fraction": 0.125, "test_fraction": 0.125}
    return config_from_dict({**TINY, "data": data})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Packs made once for the module (copied by each test that changes them): `npy`, index splits and
    labels a, b; `shapes`, contiguous splits; both with blocks of 2 rows."""
    root = tmp_path_factory.mktemp("packs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pack_module, "BLOCK_BYTES", 32 * ROWS_PER_BLOCK)
        pack(npy_cfg(npy_folder(root / "src")), root / "npy", progress=False)
        pack(shapes_cfg(), root / "shapes", progress=False)
    return root


@pytest.fixture
def npy_pack(made, tmp_path):
    shutil.copytree(made / "npy", tmp_path / "npy")
    return tmp_path / "npy"


@pytest.fixture
def shapes_pack(made, tmp_path):
    shutil.copytree(made / "shapes", tmp_path / "shapes")
    return tmp_path / "shapes"


def header(d) -> dict:
    return json.loads((d / "header.json").read_text())


def put_header(d, h) -> None:
    (d / "header.json").write_text(json.dumps(h, indent=1, sort_keys=True))


def edit_array(path, fn) -> None:
    """Load a .npy file, change it with fn (in place), save it with the same dtype and shape."""
    a = np.load(path)
    fn(a)
    np.save(path, a)


def packed_config(tmp_path, d, **overrides):
    raw = {"data": {"source": "packed", "path": str(d)}}
    for k, v in overrides.items():
        raw.setdefault(k, {}).update(v)
    return write_config(tmp_path / "packed.yaml", raw)


def preview(run, tmp_path, d):
    return run("preview", "--config", packed_config(tmp_path, d), "--out", tmp_path / "x.png")


# ---- refused at open: one line, exit 2, for every verb ----------------------------------------
def swap_files(a, b):
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)


def take_val_row(d):
    val = np.load(d / "val.npy")
    edit_array(d / "train.npy", lambda a: a.__setitem__(0, val[0]))


def replace_count(d, text):
    h = header(d)
    h["count"] = "@"
    (d / "header.json").write_text(json.dumps(h).replace('"@"', text))


def fifo_for(d, name):
    (d / name).unlink()
    os.mkfifo(d / name)


def drop_train(d):
    np.save(d / "train.npy", np.zeros(0, dtype=np.int32))
    h = header(d)
    h["splits"]["train"]["count"] = 0
    put_header(d, h)


def ranges(d, val_start):
    h = header(d)
    h["splits"] = {
        "train": {"count": 72, "start": 0},
        "val": {"count": 12, "start": val_start},
        "test": {"count": 12, "start": 84},
    }
    put_header(d, h)


def change_header(**changes):
    def change(d):
        h = header(d)
        for dotted, value in changes.items():
            *path, last = dotted.split(".")
            where = h
            for k in path:
                where = where[k]
            if value is None:
                del where[last]
            else:
                where[last] = value
        put_header(d, h)

    return change


def append(path, data):
    with open(path, "ab") as f:
        f.write(data)


def drop_file_checksum(d, name):
    """A header without the checksum of `name`, sealed again: only the missing entry is wrong."""
    h = header(d)
    del h["files"][name]
    put_header(d, {**h, "header_checksum": header_digest(h)})


TAMPERINGS = {
    "rows_checksum_in_header": (change_header(checksum="sha256:" + "0" * 64), ["header.json", "changed after"]),
    "class_renamed_in_header": (change_header(classes=["a", "c"]), ["header.json", "changed after"]),
    "train_index_minus_one": (
        lambda d: edit_array(d / "train.npy", lambda a: a.__setitem__(0, -1)),
        ["train.npy", "row number -1", "outside the 96 rows"],
    ),
    "train_index_one_past_the_end": (
        lambda d: edit_array(d / "train.npy", lambda a: a.__setitem__(3, 96)),
        ["train.npy", "row number 96", "outside the 96 rows"],
    ),
    "train_takes_a_val_row": (take_val_row, ["split val", "earlier split (train)", "disjoint"]),
    "val_and_test_swapped": (lambda d: swap_files(d / "val.npy", d / "test.npy"), ["val.npy", "match its checksum"]),
    "labels_file_changed_in_range": (
        lambda d: edit_array(d / "labels.npy", lambda a: a.__setitem__(0, 1 - a[0])),
        ["labels.npy", "match its checksum"],
    ),
    "label_99_of_two_classes": (
        lambda d: edit_array(d / "labels.npy", lambda a: a.__setitem__(5, 99)),
        ["labels.npy", "label 99", "2 classes"],
    ),
    "label_2_of_two_classes": (
        lambda d: edit_array(d / "labels.npy", lambda a: a.__setitem__(5, 2)),
        ["labels.npy", "label 2", "labels 0 to 1"],
    ),
    "negative_label": (
        lambda d: edit_array(d / "labels.npy", lambda a: a.__setitem__(5, -3)),
        ["labels.npy", "label -3"],
    ),
    "overlapping_ranges": (lambda d: ranges(d, 70), ["split val", "disjoint"]),
    "empty_train_split": (drop_train, ["split train is empty"]),
    "count_1e400": (lambda d: replace_count(d, "1e400"), ["header.json", "not readable JSON"]),
    "count_a_float": (lambda d: replace_count(d, "96.0"), ["count is 96.0", "not an integer"]),
    "count_true": (lambda d: replace_count(d, "true"), ["count is True", "not an integer"]),
    "split_without_count": (change_header(**{"splits.train.count": None}), ["splits.train.count", "missing"]),
    "split_with_start_and_index": (change_header(**{"splits.val.start": 0}), ["splits.val", "either start or index"]),
    "index_named_elsewhere": (change_header(**{"splits.test.index": "../x.npy"}), ["splits.test.index"]),
    "no_splits": (change_header(splits=None), ["splits", "missing"]),
    "height_zero": (change_header(height=0), ["height is 0"]),
    "row_bytes_disagree": (change_header(row_bytes=31), ["row_bytes is 31", "take 32"]),
    "deeply_nested_header": (
        lambda d: (d / "header.json").write_text("[" * 100_000),
        ["header.json", "nests too deeply"],
    ),
    "header_a_list": (lambda d: (d / "header.json").write_text("[1]"), ["header.json", "not a vitmask-packed/1"]),
    "header_huge": (
        lambda d: (d / "header.json").write_text(" " * (16 << 20) + "{}"),
        ["header.json", "16,777,218 bytes"],
    ),
    "rows_a_fifo": (lambda d: fifo_for(d, "rows.npy"), ["rows.npy", "not a regular file"]),
    "header_a_fifo": (lambda d: fifo_for(d, "header.json"), ["header.json", "not a regular file"]),
    "index_a_fifo": (lambda d: fifo_for(d, "train.npy"), ["train.npy", "not a regular file"]),
    "rows_longer": (lambda d: append(d / "rows.npy", b"\0" * 32), ["rows.npy", "32 bytes after"]),
    "blocks_missing": (lambda d: (d / "blocks.npy").unlink(), ["blocks.npy", "missing"]),
    "blocks_file_changed": (
        lambda d: edit_array(d / "blocks.npy", lambda a: a.__setitem__(0, a[0] ^ 1)),
        ["blocks.npy", "match its checksum"],
    ),
    "blocks_checksum_missing": (lambda d: drop_file_checksum(d, "blocks.npy"), ["files.blocks.npy", "missing"]),
}


@pytest.mark.parametrize("case", list(TAMPERINGS))
def test_each_tampering_or_malformed_file_is_refused_at_open_in_one_line(
    case, npy_pack, tmp_path, run_cli_in_process, no_hang
):
    tamper, needles = TAMPERINGS[case]
    assert preview(run_cli_in_process, tmp_path, npy_pack).returncode == 0  # the pack as written opens
    tamper(npy_pack)
    assert_user_error(preview(run_cli_in_process, tmp_path, npy_pack), *needles)


def test_every_verb_refuses_a_tampered_pack(npy_pack, tmp_path, run_cli_in_process):
    cfg = packed_config(tmp_path, npy_pack, train={"max_steps": 2, "eval_every": 2, "checkpoint_every": 2})
    res = run_cli_in_process("train", "--config", cfg, "--run-dir", tmp_path / "run", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    ckpt = tmp_path / "run" / "last.pt"
    edit_array(npy_pack / "labels.npy", lambda a: a.__setitem__(0, 99))  # finetune and probe saw 3 classes
    needles = ("labels.npy", "label 99", "2 classes")
    for args in (
        ("eval", "--checkpoint", ckpt, "--device", "cpu"),
        ("probe", "--checkpoint", ckpt, "--device", "cpu"),
        ("reconstruct", "--checkpoint", ckpt, "--out", tmp_path / "r.png"),
        ("finetune", "--checkpoint", ckpt, "--config", cfg, "--run-dir", tmp_path / "ft", "--device", "cpu"),
        ("train", "--config", cfg, "--run-dir", tmp_path / "run2", "--device", "cpu"),
        ("pack", "--verify", npy_pack),
    ):
        assert_user_error(run_cli_in_process(*args), *needles)
    assert not (tmp_path / "r.png").exists() and not (tmp_path / "ft").exists() and not (tmp_path / "run2").exists()


# ---- rows checked by blocks as read --------------------------------------------------------------
def damage_row(d, row, value=None):
    """Flip one bit of `row` in rows.npy (or set the row to `value`), in place, through a memory map."""
    rows = np.load(d / "rows.npy", mmap_mode="r+")
    if value is None:
        rows[row, 3] ^= 0x04
    else:
        rows[row] = value
    rows.flush()
    del rows


def test_a_flipped_bit_is_found_when_its_block_is_first_read_and_not_before(shapes_pack):
    want = load_labelled_splits(shapes_cfg()).images["train"]  # the source's own images
    damage_row(shapes_pack, 37)  # block 18: rows 36 and 37
    train = open_packed(shapes_pack).split("train")  # opening reads no row
    other = torch.tensor([0, 35, 38, 95])
    assert torch.equal(train[other], want[other])  # the other blocks read as written
    with pytest.raises(UserError, match=r"rows 36 to 37 \(block 18 of 64\)"):
        train[torch.tensor([36])]  # the undamaged row of the block: its block is refused whole
    with pytest.raises(UserError, match="rows 36 to 37"):
        open_packed(shapes_pack).split("train")[30:40]


def test_a_read_spanning_checked_and_new_blocks_checks_the_new_ones(shapes_pack):
    train = open_packed(shapes_pack).split("train")
    train[torch.tensor([0, 1])]  # block 0 checked
    damage_row(shapes_pack, 11)  # block 5
    with pytest.raises(UserError, match="rows 10 to 11"):
        train[torch.tensor([0, 11])]
    with pytest.raises(UserError, match="rows 10 to 11"):  # found again: a damaged block is never marked good
        train[torch.tensor([1, 10])]


def test_the_last_shorter_block_is_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(pack_module, "BLOCK_BYTES", 32 * 3)  # blocks of 3 rows: 128 = 42 * 3 + 2
    pack(shapes_cfg(), tmp_path / "p", progress=False)
    assert header(tmp_path / "p")["block_rows"] == 3
    assert np.load(tmp_path / "p" / "blocks.npy").shape == (43,)
    damage_row(tmp_path / "p", 127)
    test = open_packed(tmp_path / "p").split("test")  # rows 112 .. 127
    assert len(test[0:14]) == 14  # rows 112 .. 125: blocks 37 .. 41
    with pytest.raises(UserError, match=r"rows 126 to 127 \(block 42 of 43\)"):
        test[15]


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_sampler_meets_a_damaged_block_with_or_without_prefetch(shapes_pack, prefetch):
    # a row in a block that batch 0 does not touch (the sampler's order is seeded by seed + 1): with
    # prefetch, batches 1 and 2 are gathered in the background thread
    first = set((EpochOrder(96, seed=1).indices(0, 32) // ROWS_PER_BLOCK).tolist())
    row = next(r for r in range(96) if r // ROWS_PER_BLOCK not in first)
    block = row - row % ROWS_PER_BLOCK
    damage_row(shapes_pack, row)
    train = open_packed(shapes_pack).split("train")
    sampler = BatchSampler(train, shapes_cfg(), prefetch=prefetch)  # 32 of the 96 train images a batch
    assert (sampler.step_images.prefetcher is not None) == prefetch
    try:
        sampler.sample()  # batch 0: undamaged blocks
        with pytest.raises(UserError, match=f"rows {block} to {block + 1} "):
            for _ in range(2):  # the rest of the epoch: every train row
                sampler.sample()
    finally:
        sampler.close()


def test_a_run_stops_in_one_line_at_a_damaged_block_and_keeps_its_last_checkpoint(
    shapes_pack, tmp_path, run_cli_in_process
):
    # val rows are 96 .. 111; the validation grid reads rows 96 .. 103 at the start, the first
    # validation (step 2) the whole split: a damaged row 108 (block 54) is first read there
    damage_row(shapes_pack, 108)
    train = {"max_steps": 4, "eval_every": 2, "checkpoint_every": 1, "log_every": 1}
    cfg = packed_config(tmp_path, shapes_pack, train=train)
    run = tmp_path / "run"
    res = run_cli_in_process("train", "--config", cfg, "--run-dir", run, "--device", "cpu")
    assert_user_error(
        res, "training stopped at step 2", "rows.npy is damaged", "rows 108 to 109", f"{run / 'last.pt'} (step 1)"
    )
    assert torch.load(run / "last.pt", weights_only=True)["step"] == 1
    assert not (run / "step_0000002.pt").exists()


def test_zeroed_rows_stop_a_run_before_its_first_step_and_leave_nothing(shapes_pack, tmp_path, run_cli_in_process):
    damage_row(shapes_pack, slice(None), 0)  # every row all zero (trained to val acc 1.0 unchecked)
    cfg = packed_config(tmp_path, shapes_pack)
    res = run_cli_in_process("train", "--config", cfg, "--run-dir", tmp_path / "run", "--device", "cpu")
    assert_user_error(res, "training stopped at step 0", "rows.npy is damaged", "no checkpoint had been written")
    assert not (tmp_path / "run").exists()


# ---- pack --verify: the whole pass -------------------------------------------------------------
def test_verify_passes_a_whole_pack_and_names_the_damaged_blocks(shapes_pack, run_cli_in_process):
    res = run_cli_in_process("pack", "--verify", shapes_pack)
    assert res.returncode == 0 and "whole: 128 images" in res.stdout and "64 blocks" in res.stdout, res
    damage_row(shapes_pack, 37)
    assert_user_error(run_cli_in_process("pack", "--verify", shapes_pack), "rows 36 to 37 (block 18 of 64)")
    damage_row(shapes_pack, 1)
    damage_row(shapes_pack, 100)
    assert_user_error(
        run_cli_in_process("pack", "--verify", shapes_pack), "3 of its 64 blocks", "the first rows 0 to 1"
    )


def test_verify_checks_the_rows_sha256_against_the_header(shapes_pack, run_cli_in_process):
    # a pack whose block sums were made to match changed rows still differs from the rows' SHA-256
    damage_row(shapes_pack, 37)
    rows = np.load(shapes_pack / "rows.npy")
    sums = BlockSums(ROWS_PER_BLOCK)
    sums.update(rows)
    np.save(shapes_pack / "blocks.npy", sums.finish())
    h = header(shapes_pack)
    put_header(shapes_pack, seal({k: v for k, v in h.items() if k not in ("files", "header_checksum")}, shapes_pack))
    assert_user_error(run_cli_in_process("pack", "--verify", shapes_pack), "rows.npy", "rows' checksum")


def test_verify_takes_no_out_and_pack_needs_one_of_them(shapes_pack, tmp_path, run_cli_in_process):
    assert_user_error(run_cli_in_process("pack", "--verify", shapes_pack, "--out", tmp_path / "o"), "--verify")
    assert_user_error(run_cli_in_process("pack"), "--out DIR", "--verify DIR")
    assert_user_error(run_cli_in_process("pack", "--verify", tmp_path / "none"), "none is not a folder")
    assert not (tmp_path / "o").exists()


def strip_checksums(d):
    h = header(d)
    for k in ("files", "header_checksum", "block_rows"):
        del h[k]
    put_header(d, h)
    (d / "blocks.npy").unlink()


def test_a_pack_without_checksums_opens_with_one_warning_and_verifies_by_its_sha256(
    shapes_pack, tmp_path, run_cli_in_process
):
    strip_checksums(shapes_pack)
    res = preview(run_cli_in_process, tmp_path, shapes_pack)
    assert res.returncode == 0, res.stderr
    warnings = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1 and "packed without checksums" in warnings[0] and "vitmask pack --out" in warnings[0]
    res = run_cli_in_process("pack", "--verify", shapes_pack)
    assert res.returncode == 0 and "match the header's SHA-256" in res.stdout, res
    damage_row(shapes_pack, 37)
    res = run_cli_in_process("pack", "--verify", shapes_pack)
    assert res.returncode == 2 and "rows' checksum" in res.stderr.splitlines()[-1], res
    ranges(shapes_pack, 70)  # the structural checks still apply
    assert "disjoint" in preview(run_cli_in_process, tmp_path, shapes_pack).stderr


def test_an_empty_epoch_is_refused_not_divided_by():
    with pytest.raises(UserError, match="train split holds no images"):
        EpochOrder(0, seed=1)


# ---- pack: links, signals ------------------------------------------------------------------------
def test_out_that_is_a_link_to_a_pack_replaces_the_pack_it_points_at(tmp_path, run_cli_in_process):
    small = write_config(tmp_path / "c.yaml", {"data": {"num_train": 40, "num_val": 8, "num_test": 8}})
    big = write_config(tmp_path / "d.yaml", {"data": {"num_train": 48, "num_val": 8, "num_test": 8}})
    (tmp_path / "data").mkdir()
    assert run_cli_in_process("pack", "--config", small, "--out", tmp_path / "data" / "p").returncode == 0
    (tmp_path / "link").symlink_to(tmp_path / "data" / "p")
    res = run_cli_in_process("pack", "--config", big, "--out", tmp_path / "link")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "link").is_symlink() and os.readlink(tmp_path / "link") == str(tmp_path / "data" / "p")
    assert header(tmp_path / "data" / "p")["count"] == 64  # the new pack, where the link points
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "d.yaml", "data", "link"]  # nothing left aside
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["p"]
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert_user_error(run_cli_in_process("pack", "--config", big, "--out", tmp_path / "dangling"), "--out")
    assert not (tmp_path / "nowhere").exists()


def test_out_whose_header_is_a_fifo_is_refused_without_blocking(tmp_path, run_cli_in_process, no_hang):
    cfg = write_config(tmp_path / "c.yaml", {"data": {"num_train": 40, "num_val": 8, "num_test": 8}})
    (tmp_path / "p").mkdir()
    os.mkfifo(tmp_path / "p" / "header.json")
    assert_user_error(run_cli_in_process("pack", "--config", cfg, "--out", tmp_path / "p"), "not a vitmask packed")
    assert [p.name for p in (tmp_path / "p").iterdir()] == ["header.json"]


SLOW_PACK = """
import sys, time
import vitmask.data.pack as p
real = p.plan_in_memory
def slow(cfg, seed, *args, **kwargs):
    plan = real(cfg, seed, *args, **kwargs)
    def chunks(parts=plan.chunks):
        for part in parts:
            for i in range(0, len(part), 8):
                time.sleep(0.02)
                yield part[i : i + 8]
    plan.chunks = chunks()
    return plan
p.plan_in_memory = slow
sys.argv = ["vitmask", *sys.argv[1:]]
from vitmask.cli.entry import main
main()
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_pack_stopped_mid_write_ends_in_one_line_leaves_nothing_and_runs_again(signum, tmp_path, run_cli_in_process):
    # some 2,500 images in chunks of 8, 20 ms each: over 6 s of writing, stopped once rows are on disk
    cfg = write_config(tmp_path / "c.yaml", {"data": {"num_train": 2000, "num_val": 300, "num_test": 300}})
    out = tmp_path / "p"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", SLOW_PACK, "pack", "--config", str(cfg), "--out", str(out)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rows = tmp_path / f".p.packing-{proc.pid}" / "rows.npy"
    deadline = time.monotonic() + 120
    while not (rows.exists() and rows.stat().st_size > 128 + 32 * 64) and proc.poll() is None:
        assert time.monotonic() < deadline, "the pack never started writing"
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signum)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 5
    assert proc.returncode == 128 + signum, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and signal.Signals(signum).name in lines[0] and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]  # no temp dir, no partial pack
    res = run_cli_in_process("pack", "--config", cfg, "--out", out)
    assert res.returncode == 0, res.stderr
    assert verify_packed(out, progress=False)["count"] > 2000  # whole: every block and the rows' SHA-256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "p"]


# ---- two bugs that no other test reached -------------------------------------------------------
def test_an_18x18_pack_reads_back_its_images_from_41_byte_rows(tmp_path):
    cfg = shapes_cfg(image_size=18)
    h = pack(cfg, tmp_path / "p", progress=False)
    assert h["row_bytes"] == 41  # 324 pixels: 40 whole bytes and 4 bits of a 41st
    data = (tmp_path / "p" / "rows.npy").stat().st_size - np.load(tmp_path / "p" / "rows.npy", mmap_mode="r").offset
    assert data == 128 * 41  # 128 images of 41 bytes after the .npy header
    want = load_labelled_splits(cfg).images
    ds = open_packed(tmp_path / "p")
    for k in ("train", "val", "test"):
        assert torch.equal(ds.split(k)[:], want[k]), k
    first = np.packbits(want["train"][0].reshape(-1).numpy())  # numpy's own packing of the first image
    assert np.array_equal(np.load(tmp_path / "p" / "rows.npy")[0], first)


def test_a_subset_of_an_index_split_takes_the_images_at_those_positions(made):
    cfg = npy_cfg(made / "src")
    want = load_labelled_splits(cfg).images["train"]  # the same split, read from the npy files
    train = open_packed(made / "npy").split("train")
    assert not isinstance(train.where, tuple)  # an index split: positions are not row numbers
    pos = np.array([70, 3, 41, 0, 71])
    assert torch.equal(train.subset(pos)[:], want[torch.from_numpy(pos)])
    assert torch.equal(spread(train, 5)[:], want[torch.tensor([0, 18, 36, 53, 71])])  # linspace(0, 71, 5) rounded
