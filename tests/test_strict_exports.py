"""Export dirs are read as strictly as checkpoints, and a checkpoint's both weight entries are checked.

- config.json nested thousands deep, an integer of more digits than Python converts, numbers past
  int64 or past the largest float where the run's record is read, a file over 1 MiB: one line,
  exit 2, from every verb that takes the dir (and a UserError from `load_pretrained`);
- model.safetensors with a NaN or an inf (its SHA-256 updated to match), or a tensor that is not
  float32: refused as a checkpoint with NaN is;
- `export` onto a full disk: one line, nothing left on the disk;
- a checkpoint with an EMA whose trained weights (the entry not loaded) do not fit: refused by
  count-params, eval, export and `train --init`, and the same for the EMA under `--weights raw`;
- config.json's constructor arguments alone rebuild the model, whose outputs are the checkpoint's.

The expectations are read without vitmask's loaders: safetensors' `load_file`, `torch.load`.
"""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import assert_user_error, train_tiny, write_config
from tests.test_packed import small_tmpfs  # noqa: F401  (a fixture: a 64 KiB tmpfs)
from vitmask.cli import verbs
from vitmask.config import ModelConfig, config_from_dict
from vitmask.errors import UserError
from vitmask.model.vit import MaskedPatchViT, build_model
from vitmask.store.checkpoint import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
TRAIN = {"max_steps": 2, "eval_every": 2, "checkpoint_every": 2, "log_every": 2, "ema_decay": 0.9}


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """Two steps of the tiny model with an EMA, and mask.fill 1.0 (not the default 0.5)."""
    return train_tiny(tmp_path_factory.mktemp("ckpt"), {"mask": {"ratio": 0.5, "fill": 1.0}, "train": TRAIN})


@pytest.fixture(scope="module")
def exported(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "full"
    verbs.export(ckpt, out)
    return out


def copy_of(exported: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(exported, out)
    return out


def every_verb_refuses(run_cli, out: Path, tmp_path: Path, *needles: str) -> None:
    """eval, count-params, probe, sample and `train --init` give one line, exit 2, naming `needles`;
    `load_pretrained` raises a UserError that says the same; nothing is written."""
    import vitmask

    assert_user_error(run_cli("eval", "--checkpoint", out, "--device", "cpu"), *needles)
    assert_user_error(run_cli("count-params", "--checkpoint", out), *needles)
    assert_user_error(run_cli("probe", "--checkpoint", out, "--device", "cpu"), *needles)
    assert_user_error(run_cli("sample", "--checkpoint", out, "--out", tmp_path / "s.png", "--n", "1"), *needles)
    config = write_config(tmp_path / "run.yaml", {"mask": {"ratio": 0.5, "fill": 1.0}, "train": TRAIN})
    run = tmp_path / "run"
    res = run_cli("train", "--config", config, "--init", out, "--run-dir", run, "--device", "cpu")
    assert_user_error(res, *needles)
    assert not run.exists() and not (tmp_path / "s.png").exists()
    with pytest.raises(UserError) as refused:
        vitmask.load_pretrained(out)
    assert all(n in str(refused.value) for n in needles), str(refused.value)


# ---- config.json ------------------------------------------------------------------------------------
def _with(meta: dict, where: tuple[str, ...], value) -> dict:
    node = meta
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    return meta


HOSTILE_CONFIGS = {
    # name: (config.json's text from the export's meta, what the line says)
    "lists 100,000 deep": (
        lambda m: json.dumps(m)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "nested more than 32 levels deep",
    ),
    "objects 100,000 deep": (
        lambda m: json.dumps(m)[:-1] + ', "x": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}",
        "nested more than 32 levels deep",
    ),
    "lists 200 deep in the config": (  # within json's own limit: the depth check finds it
        lambda m: json.dumps(_with(m, ("training", "config", "model", "depth"), 0)).replace(
            '"depth": 0', '"depth": ' + "[" * 200 + "]" * 200
        ),
        "nested more than 32 levels deep",
    ),
    "an integer of 5,000 digits": (
        lambda m: json.dumps(m)[:-1] + ', "x": ' + "9" * 5000 + "}",
        "an integer of more than 4300 digits",
    ),
    "a step past int64": (
        lambda m: json.dumps(_with(m, ("training", "step"), 10**400)),
        "training.step is not a step",
    ),
    "a figure past the largest float": (
        lambda m: json.dumps(_with(m, ("training", "val"), {"ema": {"loss": 10**400}})),
        "training.val is not a table of numbers",
    ),
    "a figure that is text": (
        lambda m: json.dumps(_with(m, ("training", "best_val_loss"), "low")),
        "training.best_val_loss is not a number",
    ),
    "an init record with a number past int64": (
        lambda m: json.dumps(_with(m, ("training", "init"), {"path": "w", "step": 2**63})),
        "training.init is not a record of where the run's weights came from",
    ),
    "a config integer past int64": (
        lambda m: json.dumps(_with(m, ("training", "config", "train", "max_steps"), 2**64)),
        "train.max_steps must be an integer in",
    ),
    "a file over 1 MiB": (
        lambda m: json.dumps({**m, "padding": "x" * (1 << 20)}),
        "more than an export's may be (1,048,576)",
    ),
    "weights that are neither ema nor raw": (
        lambda m: json.dumps(_with(m, ("weights",), "best")),
        "config.json names weights 'best' (not ema or raw)",
    ),
    "weights named in capitals": (
        lambda m: json.dumps(_with(m, ("weights",), "EMA")),
        "config.json names weights 'EMA' (not ema or raw)",
    ),
    "weights that are no text": (
        lambda m: json.dumps(_with(m, ("weights",), 1)),
        "config.json has no valid 'weights' entry",
    ),
    "no SHA-256 of the weights": (
        lambda m: json.dumps(_with(m, ("sha256",), {})),
        "config.json names no SHA-256 of model.safetensors",
    ),
    "a SHA-256 of another file only": (
        lambda m: json.dumps(_with(m, ("sha256",), {"weights.bin": m["sha256"]["model.safetensors"]})),
        "config.json names no SHA-256 of model.safetensors",
    ),
    "a SHA-256 that is no digest": (
        lambda m: json.dumps(_with(m, ("sha256",), {"model.safetensors": True})),
        "config.json names no SHA-256 of model.safetensors",
    ),
}


@pytest.mark.parametrize("name", HOSTILE_CONFIGS)
def test_a_hostile_config_json_is_one_line_from_every_verb(run_cli, exported, tmp_path, name):
    out = copy_of(exported, tmp_path)
    text, needle = HOSTILE_CONFIGS[name]
    (out / "config.json").write_text(text(json.loads((out / "config.json").read_text())))
    every_verb_refuses(run_cli, out, tmp_path, f"export dir {out}", needle)


def nested_to(meta: dict, depth: int) -> str:
    """config.json's text with an entry of lists added so that it nests exactly `depth` levels (the
    top object is level 1, its "x" list level 2)."""
    return json.dumps({**meta, "x": json.loads("[" * (depth - 1) + "]" * (depth - 1))})


def test_config_json_may_nest_32_levels_and_not_33(run_cli, exported, tmp_path):
    out = copy_of(exported, tmp_path)
    meta = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(nested_to(meta, 32))
    assert run_cli("count-params", "--checkpoint", out).returncode == 0
    (out / "config.json").write_text(nested_to(meta, 33))
    assert_user_error(run_cli("count-params", "--checkpoint", out), "nested more than 32 levels deep")


def test_a_run_record_with_nan_and_inf_figures_is_read(run_cli, exported, tmp_path):
    # what a real run may record: no non-empty patches (acc_nonempty NaN), no validation yet (inf)
    out = copy_of(exported, tmp_path)
    meta = json.loads((out / "config.json").read_text())
    meta["training"].update(val={"ema": {"loss": 1.0, "acc_nonempty": float("nan")}}, best_val_loss=float("inf"))
    (out / "config.json").write_text(json.dumps(meta))
    assert run_cli("count-params", "--checkpoint", out).returncode == 0
    again = tmp_path / "again"
    assert run_cli("export", "--checkpoint", out, "--out", again).returncode == 0


# ---- model.safetensors ------------------------------------------------------------------------------
def rewrite_weights(out: Path, change) -> None:
    """Apply `change` to the export's tensors, write them, and put their SHA-256 in config.json (as
    someone who edits the weights would), so only the values themselves are wrong."""
    tensors = load_file(out / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors")
    meta = json.loads((out / "config.json").read_text())
    meta["sha256"]["model.safetensors"] = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    (out / "config.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_an_export_with_a_non_finite_weight_is_refused_by_every_verb(run_cli, exported, tmp_path, value):
    out = copy_of(exported, tmp_path)
    rewrite_weights(out, lambda t: t["blocks.1.ffn.fc1.weight"].view(-1).__setitem__(7, value))
    why = "holds NaN or inf values (model weight blocks.1.ffn.fc1.weight)"
    every_verb_refuses(run_cli, out, tmp_path, f"export dir {out}", why)
    never = tmp_path / "never"
    assert_user_error(run_cli("export", "--checkpoint", out, "--out", never), why)
    assert not never.exists()


def test_an_export_with_a_tensor_that_is_not_float32_is_refused(run_cli, exported, tmp_path):
    out = copy_of(exported, tmp_path)
    rewrite_weights(out, lambda t: t.update({"embed.bias": t["embed.bias"].half()}))
    assert_user_error(run_cli("eval", "--checkpoint", out), "holds embed.bias as torch.float16, not the float32")


# ---- export onto a full disk --------------------------------------------------------------------------
def test_an_export_onto_a_full_tmpfs_is_one_line_and_leaves_nothing(run_cli, ckpt, small_tmpfs):  # noqa: F811
    # the tiny model's weights are about 80 KB: more than the 64 KiB disk holds
    out = small_tmpfs / "export"
    res = run_cli("export", "--checkpoint", ckpt, "--out", out)
    assert_user_error(res, f"cannot write --out {out}", "the disk is full", "nothing was written")
    assert list(small_tmpfs.iterdir()) == []  # no export, no temp dir


def test_safetensors_failing_to_write_is_the_os_error_it_was(run_cli, ckpt, tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, file, metadata=None):
        Path(file).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "export"
    assert_user_error(run_cli("export", "--checkpoint", ckpt, "--out", out), "the disk is full", "nothing was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    def broken(tensors, file, metadata=None):  # not a failed write: a bug, kept as it is
        raise SafetensorError("tensor invalid")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(SafetensorError, match="tensor invalid"):
        verbs.export(ckpt, out)
    assert not out.exists()


# ---- both weight entries of a checkpoint ----------------------------------------------------------------
DAMAGE = {
    "an extra key": (lambda w: w.update(extra=torch.zeros(2)), "unexpected: extra"),
    "a wrong shape": (lambda w: w.update({"embed.weight": torch.zeros(32, 5)}), "embed.weight (32, 5) vs (32, 4)"),
    "a missing tensor": (lambda w: w.pop("blocks.0.ffn.fc2.bias"), "missing: blocks.0.ffn.fc2.bias"),
}


def damaged(ckpt: Path, path: Path, entry: str, how: str) -> Path:
    state = load_checkpoint(ckpt)
    state.pop("format")
    DAMAGE[how][0](state[entry])
    return save_checkpoint(state, path)


@pytest.mark.parametrize("how", DAMAGE)
def test_an_ema_checkpoint_whose_trained_weights_do_not_fit_is_refused(run_cli, ckpt, tmp_path, how):
    bad = damaged(ckpt, tmp_path / "bad.pt", "model", how)
    needles = (f"checkpoint {bad} is damaged: its trained weights ('model' entry) do not fit", DAMAGE[how][1])
    assert_user_error(run_cli("count-params", "--checkpoint", bad), *needles)
    assert_user_error(run_cli("eval", "--checkpoint", bad, "--device", "cpu"), *needles)
    assert_user_error(run_cli("probe", "--checkpoint", bad, "--device", "cpu"), *needles)
    assert_user_error(run_cli("export", "--checkpoint", bad, "--out", tmp_path / "e"), *needles)
    config = write_config(tmp_path / "run.yaml", {"mask": {"ratio": 0.5, "fill": 1.0}, "train": TRAIN})
    res = run_cli("train", "--config", config, "--init", bad, "--run-dir", tmp_path / "run", "--device", "cpu")
    assert_user_error(res, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt", "run.yaml"]


def test_a_checkpoint_whose_ema_does_not_fit_is_refused_when_its_raw_weights_are_asked_for(run_cli, ckpt, tmp_path):
    bad = damaged(ckpt, tmp_path / "bad.pt", "ema", "a wrong shape")
    needles = ("its EMA weights ('ema' entry) do not fit", "embed.weight (32, 5) vs (32, 4)")
    assert_user_error(run_cli("eval", "--checkpoint", bad, "--weights", "raw", "--device", "cpu"), *needles)
    assert_user_error(run_cli("export", "--checkpoint", bad, "--out", tmp_path / "e", "--weights", "raw"), *needles)


def test_an_untouched_ema_checkpoint_gives_either_entry(run_cli, ckpt, tmp_path):
    assert run_cli("count-params", "--checkpoint", ckpt).returncode == 0
    state = torch.load(ckpt, weights_only=True)
    for weights in ("ema", "raw"):
        out = tmp_path / weights
        assert run_cli("export", "--checkpoint", ckpt, "--out", out, "--weights", weights).returncode == 0
        saved = load_file(out / "model.safetensors")
        entry = state["ema" if weights == "ema" else "model"]
        assert saved.keys() == entry.keys() and all(torch.equal(saved[k], v) for k, v in entry.items())


# ---- config.json rebuilds the model -----------------------------------------------------------------------
def test_config_jsons_constructor_arguments_alone_rebuild_the_model(ckpt, exported):
    meta = json.loads((exported / "config.json").read_text())
    assert meta["fill"] == 1.0  # the run's mask.fill, not the default
    model = MaskedPatchViT(
        ModelConfig(**meta["model"]), meta["num_patches"], meta["patch_dim"], meta["num_classes"], meta["fill"]
    )
    model.load_state_dict(load_file(exported / "model.safetensors"))  # strict: every key, every shape
    state = torch.load(ckpt, weights_only=True)
    want = build_model(config_from_dict(state["config"]))
    want.load_state_dict(state["ema"])
    g = torch.Generator().manual_seed(0)
    patches = torch.randint(0, 2, (6, 64, 4), generator=g).float()  # (B, N, P)
    mask = torch.rand(6, 64, generator=g) < 0.5  # (B, N)
    with torch.no_grad():
        got = model.eval()(patches, mask)
        assert torch.equal(got, want.eval()(patches, mask))
        # the fill matters: the same weights with the default fill predict otherwise
        other = MaskedPatchViT(ModelConfig(**meta["model"]), 64, 4, 16, 0.5)
        other.load_state_dict(load_file(exported / "model.safetensors"))
        assert not torch.allclose(other.eval()(patches, mask), got)
