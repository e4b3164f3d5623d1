"""The idx source on torchvision's own download: the raw folder `<root>/MNIST/raw` holds every file
twice (the .gz torchvision fetched and the file it unpacked), train and test. Read as a folder it is
torchvision's split (train and test once each, labels aligned); one test-set file as data.path gives
the split of the published MNIST figures: the 10,000 test images cut 8,000/1,000/1,000."""

import gzip
import shutil

import numpy as np
import pytest
import torch

from tests.conftest import MNIST_DIR
from tests.test_sources import cfg_for, numbered_images, write_idx
from vitmask.config import config_from_dict
from vitmask.data.batches import load_splits
from vitmask.data.sources import read_idx


def write_labels(path, labels: np.ndarray) -> None:
    raw = np.array([0x801, len(labels)], ">u4").tobytes() + labels.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def index_of(images: torch.Tensor) -> list[int]:
    """numbered_images' index of each binarized (n, 4, 4) image: its pixels read as a binary number."""
    weights = 2 ** torch.arange(15, -1, -1)
    return (images.reshape(len(images), 16).long() * weights).sum(1).tolist()


def torchvision_raw(root, n_train: int, n_test: int):
    """<root>/MNIST/raw as torchvision leaves it: each of the four files plain and gzipped. Train images
    are numbered 0..n_train-1, test images n_train..; each label is the image's number mod 10."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = numbered_images(n_train + n_test)
    for prefix, part in (("train", slice(0, n_train)), ("t10k", slice(n_train, n_train + n_test))):
        for suffix in ("", ".gz"):
            write_idx(raw / f"{prefix}-images-idx3-ubyte{suffix}", images[part])
            write_labels(raw / f"{prefix}-labels-idx1-ubyte{suffix}", np.arange(n_train + n_test)[part] % 10)
    return raw


def test_the_raw_folder_reads_each_file_once_as_torchvisions_train_and_test(tmp_path):
    raw = torchvision_raw(tmp_path, n_train=40, n_test=12)
    parts, labels = read_idx(cfg_for("idx", raw, image_size=4, fit="none").data)
    assert sorted(parts) == ["test", "train"]
    assert index_of(parts["train"] >= 128) == list(range(40))  # once each, in the file's order
    assert index_of(parts["test"] >= 128) == list(range(40, 52))
    assert labels["train"].tolist() == [i % 10 for i in range(40)]
    assert labels["test"].tolist() == [i % 10 for i in range(40, 52)]

    s = load_splits(cfg_for("idx", raw, image_size=4, fit="none", val_fraction=0.25))
    assert (len(s["train"]), len(s["val"]), len(s["test"])) == (30, 10, 12)
    assert sorted(index_of(torch.cat([s["train"], s["val"]]))) == list(range(40))
    assert index_of(s["test"]) == list(range(40, 52))


def test_one_test_set_file_is_split_by_fractions_as_a_folder_holding_only_it(tmp_path):
    raw = torchvision_raw(tmp_path / "tv", n_train=40, n_test=50)
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(raw / "t10k-images-idx3-ubyte.gz", alone)
    shutil.copy(raw / "t10k-labels-idx1-ubyte.gz", alone)
    one_file = load_splits(cfg_for("idx", raw / "t10k-images-idx3-ubyte", image_size=4, fit="none"))
    folder = load_splits(cfg_for("idx", alone, image_size=4, fit="none"))
    assert {k: len(v) for k, v in one_file.items()} == {"train": 40, "val": 5, "test": 5}
    assert set(index_of(torch.cat(list(one_file.values())))) == set(range(40, 90))  # the test files only
    for k in ("train", "val", "test"):
        assert torch.equal(one_file[k], folder[k]), k


@pytest.mark.skipif(not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file(), reason="needs ../shared/data/mnist")
def test_the_published_split_from_a_torchvision_download(tmp_path):
    """MNIST's test set unpacked into a torchvision raw folder beside other files, read as
    data.path=<raw>/t10k-images-idx3-ubyte: the same 8,000/1,000/1,000 images as the .gz files alone."""
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        shutil.copy(MNIST_DIR / f"{name}.gz", raw)
        with gzip.open(MNIST_DIR / f"{name}.gz") as src, open(raw / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    write_idx(raw / "train-images-idx3-ubyte", numbered_images(20, 28))
    mnist = {"source": "idx", "image_size": 28, "fit": "none", "split_seed": 0}
    published = load_splits(config_from_dict({"data": {**mnist, "path": str(MNIST_DIR)}}))
    downloaded = load_splits(config_from_dict({"data": {**mnist, "path": str(raw / "t10k-images-idx3-ubyte")}}))
    assert {k: len(v) for k, v in downloaded.items()} == {"train": 8000, "val": 1000, "test": 1000}
    for k in ("train", "val", "test"):
        assert torch.equal(downloaded[k], published[k]), k
