"""`vitmask preview`: the PNG grid (size, content) and the dataset statistics."""

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import MNIST_DIR, ROOT, TINY, assert_user_error, write_config
from tests.test_sources import run_inproc
from vitmask.config import config_from_dict, load_config
from vitmask.data.batches import eval_batches, load_splits
from vitmask.data.preview import blank_counts, dataset_stats, format_stats, preview_grid


def test_preview_writes_the_grid_and_prints_statistics(tmp_path, capsys):
    rng = np.random.default_rng(0)
    images = (rng.random((50, 16, 16)) < 0.3).astype(np.uint8)  # 0/1, 16x16 like TINY
    np.savez(tmp_path / "d.npz", images=images)
    cfg = write_config(tmp_path / "c.yaml", {"data": {"source": "npz", "path": str(tmp_path / "d.npz")}})
    out = tmp_path / "sub" / "preview.png"
    res = run_inproc(capsys, "preview", "--config", cfg, "--out", out)  # --count defaults to 16
    assert res.returncode == 0, res.stderr
    # 16 images, 8 per row, each row followed by its masked copy: 4 rows of 8 cells of 16 * 4 pixels
    png = np.asarray(Image.open(out).convert("RGB")).astype(int)
    cell, pad = 16 * 4, 2
    assert png.shape == (4 * (cell + pad) + pad, 8 * (cell + pad) + pad, 3)
    train = {tuple(x.flatten().tolist()) for x in load_splits(load_config(cfg))["train"]}
    for r in range(4):
        for c in range(8):
            y, x = pad + r * (cell + pad), pad + c * (cell + pad)
            block = png[y : y + cell, x : x + cell]
            tinted = int((block[..., 2] > block[..., 0] + 40).sum())
            if r % 2 == 0:  # the image: black and white only, both present, one of the training images
                assert tinted == 0 and set(np.unique(block)) == {0, 255}
                assert tuple((block[::4, ::4, 0] // 255).flatten().tolist()) in train
            else:  # its masks: 32 of 64 patches of 2x2 pixels, each pixel drawn 4x4
                assert tinted == 32 * 4 * 16
    lines = res.stdout.splitlines()
    counts = {
        ln.split()[0]: (int(ln.split()[1]), float(ln.split()[2]))
        for ln in lines
        if ln.split()[0] in ("train", "val", "test")
    }
    assert {k: v[0] for k, v in counts.items()} == {"train": 40, "val": 5, "test": 5}
    fg = sum(n * f for n, f in counts.values()) / 50
    assert abs(fg - images.mean()) < 1e-3
    assert any(ln.startswith("empty patches (train)") for ln in lines) and "most common patch classes" in res.stdout


def test_dataset_stats_against_numpy():
    cfg = config_from_dict(TINY)
    g = torch.Generator().manual_seed(0)
    train = (torch.rand(20, 16, 16, generator=g) < 0.2).to(torch.uint8)
    train[:5] = 0
    splits = {"train": train, "val": train[:3], "test": train[5:9]}
    s = dataset_stats(splits, cfg, top=3)
    x = train.numpy().reshape(20, 8, 2, 8, 2).transpose(0, 1, 3, 2, 4).reshape(20, 64, 4)
    classes = x @ np.array([8, 4, 2, 1])
    shares = np.bincount(classes.ravel(), minlength=16) / classes.size
    assert s["images"] == {"train": 20, "val": 3, "test": 4}
    assert s["foreground"]["test"] == pytest.approx(train[5:9].float().mean().item())
    assert s["empty_patch_share"] == pytest.approx(shares[0])
    assert [c for c, _ in s["top_classes"]] == list(np.argsort(-shares, kind="stable")[:3])


def test_preview_rejects_an_out_path_that_is_not_png(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml")
    res = run_inproc(capsys, "preview", "--config", cfg, "--out", tmp_path / "p.jpg")
    assert_user_error(res, "--out", "must be a .png")
    assert not (tmp_path / "p.jpg").exists()


def test_preview_grid_tints_masked_patches_light_on_foreground_dark_on_background():
    # two 4x4 images of 2x2 patches, each row of images followed by the same images with masks drawn:
    # a masked pixel is 0.45 * its gray level + 0.55 * (0.2, 0.45, 1.0)
    light, dark = torch.tensor([0.56, 0.6975, 1.0]), torch.tensor([0.11, 0.2475, 0.55])
    cfg = config_from_dict({"data": {"image_size": 4, "patch_size": 2}, "mask": {"ratio": 0.5}})
    images = torch.tensor([[[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]] * 2, dtype=torch.uint8)
    images[1] = 1 - images[1]
    grid = preview_grid(images, cfg, seed=5, per_row=2, scale=1)  # (3, 2 * 6 + 2, 2 * 6 + 2)
    assert grid.shape == (3, 14, 14)
    mask = next(eval_batches(images, cfg, 0.5, 5, 2)).mask  # the masks seed 5 draws: 2 of 4 patches each
    for i in range(2):
        top, masked = grid[:, 2:6, 2 + 6 * i : 6 + 6 * i], grid[:, 8:12, 2 + 6 * i : 6 + 6 * i]  # (3, 4, 4) each
        assert torch.equal(top, images[i].float().expand(3, 4, 4))
        for y in range(4):
            for x in range(4):
                gray = float(images[i, y, x])
                if mask[i, (y // 2) * 2 + x // 2]:
                    torch.testing.assert_close(masked[:, y, x], light if gray else dark)
                else:
                    assert masked[:, y, x].tolist() == [gray] * 3
    assert grid[:, 0, 0].tolist() == grid[:, 7, 5].tolist() == [0.5] * 3  # the padding between cells


def test_statistics_text_by_hand():
    cfg = config_from_dict({"data": {"image_size": 4, "patch_size": 2}, "mask": {"ratio": 0.5}})
    empty = torch.zeros(4, 4, dtype=torch.uint8)
    corner = empty.clone()
    corner[:2, :2] = 1  # one patch 11/11 (class 15)
    splits = {"train": torch.stack([empty, corner]), "val": corner[None], "test": torch.stack([empty] * 3)}
    lines = format_stats(dataset_stats(splits, cfg, top=2), cfg).splitlines()  # top 2: no ties among them
    assert "mask random, ratio 0.5 (2 of 4 patches)" in lines
    assert lines[-6:] == [
        "train         2  0.1250",  # 4 of 32 pixels
        "val           1  0.2500",
        "test          3  0.0000",
        "empty patches (train) 0.8750",  # 7 of 8 patches
        "most common patch classes (train): 0 [00/00] 0.8750, 15 [11/11] 0.1250",
        "blank after preprocessing: 4 images blank, 0 nearly blank (under 1% of pixels on), of 6",  # 1 + 3 empty
    ]


@pytest.mark.skipif(not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file(), reason="needs ../shared/data/mnist")
def test_statistics_of_the_mnist_test_set_are_the_ones_the_docs_show():
    cfg = load_config(ROOT / "configs" / "mnist.yaml", ["data.source=idx", f"data.path={MNIST_DIR}"])
    text = format_stats(dataset_stats(load_splits(cfg), cfg), cfg)
    page = (ROOT / "docs" / "data.md").read_text()
    shown = page[page.index("split    images  foreground") :].split("```")[0].strip().splitlines()
    assert len(shown) == 7 and shown == text.splitlines()[-7:]


# ---- blank images ------------------------------------------------------------------------------------
def stroke_image(kind: str) -> np.ndarray:
    """A 64x64 white-on-black drawing: `thin` 1-pixel lines (a 4x resize to 16x16 averages them below
    half of 255: blank), `dot` a 4x4 spot (one pixel of 256 survives: nearly blank), `thick` an 8-pixel
    bar (a 2-pixel bar at 16x16)."""
    x = np.zeros((64, 64), np.uint8)
    if kind == "thin":
        x[10:54, 31] = 255
        x[20, 8:56] = 255
    elif kind == "dot":
        x[28:32, 28:32] = 255
    else:
        x[8:56, 28:36] = 255
    return x


def test_preview_counts_the_thin_strokes_a_resize_blanks_and_warns_once(tmp_path, capsys):
    kinds = ["thin"] * 16 + ["dot"] * 4 + ["thick"] * 42  # 62 drawings: 16 blank and 4 nearly blank at 16x16
    (tmp_path / "drawings").mkdir()
    for i, kind in enumerate(kinds):
        Image.fromarray(stroke_image(kind)).save(tmp_path / "drawings" / f"{i:02d}.png")
    data = {"source": "folder", "path": str(tmp_path / "drawings"), "image_size": 16, "fit": "resize"}
    cfg = write_config(tmp_path / "c.yaml", {"data": data})
    res = run_inproc(capsys, "preview", "--config", cfg, "--out", tmp_path / "resized.png")
    assert res.returncode == 0, res.stderr
    assert "blank after preprocessing: 16 images blank, 4 nearly blank (under 1% of pixels on), of 62" in res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert lines[0].startswith("vitmask: warning: 20 of 62 images (32%) are blank or nearly blank"), lines[0]
    assert "data.fit resize to 16x16" in lines[0] and "data.fit=pad" in lines[0]

    # the same drawings padded (centred, the 64x64 canvas cropped to its middle 16x16): the thin lines and
    # the dot stay whole where they cross the middle, nothing is blank, and no warning
    data["fit"] = "pad"
    cfg = write_config(tmp_path / "c.yaml", {"data": data})
    res = run_inproc(capsys, "preview", "--config", cfg, "--out", tmp_path / "padded.png")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "blank after preprocessing: 0 images blank, 0 nearly blank (under 1% of pixels on), of 62" in res.stdout


@pytest.mark.parametrize("blank, warned", [(6, False), (7, True)])
def test_preview_warns_only_when_more_than_a_tenth_of_the_images_are_blank(tmp_path, capsys, blank, warned):
    images = np.zeros((62, 16, 16), np.uint8)
    images[blank:, 4:12, 6:10] = 1  # 32 of 256 pixels on; the first `blank` images empty
    np.savez(tmp_path / "d.npz", images=images)
    cfg = write_config(tmp_path / "c.yaml", {"data": {"source": "npz", "path": str(tmp_path / "d.npz")}})
    res = run_inproc(capsys, "preview", "--config", cfg, "--out", tmp_path / "p.png")
    assert res.returncode == 0
    assert f"blank after preprocessing: {blank} images blank, 0 nearly blank" in res.stdout
    if warned:  # 7 of 62 is 11%, over a tenth; 6 of 62 (9.7%) is not
        assert res.stderr.startswith("vitmask: warning: 7 of 62 images (11%) are blank or nearly blank")
    else:
        assert res.stderr == ""


def test_blank_counts_by_hand_with_one_percent_the_edge_of_nearly_blank():
    images = torch.zeros(6, 20, 20, dtype=torch.uint8)  # 400 pixels: under 1% is 0 < on < 4
    for i, on in enumerate([0, 1, 3, 4, 40, 0]):
        images[i].view(-1)[:on] = 1
    assert blank_counts(images) == (2, 2)
    assert blank_counts(images, chunk=4) == (2, 2)  # counted across chunks alike
    assert blank_counts(images[:0]) == (0, 0)
