"""scripts/benchmark.py runs end to end on a tiny config and writes every figure it promises.
No timing is asserted: speed is measured by `make bench`, never by the test suite."""

import json
import math
import subprocess

from tests.conftest import ROOT, assert_user_error, run_script

BENCH = ROOT / "scripts" / "benchmark.py"


def run_bench(*args: str) -> subprocess.CompletedProcess:
    """`python scripts/benchmark.py ARGS` in this process (its start-up is not what these tests check)."""
    return run_script(BENCH, "--device", "cpu", "--batch", "8", "--steps", "2", "--warmup", "1", *args)


def test_benchmark_reports_vitmask_reference_and_variant(tiny_config, tmp_path):
    out = tmp_path / "bench.json"
    decoder = "model.decoder=cross,mask.fill=learned"  # the encoder-decoder designs are variants like any other
    variants = ("--vs", "model.attention=explicit", "--vs", "autocast=bf16", "--vs", decoder)
    variants += ("--vs", "data.batch_size=4")  # its own batch: the script ran at --batch 8
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
    # a variant with its own batch: its images per second are its 4 images over its own step time
    small = r["variants"]["data.batch_size=4"]
    assert math.isclose(small["images_per_s"], 4 / (small["step_ms"] / 1000))
    assert math.isclose(small["tokens_per_s"], small["images_per_s"] * 64)
    assert "vitmask / reference (train images/s)" in res.stdout


def test_benchmark_bad_variant_is_a_user_error(tiny_config):
    res = run_bench("--config", tiny_config, "--vs", "autocast=fp8", "--no-reference")
    assert_user_error(res, "autocast", "bf16")


def test_benchmark_runs_the_shipped_recipe_against_its_reference(tmp_path):
    # configs/default.yaml: learned fill, uniform ratio schedule, mixed masks; and the mask timing
    out = tmp_path / "bench.json"
    small = ("--set", "data.num_train=64", "--set", "data.num_val=16", "--set", "data.num_test=16")
    res = run_bench("--eval-batches", "1", *small, "--mask-timing", "4,8", "--json", out)
    assert res.returncode == 0, res.stderr
    r = json.loads(out.read_text())
    assert r["reference"]["images_per_s"] > 0 and r["vitmask"]["images_per_s"] > 0
    assert set(r["mask_timing_ms"]) == {"4", "8"}
    assert all(t[k] > 0 for t in r["mask_timing_ms"].values() for k in ("random", "block", "mixed"))
    assert "mask building, ms per batch" in res.stdout


def test_benchmark_bad_mask_timing_is_a_user_error(tiny_config):
    res = run_bench("--config", tiny_config, "--mask-timing", "16,lots", "--no-reference")
    assert_user_error(res, "--mask-timing", "16,1024")


def test_benchmark_times_vitmask_alone_where_the_reference_cannot_build_the_model(tiny_config, tmp_path):
    out = tmp_path / "bench.json"
    res = run_bench("--config", tiny_config, "--set", "model.norm=none", "--eval-batches", "1", "--json", out)
    assert res.returncode == 0, res.stderr
    assert "reference skipped: the reference model needs model.norm=layernorm" in res.stdout
    r = json.loads(out.read_text())
    assert r["vitmask"]["images_per_s"] > 0 and "reference" not in r
