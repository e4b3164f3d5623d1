"""What the compiled step's check costs (train/compile_check.py): a checked step against a plain one.

A compiled run checks its first step in each process: the batch runs through the compiled net and
again through the plain module, and the gradients are compared. This script builds a config's
Trainer with train.compile on, compiles the step (untimed; its seconds are printed), then times
--repeats plain compiled steps and --repeats checked steps, alternating, on the same warm process,
and prints the median of each and their difference: the check's cost, paid once per process.

    python scripts/bench_compile_check.py --config configs/mnist.yaml \\
        --set data.source=idx --set data.path=DIR --repeats 10
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vitmask.config import load_config  # noqa: E402
from vitmask.data.batches import load_splits  # noqa: E402
from vitmask.errors import UserError  # noqa: E402
from vitmask.runtime.process import precision_on, resolve_device  # noqa: E402
from vitmask.train.parity import compare_step  # noqa: E402
from vitmask.train.trainer import Trainer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--repeats", type=int, default=10, help="timed steps of each kind")
    return p.parse_args(argv)


def timed(fn, device: torch.device) -> float:
    """Seconds `fn()` takes, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {args.repeats}")
    device = resolve_device(args.device)
    cfg = load_config(args.config, [*args.set, "train.compile=true"])
    trainer = Trainer(cfg, load_splits(cfg), device)
    precision = precision_on(cfg.train.precision, device)
    compile_s = timed(lambda: trainer.train_step(trainer.sampler.sample()), device)
    for _ in range(2):  # warm: a second graph for the static step's other masked counts, if any
        trainer.train_step(trainer.sampler.sample())

    def checked():
        compare_step(trainer, trainer.sampler.sample(), precision).apply(trainer)

    plain, check = [], []
    for _ in range(args.repeats):
        plain.append(timed(lambda: trainer.train_step(trainer.sampler.sample()), device))
        check.append(timed(checked, device))
    p, c = statistics.median(plain) * 1e3, statistics.median(check) * 1e3
    print(
        f"{args.config} on {device.type}, {precision}, batch {cfg.data.batch_size}: first step with compile "
        f"{compile_s:.1f} s; compiled step {p:.1f} ms, checked step {c:.1f} ms (median of {args.repeats}); "
        f"the check costs {c - p:.1f} ms once per process"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"bench_compile_check: error: {e}", file=sys.stderr)
        sys.exit(2)
