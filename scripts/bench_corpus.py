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
  unbroken run: last.pt's weights bit-identical (CPU, train.deterministic);
- checks: what the pack's integrity checks cost (docs/corpora.md): `vitmask pack --verify`'s full
  pass (seconds, GB/s); `open_packed` of the corpus with its splits as contiguous ranges and of the
  same rows with the splits as index files and labels (what `vitmask pack` writes for the npy
  source: every open check reads the index and label files whole); and random batches of 256
  from the train split until every row block has been checked once, gathered with the block
  checks and without, then again with every block already checked (the steady state). The page
  cache is warm for these (the verify pass reads every row first).
`--only checks` runs the checks alone. Run it alone on the machine: every figure is a time.
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
from vitmask.data.pack import BLOCK_BYTES, pack  # noqa: E402
from vitmask.data.packed import (  # noqa: E402
    BLOCKS,
    FORMAT,
    BlockCheck,
    BlockSums,
    open_packed,
    row_bytes,
    seal,
    unpack_rows,
    verify_packed,
)

SIDE = 28
CHUNK = 1 << 20


def synthetic_rows(start: int, count: int) -> np.ndarray:
    """(count, 98) packed rows of sparse strokes (about 20% foreground), the same for the same range."""
    rng = np.random.default_rng(start)
    bits = (rng.random((count, SIDE * SIDE), dtype=np.float32) < 0.2).astype(np.uint8)
    return np.packbits(bits, axis=1)


def write_corpus(root: Path, n: int, classes: int = 345) -> None:
    """A packed directory of n images written directly (no source): splits as contiguous ranges,
    with the checksums `vitmask pack` writes."""
    root.mkdir(parents=True, exist_ok=True)
    r = row_bytes(SIDE, SIDE)
    h, blocks = hashlib.sha256(), BlockSums(max(1, BLOCK_BYTES // r))
    with open(root / "rows.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False, "shape": (n, r)})
        for start in range(0, n, CHUNK):
            rows = synthetic_rows(start, min(CHUNK, n - start))
            h.update(rows)
            blocks.update(rows)
            f.write(rows.tobytes())
    np.save(root / "labels.npy", (np.arange(n, dtype=np.int64) % classes).astype(np.int32))
    np.save(root / BLOCKS, blocks.finish())
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
        "block_rows": blocks.block_rows,
    }
    header = seal(header, root)
    (root / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True) + "\n")


def indexed_twin(corpus: Path, root: Path) -> Path:
    """The corpus's rows (a symbolic link) and labels with the splits stored as index files, a seeded
    permutation cut 98/1/1, as `vitmask pack` stores the npy source: the open checks' worst case."""
    root.mkdir(parents=True, exist_ok=True)
    header = json.loads((corpus / "header.json").read_text())
    for name in ("rows.npy", "labels.npy", BLOCKS):
        if not (root / name).exists():
            (root / name).symlink_to((corpus / name).resolve())
    n = header["count"]
    order = np.random.default_rng(0).permutation(n).astype(np.int32 if n < 2**31 else np.int64)
    val = test = max(1, n // 100)
    cuts = {"test": order[:test], "val": order[test : test + val], "train": order[test + val :]}
    for name, idx in cuts.items():
        np.save(root / f"{name}.npy", idx)
    splits = {name: {"count": len(idx), "index": f"{name}.npy"} for name, idx in cuts.items()}
    body = {k: v for k, v in header.items() if k not in ("files", "header_checksum")}
    sealed = seal({**body, "splits": splits}, root)
    (root / "header.json").write_text(json.dumps(sealed, indent=1, sort_keys=True) + "\n")
    return root


def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of fn()."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def check_costs(corpus: Path, work: Path, max_batches: int, batch: int = 256) -> dict:
    """What the integrity checks cost: the full verify, open_packed, and the block checks of a first pass."""
    t = time.perf_counter()
    verify_packed(corpus, progress=False)
    verify_s = time.perf_counter() - t
    size = (corpus / "rows.npy").stat().st_size
    twin = indexed_twin(corpus, work / "indexed.packed")
    opens = {
        "ranges": timed(lambda: open_packed(corpus), 3),
        "index_files": timed(lambda: open_packed(twin), 3),
    }
    ds = open_packed(corpus)
    checked, plain = ds.split("train"), ds.split("train")
    plain.check = None  # the same split, its rows gathered unchecked
    checked.check = fresh = BlockCheck(ds.rows, ds.check.block_rows, ds.check.sums, ds.check.path)
    order = EpochOrder(len(checked), seed=1)
    start, count = ds.splits["train"]  # the corpus's splits are ranges
    train_blocks = np.arange(start // fresh.block_rows, (start + count - 1) // fresh.block_rows + 1)
    seen, steps = np.zeros(len(fresh), dtype=bool), 0  # the batches of a first pass over every train block
    while steps < max_batches and not seen[train_blocks].all():
        seen[(order.indices(steps * batch, batch).numpy() + start) // fresh.block_rows] = True
        steps += 1
    rates = {}
    for name, images in (
        ("unchecked", plain),
        ("first_pass_checked", checked),
        ("all_checked", checked),
        ("unchecked_again", plain),
    ):
        t = time.perf_counter()
        for s in range(steps):
            images[order.indices(s * batch, batch)]
        rates[name] = round(steps * batch / (time.perf_counter() - t))
    return {
        "verify_s": round(verify_s, 2),
        "verify_gb_per_s": round(size / verify_s / 1e9, 2),
        "open_s": {k: [round(x, 3) for x in v] for k, v in opens.items()},
        "blocks": len(fresh),
        "block_rows": fresh.block_rows,
        "first_pass_batches": steps,
        "blocks_checked_in_first_pass": int(fresh.verified.sum()),
        "batch_images_per_s": rates,
    }


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


def add_checksums(root: Path) -> None:
    """Give a corpus written without checksums (by an earlier version of this script) the block sums
    and sealed header `vitmask pack` writes: one pass over its rows."""
    header = json.loads((root / "header.json").read_text())
    if "header_checksum" in header:
        return
    rows = np.load(root / "rows.npy", mmap_mode="r")
    blocks = BlockSums(max(1, BLOCK_BYTES // rows.shape[1]))
    for start in range(0, len(rows), CHUNK):
        blocks.update(rows[start : start + CHUNK])
    np.save(root / BLOCKS, blocks.finish())
    header = seal({**header, "block_rows": blocks.block_rows}, root)
    (root / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="images in the synthetic corpus")
    ap.add_argument("--dir", type=Path, required=True, help="work folder (the corpus is written here)")
    ap.add_argument("--batches", type=int, default=400, help="batches of 256 timed")
    ap.add_argument("--pack-n", type=int, default=2_000_000, help="images packed from npy files")
    ap.add_argument("--steps", type=int, default=40, help="training steps of the RssAnon and resume runs")
    ap.add_argument("--check-batches", type=int, default=5000, help="at most this many batches in the first pass")
    ap.add_argument("--only", choices=("all", "checks"), default="all", help="checks: the integrity checks' cost alone")
    args = ap.parse_args()
    corpus = args.dir / "corpus.packed"
    if not (corpus / "header.json").exists():
        t = time.perf_counter()
        write_corpus(corpus, args.n)
        print(f"wrote {corpus} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    add_checksums(corpus)
    report = {"n": json.loads((corpus / "header.json").read_text())["count"]}
    if args.only == "all":
        report["batch_images_per_s"] = batch_throughput(corpus, args.batches)
        report["pack_images_per_s"] = pack_throughput(args.dir, min(args.n, args.pack_n))
        report["train"] = train_and_resume(args.dir, corpus, args.steps)
    report["checks"] = check_costs(corpus, args.dir, args.check_batches)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
