"""The npy source (Quick, Draw!'s numpy_bitmap layout): one <class>.npy per class, labels from the
sorted file names, data.max_per_class, packed the same as read, and bad files refused in one line."""

import numpy as np
import pytest
import torch

from tests.conftest import TINY, assert_user_error, write_config
from vitmask.config import config_from_dict
from vitmask.data.batches import load_labelled_splits
from vitmask.data.pack import pack

pytestmark = pytest.mark.usefixtures("one_thread")


def quickdraw_folder(root, counts=(("cat", 30), ("apple", 25), ("zebra", 20))):
    """Synthetic files of the Quick, Draw! layout: (n, 784) uint8 gray levels; image i of class c has
    gray level 200 at pixel (c, i % 28) and 100 (below the 0.5 threshold) at pixel (27, 27)."""
    root.mkdir()
    for c, (name, n) in enumerate(counts):
        a = np.zeros((n, 28, 28), dtype=np.uint8)
        a[np.arange(n), c, np.arange(n) % 28] = 200
        a[:, 27, 27] = 100
        np.save(root / f"{name}.npy", a.reshape(n, 784))
    return root


def npy_cfg(path, **data):
    return config_from_dict(
        {**TINY, "data": {**TINY["data"], "source": "npy", "path": str(path), "image_size": 28, **data}}
    )


def all_images(data):
    return {k: (data.images[k][:], data.labels[k]) for k in ("train", "val", "test")}


def test_labels_follow_sorted_file_names_and_max_per_class_caps_each(tmp_path):
    root = quickdraw_folder(tmp_path / "qd")
    data = load_labelled_splits(npy_cfg(root, max_per_class=22))
    images = torch.cat([data.images[k] for k in ("train", "val", "test")])
    labels = torch.cat([data.labels[k] for k in ("train", "val", "test")])
    assert len(images) == 22 + 22 + 20  # apple 25 -> 22, cat 30 -> 22, zebra 20
    assert torch.bincount(labels).tolist() == [22, 22, 20]  # apple, cat, zebra: sorted names
    file_row = {0: 1, 1: 0, 2: 2}  # apple.npy was written second (row 1), cat first (row 0)
    for img, y in zip(images, labels, strict=True):
        on = img.nonzero().tolist()
        assert len(on) == 1 and on[0][0] == file_row[int(y)]  # gray 200 kept, gray 100 dropped
    taken = sorted(int(img[file_row[1]].argmax()) for img, y in zip(images, labels, strict=True) if y == 1)
    assert taken == list(range(22))  # cat: its first 22 images


def test_zero_one_files_and_three_dimensional_files_are_read(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    a = np.zeros((12, 8, 8), dtype=np.uint8)
    a[:, 0, 0] = 1  # 0/1 values: 1 is foreground
    np.save(root / "a.npy", a)
    np.save(root / "b.npy", np.ones((12, 64), dtype=bool))
    data = load_labelled_splits(npy_cfg(root, image_size=8))
    for k in ("train", "val", "test"):
        for img, y in zip(data.images[k], data.labels[k], strict=True):
            assert int(img.sum()) == (1 if y == 0 else 64)


def test_a_pack_of_an_npy_folder_holds_what_the_source_reads(tmp_path):
    root = quickdraw_folder(tmp_path / "qd")
    cfg = npy_cfg(root, max_per_class=24)
    header = pack(cfg, tmp_path / "p", progress=False)
    assert header["classes"] == ["apple", "cat", "zebra"] and header["count"] == 24 + 24 + 20
    packed = config_from_dict(
        {**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "source": "packed", "path": str(tmp_path / "p")}}
    )
    want, got = all_images(load_labelled_splits(cfg)), all_images(load_labelled_splits(packed))
    for k in want:
        assert torch.equal(got[k][0], want[k][0]) and torch.equal(got[k][1], want[k][1]), k


@pytest.mark.parametrize(
    "array, needles",
    [
        (np.zeros((5, 784), dtype=np.float32), ("dtype float32", "uint8")),
        (np.zeros((5, 783), dtype=np.uint8), ("shape (5, 783)", "(n, 784)")),
        (np.full((5, 784), 300, dtype=np.int16), ("values in [0, 300]", "uint8")),
    ],
)
def test_a_bad_npy_file_is_one_line(tmp_path, run_cli_in_process, array, needles):
    root = tmp_path / "d"
    root.mkdir()
    np.save(root / "bad.npy", array)
    cfg = write_config(tmp_path / "c.yaml", {"data": {"source": "npy", "path": str(root), "image_size": 28}})
    res = run_cli_in_process("pack", "--config", cfg, "--out", tmp_path / "p")
    assert_user_error(res, "bad.npy", *needles)
    assert not (tmp_path / "p").exists()


def test_an_empty_or_missing_folder_is_one_line(tmp_path, run_cli_in_process):
    (tmp_path / "empty").mkdir()
    for path, needle in ((tmp_path / "empty", "no .npy files"), (tmp_path / "nope", "does not exist")):
        cfg = write_config(tmp_path / "c.yaml", {"data": {"source": "npy", "path": str(path), "image_size": 28}})
        assert_user_error(run_cli_in_process("pack", "--config", cfg, "--out", tmp_path / "p"), needle)
        assert not (tmp_path / "p").exists()


def test_max_per_class_must_not_be_negative():
    with pytest.raises(Exception, match="data.max_per_class"):
        config_from_dict({"data": {"max_per_class": -1}})
