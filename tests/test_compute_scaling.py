"""scripts/compute_scaling.py: each budget trains in a fresh process, raw and EMA weights are scored,
and on a tiny config a 4x longer budget does not score worse than the shorter one."""

import json
import math
import subprocess
import sys

import yaml

from tests.conftest import ROOT, TINY


# About 15 s here: three fresh processes (the script, then one per budget, each importing torch) that
# train 15 and 60 steps and score raw and EMA weights; a process per run is what the test checks.
def test_a_longer_budget_never_scores_worse_and_each_run_is_a_process_of_its_own(tmp_path):
    cfg = {
        **TINY,
        "mask": {"ratio_schedule": "uniform", "strategy": "mixed"},
        "model": {**TINY["model"], "depth": 1},
        "train": {**TINY["train"], "ema_decay": 0.9, "warmup_steps": 5, "schedule": "cosine"},
    }
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "scaling.jsonl"
    cmd = [sys.executable, str(ROOT / "scripts" / "compute_scaling.py"), "--config", str(config), "--device", "cpu"]
    cmd += ["--base-steps", "15", "--multipliers", "1,4", "--out", str(out), "--save-dir", str(tmp_path / "runs")]
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    header, runs, probe = rows[0], [r for r in rows if r["kind"] == "run"], rows[-1]
    assert header["kind"] == "header" and header["base_steps"] == 15 and "calibration_step_ms" not in header
    assert [r["steps"] for r in runs] == [15, 60]
    # a process per run, none of them the parent's: no Trainer of one run lives beside another's
    assert len({header["pid"], *(r["pid"] for r in runs)}) == 3
    assert probe["kind"] == "probe" and probe["checkpoint"].endswith("x4.pt")
    for weights in ("raw", "ema"):
        short, long = runs[0][weights], runs[1][weights]
        # the two estimates' Monte Carlo error: two standard errors of their difference
        mc = 2 * math.hypot(short["test_nll_se"], long["test_nll_se"])
        assert long["test_nll"] <= short["test_nll"] + mc, (weights, short["test_nll"], long["test_nll"], mc)
        assert long["train_nll"] <= short["train_nll"] + 2 * math.hypot(short["train_nll_se"], long["train_nll_se"])
    assert runs[1]["test_nll"] == runs[1]["ema"]["test_nll"]  # the headline is the EMA's
    assert runs[0]["raw"]["test_nll"] != runs[0]["ema"]["test_nll"]  # two sets of weights were scored
