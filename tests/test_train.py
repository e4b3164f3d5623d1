import json
import math

import torch

from tests.conftest import run_cli
from vitmask.checkpoint import load_checkpoint
from vitmask.config import load_config
from vitmask.data import load_splits
from vitmask.train import Trainer

ONE = {"OMP_NUM_THREADS": "1"}  # one thread per process: on a small shared CPU box, two mostly wait on each other


def test_thirty_steps_lower_the_loss(tiny_config):
    cfg = load_config(tiny_config)
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    before = trainer.evaluate()
    trainer.fit(run_dir=None, progress=False)
    after = trainer.evaluate()
    assert trainer.step == 30
    assert after["loss"] < before["loss"] - 0.3, (before, after)
    assert math.isfinite(after["loss"])


def test_checkpoint_is_plain_data_and_eval_is_reproducible(tiny_config, tmp_path):
    run = tmp_path / "run"
    res = run_cli("train", "--config", tiny_config, "--run-dir", run, "--device", "cpu", env=ONE)
    assert res.returncode == 0, res.stderr
    state = torch.load(run / "last.pt", weights_only=True)  # plain data only
    assert state["step"] == 30
    assert state["config"]["model"]["hidden_dim"] == 32
    assert set(state) >= {"model", "optimizer", "step", "config"}
    assert load_checkpoint(run / "last.pt")["step"] == 30
    a = run_cli("eval", "--checkpoint", run / "last.pt", "--json")
    b = run_cli("eval", "--checkpoint", run / "last.pt", "--json")
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout) == json.loads(b.stdout)
    m = json.loads(a.stdout)["results"][0]
    assert m["acc"] > m["majority_acc"] - 0.05


def test_resume_continues_from_the_checkpoint_step(tiny_config, tmp_path):
    run = tmp_path / "run"
    assert (
        run_cli("train", "--config", tiny_config, "--run-dir", run, "--set", "train.max_steps=15", env=ONE).returncode
        == 0
    )
    res = run_cli("train", "--config", tiny_config, "--run-dir", run, "--resume", "auto", env=ONE)
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stdout and "from step 15" in res.stdout
    assert load_checkpoint(run / "last.pt")["step"] == 30
