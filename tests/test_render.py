"""Pictures: predictions pasted into images, and the reconstruction grid (TensorBoard's and
`vitmask reconstruct`'s) checked pixel by pixel against colours and layouts written out by hand.

The documented palette: a masked pixel of the input is gray 0.5; in the error row a missing
foreground pixel is red, a spurious one orange, and masked patches are tinted blue (visible on the
black background, clamped away on white). Cells are 2 pixels apart on a 0.3 gray background.
"""

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import write_config
from vitmask.config import config_from_dict, load_config
from vitmask.data.batches import eval_batches, load_splits
from vitmask.evaluate.pictures import paste_predictions, reconstruction_grid
from vitmask.train.trainer import Trainer

RED = (1.0, 0.1, 0.1)
ORANGE = (1.0, 0.6, 0.0)
BLUE_ON_BLACK = (0.0, 0.0, 0.35)
WHITE, BLACK, GRAY, PAD_GRAY = (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (0.5, 0.5, 0.5), (0.3, 0.3, 0.3)
PAD = 2


def image_of(rows: list[str]) -> torch.Tensor:
    """['1100', ...] -> (1, H, W) uint8."""
    return torch.tensor([[int(c) for c in r] for r in rows], dtype=torch.uint8).unsqueeze(0)


def test_paste_predictions_keeps_visible_patches_and_draws_predicted_classes():
    image = image_of(["1111", "1111", "0000", "0000"])  # a 2x2 grid of 2x2 patches: classes 15, 15, 0, 0
    mask = torch.tensor([[False, True, True, False]])
    pred = torch.tensor([[3, 9, 6, 3]])  # 9 = 10/01 at patch 1, 6 = 01/10 at patch 2; 3 is never used
    out = paste_predictions(image, mask, pred, 2)
    assert out[0].tolist() == [[1, 1, 1, 0], [1, 1, 0, 1], [0, 1, 0, 0], [1, 0, 0, 0]]


def cell(grid: torch.Tensor, row: int, col: int, size: int) -> torch.Tensor:
    """The (size, size, 3) pixels of the image in grid row `row`, column `col` (make_grid's layout)."""
    y, x = PAD + row * (size + PAD), PAD + col * (size + PAD)
    return grid[:, y : y + size, x : x + size].permute(1, 2, 0)


def test_reconstruction_grid_rows_and_error_colours_at_known_pixels():
    image = image_of(["1111", "1100", "0000", "0011"])  # patches 15 (11/11), 12 (11/00), 0, 3 (00/11)
    mask = torch.tensor([[False, True, False, True]])  # patches 1 (top right) and 3 (bottom right)
    # patch 1 (truth 11/00 at rows 0-1, columns 2-3) predicted 6 = 01/10: a missing pixel at (0, 2),
    # a spurious one at (1, 2), a right foreground pixel at (0, 3), a right background one at (1, 3);
    # patch 3 (truth 00/11 at rows 2-3, columns 2-3) predicted right
    pred = torch.tensor([[0, 6, 0, 3]])
    grid = reconstruction_grid(image, mask, pred, 2)  # (3, H', W')
    assert grid.shape == (3, 4 * (4 + PAD) + PAD, 4 + 2 * PAD)  # four rows of one 4x4 image
    for y, x in ((0, 0), (6, 3), (7, 3), (9, 7)):  # the border, the gap between rows 1 and 2, the right border
        torch.testing.assert_close(grid[:, y, x], torch.tensor(PAD_GRAY))
    orig, masked_in, filled, errors = (cell(grid, r, 0, 4) for r in range(4))
    want_orig = image[0].float()
    assert torch.equal(orig, want_orig.unsqueeze(-1).expand(4, 4, 3))
    want_in = want_orig.clone()
    want_in[0:2, 2:4] = want_in[2:4, 2:4] = 0.5  # masked patches gray
    assert torch.equal(masked_in, want_in.unsqueeze(-1).expand(4, 4, 3))
    want_filled = want_orig.clone()
    want_filled[0:2, 2:4] = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # 6 = 01/10
    assert torch.equal(filled, want_filled.unsqueeze(-1).expand(4, 4, 3))
    expect = {
        (0, 2): RED,  # missing: truth 1, predicted 0
        (1, 2): ORANGE,  # spurious: truth 0, predicted 1
        (0, 3): WHITE,  # masked, right, foreground: the blue tint clamps away
        (1, 3): BLUE_ON_BLACK,  # masked, right, background: tinted blue
        (2, 2): BLUE_ON_BLACK,
        (3, 3): WHITE,
        (0, 0): WHITE,  # visible patches as they are, untinted
        (2, 0): BLACK,
        (3, 1): BLACK,
    }
    for (y, x), colour in expect.items():
        torch.testing.assert_close(errors[y, x], torch.tensor(colour), msg=f"error row pixel {(y, x)}")


def test_several_predictions_get_a_filled_row_and_an_error_row_each():
    image = image_of(["1100", "1100", "0000", "0000"])
    mask = torch.tensor([[True, False, False, False]])
    right, wrong = torch.tensor([[12, 0, 0, 0]]), torch.tensor([[0, 0, 0, 0]])
    grid = reconstruction_grid(image, mask, [right, wrong], 2)
    assert grid.shape == (3, 6 * (4 + PAD) + PAD, 4 + 2 * PAD)
    first_errors, second_filled, second_errors = cell(grid, 3, 0, 4), cell(grid, 4, 0, 4), cell(grid, 5, 0, 4)
    torch.testing.assert_close(first_errors[0, 0], torch.tensor(WHITE))  # right: no error colour
    assert second_filled[0:2, 0:2].sum() == 0  # class 0 pasted
    torch.testing.assert_close(second_errors[1, 1], torch.tensor(RED))  # every pixel of 11/11 missing


def reference_picture(images: torch.Tensor, mask: torch.Tensor, pred: torch.Tensor, p: int, scale: int) -> np.ndarray:
    """The reconstruction picture written out pixel by pixel in plain Python, as uint8 (H', W', 3)."""
    b, size = images.shape[0], images.shape[1]
    g, bits = size // p, p * p
    height, width = 4 * (size + PAD) + PAD, b * (size + PAD) + PAD
    pic = [[PAD_GRAY] * width for _ in range(height)]
    for col in range(b):
        for y in range(size):
            for x in range(size):
                patch = (y // p) * g + x // p
                truth = int(images[col, y, x])
                hidden = bool(mask[col, patch])
                k = (y % p) * p + x % p  # the pixel's place in the patch, row-major; first = most significant
                guess = (int(pred[col, patch]) >> (bits - 1 - k)) & 1 if hidden else truth
                if guess < truth:
                    err = RED
                elif guess > truth:
                    err = ORANGE
                elif hidden:
                    err = WHITE if guess else BLUE_ON_BLACK
                else:
                    err = WHITE if guess else BLACK
                shown = (float(truth),) * 3, GRAY if hidden else (float(truth),) * 3, (float(guess),) * 3, err
                for row, colour in enumerate(shown):
                    pic[PAD + row * (size + PAD) + y][PAD + col * (size + PAD) + x] = colour
    big = np.array(pic).repeat(scale, 0).repeat(scale, 1)  # (sH', sW', 3)
    return np.floor(big * 255 + 0.5).astype(np.uint8)


@pytest.fixture(scope="module")
def ckpt_predicting_9(tmp_path_factory):
    """A tiny trained checkpoint whose head bias is raised so far for class 9 (10/01) that the model
    predicts it for every patch: the picture is then known without running the model."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = load_config(write_config(root / "tiny.yaml", {"train": {"max_steps": 2, "checkpoint_every": 2}}))
    Trainer(cfg, load_splits(cfg), torch.device("cpu")).fit(run_dir=root, progress=False)
    state = torch.load(root / "last.pt", weights_only=True)
    state["model"]["head.bias"][9] = 1e4
    torch.save(state, root / "nine.pt")
    return root / "nine.pt"


def test_reconstruct_writes_the_picture_pixel_for_pixel(ckpt_predicting_9, tmp_path, capsys):
    from tests.test_sources import run_inproc

    out = tmp_path / "recon.png"
    args = ["--checkpoint", ckpt_predicting_9, "--out", out, "--n", "3", "--seed", "2", "--mask-ratio", "0.25"]
    res = run_inproc(capsys, "reconstruct", *args)
    assert res.returncode == 0, res.stderr
    cfg = config_from_dict(torch.load(ckpt_predicting_9, weights_only=True)["config"])
    images = load_splits(cfg)["test"][:3]  # the first --n test images
    mask = next(eval_batches(images, cfg, 0.25, 2, 3)).mask  # the masks --seed 2 draws: round(0.25 * 64) each
    assert mask.sum(1).tolist() == [16, 16, 16]
    want = reference_picture(images, mask, torch.full((3, 64), 9), 2, scale=4)
    got = np.asarray(Image.open(out).convert("RGB"))
    assert got.shape == want.shape == (4 * (4 * 18 + 2), 4 * (3 * 18 + 2), 3)  # 4 rows, 3 columns of 16 px, 4x
    assert np.abs(got.astype(int) - want).max() <= 1  # float32 vs float64 rounding of 0.3 and 0.1 at most
    # 10/01 pasted on shapes' mostly empty or full patches: pixels wrong both ways, in their colours
    assert (got == [255, 26, 26]).all(-1).any() and (got == [255, 153, 0]).all(-1).any()


@pytest.mark.parametrize("iterative", [[], ["--iterative", "--steps", "3"]], ids=["one-shot", "iterative"])
def test_inpaint_writes_the_image_with_the_boxed_patches_predicted(ckpt_predicting_9, tmp_path, capsys, iterative):
    from tests.test_sources import run_inproc

    picture = np.zeros((16, 16), np.uint8)
    picture[6:12, 3:13] = 255  # a white bar on black, already 16x16: preprocessing keeps it as is
    Image.fromarray(picture).save(tmp_path / "in.png")
    out = tmp_path / "out.png"
    args = ["--checkpoint", ckpt_predicting_9, "--image", tmp_path / "in.png", "--box", "2,2,7,5", "--out", out]
    res = run_inproc(capsys, "inpaint", *args, *iterative)
    assert res.returncode == 0, res.stderr
    want = (picture // 255).astype(np.uint8)
    for y in (2, 4):  # the box x 2..6, y 2..4 touches patch rows 1-2 and patch columns 1-3
        for x in (2, 4, 6):
            want[y : y + 2, x : x + 2] = [[1, 0], [0, 1]]  # class 9 = 10/01
    got = (np.asarray(Image.open(out).convert("L")) > 127).astype(np.uint8)
    assert np.array_equal(got, want)
