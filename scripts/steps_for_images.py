"""How many training steps suit a set of N images: configs/mnist.yaml trained on N MNIST digits, its
validation loss every few hundred steps, and the step where it was lowest.

A user's own set is a folder of N images split 80/10/10 (data.val_fraction, data.test_fraction).
This script makes such sets from MNIST's test-set files: the first N/10 digits of each class, written
as one <digit>.npy per class (the npy source, data.max_per_class = N/10), so every set is the same
kind of data at another size. Each set trains configs/mnist.yaml (its model, masks, optimiser and
schedule) for --steps steps with a validation every --eval-every, through `vitmask.train`; the
validation loss read is the EMA weights' (`val_ema/loss`: what eval, probe and export use).

The table gives, for each N: its train images, the step of the lowest validation loss, that loss,
the loss at the last step, and the passes over the train images (epochs) at the best step. The rule
in docs/own-data.md comes from this table.

    python scripts/steps_for_images.py --data ../shared/data/mnist --images 500 2000 --steps 4000

Each run is a full training (about 5 minutes per 4,000 steps on 2 CPU cores, compiled); nothing else
should run beside it. Runs go under --work (default runs/steps-for-images).
"""

import argparse
import csv
import gzip
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import vitmask  # noqa: E402
from vitmask.config import load_config  # noqa: E402
from vitmask.data.batches import load_splits  # noqa: E402

VAL_LOSS = "val_ema/loss"  # configs/mnist.yaml keeps an EMA (train.ema_decay): its weights are scored


def write_class_files(data: Path, out: Path) -> None:
    """MNIST's test-set digits as out/<digit>.npy, (n, 28, 28) uint8 gray levels, in file order."""
    with gzip.open(data / "t10k-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(data / "t10k-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    out.mkdir(parents=True, exist_ok=True)
    for digit in range(10):
        np.save(out / f"{digit}.npy", images[labels == digit])


def validation_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, validation loss) of every validation in the run's metrics.csv."""
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get(VAL_LOSS)]
    return [(int(r["step"]), float(r[VAL_LOSS])) for r in rows]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="a folder with MNIST's t10k-*-idx*-ubyte.gz files")
    ap.add_argument("--images", type=int, nargs="+", default=[500, 2000], help="set sizes N (multiples of 10)")
    ap.add_argument("--steps", type=int, default=4000, help="training steps of each run")
    ap.add_argument("--eval-every", type=int, default=250, help="steps between validations")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "steps-for-images", help="where runs go")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another config key")
    a = ap.parse_args(argv)
    classes = a.work / "mnist-by-class"
    write_class_files(a.data, classes)
    rows = []
    for n in a.images:
        overrides = [
            "data.source=npy", f"data.path={classes}", f"data.max_per_class={n // 10}",
            f"train.max_steps={a.steps}", f"train.eval_every={a.eval_every}", f"train.checkpoint_every={a.steps}",
            "train.loggers=[csv]", *a.set,
        ]  # fmt: skip
        result = vitmask.train(ROOT / "configs" / "mnist.yaml", overrides=overrides, run_dir=a.work / f"n{n}")
        losses = validation_losses(result.run_dir)
        best_step, best = min(losses, key=lambda sl: sl[1])
        cfg = load_config(ROOT / "configs" / "mnist.yaml", overrides)
        train_images, batch = len(load_splits(cfg)["train"]), cfg.data.batch_size
        rows.append({"images": n, "train_images": train_images, "best_step": best_step, "best_val_loss": best,
                     "last_val_loss": losses[-1][1], "epochs_at_best": best_step * batch / train_images,
                     "curve": losses})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'N':>6} {'train':>6} {'best step':>9} {'best val':>9} {'last val':>9} {'epochs':>7}")
    for r in rows:
        print(f"{r['images']:>6} {r['train_images']:>6} {r['best_step']:>9} {r['best_val_loss']:>9.4f} "
              f"{r['last_val_loss']:>9.4f} {r['epochs_at_best']:>7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
