"""A training's speed on a CPU it shares: alone, and beside one other CPU-bound process.

Each variant (a thread count, an OpenMP wait policy, compiled or eager) runs in a fresh process of
its own (OpenMP reads its settings once, at start). It trains the config's real step
(`Trainer.train_step`) and times rounds of --steps steps, alternating: a round alone, then a round
with a competitor running (one process spinning a pure-Python loop: one core's worth of work, as a
second job on the machine would be), and so on for --rounds pairs. Reported per variant: the median
images/s alone and shared, and their ratio; half the alone speed is a fair share of a machine with
one more job than it has cores.

    python scripts/bench_shared_cpu.py --config configs/mnist.yaml --set data.source=idx \\
        --set data.path=../shared/data/mnist --variant threads=0 --variant threads=1 \\
        --variant threads=0,wait=passive --variant threads=0,compile=0
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SPIN = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "mnist.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--steps", type=int, default=40, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3, help="pairs of rounds (alone, shared)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="threads=N (0: the trainer's choice), wait=passive|active (OMP_WAIT_POLICY), spin=N (GOMP_SPINCOUNT), "
        "compile=0|1; "
        "comma-separated, repeatable",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one variant, in its own process
    p.add_argument("--json", default=None, help="write the results here too")
    return p.parse_args(argv)


def parse_variant(text: str) -> dict[str, str]:
    pairs = [kv.split("=", 1) for kv in text.split(",") if kv]
    return {k: v for k, v in pairs}


def time_steps(trainer, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(trainer.sampler.sample())
    float(trainer._grad_norm_sum)  # the host sync: every step's work is done
    return time.perf_counter() - t0


def child(args) -> None:
    """One variant: build the trainer, warm up, then alternate timed rounds alone and shared."""
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from vitmask.config import load_config
    from vitmask.data.batches import load_splits
    from vitmask.train.trainer import Trainer

    variant = parse_variant(args.child)
    sets = [*args.set, "train.max_steps=1000000"]
    if "compile" in variant:
        sets.append(f"train.compile={'true' if variant['compile'] == '1' else 'false'}")
    cfg = load_config(args.config, sets)
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    threads = int(variant.get("threads", "0"))
    if threads:
        torch.set_num_threads(threads)
    time_steps(trainer, 10)  # compile, caches, allocator
    batch = cfg.data.batch_size
    alone, shared = [], []
    for _ in range(args.rounds):
        alone.append(args.steps * batch / time_steps(trainer, args.steps))
        spinner = subprocess.Popen([sys.executable, "-c", SPIN])
        try:
            time.sleep(0.5)  # the competitor is running
            shared.append(args.steps * batch / time_steps(trainer, args.steps))
        finally:
            spinner.kill()
            spinner.wait()
    row = {
        "variant": args.child,
        "threads": torch.get_num_threads(),
        "alone_img_s": round(statistics.median(alone), 1),
        "shared_img_s": round(statistics.median(shared), 1),
    }
    row["shared_over_alone"] = round(row["shared_img_s"] / row["alone_img_s"], 3)
    print(json.dumps(row), flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        child(args)
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{cpus} CPUs in this process's affinity, load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d')}")
    rows = []
    for text in args.variant or ["threads=0"]:
        variant = parse_variant(text)
        env = dict(os.environ)
        if "wait" in variant:
            env["OMP_WAIT_POLICY"] = variant["wait"].upper()
        if "spin" in variant:
            env["GOMP_SPINCOUNT"] = variant["spin"]
        cmd = [sys.executable, __file__, "--config", args.config, "--steps", str(args.steps)]
        cmd += ["--rounds", str(args.rounds), "--child", text, *(a for kv in args.set for a in ("--set", kv))]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"{text}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{text:<28} threads {row['threads']}  alone {row['alone_img_s']:>7.1f} img/s  "
            f"shared {row['shared_img_s']:>7.1f} img/s  ratio {row['shared_over_alone']:.3f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
