"""Sizes that data and model both compute from a config: how many patches an image hides, and the
limits of the built-in shapes generator.

A leaf (the standard library only), so that `data/` (which draws masks and images) and `model/`
(which counts FLOPs and memory) each import it and neither imports the other.

- `num_masked`: the patches hidden per image at a mask ratio; masks hide that many
  (data/masking.py, data/batches.py), the FLOP count and the memory estimate count them
  (model/flops.py, model/memory_estimate.py).
- `MAX_SHAPES`, `CHUNK_IMAGES`, `CHUNK_PIXELS`: the shapes an image of the `shapes` source holds at
  most, and how many images one generation chunk draws at once; data/shapes.py draws so,
  model/memory_estimate.py counts a chunk's temporaries.
"""

MAX_SHAPES = 3  # shapes per generated image, at most
CHUNK_IMAGES = 2048  # images a generation chunk draws at once, up to 64 x 64 pixels; fewer above
# pixels drawn per chunk: CHUNK_IMAGES images up to 64 x 64, fewer above, so the (n, S, H, W) float
# temporaries of a chunk stay near 2 GiB whatever the image size (model/memory_estimate.py counts them)
CHUNK_PIXELS = CHUNK_IMAGES * 64 * 64


def num_masked(num_patches: int, ratio: float) -> int:
    """Patches hidden per image: round(ratio * N) (Python's round), at least 1 and at most N - 1."""
    return min(max(round(ratio * num_patches), 1), num_patches - 1)
