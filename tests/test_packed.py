"""The packed dataset format and `vitmask pack`: bits against numpy's own packbits, the same images
and training as the source it was packed from, deterministic bytes, and every bad input refused
in one line with nothing half-written."""

import errno
import json
import subprocess

import numpy as np
import pytest
import torch

from tests.conftest import MNIST_DIR, TINY, assert_user_error, write_config
from vitmask.config import config_from_dict
from vitmask.data import pack as pack_module
from vitmask.data.batches import load_labelled_splits
from vitmask.data.pack import pack
from vitmask.data.packed import open_packed, unpack_rows
from vitmask.errors import UserError
from vitmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
HAS_MNIST = (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file()


def shapes_cfg(**data):
    return config_from_dict({**TINY, "data": {**TINY["data"], "num_train": 96, "num_val": 16, "num_test": 16, **data}})


def test_unpack_inverts_numpy_packbits_in_the_patch_bit_order():
    images = (torch.rand(5, 7, 9, generator=torch.Generator().manual_seed(0)) < 0.5).to(torch.uint8)  # 63 bits
    rows = torch.from_numpy(np.packbits(images.reshape(5, -1).numpy(), axis=1))  # (5, 8): numpy's reference
    assert rows.shape == (5, 8)
    assert torch.equal(unpack_rows(rows, 7, 9), images)
    first = torch.zeros(1, 2, 8, dtype=torch.uint8)
    first[0, 0, 0] = 1  # the first pixel is the most significant bit, as in a patch's class
    assert np.packbits(first.reshape(1, -1).numpy(), axis=1).tolist() == [[0x80, 0]]


def test_a_pack_of_shapes_holds_the_same_splits_labels_and_header(tmp_path):
    cfg = shapes_cfg()
    header = pack(cfg, tmp_path / "p", progress=False)
    want = load_labelled_splits(cfg)
    got = load_labelled_splits(
        config_from_dict(
            {**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "source": "packed", "path": str(tmp_path / "p")}}
        )
    )
    for k in ("train", "val", "test"):
        assert torch.equal(got.images[k][:], want.images[k])
        assert torch.equal(got.labels[k], want.labels[k])
        assert header["splits"][k]["count"] == len(want.images[k])
    rows = np.load(tmp_path / "p" / "rows.npy", mmap_mode="r")
    assert rows.shape == (header["count"], 32)  # 16 x 16 bits
    assert header["height"] == header["width"] == 16 and header["threshold"] == 0.5
    import hashlib

    assert header["checksum"] == "sha256:" + hashlib.sha256(np.asarray(rows).tobytes()).hexdigest()


def test_packing_twice_gives_the_same_bytes(tmp_path):
    cfg = shapes_cfg()
    pack(cfg, tmp_path / "a", progress=False)
    pack(cfg, tmp_path / "b", progress=False)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_packed_images_index_like_the_tensor_they_hold(tmp_path):
    cfg = shapes_cfg()
    pack(cfg, tmp_path / "p", progress=False)
    train = open_packed(tmp_path / "p").split("train")
    want = load_labelled_splits(cfg).images["train"]
    idx = torch.tensor([5, 0, -1, 17, 5])
    assert torch.equal(train[idx], want[idx])
    assert torch.equal(train[3:9], want[3:9]) and torch.equal(train[4], want[4])
    assert torch.equal(train.rows_to_device()[idx], want[idx])  # the copy the device gathers from
    assert torch.equal(torch.cat(list(train.split(10))), want)


@pytest.mark.skipif(not HAS_MNIST, reason="needs ../shared/data/mnist")
def test_mnist_from_a_pack_splits_and_trains_exactly_as_from_its_idx_files(tmp_path):
    raw = {
        **TINY,
        "data": {"source": "idx", "path": str(MNIST_DIR), "image_size": 28, "patch_size": 4, "batch_size": 16},
        "train": {**TINY["train"], "max_steps": 3, "deterministic": True},
    }
    idx_cfg = config_from_dict(raw)
    pack(idx_cfg, tmp_path / "mnist", progress=False)
    packed_cfg = config_from_dict({**raw, "data": {**raw["data"], "source": "packed", "path": str(tmp_path / "mnist")}})
    a, b = load_labelled_splits(idx_cfg), load_labelled_splits(packed_cfg)
    for k in ("train", "val", "test"):
        assert len(a.images[k]) == len(b.images[k]) == {"train": 8000, "val": 1000, "test": 1000}[k]
        assert torch.equal(b.images[k][:], a.images[k]), k  # the same seed gives the same images, in order
        assert torch.equal(b.labels[k], a.labels[k]), k
    steps = []
    for cfg, data in ((idx_cfg, a), (packed_cfg, b)):
        trainer = Trainer(cfg, data.images, torch.device("cpu"))
        steps.append([float(trainer.train_step(trainer.sampler.sample())["loss"]) for _ in range(3)])
        steps.append(trainer.model.state_dict())
    assert steps[0] == steps[2]
    assert all(torch.equal(steps[1][k], steps[3][k]) for k in steps[1])


# ---- bad input ------------------------------------------------------------------------------------
def packed_config(tmp_path, path, **data):
    return write_config(tmp_path / "c.yaml", {"data": {"source": "packed", "path": str(path), **data}})


@pytest.fixture
def packed_dir(tmp_path):
    pack(shapes_cfg(), tmp_path / "p", progress=False)
    return tmp_path / "p"


def test_a_truncated_rows_file_is_one_line(tmp_path, packed_dir, run_cli_in_process):
    rows = packed_dir / "rows.npy"
    rows.write_bytes(rows.read_bytes()[:-100])
    res = run_cli_in_process("preview", "--config", packed_config(tmp_path, packed_dir), "--out", tmp_path / "x.png")
    assert_user_error(res, "rows.npy", "truncated", "vitmask pack")


def test_a_header_whose_count_disagrees_is_one_line(tmp_path, packed_dir, run_cli_in_process):
    header = json.loads((packed_dir / "header.json").read_text())
    header["count"] += 1
    (packed_dir / "header.json").write_text(json.dumps(header))
    res = run_cli_in_process("preview", "--config", packed_config(tmp_path, packed_dir), "--out", tmp_path / "x.png")
    assert_user_error(res, "rows.npy", f"{header['count']} rows", "vitmask pack")


def test_a_pack_of_another_image_size_is_one_line(tmp_path, packed_dir, run_cli_in_process):
    """The pack's 16x16 images against data.image_size 28 set on the command line (a config file's size
    gives way to the pack's header: tests/test_binarization_record.py)."""
    cfg = packed_config(tmp_path, packed_dir, image_size=28, patch_size=2)
    args = ("train", "--config", cfg, "--run-dir", tmp_path / "run", "--device", "cpu", "--set", "data.image_size=28")
    assert_user_error(run_cli_in_process(*args), "--set data.image_size=28", "data.image_size=16", "16x16")
    assert not (tmp_path / "run").exists()


def test_out_that_is_not_a_pack_is_refused_and_left_alone(tmp_path, run_cli_in_process):
    cfg = write_config(tmp_path / "c.yaml", {"data": {"num_train": 64, "num_val": 8, "num_test": 8}})
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    res = run_cli_in_process("pack", "--config", cfg, "--out", tmp_path / "mine")
    assert_user_error(res, "--out", "not a vitmask packed dataset")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    assert_user_error(run_cli_in_process("pack", "--config", cfg, "--out", tmp_path / "file"), "--out")
    assert (tmp_path / "file").read_text() == "x"
    res = run_cli_in_process("pack", "--config", cfg, "--out", tmp_path / "p")  # new: written
    assert res.returncode == 0 and "wrote" in res.stdout
    res = run_cli_in_process("pack", "--config", cfg, "--out", tmp_path / "p")  # a pack: replaced
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp dirs


def test_a_full_disk_mid_pack_leaves_nothing(tmp_path, monkeypatch, run_cli_in_process):
    cfg = write_config(tmp_path / "c.yaml", {"data": {"num_train": 64, "num_val": 8, "num_test": 8}})
    real = pack_module.pack_rows

    def fill_up(images):
        if fill_up.calls:
            raise OSError(errno.ENOSPC, "No space left on device")
        fill_up.calls += 1
        return real(images)

    fill_up.calls = 0
    monkeypatch.setattr(pack_module, "CHUNK", 16)
    monkeypatch.setattr(pack_module, "pack_rows", fill_up)
    res = run_cli_in_process("pack", "--config", cfg, "--out", tmp_path / "p")
    assert_user_error(res, "disk is full", str(tmp_path / "p"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]  # no pack, no temp dir


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs at tmp_path / "disk": a disk that really fills up (needs the right to mount)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (mounting needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_pack_onto_a_full_tmpfs_leaves_nothing(tmp_path, small_tmpfs, run_cli_in_process):
    # 2,600 images of 32x32 are 128 bytes each packed: 333 KB of rows for a 64 KiB disk
    cfg = write_config(tmp_path / "c.yaml", {"data": {"num_train": 2000, "num_val": 300, "num_test": 300}})
    res = run_cli_in_process("pack", "--config", cfg, "--out", small_tmpfs / "p")
    assert_user_error(res, "disk is full", str(small_tmpfs / "p"))
    assert list(small_tmpfs.iterdir()) == []  # no pack, no temp dir: the space is given back


def test_an_interrupted_pack_leaves_no_dataset_that_looks_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(pack_module, "CHUNK", 16)
    monkeypatch.setattr(pack_module, "pack_rows", lambda images: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        pack(shapes_cfg(), tmp_path / "p", progress=False)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UserError, match="already packed"):
        pack(config_from_dict({"data": {"source": "packed", "path": str(tmp_path)}}), tmp_path / "q")
