"""The shapes generator's drawing (`_draw_chunk` rasterises each kind only for the slots that hold it)
against the all-kinds rasteriser it replaced, written out here: the same images, labels and
generator state bit for bit, and so the same published dataset."""

import hashlib
import math

import pytest
import torch

from vitmask.data import shapes
from vitmask.data.shapes import largest_kind
from vitmask.sizes import MAX_SHAPES

SEEDS = (0, 1, 2, 3, 12345)


def reference_segment_distance(px, py, ax, ay, bx, by):
    """Distance from pixel centres (1, 1, H, W) to segments with ends (n, S, 1, 1) -> (n, S, H, W)."""
    dx, dy = bx - ax, by - ay
    t = ((px - ax) * dx + (py - ay) * dy) / (dx * dx + dy * dy).clamp_min(1e-6)
    t = t.clamp(0.0, 1.0)
    return torch.hypot(px - (ax + t * dx), py - (ay + t * dy))


def reference_draw_chunk(n: int, size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-kinds rasteriser (every kind for every slot) the module's drawing must match bit for bit."""
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
    line = reference_segment_distance(px, py, cx - ex, cy - ey, cx + ex, cy + ey) <= thick / 2 + 0.25
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
        edge_dist.append(reference_segment_distance(px, py, ax, ay, bx, by))
    e = torch.stack(edge_sign)  # (3, n, S, H, W)
    tri = (e >= 0).all(0) | (e <= 0).all(0)
    tri_out = tri & (torch.stack(edge_dist).amin(0) <= thick)

    solid = torch.stack([rect, ell, line, tri])  # (4, n, S, H, W)
    outline = torch.stack([rect_out, ell_out, line, tri_out])
    pick = torch.where(filled, solid, outline)  # (4, n, S, H, W)
    drawn = pick.gather(0, kind.expand(n, S, size, size).unsqueeze(0)).squeeze(0) & active  # (n, S, H, W)
    return drawn.any(1).to(torch.uint8), largest_kind(drawn, kind.view(n, S))  # (n, H, W), (n,)


@pytest.mark.parametrize("size", [16, 28, 32, 7])
@pytest.mark.parametrize("n", [1, 3, 64, 300])
def test_drawing_each_kind_only_for_its_slots_gives_the_same_images_labels_and_generator_state(size, n):
    for seed in SEEDS:
        g, g_ref = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        images, labels = shapes._draw_chunk(n, size, g)
        ref_images, ref_labels = reference_draw_chunk(n, size, g_ref)
        assert images.dtype == torch.uint8 and images.shape == (n, size, size) and labels.shape == (n,)
        assert torch.equal(images, ref_images), (seed, size, n)
        assert torch.equal(labels, ref_labels), (seed, size, n)
        assert torch.equal(g.get_state(), g_ref.get_state()), (seed, size, n)


# configs/default.yaml's shapes splits (20000 / 1000 / 2000 drawn, 32 x 32, seed 0) as the all-kinds
# rasteriser above draws them: kept images, and sha256 of their bytes and of their int64 labels
PUBLISHED = {
    "train": (19760, "e080088b9315eeb679e877e50b3e71cffbcd5a5a4d695593d22a2f81b3318617",
              "f7434d89f85e434930689e1e203d2138d29ae64b4451fe53fb7c49726e19432a"),
    "val": (993, "98668c0a9993c0cb829d58dd13409749a59257b71694c9c79bd1dc3ecd897889",
            "baf403ef03b383e7f11fcc402044f745a30019b20d34c1e5b90bce5b3489764d"),
    "test": (1981, "6036b2daf80461794447d8918e7b90707cb6403856ac67a66be84242512b81e3",
             "34d66b47ba6ae3a9352655f831e372414981b23fe059f4c375617fd504d436d4"),
}  # fmt: skip


def test_the_published_shapes_splits_are_those_of_the_all_kinds_rasteriser():
    images, labels = shapes.make_labelled_splits(20000, 1000, 2000, 32, 0)
    for split, (count, image_hash, label_hash) in PUBLISHED.items():
        assert len(images[split]) == count, split
        assert hashlib.sha256(images[split].numpy().tobytes()).hexdigest() == image_hash, split
        assert hashlib.sha256(labels[split].numpy().tobytes()).hexdigest() == label_hash, split
