"""`vitmask preview`: the PNG grid (size, content) and the dataset statistics."""

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import TINY, assert_user_error, run_cli, write_config
from tests.test_sources import run_inproc
from vitmask.config import config_from_dict
from vitmask.preview import dataset_stats


def test_preview_writes_the_grid_and_prints_statistics(tmp_path):
    rng = np.random.default_rng(0)
    images = (rng.random((50, 16, 16)) < 0.3).astype(np.uint8)  # 0/1, 16x16 like TINY
    np.savez(tmp_path / "d.npz", images=images)
    cfg = write_config(tmp_path / "c.yaml", {"data": {"source": "npz", "path": str(tmp_path / "d.npz")}})
    out = tmp_path / "sub" / "preview.png"
    res = run_cli("preview", "--config", cfg, "--out", out, "--count", "16")
    assert res.returncode == 0, res.stderr
    # 16 images, 8 per row, each row followed by its masked copy: 4 rows of 8 cells of 16 * 4 pixels
    png = np.asarray(Image.open(out).convert("RGB")).astype(int)
    cell, pad = 16 * 4, 2
    assert png.shape == (4 * (cell + pad) + pad, 8 * (cell + pad) + pad, 3)
    for r in range(4):
        for c in range(8):
            y, x = pad + r * (cell + pad), pad + c * (cell + pad)
            block = png[y : y + cell, x : x + cell]
            tinted = int((block[..., 2] > block[..., 0] + 40).sum())
            if r % 2 == 0:  # the image: black and white only, both present
                assert tinted == 0 and set(np.unique(block)) == {0, 255}
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
