"""scripts/build_pretrained.py end to end, tiny: the whole build (train mnist, export its EMA, fine-tune
the classifier from it, train shapes, score each, write the examples, records and cards) with `--quick`
and `--set` keys that shrink every model and run, into a temp folder, on MNIST's test-set files of
conftest.MNIST_DIR. The figures each record keeps are scored again here on the built exports, in the
work folder the build leaves (--work); the examples are read from the test split by the data loader.
"""

import json
import os
import stat

import numpy as np
import pytest

from tests.conftest import MNIST_DIR, ROOT, run_script
from vitmask.cli import verbs
from vitmask.config import config_from_dict
from vitmask.data.batches import load_labelled_splits
from vitmask.data.binarization import foreground_share
from vitmask.pretrained import MNIST_PATH

pytestmark = pytest.mark.usefixtures("one_thread")
TINY_BUILD = [
    "train.max_steps=3", "train.eval_every=3", "train.checkpoint_every=3", "train.log_every=1",
    "train.warmup_steps=1", "train.eval_images=64", "finetune.freeze_steps=1", "data.num_train=200",
    "data.num_val=50", "data.num_test=100", "model.hidden_dim=16", "model.ffn_dim=32", "model.depth=1",
    "model.num_heads=2",
]  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        if os.environ.get("VITMASK_CI") == "1":
            pytest.fail(f"VITMASK_CI=1 and MNIST's t10k idx files are missing from {MNIST_DIR}")
        pytest.skip(f"needs MNIST's t10k idx files in {MNIST_DIR}")
    root = tmp_path_factory.mktemp("build")
    out = root / "out"
    (out / "mnist").mkdir(parents=True)
    (out / "mnist" / "stale.txt").write_text("from an earlier build")  # replaced whole
    sets = [x for key in TINY_BUILD for x in ("--set", key)]
    args = ["--data", MNIST_DIR, "--out", out, "--work", root / "work", "--quick", "--device", "cpu",
            "--exact-images", "3", *sets]  # fmt: skip
    res = run_script(ROOT / "scripts" / "build_pretrained.py", *args)
    assert res.returncode == 0, res.stderr[-3000:]
    return {"out": out, "work": root / "work", "stdout": res.stdout}


def record(built, name):
    return json.loads((built["out"] / name / "shipped.json").read_text())


def test_the_build_writes_each_folder_whole_and_readable_by_everyone(built):
    files = {
        "mnist": {"model.safetensors", "config.json", "README.md", "shipped.json", "examples.npz"},
        "mnist-classifier": {"model.safetensors", "config.json", "README.md", "shipped.json"},
        "shapes": {"model.safetensors", "config.json", "README.md", "shipped.json", "examples.npz"},
    }
    assert sorted(p.name for p in built["out"].iterdir()) == sorted(files)
    for name, want in files.items():
        assert {p.name for p in (built["out"] / name).iterdir()} == want, name
        for p in (built["out"] / name).iterdir():
            assert stat.S_IMODE(p.stat().st_mode) == 0o644, p


def test_the_mnist_models_record_the_tours_path_and_the_classifier_its_pretrained_name(built):
    for name in ("mnist", "mnist-classifier"):
        data = json.loads((built["out"] / name / "config.json").read_text())["training"]["config"]["data"]
        assert (data["source"], data["path"]) == ("idx", MNIST_PATH)
    meta = json.loads((built["out"] / "mnist-classifier" / "config.json").read_text())
    assert meta["task"] == "classifier" and meta["training"]["pretrained"] == "mnist"


def test_each_model_records_the_foreground_share_of_its_training_images(built, monkeypatch):
    """What the warnings of predict, inpaint and the Python calls compare images with (docs/own-data.md,
    docs/generation.md): the share of 1-pixels of the train split each training or fine-tuning read."""
    monkeypatch.chdir(built["work"])  # where the data sits at the recorded path
    for name in ("mnist", "mnist-classifier", "shapes"):
        meta = json.loads((built["out"] / name / "config.json").read_text())
        train = load_labelled_splits(config_from_dict(meta["training"]["config"])).images["train"]
        assert meta["training"]["foreground_share"] == foreground_share(train), name
    assert json.loads((built["out"] / "mnist" / "config.json").read_text())["weights"] == "ema"


def test_each_record_keeps_the_figures_eval_gives_on_the_built_export(built, monkeypatch):
    monkeypatch.chdir(built["work"])  # where the data sits at the recorded path
    r = verbs.evaluate_checkpoint("mnist", "test", [0.5], "cpu", 0, None, True, True, nll_exact_images=3)
    half, box = r["results"][0], r["results"][1]
    assert box["strategy"] == "centre"
    want = {"acc_r0.5": half["acc"], "acc_nonempty_r0.5": half["acc_nonempty"],
            "acc_nonempty_centre_box": box["acc_nonempty"], "acc_centre_box": box["acc"],
            "nll_bound_nats": r["nll"]["nats"], "nll_bound_bits_per_pixel": r["nll"]["bits_per_pixel"],
            "nll_bound_se_images": r["nll"]["se_images"], "split": "test", "images": 1000, "seed": 0,
            "nll_exact_images": 3, "nll_bound_same_images_nats": r["nll"]["exact"]["bound_same_images"],
            "nll_exact_raster_nats": r["nll"]["exact"]["fixed"]["nats"],
            "nll_exact_mixture_nats": r["nll"]["exact"]["mixture"]["nats"]}  # fmt: skip
    assert record(built, "mnist")["metrics"] == want
    r = verbs.evaluate_checkpoint("mnist-classifier", "test", [], "cpu", 0)
    assert record(built, "mnist-classifier")["metrics"] == {"split": "test", "images": 1000, "accuracy": r["accuracy"]}
    r = verbs.evaluate_checkpoint("shapes", "test", [0.5], "cpu", 0)["results"][0]
    got = record(built, "shapes")["metrics"]
    assert (got["acc_r0.5"], got["acc_nonempty_r0.5"], got["images"]) == (r["acc"], r["acc_nonempty"], 100)


def test_the_examples_are_the_first_images_of_the_test_split(built, monkeypatch):
    monkeypatch.chdir(built["work"])
    for name in ("mnist", "shapes"):
        cfg = config_from_dict(json.loads((built["out"] / name / "config.json").read_text())["training"]["config"])
        data = load_labelled_splits(cfg)
        examples = np.load(built["out"] / name / "examples.npz")
        assert np.array_equal(examples["images"], data.images["test"][:48].numpy())
        assert np.array_equal(examples["labels"], data.labels["test"][:48].numpy())
        assert list(record(built, name)["examples"]["split_index"]) == [0, 47]
    names = list(np.load(built["out"] / "shapes" / "examples.npz")["label_names"])
    assert names == ["rectangle", "ellipse", "line", "triangle"]


def test_the_records_and_cards_say_how_the_models_were_built(built):
    for name in ("mnist", "mnist-classifier", "shapes"):
        r, card = record(built, name), (built["out"] / name / "README.md").read_text()
        assert r["quick"] is True and card.startswith(f"# {name}: ") and "**A quick build**" in card
        assert r["command"] == "python scripts/build_pretrained.py --data DIR --quick --exact-images 3 " + " ".join(
            f"--set {k}" for k in TINY_BUILD
        )
        assert f"By `{r['command']}`" in card
        assert r["steps"] == 3 and f"({r['steps']} steps)" in card
        assert all(f"$ {c}" in built["stdout"] for c in r["commands"])  # what it recorded is what it ran
        assert r["host"]["threads"] == 1 and r["host"]["date"] in card
        licence = card.split("\n## Licence\n\n", 1)[1].split("\n", 1)[0]  # the weights' licence, then the data's
        assert licence.startswith("The weights: the MIT licence, as vitmask's code"), licence
        assert ("(CC BY-SA 3.0)" if name.startswith("mnist") else "no third-party licence") in licence, licence
    commands = record(built, "mnist-classifier")["commands"]
    assert commands[0].startswith("vitmask finetune --checkpoint mnist --config configs/finetune-mnist.yaml")
    mnist = (built["out"] / "mnist" / "README.md").read_text()
    assert (
        "**It learned from 8,000 of the 10,000 images of MNIST's test set: do not score it on MNIST's test set."
        in mnist
    )
    assert "the 8,000 train-split images of MNIST's 10,000 test-set images" in mnist
