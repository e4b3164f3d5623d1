"""A fine-tuned classifier on data that tells right from wrong: inverted images, label values that are
not 0..L-1 ({3, 7, 9}), classes listed out of the logits' order, splits whose majority classes
differ, mean pooling, several batches. Each test fails when that case is handled like the common one
(inverted zero or two times, classes named by index, the majority counted on the scored split, ...).

Expectations are independent of the code under test: images drawn here (a square, a row bar, a
column bar), binarized by hand (< 128 under data.invert), cut into patches with reshape/permute and
run through a classifier built from the checkpoint's own weights, softmaxed by torch; counts by hand.
"""

import csv
import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import vitmask
from tests.conftest import TINY, assert_user_error, train_tiny, write_config
from vitmask.config import config_from_dict
from vitmask.data.batches import load_labelled_splits
from vitmask.model.classifier import Classifier
from vitmask.model.vit import build_model
from vitmask.store.checkpoint import load_checkpoint
from vitmask.train.finetune import FinetuneTrainer

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
VALUES = [3, 7, 9]  # the digits' label values: not 0..L-1


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


def drawings(kinds, seed: int) -> np.ndarray:
    """(n, 16, 16) uint8: dark ink (0..79) on a light ground (170..255), each image one kind of drawing,
    moved by up to a pixel: 0 a square, 1 a row bar, 2 a column bar."""
    rng = np.random.default_rng(seed)
    gray = rng.integers(170, 256, (len(kinds), 16, 16))
    for i, kind in enumerate(kinds):
        dy, dx = rng.integers(-1, 2, 2)
        ink = np.zeros((16, 16), bool)
        if kind == 0:
            ink[3 + dy : 8 + dy, 3 + dx : 8 + dx] = True
        elif kind == 1:
            ink[10 + dy : 13 + dy, 1:15] = True
        else:
            ink[1:15, 10 + dx : 13 + dx] = True
        gray[i][ink] = rng.integers(0, 80, ink.sum())
    return gray.astype(np.uint8)


def finetune(pretrained, run, data: dict, train: dict, finetune_keys: dict | None = None):
    cfg = config_from_dict(
        {
            **TINY,
            "data": {**TINY["data"], **data},
            "train": {**TINY["train"], **train},
            "finetune": finetune_keys or {},
        }
    )
    FinetuneTrainer(cfg, load_labelled_splits(cfg), CPU, load_checkpoint(pretrained)["ema"]).fit(run, progress=False)
    return run / "last.pt"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    train = {"ema_decay": 0.9, "max_steps": 10, "eval_every": 10, "checkpoint_every": 10}
    return train_tiny(tmp_path_factory.mktemp("pre"), {"train": train})


@pytest.fixture(scope="module")
def digits(pretrained, tmp_path_factory):
    """An npz of 240 drawings labelled 3 (squares), 7 (row bars) and 9 (column bars), dark on light, and a
    classifier fine-tuned on it for 30 steps with data.invert true (the ink is the foreground)."""
    root = tmp_path_factory.mktemp("digits")
    labels = np.random.default_rng(0).choice(VALUES, 240, p=[0.5, 0.3, 0.2])
    np.savez(root / "digits.npz", images=drawings([VALUES.index(v) for v in labels], 1), labels=labels)
    data = {"source": "npz", "path": str(root / "digits.npz"), "invert": True}
    steps = {"max_steps": 30, "eval_every": 30, "checkpoint_every": 30}
    run = root / "run"
    run.mkdir()
    return finetune(pretrained, run, data, steps)


@pytest.fixture(scope="module")
def digits_export(digits, tmp_path_factory):
    from vitmask.store.classifier import export_classifier

    out = tmp_path_factory.mktemp("digits-export") / "classifier"
    export_classifier(digits, out)
    return out


# a folder source of its own train/val/test splits whose majority classes differ: b in train, a in val, c in test
COUNTS = {"train": {"a": 6, "b": 14, "c": 8}, "val": {"a": 5, "b": 2, "c": 3}, "test": {"a": 2, "b": 3, "c": 7}}


@pytest.fixture(scope="module")
def letters(pretrained, tmp_path_factory):
    """A classifier fine-tuned for 6 steps on the folder of COUNTS, its tokens pooled by their mean."""
    root = tmp_path_factory.mktemp("letters")
    for s, (split, counts) in enumerate(COUNTS.items()):
        for k, (name, count) in enumerate(counts.items()):
            (root / "images" / split / name).mkdir(parents=True)
            for i, image in enumerate(drawings([k] * count, seed=10 * s + k)):
                Image.fromarray(image).save(root / "images" / split / name / f"{i}.png")
    data = {"source": "folder", "path": str(root / "images"), "batch_size": 8}
    steps = {"max_steps": 6, "eval_every": 6, "checkpoint_every": 6, "ema_decay": 0.5}
    run = root / "run"
    run.mkdir()
    return finetune(pretrained, run, data, steps, {"pool": "mean"})


def reference(ckpt) -> Classifier:
    """The classifier of a fine-tuning checkpoint, built by hand from its own weights (the EMA's when it
    has them), pooled as its config says."""
    state = torch.load(ckpt, weights_only=True)
    cfg = config_from_dict(state["config"])
    weights = state["ema"] if state.get("ema") else state["model"]
    grid = None if cfg.finetune.pool == "mean" else cfg.finetune.grid
    model = Classifier(build_model(cfg), len(weights["head.bias"]), grid, 0.01)
    model.load_state_dict(weights)
    return model.eval()


def hand_patches(pixels) -> torch.Tensor:
    """(B, 16, 16) 0/1 pixels -> (B, 64, 4) float 2x2 patches, row by row."""
    pix = torch.as_tensor(np.asarray(pixels), dtype=torch.float32)
    return pix.reshape(len(pix), 8, 2, 8, 2).permute(0, 1, 3, 2, 4).reshape(len(pix), 64, 4)


def hand_probabilities(ckpt, pixels) -> torch.Tensor:
    with torch.no_grad():
        return reference(ckpt)(hand_patches(pixels)).softmax(-1)


def inverted(gray) -> np.ndarray:
    """data.invert true at threshold 0.5: a pixel is foreground where its level is below 128."""
    return (np.asarray(gray) < 128).astype(np.uint8)


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def csv_probabilities(rows, k: int) -> torch.Tensor:
    return torch.tensor([[float(r[f"probability_{i}"]) for i in range(1, k + 1)] for r in rows])


# ---- data.invert ----------------------------------------------------------------------------------------
def test_inverted_training_data_is_inverted_once_by_predict_and_python(run_cli, digits, digits_export, tmp_path):
    kinds = [0, 1, 2, 1, 0, 2]
    gray = drawings(kinds, seed=7)
    folder = tmp_path / "images"
    folder.mkdir()
    for i, image in enumerate(gray):
        Image.fromarray(image).save(folder / f"{i}.png")
    want = hand_probabilities(digits, inverted(gray))  # (6, 3)
    not_inverted = hand_probabilities(digits, 1 - inverted(gray))  # what zero or two inversions give
    assert (want - not_inverted).abs().max() > 0.1  # the two differ: the test tells them apart
    out = tmp_path / "p.csv"
    res = run_cli("predict", "--checkpoint", digits, "--input", folder, "--out", out, "--top-k", "3")
    assert res.returncode == 0, res.stderr
    got = csv_probabilities(read_csv(out), 3)
    assert torch.allclose(got, want.sort(descending=True).values, atol=1e-6, rtol=0)
    for path in (digits, digits_export):
        classifier = vitmask.load_classifier(path)
        assert classifier.processor.invert is True
        assert torch.allclose(classifier.probabilities(gray), want, atol=1e-6, rtol=0)
        assert torch.allclose(classifier.probabilities(list(gray)), want, atol=1e-6, rtol=0)
    assert json.loads((digits_export / "config.json").read_text())["data"]["invert"] is True


def test_a_pack_binarized_with_another_invert_is_refused_and_one_with_the_same_is_read_once(run_cli, digits, tmp_path):
    cfg = load_checkpoint(digits)["config"]
    config = write_config(tmp_path / "d.yaml", {"data": cfg["data"]})
    other = tmp_path / "other"
    assert run_cli("pack", "--config", config, "--set", "data.invert=false", "--out", other).returncode == 0
    out = tmp_path / "p.csv"
    res = run_cli("predict", "--checkpoint", digits, "--input", other, "--out", out)
    assert_user_error(res, "binarized with invert False", "trained with invert True")
    assert not out.exists()

    same = tmp_path / "same"
    assert run_cli("pack", "--config", config, "--out", same).returncode == 0
    res = run_cli("predict", "--checkpoint", digits, "--input", same, "--split", "test", "--out", out, "--top-k", "3")
    assert res.returncode == 0, res.stderr
    test = load_labelled_splits(config_from_dict(cfg)).images["test"]  # inverted once, when loaded
    want = hand_probabilities(digits, test)
    assert torch.allclose(csv_probabilities(read_csv(out), 3), want.sort(descending=True).values, atol=1e-6, rtol=0)


# ---- layouts ------------------------------------------------------------------------------------------------
def test_a_batch_of_channels_last_images_is_read_as_documented(run_cli, digits, tmp_path):
    gray = drawings([0, 1, 2, 2, 1], seed=8)
    want = hand_probabilities(digits, inverted(gray))
    classifier = vitmask.load_classifier(digits)
    rgb = np.repeat(gray[..., None], 3, axis=3)  # (B, H, W, 3): gray in every channel, the same luma
    for batch in (
        rgb,
        gray[..., None],
        torch.from_numpy(rgb),
        np.concatenate([rgb, np.full_like(gray[..., None], 255)], 3),
    ):
        assert torch.allclose(classifier.probabilities(batch), want, atol=1e-6, rtol=0), batch.shape
    np.savez(tmp_path / "rgb.npz", images=rgb)
    out = tmp_path / "p.json"
    res = run_cli("predict", "--checkpoint", digits, "--input", tmp_path / "rgb.npz", "--out", out, "--top-k", "3")
    assert res.returncode == 0, res.stderr
    records = json.loads(out.read_text())
    assert torch.allclose(
        torch.tensor([r["probabilities"] for r in records]), want.sort(descending=True).values, atol=1e-6
    )


# ---- label values that are not 0..L-1 ----------------------------------------------------------------------
def test_classes_labelled_3_7_9_are_named_and_valued_by_their_labels(run_cli, digits, tmp_path):
    assert load_checkpoint(digits)["labels"] == {"values": VALUES, "names": ["3", "7", "9"]}
    classifier = vitmask.load_classifier(digits)
    assert classifier.names == ["3", "7", "9"]
    truth = np.random.default_rng(3).choice(VALUES, 60)
    gray = drawings([VALUES.index(v) for v in truth], seed=9)
    top = classifier.predict(gray)
    hand = hand_probabilities(digits, inverted(gray)).argmax(1)  # (60,) column of each image's likeliest class
    assert top.classes[:, 0].tolist() == hand.tolist()
    assert top.labels[:, 0].tolist() == [VALUES[c] for c in hand.tolist()]
    assert [n[0] for n in top.names] == [str(VALUES[c]) for c in hand.tolist()]
    accuracy = float(np.mean(top.labels[:, 0].numpy() == truth))
    assert accuracy >= 0.9, accuracy  # it learned the drawings: a class named by another's label scores about 1/3

    res = run_cli("eval", "--checkpoint", digits, "--split", "test", "--json", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    test_labels = load_labelled_splits(config_from_dict(load_checkpoint(digits)["config"])).labels["test"]
    assert [(r["label"], r["name"], r["images"]) for r in report["per_class"]] == [
        (v, str(v), int((test_labels == v).sum())) for v in VALUES
    ]
    assert report["accuracy"] >= 0.9


def permuted_export(source, out, order: list[int]) -> None:
    """A copy of a classifier's export whose class k is the source's class order[k]: the head's rows
    and config.json's classes (index, label, name) moved together, the SHA-256 written anew."""
    shutil.copytree(source, out)
    weights = load_file(out / "model.safetensors")
    for key in ("head.weight", "head.bias"):
        weights[key] = weights[key][order].contiguous()
    save_file(weights, out / "model.safetensors")
    meta = json.loads((out / "config.json").read_text())
    classes = meta["classifier"]["classes"]
    meta["classifier"]["classes"] = [{**classes[j], "index": k} for k, j in enumerate(order)]
    meta["sha256"]["model.safetensors"] = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    (out / "config.json").write_text(json.dumps(meta))


def test_an_export_listing_its_classes_in_another_order_gives_the_same_named_answers(
    run_cli, digits, digits_export, tmp_path
):
    moved = tmp_path / "moved"
    permuted_export(digits_export, moved, [2, 0, 1])  # class 0 is now label 9, class 1 label 3, class 2 label 7
    a, b = vitmask.load_classifier(digits_export), vitmask.load_classifier(moved)
    assert b.names == ["9", "3", "7"] and b.classes.values == [9, 3, 7]
    gray = drawings([0, 1, 2, 0, 2, 1, 1], seed=11)
    top_a, top_b = a.predict(gray, top_k=3), b.predict(gray, top_k=3)
    assert top_b.names == top_a.names and torch.equal(top_b.labels, top_a.labels)
    assert torch.allclose(top_b.probabilities, top_a.probabilities, atol=1e-6, rtol=0)
    assert torch.allclose(b.probabilities(gray), a.probabilities(gray)[:, [2, 0, 1]], atol=1e-6, rtol=0)

    folder = tmp_path / "images"
    folder.mkdir()
    for i, image in enumerate(gray):
        Image.fromarray(image).save(folder / f"{i}.png")
    rows = {}
    for name, path in (("a", digits_export), ("b", moved)):
        assert (
            run_cli("predict", "--checkpoint", path, "--input", folder, "--out", tmp_path / f"{name}.json").returncode
            == 0
        )
        rows[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert [r["classes"] for r in rows["b"]] == [r["classes"] for r in rows["a"]]

    reports = {}
    for name, path in (("a", digits_export), ("b", moved)):
        res = run_cli("eval", "--checkpoint", path, "--split", "test", "--json", "--device", "cpu")
        assert res.returncode == 0, res.stderr
        reports[name] = json.loads(res.stdout)
    by_name = {n: {r["name"]: (r["label"], r["images"], r["correct"]) for r in reports[n]["per_class"]} for n in "ab"}
    assert by_name["b"] == by_name["a"]
    for key in ("accuracy", "majority_class", "majority_acc"):
        assert reports["b"][key] == reports["a"][key], key
    confusion_a = torch.tensor(reports["a"]["confusion"])
    assert reports["b"]["confusion"] == confusion_a[[2, 0, 1]][:, [2, 0, 1]].tolist()

    # classes whose listed indices are not 0, 1, 2 in order cannot be matched to the logits: refused
    shuffled = tmp_path / "shuffled"
    shutil.copytree(digits_export, shuffled)
    meta = json.loads((shuffled / "config.json").read_text())
    meta["classifier"]["classes"].reverse()
    (shuffled / "config.json").write_text(json.dumps(meta))
    res = run_cli("predict", "--checkpoint", shuffled, "--input", folder, "--out", tmp_path / "c.json")
    assert_user_error(res, "classifier.classes")


# ---- the majority-class floor and mean pooling ----------------------------------------------------------
def test_the_majority_class_floor_is_the_training_splits_majority(run_cli, letters):
    res = run_cli("eval", "--checkpoint", letters, "--split", "test", "--json", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    test = COUNTS["test"]
    assert report["majority_class"] == "b"  # train's majority (14 of 28); the test split's is c (7 of 12)
    assert report["majority_acc"] == test["b"] / sum(test.values())
    assert [(r["name"], r["images"]) for r in report["per_class"]] == list(test.items())
    # the validation the run recorded: the share of train's majority among the val images
    val = load_checkpoint(letters)["val"]
    for weights in ("raw", "ema"):
        assert val[weights]["majority_acc"] == pytest.approx(COUNTS["val"]["b"] / sum(COUNTS["val"].values()))


def test_a_mean_pooled_classifier_says_so_in_its_export_and_pools_by_the_mean(run_cli, letters, tmp_path):
    out = tmp_path / "export"
    assert run_cli("export", "--checkpoint", letters, "--out", out).returncode == 0
    meta = json.loads((out / "config.json").read_text())
    assert meta["classifier"]["pool"] == "mean" and meta["classifier"]["grid"] is None
    assert meta["classifier"]["features"] == TINY["model"]["hidden_dim"]
    assert meta["training"]["config"]["finetune"]["pool"] == "mean"
    gray = drawings([0, 1, 2], seed=12)
    pixels = (gray >= 128).astype(np.uint8)
    with torch.no_grad():
        tokens = reference(letters).encoder.forward_encoder(hand_patches(pixels))  # (3, 64, 32)
    for path in (letters, out):
        classifier = vitmask.load_classifier(path)
        assert classifier.model.grid is None
        assert torch.allclose(classifier.features(gray), tokens.mean(1), atol=1e-6, rtol=0)
        assert torch.allclose(classifier.probabilities(gray), hand_probabilities(letters, pixels), atol=1e-6, rtol=0)


# ---- predict's file ----------------------------------------------------------------------------------------
def test_predict_writes_full_precision_and_counts_npz_names_across_batches(run_cli, digits, tmp_path):
    gray = drawings([0, 1, 2, 0, 1, 2, 0], seed=13)
    np.savez(tmp_path / "x.npz", images=gray)
    out = tmp_path / "p.csv"
    args = ["predict", "--checkpoint", digits, "--input", tmp_path / "x.npz", "--top-k", "3", "--batch-size", "3"]
    assert run_cli(*args, "--out", out).returncode == 0
    rows = read_csv(out)
    assert [r["name"] for r in rows] == [str(i) for i in range(7)]  # 3 batches: 3, 3 and 1 images
    classifier = vitmask.load_classifier(digits)
    tops = [classifier.predict(gray[i : i + 3], top_k=3) for i in (0, 3, 6)]  # as predict batches them
    probabilities = [p for top in tops for p in top.probabilities.tolist()]
    # the file holds each float32 probability exactly: it reads back as the same number
    assert [[float(r[f"probability_{i}"]) for i in (1, 2, 3)] for r in rows] == probabilities
    assert [[r[f"class_{i}"] for i in (1, 2, 3)] for r in rows] == [n for top in tops for n in top.names]
    want = hand_probabilities(digits, inverted(gray)).sort(descending=True).values
    assert torch.allclose(csv_probabilities(rows, 3), want, atol=1e-6, rtol=0)  # image i is named i
    assert run_cli(*args, "--out", tmp_path / "p.json").returncode == 0
    records = json.loads((tmp_path / "p.json").read_text())
    assert [r["name"] for r in records] == [str(i) for i in range(7)]
    assert [r["probabilities"] for r in records] == probabilities
