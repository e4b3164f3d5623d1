"""The generative commands end to end on a tiny checkpoint trained with the ratio schedule and mixed
masks: `sample`, `inpaint --samples`, `eval --nll --strategy --centre-box`, and their bad input.

The commands run in-process through `cli.main` (the same parsing, error rendering and exit codes as
the `vitmask` executable).
"""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import assert_user_error, train_tiny
from vitmask.config import load_config
from vitmask.data.batches import load_splits
from vitmask.data.preprocess import binarize_images, load_image_file


@pytest.fixture
def run_cli(run_cli_in_process):
    """This module's CLI tests run in process (conftest.run_cli_in_process)."""
    return run_cli_in_process


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 30-step tiny model on 16x16 shapes (8x8 patches of 2x2), cosine schedule, mixed masks."""
    root = tmp_path_factory.mktemp("gen")
    over = {
        "mask": {
            "ratio": 0.5,
            "ratio_schedule": "cosine",
            "strategy": "mixed",
            "block_share": 0.5,
            "block_min_patches": 4,
            "fill": "learned",
        }
    }
    return train_tiny(root, over)


@pytest.fixture(scope="module")
def user_image(tmp_path_factory):
    """A 16x16 gray PNG with a white bar (the model's own size: preprocessing changes nothing but the threshold)."""
    path = tmp_path_factory.mktemp("img") / "bar.png"
    img = Image.new("L", (16, 16), 0)
    img.paste(255, (3, 5, 13, 9))
    img.save(path)
    return path


def tiles(path, count: int, nrow: int, side: int, scale: int) -> list[torch.Tensor]:
    """Cut a make_grid PNG (padding 2) back into its `count` tiles, each (side, side) gray values 0..255."""
    grid = torch.from_numpy(np.array(Image.open(path).convert("L")))[::scale, ::scale]
    out = []
    for i in range(count):
        r, c = divmod(i, nrow)
        y, x = 2 + r * (side + 2), 2 + c * (side + 2)
        out.append(grid[y : y + side, x : x + side])
    return out


def test_sample_writes_a_grid_of_binary_images_that_a_seed_repeats(run_cli, ckpt, tmp_path):
    a, b, c = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.png"
    base = ["sample", "--checkpoint", ckpt, "--n", "5", "--steps", "4", "--device", "cpu"]
    res = run_cli(*base, "--seed", "1", "--out", a)
    assert res.returncode == 0, res.stderr
    assert "5 images of 16x16" in res.stdout
    # 5 images, 3 a row (ceil(sqrt(5))), 16 px with 2 px padding, drawn 3x: (2 * 18 + 2) x (3 * 18 + 2), times 3
    assert Image.open(a).size == (3 * 56, 3 * 38)
    for t in tiles(a, 5, 3, 16, 3):
        assert set(t.unique().tolist()) <= {0, 255}
    assert run_cli(*base, "--seed", "1", "--out", b).returncode == 0
    assert a.read_bytes() == b.read_bytes()
    assert run_cli(*base, "--seed", "2", "--out", c, "--order", "random").returncode == 0
    assert a.read_bytes() != c.read_bytes()
    # the default order is random (the any-order sampler), not MaskGIT's confidence order
    d, e = tmp_path / "d.png", tmp_path / "e.png"
    assert run_cli(*base, "--seed", "1", "--out", d, "--order", "random").returncode == 0
    assert run_cli(*base, "--seed", "1", "--out", e, "--order", "confidence").returncode == 0
    assert a.read_bytes() == d.read_bytes() != e.read_bytes()


def test_inpaint_samples_writes_the_input_and_k_different_completions(run_cli, ckpt, user_image, tmp_path):
    out = tmp_path / "k.png"
    args = ["inpaint", "--checkpoint", ckpt, "--image", user_image, "--box", "4,4,12,12", "--out", out]
    res = run_cli(*args, "--samples", "3", "--temperature", "1", "--iterative", "--steps", "4", "--seed", "3")
    assert res.returncode == 0, res.stderr
    assert "filled 16 of 64 patches" in res.stdout and "3 completions" in res.stdout
    cfg = load_config(ckpt.parent / "tiny.yaml")
    original = binarize_images(load_image_file(user_image).unsqueeze(0), cfg.data)[0].long() * 255  # (16, 16)
    hole = torch.zeros(16, 16, dtype=torch.bool)
    hole[4:12, 4:12] = True
    shown, *filled = tiles(out, 4, 4, 16, 4)
    assert (shown[hole] == 128).all() and torch.equal(shown[~hole].long(), original[~hole])  # grey hole
    for f in filled:
        assert torch.equal(f[~hole].long(), original[~hole]) and set(f[hole].unique().tolist()) <= {0, 255}
    assert len({f.numpy().tobytes() for f in filled}) > 1


def test_eval_scores_block_masks_the_centre_box_and_the_nll_bound(run_cli, ckpt):
    args = ["eval", "--checkpoint", ckpt, "--split", "test", "--device", "cpu", "--mask-ratio", "0.5"]
    args += ["--strategy", "block", "--centre-box", "--nll", "--nll-strata", "4", "--nll-samples", "2"]
    as_json, table = run_cli(*args, "--json"), run_cli(*args)
    assert as_json.returncode == 0 and table.returncode == 0, as_json.stderr + table.stderr
    report = json.loads(as_json.stdout)
    block, centre = report["results"]
    assert (block["strategy"], block["mask_ratio"]) == ("block", 0.5)
    assert (centre["strategy"], centre["mask_ratio"]) == ("centre", 0.25)
    assert centre["masked_patches"] == report["images"] * 16  # the 4x4 centre patches of the 8x8 grid
    for r in (block, centre):
        assert {"acc", "acc_nonempty", "bit_acc", "loss", "baselines"} <= set(r)
    nll = report["nll"]
    assert len(nll["per_image"]) == report["images"] and nll["pixels"] == 256
    assert nll["bits_per_pixel"] == pytest.approx(nll["nats"] / (256 * math.log(2)))
    # the Bernoulli baseline, counted here with numpy from the same splits
    cfg = load_config(ckpt.parent / "tiny.yaml")
    splits = load_splits(cfg)
    train, test = splits["train"].numpy().astype(float), splits["test"].numpy().astype(float)
    p = (train.sum(0) + 1) / (len(train) + 2)
    bern = -(test * np.log(p) + (1 - test) * np.log(1 - p)).sum((1, 2)).mean()
    assert nll["baselines"]["bernoulli"]["nats"] == pytest.approx(bern)
    for text in ("mask ratio 0.5, block masks", "centre box (mask ratio 0.25)", "NLL upper bound", "1 bit per pixel"):
        assert text in table.stdout
    assert f"{nll['nats']:.2f}" in table.stdout


def test_sample_bad_input(run_cli, ckpt, tmp_path):
    out = tmp_path / "s.png"
    base = ["sample", "--checkpoint", ckpt, "--device", "cpu"]
    assert_user_error(run_cli(*base, "--out", out, "--n", "0"), "--n must be at least 1")
    assert_user_error(run_cli(*base, "--out", out, "--steps", "0"), "--steps must be at least 1")
    assert_user_error(run_cli(*base, "--out", out, "--temperature", "-1"), "--temperature must be >= 0")
    assert_user_error(run_cli(*base, "--out", out, "--order", "sorted"), "--order must be one of")
    assert_user_error(run_cli(*base, "--out", out, "--choice-temperature", "-2"), "--choice-temperature")
    assert_user_error(run_cli(*base, "--out", tmp_path / "s.jpg"), "must end in .png")
    assert not out.exists()


def test_inpaint_sampling_bad_input(run_cli, ckpt, user_image, tmp_path):
    out = tmp_path / "o.png"
    base = ["inpaint", "--checkpoint", ckpt, "--image", user_image, "--box", "4,4,12,12", "--out", out]
    assert_user_error(run_cli(*base, "--samples", "0", "--temperature", "1"), "--samples must be at least 1")
    assert_user_error(run_cli(*base, "--samples", "2"), "2 identical completions", "--temperature 1")
    assert_user_error(run_cli(*base, "--temperature", "-0.1"), "--temperature must be >= 0")
    assert not out.exists()


def test_eval_generative_bad_input(run_cli, ckpt):
    base = ["eval", "--checkpoint", ckpt, "--device", "cpu"]
    assert_user_error(run_cli(*base, "--strategy", "mixed"), "--strategy must be one of random, block")
    assert_user_error(run_cli(*base, "--nll", "--nll-strata", "0"), "--nll-strata must be between 1 and the 64")
    assert_user_error(run_cli(*base, "--nll", "--nll-strata", "65"), "--nll-strata")
    assert_user_error(run_cli(*base, "--nll", "--nll-samples", "1"), "--nll-samples must be at least 2")
