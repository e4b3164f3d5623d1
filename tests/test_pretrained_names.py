"""A shipped model's name goes wherever a checkpoint goes: every verb's `--checkpoint`, `train --init`,
`finetune --checkpoint`, `predict --checkpoint`, and the Python loaders.

The shipped folder is replaced by tiny stand-ins (vitmask/pretrained's HERE points at a temp folder
holding exports named mnist, mnist-classifier and shapes), so each check is fast. The expectation of
each verb given a name is the same verb given the stand-in's folder path: the same output bytes, the
same numbers. An existing file or folder of the name wins; an unknown bare name is one line listing
the shipped names; a path that is not there keeps its loader's own "not found".
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import vitmask
from tests.conftest import TINY, assert_user_error, train_tiny, write_config
from vitmask import pretrained
from vitmask.cli import verbs
from vitmask.config import config_from_dict
from vitmask.data.batches import load_labelled_splits
from vitmask.errors import UserError
from vitmask.store.checkpoint import load_checkpoint
from vitmask.store.classifier import export_classifier
from vitmask.train.finetune import FinetuneTrainer

pytestmark = pytest.mark.usefixtures("one_thread")
NAMES_LISTED = "mnist, mnist-classifier, shapes"


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """A folder of tiny exports under the shipped names: mnist (the EMA weights of a 10-step tiny run),
    shapes (the same run's trained weights), mnist-classifier (a 4-step fine-tune of it on the shapes'
    labels); and an encoder-only export of the run, `other`, that is no shipped model."""
    root = tmp_path_factory.mktemp("stand-ins")
    train = {"ema_decay": 0.9, "max_steps": 10, "eval_every": 10, "checkpoint_every": 10}
    (root / "run").mkdir()
    ckpt = train_tiny(root / "run", {"train": train})
    shipped = root / "shipped"
    verbs.export(ckpt, shipped / "mnist", "ema")
    verbs.export(ckpt, shipped / "shapes", "raw")
    cfg = config_from_dict({**TINY, "train": {**TINY["train"], "max_steps": 4, "eval_every": 4}})
    trainer = FinetuneTrainer(cfg, load_labelled_splits(cfg), torch.device("cpu"), load_checkpoint(ckpt)["ema"])
    (root / "ft").mkdir()
    trainer.fit(root / "ft", progress=False)
    export_classifier(root / "ft" / "last.pt", shipped / "mnist-classifier")
    verbs.export(ckpt, root / "other", encoder_only=True)
    return root


@pytest.fixture
def shipped(stand_ins, monkeypatch):
    """The stand-ins in place of the shipped folders; returns their folder."""
    monkeypatch.setattr(pretrained, "HERE", stand_ins / "shipped")
    return stand_ins / "shipped"


def an_image(path):
    Image.fromarray((np.arange(256).reshape(16, 16) % 7 * 40).astype(np.uint8)).save(path)
    return path


# ---- every verb takes a name ------------------------------------------------------------------------
# verb, the model's name, its arguments after --checkpoint, the file it writes ("" when its output is stdout)
FILE_VERBS = [
    ("sample", "mnist", ["--out", "OUT.png", "--n", "4", "--steps", "2"], "OUT.png"),
    ("inpaint", "mnist", ["--image", "IMG", "--box", "0,0,8,8", "--out", "OUT.png"], "OUT.png"),
    ("reconstruct", "shapes", ["--out", "OUT.png", "--n", "4"], "OUT.png"),
    ("predict", "mnist-classifier", ["--input", "IMG", "--out", "OUT.csv", "--top-k", "2"], "OUT.csv"),
]
PRINT_VERBS = [
    ("eval", "mnist", ["--split", "test", "--json"]),
    ("eval", "mnist-classifier", ["--split", "test", "--json"]),
    ("probe", "shapes", ["--split", "test", "--per-class", "40", "--json"]),  # 40 of each class: the same for both
    ("count-params", "mnist", []),
]


@pytest.mark.parametrize("verb, name, args, out", FILE_VERBS, ids=[v[0] for v in FILE_VERBS])
def test_a_verb_that_writes_a_file_writes_the_same_file_for_the_name_as_for_the_folder(
    run_cli, shipped, tmp_path, verb, name, args, out
):
    image = an_image(tmp_path / "in.png")
    written = []
    for model, tag in ((name, "by-name"), (shipped / name, "by-path")):
        path = tmp_path / out.replace("OUT", tag)
        given = [str(path) if a == out else str(image) if a == "IMG" else a for a in args]
        res = run_cli(verb, "--checkpoint", model, *given)
        assert res.returncode == 0, res.stderr
        written.append(path.read_bytes())
    assert written[0] == written[1] and written[0]


@pytest.mark.parametrize("verb, name, args", PRINT_VERBS, ids=[f"{v[0]}-{v[1]}" for v in PRINT_VERBS])
def test_a_verb_that_prints_prints_the_same_for_the_name_as_for_the_folder(run_cli, shipped, verb, name, args):
    outputs = []
    for model in (name, shipped / name):
        res = run_cli(verb, "--checkpoint", model, *args)
        assert res.returncode == 0, res.stderr
        outputs.append(res.stdout)
    if "--json" in args:
        by_name, by_path = (json.loads(o) for o in outputs)
        assert by_name.pop("checkpoint") == name and by_path.pop("checkpoint") == str(shipped / name)
        assert by_name == by_path
    else:
        assert outputs[0] == outputs[1]


def test_count_params_with_overrides_counts_a_named_encoder_only_export_without_its_head(
    run_cli, stand_ins, tmp_path, monkeypatch
):
    """count-params --set rebuilds the model from its config: of an encoder-only export, without the head."""
    (tmp_path / "shipped").mkdir()
    shutil.copytree(stand_ins / "other", tmp_path / "shipped" / "shapes")
    monkeypatch.setattr(pretrained, "HERE", tmp_path / "shipped")
    counted = [
        run_cli("count-params", "--checkpoint", m, "--set", "model.dropout=0.1")
        for m in ("shapes", stand_ins / "other")
    ]
    assert counted[0].returncode == 0, counted[0].stderr
    assert counted[0].stdout == counted[1].stdout and "head" not in counted[0].stdout


def test_export_of_a_name_writes_its_weights(run_cli, shipped, tmp_path):
    res = run_cli("export", "--checkpoint", "mnist", "--out", tmp_path / "copy")
    assert res.returncode == 0, res.stderr
    got, want = load_file(tmp_path / "copy" / "model.safetensors"), load_file(shipped / "mnist" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "copy" / "config.json").read_text())["training"]["source"] == "mnist"
    res = run_cli("export", "--checkpoint", "mnist-classifier", "--out", tmp_path / "classifier")
    assert res.returncode == 0, res.stderr
    meta = json.loads((tmp_path / "classifier" / "config.json").read_text())
    assert meta["task"] == "classifier" and meta["training"]["source"] == "mnist-classifier"


def test_train_init_takes_a_name_and_the_run_records_it(run_cli, shipped, tmp_path):
    config = write_config(tmp_path / "run.yaml", {"train": {**TINY["train"], "max_steps": 2, "eval_every": 2}})
    res = run_cli("train", "--config", config, "--init", "mnist", "--run-dir", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    assert "from the ema weights of export dir mnist" in res.stdout
    assert load_checkpoint(tmp_path / "run" / "last.pt")["init"]["path"] == "mnist"


def test_finetune_takes_a_name_and_its_linear_probe_baseline_reads_the_named_model(run_cli, shipped, tmp_path):
    config = write_config(tmp_path / "ft.yaml", {"train": {**TINY["train"], "max_steps": 2, "eval_every": 2}})
    res = run_cli("finetune", "--checkpoint", "mnist", "--config", config, "--run-dir", tmp_path / "ft", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["checkpoint"] == "mnist" and "linear_probe" in report
    assert load_checkpoint(tmp_path / "ft" / "last.pt")["pretrained"] == "mnist"


def test_the_python_loaders_take_names(shipped):
    want = load_file(shipped / "mnist" / "model.safetensors")
    for model in (vitmask.load_pretrained("mnist"), vitmask.load_masked_model("mnist").model):
        state = model.state_dict()
        assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    classifier = vitmask.load_classifier("mnist-classifier")
    want = load_file(shipped / "mnist-classifier" / "model.safetensors")
    assert all(torch.equal(classifier.model.state_dict()[k], want[k]) for k in want)
    assert classifier.names == ["rectangle", "ellipse", "line", "triangle"]


# ---- what wins, and what is refused -------------------------------------------------------------------
def test_an_existing_folder_of_the_name_wins_over_the_shipped_model(run_cli, shipped, stand_ins, tmp_path, monkeypatch):
    """The working directory holds a folder `mnist`: the encoder-only export, which has no head."""
    shutil.copytree(stand_ins / "other", tmp_path / "mnist")
    monkeypatch.chdir(tmp_path)
    assert vitmask.load_pretrained("mnist").head is None
    assert vitmask.load_pretrained(shipped / "mnist").head is not None
    res = run_cli("sample", "--checkpoint", "mnist", "--out", "x.png")
    assert_user_error(res, "holds the encoder only")  # the folder here, not the shipped model
    counted = run_cli("count-params", "--checkpoint", "mnist").stdout
    assert counted == run_cli("count-params", "--checkpoint", stand_ins / "other").stdout
    assert counted != run_cli("count-params", "--checkpoint", shipped / "mnist").stdout


@pytest.mark.parametrize(
    "args",
    [
        ["sample", "--checkpoint", "mnst", "--out", "x.png"],
        ["eval", "--checkpoint", "mnst"],
        ["probe", "--checkpoint", "mnst"],
        ["reconstruct", "--checkpoint", "mnst", "--out", "x.png"],
        ["export", "--checkpoint", "mnst", "--out", "e"],
        ["count-params", "--checkpoint", "mnst"],
        ["predict", "--checkpoint", "mnst", "--input", "IMG", "--out", "p.csv"],
        ["finetune", "--checkpoint", "mnst", "--config", "CONFIG"],
        ["train", "--config", "CONFIG", "--init", "mnst"],
    ],
    ids=lambda a: a[0],
)
def test_an_unknown_name_is_one_line_that_lists_the_shipped_names(run_cli, shipped, tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    given = {"IMG": str(an_image(tmp_path / "in.png")), "CONFIG": str(write_config(tmp_path / "c.yaml"))}
    res = run_cli(*(given.get(a, a) for a in args))
    assert_user_error(res, "mnst", NAMES_LISTED, "a path to a .pt checkpoint or an export dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "in.png"]  # nothing written


def test_an_unknown_name_in_python_is_the_same_error():
    for load in (vitmask.load_pretrained, vitmask.load_masked_model, vitmask.load_classifier):
        with pytest.raises(UserError, match=f"mnst.*{NAMES_LISTED}"):
            load("mnst")


def test_a_path_that_is_not_there_keeps_its_not_found_message(run_cli, tmp_path):
    res = run_cli("sample", "--checkpoint", tmp_path / "runs" / "last.pt", "--out", tmp_path / "x.png")
    assert_user_error(res, "checkpoint not found")
    assert_user_error(run_cli("eval", "--checkpoint", "last.pt"), "checkpoint not found: last.pt")


def test_resolve_model_path_by_hand(shipped, tmp_path, monkeypatch):
    """The rule, case by case: an existing path wins, a name gives its folder (the same again when
    resolved twice), a bare unknown name is refused, anything else comes back as it was."""
    monkeypatch.chdir(tmp_path)
    assert pretrained.resolve_model_path("shapes") == shipped / "shapes"
    assert pretrained.resolve_model_path(shipped / "shapes") == shipped / "shapes"
    for unchanged in ("runs/x/last.pt", "last.pt", "model.v2", "sub/mnst"):
        assert pretrained.resolve_model_path(unchanged) == Path(unchanged)
    with pytest.raises(UserError, match=NAMES_LISTED):
        pretrained.resolve_model_path("mnist-classfier")
    (tmp_path / "mnst").write_text("not a model")
    assert pretrained.resolve_model_path("mnst") == Path("mnst")  # a file of that name: its loader speaks
