"""docs/own-data.md on images drawn dark on white: 56x56 PNG files of black shapes on white paper, in
class folders, through the guide's steps in order (config, preview, pack, train, probe, fine-tune with
configs/finetune-mnist.yaml as shipped, predict on raw files from the command line and from Python).

The user's config is the guide's (configs/mnist.yaml with the source, `data.fit=resize` for the 56x56
files and `data.invert=true` for the dark ink), with a small model for the test's time; training and
fine-tuning are shortened in steps (and the fine-tune's batch to 32 of the recipe's 64), and run without
compilation, as the guide tests run them.
The recipe says `fit: none` and `invert: false` for MNIST: the pack's header wins over it in one note
line, the classifier records the pack's values, and predict makes the raw files binary as the pack did.
The classes (a filled disc, a small filled square, a ring) are drawn so that a few dozen steps of a
tiny model learn them: the predictions on new drawings must be right.
"""

import csv
import json

import numpy as np
import pytest
import yaml
from PIL import Image, ImageDraw

import vitmask
from tests.conftest import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = ("disc", "dot", "ring")
SIDE = 56
SMALL_MODEL = ("model.hidden_dim=32", "model.num_heads=2", "model.depth=2", "model.ffn_dim=64", "model.token_conv=0")


def steps(n: int) -> list[str]:
    """The step-count shortening of a training command (and no compilation)."""
    keys = (f"train.max_steps={n}", f"train.eval_every={n}", f"train.checkpoint_every={n}", "train.compile=false")
    return [a for key in keys for a in ("--set", key)]


def draw(kind: str, rng) -> Image.Image:
    """One SIDE x SIDE drawing: black ink (0) on white paper (255)."""
    image = Image.new("L", (SIDE, SIDE), 255)
    r = {"disc": rng.uniform(15, 20), "ring": rng.uniform(14, 22), "dot": rng.uniform(3, 5)}[kind]
    cx, cy = rng.uniform(r + 3, SIDE - r - 3, 2)
    box = [cx - r, cy - r, cx + r, cy + r]
    pen = ImageDraw.Draw(image)
    if kind == "disc":
        pen.ellipse(box, fill=0)
    elif kind == "ring":
        pen.ellipse(box, outline=0, width=4)
    else:
        pen.rectangle(box, fill=0)
    return image


def write_drawings(root, per_class: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for kind in CLASSES:
        (root / kind).mkdir(parents=True)
        for i in range(per_class):
            draw(kind, rng).save(root / kind / f"{i:03d}.png")


def truth_and_guess(rows: list[dict]) -> list[tuple[str, str]]:
    return [(row["name"].replace("\\", "/").split("/")[-2], row["class_1"]) for row in rows]


def test_the_guide_on_dark_on_white_drawings_predicts_them_right(run_cli_in_process, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    write_drawings(tmp_path / "data" / "my-shapes", 30, seed=0)
    write_drawings(tmp_path / "new-shapes", 10, seed=1)  # drawings no step has seen

    def run(*args) -> str:
        res = run_cli_in_process(*args)
        assert res.returncode == 0, (args, res.stdout[-2000:], res.stderr[-2000:])
        return res.stderr

    # 2. a config: the guide's, for 56x56 dark-on-white files
    res = run_cli_in_process(
        "config", "--config", "configs/mnist.yaml", "--set", "name=my-shapes", "--set", "data.source=folder",
        "--set", "data.path=data/my-shapes", "--set", "data.fit=resize", "--set", "data.invert=true",
        "--set", "data.batch_size=32", *(a for key in SMALL_MODEL for a in ("--set", key)),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    (tmp_path / "my-shapes.yaml").write_text(res.stdout)
    assert run("preview", "--config", "my-shapes.yaml", "--out", "my-shapes-preview.png") == ""  # ink is foreground

    # 3. pack: the header records how the drawings were made binary
    assert run("pack", "--config", "my-shapes.yaml", "--out", "data/my-shapes.packed") == ""
    header = json.loads((tmp_path / "data" / "my-shapes.packed" / "header.json").read_text())
    assert (header["height"], header["fit"], header["invert"], header["threshold"]) == (28, "resize", True, 0.5)

    # 4. train, 5. probe
    packed = ["--set", "data.source=packed", "--set", "data.path=data/my-shapes.packed"]
    run("train", "--config", "my-shapes.yaml", *packed, *steps(20))
    run("probe", "--checkpoint", "runs/my-shapes/last.pt", "--split", "test")

    # 6. fine-tune with the MNIST recipe as shipped: the pack's header wins over its data keys
    recipe = yaml.safe_load((ROOT / "configs" / "finetune-mnist.yaml").read_text())["data"]
    assert (recipe["fit"], recipe["invert"]) == ("none", False)
    err = run(
        "finetune", "--checkpoint", "runs/my-shapes/last.pt", "--config", "configs/finetune-mnist.yaml", *packed,
        "--run-dir", "runs/my-shapes-classifier", "--set", "data.batch_size=32", *steps(60),
    )  # fmt: skip
    assert (
        "vitmask: note: data.fit=resize, data.invert=true from the pack's header (data/my-shapes.packed), "
        "over configs/finetune-mnist.yaml"
    ) in err.splitlines()
    classifier = vitmask.load_classifier("runs/my-shapes-classifier/last.pt")
    p = classifier.processor
    assert (p.image_size, p.fit, p.invert, p.threshold) == (28, "resize", True, 0.5)

    # 7. predict on the raw files: right, with no warning
    err = run(
        "predict", "--checkpoint", "runs/my-shapes-classifier/last.pt", "--input", "new-shapes", "--out", "preds.csv",
        "--top-k", "3",
    )  # fmt: skip
    assert err == ""
    with open("preds.csv", newline="") as f:
        pairs = truth_and_guess(list(csv.DictReader(f)))
    assert len(pairs) == 30
    assert sum(truth == guess for truth, guess in pairs) >= 27, pairs
    assert len({guess for _, guess in pairs}) == 3, pairs

    # and from Python, on the same files
    files = sorted((tmp_path / "new-shapes").rglob("*.png"))
    top = classifier.predict(files)
    right = sum(path.parent.name == names[0] for path, names in zip(files, top.names, strict=True))
    assert right >= 27 and len({names[0] for names in top.names}) == 3, top.names
    assert (top.fit, top.invert) == ("resize", True)
