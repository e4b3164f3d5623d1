"""The foreground-share warning of `vitmask predict` and the Python API (data/binarization.py), on real
images: a classifier fine-tuned on MNIST's test-set images records the share of 1-pixels of its training
images, and each call warns once when the images given are far from it. It must stay silent on MNIST's
own test images (every one alone, in batches of 16, all together) and on the data it was trained on, and
fire on dark-on-white drawings made binary without inverting them. A masked-patch model `vitmask train`
made records the share too, its export keeps it, and `vitmask inpaint` and the masked model's Python
calls (fill, logits, features) warn the same way.

The shares expected are counted here with numpy on the idx file (a pixel is foreground at gray level 128
or more, threshold 0.5 of 255): the MNIST test set is 13.4% foreground, one image 2.4% to 32.9%.
"""

import gzip
import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import vitmask
from tests.conftest import MNIST_DIR, TINY, assert_user_error
from vitmask.config import config_from_dict
from vitmask.data.batches import load_labelled_splits, load_splits
from vitmask.data.binarization import FAR_ABSOLUTE, far_from
from vitmask.data.processor import ProcessedImages
from vitmask.store.checkpoint import save_checkpoint
from vitmask.store.export import export
from vitmask.train.finetune import FinetuneTrainer
from vitmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
IMAGES = MNIST_DIR / "t10k-images-idx3-ubyte.gz"


def mnist() -> np.ndarray:
    """(10000, 28, 28) uint8: MNIST's test-set images, or a skip where the file is missing."""
    if not IMAGES.is_file():
        pytest.skip(f"needs MNIST's t10k idx files in {MNIST_DIR}")
    with gzip.open(IMAGES) as f:
        return np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28).copy()


def outlines(count: int, seed: int = 0) -> np.ndarray:
    """(count, 28, 28) uint8 gray drawings, dark on white: black outlines (2 pixels wide) of circles and
    squares on white paper."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        image = Image.new("L", (28, 28), 255)
        r = rng.uniform(6, 10)
        cx, cy = rng.uniform(r + 2, 26 - r, 2)
        shape = ImageDraw.Draw(image).ellipse if i % 2 else ImageDraw.Draw(image).rectangle
        shape([cx - r, cy - r, cx + r, cy + r], outline=0, width=2)
        out.append(np.asarray(image))
    return np.stack(out)


def share(gray: np.ndarray, invert: bool = False) -> np.ndarray:
    """Each image's share of foreground pixels at threshold 0.5 (gray level 128 or more), by numpy."""
    on = gray >= 128
    return (~on if invert else on).mean(axis=(1, 2))


@pytest.fixture(scope="module")
def config():
    mnist()  # skips without the file
    data = {"source": "idx", "path": str(IMAGES), "image_size": 28, "fit": "none", "split_seed": 0}
    train = {**TINY["train"], "max_steps": 2, "eval_every": 2, "checkpoint_every": 2}
    return config_from_dict({**TINY, "data": {**TINY["data"], **data}, "train": train})


@pytest.fixture(scope="module")
def checkpoint(config, tmp_path_factory):
    """A classifier fine-tuned 2 steps (from a random encoder) on MNIST's test-set images, split
    8,000 / 1,000 / 1,000: what matters here is what it records, not how well it classifies."""
    root = tmp_path_factory.mktemp("mnist-classifier")
    FinetuneTrainer(config, load_labelled_splits(config), torch.device("cpu")).fit(root, progress=False)
    return root / "last.pt"


def warnings_of(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("vitmask: warning:")]


def test_the_rule_on_every_mnist_test_image_and_on_drawings_made_binary_the_wrong_way_round():
    images = mnist()
    shares = share(images)
    trained = float(shares.mean())
    assert abs(trained - 0.134) < 0.001 and shares.min() > 0.024 and shares.max() < 0.33
    assert not any(far_from(float(s), trained, 1) for s in shares)  # every image alone
    batches = shares.reshape(-1, 16).mean(axis=1)  # 625 batches of 16 consecutive images
    assert not any(far_from(float(s), trained, 16) for s in batches)
    wrong = share(outlines(40))  # dark on white, not inverted: the paper is foreground
    assert wrong.min() > 0.75
    assert all(far_from(float(s), trained, 1) for s in wrong)
    right = share(outlines(40), invert=True)
    assert not far_from(float(right.mean()), trained, 40)
    # the edges, by hand: more than 0.25 apart; 16 images or more: over 3x or under a third
    assert far_from(trained + FAR_ABSOLUTE + 0.01, trained, 1) and not far_from(
        trained + FAR_ABSOLUTE - 0.01, trained, 1
    )
    assert far_from(0.04, 0.13, 16) and not far_from(0.04, 0.13, 15) and not far_from(0.05, 0.13, 16)
    assert far_from(0.16, 0.05, 16) and not far_from(0.16, 0.05, 15) and not far_from(0.14, 0.05, 16)


def test_the_classifier_records_its_training_images_share(checkpoint):
    recorded = torch.load(checkpoint, weights_only=False)["foreground_share"]
    assert abs(recorded - float(share(mnist()).mean())) < 0.01  # 4,096 of its 8,000 train images
    assert vitmask.load_classifier(checkpoint).trained_foreground_share == recorded


def test_silent_on_mnist_test_images_alone_in_batches_and_together(checkpoint, capsys):
    classifier = vitmask.load_classifier(checkpoint)
    images = mnist()
    shares = share(images)
    capsys.readouterr()
    classifier.predict(images[:2000])  # the 2,000 of the batches below, in one call
    for start in range(0, 2000, 16):
        classifier.predict(images[start : start + 16])
    for i in np.concatenate([shares.argsort()[:10], shares.argsort()[-10:]]):  # the emptiest and the fullest
        classifier.predict(images[i])
    assert warnings_of(capsys) == []


def test_silent_on_the_data_it_was_trained_on(checkpoint, config, capsys):
    classifier = vitmask.load_classifier(checkpoint)
    train = load_labelled_splits(config).images["train"]  # (8000, 28, 28) 0/1
    capsys.readouterr()
    classifier.predict(ProcessedImages(train[:2000], 2))  # 2,000 of them in one call
    classifier.predict(ProcessedImages(train[:16], 2))
    assert warnings_of(capsys) == []


def test_fires_once_a_call_on_dark_on_white_drawings(checkpoint, capsys):
    classifier = vitmask.load_classifier(checkpoint)
    drawings = outlines(30)
    capsys.readouterr()
    classifier.predict(drawings)
    (line,) = warnings_of(capsys)
    expected = round(float(share(drawings).mean()) * 100)
    assert f"the 30 images are {expected}% foreground (1-pixels) after the model's preprocessing" in line
    assert "where its training images were 13%" in line and "its predictions on them are likely wrong" in line
    classifier.features(drawings[0])
    assert len(warnings_of(capsys)) == 1  # one image alone: once
    classifier.predict(drawings, invert=True, force_preprocessing=True)  # made binary the right way round
    assert warnings_of(capsys) == []


def test_predict_warns_in_one_line_on_a_folder_of_drawings_and_not_on_one_of_digits(
    checkpoint, run_cli_in_process, tmp_path
):
    for name, images in (("digits", mnist()[:50]), ("drawings", outlines(20))):
        (tmp_path / name).mkdir()
        for i, image in enumerate(images):
            Image.fromarray(image).save(tmp_path / name / f"{i:02d}.png")
    res = run_cli_in_process(
        "predict", "--checkpoint", checkpoint, "--input", tmp_path / "digits", "--out", tmp_path / "d.csv"
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr
    res = run_cli_in_process(
        "predict", "--checkpoint", checkpoint, "--input", tmp_path / "drawings", "--out", tmp_path / "w.csv"
    )
    assert res.returncode == 0, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert line.startswith("vitmask: warning: the 20 images are") and "where its training images were 13%" in line
    assert "--invert/--no-invert and --threshold" in line
    res = run_cli_in_process(
        "predict", "--checkpoint", checkpoint, "--input", tmp_path / "drawings", "--out", tmp_path / "i.csv", "--invert"
    )
    assert_user_error(res, "--invert contradicts", "data.invert false", "--force-preprocessing")


def test_the_shipped_classifier_records_its_share_and_warns_on_drawings_not_on_digits(run_cli_in_process, tmp_path):
    """The shipped mnist-classifier, a new user's first classifier, records the share of its 8,000
    training digits (counted here with numpy: MNIST's test set is 13.4% foreground), so predict warns on
    dark-on-white drawings given to it as they are, and not on MNIST digits."""
    recorded = vitmask.load_classifier("mnist-classifier").trained_foreground_share
    assert recorded is not None and abs(recorded - float(share(mnist()).mean())) < 0.01
    for name, images in (("digits", mnist()[:16]), ("drawings", outlines(16))):
        (tmp_path / name).mkdir()
        for i, image in enumerate(images):
            Image.fromarray(image).save(tmp_path / name / f"{i:02d}.png")
    res = run_cli_in_process(
        "predict", "--checkpoint", "mnist-classifier", "--input", tmp_path / "digits", "--out", tmp_path / "d.csv"
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr
    res = run_cli_in_process(
        "predict", "--checkpoint", "mnist-classifier", "--input", tmp_path / "drawings", "--out", tmp_path / "w.csv"
    )
    assert res.returncode == 0, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert line.startswith("vitmask: warning: the 16 images are") and "where its training images were 13%" in line


# ---- masked-patch models: `vitmask train` records the share, inpaint and the Python calls check it --------
@pytest.fixture(scope="module")
def masked(config, tmp_path_factory):
    """A masked-patch model trained 2 steps on MNIST's test-set images (8,000 train), and its export."""
    root = tmp_path_factory.mktemp("mnist-masked")
    Trainer(config, load_splits(config), torch.device("cpu")).fit(root, progress=False)
    export(root / "last.pt", root / "export")
    return root


def png(tmp_path, name: str, gray: np.ndarray):
    Image.fromarray(gray).save(tmp_path / name)
    return tmp_path / name


def test_a_masked_patch_run_records_its_training_images_share_and_its_export_keeps_it(masked):
    recorded = torch.load(masked / "last.pt", weights_only=False)["foreground_share"]
    assert abs(recorded - float(share(mnist()).mean())) < 0.01  # 4,096 of its 8,000 train images
    meta = json.loads((masked / "export" / "config.json").read_text())
    assert meta["training"]["foreground_share"] == recorded
    for path in (masked / "last.pt", masked / "export"):
        assert vitmask.load_masked_model(path).trained_foreground_share == recorded


def test_the_masked_models_python_calls_warn_once_on_drawings_and_not_on_digits(masked, capsys):
    model = vitmask.load_masked_model(masked / "export")
    drawings, digits = outlines(30), mnist()[:2000]
    hidden = torch.zeros(model.num_patches, dtype=torch.bool)
    hidden[:98] = True  # the top half
    capsys.readouterr()
    model.fill(digits, hidden)
    for start in range(0, 320, 16):
        model.logits(digits[start : start + 16], hidden)
    model.features(digits[:16])
    assert warnings_of(capsys) == []
    model.fill(drawings, hidden)
    (line,) = warnings_of(capsys)  # fill's own check, not a second one from the prediction inside it
    expected = round(float(share(drawings).mean()) * 100)
    assert f"the 30 images are {expected}% foreground (1-pixels) after the model's preprocessing" in line
    assert "where its training images were 13%" in line and "invert= and threshold=" in line
    model.logits(drawings, hidden)
    model.features(drawings[0])
    assert len(warnings_of(capsys)) == 2  # once a call
    model.fill(drawings, hidden, invert=True, force_preprocessing=True)  # made binary the right way round
    assert warnings_of(capsys) == []


def test_inpaint_warns_in_one_line_on_a_drawing_and_not_on_a_digit(masked, run_cli_in_process, tmp_path):
    shares = share(mnist())
    fullest = mnist()[shares.argmax()]  # the digit of most ink: 32.9% foreground
    box = ["--box", "0,0,14,14"]
    for checkpoint in (masked / "last.pt", masked / "export"):
        res = run_cli_in_process(
            "inpaint", "--checkpoint", checkpoint, "--image", png(tmp_path, "digit.png", fullest),
            "--out", tmp_path / "d.png", *box,
        )  # fmt: skip
        assert res.returncode == 0 and res.stderr == "", res.stderr
        drawing = outlines(1)
        res = run_cli_in_process(
            "inpaint", "--checkpoint", checkpoint, "--image", png(tmp_path, "drawing.png", drawing[0]),
            "--out", tmp_path / "w.png", *box,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
        expected = round(float(share(drawing)[0]) * 100)
        assert line.startswith(f"vitmask: warning: the 1 image is {expected}% foreground (1-pixels)"), line
        assert "its predictions on it are likely wrong; check it is drawn as its training data" in line
        assert "where its training images were 13%" in line and "--invert/--no-invert and --threshold" in line
        assert (tmp_path / "w.png").is_file()


@pytest.mark.parametrize("value", [2.0, -0.5, "much", float("nan")])
def test_a_checkpoint_whose_share_is_not_a_share_is_one_line(masked, checkpoint, run_cli_in_process, tmp_path, value):
    image = png(tmp_path, "digit.png", mnist()[0])
    for source, args in (
        (masked / "last.pt", ["inpaint", "--image", image, "--box", "0,0,8,8", "--out", tmp_path / "o.png"]),
        (checkpoint, ["predict", "--input", image, "--out", tmp_path / "o.csv"]),
    ):
        state = torch.load(source, weights_only=False)
        state["foreground_share"] = value
        bad = tmp_path / f"bad-{source.parent.name}.pt"
        save_checkpoint(state, bad)  # with its checksum: a record written wrong, not a file damaged on disk
        res = run_cli_in_process(args[0], "--checkpoint", bad, *args[1:])
        assert_user_error(res, f"checkpoint {bad} is damaged: its foreground_share is {value}, not a number in [0, 1]")
        assert not (tmp_path / "o.png").exists() and not (tmp_path / "o.csv").exists()


def test_the_shipped_masked_patch_models_record_their_share_and_inpaint_warns_on_a_drawing(
    run_cli_in_process, tmp_path
):
    """The shipped mnist and shapes models record their training images' share (a rebuild records
    the same: test_build_pretrained), mnist's that of its 8,000 digits (13.4% by numpy)."""
    recorded = vitmask.load_masked_model("mnist").trained_foreground_share
    assert recorded is not None and abs(recorded - float(share(mnist()).mean())) < 0.01
    shapes = vitmask.load_masked_model("shapes")
    train = load_splits(shapes.config)["train"]  # the shapes it drew for its training
    assert abs(shapes.trained_foreground_share - float(train.double().mean())) < 0.01  # 4,096 of them
    args = ["inpaint", "--checkpoint", "mnist", "--box", "0,0,14,14"]
    res = run_cli_in_process(*args, "--image", png(tmp_path, "d.png", mnist()[0]), "--out", tmp_path / "d-out.png")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    res = run_cli_in_process(*args, "--image", png(tmp_path, "w.png", outlines(1)[0]), "--out", tmp_path / "w-out.png")
    assert res.returncode == 0 and "where its training images were 13%" in res.stderr, res.stderr
