"""The cost of the checkpoint checksum: a save with it against the same save without, interleaved.

    python scripts/bench_checksum.py --config configs/default.yaml --repeats 30
    python scripts/bench_checksum.py --config configs/mnist.yaml --set model.hidden_dim=512

Builds the model and Adam state a run of the config checkpoints (one optimizer step, so the
moments exist), then times, alternately in one process, `save_checkpoint` as it is (its finite
check, torch.save, the SHA-256 of the file's headers read back, the zip comment; temp file,
fsync, rename) and `save_checkpoint` with the checksum step replaced by plain torch.save; and
`load_checkpoint` with and without `verify_checksum`. Prints the medians and their ratios. Run it
alone on the machine: the ratio is what counts.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vitmask.config import load_config  # noqa: E402
from vitmask.model.vit import build_model  # noqa: E402
from vitmask.store import checkpoint  # noqa: E402
from vitmask.store.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402


def state_of(cfg) -> dict:
    """What a checkpoint of this config holds, in size: the weights and Adam's two moments."""
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1, "config": cfg.to_dict()}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    state = state_of(load_config(args.config, args.overrides))
    signed_save = checkpoint._save_with_checksum
    real_verify = checkpoint.verify_checksum
    with tempfile.TemporaryDirectory() as folder:
        plain, signed = Path(folder) / "plain.pt", Path(folder) / "signed.pt"

        def save_plain():  # save_checkpoint with the checksum step left out: the save before it
            checkpoint._save_with_checksum = lambda obj, f: torch.save(obj, f)
            try:
                save_checkpoint(state, plain)
            finally:
                checkpoint._save_with_checksum = signed_save

        def save_signed():
            save_checkpoint(state, signed)

        def load_plain():  # load_checkpoint with the check left out (the file read once, as now)
            checkpoint.verify_checksum = lambda data: True
            try:
                load_checkpoint(signed)
            finally:
                checkpoint.verify_checksum = real_verify

        def load_signed():
            load_checkpoint(signed)

        save_plain(), save_signed()  # warm-up
        times = {name: [] for name in ("save", "save+checksum", "load", "load+check")}
        for _ in range(args.repeats):
            times["save"].append(timed(save_plain))
            times["save+checksum"].append(timed(save_signed))
            times["load"].append(timed(load_plain))
            times["load+check"].append(timed(load_signed))
        size = signed.stat().st_size
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"checkpoint {size / 2**20:.1f} MiB, {args.repeats} interleaved repeats, medians:")
    for k, v in med.items():
        print(f"  {k:<14} {v * 1e3:8.2f} ms")
    print(f"save with checksum / without: {med['save+checksum'] / med['save']:.3f}")
    print(f"load with check / torch.load: {med['load+check'] / med['load']:.3f}")


if __name__ == "__main__":
    main()
