"""The built-in `shapes` dataset: procedural binary images, generated with batched tensor ops.

Each image holds 1 to 3 shapes, drawn from rectangles, ellipses, lines and triangles, each filled
or outlined, at random sizes and positions; the shapes are OR-ed together. Every shape of every
image is rasterised at once by broadcasting over a pixel grid, with no per-image Python loop.

An image's label is the kind of its largest shape (0 rectangle, 1 ellipse, 2 line, 3 triangle):
the shape that draws the most pixels of its own (counted before the shapes are OR-ed; ties go to
the shape drawn first). Labels come from the same draws as the images, so asking for them changes
nothing about the images.

Shapes: n images, S shape slots per image, H = W image side.
"""

import math

import torch

from vitmask.sizes import CHUNK_IMAGES, CHUNK_PIXELS, MAX_SHAPES

RECT, ELLIPSE, LINE, TRIANGLE = range(4)
KINDS = ("rectangle", "ellipse", "line", "triangle")  # label i names kind i


def _segment_distance(px, py, ax, ay, bx, by):
    """Distance from pixel centres (1, 1, H, W) to segments with ends (n, S, 1, 1) -> (n, S, H, W)."""
    dx, dy = bx - ax, by - ay
    t = ((px - ax) * dx + (py - ay) * dy) / (dx * dx + dy * dy).clamp_min(1e-6)
    t = t.clamp(0.0, 1.0)
    return torch.hypot(px - (ax + t * dx), py - (ay + t * dy))


def _draw_chunk(n: int, size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, size, size) uint8 images in {0, 1}, and (n,) int64 labels: the kind of the largest shape."""
    S = MAX_SHAPES

    def u(lo, hi):  # (n, S, 1, 1) uniform draws
        return torch.rand(n, S, 1, 1, generator=g) * (hi - lo) + lo

    kind = torch.randint(0, 4, (n, S, 1, 1), generator=g)
    filled = torch.rand(n, S, 1, 1, generator=g) < 0.5
    count = torch.randint(1, S + 1, (n, 1, 1, 1), generator=g)
    active = torch.arange(S).view(1, S, 1, 1) < count  # (n, S, 1, 1)
    cx, cy = u(0, size), u(0, size)
    hw, hh = u(0.1 * size, 0.4 * size), u(0.1 * size, 0.4 * size)
    thick = u(1.0, 2.5)

    coords = torch.arange(size, dtype=torch.float32) + 0.5
    py = coords.view(1, 1, size, 1)
    px = coords.view(1, 1, 1, size)
    dx, dy = (px - cx).abs(), (py - cy).abs()  # (n, S, H, W)

    # rectangles, axis-aligned; the outline is the rectangle minus its inset
    rect = (dx <= hw) & (dy <= hh)
    rect_out = rect & ~((dx <= hw - thick) & (dy <= hh - thick))
    # ellipses with semi-axes hw, hh
    ell = (dx / hw) ** 2 + (dy / hh) ** 2 <= 1.0
    inner = (dx / (hw - thick).clamp_min(1e-3)) ** 2 + (dy / (hh - thick).clamp_min(1e-3)) ** 2 <= 1.0
    ell_out = ell & ~inner
    # lines through the shape's box, at a random angle
    ang = u(0, math.pi)
    ex, ey = hw * torch.cos(ang), hh * torch.sin(ang)
    line = _segment_distance(px, py, cx - ex, cy - ey, cx + ex, cy + ey) <= thick / 2 + 0.25
    # triangles: three vertices at random angles around the centre
    angles = torch.rand(n, S, 3, generator=g) * 2 * math.pi
    radius = 0.5 * (hw + hh).squeeze(-1) * (0.6 + 0.4 * torch.rand(n, S, 3, generator=g))
    vx = (cx.squeeze(-1) + radius * torch.cos(angles)).unsqueeze(-1)  # (n, S, 3, 1)
    vy = (cy.squeeze(-1) + radius * torch.sin(angles)).unsqueeze(-1)
    edge_sign = []
    edge_dist = []
    for i in range(3):
        j = (i + 1) % 3
        ax, ay, bx, by = vx[:, :, i : i + 1], vy[:, :, i : i + 1], vx[:, :, j : j + 1], vy[:, :, j : j + 1]
        edge_sign.append((bx - ax) * (py - ay) - (by - ay) * (px - ax))
        edge_dist.append(_segment_distance(px, py, ax, ay, bx, by))
    e = torch.stack(edge_sign)  # (3, n, S, H, W)
    tri = (e >= 0).all(0) | (e <= 0).all(0)
    tri_out = tri & (torch.stack(edge_dist).amin(0) <= thick)

    solid = torch.stack([rect, ell, line, tri])  # (4, n, S, H, W)
    outline = torch.stack([rect_out, ell_out, line, tri_out])
    pick = torch.where(filled, solid, outline)  # (4, n, S, H, W)
    drawn = pick.gather(0, kind.expand(n, S, size, size).unsqueeze(0)).squeeze(0) & active  # (n, S, H, W)
    return drawn.any(1).to(torch.uint8), largest_kind(drawn, kind.view(n, S))  # (n, H, W), (n,)


def largest_kind(drawn: torch.Tensor, kind: torch.Tensor) -> torch.Tensor:
    """Each image's label: the kind of the slot drawing the most pixels (the first such slot on a tie).

    drawn (n, S, H, W) bool, each slot's own pixels (inactive slots empty); kind (n, S) -> (n,) int64.
    """
    largest = drawn.flatten(2).sum(2).argmax(1, keepdim=True)  # (n, 1): argmax returns the first maximum
    return kind.gather(1, largest).squeeze(1)  # (n,)


def generate_labelled(
    n: int, size: int, generator: torch.Generator, chunk: int = CHUNK_IMAGES
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, size, size) uint8 binary images and their (n,) int64 labels, deterministic for the generator's state."""
    chunk = max(1, min(chunk, CHUNK_PIXELS // (size * size)))
    parts = [_draw_chunk(min(chunk, n - i), size, generator) for i in range(0, n, chunk)]
    if not parts:
        return torch.zeros(0, size, size, dtype=torch.uint8), torch.zeros(0, dtype=torch.long)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def generate(n: int, size: int, generator: torch.Generator, chunk: int = CHUNK_IMAGES) -> torch.Tensor:
    """(n, size, size) uint8 binary images, deterministic for the generator's state."""
    return generate_labelled(n, size, generator, chunk)[0]


def _unseen(images: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """(n,) bool: the rows of `images` that occur neither in `seen` nor earlier in `images`."""
    if len(images) == 0:
        return torch.zeros(0, dtype=torch.bool)
    flat = torch.cat([seen, images]).flatten(1)  # (s + n, H*W)
    _, inverse = torch.unique(flat, dim=0, return_inverse=True)  # (s + n,)
    order = torch.arange(len(flat))
    first = torch.full((int(inverse.max()) + 1,), len(flat)).scatter_reduce(0, inverse, order, "amin")
    keep = first[inverse] == order  # the first occurrence of each distinct image
    return keep[len(seen) :]


def make_labelled_splits(
    num_train: int, num_val: int, num_test: int, size: int, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Fixed train/val/test sets and their labels. Test is drawn first, then val, then train, so a
    split does not change when a later one grows. Repeated images are dropped, within a split and
    across splits (from the later one), so the splits are disjoint; their labels go with them."""
    g = torch.Generator().manual_seed(seed)
    seen = torch.zeros(0, size, size, dtype=torch.uint8)
    images, labels = {}, {}
    for split, n in (("test", num_test), ("val", num_val), ("train", num_train)):
        drawn, kinds = generate_labelled(n, size, g)  # (n, S, S), (n,)
        keep = _unseen(drawn, seen)  # (n,)
        images[split], labels[split] = drawn[keep], kinds[keep]
        seen = torch.cat([seen, images[split]])
    order = ("train", "val", "test")
    return {k: images[k] for k in order}, {k: labels[k] for k in order}


def make_splits(num_train: int, num_val: int, num_test: int, size: int, seed: int) -> dict[str, torch.Tensor]:
    """The images of `make_labelled_splits`."""
    return make_labelled_splits(num_train, num_val, num_test, size, seed)[0]
