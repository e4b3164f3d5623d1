"""Quality against wall time: a recipe trained at several wall-clock budgets, each a fresh run alone.

For each budget B (seconds of the whole `vitmask train` command, compile and validations included),
the run gets `train.max_steps` = the steps that fit in B at the step time measured here first, so its
learning-rate schedule ends where its time does. Each run is a fresh process with an empty
torch.compile cache (a user's first run), and is then scored on its test split:

    vitmask train --config CONFIG --set ... --set train.max_steps=N --run-dir OUT/runs/B
    vitmask eval --checkpoint OUT/runs/B/last.pt --split test --mask-ratio 0.5 --centre-box --nll \
        --nll-orders 1 --nll-exact-images 100 --json

The calibration trains CALIBRATION_STEPS steps (after compiling) in a process of its own and times
them; a run's steps are (B - its fixed cost) / the step time, where the fixed cost (start-up, data,
compile, validations, checkpoints) is measured by the first budget's run and used for the rest.
Writes OUT/curve.csv (one row per budget: seconds asked and taken, steps, the NLL bound, the exact
raster NLL on the first 100 test images and the bound on those images, r=0.5 and centre-box
non-empty accuracy) and OUT/curve.png (NLL against wall seconds), and prints the rows.

    python scripts/time_curve.py --config configs/mnist.yaml --data DIR --budgets 150,300,450,600 --out runs/curve
    python scripts/time_curve.py ... --set train.step_shapes=masked --out runs/curve-masked   # another recipe

DIR holds MNIST's test-set idx files (`--set data.source=idx --set data.path=DIR` is added). Run it
alone: anything else on the machine slows the runs and shortens what each budget buys.
"""

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION_STEPS = 200
FIELDS = ("budget_s", "wall_s", "steps", "nll_bound", "nll_bound_first100", "nll_exact_raster_first100",
          "acc_nonempty_r05", "acc_nonempty_centre_box")  # fmt: skip


def vitmask(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vitmask", *args], env=env, capture_output=True, text=True)


def fresh_cache_env(folder: Path) -> dict:
    """The environment of a run: this checkout's vitmask, and an empty torch.compile cache of its own."""
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TORCHINDUCTOR_CACHE_DIR": str(folder)}


def step_seconds(config: str, sets: list[str]) -> float:
    """Seconds a training step takes, timed over CALIBRATION_STEPS steps after the compile, in a process of its own."""
    code = f"""
import sys, time, torch
sys.path.insert(0, {str(ROOT / "src")!r})
from vitmask.config import load_config
from vitmask.data.batches import load_splits
from vitmask.train.trainer import Trainer
cfg = load_config({config!r}, {sets!r})
trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
for _ in range(30):
    trainer.train_step(trainer.sampler.sample())
began = time.perf_counter()
for _ in range({CALIBRATION_STEPS}):
    trainer.train_step(trainer.sampler.sample())
print((time.perf_counter() - began) / {CALIBRATION_STEPS})
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"time_curve: the calibration failed:\n{res.stderr[-2000:]}")
    return float(res.stdout.strip().splitlines()[-1])


def run(config: str, sets: list[str], steps: int, run_dir: Path) -> tuple[float, dict]:
    """Train `steps` steps in a fresh process with an empty compile cache, then score it: (wall seconds, eval JSON)."""
    with tempfile.TemporaryDirectory() as cache:
        env = fresh_cache_env(Path(cache))
        args = ["train", "--config", config, *(x for s in sets for x in ("--set", s)),
                "--set", f"train.max_steps={steps}", "--run-dir", str(run_dir)]  # fmt: skip
        began = time.perf_counter()
        res = vitmask(*args, env=env)
        wall = time.perf_counter() - began
    if res.returncode != 0:
        raise SystemExit(f"time_curve: vitmask {' '.join(args)} failed:\n{res.stderr[-2000:]}")
    scored = vitmask("eval", "--checkpoint", str(run_dir / "last.pt"), "--split", "test", "--mask-ratio", "0.5",
                     "--centre-box", "--nll", "--nll-orders", "1", "--nll-exact-images", "100", "--json",
                     env=fresh_cache_env(run_dir))  # fmt: skip
    if scored.returncode != 0:
        raise SystemExit(f"time_curve: scoring {run_dir} failed:\n{scored.stderr[-2000:]}")
    return wall, json.loads(scored.stdout)


def row_of(budget: float, wall: float, steps: int, report: dict) -> dict:
    nll, exact = report["nll"], report["nll"]["exact"]
    half = next(r for r in report["results"] if r["strategy"] != "centre")
    box = next(r for r in report["results"] if r["strategy"] == "centre")
    return {
        "budget_s": budget,
        "wall_s": round(wall, 1),
        "steps": steps,
        "nll_bound": round(nll["nats"], 2),
        "nll_bound_first100": round(exact["bound_same_images"], 2),
        "nll_exact_raster_first100": round(exact["fixed"]["nats"], 2),
        "acc_nonempty_r05": round(half["acc_nonempty"], 4),
        "acc_nonempty_centre_box": round(box["acc_nonempty"], 4),
    }


def read_curve(file: Path) -> list[dict]:
    """A curve.csv this script wrote, its numbers as numbers."""
    with open(file, newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def plot(curves: dict[str, list[dict]], out: Path) -> None:
    """NLL (bound: solid; exact raster on 100 images: dashed) against wall seconds, one colour per curve (PIL)."""
    from PIL import Image, ImageDraw

    w, h, pad = 720, 440, 60
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    rows = [r for rs in curves.values() for r in rs]
    xmax = max(r["wall_s"] for r in rows) * 1.05
    ys = [r[k] for r in rows for k in ("nll_bound", "nll_exact_raster_first100")]
    ylo, yhi = math.floor(min(ys)) - 1, math.ceil(max(ys)) + 1

    def xy(x: float, y: float) -> tuple[float, float]:
        return pad + (w - 2 * pad) * x / xmax, h - pad - (h - 2 * pad) * (y - ylo) / (yhi - ylo)

    d.line([xy(0, ylo), xy(xmax, ylo)], fill="black")
    d.line([xy(0, ylo), xy(0, yhi)], fill="black")
    for t in range(0, int(xmax) + 1, 100):
        d.text((xy(t, ylo)[0] - 8, h - pad + 6), str(t), fill="black")
    for v in range(int(ylo), int(yhi) + 1, 2):
        d.text((8, xy(0, v)[1] - 6), str(v), fill="black")
    d.text((w // 2 - 60, h - 24), "wall seconds (whole train command)", fill="black")
    d.text(
        (pad, 12),
        "NLL, nats per image: bound (solid), exact raster order, first 100 test images (dashed)",
        fill="black",
    )
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for i, (name, rs) in enumerate(curves.items()):
        c = colours[i % len(colours)]
        for key, dashed in (("nll_bound", False), ("nll_exact_raster_first100", True)):
            pts = [xy(r["wall_s"], r[key]) for r in rs]
            for a, b in zip(pts, pts[1:], strict=False):
                if dashed:  # dashes of 6 pixels
                    n = max(1, int(math.dist(a, b) / 12))
                    for k in range(n):
                        p0 = (a[0] + (b[0] - a[0]) * k / n, a[1] + (b[1] - a[1]) * k / n)
                        p1 = (a[0] + (b[0] - a[0]) * (k + 0.5) / n, a[1] + (b[1] - a[1]) * (k + 0.5) / n)
                        d.line([p0, p1], fill=c, width=2)
                else:
                    d.line([a, b], fill=c, width=2)
            for p in pts:
                d.ellipse([p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3], fill=c)
        d.text((w - pad - 200, pad + 16 * i), name, fill=c)
    img.save(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/mnist.yaml")
    ap.add_argument("--data", required=True, help="a folder with MNIST's test-set idx files (plain or .gz)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--budgets", default="150,300,450,600", help="wall seconds of each run, comma-separated")
    ap.add_argument("--out", type=Path, required=True, help="a new folder: runs/, curve.csv, curve.png")
    ap.add_argument("--name", default="", help="the curve's name in the plot (default: the --sets)")
    ap.add_argument("--beside", action="append", default=[], metavar="NAME=CSV",
                    help="also draw another run's curve.csv in the plot, named NAME (repeatable)")  # fmt: skip
    a = ap.parse_args(argv)
    budgets = sorted(float(b) for b in a.budgets.split(","))
    if a.out.exists():
        raise SystemExit(f"time_curve: --out {a.out} exists; pass a new folder")
    for spec in a.beside:
        if "=" not in spec or not Path(spec.partition("=")[2]).is_file():
            raise SystemExit(f"time_curve: --beside takes NAME=CSV, a curve.csv of this script; got {spec!r}")
    sets = ["data.source=idx", f"data.path={a.data}", *a.set]
    seconds = step_seconds(a.config, sets)
    print(f"calibration: {seconds * 1000:.1f} ms a step", flush=True)
    a.out.mkdir(parents=True)
    rows, fixed = [], None
    for budget in budgets:
        # the first run's fixed cost is guessed at 60 s, then measured
        steps = max(1, int((budget - (60.0 if fixed is None else fixed)) / seconds))
        wall, report = run(a.config, sets, steps, a.out / "runs" / f"{int(budget)}")
        fixed = wall - steps * seconds if fixed is None else fixed
        rows.append(row_of(budget, wall, steps, report))
        print(json.dumps(rows[-1]), flush=True)
    with open(a.out / "curve.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    curves = {a.name or " ".join(a.set) or a.config: rows}
    for spec in a.beside:
        name, _, file = spec.partition("=")
        curves[name] = read_curve(Path(file))
    plot(curves, a.out / "curve.png")
    print(f"wrote {a.out / 'curve.csv'} and {a.out / 'curve.png'}")


if __name__ == "__main__":
    main()
