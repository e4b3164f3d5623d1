"""Every bad input ends in one line on stderr, exit code 2, no traceback, and nothing overwritten."""

import json

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ROOT, assert_user_error, run_cli, write_config
from vitmask.config import config_from_dict
from vitmask.data.batches import eval_batches, load_splits
from vitmask.data.patches import classes_to_patches, patches_to_classes, patchify
from vitmask.model.vit import build_model


def test_count_params_prints_the_table_with_the_notation_names_and_total():
    res = run_cli("count-params", "--config", ROOT / "configs" / "seed.yaml")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[-1].split()[-1] == "314,640"
    assert any(ln.startswith("pos ") and "131,072" in ln for ln in lines)
    assert any("blocks.0.attn.qkv.weight" in ln and "49,152" in ln for ln in lines)


def test_config_prints_resolved_yaml_with_overrides(tiny_config):
    res = run_cli("config", "--config", tiny_config, "--set", "model.depth=3")
    assert res.returncode == 0, res.stderr
    assert "depth: 3" in res.stdout and "hidden_dim: 32" in res.stdout


def test_missing_config_file(tmp_path):
    assert_user_error(run_cli("train", "--config", tmp_path / "nope.yaml"), "config file not found", "nope.yaml")


def test_unreadable_config_file(tmp_path):
    p = tmp_path / "binary.yaml"
    p.write_bytes(b"\xff\xfe\x00\x81binary")
    assert_user_error(run_cli("config", "--config", p), "cannot read config file")


def test_bad_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  depth: [1, 2\n")
    assert_user_error(run_cli("config", "--config", p), "bad YAML", "line")


def test_bad_key_and_bad_value(tiny_config):
    assert_user_error(
        run_cli("config", "--config", tiny_config, "--set", "model.depht=2"), "did you mean 'model.depth'"
    )
    assert_user_error(run_cli("config", "--config", tiny_config, "--set", "model.hidden_dim=x"), "model.hidden_dim")
    assert_user_error(run_cli("count-params", "--config", tiny_config, "--set", "model.num_heads=5"), "num_heads")


def test_usage_error_is_one_line(tiny_config):
    assert_user_error(run_cli("eval"), "--checkpoint")


def test_missing_and_foreign_checkpoints(tmp_path):
    assert_user_error(run_cli("eval", "--checkpoint", tmp_path / "none.pt"), "checkpoint not found")
    text = tmp_path / "text.pt"
    text.write_text("not a checkpoint")
    assert_user_error(run_cli("eval", "--checkpoint", text), "cannot read checkpoint")
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    assert_user_error(run_cli("eval", "--checkpoint", foreign), "not a vitmask checkpoint")
    assert_user_error(run_cli("count-params", "--checkpoint", foreign), "not a vitmask checkpoint")


def test_cuda_where_there_is_none(tiny_config, tmp_path):
    if torch.cuda.is_available():
        return  # only meaningful on a machine without a GPU, like CI
    res = run_cli("train", "--config", tiny_config, "--device", "cuda", "--run-dir", tmp_path / "r")
    assert_user_error(res, "--device cuda", "--device cpu")
    assert not (tmp_path / "r").exists()


def test_existing_run_dir_is_refused_and_left_alone(tiny_config, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("keep me")
    res = run_cli("train", "--config", tiny_config, "--run-dir", run)
    assert_user_error(res, "already exists", "--resume", "--run-dir")
    assert [p.name for p in run.iterdir()] == ["notes.txt"]
    assert (run / "notes.txt").read_text() == "keep me"


def test_train_then_eval_json(tmp_path):
    cfg = write_config(tmp_path / "t.yaml", {"train": {"max_steps": 10, "eval_every": 10, "checkpoint_every": 10}})
    run = tmp_path / "run"
    res = run_cli("train", "--config", cfg, "--run-dir", run, "--device", "cpu")
    assert res.returncode == 0, res.stderr
    assert (run / "last.pt").is_file() and (run / "config.yaml").is_file()
    assert any(p.name.startswith("events.out.tfevents") for p in run.iterdir())
    res = run_cli("eval", "--checkpoint", run / "last.pt", "--split", "test", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["split"] == "test" and len(report["results"]) == 1
    m = report["results"][0]
    # by hand: the 64 test images hide round(0.5 * 64) = 32 patches each under the masks of seed 0,
    # scored against the checkpoint's own model run here
    state = torch.load(run / "last.pt", weights_only=True)
    cfg = config_from_dict(state["config"])
    model = build_model(cfg).eval()
    model.load_state_dict(state["model"])
    images = load_splits(cfg)["test"]
    batch = next(eval_batches(images, cfg, 0.5, 0, len(images)))
    truth = patches_to_classes(patchify(images, 2)).gather(1, batch.ids)  # (64, 32)
    with torch.no_grad():
        logits = model(batch.patches, batch.mask, batch.ids)  # (64, 32, 16)
    pred = logits.argmax(-1)
    hit, filled = pred == truth, truth != 0
    wrong_bits = int((classes_to_patches(pred, 4) != classes_to_patches(truth, 4)).sum())
    assert set(report) == {"checkpoint", "split", "seed", "images", "patch_size", "results"}
    assert {"mask_ratio", "loss", "acc", "acc_nonempty", "bit_acc", "majority_acc", "masked_patches"} <= set(m)
    assert {"nonempty_patches", "per_class", "confusions", "baselines"} <= set(m)
    assert m["loss"] == pytest.approx(float(F.cross_entropy(logits.flatten(0, 1), truth.flatten())), rel=1e-5)
    assert m["bit_acc"] == pytest.approx(1 - wrong_bits / (64 * 32 * 4), abs=1e-12)
    assert m["mask_ratio"] == 0.5 and m["masked_patches"] == 64 * 32 and report["images"] == 64
    assert m["nonempty_patches"] == int(filled.sum())
    assert m["acc"] == int(hit.sum()) / (64 * 32)
    assert m["acc_nonempty"] == int((hit & filled).sum()) / int(filled.sum())
    assert m["majority_acc"] == m["baselines"]["majority"]["acc"] == int((~filled).sum()) / (64 * 32)  # "empty"
    counts = torch.bincount(truth.flatten(), minlength=16).tolist()
    assert {r["class"]: r["patches"] for r in m["per_class"]} == {c: n for c, n in enumerate(counts) if n}
    assert_user_error(run_cli("eval", "--checkpoint", run / "last.pt", "--mask-ratio", "1"), "--mask-ratio")
