"""The names a fine-tuned classifier keeps for its classes, read from each kind of source and
checked against the names written into the files by hand."""

import json

import numpy as np
from PIL import Image

from vitmask.config import DataConfig
from vitmask.data.class_names import class_names
from vitmask.data.sources import read_folder


def png(path, value=255):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (4, 4), value).save(path)


def test_a_folder_names_its_classes_by_their_subfolders_sorted(tmp_path):
    for cls in ("zebra", "apple", "mango"):
        png(tmp_path / "train" / cls / "a.png")
        png(tmp_path / "test" / cls / "b.png")
    png(tmp_path / "val" / "apple" / "c.png")
    data = DataConfig(source="folder", path=str(tmp_path))
    assert class_names(data, [0, 1, 2]) == ["apple", "mango", "zebra"]
    # a class folder without a readable image keeps its place in the names and in the labels alike
    (tmp_path / "train" / "kiwi").mkdir()
    (tmp_path / "train" / "kiwi" / "x.png").write_bytes(b"not a png")
    _, labels = read_folder(data)  # train: apple, mango, zebra (kiwi's file skipped); test: the same
    assert labels["train"].tolist() == labels["test"].tolist() == [0, 2, 3]  # apple 0, kiwi 1, mango 2, zebra 3
    assert class_names(data, [0, 2, 3]) == ["apple", "mango", "zebra"]


def test_a_folder_with_loose_images_has_no_names(tmp_path):
    png(tmp_path / "a.png")
    png(tmp_path / "cats" / "b.png")
    assert class_names(DataConfig(source="folder", path=str(tmp_path)), [0, 1]) == ["0", "1"]


def test_npy_npz_packed_and_shapes_names(tmp_path):
    for name in ("cat", "airplane"):
        np.save(tmp_path / f"{name}.npy", np.zeros((2, 16), dtype=np.uint8))
    assert class_names(DataConfig(source="npy", path=str(tmp_path)), [0, 1]) == ["airplane", "cat"]

    images = np.zeros((3, 4, 4), dtype=np.uint8)
    np.savez(tmp_path / "s.npz", images=images, labels=np.array(["dog", "cat", "dog"]))
    assert class_names(DataConfig(source="npz", path=str(tmp_path / "s.npz")), [0, 1]) == ["cat", "dog"]
    np.savez(tmp_path / "i.npz", images=images, labels=np.array([7, 3, 7]))
    assert class_names(DataConfig(source="npz", path=str(tmp_path / "i.npz")), [3, 7]) == ["3", "7"]

    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "header.json").write_text(json.dumps({"classes": ["ant", "bee", "cow"]}))
    assert class_names(DataConfig(source="packed", path=str(tmp_path / "pack")), [1, 2]) == ["bee", "cow"]
    assert class_names(DataConfig(source="shapes"), [0, 1, 2, 3]) == ["rectangle", "ellipse", "line", "triangle"]
    assert class_names(DataConfig(source="idx", path=str(tmp_path)), [0, 9]) == ["0", "9"]
    # a missing file or a value past the names: the values themselves
    assert class_names(DataConfig(source="packed", path=str(tmp_path / "none")), [0]) == ["0"]
    assert class_names(DataConfig(source="shapes"), [0, 4]) == ["0", "4"]
