"""`ImageProcessor`: images as a user has them -> the binary pixels, patches and token classes a model
takes, checked against patch classes written out by hand, the same image in every input form, and
bad input."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from vitmask.config import config_from_dict
from vitmask.data.processor import ImageProcessor
from vitmask.errors import UserError

# 4x4 gray levels; at threshold 0.5 a pixel is foreground from 127.5 up (128 is, 127 is not)
GRAY = np.array(
    [
        [255, 0, 0, 0],
        [0, 0, 0, 255],
        [255, 255, 0, 127],
        [255, 255, 0, 128],
    ],
    dtype=np.uint8,
)
# its 2x2 patches, row by row; a patch's first pixel is its class's most significant bit:
# [[1,0],[0,0]] = 8, [[0,0],[0,1]] = 1, [[1,1],[1,1]] = 15, [[0,0],[0,1]] = 1 (127 off, 128 on)
CLASSES = [8, 1, 15, 1]
INVERTED = [7, 14, 0, 14]
PATCHES = [[1, 0, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 1]]


def test_a_tiny_image_gives_the_patch_classes_written_out_by_hand():
    proc = ImageProcessor(image_size=4, patch_size=2, threshold=0.5, invert=False, fit="none")
    out = proc(GRAY)
    assert out.pixels.tolist() == [(GRAY >= 128).astype(int).tolist()]
    assert out.patches.tolist() == [PATCHES]
    assert out.patches.dtype == torch.float32
    assert out.classes.tolist() == [CLASSES]
    inverted = ImageProcessor(image_size=4, patch_size=2, invert=True, fit="none")
    assert inverted(GRAY).classes.tolist() == [INVERTED]
    # a 4x4 patch: the whole image is one token, 16 bits, the first pixel the most significant
    whole = ImageProcessor(image_size=4, patch_size=4, fit="none")(GRAY).classes.tolist()
    bits = "".join(str(int(v >= 128)) for v in GRAY.flatten())
    assert whole == [[int(bits, 2)]]


def test_fit_pad_centres_a_small_image_and_the_threshold_follows_the_config():
    square = np.full((2, 2), 200, dtype=np.uint8)  # centred on a 4x4 canvas: one pixel in each patch's inner corner
    proc = ImageProcessor.from_config(config_from_dict({"data": {"image_size": 4, "fit": "pad", "threshold": 0.5}}))
    assert proc(square).classes.tolist() == [[1, 2, 4, 8]]
    strict = ImageProcessor(image_size=4, fit="pad", threshold=0.9)  # 200 < 0.9 * 255: all background
    assert strict(square).classes.tolist() == [[0, 0, 0, 0]]


def test_every_input_form_gives_the_same_pixels(tmp_path):
    proc = ImageProcessor(image_size=4, fit="none")
    want = proc(GRAY).pixels
    path = tmp_path / "g.png"
    Image.fromarray(GRAY).save(path)
    rgb = Image.fromarray(np.repeat(GRAY[:, :, None], 3, axis=2))  # gray in RGB: the same luma
    # GRAY is 4 pixels wide: as a batch it needs its channel axis, (1, 4, 4, 1) (a (1, 4, 4) array is one RGBA image)
    one = GRAY[None, :, :, None]
    for form in (one, torch.from_numpy(GRAY), torch.from_numpy(one), Image.fromarray(GRAY), rgb, path):
        assert torch.equal(proc(form).pixels, want), type(form)
    assert torch.equal(proc(str(path)).pixels, want)
    binary = (GRAY >= 128).astype(np.uint8)  # 0/1 values are read as binary pixels, as an npz source reads them
    assert torch.equal(proc(binary).pixels, want)
    assert torch.equal(proc((GRAY / 255.0).astype(np.float32)).pixels, want)

    # a batch keeps its order; a list may mix sizes, each fitted on its own
    flipped = GRAY[:, ::-1].copy()
    batch = proc(np.stack([GRAY, flipped])[..., None])
    assert torch.equal(batch.pixels[0], want[0]) and torch.equal(batch.pixels[1], proc(flipped).pixels[0])
    padded = ImageProcessor(image_size=4, fit="pad")
    mixed = padded([GRAY, np.full((2, 2), 255, dtype=np.uint8), path])
    assert mixed.classes.tolist() == [CLASSES, [1, 2, 4, 8], CLASSES]


def test_from_pretrained_reads_an_export_dirs_data_entry(tmp_path):
    data = {"image_size": 4, "patch_size": 2, "threshold": 0.5, "invert": True, "fit": "none", "bit_order": "..."}
    (tmp_path / "config.json").write_text(json.dumps({"format": "vitmask-export/1", "data": data}))
    proc = ImageProcessor.from_pretrained(tmp_path)
    assert proc == ImageProcessor(4, 2, 0.5, True, "none")
    assert proc(GRAY).classes.tolist() == [INVERTED]


@pytest.mark.parametrize("name", ["mnist", "mnist-classifier", "shapes"])
def test_from_pretrained_takes_a_shipped_models_name(name, tmp_path, monkeypatch):
    """The name reads the shipped folder's config.json, whose data entry is read here by hand; a folder of
    the name in the working directory wins, as for every loader."""
    from vitmask import pretrained

    monkeypatch.chdir(tmp_path)
    data = json.loads((pretrained.HERE / name / "config.json").read_text())["data"]
    proc = ImageProcessor.from_pretrained(name)
    fields = (proc.image_size, proc.patch_size, proc.threshold, proc.invert, proc.fit)
    assert fields == (data["image_size"], data["patch_size"], data["threshold"], data["invert"], data["fit"])
    (tmp_path / name).mkdir()
    mine = {"image_size": 4, "patch_size": 2, "threshold": 0.5, "invert": False, "fit": "pad"}
    (tmp_path / name / "config.json").write_text(json.dumps({"data": mine}))
    assert ImageProcessor.from_pretrained(name) == ImageProcessor(4, 2, 0.5, False, "pad")
    with pytest.raises(UserError, match="no model of that name ships with vitmask"):
        ImageProcessor.from_pretrained("mnst")


def test_bad_input_is_one_clear_error(tmp_path):
    proc = ImageProcessor(image_size=4, fit="none")
    cases = [
        ([], "empty list"),
        (np.zeros((1, 1, 4, 4, 1)), r"shape \(1, 1, 4, 4, 1\)"),
        ("no/such.png", "image not found"),
        ({"not": "an image"}, "is of type dict"),
        (np.full((4, 4), 300, dtype=np.int32), "0..255"),
        (np.zeros((3, 3), dtype=np.uint8), "3x3 pixels, but the model takes 4x4 images and the fit is none"),
    ]
    for images, needle in cases:
        with pytest.raises(UserError, match=needle):
            proc(images)
    with pytest.raises(UserError, match="not an export dir"):
        ImageProcessor.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"data": {"image_size": 4}}))
    with pytest.raises(UserError, match="names no patch_size"):
        ImageProcessor.from_pretrained(tmp_path)
    with pytest.raises(UserError, match="divisible"):
        ImageProcessor(image_size=5, patch_size=2)


@pytest.mark.parametrize("shape", [(4, 6), (4, 3), (6, 4), (3, 4)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fit_none_refuses_an_image_of_another_size_in_either_side(shape):
    """The height alone right (4x6) or the width alone right (6x4): another size all the same."""
    proc = ImageProcessor(image_size=4, fit="none")
    image = np.zeros(shape, dtype=np.uint8)
    needle = f"{shape[0]}x{shape[1]} pixels, but the model takes 4x4 images and the fit is none"
    for images in (image, [GRAY, image], torch.from_numpy(image)):
        with pytest.raises(UserError, match=needle):
            proc(images)


def test_a_list_of_one_height_and_other_widths_fits_each_image_on_its_own():
    """2x2 and 2x4 (one height), 4x2 and 4x4 (one width with others): each padded to 4x4 as it would be
    alone, its patch classes written out by hand."""
    ones = lambda h, w: np.full((h, w), 255, dtype=np.uint8)  # noqa: E731
    padded = ImageProcessor(image_size=4, patch_size=2, fit="pad")
    out = padded([ones(2, 2), ones(2, 4), ones(4, 2), GRAY])
    # 2x2 centred: one pixel in each patch's inner corner; 2x4: rows 1-2; 4x2: columns 1-2
    assert out.classes.tolist() == [[1, 2, 4, 8], [3, 3, 12, 12], [5, 10, 5, 10], CLASSES]
    for i, image in enumerate([ones(2, 2), ones(2, 4), ones(4, 2), GRAY]):
        assert torch.equal(out.pixels[i], padded(image).pixels[0])
