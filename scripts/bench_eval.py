"""Eval speed per image against a training step's forward pass, on the same model and device.

    python scripts/bench_eval.py [--config configs/default.yaml] [--images 1024] [--device cpu]

Prints ms per image for: the forward pass of a training step (train mode, autograd on, loss
included), `evaluate` alone, and `evaluate` with the three baselines scored beside it (the table
fit is timed separately: it runs once per ratio, not per image). The model is untrained: speed
does not depend on the weights.
"""

import argparse
import time
from pathlib import Path

from vitmask.config import load_config
from vitmask.data.batches import BatchSampler
from vitmask.data.shapes import make_splits
from vitmask.evaluate.baselines import fit_baselines
from vitmask.evaluate.scores import evaluate
from vitmask.model.vit import build_model
from vitmask.runtime.process import resolve_device
from vitmask.train.trainer import masked_loss


def timed(fn, repeats: int) -> float:
    """Seconds per call, after one warm-up call."""
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("configs/default.yaml"))
    ap.add_argument("--images", type=int, default=1024, help="images in the eval split")
    ap.add_argument("--train-images", type=int, default=4096, help="images the baselines are fitted on")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()
    cfg = load_config(a.config)
    device = resolve_device(a.device)
    d = cfg.data
    splits = make_splits(a.train_images, 1, a.images, d.image_size, cfg.seed)
    train, images = splits["train"].to(device), splits["test"].to(device)
    model = build_model(cfg).to(device)
    sampler = BatchSampler(train, cfg)
    batch = sampler.sample()

    def train_forward():
        model.train()
        logits = model(batch.patches, batch.mask, batch.ids)  # (B, M, C)
        masked_loss(logits, batch.masked_targets)

    per_step = timed(train_forward, a.repeats)
    print(f"device {device}  config {a.config}  batch {d.batch_size}  eval images {len(images)}")
    print(f"training-step forward   {1e3 * per_step / d.batch_size:8.3f} ms/image")
    t0 = time.perf_counter()
    base = fit_baselines(train, cfg, cfg.mask.ratio, 0)
    fit_s = time.perf_counter() - t0
    r = cfg.mask.ratio
    alone = timed(lambda: evaluate(model, images, cfg, r, 0, base.majority), max(1, a.repeats // 2))
    print(f"eval                    {1e3 * alone / len(images):8.3f} ms/image")
    both = timed(lambda: evaluate(model, images, cfg, r, 0, base.majority, baselines=base), max(1, a.repeats // 2))
    print(f"eval with baselines     {1e3 * both / len(images):8.3f} ms/image")
    print(f"baseline fit            {fit_s:8.3f} s once per ratio ({len(train)} train images)")


if __name__ == "__main__":
    main()
