"""Quality against compute: one config trained at 1x, 4x, 16x and 64x a base budget of steps.

The base budget is set in steps (--base-steps) or in seconds of training (--base-seconds): then a
process of its own first times the config's step (after compiling it, when train.compile is on) and
base = round(base-seconds / step time) steps. Each run starts fresh from the config's seed with
train.max_steps = k x base (the schedule's warm-up stays as the config says, capped at a tenth of
the run), and is timed around its steps alone (device-synchronised, compilation excluded: the first
step's time is reported on its own). After each run:

- the NLL bound (stratified, `vitmask eval --nll`'s estimator) on the test split (or its first
  --nll-images images) and on as many images of the train split (the first ones), to show where
  the model starts to fit its training images better than unseen ones; for the trained (raw)
  weights and, with train.ema_decay, the EMA's;
- accuracy and non-empty accuracy at mask ratio 0.5 (random masks) and in the centre box, on test;
- for the largest run, the linear and k-NN probes (`vitmask probe`'s defaults).

Each run is a process of its own, as `vitmask train` would be: no run shares torch.compile's caches,
CUDA-graph pools or memory with another run or with the calibration.
Every result is appended to --out as one JSON line as soon as it is known; each run's checkpoint
goes to --save-dir. A run whose projected time would pass --deadline seconds is skipped and says so.

    python scripts/compute_scaling.py --config configs/mnist-gpu.yaml --base-seconds 1.5 \\
        --set data.source=idx --set data.path=data/mnist --out runs/scaling.jsonl --save-dir runs/scaling
"""

import time

START = time.perf_counter()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vitmask.cli.verbs import evaluate_checkpoint, probe_checkpoint  # noqa: E402
from vitmask.config import load_config  # noqa: E402
from vitmask.data.batches import load_splits  # noqa: E402
from vitmask.errors import UserError  # noqa: E402
from vitmask.evaluate.likelihood import nll_report  # noqa: E402
from vitmask.inference.open import open_model  # noqa: E402
from vitmask.runtime.process import resolve_device  # noqa: E402
from vitmask.store.checkpoint import save_checkpoint  # noqa: E402
from vitmask.train.trainer import Trainer  # noqa: E402

SCALARS = ("loss", "acc", "acc_nonempty", "bit_acc")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--base-seconds", type=float, default=2.0, help="seconds of training of the 1x run")
    p.add_argument("--base-steps", type=int, default=0, help="steps of the 1x run (0: from --base-seconds)")
    p.add_argument("--multipliers", default="1,4,16,64", help="budgets, in units of the base")
    p.add_argument("--deadline", type=float, default=1e9, help="skip runs that would end after this many seconds")
    p.add_argument("--nll-samples", type=int, default=2, help="draws per stratum and image of the NLL bound")
    p.add_argument("--nll-images", type=int, default=0, help="NLL bound on the first N test and train images (0: all)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one run of the parent's ladder
    p.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)  # time the step, in a process alone
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # a child run: probe its model
    p.add_argument("--out", required=True, help="JSON lines, one per result")
    p.add_argument("--save-dir", required=True, help="a checkpoint per run")
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def emit(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)


def with_steps(cfg, steps: int):
    train = cfg.train
    warmup = min(train.warmup_steps, max(1, steps // 10))
    every = max(1, steps)  # no validation inside the timed loop
    train = dataclasses.replace(
        train, max_steps=steps, warmup_steps=warmup, eval_every=every, checkpoint_every=every, log_every=every
    )
    return dataclasses.replace(cfg, train=train)


def step_seconds(cfg, splits, device, steps: int = 60) -> tuple[float, float]:
    """(first step's seconds, mean seconds of `steps` steps after 10 warm-up steps). Run only in a
    process of its own (--calibrate), so no run shares a process, a compile cache or memory with it."""
    trainer = Trainer(with_steps(cfg, 10_000), splits, device)
    t0 = time.perf_counter()
    trainer.train_step(trainer.sampler.sample())
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(10):
        trainer.train_step(trainer.sampler.sample())
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(trainer.sampler.sample())
    sync(device)
    return first, (time.perf_counter() - t0) / steps


def train_run(cfg, splits, device, steps: int) -> tuple[Trainer, float, float]:
    """A fresh run of `steps` steps: (trainer, first step's seconds, seconds of the other steps)."""
    trainer = Trainer(with_steps(cfg, steps), splits, device)
    t0 = time.perf_counter()
    trainer.train_step(trainer.sampler.sample())
    sync(device)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    while trainer.step < steps:
        trainer.train_step(trainer.sampler.sample())
    sync(device)
    return trainer, first, time.perf_counter() - t0


def scores(ckpt: Path, cfg, splits, device, weights: str, nll_samples: int, nll_images: int) -> dict:
    """The NLL bound on the first `nll_images` test images (0: all) and on as many train images, r=0.5
    and centre-box accuracy on the whole test split, of one set of a checkpoint's weights (raw or ema)."""
    test = evaluate_checkpoint(ckpt, "test", [0.5], str(device), centre_box=True, weights=weights)
    model, _, _, _ = open_model(ckpt, str(device), 0, weights)
    train = splits["train"].to(device)
    n = min(nll_images or len(splits["test"]), len(splits["test"]), len(train))
    nll = {
        name: nll_report(model, train, images[:n].to(device), cfg.data.patch_size, samples=nll_samples)
        for name, images in (("test", splits["test"]), ("train", train))
    }
    ratio, box = test["results"][0], test["results"][1]
    return {
        "nll_images": n,
        "test_nll": nll["test"]["nats"],
        "test_nll_se": nll["test"]["se_mc"],
        "train_nll": nll["train"]["nats"],
        "train_nll_se": nll["train"]["se_mc"],
        "r05": {m: ratio[m] for m in SCALARS},
        "centre_box": {m: box[m] for m in SCALARS},
    }


def run_one(args, cfg, splits, device, steps: int, k: int) -> Path:
    """Train one budget in this process, score its raw and EMA weights, emit one row."""
    trainer, first, seconds = train_run(cfg, splits, device, steps)
    ckpt = save_checkpoint(trainer.state_dict(), Path(args.save_dir) / f"x{k}.pt")
    trainer.close()
    row = {
        "kind": "run",
        "multiplier": k,
        "steps": steps,
        "images_seen": steps * cfg.data.batch_size,
        "first_step_s": round(first, 2),
        "train_seconds": round(seconds, 2),
        "pid": os.getpid(),  # each run's process is its own
    }
    for weights in ("raw", "ema") if trainer.ema is not None else ("raw",):
        row[weights] = scores(ckpt, cfg, splits, device, weights, args.nll_samples, args.nll_images)
    # the headline figures: the EMA's where there is one (what evaluation and export use by default)
    headline = row.get("ema", row["raw"])
    row.update(weights="ema" if "ema" in row else "raw", test_nll=headline["test_nll"], train_nll=headline["train_nll"])
    row.update(process_s=round(time.perf_counter() - START, 1), checkpoint=str(ckpt))
    emit(Path(args.out), row)
    return ckpt


def child_command(args, device, *extra: str) -> list[str]:
    cmd = [sys.executable, __file__, "--config", args.config, "--device", str(device)]
    cmd += [a for kv in args.set for a in ("--set", kv)]
    cmd += ["--nll-samples", str(args.nll_samples), "--nll-images", str(args.nll_images)]
    cmd += ["--out", args.out, "--save-dir", args.save_dir]
    return cmd + list(extra)


def calibrate(args, device) -> dict:
    """The step time, measured in a process of its own: {"first_step_s", "step_ms"}."""
    done = subprocess.run(child_command(args, device, "--calibrate"), check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    cfg = load_config(args.config, args.set)
    out, save_dir = Path(args.out), Path(args.save_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_dir.mkdir(parents=True, exist_ok=True)
    multipliers = [int(m) for m in args.multipliers.split(",")]
    if args.calibrate:
        first, per_step = step_seconds(cfg, load_splits(cfg), device)
        print(json.dumps({"first_step_s": round(first, 2), "step_ms": round(per_step * 1e3, 3)}), flush=True)
        return
    if args.child:  # one budget of the parent's ladder
        splits = load_splits(cfg)
        ckpt = run_one(args, cfg, splits, device, multipliers[0] * args.base_steps, multipliers[0])
        if args.probe:
            probe = probe_checkpoint(ckpt, "test", None, 20, 0, str(device))
            emit(out, {"kind": "probe", "checkpoint": str(ckpt), **{k: probe[k] for k in probe if k != "checkpoint"}})
        return
    header = {
        "config": args.config,
        "overrides": args.set,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "pid": os.getpid(),
    }
    base, per_step = args.base_steps, 0.0
    if not base:
        timing = calibrate(args, device)
        per_step = timing["step_ms"] / 1e3
        base = max(1, round(args.base_seconds / per_step))
        header.update(calibration_first_step_s=timing["first_step_s"], calibration_step_ms=timing["step_ms"])
    header["base_steps"] = base
    emit(out, {"kind": "header", **header})
    for k in multipliers:
        steps = k * base
        now = time.perf_counter() - START
        projected = now + steps * per_step * 1.1 + 30.0  # training, plus starting, compiling and scoring
        if projected > args.deadline:
            emit(out, {"kind": "skipped", "multiplier": k, "steps": steps, "projected_end_s": round(projected, 1)})
            continue
        extra = ["--child", "--base-steps", str(base), "--multipliers", str(k)]
        subprocess.run(child_command(args, device, *extra, *(["--probe"] if k == multipliers[-1] else [])), check=False)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
