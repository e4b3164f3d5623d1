"""Labels from every source line up with their images through splits and skipped files, and asking
for them changes nothing about the images.

Every image the tests write spells its own index in binary (`numbered_images`), so each image that
comes back says which label it must carry; the expected labels are the arrays the tests wrote.
"""

import gzip
import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import MNIST_DIR, TINY
from tests.test_sources import numbered_images, write_idx
from vitmask.config import config_from_dict
from vitmask.data import shapes
from vitmask.data.batches import load_labelled_splits, load_splits


def cfg_for(source: str, path, **data):
    return config_from_dict({**TINY, "data": {**TINY["data"], "source": source, "path": str(path), **data}})


def index_of(images: torch.Tensor) -> list[int]:
    """The index each 4x4 numbered image spells (most significant pixel first)."""
    weights = 2 ** torch.arange(15, -1, -1)
    return (images.flatten(1).long() * weights).sum(1).tolist()


def assert_aligned(data, expected: dict[int, int]) -> None:
    """Every split's label is the one written for the image's index."""
    for split, images in data.images.items():
        assert data.labels[split].dtype == torch.int64
        assert data.labels[split].tolist() == [expected[i] for i in index_of(images)], split


def write_label_file(path: Path, labels) -> None:
    """idx labels: magic 0x00000801 (ubyte, 1 dim), the count big-endian, then one byte per label."""
    raw = struct.pack(">II", 0x801, len(labels)) + bytes(labels)
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


# ---- idx ------------------------------------------------------------------------------------------
def test_idx_labels_come_from_the_file_beside_each_images_file(tmp_path):
    labels = [(7 * i) % 10 for i in range(60)]
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", numbered_images(60)[:40])
    write_label_file(tmp_path / "train-labels-idx1-ubyte.gz", labels[:40])
    write_idx(tmp_path / "t10k-images-idx3-ubyte", numbered_images(60)[40:])
    write_label_file(tmp_path / "t10k-labels-idx1-ubyte", labels[40:])
    data = load_labelled_splits(cfg_for("idx", tmp_path, image_size=4, fit="none"))
    assert [len(data.labels[k]) for k in ("train", "val", "test")] == [36, 4, 20]
    assert_aligned(data, dict(enumerate(labels)))
    assert data.labels["test"].tolist() == labels[40:]  # the source's own test split, in file order


def test_idx_without_a_labels_file_loads_the_same_images_and_says_how_to_add_labels(tmp_path):
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", numbered_images(50))
    cfg = cfg_for("idx", tmp_path, image_size=4, fit="none")
    data = load_labelled_splits(cfg)
    assert data.labels is None
    assert "t10k-labels-idx1-ubyte[.gz]" in data.no_labels and "beside" in data.no_labels
    write_label_file(tmp_path / "t10k-labels-idx1-ubyte.gz", [1] * 49)  # one short
    short = load_labelled_splits(cfg)
    assert short.labels is None and "holds 49 labels for the 50 images" in short.no_labels
    assert all(torch.equal(short.images[k], data.images[k]) for k in data.images)


@pytest.mark.skipif(not (MNIST_DIR / "t10k-labels-idx1-ubyte.gz").is_file(), reason="needs ../shared/data/mnist")
def test_real_mnist_labels_through_idx_count_like_the_labels_file():
    data = load_labelled_splits(config_from_dict({"data": {"source": "idx", "path": str(MNIST_DIR)}}))
    with gzip.open(MNIST_DIR / "t10k-labels-idx1-ubyte.gz") as f:
        raw = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
    counts = sum(torch.bincount(y, minlength=10) for y in data.labels.values())
    assert counts.tolist() == np.bincount(raw, minlength=10).tolist()
    assert [len(data.labels[k]) for k in ("train", "val", "test")] == [8000, 1000, 1000]


# ---- folder ---------------------------------------------------------------------------------------
def test_folder_labels_are_class_subfolders_shared_across_splits_with_a_corrupt_file_skipped(tmp_path, capsys):
    # train/{cat,dog,emu}, test/{dog,emu}: classes sorted -> cat 0, dog 1, emu 2 in both splits
    expected, images = {}, numbered_images(40)
    layout = {"train": ("cat", "dog", "emu"), "test": ("dog", "emu")}
    i = 0
    for split, classes in layout.items():
        for label, name in enumerate(("cat", "dog", "emu")):
            if name not in classes:
                continue
            (tmp_path / split / name).mkdir(parents=True)
            for _ in range(5 if split == "train" else 3):
                Image.fromarray(images[i]).save(tmp_path / split / name / f"{i:02d}.png")
                expected[i] = label
                i += 1
    (tmp_path / "train" / "cat" / "00b-broken.png").write_bytes(b"\x89PNG not really")  # sorts among the cats
    data = load_labelled_splits(cfg_for("folder", tmp_path, image_size=4, fit="none", val_fraction=0.2))
    assert "skipped 1 of 22 image files" in capsys.readouterr().err
    assert [len(data.labels[k]) for k in ("train", "val", "test")] == [12, 3, 6]
    assert_aligned(data, expected)
    assert data.labels["test"].tolist() == [1, 1, 1, 2, 2, 2]


def test_folder_with_images_outside_class_subfolders_has_no_labels(tmp_path):
    (tmp_path / "a").mkdir()
    for i in range(10):
        Image.fromarray(numbered_images(10)[i]).save(tmp_path / ("a" if i < 5 else ".") / f"{i}.png")
    data = load_labelled_splits(cfg_for("folder", tmp_path, image_size=4, fit="none", val_fraction=0.2))
    assert data.labels is None
    assert "5.png is not in a class subfolder" in data.no_labels and "ImageFolder" in data.no_labels


# ---- npz ------------------------------------------------------------------------------------------
def test_npz_labels_follow_the_seeded_split_and_strings_are_numbered_in_sorted_order(tmp_path):
    labels = np.array([(3 * i) % 5 for i in range(100)])
    names = np.array(["zero", "one", "two", "three", "four"])[labels]
    np.savez(tmp_path / "d.npz", images=numbered_images(100), labels=labels, names=names)
    data = load_labelled_splits(cfg_for("npz", tmp_path / "d.npz", image_size=4, fit="none"))
    assert_aligned(data, dict(enumerate(labels.tolist())))
    by_name = load_labelled_splits(cfg_for("npz", tmp_path / "d.npz", npz_labels_key="names", image_size=4, fit="none"))
    order = {"four": 0, "one": 1, "three": 2, "two": 3, "zero": 4}  # sorted names
    assert_aligned(by_name, {i: order[n] for i, n in enumerate(names.tolist())})


def test_npz_without_or_with_a_wrong_labels_array_has_no_labels(tmp_path):
    np.savez(tmp_path / "d.npz", images=numbered_images(20), labels=np.zeros((20, 2)))
    data = load_labelled_splits(cfg_for("npz", tmp_path / "d.npz", image_size=4, fit="none"))
    assert data.labels is None and "has shape (20, 2), but there are 20 images" in data.no_labels
    data = load_labelled_splits(cfg_for("npz", tmp_path / "d.npz", npz_labels_key="y", image_size=4, fit="none"))
    assert data.labels is None and "has no array 'y'" in data.no_labels and "data.npz_labels_key" in data.no_labels


# ---- torchvision (never downloads) ----------------------------------------------------------------
def test_torchvision_labels_are_its_targets(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    labels = [(5 * i + 1) % 10 for i in range(30)]
    write_idx(raw / "train-images-idx3-ubyte", numbered_images(30)[:20])
    write_label_file(raw / "train-labels-idx1-ubyte", labels[:20])
    write_idx(raw / "t10k-images-idx3-ubyte", numbered_images(30)[20:])
    write_label_file(raw / "t10k-labels-idx1-ubyte", labels[20:])
    data = load_labelled_splits(cfg_for("torchvision", tmp_path, name="MNIST", image_size=4, fit="none"))
    assert_aligned(data, dict(enumerate(labels)))


# ---- shapes ---------------------------------------------------------------------------------------
def test_shapes_label_is_the_kind_of_the_slot_with_most_pixels_first_on_ties():
    drawn = torch.zeros(3, 3, 6, 6, dtype=torch.bool)  # 3 images, 3 slots
    drawn[0, 0, :3, :3] = True  # 9 pixels
    drawn[0, 1, :4, :4] = True  # 16: the largest
    drawn[1, 0, 0, :4] = True  # 4
    drawn[1, 2, 5, 2:] = True  # 4: a tie, the first slot wins
    drawn[2, 1, :2, :2] = True  # image 2: only slot 1 draws anything (overlap with others does not matter)
    kind = torch.tensor(
        [
            [shapes.ELLIPSE, shapes.RECT, shapes.LINE],
            [shapes.TRIANGLE, shapes.RECT, shapes.LINE],
            [shapes.LINE, shapes.RECT, shapes.ELLIPSE],
        ]
    )
    assert shapes.largest_kind(drawn, kind).tolist() == [shapes.RECT, shapes.TRIANGLE, shapes.RECT]


def test_shapes_labels_of_one_shape_images_are_that_shapes_kind():
    # the generator draws, in order, the kinds (n, 3), then filled, then the shape count per image
    n = 200
    g = torch.Generator().manual_seed(11)
    kind = torch.randint(0, 4, (n, 3, 1, 1), generator=g).view(n, 3)
    torch.rand(n, 3, 1, 1, generator=g)
    count = torch.randint(1, 4, (n, 1, 1, 1), generator=g).view(n)
    _, labels = shapes.generate_labelled(n, 16, torch.Generator().manual_seed(11))
    one = count == 1
    assert one.sum() > 40 and torch.equal(labels[one], kind[one, 0])
    assert set(labels.tolist()) == {0, 1, 2, 3}


def test_labels_change_nothing_about_the_images():
    """The shapes splits hash to what they were before labels existed (sha256 of the uint8 bytes,
    recorded from main at 15fe921), and load_splits gives the labelled path's images."""
    images, labels = shapes.make_labelled_splits(300, 50, 50, 32, seed=7)
    digest = {k: hashlib.sha256(v.numpy().tobytes()).hexdigest()[:16] for k, v in images.items()}
    assert digest == {"train": "2f5cfc88393ea73d", "val": "53a43347e1d5bea9", "test": "89ba59d0ddc29128"}
    assert {k: len(v) for k, v in labels.items()} == {"train": 298, "val": 50, "test": 50}
    cfg = config_from_dict(TINY)
    plain = load_splits(cfg)
    digest = {k: hashlib.sha256(v.numpy().tobytes()).hexdigest()[:16] for k, v in plain.items()}
    assert digest == {"train": "7e97e291f84d5bb5", "val": "e9e1a1b287df2405", "test": "5697f0973ab4db4e"}
