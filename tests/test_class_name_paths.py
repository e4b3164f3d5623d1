"""Class names survive every path: a labelled source packed (`vitmask pack`), fine-tuned on the pack,
then `eval`, `predict`, `export` and `vitmask.load_classifier` all name the classes as the source
does: a folder's class subfolders, an npz archive's string labels, a torchvision dataset's
`classes` (FashionMNIST, on idx files written here: nothing is downloaded). A pack whose header
numbers its classes still trains and predicts, with numbers.

The expected names are written out by hand; which class a prediction names is checked against a
classifier built by hand from the checkpoint's own weights (tests/test_classifier.py's `reference`).
"""

import csv
import json
import struct

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import datasets

from tests.conftest import TINY, train_tiny, write_config
from tests.test_classifier import hand_patches, reference
from vitmask.config import DataConfig
from vitmask.data.class_names import class_names
from vitmask.data.packed import header_digest
from vitmask.store.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# Python's sorted order, capitals first, so neither the order of the alphabet nor the order the
# classes were written in: label 0 is Zebra (a folder's classes and an npz's labels are numbered so)
NAMED = ["Zebra", "apple", "mango"]
WRITTEN = ["mango", "Zebra", "apple"]  # the order the test writes the classes in
# FashionMNIST's targets 2, 5 and 9 by torchvision's own `classes`: not alphabetical either
FASHION = {2: "Pullover", 5: "Sandal", 9: "Ankle boot"}
PER_CLASS = 12


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """4 steps of the tiny masked-patch model on 16x16 shapes: the encoder every fine-tuning starts from."""
    train = {"max_steps": 4, "eval_every": 4, "checkpoint_every": 4}
    return train_tiny(tmp_path_factory.mktemp("pre"), {"train": train})


def class_images(kind: int, n: int, seed: int) -> np.ndarray:
    """(n, 16, 16) uint8 0/255: kind 0 the top half lit, 1 the left half, 2 the main diagonal band,
    each with a few random pixels flipped so that no two images are alike."""
    rng = np.random.default_rng(seed)
    base = np.zeros((16, 16), dtype=bool)
    if kind == 0:
        base[:8] = True
    elif kind == 1:
        base[:, :8] = True
    else:
        base = np.abs(np.subtract.outer(np.arange(16), np.arange(16))) < 3
    flips = rng.random((n, 16, 16)) < 0.05
    return ((base ^ flips) * 255).astype(np.uint8)


def write_folder(root, names=WRITTEN):
    """root/<name>/<i>.png, PER_CLASS images of each class, kind i for names[i] in `NAMED` order."""
    for name in names:
        kind = NAMED.index(name)
        (root / name).mkdir(parents=True)
        for i, image in enumerate(class_images(kind, PER_CLASS, seed=kind)):
            Image.fromarray(image).save(root / name / f"{i:02d}.png")
    return root


def write_npz(path):
    """images and string labels, the classes interleaved in the `WRITTEN` order."""
    images, labels = [], []
    for i in range(PER_CLASS):
        for name in WRITTEN:
            images.append(class_images(NAMED.index(name), 1, seed=100 * i + NAMED.index(name))[0])
            labels.append(name)
    np.savez(path, images=np.stack(images), labels=np.array(labels))
    return path


def write_fashion(root):
    """<root>/FashionMNIST/raw: idx files of 16x16 images whose targets are 9, 2 and 5 in turn."""
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    targets = [9, 2, 5]
    for prefix, n in (("train", 3 * PER_CLASS), ("t10k", 9)):
        labels = [targets[i % 3] for i in range(n)]
        images = np.stack([class_images(sorted(FASHION).index(t), 1, seed=7 * i)[0] for i, t in enumerate(labels)])
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, *images.shape) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + bytes(labels))
    return root


def data_keys(**data) -> dict:
    return {"data": {**TINY["data"], "batch_size": 8, "fit": "none", **data}}


def fine_tune(run_cli, pretrained, pack, tmp_path):
    """4 steps of fine-tuning on the pack: its last.pt."""
    train = {**TINY["train"], "max_steps": 4, "eval_every": 4, "checkpoint_every": 4, "log_every": 2}
    config = write_config(tmp_path / "ft.yaml", {**data_keys(source="packed", path=str(pack)), "train": train})
    run = tmp_path / "ft"
    res = run_cli("finetune", "--checkpoint", pretrained, "--config", config, "--run-dir", run, "--no-baselines")
    assert res.returncode == 0, res.stderr
    return run / "last.pt"


def likeliest(ckpt, gray: np.ndarray) -> list[int]:
    """The class index the checkpoint's classifier, built by hand, gives each image (no EMA: its weights)."""
    with torch.no_grad():
        return reference(ckpt, "model")(hand_patches(gray)).argmax(1).tolist()


def predict_folder(tmp_path) -> tuple[np.ndarray, list]:
    """Two images of each kind as PNG files: their gray levels and paths."""
    gray = np.concatenate([class_images(kind, 2, seed=50 + kind) for kind in range(3)])
    folder = tmp_path / "to-predict"
    folder.mkdir()
    paths = [folder / f"{i}.png" for i in range(len(gray))]
    for image, path in zip(gray, paths, strict=True):
        Image.fromarray(image).save(path)
    return gray, paths


def check_every_path(run_cli, pretrained, source_keys: dict, values: list[int], names: list[str], tmp_path):
    """pack, finetune, eval, predict, export and Python on one source: every one names class i names[i]."""
    import vitmask

    pack = tmp_path / "pack"
    res = run_cli("pack", "--config", write_config(tmp_path / "source.yaml", data_keys(**source_keys)), "--out", pack)
    assert res.returncode == 0, res.stderr
    header = json.loads((pack / "header.json").read_text())
    assert [header["classes"][v] for v in values] == names

    ckpt = fine_tune(run_cli, pretrained, pack, tmp_path)
    assert load_checkpoint(ckpt)["labels"] == {"values": values, "names": names}

    res = run_cli("eval", "--checkpoint", ckpt, "--split", "test", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.splitlines()[-1])
    assert [c["name"] for c in report["per_class"]] == names and report["majority_class"] in names

    gray, paths = predict_folder(tmp_path)
    want = [names[i] for i in likeliest(ckpt, gray)]  # the likeliest class, named
    out = tmp_path / "p.csv"
    res = run_cli("predict", "--checkpoint", ckpt, "--input", paths[0].parent, "--out", out)
    assert res.returncode == 0, res.stderr
    with open(out) as f:
        rows = {r["name"]: r["class_1"] for r in csv.DictReader(f)}
    assert [rows[p.name] for p in paths] == want

    exported = tmp_path / "export"
    assert run_cli("export", "--checkpoint", ckpt, "--out", exported).returncode == 0
    meta = json.loads((exported / "config.json").read_text())
    assert [c["name"] for c in meta["classifier"]["classes"]] == names
    for path in (ckpt, exported):
        classifier = vitmask.load_classifier(path)
        assert classifier.names == names
        assert [top[0] for top in classifier.predict(gray).names] == want


def test_a_folder_keeps_its_class_names_through_pack_finetune_eval_predict_and_export(run_cli, pretrained, tmp_path):
    folder = write_folder(tmp_path / "images")
    assert class_names(DataConfig(source="folder", path=str(folder)), [0, 1, 2]) == NAMED  # unpacked, the same
    check_every_path(run_cli, pretrained, {"source": "folder", "path": str(folder)}, [0, 1, 2], NAMED, tmp_path)


def test_an_npz_with_string_labels_keeps_its_names_on_every_path(run_cli, pretrained, tmp_path):
    npz = write_npz(tmp_path / "images.npz")
    check_every_path(run_cli, pretrained, {"source": "npz", "path": str(npz)}, [0, 1, 2], NAMED, tmp_path)


def test_a_torchvision_dataset_keeps_its_classes_names_on_every_path(run_cli, pretrained, tmp_path):
    root = write_fashion(tmp_path / "tv")
    keys = {"source": "torchvision", "name": "FashionMNIST", "path": str(root)}
    # what torchvision's dataset itself exposes, read here from a dataset opened on the files
    opened = datasets.FashionMNIST(root, train=True, download=False)
    assert [opened.classes[t] for t in FASHION] == list(FASHION.values())
    check_every_path(run_cli, pretrained, keys, list(FASHION), list(FASHION.values()), tmp_path)


def test_emnist_names_follow_its_split_as_the_dataset_gives_them(tmp_path):
    raw = tmp_path / "EMNIST" / "raw"
    raw.mkdir(parents=True)
    for part in ("train", "test"):  # one 4x4 image each: enough for torchvision to open the split
        (raw / f"emnist-letters-{part}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, 1, 4, 4) + bytes(16))
        (raw / f"emnist-letters-{part}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, 1) + bytes([1]))
    opened = datasets.EMNIST(tmp_path, split="letters", train=True, download=False)
    data = DataConfig(source="torchvision", name="EMNIST", emnist_split="letters", path=str(tmp_path))
    assert class_names(data, [1, 2, 26]) == ["a", "b", "z"] == [opened.classes[t] for t in (1, 2, 26)]
    digits = DataConfig(source="torchvision", name="EMNIST", emnist_split="digits", path=str(tmp_path))
    assert class_names(digits, [0, 9]) == ["0", "9"]


def test_a_pack_that_numbers_its_classes_still_trains_and_predicts_numbers(run_cli, pretrained, tmp_path):
    folder = write_folder(tmp_path / "images")
    pack = tmp_path / "pack"
    config = write_config(tmp_path / "source.yaml", data_keys(source="folder", path=str(folder)))
    assert run_cli("pack", "--config", config, "--out", pack).returncode == 0
    # the header of a pack without names: its classes are the label values as text, checksummed as pack seals it
    header = json.loads((pack / "header.json").read_text())
    header["classes"] = ["0", "1", "2"]
    header["header_checksum"] = header_digest(header)
    (pack / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True) + "\n")

    ckpt = fine_tune(run_cli, pretrained, pack, tmp_path)
    assert load_checkpoint(ckpt)["labels"] == {"values": [0, 1, 2], "names": ["0", "1", "2"]}
    gray, paths = predict_folder(tmp_path)
    out = tmp_path / "p.csv"
    assert run_cli("predict", "--checkpoint", ckpt, "--input", paths[0].parent, "--out", out).returncode == 0
    with open(out) as f:
        got = {r["name"]: r["class_1"] for r in csv.DictReader(f)}
    assert [got[p.name] for p in paths] == [str(i) for i in likeliest(ckpt, gray)]


def test_a_pack_of_the_built_in_shapes_names_its_kinds(run_cli, tmp_path):
    config = write_config(tmp_path / "shapes.yaml", {"data": {**TINY["data"], "num_train": 64}})
    assert run_cli("pack", "--config", config, "--out", tmp_path / "pack").returncode == 0
    header = json.loads((tmp_path / "pack" / "header.json").read_text())
    assert header["classes"] == ["rectangle", "ellipse", "line", "triangle"]
