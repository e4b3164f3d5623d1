"""What the loggers of `train.loggers` cost the training step: the same run trained once per logger set,
each step timed, in one process.

    python scripts/bench_loggers.py                              # configs/default.yaml, 40 timed steps
    python scripts/bench_loggers.py --config configs/mnist.yaml --steps 100 --rounds 2 \\
        --set data.source=idx --set data.path=DIR

The runs: `[]` (no logger: the baseline), `[tensorboard]`, `[csv, jsonl]`, `[tensorboard, csv,
jsonl]`, and `[mlflow]` and `[wandb]` where those packages are installed (MLflow on a SQLite file and
W&B offline, both in a temporary folder: nothing leaves the machine); `--loggers a,b` (repeatable)
names other sets. Each is `vitmask.train` on the config with `--set` applied, then the benchmark's
own keys: its logger set, `train.log_every` (`--log-every`), and `train.max_steps` = `--warmup` +
`--steps` + 1 with validation and checkpoints at the last step only (no online probe, no early
stopping). Its runs go to a temporary folder (`--run-root` keeps them), its console lines to
/dev/null.

How a step is timed: a callback's `on_start` wraps the trainer's `train_step`, which the loop calls
once a step, and notes the time at each call (the CUDA device synchronised first). The time from one
call to the next is one whole pass of the loop: the step itself, and on a logging step (every
`train.log_every`) the host sync that reads the window's numbers, the console line, and the loggers'
`log`. Steps between logging steps run the same code in every run, so their median is the same with
or without loggers unless a logger slows the step itself (a background thread, a lock, memory
traffic); the logging steps' median minus the baseline's is what a logging step pays for its
loggers. The `--warmup` first steps are not timed, nor the last (its validation and checkpoint).
With `--rounds` R, every set runs R times, the order reversed every other round, and the step times
of its runs are pooled.

Printed: a table, one row per logger set: the median of its non-logging steps and of its logging
steps in ms, each beside its difference from the baseline's, and the counts of steps timed. A bad
argument is one line on stderr and exit code 2.
"""

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import typing
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vitmask.config import LoggerName, load_config  # noqa: E402
from vitmask.errors import UserError  # noqa: E402
from vitmask.train.callbacks import Callback  # noqa: E402
from vitmask.train.loggers import EXTRAS, check_extras  # noqa: E402
from vitmask.train.run import train  # noqa: E402

# the benchmark needs a few thousand images, not the full split: step speed does not depend on it
DATA_OVERRIDES = ["data.num_train=4096", "data.num_val=256", "data.num_test=16"]
SETS = [(), ("tensorboard",), ("csv", "jsonl"), ("tensorboard", "csv", "jsonl"), ("mlflow",), ("wandb",)]
NAMES = typing.get_args(LoggerName)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line, as every other refusal
        raise UserError(message)


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--steps", type=int, default=40, help="timed steps of each run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--log-every", type=int, default=5, help="train.log_every of every run")
    p.add_argument("--rounds", type=int, default=1, help="runs of each logger set, their steps pooled")
    p.add_argument(
        "--loggers",
        action="append",
        default=None,
        metavar="A,B",
        help="a logger set to time beside the baseline (repeatable; default: the sets of the docstring)",
    )
    p.add_argument("--run-root", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    return p.parse_args(argv)


def installed(logger: str) -> bool:
    return logger not in EXTRAS or importlib.util.find_spec(EXTRAS[logger]) is not None


def logger_sets(given: list[str] | None) -> list[tuple[str, ...]]:
    """The baseline `()`, then the sets of `--loggers` (each `a,b`), or SETS where each set's packages
    are installed."""
    if given is None:
        return [s for s in SETS if all(installed(name) for name in s)]
    sets: list[tuple[str, ...]] = [()]
    for text in given:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in NAMES]
        if not names or unknown:
            raise UserError(
                f"--loggers {text!r}: name loggers of {', '.join(NAMES)}, separated by commas "
                f"({'unknown: ' + ', '.join(unknown) if unknown else 'none named'})"
            )
        if names not in sets:
            sets.append(names)
    return sets


def label(names: tuple[str, ...]) -> str:
    return "[" + ", ".join(names) + "]"


def overrides(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The run's --set: the data sizes, the caller's, then the benchmark's own keys (last: they win)."""
    last = args.warmup + args.steps + 1
    return [
        *DATA_OVERRIDES,
        *args.set,
        f"train.loggers={label(names)}",
        f"train.log_every={args.log_every}",
        f"train.max_steps={last}",
        f"train.eval_every={last}",
        f"train.checkpoint_every={last}",
        "train.probe_every=0",
        "train.early_stop_patience=0",
    ]


class StepTimer(Callback):
    """Notes (trainer.step, time) at each call of the trainer's `train_step` (see the module docstring)."""

    def __init__(self):
        self.calls: list[tuple[int, float]] = []

    def on_start(self, trainer) -> None:
        step, device = trainer.train_step, trainer.device

        def timed_step(batch):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.calls.append((trainer.step, time.perf_counter()))
            return step(batch)

        trainer.train_step = timed_step


def step_times(calls: list[tuple[int, float]], log_every: int, warmup: int) -> tuple[list[float], list[float]]:
    """(seconds of the non-logging steps, of the logging steps) from the (steps done, time) of each call
    of train_step: step k lasts from the call made after k - 1 steps to the one made after k. Steps up
    to `warmup` are left out, and so is a step without the next call (the last)."""
    plain: list[float] = []
    logging: list[float] = []
    for (done, start), (after, end) in zip(calls, calls[1:], strict=False):
        step = done + 1
        if after != step or step <= warmup:
            continue
        (logging if step % log_every == 0 else plain).append(end - start)
    return plain, logging


@contextlib.contextmanager
def tracking_env(folder: Path):
    """MLflow on a SQLite file and W&B offline, both in `folder`; os.environ restored afterwards."""
    env = {
        "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}",
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(folder),
        "WANDB_SILENT": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_once(args: argparse.Namespace, names: tuple[str, ...], run_dir: Path) -> tuple[list[float], list[float]]:
    timer = StepTimer()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        train(args.config, overrides(args, names), run_dir, callbacks=[timer], device=args.device)
    return step_times(timer.calls, args.log_every, args.warmup)


def table(results: dict[tuple[str, ...], tuple[list[float], list[float]]]) -> list[str]:
    """One row per logger set: median ms of its non-logging and logging steps, each with its
    difference from the baseline's (the first set), and the steps timed."""
    base = results[next(iter(results))]
    base_ms = [statistics.median(times) * 1e3 for times in base]
    width = max(len("loggers"), *(len(label(names)) for names in results))
    head = ("non-logging ms", "vs baseline", "logging ms", "vs baseline", "steps timed")
    lines = [f"{'loggers':<{width}}  " + "  ".join(f"{h:>14}" for h in head)]
    for i, (names, (plain, logging)) in enumerate(results.items()):
        cells = []
        for times, baseline in zip((plain, logging), base_ms, strict=True):
            ms = statistics.median(times) * 1e3
            cells += [f"{ms:.2f}", "-" if i == 0 else f"{ms - baseline:+.2f}"]
        cells.append(f"{len(plain)} + {len(logging)}")
        lines.append(f"{label(names):<{width}}  " + "  ".join(f"{c:>14}" for c in cells))
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--rounds", args.rounds, 1)):
        if value < least:
            raise UserError(f"{flag} must be >= {least}, got {value}")
    if not 2 <= args.log_every <= args.steps:
        raise UserError(
            f"--log-every must be from 2 to --steps ({args.steps}), got {args.log_every}: both kinds of step are timed"
        )
    sets = logger_sets(args.loggers)
    for names in sets:  # every refusal (a bad --set, a missing extra) before the first run
        check_extras(load_config(args.config, overrides(args, names)))
    with contextlib.ExitStack() as stack:
        root = args.run_root or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vitmask-bench-loggers-")))
        stack.enter_context(tracking_env(root))
        results: dict[tuple[str, ...], tuple[list[float], list[float]]] = {names: ([], []) for names in sets}
        for r in range(args.rounds):
            for names in sets if r % 2 == 0 else reversed(sets):
                slug = "-".join(names) or "none"
                plain, logging = run_once(args, names, root / f"round{r + 1}-{slug}")
                results[names][0].extend(plain)
                results[names][1].extend(logging)
    print(
        f"{args.config}: {args.steps} timed steps a run (after {args.warmup}), train.log_every {args.log_every}, "
        f"{args.rounds} round(s); medians in ms, the baseline [] logs nowhere"
    )
    print("\n".join(table(results)))
    return 0


def cli(argv=None) -> int:
    try:
        return main(argv)
    except UserError as e:
        print(f"bench_loggers: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
