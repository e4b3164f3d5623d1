"""Preprocessing, the one path every image takes: fit to size (pad, resize, center_crop, none),
binarize at the threshold (a pixel exactly at threshold * 255 is foreground), invert; reading image files."""

import numpy as np
import pytest
import torch

from vitmask.config import DataConfig
from vitmask.data.preprocess import binarize_images, fit_images, load_image_file
from vitmask.errors import UserError


def test_pad_centres_small_images_and_crop_centres_large_ones():
    x = torch.full((1, 2, 2), 200, dtype=torch.uint8)
    out = fit_images(x, 4, "pad")
    assert out[0].tolist() == [[0, 0, 0, 0], [0, 200, 200, 0], [0, 200, 200, 0], [0, 0, 0, 0]]
    big = torch.arange(36, dtype=torch.uint8).view(1, 6, 6)
    assert fit_images(big, 2, "center_crop")[0].tolist() == [[14, 15], [20, 21]]
    assert fit_images(torch.zeros(3, 7, 5, dtype=torch.uint8), 4, "resize").shape == (3, 4, 4)


def test_pad_and_center_crop_centre_each_side_on_its_own():
    # 2 rows x 6 columns onto 4x4: rows padded (offset 1), columns cropped to the middle four
    x = torch.arange(1, 13, dtype=torch.uint8).view(1, 2, 6)
    want = [[0, 0, 0, 0], [2, 3, 4, 5], [8, 9, 10, 11], [0, 0, 0, 0]]
    assert fit_images(x, 4, "pad")[0].tolist() == want
    assert fit_images(x, 4, "center_crop")[0].tolist() == want
    small = torch.full((1, 1, 1), 9, dtype=torch.uint8)
    assert fit_images(small, 3, "center_crop")[0].tolist() == [[0, 0, 0], [0, 9, 0], [0, 0, 0]]


def test_resize_matches_pil_bilinear():
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 12, 20), generator=g, dtype=torch.uint8)
    got = fit_images(x, 8, "resize")
    for img, out in zip(x, got, strict=True):
        ref = torch.from_numpy(np.asarray(Image.fromarray(img.numpy()).resize((8, 8), Image.BILINEAR)).astype(int))
        assert (out.int() - ref).abs().max() <= 1  # PIL rounds its fixed-point arithmetic its own way


def test_fit_none_needs_the_exact_size():
    with pytest.raises(UserError, match="data.fit is none"):
        fit_images(torch.zeros(1, 28, 28, dtype=torch.uint8), 32, "none")


def test_binarize_thresholds_and_inverts():
    x = torch.tensor([[[0, 127, 128, 255]]], dtype=torch.uint8).expand(1, 4, 4).contiguous()
    cfg = DataConfig(image_size=4, fit="none", threshold=0.5)
    assert binarize_images(x, cfg)[0, 0].tolist() == [0, 0, 1, 1]
    inv = DataConfig(image_size=4, fit="none", threshold=0.5, invert=True)
    assert binarize_images(x, inv)[0, 0].tolist() == [1, 1, 0, 0]


@pytest.mark.parametrize("threshold,level", [(0.6, 153), (0.2, 51), (0.4, 102), (1.0, 255)])
def test_a_pixel_exactly_at_the_threshold_is_foreground(threshold, level):
    assert threshold * 255 == level  # exact in floating point: the comparison itself decides
    x = torch.tensor([level - 1, level, min(level + 1, 255)], dtype=torch.uint8).view(1, 1, 3)
    cfg = DataConfig(image_size=3, patch_size=1, fit="pad", threshold=threshold)  # pad: the 1x3 row is the middle row
    assert binarize_images(x, cfg)[0, 1].tolist() == [0, 1, 1]
    inv = DataConfig(image_size=3, patch_size=1, fit="pad", threshold=threshold, invert=True)
    assert binarize_images(x, inv)[0, 1].tolist() == [1, 0, 0]


def test_threshold_zero_makes_every_pixel_foreground():
    x = torch.tensor([[[0, 1], [128, 255]]], dtype=torch.uint8)
    assert binarize_images(x, DataConfig(image_size=2, fit="none", threshold=0.0))[0].tolist() == [[1, 1], [1, 1]]


def test_load_image_file_reads_grayscale_and_rejects_non_images(tmp_path):
    from PIL import Image

    Image.new("RGB", (5, 3), (255, 255, 255)).save(tmp_path / "white.png")
    img = load_image_file(tmp_path / "white.png")
    assert img.shape == (3, 5) and img.dtype == torch.uint8 and (img == 255).all()
    (tmp_path / "fake.png").write_text("hello")
    with pytest.raises(UserError, match="not a readable image"):
        load_image_file(tmp_path / "fake.png")
    with pytest.raises(UserError, match="image not found"):
        load_image_file(tmp_path / "missing.png")


@pytest.mark.parametrize("fit", ["pad", "center_crop"])
def test_the_canvas_around_a_padded_image_is_background_with_and_without_invert(fit):
    # a 2x2 image of dark ink (0) on white paper (255) at the top left, centred on a 4x4 canvas
    x = torch.tensor([[[0, 255], [255, 255]]], dtype=torch.uint8)
    ink_on_black = DataConfig(image_size=4, patch_size=2, fit=fit, threshold=0.5)
    assert binarize_images(255 - x, ink_on_black)[0].tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0], [0] * 4]
    inverted = DataConfig(image_size=4, patch_size=2, fit=fit, threshold=0.5, invert=True)
    # the same picture written as dark ink on white: inverted, the ink is the only foreground pixel
    assert binarize_images(x, inverted)[0].tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0], [0] * 4]
