"""What one validation costs during training on a packed corpus of N images: the default
`train.eval_images` against the whole val split, beside the training step, and the share of a run
each takes at the config's `train.eval_every`.

    python scripts/bench_validation.py --n 20000 --dir /tmp/corpus-small                 # a smoke test
    python scripts/bench_validation.py --n 4000000 --dir /data/corpus4m                  # the 4M figures
    python scripts/bench_validation.py --n 4000000 --dir /data/corpus4m --whole          # and the whole split

The corpus is scripts/bench_corpus.py's synthetic one (28x28 images written straight into the
packed format; its val split is 1% of N: 40,000 images of 4M), written once into --dir and reused.
The model, mask and training keys come from --config (default configs/default.yaml), the data from
the corpus (`data.source: packed`, 28x28).

Figures (one JSON object on stdout):
- setup_s: building the Trainer (the Validator picks its images and counts the train classes);
- step_ms: the median training step (sampler and step) over --steps steps, after two warm-up steps;
- validation: for the default eval_images (and with --whole, for eval_images 0): the images scored,
  the seconds of `Trainer.evaluate` plus the reconstruction grid (the first call warms up, the
  second is timed), and share_of_run = validation / (eval_every steps + validation).
Run it alone on the machine: every figure is a time. --whole scores every val image, which on a CPU
takes minutes for 40,000 images.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_corpus import SIDE, write_corpus  # noqa: E402
from vitmask.config import load_config  # noqa: E402
from vitmask.data.batches import load_splits  # noqa: E402
from vitmask.runtime.process import resolve_device  # noqa: E402
from vitmask.train.trainer import Trainer  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_validation(trainer: Trainer) -> float:
    """Seconds of one validation's work: the metrics on the validation images and the grid."""
    trainer.evaluate()
    trainer.validator.reconstruction(trainer.model)
    sync(trainer.device)
    return time.perf_counter()


def measure(cfg_path: Path, corpus: Path, device: torch.device, steps: int, sets: list[str], whole: bool) -> dict:
    data = ["data.source=packed", f"data.path={corpus}", f"data.image_size={SIDE}", "data.fit=none"]
    report: dict = {}
    for label, limit in [("default", None), *([("whole_split", 0)] if whole else [])]:
        extra = [] if limit is None else [f"train.eval_images={limit}"]
        cfg = load_config(cfg_path, [*data, *sets, *extra])
        splits = load_splits(cfg)
        t = time.perf_counter()
        trainer = Trainer(cfg, splits, device)
        setup = time.perf_counter() - t
        if "step_ms" not in report:
            report["setup_s"] = round(setup, 2)
            times = []
            for i in range(steps + 2):
                t = time.perf_counter()
                trainer.train_step(trainer.sampler.sample())
                sync(device)
                if i >= 2:
                    times.append(time.perf_counter() - t)
            report["step_ms"] = round(1000 * statistics.median(times), 2)
            report["eval_every"] = cfg.train.eval_every
            report["val_split_images"] = len(splits["val"])
        time_validation(trainer)  # warm-up
        t = time.perf_counter()
        seconds = time_validation(trainer) - t
        between = cfg.train.eval_every * report["step_ms"] / 1000
        report[label] = {
            "eval_images": cfg.train.eval_images,
            "images_scored": len(trainer.validator.images),
            "seconds": round(seconds, 3),
            "share_of_run": round(seconds / (between + seconds), 4),
        }
        trainer.close()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4_000_000, help="images in the synthetic corpus")
    ap.add_argument("--dir", type=Path, required=True, help="work folder (the corpus is written here once)")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--steps", type=int, default=20, help="training steps timed")
    ap.add_argument("--whole", action="store_true", help="also time a validation of the whole val split")
    args = ap.parse_args()
    corpus = args.dir / f"corpus{args.n}.packed"
    if not (corpus / "header.json").exists():
        t = time.perf_counter()
        write_corpus(corpus, args.n)
        print(f"wrote {corpus} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    device = resolve_device(args.device)
    report = {"n": args.n, "config": str(args.config), "device": str(device)}
    report.update(measure(args.config, corpus, device, args.steps, args.set, args.whole))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
