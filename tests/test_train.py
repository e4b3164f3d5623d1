import json
import math

import torch
import yaml

from tests.conftest import run_cli, write_config
from tests.test_sources import run_inproc
from vitmask.config import config_from_dict, load_config
from vitmask.data.batches import load_splits
from vitmask.store.checkpoint import load_checkpoint
from vitmask.train.trainer import Trainer

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


SHORT = {"train": {"max_steps": 2, "eval_every": 2, "checkpoint_every": 2, "log_every": 2}}


def test_config_yaml_in_the_run_dir_is_the_resolved_config(tmp_path, capsys):
    cfg = write_config(tmp_path / "tiny.yaml", SHORT)
    run = tmp_path / "run"
    sets = ["--set", "model.depth=1", "--set", "train.optimizer=adamw", "--set", "mask.ratio_range=[0.2, 0.6]"]
    res = run_inproc(capsys, "train", "--config", cfg, "--run-dir", run, "--device", "cpu", *sets)
    assert res.returncode == 0, res.stderr
    written = yaml.safe_load((run / "config.yaml").read_text())
    # by hand: the file's keys, the --set values over them, the defaults for every key neither gives
    assert written["name"] == "tiny"  # the config file's stem
    assert written["model"]["hidden_dim"] == 32 and written["data"]["image_size"] == 16  # from the file
    assert written["model"]["depth"] == 1 and written["train"]["optimizer"] == "adamw"  # --set beats the file
    assert written["mask"]["ratio_range"] == [0.2, 0.6] and written["mask"]["ratio_schedule"] == "uniform"
    assert written["train"]["max_steps"] == 2 and written["train"]["lr"] == 3e-3  # the file's
    assert written["train"]["beta2"] == 0.999 and written["model"]["activation"] == "gelu"  # the defaults
    # parsed back, it is the config the run trained with: the one its checkpoint holds, key for key
    assert written == yaml.safe_load(yaml.safe_dump(load_checkpoint(run / "last.pt")["config"]))
    assert config_from_dict(written) == load_config(cfg, [s for s in sets if s != "--set"])


def test_without_run_dir_a_run_writes_to_runs_and_the_config_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path / "tinyrun.yaml", SHORT)
    res = run_inproc(capsys, "train", "--config", "tinyrun.yaml", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    assert load_checkpoint(tmp_path / "runs" / "tinyrun" / "last.pt")["step"] == 2  # the file's stem
    assert (tmp_path / "runs" / "tinyrun" / "config.yaml").is_file()
    res = run_inproc(capsys, "train", "--config", "tinyrun.yaml", "--set", "name=renamed", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    assert load_checkpoint(tmp_path / "runs" / "renamed" / "last.pt")["step"] == 2  # the config's name key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "tinyrun.yaml"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["renamed", "tinyrun"]


def test_resume_auto_starts_fresh_when_the_run_dir_has_no_checkpoint(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    plain = tmp_path / "plain"
    res = run_inproc(capsys, "train", "--config", cfg, "--run-dir", plain, "--device", "cpu")
    assert res.returncode == 0, res.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    for run in (tmp_path / "missing", empty):  # a run dir that does not exist yet, and an empty one
        res = run_inproc(capsys, "train", "--config", cfg, "--run-dir", run, "--resume", "auto", "--device", "cpu")
        assert res.returncode == 0, res.stderr
        assert "resuming" not in res.stdout
        state, fresh = load_checkpoint(run / "last.pt"), load_checkpoint(plain / "last.pt")
        assert state["step"] == 2
        for key, value in fresh["model"].items():  # the same weights as a run started without --resume
            assert torch.equal(state["model"][key], value), key
