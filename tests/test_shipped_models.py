"""The models shipped inside vitmask (src/vitmask/pretrained/), checked without retraining.

Each shipped folder is the registry's, holds its files, loads by name, is the model of its recipe,
has a card that names the build command, the data, its licence and the figures of shipped.json, and
scores on a slice of its own test split what the card says, within a stated tolerance. The listing
(`vitmask models`) is checked against shipped.json and the sizes of the files on disk. A shipped
MNIST model whose data is not where its config says is one line that says where to get it.

MNIST's slices read the idx files in conftest.MNIST_DIR; without them (and without VITMASK_CI=1,
under which a missing file is a failure) those checks skip.
"""

import gzip
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

import vitmask
from tests.conftest import MNIST_DIR, ROOT, assert_user_error
from vitmask import pretrained
from vitmask.config import config_from_dict
from vitmask.data.batches import load_labelled_splits
from vitmask.data.shapes import make_labelled_splits

pytestmark = pytest.mark.usefixtures("one_thread")
BUDGET = 5_000_000  # bytes: every shipped file together
SLICE = 500  # test images each accuracy check scores
MASKED = [m.name for m in pretrained.SHIPPED.values() if m.task == pretrained.MASKED]
LABELS = {  # how the listing names each figure of shipped.json, written out
    "acc_r0.5": "r=0.5 acc",
    "acc_nonempty_r0.5": "r=0.5 non-empty acc",
    "acc_nonempty_centre_box": "centre box non-empty acc",
    "nll_bound_nats": "NLL bound (nats/image)",
    "accuracy": "test accuracy",
}
HAS_MNIST = (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file() and (MNIST_DIR / "t10k-labels-idx1-ubyte.gz").is_file()


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


def needs_mnist() -> None:
    """Skip without MNIST's idx files, except in CI (VITMASK_CI=1), where they must be there."""
    if not HAS_MNIST:
        if os.environ.get("VITMASK_CI") == "1":
            pytest.fail(f"VITMASK_CI=1 and MNIST's t10k idx files are missing from {MNIST_DIR}")
        pytest.skip(f"needs MNIST's t10k idx files in {MNIST_DIR}")


def record(name: str) -> dict:
    return json.loads((pretrained.HERE / name / pretrained.METADATA_FILE).read_text())


def export_config(name: str) -> dict:
    return json.loads((pretrained.HERE / name / "config.json").read_text())


def files_of(folder) -> list:
    return [p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


# ---- the folders, their files and cards ---------------------------------------------------------------
def test_the_shipped_folders_are_the_registrys_and_fit_in_5_mb():
    folders = sorted(p.name for p in pretrained.HERE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(pretrained.names()) == ["mnist", "mnist-classifier", "shapes"]
    total = sum(p.stat().st_size for p in files_of(pretrained.HERE))
    assert total <= BUDGET, f"the shipped files take {total:,} bytes, more than {BUDGET:,}"


@pytest.mark.parametrize("name", pretrained.names())
def test_each_shipped_model_has_its_files_and_is_its_recipes_model(name):
    folder = pretrained.HERE / name
    want = {"model.safetensors", "config.json", "README.md", "shipped.json"} | (
        {"examples.npz"} if name in MASKED else set()
    )
    assert {p.name for p in files_of(folder)} == want
    model = pretrained.SHIPPED[name]
    recipe = yaml.safe_load((ROOT / model.recipe).read_text())
    trained = export_config(name)["training"]["config"]
    if "model" in recipe:  # a fine-tuning recipe takes its model from the pretrained one
        assert {k: trained["model"][k] for k in recipe["model"]} == recipe["model"]
    else:
        assert trained["model"] == export_config("mnist")["training"]["config"]["model"]
    kept = [k for k in recipe["data"] if k not in ("source", "path")]  # the build points MNIST at its idx file
    assert {k: trained["data"][k] for k in kept} == {k: recipe["data"][k] for k in kept}
    assert record(name)["task"] == model.task and record(name)["recipe"] == model.recipe


@pytest.mark.parametrize("name", ["mnist", "mnist-classifier"])
def test_the_mnist_models_record_the_tours_data_path(name):
    data = export_config(name)["training"]["config"]["data"]
    assert (data["source"], data["path"]) == ("idx", "data/mnist/MNIST/raw/t10k-images-idx3-ubyte")
    assert data["split_seed"] == 0 and (data["val_fraction"], data["test_fraction"]) == (0.1, 0.1)


@pytest.mark.parametrize("name", pretrained.names())
def test_each_card_names_the_build_command_the_data_its_licence_and_the_figures(name):
    card = (pretrained.HERE / name / "README.md").read_text()
    r = record(name)
    assert r["command"].startswith("python scripts/build_pretrained.py --data DIR")
    assert f"By `{r['command']}`" in card and all(c in card for c in r["commands"])
    assert r["data"]["licence"][1:] in card and r["data"]["learned_from"] in card  # [1:]: a sentence there
    # the Licence section's one line: the weights' licence, then the data's
    licence = card.split("\n## Licence\n\n", 1)[1].split("\n", 1)[0]
    assert licence.startswith("The weights: the MIT licence, as vitmask's code"), licence
    assert ("(CC BY-SA 3.0)" if name.startswith("mnist") else "no third-party licence") in licence, licence
    for key, value in r["metrics"].items():
        if key in pretrained.METRICS:
            assert (f"| {value:.2f} |" if key == "nll_bound_nats" else f"| {value:.4f} |") in card, key
    assert f"{r['host']['cpu']}, {r['host']['threads']} thread" in card and f"torch {r['host']['torch']}" in card
    if name.startswith("mnist"):
        assert all(w in card for w in ("Yann LeCun", "Corinna Cortes", "Christopher J.C. Burges", "CC BY-SA 3.0"))
        assert "8,000 train-split images of MNIST's 10,000 test-set images" in card
        assert "split 8,000 / 1,000 / 1,000 (train / val / test) by data.split_seed 0" in card
        bold = [line for line in card.splitlines() if line.startswith("**It learned from")]
        assert len(bold) == 1 and bold[0].endswith("**") and "do not score it on MNIST's test set" in bold[0]
    else:
        assert "no outside data" in card
    wanted = {"mnist": ["acc_r0.5", "acc_nonempty_r0.5", "acc_nonempty_centre_box", "nll_bound_nats"],
              "mnist-classifier": ["accuracy"], "shapes": ["acc_r0.5", "acc_nonempty_r0.5"]}[name]  # fmt: skip
    assert set(wanted) <= set(r["metrics"])


# ---- accuracy on a slice of each model's own test split ----------------------------------------------
def slice_of(name: str):
    """The first SLICE images of the model's test split (n, S, S) uint8 0/1 and their labels (n,)."""
    cfg = config_from_dict(export_config(name)["training"]["config"])
    if cfg.data.source == "shapes":  # the test split is drawn first: the same without train and val
        images, labels = make_labelled_splits(0, 0, cfg.data.num_test, cfg.data.image_size, cfg.split_seed)
    else:
        needs_mnist()
        moved = config_from_dict({**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "path": str(MNIST_DIR)}})
        data = load_labelled_splits(moved)
        images, labels = data.images, data.labels
    return images["test"][:SLICE], labels["test"][:SLICE]


def hand_patches(pixels: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, S, S) 0/1 -> (n, N, p*p) float patches, row by row, and (n, N) classes: the first pixel the top bit."""
    n, s = len(pixels), pixels.shape[-1]
    g = s // p
    patches = pixels.reshape(n, g, p, g, p).permute(0, 1, 3, 2, 4).reshape(n, g * g, p * p).float()
    weights = 2 ** torch.arange(p * p - 1, -1, -1, dtype=torch.float32)  # (p*p,) 8 4 2 1 for 2x2
    return patches, (patches * weights).sum(-1).long()


def tolerance(p: float, n: int) -> float:
    return 4 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("name", MASKED)
def test_a_masked_models_accuracy_at_ratio_half_on_a_slice_matches_its_card(name):
    """The card's r=0.5 accuracy is the mean, over its test images, of each image's accuracy a_i on its
    M = round(N / 2) hidden patches. Here SLICE of those images get fresh random masks of M patches
    (other draws than the card's) and their mean accuracy is compared with the card's figure p.

    Tolerance: 4 standard errors, the binomial sqrt(p (1 - p) / n) with n the slice's images. Each a_i
    lies in [0, 1] with mean p, so its variance is at most p (1 - p) (a Bernoulli's, the largest), and
    the patches of one image may be correlated without loosening it: sqrt(p (1 - p) / n) bounds the
    standard error of the slice's mean. The card's figure averages a superset of these images, so the
    difference's variance, p (1 - p) (1/n - 1/N), is smaller still. 4 of these standard errors are
    passed by chance with probability under 1e-4 (normal approximation); a wrong model, weights or
    preprocessing is off by far more."""
    model = vitmask.load_pretrained(name)
    images, _ = slice_of(name)
    patches, classes = hand_patches(images, model.processor.patch_size)
    n, num = classes.shape
    hidden = round(num / 2)
    g = torch.Generator().manual_seed(1234)
    order = torch.rand(n, num, generator=g).argsort(1)  # (n, N): a random order of each image's patches
    mask = torch.zeros(n, num, dtype=torch.bool).scatter_(1, order[:, :hidden], True)  # (n, N) M hidden each
    with torch.no_grad():
        pred = model(patches, mask).argmax(-1)  # (n, N)
    per_image = ((pred == classes) & mask).sum(1) / hidden  # (n,)
    p = record(name)["metrics"]["acc_r0.5"]
    assert abs(float(per_image.mean()) - p) <= tolerance(p, n), (float(per_image.mean()), p)


def test_the_classifiers_accuracy_on_a_slice_matches_its_card():
    """Each image is one Bernoulli trial (right or wrong): the slice's accuracy has the binomial
    standard error sqrt(p (1 - p) / n) exactly, p the card's test accuracy and n the slice's images.
    Tolerance 4 of them (a chance failure under 1e-4; the card's figure counts a superset of the
    slice, which only narrows the difference)."""
    classifier = vitmask.load_classifier("mnist-classifier")
    images, labels = slice_of("mnist-classifier")
    patches, _ = hand_patches(images, classifier.processor.patch_size)
    with torch.no_grad():
        pred = classifier.model(patches).argmax(-1)  # (n,) class indices, the labels 0..9 in order
    assert classifier.classes.values == list(range(10))
    acc, p = float((pred == labels).float().mean()), record("mnist-classifier")["metrics"]["accuracy"]
    assert abs(acc - p) <= tolerance(p, len(labels)), (acc, p)


@pytest.mark.parametrize("name", MASKED)
def test_the_example_images_are_the_first_of_the_test_split(name):
    examples = np.load(pretrained.HERE / name / "examples.npz")
    images, labels = slice_of(name)
    k = len(examples["images"])
    assert 24 <= k <= 64 and examples["images"].dtype == np.uint8
    assert np.array_equal(examples["images"], images[:k].numpy()) and np.array_equal(
        examples["labels"], labels[:k].numpy()
    )
    assert np.array_equal(examples["split_index"], np.arange(k))
    if name == "mnist":  # the positions in the t10k file: read it by hand and compare the images
        with gzip.open(MNIST_DIR / "t10k-images-idx3-ubyte.gz") as f:
            raw = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
        assert np.array_equal(examples["images"], (raw[examples["source_index"]] >= 128).astype(np.uint8))
        assert list(examples["label_names"]) == [str(i) for i in range(10)]


# ---- the listing ----------------------------------------------------------------------------------------
def test_vitmask_models_json_gives_the_recorded_figures_and_the_sizes_on_disk(run_cli):
    res = run_cli("models", "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [r["name"] for r in rows] == ["mnist", "mnist-classifier", "shapes"]
    for r in rows:
        folder = pretrained.HERE / r["name"]
        assert r["bytes"] == sum(os.path.getsize(p) for p in files_of(folder))
        metrics = record(r["name"])["metrics"]
        assert r["metrics"] == {k: v for k, v in metrics.items() if k in pretrained.METRICS}
        assert r["test_images"] == metrics["images"] and r["task"] == record(r["name"])["task"]
        assert r["data"] == record(r["name"])["data"]["summary"]


def test_vitmask_models_prints_each_models_task_data_size_and_figures(run_cli):
    res = run_cli("models")
    assert res.returncode == 0, res.stderr
    blocks = res.stdout.split("\n\n")
    for name, block in zip(pretrained.names(), blocks, strict=False):
        r = record(name)
        size = sum(os.path.getsize(p) for p in files_of(pretrained.HERE / name))
        head = block.splitlines()[0]
        assert head.startswith(f"{name}  {r['task']}, {size / 1e6:.2f} MB"), head
        assert f"data: {r['data']['summary']}" in block
        for key, label in LABELS.items():
            if key in r["metrics"]:
                value = r["metrics"][key]
                shown = f"{value:.2f}" if key == "nll_bound_nats" else f"{value:.4f}"
                assert f"{label} {shown}" in block, key


def test_the_listing_needs_no_torch():
    code = (
        "import sys; from vitmask.pretrained import listing, format_listing; "
        "print(format_listing(listing())); assert 'torch' not in sys.modules"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("mnist  ")


@pytest.fixture
def installed_copy(tmp_path, monkeypatch):
    """The shipped folders copied, standing in for the installed package's (pretrained.HERE), to damage."""
    copy = tmp_path / "pretrained"
    shutil.copytree(pretrained.HERE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    monkeypatch.setattr(pretrained, "HERE", copy)
    return copy


def test_a_changed_shipped_json_lists_no_figure_that_is_not_a_finite_number(run_cli, installed_copy):
    """shipped.json edited in the installed package: an image count that is text, figures that are a bool,
    NaN, inf or an integer past a float, a summary that is no text and a quick flag that is a word are
    left out of both listings (as never recorded), and --json stays strict JSON."""
    (installed_copy / "mnist" / pretrained.METADATA_FILE).write_text(
        '{"metrics": {"images": "many", "acc_r0.5": true, "acc_nonempty_r0.5": NaN, "nll_bound_nats": 1e400, '
        '"acc_nonempty_centre_box": ' + "9" * 400 + '}, "data": {"summary": 5}, "quick": "no"}'
    )
    res = run_cli("models", "--json")
    assert res.returncode == 0, res.stderr

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    rows = {r["name"]: r for r in json.loads(res.stdout, parse_constant=refuse)}
    assert (rows["mnist"]["test_images"], rows["mnist"]["metrics"]) == (None, {})
    assert (rows["mnist"]["data"], rows["mnist"]["quick"]) == ("", False)
    assert rows["shapes"]["metrics"] == {k: v for k, v in record("shapes")["metrics"].items() if k in LABELS}
    res = run_cli("models")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    mnist = res.stdout.split("\n\n")[0]
    assert "  figures: none recorded" in mnist and "(a --quick build" not in mnist


def test_a_damaged_or_missing_shipped_model_says_so_and_to_reinstall(run_cli, installed_copy, tmp_path, monkeypatch):
    """Files of the installed package changed: each verb says which shipped model is damaged or missing and
    to reinstall vitmask, never to export it again (the user exported nothing)."""
    weights = installed_copy / "mnist" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    (installed_copy / "mnist-classifier" / "config.json").write_text("{")
    shutil.rmtree(installed_copy / "shapes")
    monkeypatch.chdir(tmp_path)
    cases = [
        (("sample", "--checkpoint", "mnist", "--out", "s.png"), "mnist is damaged", "its SHA-256 differs"),
        (
            (
                "predict",
                "--checkpoint",
                "mnist-classifier",
                "--input",
                ROOT / "docs" / "inpaint_input.png",
                "--out",
                "p.csv",
            ),
            "mnist-classifier is damaged",
            "config.json cannot be read",
        ),  # fmt: skip
        (("sample", "--checkpoint", "shapes", "--out", "s.png"), "shapes is missing from this installation", ""),
    ]
    for args, problem, detail in cases:
        res = run_cli(*args)
        assert_user_error(res, f"the shipped model {problem}", detail, "reinstall vitmask")
        assert "export it again" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrained"]


# ---- a shipped model's missing data ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mnist", "mnist-classifier"])
def test_eval_of_a_shipped_mnist_model_without_the_data_says_where_to_get_it(run_cli, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    res = run_cli("eval", "--checkpoint", name, "--split", "test")
    assert_user_error(
        res,
        f"the shipped model {name} reads its test split from data/mnist/MNIST/raw/t10k-images-idx3-ubyte",
        "download MNIST with torchvision",
        "MNIST('data/mnist', download=True)",
        "run the command from the folder that holds data/",
    )
    assert list(tmp_path.iterdir()) == []


def test_with_mnist_where_the_tour_downloads_it_a_shipped_model_reads_it(run_cli, tmp_path, monkeypatch):
    needs_mnist()
    raw = tmp_path / "data" / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        with gzip.open(MNIST_DIR / f"{name}.gz") as src, open(raw / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    monkeypatch.chdir(tmp_path)
    res = run_cli("reconstruct", "--checkpoint", "mnist", "--n", "4", "--out", "r.png")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "left", [[], ["t10k-labels-idx1-ubyte"], ["t10k-labels-idx1-ubyte", "t10k-images-idx3-ubyte.gz"]]
)
def test_a_data_folder_without_the_data_file_is_missing_data(run_cli, tmp_path, monkeypatch, left):
    """The file a shipped model reads is checked, not its folder: the folder torchvision's download makes,
    holding other files but not this one, still says where to get it."""
    raw = tmp_path / "data" / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in left:
        (raw / name).write_bytes(b"not this file")
    monkeypatch.chdir(tmp_path)
    res = run_cli("eval", "--checkpoint", "mnist", "--split", "test")
    assert_user_error(
        res,
        "the shipped model mnist reads its test split from data/mnist/MNIST/raw/t10k-images-idx3-ubyte",
        "download MNIST with torchvision",
    )


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda f: f.write_bytes(b"not an idx file"), "is not a readable idx image file"),
        (lambda f: f.mkdir(), "no idx image files"),
    ],
    ids=["damaged", "a folder"],
)
def test_a_damaged_data_file_of_a_shipped_model_is_named_not_downloaded_again(
    run_cli, tmp_path, monkeypatch, make, said
):
    raw = tmp_path / "data" / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    make(raw / "t10k-images-idx3-ubyte")
    monkeypatch.chdir(tmp_path)
    res = run_cli("eval", "--checkpoint", "mnist", "--split", "test")
    assert_user_error(res, "data/mnist/MNIST/raw/t10k-images-idx3-ubyte", said)
    assert "download MNIST" not in res.stderr


@pytest.mark.parametrize(
    "name, file, args, said",
    [
        ("mnist", "model.safetensors", ("count-params", "--checkpoint", "mnist"), "model.safetensors is missing"),
        ("mnist", "config.json", ("count-params", "--checkpoint", "mnist"), "config.json is missing"),
        ("shapes", "shipped.json", ("models",), "has no readable shipped.json"),
    ],
)
def test_a_file_missing_from_a_shipped_models_folder_is_named(run_cli, installed_copy, name, file, args, said):
    (installed_copy / name / file).unlink()
    res = run_cli(*args)
    assert_user_error(res, f"the shipped model {name}", said, "reinstall vitmask")
