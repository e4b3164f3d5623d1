"""Speedrun: wall time from process start until an evaluation reaches a target accuracy.

Trains with vitmask's Trainer (`sampler.sample()`, `train_step`, `evaluate`) and evaluates every
--eval-every seconds of training on the held-out validation split, at mask ratio --ratio. It stops
when non-empty-patch accuracy reaches --target (0.60 by default) or after --budget seconds, and
writes the accuracy-versus-time curve as CSV (seconds since process start, step, loss, acc,
acc_nonempty). Evaluation time counts against the clock: it is part of reaching the target.

    python scripts/speedrun.py --config configs/mnist.yaml --budget 600 --curve runs/speedrun.csv
"""

import time

START = time.perf_counter()  # before importing torch: the clock starts with the process

import argparse  # noqa: E402
import csv  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vitmask.config import load_config  # noqa: E402
from vitmask.data.batches import load_splits  # noqa: E402
from vitmask.errors import UserError  # noqa: E402
from vitmask.runtime.process import resolve_device  # noqa: E402
from vitmask.store.checkpoint import save_checkpoint  # noqa: E402
from vitmask.train.trainer import Trainer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--target", type=float, default=0.60, help="non-empty-patch accuracy to reach")
    p.add_argument("--ratio", type=float, default=0.5, help="mask ratio of the evaluation")
    p.add_argument("--budget", type=float, default=600.0, help="give up after this many seconds")
    p.add_argument("--eval-every", type=float, default=30.0, help="seconds of training between evaluations")
    p.add_argument(
        "--eval-batches",
        type=int,
        default=0,
        help="eval batches of 256 images (0 = all the validation images: train.eval_images of val)",
    )
    p.add_argument("--curve", default="", help="write the accuracy-versus-time curve to this CSV")
    p.add_argument("--save", default="", help="write the final checkpoint here (for vitmask eval)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not 0.0 < args.ratio < 1.0:
        raise UserError(f"--ratio must be strictly between 0 and 1, got {args.ratio}")
    device = resolve_device(args.device)
    cfg = load_config(args.config, args.set)
    trainer = Trainer(cfg, load_splits(cfg), device)
    curve: list[dict] = []
    reached = None
    next_eval = time.perf_counter() - START + args.eval_every
    while True:
        out = trainer.train_step(trainer.sampler.sample())  # advances trainer.step
        now = time.perf_counter() - START
        if now < next_eval and now < args.budget:
            continue
        val = trainer.evaluate(args.eval_batches, args.ratio)
        t = time.perf_counter() - START
        row = {"seconds": round(t, 2), "step": trainer.step, "loss": float(out["loss"])}
        row.update({k: val[k] for k in ("acc", "acc_nonempty")})
        curve.append(row)
        print(f"{t:7.1f}s  step {trainer.step:6d}  acc {val['acc']:.4f}  non-empty acc {val['acc_nonempty']:.4f}")
        sys.stdout.flush()
        if val["acc_nonempty"] >= args.target:
            reached = t
            break
        if t >= args.budget:
            break
        next_eval = t + args.eval_every
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(trainer.state_dict(), args.save)
    if args.curve:
        Path(args.curve).parent.mkdir(parents=True, exist_ok=True)
        with open(args.curve, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["seconds", "step", "loss", "acc", "acc_nonempty"])
            w.writeheader()
            w.writerows(curve)
    if reached is None:
        print(f"target non-empty acc {args.target} not reached in {args.budget:.0f} s")
    else:
        print(f"reached non-empty acc {args.target} at {reached:.1f} s (step {trainer.step})")
    return {"reached_s": reached, "curve": curve}


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
