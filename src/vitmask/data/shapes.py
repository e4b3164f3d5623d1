"""The built-in `shapes` dataset: procedural binary images, generated with batched tensor ops.

Each image holds 1 to 3 shapes, drawn from rectangles, ellipses, lines and triangles, each filled
or outlined, at random sizes and positions; the shapes are OR-ed together. The shapes of one kind,
across all images of a chunk, are rasterised at once by broadcasting over a pixel grid, each kind
only for the slots that hold it, with no per-image Python loop.

An image's label is the kind of its largest shape (0 rectangle, 1 ellipse, 2 line, 3 triangle):
the shape that draws the most pixels of its own (counted before the shapes are OR-ed; ties go to
the shape drawn first). Labels come from the same draws as the images, so asking for them changes
nothing about the images.

Shapes: n images, S shape slots per image, m drawn slots of one kind, H = W image side.
"""

import functools
import math

import torch

from vitmask.sizes import CHUNK_IMAGES, CHUNK_PIXELS, MAX_SHAPES

RECT, ELLIPSE, LINE, TRIANGLE = range(4)
KINDS = ("rectangle", "ellipse", "line", "triangle")  # label i names kind i


def _segment_distance(px, py, ax, ay, bx, by, hypot=torch.hypot):
    """Distance from pixel centres (1, H, W) to m segments with ends (m, 1, 1) -> (m, H, W).

    `hypot` takes the (m, H, W) offsets from the pixels to their nearest points on the segments;
    `_draw_chunk` passes `_hypot_in_slots`, which runs it where the pixels' bits cannot move."""
    dx, dy = bx - ax, by - ay
    t = ((px - ax) * dx + (py - ay) * dy) / (dx * dx + dy * dy).clamp_min(1e-6)
    t = t.clamp(0.0, 1.0)
    return hypot(px - (ax + t * dx), py - (ay + t * dy))


def _hypot_in_slots(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, buffers: torch.Tensor) -> torch.Tensor:
    """torch.hypot of the (m, H, W) offsets x, y of slots `rows` (m,), run at those rows of every slot.

    buffers (3, n*S, H, W): hypot's x, y and result over all n*S slots of a chunk, any values in the
    other rows. hypot's vectorised path and its scalar one (the last elements of each thread's share of
    a tensor) can differ in the last bit, and which elements take which depends on the tensor's
    length. Run over every slot, each pixel takes the path it took when every slot was rasterised as
    every kind, so the drawing stays bit for bit that of the all-kinds rasteriser. -> (m, H, W)
    """
    bx, by, out = buffers  # (n*S, H, W) each
    bx[rows], by[rows] = x, y
    return torch.hypot(bx, by, out=out)[rows]


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
    # lines through the shape's box, at a random angle: ends at the centre -+ (ex, ey)
    ang = u(0, math.pi)
    ex, ey = hw * torch.cos(ang), hh * torch.sin(ang)  # (n, S, 1, 1)
    # triangles: three vertices at random angles around the centre
    angles = torch.rand(n, S, 3, generator=g) * 2 * math.pi
    radius = 0.5 * (hw + hh).squeeze(-1) * (0.6 + 0.4 * torch.rand(n, S, 3, generator=g))
    vx = (cx.squeeze(-1) + radius * torch.cos(angles)).unsqueeze(-1)  # (n, S, 3, 1)
    vy = (cy.squeeze(-1) + radius * torch.sin(angles)).unsqueeze(-1)

    slots = n * S
    coords = torch.arange(size, dtype=torch.float32) + 0.5
    py, px = coords.view(1, size, 1), coords.view(1, 1, size)
    buffers = torch.zeros(3, slots, size, size)  # hypot's x, y and result for every slot (_hypot_in_slots)
    drawn = torch.zeros(slots, size, size, dtype=torch.bool)  # (n*S, H, W): each slot's own pixels
    # each kind is rasterised only for the active slots that hold it; the other rows stay empty
    for k in range(len(KINDS)):
        rows = ((kind == k) & active).view(slots).nonzero().view(-1)  # (m,)
        if len(rows) == 0:
            continue
        x0, y0, w, h, th = (p.view(slots, 1, 1)[rows] for p in (cx, cy, hw, hh, thick))  # (m, 1, 1) each
        dx, dy = (px - x0).abs(), (py - y0).abs()  # (m, 1, W), (m, H, 1)
        hypot = functools.partial(_hypot_in_slots, rows=rows, buffers=buffers)
        if k == RECT:  # axis-aligned; the outline is the rectangle minus its inset
            solid = (dx <= w) & (dy <= h)  # (m, H, W)
            outline = solid & ~((dx <= w - th) & (dy <= h - th))
        elif k == ELLIPSE:  # semi-axes w, h; the outline is the ellipse minus the one th inside
            solid = (dx / w) ** 2 + (dy / h) ** 2 <= 1.0  # (m, H, W)
            inner = (dx / (w - th).clamp_min(1e-3)) ** 2 + (dy / (h - th).clamp_min(1e-3)) ** 2 <= 1.0
            outline = solid & ~inner
        elif k == LINE:  # a line is the same filled or outlined
            lx, ly = ex.view(slots, 1, 1)[rows], ey.view(slots, 1, 1)[rows]  # (m, 1, 1)
            solid = _segment_distance(px, py, x0 - lx, y0 - ly, x0 + lx, y0 + ly, hypot) <= th / 2 + 0.25
            outline = solid  # (m, H, W)
        else:  # triangles: inside on one side of all three edges; the outline within th of an edge
            tx, ty = vx.view(slots, 3, 1)[rows], vy.view(slots, 3, 1)[rows]  # (m, 3, 1)
            side, dist = [], []  # 3 x (m, H, W) each
            for i in range(3):
                j = (i + 1) % 3
                ax, ay, bx, by = tx[:, i : i + 1], ty[:, i : i + 1], tx[:, j : j + 1], ty[:, j : j + 1]
                side.append((bx - ax) * (py - ay) - (by - ay) * (px - ax))
                dist.append(_segment_distance(px, py, ax, ay, bx, by, hypot))
            solid = ((side[0] >= 0) & (side[1] >= 0) & (side[2] >= 0)) | (
                (side[0] <= 0) & (side[1] <= 0) & (side[2] <= 0)
            )  # (m, H, W)
            outline = solid & (torch.minimum(torch.minimum(dist[0], dist[1]), dist[2]) <= th)
        drawn[rows] = torch.where(filled.view(slots, 1, 1)[rows], solid, outline)  # (m, H, W)
    drawn = drawn.view(n, S, size, size)  # inactive slots empty
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
