"""`vitmask train --init`: a new run whose weights come from an export dir or a checkpoint.

The expectations are read without vitmask's loaders: an export's tensors with safetensors'
`load_file`, a checkpoint's entries with `torch.load(weights_only=True)`. The weights at the first
step are caught inside the real command (the trainer's step is wrapped to copy them first).
"""

import json
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TINY, assert_user_error, train_tiny, write_config
from vitmask.cli import verbs
from vitmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

SOURCE_STEPS = 4
RUN = {"max_steps": 2, "eval_every": 2, "checkpoint_every": 2, "log_every": 1, "ema_decay": 0.5}


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A finished 4-step run of the tiny model with an EMA (so the EMA and the trained weights differ)."""
    train = {"max_steps": SOURCE_STEPS, "eval_every": 4, "checkpoint_every": 4, "log_every": 4, "ema_decay": 0.9}
    return train_tiny(tmp_path_factory.mktemp("source"), {"train": train})


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    """The source's full export (its EMA weights) and its encoder-only export."""
    root = tmp_path_factory.mktemp("export")
    verbs.export(source, root / "full")
    verbs.export(source, root / "encoder", encoder_only=True)
    return root


def run_config(tmp_path, train=None, **sections):
    """TINY with another seed (so its random init differs from the source's) and a short run."""
    return write_config(
        tmp_path / "run.yaml", {"seed": 7, "train": {**TINY["train"], **RUN, **(train or {})}, **sections}
    )


def first_step_weights(monkeypatch) -> dict:
    """Wrap the trainer's step so the weights and the EMA at the first step are copied into the dict returned."""
    seen: dict = {}
    step = Trainer._run_step

    def copy_then_step(self):
        if not seen:
            seen["model"] = {k: v.clone() for k, v in self.model.state_dict().items()}
            seen["ema"] = {k: v.clone() for k, v in self.ema.state_dict().items()}
        step(self)

    monkeypatch.setattr(Trainer, "_run_step", copy_then_step)
    return seen


def assert_same_tensors(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_a_run_from_an_export_starts_at_step_0_with_the_exported_weights(
    run_cli, exported, source, tmp_path, monkeypatch
):
    seen = first_step_weights(monkeypatch)
    config = run_config(tmp_path, model={**TINY["model"], "dropout": 0.1})  # dropout may differ: no weight has it
    run = tmp_path / "run"
    res = run_cli("train", "--config", config, "--init", exported / "full", "--run-dir", run, "--device", "cpu")
    assert res.returncode == 0, res.stderr
    assert f"starting a new run in {run} from the ema weights of export dir {exported / 'full'}" in res.stdout

    want = load_file(exported / "full" / "model.safetensors")
    assert_same_tensors(seen["model"], want)
    assert_same_tensors(seen["ema"], want)  # the EMA starts from the same weights

    state = torch.load(run / "last.pt", weights_only=True)
    src = torch.load(source, weights_only=True)
    assert state["step"] == RUN["max_steps"]  # counted from 0, not from the source's step
    assert state["scheduler"]["last_epoch"] == RUN["max_steps"]
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {float(RUN["max_steps"])}
    assert state["run_id"] != src["run_id"]
    assert state["init"] == {
        "path": str(exported / "full"),
        "kind": "export dir",
        "weights": "ema",
        "step": SOURCE_STEPS,
        "run_id": src["run_id"],
    }


@pytest.mark.parametrize("flag, entry", [(None, "ema"), ("ema", "ema"), ("raw", "model")])
def test_a_run_from_a_checkpoint_starts_from_its_ema_or_its_trained_weights(
    run_cli, source, tmp_path, monkeypatch, flag, entry
):
    seen = first_step_weights(monkeypatch)
    run = tmp_path / "run"
    pick = ["--init-weights", flag] if flag else []
    res = run_cli(
        "train", "--config", run_config(tmp_path), "--init", source, *pick, "--run-dir", run, "--device", "cpu"
    )
    assert res.returncode == 0, res.stderr
    want = torch.load(source, weights_only=True)[entry]
    assert_same_tensors(seen["model"], want)
    assert_same_tensors(seen["ema"], want)
    state = torch.load(run / "last.pt", weights_only=True)
    assert state["init"]["kind"] == "checkpoint" and state["init"]["weights"] == entry.replace("model", "raw")


def test_a_stopped_init_run_resumes_without_init_and_ends_as_an_unbroken_one(run_cli, exported, tmp_path, monkeypatch):
    n = 3
    train = {"max_steps": 2 * n, "checkpoint_every": n, "eval_every": n, "deterministic": True}
    train.update(optimizer="adamw", weight_decay=0.01, schedule="cosine", warmup_steps=2, grad_clip=1.0)
    config = run_config(tmp_path, train, model={**TINY["model"], "dropout": 0.1})  # dropout: the torch RNG too
    weights = tmp_path / "weights"
    shutil.copytree(exported / "full", weights)
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    res = run_cli("train", "--config", config, "--init", weights, "--run-dir", whole, "--device", "cpu")
    assert res.returncode == 0, res.stderr

    step = Trainer._run_step

    def stop_at_n(self):
        step(self)
        if self.step == n:
            signal.raise_signal(signal.SIGTERM)  # recorded by the loop: it checkpoints and stops

    monkeypatch.setattr(Trainer, "_run_step", stop_at_n)
    res = run_cli("train", "--config", config, "--init", weights, "--run-dir", broken, "--device", "cpu")
    assert res.returncode == 128 + signal.SIGTERM, res.stderr
    assert torch.load(broken / "last.pt", weights_only=True)["step"] == n
    monkeypatch.undo()

    shutil.rmtree(weights)  # a resume reads its own checkpoint: the initial weights are not needed again
    res = run_cli("train", "--run-dir", broken, "--resume", "auto", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    assert f"resuming {broken} from step {n}" in res.stdout
    a, b = (torch.load(run / "last.pt", weights_only=True) for run in (whole, broken))
    assert a["step"] == b["step"] == 2 * n
    assert_same_tensors(b["model"], a["model"])
    assert_same_tensors(b["ema"], a["ema"])
    assert b["init"] == a["init"] and a["init"]["path"] == str(weights)  # the record stays with the run


def refused(run_cli, tmp_path, config, *args, needles=()):
    """`train --config config ARGS` into a run dir that does not exist: one line, exit 2, and no run dir."""
    run = tmp_path / "runs" / "new"
    res = run_cli("train", "--config", config, "--run-dir", run, "--device", "cpu", *map(str, args))
    assert_user_error(res, *needles)
    assert not (tmp_path / "runs").exists()


def test_a_config_of_another_model_is_refused_naming_the_first_differing_key(run_cli, exported, tmp_path):
    deeper = run_config(tmp_path, model={**TINY["model"], "depth": 3, "ffn_dim": 32})
    needles = ("model.depth=2", "model.depth=3", "--set model.depth=2")
    refused(run_cli, tmp_path, deeper, "--init", exported / "full", needles=needles)
    learned = run_config(tmp_path, mask={"ratio": 0.5, "fill": "learned"})
    refused(run_cli, tmp_path, learned, "--init", exported / "full", needles=("mask.fill=0.5", "mask.fill=learned"))


@pytest.mark.parametrize(
    "data, needles",
    [
        ({"image_size": 20}, ("16x16 images", "20x20", "data.image_size=16")),
        ({"patch_size": 4}, ("2-pixel patches", "4-pixel patches", "data.patch_size=2")),
    ],
)
def test_weights_of_another_image_or_patch_size_are_refused(run_cli, source, tmp_path, data, needles):
    config = run_config(tmp_path, data={**TINY["data"], **data})
    refused(run_cli, tmp_path, config, "--init", source, needles=needles)


def test_an_encoder_only_export_is_refused(run_cli, exported, tmp_path):
    config = run_config(tmp_path)
    refused(run_cli, tmp_path, config, "--init", exported / "encoder", needles=("encoder only", "--encoder-only"))


def test_init_with_resume_and_init_weights_alone_are_refused(run_cli, source, tmp_path):
    config = run_config(tmp_path)
    for resume in ("auto", source):
        refused(run_cli, tmp_path, config, "--init", source, "--resume", resume, needles=("--init", "--resume"))
    refused(run_cli, tmp_path, config, "--init-weights", "raw", needles=("--init-weights", "--init PATH"))
    refused(run_cli, tmp_path, config, "--init", source, "--init-weights", "best", needles=("--init-weights must be",))


def test_missing_and_broken_sources_are_refused(run_cli, source, exported, tmp_path):
    config = run_config(tmp_path)
    refused(run_cli, tmp_path, config, "--init", tmp_path / "nowhere", needles=("does not exist",))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(source.read_bytes()[:1000])
    refused(run_cli, tmp_path, config, "--init", truncated, needles=(str(truncated),))
    tampered = tmp_path / "tampered"
    shutil.copytree(exported / "full", tampered)
    with open(tampered / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x00\x80\x7f")
    refused(run_cli, tmp_path, config, "--init", tampered, needles=("SHA-256",))
    (tmp_path / "folder").mkdir()
    refused(run_cli, tmp_path, config, "--init", tmp_path / "folder", needles=("is a folder",))
    ema_free = tmp_path / "plain"  # a raw-only export cannot give EMA weights: the message names --init-weights
    verbs.export(source, ema_free, weights="raw")
    refused(run_cli, tmp_path, config, "--init", ema_free, "--init-weights", "ema", needles=("--init-weights ema",))


def test_an_export_of_an_init_run_names_the_weights_it_started_from(run_cli, exported, tmp_path):
    config = run_config(tmp_path)
    res = run_cli(
        "train", "--config", config, "--init", exported / "full", "--run-dir", tmp_path / "run", "--device", "cpu"
    )
    assert res.returncode == 0, res.stderr
    res = run_cli("export", "--checkpoint", tmp_path / "run" / "last.pt", "--out", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    init = json.loads((tmp_path / "out" / "config.json").read_text())["training"]["init"]
    assert init["path"] == str(exported / "full") and init["kind"] == "export dir"
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"weights of the export dir `{exported / 'full'}`" in card
