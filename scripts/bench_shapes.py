"""Time the shapes dataset's generation: configs/default.yaml's splits (20,000 + 1,000 + 2,000 images of
32x32, seed 0) drawn by the module's rasteriser (each kind only for the slots that hold it) against the
all-kinds rasteriser of tests/test_shapes_drawing.py, which draws the same images bit for bit (the run
checks that too). Every training, pack and eval of a shapes config draws its splits first.

    python scripts/bench_shapes.py --repeats 5

Prints the median seconds of each and their ratio. Run it alone on the machine.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import torch  # noqa: E402
from tests.test_shapes_drawing import reference_draw_chunk  # noqa: E402

from vitmask.data import shapes  # noqa: E402


def seconds(draw, repeats: int) -> tuple[float, dict]:
    """The median seconds of make_labelled_splits with `draw` as the chunk rasteriser, and its splits."""
    real, times, splits = shapes._draw_chunk, [], {}
    shapes._draw_chunk = draw
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            splits = shapes.make_labelled_splits(20000, 1000, 2000, 32, 0)
            times.append(time.perf_counter() - start)
    finally:
        shapes._draw_chunk = real
    return statistics.median(times), splits


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    ours, ours_splits = seconds(shapes._draw_chunk, a.repeats)
    reference, reference_splits = seconds(reference_draw_chunk, a.repeats)
    for part in (0, 1):
        for split in ("train", "val", "test"):
            assert torch.equal(ours_splits[part][split], reference_splits[part][split]), split
    print(f"shapes splits of configs/default.yaml, {torch.get_num_threads()} threads, median of {a.repeats}:")
    print(f"  each kind for its slots  {ours:.2f} s")
    print(f"  every kind for every slot {reference:.2f} s  ({reference / ours:.2f}x the time; the same images)")


if __name__ == "__main__":
    main()
