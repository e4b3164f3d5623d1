"""`vitmask pack` never drops labels without a word: labels that are there but cannot be used are
refused in one line that says why (nothing written), unless --no-labels asks for a pack without
labels; a source with no labels at all is packed without them and one note on stderr says so.

Each source that can carry labels (npz, idx, folder) is written here by hand, each image spelling
its own index (test_sources.numbered_images), in every way its labels can be absent or unusable."""

import json
import struct

import numpy as np
import pytest
from PIL import Image

from tests.conftest import assert_user_error, write_config
from tests.test_sources import numbered_images, write_idx
from vitmask.data import sources

pytestmark = pytest.mark.usefixtures("one_thread")

N = 20


def idx_labels(path, labels) -> None:
    path.write_bytes(struct.pack(">II", 0x801, len(labels)) + bytes(labels))


def png(path, i: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(numbered_images(N)[i]).save(path)


# ---- the sources: each writes its data under `root` and returns (data keys, why in the refusal) -----
def npz_object_labels(root):
    np.savez(root / "d.npz", images=numbered_images(N), labels=np.array([str(i) for i in range(N)], dtype=object))
    return {"source": "npz", "path": str(root / "d.npz")}, "cannot be read (ValueError)"


def npz_labels_of_another_shape(root):
    np.savez(root / "d.npz", images=numbered_images(N), labels=np.zeros((N, 2), np.int64))
    return {"source": "npz", "path": str(root / "d.npz")}, f"has shape ({N}, 2), but there are {N} images"


def npz_labels_of_another_count(root):
    np.savez(root / "d.npz", images=numbered_images(N), labels=np.zeros(N - 1, np.int64))
    return {"source": "npz", "path": str(root / "d.npz")}, f"has shape ({N - 1},), but there are {N} images"


def idx_labels_of_another_count(root):
    write_idx(root / "t10k-images-idx3-ubyte", numbered_images(N))
    idx_labels(root / "t10k-labels-idx1-ubyte", [1] * (N - 1))
    return {"source": "idx", "path": str(root)}, f"holds {N - 1} labels for the {N} images"


def idx_labels_unreadable(root):
    write_idx(root / "t10k-images-idx3-ubyte", numbered_images(N))
    (root / "t10k-labels-idx1-ubyte").write_bytes(b"not an idx file")
    return {"source": "idx", "path": str(root)}, "is not a readable idx labels file"


def idx_labels_beside_one_file_only(root):
    write_idx(root / "train-images-idx3-ubyte", numbered_images(N)[:12])
    idx_labels(root / "train-labels-idx1-ubyte", [i % 3 for i in range(12)])
    write_idx(root / "t10k-images-idx3-ubyte", numbered_images(N)[12:])
    return {"source": "idx", "path": str(root)}, "there is no labels file t10k-labels-idx1-ubyte[.gz]"


def folder_with_an_image_outside_the_classes(root):
    for i in range(N):
        png(root / "imgs" / ("a" if i % 2 else "b") / f"{i:02d}.png", i)
    png(root / "imgs" / "stray.png", 0)
    return {"source": "folder", "path": str(root / "imgs")}, "stray.png is not in a class subfolder"


UNUSABLE = [
    npz_object_labels,
    npz_labels_of_another_shape,
    npz_labels_of_another_count,
    idx_labels_of_another_count,
    idx_labels_unreadable,
    idx_labels_beside_one_file_only,
    folder_with_an_image_outside_the_classes,
]


def npz_without_labels(root):
    np.savez(root / "d.npz", images=numbered_images(N))
    return {"source": "npz", "path": str(root / "d.npz")}, "has no array 'labels'"


def idx_without_labels(root):
    write_idx(root / "t10k-images-idx3-ubyte", numbered_images(N))
    return {"source": "idx", "path": str(root)}, "there is no labels file t10k-labels-idx1-ubyte[.gz]"


def folder_without_classes(root):
    for i in range(N):
        png(root / "imgs" / f"{i:02d}.png", i)
    return {"source": "folder", "path": str(root / "imgs")}, "is not in a class subfolder"


ABSENT = [npz_without_labels, idx_without_labels, folder_without_classes]


def npz_with_labels(root):
    np.savez(root / "d.npz", images=numbered_images(N), labels=np.arange(N) % 4)
    return {"source": "npz", "path": str(root / "d.npz")}, ""


def config(root, data: dict):
    keys = {**data, "image_size": 4, "patch_size": 2, "fit": "none", "val_fraction": 0.2, "test_fraction": 0.2}
    return write_config(root / "c.yaml", {"data": keys})


def header(out) -> dict:
    return json.loads((out / "header.json").read_text())


@pytest.mark.parametrize("make", UNUSABLE, ids=lambda f: f.__name__)
def test_labels_that_cannot_be_used_are_refused_with_their_reason(run_cli_in_process, tmp_path, make):
    data, why = make(tmp_path)
    out = tmp_path / "p"
    res = run_cli_in_process("pack", "--config", config(tmp_path, data), "--out", out)
    assert_user_error(res, "cannot be packed", why, "--no-labels")
    assert not out.exists() and not list(tmp_path.glob(".p.packing-*"))  # nothing written


@pytest.mark.parametrize("make", UNUSABLE, ids=lambda f: f.__name__)
def test_no_labels_packs_the_images_of_unusable_labels_without_them(run_cli_in_process, tmp_path, make):
    data, _ = make(tmp_path)
    out = tmp_path / "p"
    res = run_cli_in_process("pack", "--config", config(tmp_path, data), "--out", out, "--no-labels")
    assert res.returncode == 0, res.stderr
    assert header(out)["classes"] is None and not (out / "labels.npy").exists()
    assert header(out)["count"] == (N + 1 if data["source"] == "folder" else N)  # every image, the stray one too


@pytest.mark.parametrize("make", ABSENT, ids=lambda f: f.__name__)
def test_a_source_without_labels_is_packed_without_them_and_one_note_says_so(run_cli_in_process, tmp_path, make):
    data, why = make(tmp_path)
    out = tmp_path / "p"
    res = run_cli_in_process("pack", "--config", config(tmp_path, data), "--out", out)
    assert res.returncode == 0, res.stderr
    notes = [line for line in res.stderr.splitlines() if "vitmask: note:" in line]
    assert len(notes) == 1 and "the pack has no labels" in notes[0] and why in notes[0], res.stderr
    assert header(out)["classes"] is None and not (out / "labels.npy").exists()


def test_usable_labels_are_packed_without_a_note_and_no_labels_drops_them(run_cli_in_process, tmp_path):
    data, _ = npz_with_labels(tmp_path)
    res = run_cli_in_process("pack", "--config", config(tmp_path, data), "--out", tmp_path / "p")
    assert res.returncode == 0 and "no labels" not in res.stderr, res.stderr
    assert header(tmp_path / "p")["classes"] == ["0", "1", "2", "3"]
    labels = np.load(tmp_path / "p" / "labels.npy")
    assert sorted(labels.tolist()) == sorted((np.arange(N) % 4).tolist())
    res = run_cli_in_process("pack", "--config", tmp_path / "c.yaml", "--out", tmp_path / "q", "--no-labels")
    assert res.returncode == 0 and "no labels" not in res.stderr, res.stderr
    assert header(tmp_path / "q")["classes"] is None and not (tmp_path / "q" / "labels.npy").exists()
    assert (tmp_path / "q" / "rows.npy").read_bytes() == (tmp_path / "p" / "rows.npy").read_bytes()


def test_no_labels_is_refused_with_verify(run_cli_in_process, tmp_path):
    data, _ = npz_with_labels(tmp_path)
    assert run_cli_in_process("pack", "--config", config(tmp_path, data), "--out", tmp_path / "p").returncode == 0
    assert_user_error(run_cli_in_process("pack", "--verify", tmp_path / "p", "--no-labels"), "--no-labels", "--verify")


@pytest.mark.parametrize("make", UNUSABLE, ids=lambda f: f.__name__)
def test_the_readers_say_the_labels_are_unusable(tmp_path, make):
    """What the refusal rests on: the source's reader returns an UnusableLabels, never a plain reason."""
    from vitmask.config import config_from_dict

    data, why = make(tmp_path)
    cfg = config_from_dict({"data": {**data, "image_size": 4, "patch_size": 2, "fit": "none"}}).data
    _, labels = {"npz": sources.read_npz, "idx": sources.read_idx, "folder": sources.read_folder}[data["source"]](cfg)
    assert isinstance(labels, sources.UnusableLabels) and why in labels


@pytest.mark.parametrize("make", ABSENT, ids=lambda f: f.__name__)
def test_the_readers_say_the_labels_are_absent(tmp_path, make):
    from vitmask.config import config_from_dict

    data, why = make(tmp_path)
    cfg = config_from_dict({"data": {**data, "image_size": 4, "patch_size": 2, "fit": "none"}}).data
    _, labels = {"npz": sources.read_npz, "idx": sources.read_idx, "folder": sources.read_folder}[data["source"]](cfg)
    assert isinstance(labels, str) and not isinstance(labels, sources.UnusableLabels) and why in labels
