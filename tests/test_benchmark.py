"""scripts/benchmark.py runs end to end on a tiny config and writes every figure it promises.
No timing is asserted: speed is measured by `make bench`, never by the test suite."""

import json
import math
import subprocess
import sys

from tests.conftest import ROOT, assert_user_error
from vitmask.checkpoint import load_checkpoint

BENCH = ROOT / "scripts" / "benchmark.py"


def run_bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--batch", "8", "--steps", "2", "--warmup", "1"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_benchmark_reports_vitmask_reference_and_variant(tiny_config, tmp_path):
    out = tmp_path / "bench.json"
    decoder = "model.decoder=cross,mask.fill=learned"  # the encoder-decoder designs are variants like any other
    variants = ("--vs", "model.attention=explicit", "--vs", "autocast=bf16", "--vs", decoder)
    res = run_bench("--config", tiny_config, "--eval-batches", "1", *variants, "--json", out)
    assert res.returncode == 0, res.stderr
    r = json.loads(out.read_text())
    for name in ("vitmask", "reference"):
        for key in ("images_per_s", "tokens_per_s", "batch_share_in_step", "achieved_gflops", "pct_of_peak"):
            assert math.isfinite(r[name][key]) and r[name][key] > 0, (name, key)
        assert r[name]["peak_memory_mb"] > 0
        assert r[name]["tokens_per_s"] == r[name]["images_per_s"] * 64  # 16x16 image, 2x2 patches
    assert r["vitmask"]["eval_images_per_s"] > 0
    assert r["ratio"] == r["vitmask"]["images_per_s"] / r["reference"]["images_per_s"]
    assert set(r["matmul_peak_gflops"]) == {"fp32", "bf16"}
    assert r["precision"] == "fp32" and not r["compile"]
    # the reference computes every token in every block, vitmask's last block only the masked ones
    assert r["reference_train_gflop_per_image"] > r["train_gflop_per_image"]
    for name, per_image in (("vitmask", "train_gflop_per_image"), ("reference", "reference_train_gflop_per_image")):
        assert math.isclose(r[name]["achieved_gflops"], r[name]["images_per_s"] * r[per_image])
    assert r["variants"]["model.attention=explicit"]["images_per_s"] > 0
    assert r["variants"]["autocast=bf16"]["precision"] == "bf16"  # the trainer's own train.precision
    assert r["variants"][decoder]["images_per_s"] > 0
    assert (
        r["variants"][decoder]["achieved_gflops"] < r["variants"][decoder]["images_per_s"] * r["train_gflop_per_image"]
    )
    assert "vitmask / reference (train images/s)" in res.stdout


def test_benchmark_bad_variant_is_a_user_error(tiny_config):
    res = run_bench("--config", tiny_config, "--vs", "autocast=fp8", "--no-reference")
    assert_user_error(res, "autocast", "bf16")


SPEEDRUN = ROOT / "scripts" / "speedrun.py"


def test_speedrun_writes_an_accuracy_versus_time_curve(tiny_config, tmp_path):
    curve = tmp_path / "curve.csv"
    cmd = [sys.executable, str(SPEEDRUN), "--config", tiny_config, "--device", "cpu", "--budget", "4"]
    cmd += ["--eval-every", "1", "--eval-batches", "1", "--target", "1.01", "--curve", str(curve)]
    cmd += ["--save", str(tmp_path / "last.pt")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "not reached in 4 s" in res.stdout  # a target above 1 is never reached
    lines = curve.read_text().splitlines()
    assert lines[0] == "seconds,step,loss,acc,acc_nonempty"
    rows = [list(map(float, ln.split(","))) for ln in lines[1:]]
    assert len(rows) >= 1
    seconds, steps = [r[0] for r in rows], [r[1] for r in rows]
    assert seconds == sorted(seconds) and steps == sorted(steps) and steps[0] >= 1
    assert seconds[-1] >= 4 and all(0 <= r[3] <= 1 and 0 <= r[4] <= 1 for r in rows)
    state = load_checkpoint(tmp_path / "last.pt")  # the trained model, for vitmask eval
    assert state["step"] == steps[-1]  # one optimisation step per recorded step


def test_speedrun_bad_ratio_is_a_user_error(tiny_config):
    res = subprocess.run(
        [sys.executable, str(SPEEDRUN), "--config", tiny_config, "--ratio", "1.5"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert_user_error(res, "--ratio", "between 0 and 1")
