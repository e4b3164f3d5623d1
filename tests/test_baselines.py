"""The baselines on tiny datasets whose answers are computed by hand or by a plain-Python reference."""

from collections import Counter

import torch

from vitmask.config import config_from_dict
from vitmask.data.batches import eval_batches
from vitmask.data.patches import classes_to_patches, unpatchify
from vitmask.evaluate.baselines import EIGHT, FOUR, codes_fit, context_codes, fit_baselines, fit_table, lookup
from vitmask.evaluate.scores import evaluate


def images_from_classes(classes: list[list[int]], patch_size: int = 2) -> torch.Tensor:
    """(n, N) patch classes on a square grid -> (n, H, W) uint8 images."""
    c = torch.tensor(classes)
    return unpatchify(classes_to_patches(c, patch_size**2), patch_size)


def cfg_for(image_size: int, ratio: float = 0.5):
    return config_from_dict({"data": {"image_size": image_size, "patch_size": 2}, "mask": {"ratio": ratio}})


def test_majority_and_per_position_majority_by_hand():
    train = images_from_classes([[15, 0, 0, 0], [15, 3, 0, 0], [0, 3, 0, 1]])  # a 2x2 grid of patches
    b = fit_baselines(train, cfg_for(4), 0.5, seed=0)
    assert b.majority == 0  # 0 occurs 6 times, 15 and 3 twice, 1 once
    assert b.position.tolist() == [15, 3, 0, 0]
    ids = torch.tensor([[0, 1]])
    mask = torch.tensor([[True, True, False, False]])
    guess = b.predict(torch.tensor([[7, 7, 7, 7]]), mask, ids)
    assert guess["majority"].tolist() == [[0, 0]] and guess["position"].tolist() == [[15, 3]]


def test_context_codes_by_hand():
    # grid 2x2, classes a=1 b=2 c=3 d=4; patches 0 and 2 masked. Base C + 2 = 18, masked = 16, outside = 17.
    classes = torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[True, False, True, False]])
    code = context_codes(classes, mask, 2, 16, EIGHT)[0, 0].item()
    digits = [17, 17, 17, 17, 2, 17, 16, 4]  # the neighbours of patch 0, row by row
    assert code == sum(d * 18**k for k, d in enumerate(reversed(digits)))
    up_left_right_down = [17, 17, 2, 16]
    assert context_codes(classes, mask, 2, 16, FOUR)[0, 0].item() == sum(
        d * 18**k for k, d in enumerate(reversed(up_left_right_down))
    )


def test_table_takes_the_most_frequent_centre_ties_to_the_smallest_and_backs_off():
    table = fit_table(torch.tensor([5, 5, 5, 7, 7, 9]), torch.tensor([2, 2, 1, 4, 3, 0]), 16, FOUR)
    assert table.keys.tolist() == [5, 7, 9] and table.values.tolist() == [2, 3, 0]
    got = lookup(table, torch.tensor([[9, 6, 5, 100]]), torch.tensor([[11, 12, 13, 14]]))
    assert got.tolist() == [[0, 12, 2, 14]]


def test_back_off_goes_8_neighbour_then_4_neighbour_then_per_position():
    # 2x2 grids of patches, one masked per image (ratio 0.25 of 4). For the top-left patch the
    # 8-neighbour context is (right, below, below-right), the 4-neighbour context (right, below).
    train = images_from_classes([[1, 2, 3, 4]] * 40 + [[5, 2, 3, 6]] * 120 + [[7, 8, 8, 8]] * 200)
    b = fit_baselines(train, cfg_for(4, 0.25), 0.25, seed=0)
    # by hand: 8-table (2, 3, 4) -> 1 (only [1, 2, 3, 4] has it); 4-table (2, 3) -> 5 ([5, 2, 3, 6] is
    # three times as common); per-position majority of the top-left patch -> 7 (200 images of 360)
    assert b.position[0] == 7
    queries = torch.tensor([[0, 2, 3, 4], [0, 2, 3, 9], [0, 9, 9, 9]])  # the masked patch's class is never read
    mask = torch.tensor([[True, False, False, False]] * 3)
    got = b.predict(queries, mask, torch.zeros(3, 1, dtype=torch.long))["neighbour"]
    assert got.flatten().tolist() == [1, 5, 7]  # the 8-neighbour table decides, then the 4-neighbour, then position


def test_the_neighbour_table_is_left_out_for_patches_larger_than_2x2():
    # 3x3 patches: 512 classes, (512 + 2)^8 * 512 overflows int64, so no table is built
    assert codes_fit(16, 8) and not codes_fit(512, 8)
    g = torch.Generator().manual_seed(0)
    for patch_size, want in ((3, {"majority", "position"}), (2, {"majority", "position", "neighbour"})):
        cfg = config_from_dict({"data": {"image_size": 6, "patch_size": patch_size}, "mask": {"ratio": 0.5}})
        train = (torch.rand(12, 6, 6, generator=g) < 0.3).to(torch.uint8)
        b = fit_baselines(train, cfg, 0.5, seed=0)
        assert (b.tables == []) == (patch_size == 3)
        q = next(eval_batches(train, cfg, 0.5, 1, 4))
        assert set(b.predict(q.targets, q.mask, q.ids)) == want
        m = evaluate(Zeros(cfg.data.num_classes), train, cfg, 0.5, 1, b.majority, baselines=b)
        assert set(m["baselines"]) == want  # the eval report leaves the table out too


class Zeros(torch.nn.Module):
    """Equal logits for every class: a model-shaped stand-in for the eval loop."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.num_classes = num_classes

    def forward(self, patches, mask, ids):
        return torch.zeros(*ids.shape, self.num_classes)  # (B, M, C)


def reference_neighbour(train_cls, train_masks, query_cls, query_mask, grid, position):
    """Plain-Python neighbour baseline: 8-neighbour table, then 4-neighbour, then per-position."""

    def context(cls, mask, i, offsets):
        r, c = divmod(i, grid)
        out = []
        for dy, dx in offsets:
            rr, cc = r + dy, c + dx
            if not (0 <= rr < grid and 0 <= cc < grid):
                out.append("out")
            elif mask[rr * grid + cc]:
                out.append("masked")
            else:
                out.append(cls[rr * grid + cc])
        return tuple(out)

    tables = []
    for offsets in (EIGHT, FOUR):
        seen: dict[tuple, Counter] = {}
        for cls, mask in zip(train_cls, train_masks, strict=True):
            for i in range(grid * grid):
                if mask[i]:
                    seen.setdefault(context(cls, mask, i, offsets), Counter())[cls[i]] += 1
        # most frequent, ties to the smallest class
        tables.append({k: min(v, key=lambda c, v=v: (-v[c], c)) for k, v in seen.items()})
    guesses = []
    for i in range(grid * grid):
        if not query_mask[i]:
            continue
        g = position[i]
        for table, offsets in zip(tables, (EIGHT, FOUR), strict=True):
            key = context(query_cls, query_mask, i, offsets)
            if key in table:
                g = table[key]
                break
        guesses.append(g)
    return guesses


def test_neighbour_table_matches_a_plain_python_reference():
    g = torch.Generator().manual_seed(0)
    # sparse random 8x8 images (a 4x4 grid): few distinct contexts, so the table is hit and missed
    train = (torch.rand(30, 8, 8, generator=g) < 0.15).to(torch.uint8)
    query = (torch.rand(6, 8, 8, generator=g) < 0.15).to(torch.uint8)
    cfg = cfg_for(8, 0.5)
    b = fit_baselines(train, cfg, 0.5, seed=3, batch_size=7)
    train_cls, train_masks = [], []
    for batch in eval_batches(train, cfg, 0.5, 3, 7):  # the masks the tables were fitted on
        train_cls += batch.targets.tolist()
        train_masks += batch.mask.tolist()
    q = next(eval_batches(query, cfg, 0.5, 11, len(query)))
    got = b.predict(q.targets, q.mask, q.ids)["neighbour"]
    pos = b.position.tolist()
    for row in range(len(query)):
        want = reference_neighbour(train_cls, train_masks, q.targets[row].tolist(), q.mask[row].tolist(), 4, pos)
        order = q.ids[row].argsort()  # ids are in mask-draw order; the reference goes by position
        assert got[row][order].tolist() == want
    # the query exercises every level: some 8-neighbour hits, some 4-neighbour hits, some back-offs
    hits = [torch.isin(context_codes(q.targets, q.mask, 4, 16, t.offsets).gather(1, q.ids), t.keys) for t in b.tables]
    assert hits[0].any() and (hits[1] & ~hits[0]).any() and (~hits[1] & ~hits[0]).any()
