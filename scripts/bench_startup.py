"""What the CLI costs before it does any work: `--help`, a few verbs' `--help` and `--version`, beside
the interpreter alone and the interpreter importing torch, in the same run.

    python scripts/bench_startup.py
    python scripts/bench_startup.py --runs 20 --verb train --verb eval --verb sample

Each command runs in a fresh interpreter (`python -m vitmask ...`, this checkout's src first on the
path), its output thrown away, `--runs` times; the commands take turns, one run of each per round,
so a change in the machine's load falls on all of them alike. For each it prints the CPU seconds
the child used (user + sys, from the kernel's accounting of waited-for children) and its wall
seconds, as min / median / max, and the load average before and after. CPU seconds are what the
command costs on a shared machine; wall seconds also count the time it waited for a core.
"""

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VERBS = ["train", "eval", "sample", "pack"]


def commands(verbs: list[str]) -> list[tuple[str, list[str]]]:
    """(label, argv) of each command measured: the references first, then the CLI's."""
    py, cli = [sys.executable], [sys.executable, "-m", "vitmask"]
    return [
        ("python -c pass", [*py, "-c", "pass"]),
        ('python -c "import torch"', [*py, "-c", "import torch"]),
        ("vitmask --help", [*cli, "--help"]),
        ("vitmask --version", [*cli, "--version"]),
        *((f"vitmask {verb} --help", [*cli, verb, "--help"]) for verb in verbs),
    ]


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """CPU seconds (user + sys) and wall seconds of one run of `argv`, which must exit 0."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    res = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {res.returncode}: {res.stderr.decode()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each command (default 10)")
    parser.add_argument(
        "--verb", dest="verbs", action="append", help=f"a verb whose --help is measured (default {DEFAULT_VERBS})"
    )
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    env["COLUMNS"] = "100"  # the help's layout, whatever the terminal
    measured = commands(args.verbs or DEFAULT_VERBS)
    cpu: dict[str, list[float]] = {label: [] for label, _ in measured}
    wall: dict[str, list[float]] = {label: [] for label, _ in measured}
    load_before = os.getloadavg()
    for _, command in measured:  # one untimed run each: the page cache warm for every command alike
        run_once(command, env)
    for _ in range(args.runs):
        for label, command in measured:
            c, w = run_once(command, env)
            cpu[label].append(c)
            wall[label].append(w)
    load_after = os.getloadavg()
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, {args.runs} runs each")
    print(f"load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}")
    print(f"load average (1, 5, 15 min) after:  {', '.join(f'{x:.2f}' for x in load_after)}")
    print()
    print("| command | CPU s (user + sys): min / median / max | wall s: min / median / max |")
    print("|---|---:|---:|")
    for label, _ in measured:
        print(f"| `{label}` | {spread(cpu[label])} | {spread(wall[label])} |")


if __name__ == "__main__":
    main()
