"""A fine-tuned classifier you can use: `vitmask predict`, `vitmask export` of a fine-tuning checkpoint
(and its ONNX graph), the Python API (`load_classifier`, `load_masked_model`, the processor on
`load_pretrained`), and every verb given a classifier.

Expectations are computed independently of the code under test: images binarized by hand (>= 128),
cut into patches with reshape/permute, and run through a classifier built from the checkpoint's own
EMA entry (torch.load), softmaxed by torch.
"""

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.conftest import TINY, assert_user_error, train_tiny, write_config
from vitmask.config import config_from_dict
from vitmask.data.batches import load_labelled_splits
from vitmask.data.processor import ImageProcessor
from vitmask.evaluate.probe import extract_features
from vitmask.model.classifier import Classifier
from vitmask.model.vit import build_model
from vitmask.store.checkpoint import load_checkpoint
from vitmask.store.onnx_export import missing_onnx_packages
from vitmask.train.finetune import FinetuneTrainer

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
KINDS = ["rectangle", "ellipse", "line", "triangle"]  # the shapes' labels, by value


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """10 steps of the tiny masked-patch model on 16x16 shapes, with an EMA."""
    train = {"ema_decay": 0.9, "max_steps": 10, "eval_every": 10, "checkpoint_every": 10}
    return train_tiny(tmp_path_factory.mktemp("pre"), {"train": train})


@pytest.fixture(scope="module")
def finetuned(pretrained, tmp_path_factory):
    """6 steps of fine-tuning the tiny model on the shapes' labels, with an EMA; its last.pt."""
    train = {**TINY["train"], "max_steps": 6, "eval_every": 6, "checkpoint_every": 6, "ema_decay": 0.5}
    cfg = config_from_dict({**TINY, "train": train})
    run = tmp_path_factory.mktemp("ft")
    trainer = FinetuneTrainer(cfg, load_labelled_splits(cfg), CPU, load_checkpoint(pretrained)["ema"])
    trainer.fit(run, progress=False)
    return run / "last.pt"


@pytest.fixture(scope="module")
def exported(finetuned, tmp_path_factory):
    from vitmask.store.classifier import export_classifier

    out = tmp_path_factory.mktemp("exp") / "classifier"
    export_classifier(finetuned, out)
    return out


def reference(ckpt, weights="ema") -> Classifier:
    """The classifier of a fine-tuning checkpoint, built by hand from its own entries."""
    state = torch.load(ckpt, weights_only=True)
    cfg = config_from_dict(state["config"])
    model = Classifier(build_model(cfg), len(state[weights]["head.bias"]), 4, 0.01)
    model.load_state_dict(state[weights])
    return model.eval()


def hand_patches(gray: np.ndarray) -> torch.Tensor:
    """(B, 16, 16) gray levels -> (B, 64, 4) float 0/1 patches: >= 128 is foreground, 2x2 patches row by row."""
    pix = torch.from_numpy((gray >= 128).astype(np.float32))
    return pix.reshape(len(pix), 8, 2, 8, 2).permute(0, 1, 3, 2, 4).reshape(len(pix), 64, 4)


def hand_probabilities(ckpt, gray: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return reference(ckpt)(hand_patches(gray)).softmax(-1)  # (B, 4)


def some_images(n: int = 5, seed: int = 0) -> np.ndarray:
    """(n, 16, 16) uint8 gray levels: the shapes' test images at 0/255 with noise levels around the threshold."""
    images = load_labelled_splits(config_from_dict(TINY)).images["test"][:n].numpy().astype(np.int32) * 255
    noise = np.random.default_rng(seed).integers(0, 100, images.shape)
    return np.clip(images + noise - 40 * (images > 0), 0, 255).astype(np.uint8)


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


# ---- predict ----------------------------------------------------------------------------------------
def test_the_checkpoint_keeps_its_classes_and_predict_names_them(finetuned):
    assert load_checkpoint(finetuned)["labels"] == {"values": [0, 1, 2, 3], "names": KINDS}


def test_predict_on_a_folder_writes_the_probabilities_the_classifier_gives(run_cli, finetuned, tmp_path):
    import vitmask

    gray = some_images(5)
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    names = ["a.png", "b.png", "c.bmp", "d.png", "sub/e.png"]
    for name, image in zip(names, gray, strict=True):
        Image.fromarray(image).save(folder / name)
    out = tmp_path / "p.csv"
    res = run_cli("predict", "--checkpoint", finetuned, "--input", folder, "--out", out, "--top-k", "2")
    assert res.returncode == 0, res.stderr
    rows = read_csv(out)
    assert [r["name"] for r in rows] == names and list(rows[0]) == [
        "name",
        "class_1",
        "probability_1",
        "class_2",
        "probability_2",
    ]
    want = hand_probabilities(finetuned, gray)  # (5, 4)
    for row, probs in zip(rows, want, strict=True):
        top = probs.argsort(descending=True)[:2].tolist()
        assert [row["class_1"], row["class_2"]] == [KINDS[i] for i in top]
        got = [float(row["probability_1"]), float(row["probability_2"])]
        assert got == pytest.approx(probs[top].tolist(), abs=1e-6)

    # Python: the same images as arrays, as PIL images, as paths: the same answers as the file
    classifier = vitmask.load_classifier(finetuned)
    for images in (gray, [Image.fromarray(x) for x in gray], [folder / n for n in names]):
        top = classifier.predict(images, top_k=2)
        assert top.names == [[r["class_1"], r["class_2"]] for r in rows]
        file_probs = torch.tensor([[float(r["probability_1"]), float(r["probability_2"])] for r in rows])
        assert torch.allclose(top.probabilities, file_probs, atol=1e-6, rtol=0)
    assert torch.allclose(classifier.logits(gray).softmax(-1), want, atol=1e-6, rtol=0)
    assert classifier.names == KINDS


def test_predict_reads_an_image_an_npz_and_a_pack_and_writes_json(run_cli, finetuned, tmp_path):
    import vitmask

    classifier = vitmask.load_classifier(finetuned)
    gray = some_images(6, seed=1)
    np.savez(tmp_path / "x.npz", images=gray)
    out = tmp_path / "p.json"
    res = run_cli("predict", "--checkpoint", finetuned, "--input", tmp_path / "x.npz", "--out", out, "--top-k", "4")
    assert res.returncode == 0, res.stderr
    records = json.loads(out.read_text())
    assert [r["name"] for r in records] == [str(i) for i in range(6)]
    want = hand_probabilities(finetuned, gray)
    for r, probs in zip(records, want, strict=True):
        order = probs.argsort(descending=True).tolist()
        assert r["classes"] == [KINDS[i] for i in order]
        assert r["probabilities"] == pytest.approx(probs[order].tolist(), abs=1e-6)

    Image.fromarray(gray[2]).save(tmp_path / "one.png")
    res = run_cli("predict", "--checkpoint", finetuned, "--input", tmp_path / "one.png", "--out", tmp_path / "1.csv")
    assert res.returncode == 0, res.stderr
    (row,) = read_csv(tmp_path / "1.csv")
    assert row["name"] == "one.png" and row["class_1"] == records[2]["classes"][0]

    pack = tmp_path / "pack"
    assert run_cli("pack", "--config", write_config(tmp_path / "t.yaml"), "--out", pack).returncode == 0
    args = ["predict", "--checkpoint", finetuned, "--input", pack, "--split", "test", "--top-k", "3"]
    res = run_cli(*args, "--out", tmp_path / "pack.csv", "--batch-size", "10")
    assert res.returncode == 0, res.stderr
    rows = read_csv(tmp_path / "pack.csv")
    test = load_labelled_splits(config_from_dict(TINY)).images["test"]  # the pack's test split, unpacked by hand
    assert [r["name"] for r in rows] == [str(i) for i in range(len(test))]
    top = classifier.predict(test, top_k=3)  # 0/1 arrays are read as binary pixels
    assert [[r[f"class_{k}"] for k in (1, 2, 3)] for r in rows] == top.names
    got = torch.tensor([[float(r[f"probability_{k}"]) for k in (1, 2, 3)] for r in rows])
    assert torch.allclose(got, top.probabilities, atol=1e-6, rtol=0)


def test_bad_predict_input_is_one_line_and_writes_nothing(run_cli, finetuned, pretrained, tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(some_images(1)[0]).save(folder / "good.png")
    out = tmp_path / "p.csv"

    def predict(*args, checkpoint=finetuned, to=out):
        return run_cli("predict", "--checkpoint", checkpoint, "--out", to, *args)

    assert_user_error(predict("--input", tmp_path / "none"), "does not exist", "an .npz archive")
    (tmp_path / "notes.txt").write_text("x")
    assert_user_error(predict("--input", tmp_path / "notes.txt"), "'.txt' is not an input")
    assert_user_error(predict("--input", folder, checkpoint=pretrained), "not a fine-tuned classifier", "finetune")
    assert_user_error(predict("--input", folder, "--top-k", "0"), "--top-k must be at least 1")
    assert_user_error(predict("--input", folder, "--top-k", "5"), "--top-k 5 is out of range", "4 classes")
    assert_user_error(predict("--input", folder, "--split", "test"), "--split", "not one")
    assert_user_error(predict("--input", folder, to=tmp_path / "p.txt"), ".csv or .json")
    (tmp_path / "e.npz").write_bytes(b"PK not a zip")
    assert_user_error(predict("--input", tmp_path / "e.npz"), "not a readable .npz")
    np.savez(tmp_path / "k.npz", pictures=some_images(2))
    assert_user_error(predict("--input", tmp_path / "k.npz"), "no array 'images'", "--npz-key")
    (folder / "broken.png").write_bytes(b"\x89PNG not really")
    assert_user_error(predict("--input", folder), "broken.png", "not a readable image")
    assert not out.exists()

    out.write_text("mine")
    (folder / "broken.png").unlink()
    assert_user_error(predict("--input", folder), "already exists", "nothing was written")
    assert out.read_text() == "mine"

    pack = tmp_path / "pack"
    assert run_cli("pack", "--config", write_config(tmp_path / "t.yaml"), "--out", pack, "--set", "data.threshold=0.3")
    assert_user_error(predict("--input", pack, to=tmp_path / "q.csv"), "threshold 0.3", "threshold 0.5")
    assert not (tmp_path / "q.csv").exists()


# ---- the Python API ----------------------------------------------------------------------------------
def test_python_features_are_the_probes_features(finetuned, pretrained):
    import vitmask

    gray = some_images(4)
    pix = (torch.from_numpy(gray) >= 128).to(torch.uint8)
    # the classifier's features: its encoder's tokens pooled on the 4x4 grid, as vitmask probe pools them
    classifier = vitmask.load_classifier(finetuned)
    want = extract_features(reference(finetuned).encoder, pix, 2, grid=4)
    assert torch.allclose(classifier.features(gray), want, atol=1e-6, rtol=0)

    # the pretrained model's: probe's default pooling, and the mean of the tokens by hand
    model = vitmask.load_masked_model(pretrained)
    encoder = build_model(config_from_dict(TINY))
    encoder.load_state_dict(torch.load(pretrained, weights_only=True)["ema"])
    encoder.eval()
    assert torch.allclose(model.features(gray), extract_features(encoder, pix, 2, grid=4), atol=1e-6, rtol=0)
    with torch.no_grad():
        tokens = encoder.forward_encoder(hand_patches(gray))  # (4, 64, 32)
    assert torch.allclose(model.features(gray, pool="mean"), tokens.mean(1), atol=1e-6, rtol=0)


def test_python_masked_model_predicts_and_fills_hidden_patches_from_images(pretrained, tmp_path, run_cli):
    import vitmask

    gray = some_images(3)
    model = vitmask.load_masked_model(pretrained)
    hidden = torch.zeros(64, dtype=torch.bool)
    hidden[10:30] = True
    encoder = build_model(config_from_dict(TINY))
    encoder.load_state_dict(torch.load(pretrained, weights_only=True)["ema"])
    with torch.no_grad():
        want = encoder.eval()(hand_patches(gray), hidden.expand(3, -1))  # (3, 64, 16)
    assert torch.allclose(model.logits(gray, hidden), want, atol=1e-5, rtol=0)
    filled = model.fill(gray, hidden)  # (3, 16, 16)
    patches = filled.reshape(3, 8, 2, 8, 2).permute(0, 1, 3, 2, 4).reshape(3, 64, 4)
    classes = (patches.long() * torch.tensor([8, 4, 2, 1])).sum(-1)  # (3, 64)
    assert torch.equal(classes[:, hidden], want.argmax(-1)[:, hidden])
    assert torch.equal(patches[:, ~hidden].float(), hand_patches(gray)[:, ~hidden])

    out = tmp_path / "export"
    assert run_cli("export", "--checkpoint", pretrained, "--out", out).returncode == 0
    loaded = vitmask.load_pretrained(out)
    assert loaded.processor == ImageProcessor(16, 2, 0.5, False, "pad")
    with torch.no_grad():
        assert torch.allclose(loaded(loaded.processor(gray).patches, hidden.expand(3, -1)), want, atol=1e-5, rtol=0)


def test_import_vitmask_exports_the_api_lazily():
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = (
        "import sys, vitmask; assert 'torch' not in sys.modules; "
        "print(vitmask.load_classifier.__module__, vitmask.load_masked_model.__module__, "
        "vitmask.ImageProcessor.__module__)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src")}
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["vitmask.inference.classifier", "vitmask.inference.masked", "vitmask.data.processor"]


# ---- export -----------------------------------------------------------------------------------------
def test_an_exported_classifier_holds_the_ema_weights_its_classes_and_preprocessing(finetuned, exported):
    import vitmask

    state = torch.load(finetuned, weights_only=True)
    saved = load_file(exported / "model.safetensors")
    assert saved.keys() == state["ema"].keys()
    assert all(torch.equal(saved[k], v) for k, v in state["ema"].items())
    meta = json.loads((exported / "config.json").read_text())
    assert meta["task"] == "classifier" and meta["weights"] == "ema"
    assert meta["classifier"]["classes"] == [{"index": i, "label": i, "name": n} for i, n in enumerate(KINDS)]
    assert meta["classifier"]["pool"] == "grid" and meta["classifier"]["grid"] == 4
    assert meta["classifier"]["features"] == 16 * 32
    data = meta["data"]
    assert (data["image_size"], data["patch_size"], data["threshold"], data["invert"], data["fit"]) == (
        16,
        2,
        0.5,
        False,
        "pad",
    )
    assert "most significant bit" in data["bit_order"]
    card = (exported / "README.md").read_text()
    assert "rectangle, ellipse, line, triangle" in card and "vitmask.load_classifier" in card
    gray = some_images(4)
    a, b = vitmask.load_classifier(exported), vitmask.load_classifier(finetuned)
    assert torch.equal(a.logits(gray), b.logits(gray))
    assert ImageProcessor.from_pretrained(exported) == a.processor
    raw = vitmask.load_classifier(finetuned, weights="raw")
    with torch.no_grad():
        want = reference(finetuned, "model")(hand_patches(gray))
    assert torch.allclose(raw.logits(gray), want, atol=1e-6, rtol=0)


def test_every_verb_takes_or_refuses_a_classifier_in_one_line(run_cli, finetuned, exported, tmp_path):
    image = tmp_path / "in.png"
    Image.fromarray(some_images(1)[0]).save(image)
    for path in (exported, finetuned):
        res = run_cli("predict", "--checkpoint", path, "--input", image, "--out", tmp_path / f"{path.name}.json")
        assert res.returncode == 0, res.stderr
        res = run_cli("eval", "--checkpoint", path, "--split", "test", "--json", "--device", "cpu")
        assert res.returncode == 0 and json.loads(res.stdout)["task"] == "classifier", res.stderr
    again = tmp_path / "again"
    assert run_cli("export", "--checkpoint", exported, "--out", again).returncode == 0
    assert load_file(again / "model.safetensors").keys() == load_file(exported / "model.safetensors").keys()

    config = write_config(tmp_path / "c.yaml")
    for path in (exported, finetuned):
        for verb in (
            ["sample", "--out", tmp_path / "s.png", "--n", "2"],
            ["inpaint", "--image", image, "--box", "0,0,4,4", "--out", tmp_path / "f.png"],
            ["reconstruct", "--out", tmp_path / "r.png"],
            ["probe"],
            ["count-params"],
            ["finetune", "--config", config, "--run-dir", tmp_path / "ft"],
        ):
            assert_user_error(run_cli(verb[0], "--checkpoint", path, *verb[1:]), "fine-tuned classifier")
        assert_user_error(run_cli("train", "--config", config, "--init", path), "fine-tuned classifier")
    res = run_cli("export", "--checkpoint", finetuned, "--out", tmp_path / "e", "--encoder-only")
    assert_user_error(res, "exports whole", "--encoder-only")
    assert not (tmp_path / "e").exists() and not (tmp_path / "ft").exists()


@pytest.mark.skipif(bool(missing_onnx_packages()), reason=f"the onnx extra is missing: {missing_onnx_packages()}")
def test_the_classifiers_onnx_graph_takes_images_and_gives_torchs_logits(run_cli, finetuned, tmp_path):
    import onnx
    import onnxruntime

    out = tmp_path / "onnx"
    res = run_cli("export", "--checkpoint", finetuned, "--out", out, "--onnx")
    assert res.returncode == 0, res.stderr
    graph = onnx.load(out / "model.onnx").graph
    assert [i.name for i in graph.input] == ["images"] and [o.name for o in graph.output] == ["logits"]
    gray = some_images(5)  # a batch size other than the trace's
    pixels = (gray >= 128).astype(np.float32)
    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"images": pixels})
    with torch.no_grad():
        want = reference(finetuned)(hand_patches(gray))
    assert torch.allclose(torch.from_numpy(logits), want, atol=1e-4, rtol=0)


# ---- eval --------------------------------------------------------------------------------------------
def test_eval_scores_a_classifier_as_counted_by_hand_and_draws_its_confusion_matrix(run_cli, finetuned, tmp_path):
    from collections import Counter

    from vitmask.evaluate.classify import confusion_layout

    png = tmp_path / "cm.png"
    args = ["eval", "--checkpoint", finetuned, "--split", "test", "--device", "cpu", "--confusion", png]
    res = run_cli(*args, "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    data = load_labelled_splits(config_from_dict(TINY))
    images, labels = data.images["test"], data.labels["test"]
    with torch.no_grad():
        pred = reference(finetuned)(hand_patches(images.numpy() * 255)).argmax(1)
    pairs = Counter(zip(labels.tolist(), pred.tolist(), strict=True))
    want = [[pairs[(i, j)] for j in range(4)] for i in range(4)]
    assert report["confusion"] == want and report["images"] == len(labels) == 64
    assert report["accuracy"] == sum(want[i][i] for i in range(4)) / 64
    for i, row in enumerate(report["per_class"]):
        assert (row["name"], row["images"], row["correct"]) == (KINDS[i], sum(want[i]), want[i][i])
    majority = Counter(data.labels["train"].tolist()).most_common(1)[0][0]
    assert report["majority_class"] == KINDS[majority]
    assert report["majority_acc"] == sum(want[majority]) / 64

    picture = Image.open(png).convert("RGB")
    layout = confusion_layout(4)
    for i in range(4):
        for j in range(4):
            share = want[i][j] / sum(want[i]) if sum(want[i]) else 0.0
            colour = tuple(round(255 - share * (255 - b)) for b in (8, 48, 107))  # white to (8, 48, 107)
            x0, y0, _, _ = layout.box(i, j)
            assert picture.getpixel((x0 + 2, y0 + 2)) == colour, (i, j)

    text = run_cli(*args[:-2])
    assert text.returncode == 0, text.stderr
    assert f"accuracy {report['accuracy']:.4f}" in text.stdout
    assert all(name in text.stdout for name in KINDS)


def test_bad_eval_flags_for_a_classifier_are_one_line(run_cli, finetuned, pretrained, tmp_path):
    png = tmp_path / "cm.png"
    assert_user_error(run_cli("eval", "--checkpoint", finetuned, "--nll"), "--nll scores a masked-patch model")
    assert_user_error(run_cli("eval", "--checkpoint", finetuned, "--mask-ratio", "0.5"), "--mask-ratio")
    assert_user_error(run_cli("eval", "--checkpoint", finetuned, "--split", "train"), "use val or test")
    res = run_cli("eval", "--checkpoint", pretrained, "--confusion", png)
    assert_user_error(res, "--confusion", "masked-patch model")
    assert_user_error(run_cli("eval", "--checkpoint", finetuned, "--confusion", tmp_path / "cm.txt"), ".png")
    assert not png.exists()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (lambda m: json.dumps(m)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested more than 32"),
        (lambda m: json.dumps(m)[:-1] + ', "x": ' + "9" * 5000 + "}", "more than 4300 digits"),
        (lambda m: json.dumps({**m, "training": {**m["training"], "step": 10**400}}), "training.step is not a step"),
    ],
    ids=["lists-100000-deep", "integer-5000-digits", "step-past-int64"],
)
def test_a_classifier_export_with_a_hostile_config_json_is_one_line(run_cli, exported, tmp_path, text, needle):
    """A classifier's config.json is read with the same guards as a masked-patch export's: eval,
    predict and export refuse it in one line, and load_classifier raises the same UserError."""
    import shutil

    import vitmask
    from vitmask.errors import UserError

    out = tmp_path / "export"
    shutil.copytree(exported, out)
    (out / "config.json").write_text(text(json.loads((out / "config.json").read_text())))
    image = tmp_path / "in.png"
    Image.fromarray(some_images(1)[0]).save(image)
    assert_user_error(run_cli("eval", "--checkpoint", out, "--split", "test", "--device", "cpu"), needle)
    assert_user_error(run_cli("predict", "--checkpoint", out, "--input", image, "--out", tmp_path / "p.csv"), needle)
    assert_user_error(run_cli("export", "--checkpoint", out, "--out", tmp_path / "again"), needle)
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "again").exists()
    with pytest.raises(UserError, match=needle):
        vitmask.load_classifier(out)
