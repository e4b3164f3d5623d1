"""Benchmark packed corpora: batch throughput, pack throughput, a training run's peak RssAnon, and
exact resume, on a synthetic corpus of N 28x28 images written directly in the packed format.

    python scripts/bench_corpus.py --n 100000 --dir /tmp/corpus          # a smoke test
    python scripts/bench_corpus.py --n 50000000 --dir /data/corpus50m    # the 50M figures (about 5 GB)

Figures (one JSON object on stdout):
- batches: random batches of 256 from the packed train split on disk (the sampler's epoch order,
  gathered from the memory map and unpacked), images/s; beside it the same from an in-memory uint8
  tensor of min(N, 1M) images (what the in-memory sources do);
- pack: `vitmask pack` of min(N, --pack-n) images in 10 Quick, Draw!-layout .npy files, images/s;
- train: peak RssAnon (anonymous memory, not the page cache) of a `vitmask train` child on the
  corpus, read from /proc/PID/status every 50 ms, and its steps/s;
- resume: that run killed (SIGKILL) after its checkpoint at half the steps and resumed, against an
  unbroken run: last.pt's weights bit-identical (CPU, train.deterministic).
Run it alone on the machine: every figure is a time.
"""

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vitmask.config import config_from_dict  # noqa: E402
from vitmask.data.batches import EpochOrder  # noqa: E402
from vitmask.data.pack import pack  # noqa: E402
from vitmask.data.packed import FORMAT, open_packed, row_bytes, unpack_rows  # noqa: E402

SIDE = 28
CHUNK = 1 << 20


def synthetic_rows(start: int, count: int) -> np.ndarray:
    """(count, 98) packed rows of sparse strokes (about 20% foreground), the same for the same range."""
    rng = np.random.default_rng(start)
    bits = (rng.random((count, SIDE * SIDE), dtype=np.float32) < 0.2).astype(np.uint8)
    return np.packbits(bits, axis=1)


def write_corpus(root: Path, n: int, classes: int = 345) -> None:
    """A packed directory of n images written directly (no source): splits as contiguous ranges."""
    root.mkdir(parents=True, exist_ok=True)
    r = row_bytes(SIDE, SIDE)
    h = hashlib.sha256()
    with open(root / "rows.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False, "shape": (n, r)})
        for start in range(0, n, CHUNK):
            data = synthetic_rows(start, min(CHUNK, n - start)).tobytes()
            h.update(data)
            f.write(data)
    np.save(root / "labels.npy", (np.arange(n, dtype=np.int64) % classes).astype(np.int32))
    val = test = max(1, n // 100)
    header = {
        "format": FORMAT,
        "count": n,
        "height": SIDE,
        "width": SIDE,
        "row_bytes": r,
        "threshold": 0.5,
        "invert": False,
        "fit": "none",
        "classes": [f"class{i}" for i in range(classes)],
        "splits": {
            "train": {"count": n - val - test, "start": 0},
            "val": {"count": val, "start": n - val - test},
            "test": {"count": test, "start": n - test},
        },
        "source": "synthetic (scripts/bench_corpus.py)",
        "checksum": f"sha256:{h.hexdigest()}",
    }
    (root / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True) + "\n")


def batch_throughput(root: Path, batches: int, batch: int = 256) -> dict:
    train = open_packed(root).split("train")
    order = EpochOrder(len(train), seed=1)
    memory = torch.from_numpy(np.unpackbits(np.asarray(train.rows[: min(len(train), 1 << 20)]), axis=1))
    memory = memory[:, : SIDE * SIDE].reshape(-1, SIDE, SIDE).contiguous()  # (m, 28, 28) uint8
    mem_order = EpochOrder(len(memory), seed=1)
    out = {}
    for name, fetch in (
        ("packed_on_disk", lambda s: train[order.indices(s * batch, batch)]),
        ("in_memory_uint8", lambda s: memory[mem_order.indices(s * batch, batch)]),
    ):
        fetch(0)
        t = time.perf_counter()
        total = 0
        for s in range(1, batches + 1):
            total += int(fetch(s).shape[0])
        out[name] = total / (time.perf_counter() - t)
    rows = torch.from_numpy(np.array(train.rows[:batch]))  # a copy: writable
    t = time.perf_counter()
    for _ in range(batches):
        unpack_rows(rows, SIDE, SIDE)
    out["unpack_only"] = batches * batch / (time.perf_counter() - t)
    return {k: round(v) for k, v in out.items()}


def pack_throughput(work: Path, n: int) -> float:
    src = work / "npy"
    src.mkdir(parents=True, exist_ok=True)
    per = n // 10
    for i in range(10):
        gray = np.unpackbits(synthetic_rows(i * per, per), axis=1)[:, : SIDE * SIDE] * np.uint8(255)
        np.save(src / f"class{i:02d}.npy", gray)  # (per, 784) uint8 0/255, the Quick, Draw! layout
    cfg = config_from_dict({"data": {"source": "npy", "path": str(src), "image_size": SIDE, "fit": "none"}})
    t = time.perf_counter()
    pack(cfg, work / "npy.packed", progress=False)
    return round(10 * per / (time.perf_counter() - t))


def rss_anon(pid: int) -> int:
    """The process's anonymous resident memory in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def train_config(work: Path, corpus: Path, steps: int) -> Path:
    import yaml

    cfg = {
        "seed": 0,
        "data": {"source": "packed", "path": str(corpus), "image_size": SIDE, "batch_size": 256},
        "model": {"hidden_dim": 64, "num_heads": 4, "depth": 2, "ffn_dim": 128},
        "train": {
            "max_steps": steps,
            "eval_every": steps,
            "eval_images": 1024,
            "checkpoint_every": steps // 2,
            "log_every": 10,
            "deterministic": True,
        },
    }
    path = work / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_train(args: list[str], kill_at: Path | None = None) -> tuple[int, float]:
    """Run `vitmask train ARGS` as a child; return its peak RssAnon and wall time (SIGKILL once
    `kill_at` exists, when given)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "vitmask", "train", *args], env=env, stdout=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, rss_anon(proc.pid))
        if kill_at is not None and kill_at.exists():
            proc.send_signal(signal.SIGKILL)
        time.sleep(0.05)
    return peak, time.perf_counter() - t


def train_and_resume(work: Path, corpus: Path, steps: int) -> dict:
    cfg = train_config(work, corpus, steps)
    unbroken, killed = work / "run_unbroken", work / "run_killed"
    peak, wall = run_train(["--config", str(cfg), "--run-dir", str(unbroken), "--device", "cpu"])
    half = killed / f"step_{steps // 2:07d}.pt"
    run_train(["--config", str(cfg), "--run-dir", str(killed), "--device", "cpu"], kill_at=half)
    run_train(["--run-dir", str(killed), "--resume", "auto", "--device", "cpu"])
    a = torch.load(unbroken / "last.pt", weights_only=True)["model"]
    b = torch.load(killed / "last.pt", weights_only=True)["model"]
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return {"peak_rss_anon_mib": round(peak / 2**20), "steps": steps, "wall_s": round(wall, 1), "resume_exact": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="images in the synthetic corpus")
    ap.add_argument("--dir", type=Path, required=True, help="work folder (the corpus is written here)")
    ap.add_argument("--batches", type=int, default=400, help="batches of 256 timed")
    ap.add_argument("--pack-n", type=int, default=2_000_000, help="images packed from npy files")
    ap.add_argument("--steps", type=int, default=40, help="training steps of the RssAnon and resume runs")
    args = ap.parse_args()
    corpus = args.dir / "corpus.packed"
    if not (corpus / "header.json").exists():
        t = time.perf_counter()
        write_corpus(corpus, args.n)
        print(f"wrote {corpus} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    report = {
        "n": args.n,
        "batch_images_per_s": batch_throughput(corpus, args.batches),
        "pack_images_per_s": pack_throughput(args.dir, min(args.n, args.pack_n)),
        "train": train_and_resume(args.dir, corpus, args.steps),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
