"""The eval, reconstruct and inpaint commands end to end on a tiny trained checkpoint, and their bad input.

The commands run in-process through `cli.main` (the same parsing, error rendering and exit codes as
the `vitmask` executable), which spares each call a subprocess importing torch.
"""

import json

import pytest
import torch
from PIL import Image

from tests.conftest import assert_user_error, train_tiny
from vitmask.data.preprocess import binarize_images, load_image_file
from vitmask.store.checkpoint import load_model, save_checkpoint


@pytest.fixture
def run_cli(run_cli_in_process):
    """This module's CLI tests run in process (conftest.run_cli_in_process)."""
    return run_cli_in_process


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 30-step tiny model on 16x16 shapes (8x8 patches of 2x2)."""
    return train_tiny(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def user_image(tmp_path_factory):
    """A 20x12 gray PNG with a white bar: preprocessing pads it to 16x16."""
    path = tmp_path_factory.mktemp("img") / "bar.png"
    img = Image.new("L", (20, 12), 0)
    img.paste(255, (4, 3, 16, 9))
    img.save(path)
    return path


def test_eval_reports_every_ratio_in_a_table_and_the_same_numbers_as_json(run_cli, ckpt):
    args = ["eval", "--checkpoint", ckpt, "--split", "test", "--device", "cpu", "--seed", "3"]
    args += ["--mask-ratio", "0.25", "--mask-ratio", "0.5", "--mask-ratio", "0.75"]
    table, as_json = run_cli(*args), run_cli(*args, "--json")
    assert table.returncode == 0 and as_json.returncode == 0, table.stderr + as_json.stderr
    report = json.loads(as_json.stdout)
    assert [r["mask_ratio"] for r in report["results"]] == [0.25, 0.5, 0.75]
    for r in report["results"]:
        assert set(r["baselines"]) == {"majority", "position", "neighbour"}
        assert r["baselines"]["majority"]["acc"] == r["majority_acc"]
        assert f"mask ratio {r['mask_ratio']:g}" in table.stdout
        assert f"{r['acc']:.4f}" in table.stdout and f"{r['baselines']['neighbour']['acc']:.4f}" in table.stdout
    for label in ("per-position majority", "8-neighbour table", "bit acc", "most frequent confusions"):
        assert label in table.stdout


def test_inpaint_fills_only_the_boxed_patches(run_cli, ckpt, user_image, tmp_path):
    out = tmp_path / "filled.png"
    res = run_cli("inpaint", "--checkpoint", ckpt, "--image", user_image, "--box", "2,2,7,5", "--out", out)
    assert res.returncode == 0, res.stderr
    assert "filled 6 of 64 patches" in res.stdout  # x 2..6 touches 3 patch columns, y 2..4 two patch rows
    cfg = load_model(ckpt).config
    original = binarize_images(load_image_file(user_image).unsqueeze(0), cfg.data)[0]  # (16, 16)
    filled = (load_image_file(out) > 127).to(torch.uint8)
    assert filled.shape == (16, 16)
    keep = torch.ones(16, 16, dtype=torch.bool)
    keep[2:6, 2:8] = False  # the six 2x2 patches the box touches
    assert torch.equal(filled[keep], original[keep])


def test_inpaint_with_a_mask_image_and_iterative_filling(run_cli, ckpt, user_image, tmp_path):
    mask = Image.new("L", (20, 12), 0)
    mask.paste(255, (10, 5, 12, 6))  # one pixel row, two columns, of the original image
    mask.save(tmp_path / "mask.png")
    out = tmp_path / "filled.png"
    args = ["--image", user_image, "--mask", tmp_path / "mask.png", "--out", out, "--iterative", "--steps", "4"]
    res = run_cli("inpaint", "--checkpoint", ckpt, *args)
    assert res.returncode == 0, res.stderr
    assert "filled 1 of 64 patches" in res.stdout  # padded by (2, 0): pixels (7, 8) and (7, 9) share a patch


def test_eval_and_reconstruct_bad_input(run_cli, ckpt, tmp_path):
    assert_user_error(run_cli("eval", "--checkpoint", ckpt, "--mask-ratio", "0"), "--mask-ratio", "between 0 and 1")
    assert_user_error(
        run_cli("reconstruct", "--checkpoint", ckpt, "--out", tmp_path / "r.png", "--mask-ratio", "1"), "--mask-ratio"
    )
    assert not (tmp_path / "r.png").exists()
    state = torch.load(ckpt, weights_only=True)
    del state["model"]
    save_checkpoint(state, tmp_path / "nomodel.pt")
    assert_user_error(run_cli("eval", "--checkpoint", tmp_path / "nomodel.pt"), "no 'model' entry")


def test_inpaint_bad_input(run_cli, ckpt, user_image, tmp_path):
    out = tmp_path / "out.png"
    fake = tmp_path / "fake.png"
    fake.write_text("not an image")
    base = ["inpaint", "--checkpoint", ckpt, "--out", out]
    assert_user_error(run_cli(*base, "--image", fake, "--box", "0,0,4,4"), "not a readable image")
    assert_user_error(run_cli(*base, "--image", user_image, "--box", "0,0,17,4"), "--box", "outside")
    assert_user_error(run_cli(*base, "--image", user_image, "--box", "0,0,16,16"), "all 64 patches")
    Image.new("L", (10, 10), 255).save(tmp_path / "small_mask.png")
    res = run_cli(*base, "--image", user_image, "--mask", tmp_path / "small_mask.png")
    assert_user_error(res, "mask image is 10x10 pixels but the image is 20x12")
    assert not out.exists()


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda p: p, "checkpoint not found"),
        (lambda p: p.write_bytes(b""), "cannot read checkpoint"),
        (lambda p: p.write_text("a text file, no model\n"), "cannot read checkpoint"),
        (lambda p: p.mkdir(), "is a folder"),
    ],
    ids=["missing", "empty file", "text file", "folder without a model"],
)
def test_eval_confusion_on_what_is_no_model_says_what_it_is(run_cli, tmp_path, make, said):
    """--confusion needs a classifier; a path that holds no model at all is refused for that, not
    called a masked-patch model."""
    model = tmp_path / "model.pt"
    make(model)
    res = run_cli("eval", "--checkpoint", model, "--confusion", tmp_path / "cm.png")
    assert_user_error(res, "model.pt", said)
    assert "masked-patch model" not in res.stderr
    assert not (tmp_path / "cm.png").exists()


def test_eval_confusion_on_a_masked_patch_model_says_it_is_one(run_cli, ckpt, tmp_path):
    res = run_cli("eval", "--checkpoint", ckpt, "--confusion", tmp_path / "cm.png")
    assert_user_error(res, "--confusion", f"{ckpt} is a masked-patch model")
    assert not (tmp_path / "cm.png").exists()
