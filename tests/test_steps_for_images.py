"""scripts/steps_for_images.py end to end on two small sets of MNIST digits, a few steps each: the
sets are the first N/10 digits of each class, every validation is read, and the best step is the one
of the lowest EMA validation loss in the run's metrics.csv. No training length is measured here:
docs/own-data.md's rule comes from the script's full runs."""

import csv
import json
import os

import numpy as np
import pytest

from tests.conftest import MNIST_DIR, ROOT, run_script

SMALL = ["model.hidden_dim=16", "model.ffn_dim=32", "model.depth=1", "model.num_heads=2", "train.compile=false",
         "train.warmup_steps=1", "data.batch_size=8"]  # fmt: skip


def test_each_set_trains_and_its_best_step_is_its_lowest_validation(tmp_path):
    if not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        if os.environ.get("VITMASK_CI") == "1":
            pytest.fail(f"VITMASK_CI=1 and MNIST's t10k idx files are missing from {MNIST_DIR}")
        pytest.skip(f"needs MNIST's t10k idx files in {MNIST_DIR}")
    sets = [a for key in SMALL for a in ("--set", key)]
    args = ["--data", MNIST_DIR, "--images", "100", "200", "--steps", "6", "--eval-every", "2", "--work", tmp_path]
    res = run_script(ROOT / "scripts" / "steps_for_images.py", *args, *sets)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["images"] for r in rows] == [100, 200]
    # 10 of each digit, a tenth to val and a tenth to test: 80 and 160 to train on
    assert [r["train_images"] for r in rows] == [80, 160]
    for r in rows:
        with open(tmp_path / f"n{r['images']}" / "metrics.csv", newline="") as f:
            val = [(int(row["step"]), float(row["val_ema/loss"])) for row in csv.DictReader(f) if row["val_ema/loss"]]
        assert [s for s, _ in val] == [2, 4, 6] and [tuple(c) for c in r["curve"]] == val
        best = min(val, key=lambda sl: sl[1])
        assert (r["best_step"], r["best_val_loss"], r["last_val_loss"]) == (best[0], best[1], val[-1][1])
        assert r["epochs_at_best"] == best[0] * 8 / r["train_images"]
    digits = np.load(tmp_path / "mnist-by-class" / "3.npy")
    assert digits.shape[1:] == (28, 28) and digits.dtype == np.uint8 and len(digits) > 900  # MNIST's 1,010 threes
