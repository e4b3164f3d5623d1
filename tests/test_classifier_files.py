"""A fine-tuned classifier's files are read in one pass and checked whole.

- every weight entry of a classifier checkpoint is checked, whichever is loaded: an extra key, a
  wrong shape or a missing tensor in the trained weights (the EMA loaded) or in the EMA (the raw
  weights loaded) is one line naming the entry, from eval, export, predict and `load_classifier`;
- a head of no rows, a head that is no matrix, a `labels` entry that does not fit the head (a label
  outside int64, a bool, a float, a value twice, lists of other lengths, a name that is no text):
  one line, no warning; the same for an export's `classifier.classes`;
- loading an export dir reads config.json once and model.safetensors once, for a classifier and for
  a masked-patch model, and a checkpoint once.

Expectations: checkpoints and config.json edited by hand; the counts of reads by spies on open.
"""

import builtins
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import TINY, assert_user_error, train_tiny
from tests.test_classifier import some_images
from vitmask.config import config_from_dict
from vitmask.errors import UserError
from vitmask.store.checkpoint import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("pre"), {"train": {"max_steps": 6, "eval_every": 6}})


@pytest.fixture(scope="module")
def finetuned(pretrained, tmp_path_factory):
    """Fine-tuned 4 steps with an EMA: both weight entries."""
    from vitmask.data.batches import load_labelled_splits
    from vitmask.train.finetune import FinetuneTrainer

    train = {**TINY["train"], "max_steps": 4, "eval_every": 4, "ema_decay": 0.5}
    cfg = config_from_dict({**TINY, "train": train})
    run = tmp_path_factory.mktemp("ft")
    FinetuneTrainer(cfg, load_labelled_splits(cfg), torch.device("cpu"), load_checkpoint(pretrained)["model"]).fit(
        run, progress=False
    )
    return run / "last.pt"


@pytest.fixture(scope="module")
def exported(finetuned, tmp_path_factory):
    from vitmask.store.classifier import export_classifier

    out = tmp_path_factory.mktemp("exp") / "classifier"
    export_classifier(finetuned, out)
    return out


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "in.png"
    Image.fromarray(some_images(1)[0]).save(path)
    return path


def edited(finetuned: Path, path: Path, change) -> Path:
    state = load_checkpoint(finetuned)
    state.pop("format")
    change(state)
    return save_checkpoint(state, path)


def every_use_refuses(run_cli, path: Path, image: Path, tmp_path: Path, *needles: str, weights=()) -> None:
    """eval, export, predict: one line naming `needles`, nothing written; load_classifier: the same UserError."""
    import vitmask

    assert_user_error(run_cli("eval", "--checkpoint", path, "--split", "test", "--device", "cpu", *weights), *needles)
    assert_user_error(run_cli("export", "--checkpoint", path, "--out", tmp_path / "e", *weights), *needles)
    res = run_cli("predict", "--checkpoint", path, "--input", image, "--out", tmp_path / "p.csv", *weights)
    assert_user_error(res, *needles)
    assert not (tmp_path / "e").exists() and not (tmp_path / "p.csv").exists()
    with pytest.raises(UserError) as refused:
        vitmask.load_classifier(path, weights=weights[1] if weights else None)
    assert all(n in str(refused.value) for n in needles), str(refused.value)


# ---- both weight entries of a classifier checkpoint ------------------------------------------------------
DAMAGE = {
    "an extra key": (lambda w: w.update(extra=torch.zeros(2)), "unexpected: extra"),
    "a wrong shape": (
        lambda w: w.update({"encoder.embed.weight": torch.zeros(32, 5)}),
        "encoder.embed.weight (32, 5) vs (32, 4)",
    ),
    "a missing tensor": (lambda w: w.pop("encoder.blocks.0.ffn.fc2.bias"), "missing: encoder.blocks.0.ffn.fc2.bias"),
    "a head of other rows": (lambda w: w.update({"head.bias": torch.zeros(5)}), "head.bias (5,) vs (4,)"),
}


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_raw_entry_is_refused_when_the_ema_is_loaded(run_cli, finetuned, image, tmp_path, how):
    bad = edited(finetuned, tmp_path / "bad.pt", lambda s: DAMAGE[how][0](s["model"]))
    needles = (f"checkpoint {bad} is damaged: its trained weights ('model' entry) do not fit", DAMAGE[how][1])
    every_use_refuses(run_cli, bad, image, tmp_path, *needles)


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_ema_entry_is_refused_when_the_raw_weights_are_loaded(run_cli, finetuned, image, tmp_path, how):
    bad = edited(finetuned, tmp_path / "bad.pt", lambda s: DAMAGE[how][0](s["ema"]))
    needles = ("its EMA weights ('ema' entry) do not fit", DAMAGE[how][1])
    every_use_refuses(run_cli, bad, image, tmp_path, *needles, weights=("--weights", "raw"))


def test_an_untouched_classifier_checkpoint_gives_either_entry(finetuned):
    import vitmask

    state = torch.load(finetuned, weights_only=True)
    for weights, entry in (("ema", "ema"), ("raw", "model")):
        loaded = vitmask.load_classifier(finetuned, weights=weights).model.state_dict()
        assert loaded.keys() == state[entry].keys()
        assert all(torch.equal(loaded[k], v) for k, v in state[entry].items())


# ---- the head and the classes ---------------------------------------------------------------------------
def no_rows(state):
    for entry in ("model", "ema"):
        state[entry]["head.weight"] = state[entry]["head.weight"][:0]
        state[entry]["head.bias"] = state[entry]["head.bias"][:0]


HEADS_AND_LABELS = {
    "a head of 0 rows": (no_rows, "its classifier's head has 0 rows, so it has no class"),
    "a head that is no matrix": (
        lambda s: s["ema"].update({"head.weight": torch.zeros(4)}),
        "its classifier has no head weights",
    ),
    "a label past int64": (lambda s: s["labels"]["values"].__setitem__(0, 2**63), "label 9223372036854775808"),
    "a label below int64": (lambda s: s["labels"]["values"].__setitem__(2, -(2**63) - 1), "not an integer in"),
    "a label that is a bool": (lambda s: s["labels"]["values"].__setitem__(1, True), "holds the label True"),
    "a label that is a float": (lambda s: s["labels"]["values"].__setitem__(1, 1.0), "holds the label 1.0"),
    "a label twice": (lambda s: s["labels"]["values"].__setitem__(1, 0), "holds a label value twice"),
    "a label too few": (lambda s: s["labels"]["values"].pop(), "holds 3 label values and 4 names for a head of 4"),
    "a name that is no text": (lambda s: s["labels"]["names"].__setitem__(3, 3), "a class name that is not text"),
    "labels that are no lists": (lambda s: s.update(labels={"values": 4, "names": "abcd"}), "is not a list"),
}


@pytest.mark.parametrize("how", HEADS_AND_LABELS)
def test_a_checkpoint_whose_head_or_classes_do_not_fit_is_one_line(run_cli, finetuned, image, tmp_path, how):
    change, needle = HEADS_AND_LABELS[how]
    bad = edited(finetuned, tmp_path / "bad.pt", change)
    every_use_refuses(run_cli, bad, image, tmp_path, f"checkpoint {bad} is damaged", needle)


def classes_edit(meta, how):
    classes = meta["classifier"]["classes"]
    if how == "no classes":
        classes.clear()
    elif how == "an index out of order":
        classes[1]["index"] = 2
    elif how == "a bool index":
        classes[1]["index"] = True
    else:
        key, value = {
            "a label past int64": ("label", 2**63),
            "a label below int64": ("label", -(2**63) - 1),
            "a label of 10^400": ("label", 10**400),
            "a label that is a bool": ("label", True),
            "a label that is a float": ("label", 2.0),
            "a label twice": ("label", 0),
            "a name that is no text": ("name", None),
        }[how]
        classes[1][key] = value


EXPORT_CLASSES = {
    "a label past int64": "not an integer in",
    "a label below int64": "not an integer in",
    "a label of 10^400": "not an integer in",
    "a label that is a bool": "holds the label True",
    "a label that is a float": "holds the label 2.0",
    "a label twice": "holds a label value twice",
    "a name that is no text": "a class name that is not text",
    "no classes": "no valid classifier.classes",
    "an index out of order": "no valid classifier.classes",
    "a bool index": "no valid classifier.classes",
}


@pytest.mark.parametrize("how", EXPORT_CLASSES)
def test_an_export_whose_classes_are_not_integers_in_int64_each_once_is_one_line(
    run_cli, exported, image, tmp_path, how
):
    out = tmp_path / "copy"
    shutil.copytree(exported, out)
    meta = json.loads((out / "config.json").read_text())
    classes_edit(meta, how)
    (out / "config.json").write_text(json.dumps(meta))
    every_use_refuses(run_cli, out, image, tmp_path, f"export dir {out}", EXPORT_CLASSES[how])


# ---- one pass ------------------------------------------------------------------------------------------
def count_opens(monkeypatch) -> dict:
    """Count the Python-level opens of each file name (safetensors reads its file in Rust: its SHA-256
    is read through Python's open, and load_file is counted apart)."""
    import safetensors.torch

    counts: dict[str, int] = {}
    real_open, real_read_text, real_load = builtins.open, Path.read_text, safetensors.torch.load_file

    def spied_open(file, *args, **kwargs):
        if isinstance(file, (str, Path)):
            counts[Path(file).name] = counts.get(Path(file).name, 0) + 1
        return real_open(file, *args, **kwargs)

    def spied_read_text(self, *args, **kwargs):
        counts[self.name] = counts.get(self.name, 0) + 1
        return real_read_text(self, *args, **kwargs)

    def spied_load(file, *args, **kwargs):
        counts["load_file"] = counts.get("load_file", 0) + 1
        return real_load(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spied_open)
    monkeypatch.setattr(Path, "read_text", spied_read_text)
    monkeypatch.setattr(safetensors.torch, "load_file", spied_load)
    return counts


def test_loading_an_export_or_a_checkpoint_reads_each_file_once(finetuned, exported, pretrained, tmp_path, monkeypatch):
    import vitmask
    from vitmask.store.classifier import load_classifier_model
    from vitmask.store.export import export, load_model

    masked = tmp_path / "masked"
    export(pretrained, masked)
    counts = count_opens(monkeypatch)
    load_classifier_model(exported)
    assert counts == {"config.json": 1, "model.safetensors": 1, "load_file": 1}
    counts.clear()
    vitmask.load_classifier(finetuned)
    assert counts == {"last.pt": 1}
    counts.clear()
    load_model(masked)
    assert counts == {"config.json": 1, "model.safetensors": 1, "load_file": 1}
    counts.clear()
    vitmask.load_pretrained(masked)
    assert counts == {"config.json": 1, "model.safetensors": 1, "load_file": 1}
