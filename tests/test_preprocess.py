import pytest
import torch

from vitmask.config import DataConfig
from vitmask.errors import UserError
from vitmask.preprocess import binarize_images, fit_images, load_image_file


def test_pad_centres_small_images_and_crop_centres_large_ones():
    x = torch.full((1, 2, 2), 200, dtype=torch.uint8)
    out = fit_images(x, 4, "pad")
    assert out[0].tolist() == [[0, 0, 0, 0], [0, 200, 200, 0], [0, 200, 200, 0], [0, 0, 0, 0]]
    big = torch.arange(36, dtype=torch.uint8).view(1, 6, 6)
    assert fit_images(big, 2, "center_crop")[0].tolist() == [[14, 15], [20, 21]]
    assert fit_images(torch.zeros(3, 7, 5, dtype=torch.uint8), 4, "resize").shape == (3, 4, 4)


def test_fit_none_needs_the_exact_size():
    with pytest.raises(UserError, match="data.fit is none"):
        fit_images(torch.zeros(1, 28, 28, dtype=torch.uint8), 32, "none")


def test_binarize_thresholds_and_inverts():
    x = torch.tensor([[[0, 127, 128, 255]]], dtype=torch.uint8).expand(1, 4, 4).contiguous()
    cfg = DataConfig(image_size=4, fit="none", threshold=0.5)
    assert binarize_images(x, cfg)[0, 0].tolist() == [0, 0, 1, 1]
    inv = DataConfig(image_size=4, fit="none", threshold=0.5, invert=True)
    assert binarize_images(x, inv)[0, 0].tolist() == [1, 1, 0, 0]


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
