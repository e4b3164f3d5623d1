"""data/grid.py against torchvision's make_grid and save_image, the reference it replaces: the same
tiles, the same padding, the same bytes in the PNG files; and the library a command imports at its
start does not import torchvision (whose import took over a second of every start)."""

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from torchvision.utils import make_grid, save_image

from tests.conftest import ROOT
from vitmask.data.grid import save_png, tile


def images(b: int, c: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """(b, c, h, w) values in [0, 1], with exact 0s and 1s among them."""
    x = torch.rand(b, c, h, w, generator=torch.Generator().manual_seed(seed))
    return torch.where(x < 0.2, 0.0, torch.where(x > 0.8, 1.0, x))


@pytest.mark.parametrize("b, nrow", [(1, 8), (2, 8), (5, 2), (7, 3), (64, 8), (9, 9), (3, 1)])
@pytest.mark.parametrize("c", [1, 3])
@pytest.mark.parametrize("padding, pad_value", [(2, 0.3), (2, 0.5), (0, 0.3), (3, 1.0)])
def test_tile_lays_out_images_as_torchvisions_make_grid(b, nrow, c, padding, pad_value):
    x = images(b, c, 6, 5)
    ours = tile(x, nrow=nrow, padding=padding, pad_value=pad_value)
    assert torch.equal(ours, make_grid(x, nrow=nrow, padding=padding, pad_value=pad_value))
    assert ours.shape[0] == 3


def test_the_layout_by_hand():
    """Two 1x1 images, one a row, padding 1 of 0.5: a column of padding, image, padding, image, padding."""
    x = torch.tensor([0.0, 1.0]).view(2, 1, 1, 1)
    grid = tile(x, nrow=1, padding=1, pad_value=0.5)
    assert grid.shape == (3, 5, 3)
    assert grid[0].tolist() == [[0.5] * 3, [0.5, 0.0, 0.5], [0.5] * 3, [0.5, 1.0, 0.5], [0.5] * 3]


@pytest.mark.parametrize("shape", [(9, 7), (1, 9, 7), (3, 9, 7)])
def test_save_png_writes_the_bytes_of_torchvisions_save_image(tmp_path, shape):
    x = images(1, *((1, *shape) if len(shape) == 2 else shape))[0]  # values on both sides of every rounding
    save_png(x, tmp_path / "ours.png")
    save_image(x, tmp_path / "torchvision.png")
    assert (tmp_path / "ours.png").read_bytes() == (tmp_path / "torchvision.png").read_bytes()
    with open(tmp_path / "file.png", "wb") as f:  # a file object with a .png name, as write_atomically's
        save_png(x, f)
    assert (tmp_path / "file.png").read_bytes() == (tmp_path / "ours.png").read_bytes()


def test_the_rounding_by_hand():
    """Byte floor(255 v + 0.5): 0 -> 0, 0.5 -> 128, 1 -> 255, 0.3 -> 77, out of range clamped."""
    buffer = io.BytesIO()
    buffer.name = "x.png"
    save_png(torch.tensor([[0.0, 0.5, 1.0, 0.3, 1.5, -0.2]]), buffer)
    from PIL import Image

    buffer.seek(0)
    with Image.open(buffer) as image:
        assert image.mode == "RGB" and np.asarray(image)[0, :, 0].tolist() == [0, 128, 255, 77, 255, 0]


def test_a_commands_library_import_does_not_take_torchvision():
    code = "import sys, vitmask.cli.verbs; print([m for m in sys.modules if m.split('.')[0] == 'torchvision'])"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
