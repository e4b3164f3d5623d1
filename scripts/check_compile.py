"""Check that the compiled training step computes what the eager one computes, on your machine.

Trains a config with train.compile on for --steps steps and, at every --every-th step, runs the
step's batch through the compiled net and through the plain module from the same state, and
compares the loss and the gradients (vitmask.train.parity: the tolerances and why). One line per
checked step; exit 0 when every check is within its tolerance, 1 when one is not, 2 on bad input.

    python scripts/check_compile.py --config configs/mnist-gpu.yaml --device cuda --steps 200 --every 20 \\
        --set data.source=idx --set data.path=data/mnist --set train.compile_mode=reduce-overhead

The config's own train.compile_mode and train.step_shapes are checked (override them with --set);
train.compile is set to true. With --networks N, N networks (seeds seed, seed + 1, ...) are trained
and checked one after another in this one process, each earlier Trainer kept alive: torch.compile
runs the later networks through the code it compiled for the first, as a ladder of runs sharing a
process does, and the check says whether that code computes their steps too.
"""

import argparse
import dataclasses
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
from vitmask.train.parity import check_run  # noqa: E402
from vitmask.train.trainer import Trainer, static_step  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--steps", type=int, default=100, help="steps to train")
    p.add_argument("--every", type=int, default=10, help="check every k-th step (0, k, 2k, ...)")
    p.add_argument("--networks", type=int, default=1, help="networks checked one after another in this process")
    return p.parse_args(argv)


def print_line(result) -> None:
    print(result.line(), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps < 1 or args.every < 1 or args.networks < 1:
        raise UserError(
            f"--steps, --every and --networks must be >= 1, got {args.steps}, {args.every} and {args.networks}"
        )
    device = resolve_device(args.device)
    cfg = load_config(args.config, [*args.set, "train.compile=true", f"train.max_steps={args.steps}"])
    train = cfg.train
    precision = precision_on(train.precision, device)
    shapes = "static" if static_step(cfg) else "masked"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"compile parity: {args.config} on {name}, torch {torch.__version__}, compile_mode {train.compile_mode}, "
        f"step shapes {shapes}, {precision}, accum_steps {train.accum_steps}, {args.steps} steps, "
        f"checked every {args.every}, {args.networks} network(s) in one process",
        flush=True,
    )
    t0 = time.perf_counter()
    data = dataclasses.replace(cfg.data, split_seed=cfg.split_seed)  # every network: the same images
    results, trainers = [], []
    try:
        for i in range(args.networks):
            run_cfg = dataclasses.replace(cfg, seed=cfg.seed + i, data=data)
            if args.networks > 1:
                print(f"network {i + 1} of {args.networks}, seed {run_cfg.seed}", flush=True)
            trainers.append(Trainer(run_cfg, load_splits(run_cfg), device))  # the earlier ones stay alive
            results += check_run(trainers[-1], args.steps, args.every, precision, on_result=print_line)
    finally:
        for trainer in trainers:
            trainer.close()
    bad = [r for r in results if not r.ok]
    worst = max(max(r.loss_rel, r.grad_rel) for r in results)
    print(
        f"{len(results)} checks, {len(bad)} outside tolerance {results[0].tol:.0e} (worst {worst:.2e}), "
        f"{time.perf_counter() - t0:.0f} s"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
