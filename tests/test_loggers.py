"""The loggers of `train.loggers` (train/loggers.py): csv and jsonl hold, step for step, the scalars the
TensorBoard event files hold (read back by TensorBoard's own EventAccumulator; pandas is not installed
here, so the files are read with the csv and json modules), a resumed run drops the rows past its
checkpoint, a missing extra is one line naming the pip command, and W&B (offline) and MLflow (a SQLite
store) record the config, every scalar by step and the checkpoints' paths, read back through each
tool's own record format and client. The W&B and MLflow tests skip where their extra is not installed
(and fail so under VITMASK_CI=1).
"""

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import vitmask
from tests.conftest import extra, write_config
from vitmask.config import config_from_dict, dump_config
from vitmask.errors import UserError
from vitmask.train import loggers
from vitmask.train.callbacks import Callback

pytestmark = pytest.mark.usefixtures("one_thread")
SIX = {"max_steps": 6, "eval_every": 3, "checkpoint_every": 3, "log_every": 2}


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


class Recorder(Callback):
    """Every scalar the hooks see, by step: what the loggers were given."""

    def __init__(self):
        self.rows: dict[int, dict[str, float]] = {}

    def on_step_end(self, step, metrics):
        self.rows.setdefault(step, {}).update(metrics)

    def on_validation_end(self, step, metrics):
        self.rows.setdefault(step, {}).update(metrics)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: int(v) if k == "step" else float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tensorboard_rows(run: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    rows: dict[int, dict[str, float]] = {}
    for events in sorted(run.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={SCALARS: 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            if tag.startswith(("train/", "val/")):
                for e in acc.Scalars(tag):
                    rows.setdefault(e.step, {})[tag] = e.value
    return rows


def test_csv_and_jsonl_hold_what_tensorboard_holds_one_row_per_step(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", {"train": {**SIX, "loggers": ["tensorboard", "csv", "jsonl"]}})
    rec = Recorder()
    vitmask.train(cfg, run_dir=tmp_path / "run", device="cpu", callbacks=[rec])
    board = tensorboard_rows(tmp_path / "run")
    assert sorted(board) == [2, 3, 4, 6]  # logging steps (2, 4, 6) and validations (3, 6)
    for rows in (read_csv(tmp_path / "run" / "metrics.csv"), read_jsonl(tmp_path / "run" / "metrics.jsonl")):
        assert [r["step"] for r in rows] == [2, 3, 4, 6]
        for row in rows:
            step = row.pop("step")
            assert row.keys() == board[step].keys()
            for k, v in board[step].items():
                assert math.isclose(row[k], v, rel_tol=1e-6), (step, k)  # TensorBoard keeps float32
            assert row == rec.rows[step]  # the full doubles, as the trainer gave them
    header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[:3] == ["step", "train/loss", "train/acc"] and "val/loss" in header


def test_a_resumed_run_drops_the_rows_past_its_checkpoint(tmp_path):
    """Logs every 3 steps, so that the resumed run's training windows (which start afresh at the
    checkpoint) are the unbroken run's: rows at 3 and 6."""
    cfg = write_config(tmp_path / "c.yaml", {"train": {**SIX, "log_every": 3, "loggers": ["csv", "jsonl"]}})
    run = tmp_path / "run"
    vitmask.train(cfg, run_dir=run, device="cpu")
    whole = {name: read(run / name) for read, name in ((read_csv, "metrics.csv"), (read_jsonl, "metrics.jsonl"))}
    # the rows past step 3 as a run that went on after that checkpoint and was killed leaves them: wrong
    # numbers (not those a resume from step 3 logs), the last row cut short
    lines = (run / "metrics.csv").read_text().splitlines(keepends=True)
    (run / "metrics.csv").write_text("".join(lines[:2]) + "5,99.0,99.0,99.0,99.0,99.0,99.0,99.0,,,,\n6,1.")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:1]) + '{"step": 5, "train/loss": 99.0}\n{"step": 6, "tr')
    vitmask.train(cfg, run_dir=run, device="cpu", resume=run / "step_0000003.pt")
    for read, name in ((read_csv, "metrics.csv"), (read_jsonl, "metrics.jsonl")):
        rows = read(run / name)
        assert [r["step"] for r in rows] == [3, 6]
        for a, b in zip(rows, whole[name], strict=True):  # the rows of the run before it was cut
            a.pop("train/images_per_s", None), b.pop("train/images_per_s", None)
            assert a == b


def test_a_failed_fresh_start_leaves_no_metrics_files_behind(tmp_path, monkeypatch):
    """The csv and jsonl files are the run dir's own: a fresh run that fails before its first checkpoint
    removes them with the rest, so the same call then simply works."""
    cfg = write_config(tmp_path / "c.yaml", {"train": {**SIX, "log_every": 1, "loggers": ["csv", "jsonl"]}})
    real = loggers.JSONLinesLogger.log

    def failing(self, metrics, step):
        real(self, metrics, step)
        if step == 2:  # step 1's rows are on disk by now
            raise UserError("no more")

    monkeypatch.setattr(loggers.JSONLinesLogger, "log", failing)
    with pytest.raises(UserError, match="no more"):
        vitmask.train(cfg, run_dir=tmp_path / "run", device="cpu")
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    assert vitmask.train(cfg, run_dir=tmp_path / "run", device="cpu").step == 6


def test_a_fresh_run_without_loggers_writes_no_metrics_files(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", {"train": {**SIX, "max_steps": 2, "loggers": []}})
    vitmask.train(cfg, run_dir=tmp_path / "run", device="cpu")
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(("events.", "metrics."))]


def test_an_unknown_logger_is_one_line_with_the_nearest_name(tmp_path, run_cli):
    cfg = write_config(tmp_path / "c.yaml", {"train": SIX})
    res = run_cli("train", "--config", cfg, "--run-dir", tmp_path / "run", "--set", "train.loggers=[tensorbord, csv]")
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip() == (
        "vitmask: error: config: train.loggers must be one of tensorboard, csv, jsonl, wandb, mlflow, got "
        "'tensorbord'; did you mean 'tensorboard'?"
    )
    res = run_cli("train", "--config", cfg, "--run-dir", tmp_path / "run", "--set", "train.loggers=[csv, csv]")
    assert res.returncode == 2 and "train.loggers names csv more than once" in res.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("logger", ["wandb", "mlflow"])
def test_a_missing_extra_is_one_line_naming_the_pip_command(tmp_path, run_cli, monkeypatch, logger):
    monkeypatch.setitem(sys.modules, logger, None)  # `import wandb` fails as where it is not installed
    cfg = write_config(tmp_path / "c.yaml", {"train": SIX})
    res = run_cli("train", "--config", cfg, "--run-dir", tmp_path / "run", "--set", f"train.loggers=[csv, {logger}]")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.splitlines() == [
        f"vitmask: error: train.loggers has {logger}, which needs the {logger} extra, and {logger} is not installed; "
        f"run: pip install 'vitmask[{logger}]' (in a checkout: pip install -e '.[{logger}]'), or drop {logger} "
        "from train.loggers"
    ]
    assert not (tmp_path / "run").exists()  # refused before the run dir was made
    build = config_from_dict({"train": {"loggers": [logger]}})
    with pytest.raises(UserError, match=rf"pip install 'vitmask\[{logger}\]'"):  # the import itself, past the check
        loggers.build_loggers(build, tmp_path, "0" * 32)


def test_the_extras_are_declared_and_pinned():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

    from tests.conftest import ROOT

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    lines = (ROOT / "constraints.txt").read_text().lower().splitlines()
    pins = dict(line.split("==") for line in lines if "==" in line)
    for name, packages in (("wandb", ["wandb"]), ("mlflow", ["alembic", "mlflow-skinny", "sqlalchemy"])):
        assert sorted(p.split(">=")[0].lower() for p in extras[name]) == packages, name
        assert all(p in pins for p in packages), (name, pins)


# ---- W&B, offline ----------------------------------------------------------------------------------------
def wandb_records(path: Path) -> list:
    """The records of an offline run's .wandb file, parsed with W&B's own record schema. The file is a
    LevelDB-style log: a 7-byte header (":W&B", a magic, a version), then 32 KiB blocks of chunks, each a
    4-byte checksum, a 2-byte length, a 1-byte type (1 full, 2 first, 3 middle, 4 last) and the data."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, records, parts = path.read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail, too short for a chunk header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def wandb_value(item):
    return json.loads(item.value_json)


def test_wandb_offline_records_the_config_every_scalar_by_step_and_the_checkpoints(tmp_path, monkeypatch):
    extra("wandb")
    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WANDB_PROJECT", "vitmask-test")
    cfg = write_config(tmp_path / "c.yaml", {"train": {**SIX, "loggers": ["wandb"]}})
    rec = Recorder()
    result = vitmask.train(cfg, run_dir=tmp_path / "run", device="cpu", callbacks=[rec])
    run_id = torch.load(result.last_checkpoint, weights_only=True)["run_id"]
    (log,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")  # the W&B run is the run's id
    records = wandb_records(log)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "vitmask-test" and run.display_name == "c"
    config = {item.key: wandb_value(item) for item in run.config.update if not item.key.startswith("_")}
    want = json.loads(json.dumps(config_from_dict(torch.load(result.last_checkpoint)["config"]).to_dict()))
    assert config == want
    history: dict[int, dict[str, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: wandb_value(i) for i in r.history.item}
            history.setdefault(int(items.pop("_step")), {}).update(
                {k: v for k, v in items.items() if not k.startswith("_") and not isinstance(v, dict)}
            )
    assert sorted(history) == sorted(rec.rows) == [2, 3, 4, 6]
    for step, row in rec.rows.items():  # the scalars, and at validations the reconstruction grid as an image
        picture = {k: history[step].pop(k) for k in list(history[step]) if k.startswith("val/reconstruction/")}
        assert history[step] == row, step
        assert picture.get("val/reconstruction/_type") == ("image-file" if "val/loss" in row else None), step
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({"/".join(i.nested_key) or i.key: wandb_value(i) for i in r.summary.update})
    assert summary["checkpoint/last"] == str(tmp_path / "run" / "last.pt")
    assert summary["checkpoint/best"] == str(tmp_path / "run" / "best.pt")


# ---- MLflow, a SQLite store ------------------------------------------------------------------------------
def test_mlflow_records_params_every_scalar_by_step_the_config_and_the_checkpoints(tmp_path, monkeypatch):
    extra("mlflow")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "vitmask-test")
    client = MlflowClient(uri)
    experiment = client.create_experiment("vitmask-test", artifact_location=(tmp_path / "artifacts").as_uri())
    cfg = write_config(tmp_path / "c.yaml", {"train": {**SIX, "loggers": ["mlflow"]}})
    rec = Recorder()
    result = vitmask.train(cfg, ["train.max_steps=3"], tmp_path / "run", device="cpu", callbacks=[rec])
    resumed = vitmask.train(cfg, run_dir=tmp_path / "run", device="cpu", callbacks=[rec], resume="auto")
    run_id = torch.load(result.last_checkpoint, weights_only=True)["run_id"]
    (run,) = client.search_runs([experiment], filter_string=f"tags.`vitmask.run_id` = '{run_id}'")
    assert run.info.status == "FINISHED" and run.info.run_name == "c"  # one MLflow run, resumed
    params = run.data.params
    assert params["train.lr"] == "0.003" and params["model.hidden_dim"] == "32" and params["data.image_size"] == "16"
    assert params["train.max_steps"] == "3"  # the config as the run started
    for key in ("train/loss", "train/lr", "val/loss", "val/acc"):
        history = client.get_metric_history(run.info.run_id, key)
        want = sorted((s, row[key]) for s, row in rec.rows.items() if key in row)
        assert sorted((m.step, m.value) for m in history) == want, key
    assert {s for s, row in rec.rows.items() if "val/loss" in row} == {3, 6}
    assert run.data.tags["checkpoint/last"] == str(resumed.last_checkpoint)
    assert run.data.tags["checkpoint/best"] == str(tmp_path / "run" / "best.pt")
    config = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path / "down"))).read_text()
    assert config == dump_config(config_from_dict(torch.load(result.last_checkpoint)["config"], ["train.max_steps=3"]))
