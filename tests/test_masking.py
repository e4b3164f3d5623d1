"""Masking: the exact count M = round(ratio * N), random and block masks, per-batch ratio ranges,
what the model sees in place of a masked patch (the fill value or the learned mask embedding), and
their config keys."""

import math

import numpy as np
import pytest
import torch

from tests.conftest import TINY, write_config
from tests.test_sources import run_inproc
from vitmask.config import config_from_dict, dump_config, load_config
from vitmask.data.batches import BatchSampler, eval_batches
from vitmask.data.masking import block_mask, random_mask
from vitmask.errors import UserError
from vitmask.model.masked_input import apply_fill, mask_to_ids
from vitmask.model.vit import build_model
from vitmask.sizes import num_masked


def neighbour_share(mask: torch.Tensor, grid: int) -> float:
    """Masked-masked 4-neighbour pairs per masked patch: about 2 for solid blocks, lower when scattered."""
    m = mask.view(-1, grid, grid).float()
    pairs = (m[:, :, 1:] * m[:, :, :-1]).sum() + (m[:, 1:] * m[:, :-1]).sum()
    return float(pairs / m.sum())


def test_num_masked_is_round_ratio_times_n_within_1_and_n_minus_1():
    assert num_masked(256, 0.5) == 128
    assert num_masked(256, 0.75) == 192
    assert num_masked(10, 0.33) == 3
    assert num_masked(10, 0.01) == 1
    assert num_masked(10, 0.99) == 9


@pytest.mark.parametrize(
    "n,ratio,count",
    [
        (16, 0.53, 8),  # 8.48 rounds down
        (16, 0.6, 10),  # 9.6 rounds up (truncation would give 9)
        (16, 0.3, 5),  # 4.8 rounds up
        (16, 0.59375, 10),  # exactly 9.5: Python's round goes to the even 10
        (16, 0.65625, 10),  # exactly 10.5: Python's round goes to the even 10, not 11
        (64, 0.45, 29),  # 28.8
    ],
)
def test_num_masked_rounds_at_the_boundaries(n, ratio, count):
    assert num_masked(n, ratio) == count


def test_batches_hide_round_ratio_times_n_patches():
    # 8x8 images of 2x2 patches: N = 16; ratio 0.6 -> round(9.6) = 10 patches in every image
    cfg = config_from_dict({**TINY, "data": {**TINY["data"], "image_size": 8}, "mask": {"ratio": 0.6}})
    images = torch.randint(0, 2, (20, 8, 8), dtype=torch.uint8)
    batch = BatchSampler(images, cfg).sample()
    assert batch.ids.shape == (32, 10) and batch.mask.sum(1).tolist() == [10] * 32
    for b in eval_batches(images, cfg, 0.6, seed=0, batch_size=8):
        assert b.ids.shape[1] == 10 and b.mask.sum(1).tolist() == [10] * len(b.mask)


def test_random_mask_hides_an_exact_count_per_image():
    g = torch.Generator().manual_seed(1)
    for ratio in (0.1, 0.5, 0.75):
        m = num_masked(64, ratio)
        ids, mask = random_mask(50, 64, m, g)
        assert ids.shape == (50, m) and mask.shape == (50, 64)
        assert (mask.sum(1) == m).all()
        assert mask.gather(1, ids).all()  # ids point at masked patches
        assert (ids.sort(1).values.diff(dim=1) > 0).all()  # no repeats
        assert torch.equal(mask_to_ids(mask), ids.sort(1).values)


def test_random_masks_pick_every_patch_equally_often():
    # 4000 masks of 5 of 16 patches: each patch is hidden in 5/16 of them (binomial sd 0.0073)
    _, mask = random_mask(4000, 16, 5, torch.Generator().manual_seed(0))
    share = mask.double().mean(0)  # (16,)
    assert ((share - 5 / 16).abs() < 0.03).all(), share
    pairs = (mask[:, 0] & mask[:, 1]).double().mean()  # two given patches together: 5/16 * 4/15
    assert abs(float(pairs) - 5 / 16 * 4 / 15) < 0.02


def test_random_mask_differs_between_images_and_is_seeded():
    a = random_mask(4, 64, 32, torch.Generator().manual_seed(3))[1]
    b = random_mask(4, 64, 32, torch.Generator().manual_seed(3))[1]
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1])


def test_apply_fill_sets_exactly_the_masked_patches_to_the_fill_value():
    patches = torch.tensor([[[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]])  # (1, 3, 4)
    mask = torch.tensor([[False, True, True]])
    out = apply_fill(patches, mask, 0.3)
    want = torch.tensor([[[1.0, 0.0, 1.0, 1.0], [0.3] * 4, [0.3] * 4]])
    assert torch.equal(out, want)
    assert patches[0, 1].tolist() == [0.0, 1.0, 0.0, 0.0]  # the caller's pixels are left alone


def test_the_model_sees_the_configured_fill_value_in_masked_patches():
    # mask.fill 0.3, not the default 0.5: the pixels the patch embedding reads, captured by a hook
    cfg = config_from_dict({**TINY, "mask": {"ratio": 0.5, "fill": 0.3}})
    model = build_model(cfg).eval()
    seen = {}
    model.embed.register_forward_pre_hook(lambda m, args: seen.setdefault("pixels", args[0].clone()))
    x = torch.ones(2, 64, 4)  # every pixel foreground
    mask = torch.zeros(2, 64, dtype=torch.bool)
    mask[0, 5] = mask[1, 63] = True
    model(x, mask)
    want = torch.ones(2, 64, 4)
    want[0, 5] = want[1, 63] = 0.3
    assert torch.equal(seen["pixels"], want)


@pytest.mark.parametrize(
    "grid,num_mask,min_patches", [(16, 128, 16), (16, 1, 16), (8, 63, 4), (14, 75, 16), (5, 12, 30)]
)
def test_block_masks_hit_the_exact_count_with_valid_shapes(grid, num_mask, min_patches):
    g = torch.Generator().manual_seed(0)
    ids, mask = block_mask(64, grid, num_mask, min_patches, (0.3, 3.3), g)
    assert ids.shape == (64, num_mask) and ids.dtype == torch.int64
    assert mask.shape == (64, grid * grid) and mask.dtype == torch.bool
    assert (mask.sum(1) == num_mask).all()
    assert ((ids >= 0) & (ids < grid * grid)).all()
    assert mask.gather(1, ids).all()  # ids are exactly the masked patches
    assert all(len(set(row.tolist())) == num_mask for row in ids)


def sequential_block_mask(batch, grid, num_mask, min_patches, aspect, generator):
    """The reference: BEiT's rectangles drawn one round at a time for the whole batch, each from the
    count still truly missing, up to ceil(M / min_patches) + 4 rounds (at most 32); patches ranked by
    the round that first covered them, then by distance from that rectangle's centre, ties by index;
    a shortfall taken from the patches with the most covered 4-neighbours. The statistics below
    hold `block_mask`'s one-pass-at-a-time masks to this one's."""
    n = grid * grid
    rounds = min(math.ceil(num_mask / min(min_patches, num_mask)) + 4, 32)
    rand = lambda *shape: torch.rand(*shape, generator=generator)  # noqa: E731
    coord = torch.arange(grid, dtype=torch.float32)
    rows, cols = coord.view(1, grid, 1), coord.view(1, 1, grid)
    log_lo, log_hi = math.log(aspect[0]), math.log(aspect[1])
    key = torch.zeros(batch, grid, grid)
    covered = torch.zeros(batch, grid, grid, dtype=torch.bool)
    for r in range(rounds):
        missing = (num_mask - covered.sum((1, 2))).clamp_min(0).float()
        lo = torch.clamp(missing, max=float(min_patches))
        area = lo + rand(batch) * (missing - lo)
        ratio = torch.exp(log_lo + rand(batch) * (log_hi - log_lo))
        h = (area * ratio).sqrt().round().clamp(1, grid)
        w = (area / ratio).sqrt().round().clamp(1, grid)
        top = (rand(batch) * (grid - h + 1)).floor().view(-1, 1, 1)
        left = (rand(batch) * (grid - w + 1)).floor().view(-1, 1, 1)
        h, w = h.view(-1, 1, 1), w.view(-1, 1, 1)
        rect = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
        new = rect & ~covered & (missing > 0).view(-1, 1, 1)
        dist = torch.hypot(rows - (top + (h - 1) / 2), cols - (left + (w - 1) / 2))
        key = torch.where(new, r + dist / (dist.amax((1, 2), keepdim=True) + 1), key)
        covered |= new
    c = torch.nn.functional.pad(covered.float(), (1, 1, 1, 1))
    near = c[:, :-2, 1:-1] + c[:, 2:, 1:-1] + c[:, 1:-1, :-2] + c[:, 1:-1, 2:]
    key = torch.where(covered, key, rounds + (4 - near + rand(batch, grid, grid)) / 5)
    ids = key.view(batch, n).argsort(dim=1, stable=True)[:, :num_mask]
    return torch.zeros(batch, n, dtype=torch.bool).scatter_(1, ids, True)


def mask_statistics(mask: torch.Tensor, grid: int) -> dict[str, torch.Tensor | float]:
    """What a block mask looks like, over a batch (B, N): masked-masked neighbour pairs per masked
    patch, the boundary length of a mask, the log height/width of the rows and columns it touches
    (mean and spread), and how often each row and each column of the grid is masked."""
    m = mask.view(-1, grid, grid).float()  # (B, g, g)
    pairs = (m[:, :, 1:] * m[:, :, :-1]).sum((1, 2)) + (m[:, 1:] * m[:, :-1]).sum((1, 2))
    c = torch.nn.functional.pad(m, (1, 1, 1, 1))
    open_sides = 4 - (c[:, :-2, 1:-1] + c[:, 2:, 1:-1] + c[:, 1:-1, :-2] + c[:, 1:-1, 2:])  # (B, g, g)
    log_aspect = (m.amax(2).sum(1) / m.amax(1).sum(1)).log()  # (B,)
    return {
        "neighbours": float((pairs / m.sum((1, 2))).mean()),
        "boundary": float((m * open_sides).sum((1, 2)).mean()),
        "log_aspect": float(log_aspect.mean()),
        "log_aspect_sd": float(log_aspect.std()),
        "row_profile": m.mean((0, 2)),  # (g,)
        "col_profile": m.mean((0, 1)),  # (g,)
    }


# (grid, M, min_patches): a 16x16 grid at half and an eighth, MNIST's 14x14 at 92%, a small grid, one rectangle
SHAPES = [(16, 128, 16), (16, 32, 16), (14, 180, 16), (8, 20, 4), (16, 16, 16)]


@pytest.mark.parametrize("grid,num_mask,min_patches", SHAPES)
def test_block_masks_keep_the_statistics_of_rectangles_drawn_one_at_a_time(grid, num_mask, min_patches):
    # 1500 masks of each; the tolerances are a few times the spread between two seeds of the reference
    # (measured: neighbours 0.002, boundary 0.5%, log aspect 0.01, profiles 0.01) plus the design's
    # own shift (a pass's rectangles overlap before the next pass sees it: boundary up to +4.4%)
    ours = block_mask(1500, grid, num_mask, min_patches, (0.3, 3.3), torch.Generator().manual_seed(5))[1]
    ref = sequential_block_mask(1500, grid, num_mask, min_patches, (0.3, 3.3), torch.Generator().manual_seed(6))
    a, b = mask_statistics(ours, grid), mask_statistics(ref, grid)
    assert abs(a["neighbours"] - b["neighbours"]) < 0.03, (a["neighbours"], b["neighbours"])
    assert abs(a["boundary"] / b["boundary"] - 1) < 0.06, (a["boundary"], b["boundary"])
    assert abs(a["log_aspect"]) < 0.04 and abs(b["log_aspect"]) < 0.04  # no side preferred
    assert abs(a["log_aspect_sd"] - b["log_aspect_sd"]) < 0.05, (a["log_aspect_sd"], b["log_aspect_sd"])
    for key in ("row_profile", "col_profile"):  # where on the grid: the same profile, edges as often
        assert (a[key] - b[key]).abs().max() < 0.035, (key, a[key], b[key])
    # rows and columns alike, and a profile symmetric about the middle (uniform positions)
    assert (a["row_profile"] - a["col_profile"]).abs().max() < 0.035
    assert (a["row_profile"] - a["row_profile"].flip(0)).abs().max() < 0.035


def test_the_statistics_tell_block_masks_from_other_masks():
    # the control: the same statistics and tolerances do tell a different mask apart
    grid, m = 16, 128
    ref = mask_statistics(sequential_block_mask(1500, grid, m, 16, (0.3, 3.3), torch.Generator().manual_seed(6)), grid)
    rand = mask_statistics(random_mask(1500, 256, m, torch.Generator().manual_seed(0))[1], grid)
    assert abs(rand["neighbours"] - ref["neighbours"]) > 0.3
    wide = mask_statistics(block_mask(1500, grid, m, 16, (1.0, 3.3), torch.Generator().manual_seed(5))[1], grid)
    assert abs(wide["log_aspect"]) > 0.04  # rectangles of aspect >= 1 only: taller than wide
    big = mask_statistics(block_mask(1500, grid, m, 64, (0.3, 3.3), torch.Generator().manual_seed(5))[1], grid)
    assert abs(big["boundary"] / ref["boundary"] - 1) > 0.06  # rectangles of 64 patches at least: fewer edges


def test_mixed_masks_hold_block_rows_at_the_share_and_random_rows_elsewhere():
    from vitmask.config import MaskConfig
    from vitmask.data.masking import mixed_mask

    cfg = MaskConfig(strategy="mixed", block_share=0.25)
    ids, mask = mixed_mask(cfg, 4000, 16, 128, torch.Generator().manual_seed(0))
    assert (mask.sum(1) == 128).all() and mask.gather(1, ids).all()
    share = mask_statistics(mask, 16)["neighbours"]  # per row: about 1.0 random, 1.74 blocks
    per_row = (mask.view(-1, 16, 16)[:, :, 1:] & mask.view(-1, 16, 16)[:, :, :-1]).sum((1, 2))
    blocky = (per_row > 90).double().mean()  # a 128-patch block row has about 111 such pairs, random about 60
    assert abs(float(blocky) - 0.25) < 0.03 and 1.0 < share < 1.74


@pytest.mark.parametrize("aspect,shape", [((1.0, 1.0), (4, 4)), ((4.0, 4.0), (8, 2)), ((0.25, 0.25), (2, 8))])
def test_one_block_is_a_rectangle_of_the_asked_aspect(aspect, shape):
    # M = min_patches = 16: one rectangle of area 16; height/width = aspect fixes its sides
    _, mask = block_mask(32, 16, 16, 16, aspect, torch.Generator().manual_seed(1))
    for m in mask.view(32, 16, 16):
        rows, cols = m.nonzero(as_tuple=True)
        h, w = int(rows.max() - rows.min() + 1), int(cols.max() - cols.min() + 1)
        assert (h, w) == shape and m[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1].all()


def test_block_masks_are_clustered_and_seeded():
    g = torch.Generator().manual_seed(0)
    _, blocks = block_mask(64, 16, 128, 16, (0.3, 3.3), g)
    _, rand = random_mask(64, 256, 128, torch.Generator().manual_seed(0))
    assert neighbour_share(blocks, 16) > 1.6 > 1.1 > neighbour_share(rand, 16)  # random: about 1.0
    again = block_mask(64, 16, 128, 16, (0.3, 3.3), torch.Generator().manual_seed(0))[1]
    assert torch.equal(blocks, again)


def test_ratio_range_draws_one_count_per_batch_within_range_and_resumes():
    cfg = config_from_dict({**TINY, "data": {**TINY["data"], "image_size": 16}}, ["mask.ratio_range=[0.25, 0.75]"])
    images = torch.randint(0, 2, (50, 16, 16), dtype=torch.uint8)
    sampler = BatchSampler(images, cfg)
    counts = []
    for _ in range(12):
        b = sampler.sample()
        assert b.ids.shape[0] == cfg.data.batch_size and (b.mask.sum(1) == b.ids.shape[1]).all()
        counts.append(b.ids.shape[1])
    assert all(16 <= m <= 48 for m in counts) and len(set(counts)) > 3  # N = 64: round(0.25 N) .. round(0.75 N)
    state = sampler.state_dict()
    ahead = [sampler.sample().ids for _ in range(3)]
    resumed = BatchSampler(images, cfg)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, resumed.sample().ids) for a in ahead)
    fixed = BatchSampler(images, config_from_dict(TINY))
    assert {fixed.sample().ids.shape[1] for _ in range(3)} == {32}  # no range: round(0.5 * 64) every batch


def test_eval_batches_use_the_configured_strategy_seeded():
    cfg = config_from_dict({**TINY, "mask": {"strategy": "block", "ratio": 0.5}})
    images = torch.randint(0, 2, (40, 16, 16), dtype=torch.uint8)
    a = [b.mask for b in eval_batches(images, cfg, 0.25, seed=3, batch_size=16)]
    b = [b.mask for b in eval_batches(images, cfg, 0.25, seed=3, batch_size=16)]
    assert [len(x) for x in a] == [16, 16, 8] and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all((x.sum(1) == 16).all() for x in a)  # round(0.25 * 64)
    assert neighbour_share(torch.cat(a), 8) > 1.3


def test_learned_mask_embedding_replaces_masked_tokens_and_trains():
    cfg = config_from_dict(TINY, ["mask.fill=learned"])
    model = build_model(cfg).eval()
    assert model.mask_token.shape == (cfg.model.hidden_dim,)
    g = torch.Generator().manual_seed(0)
    ids, mask = random_mask(2, 64, 32, g)
    x = torch.randint(0, 2, (2, 64, 4), generator=g).float()
    other = torch.where(mask.unsqueeze(-1), 1 - x, x)  # only the masked patches' pixels differ
    out = model(x, mask, ids)
    assert torch.allclose(out, model(other, mask, ids))  # the model never sees masked pixels
    assert not torch.allclose(out, model(1 - x, mask, ids))  # but it does see the visible ones
    # independent reference: the first block's input built by hand
    ref = model.embed(x).clone()
    ref[mask] = model.mask_token
    seen = {}
    model.blocks[0].register_forward_hook(lambda m, inp, o: seen.setdefault("in", inp[0]))
    model(x, mask, ids)
    assert torch.allclose(seen["in"], ref + model.pos)
    model.train()
    model(x, mask, ids).sum().backward()
    assert model.mask_token.grad is not None and model.mask_token.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "override,needle",
    [
        ("mask.fill=zero", "mask.fill must be a number in [0, 1] or 'learned'"),
        ("mask.fill=2", "mask.fill must be in [0, 1]"),
        ("mask.ratio_range=[0.8, 0.2]", "mask.ratio_range must be [min, max]"),
        ("mask.ratio_range=0.3", "mask.ratio_range has the wrong type"),
        ("mask.strategy=blocks", "mask.strategy must be one of"),
        ("mask.block_aspect=[0, 2]", "mask.block_aspect must be [min, max]"),
        ("data.source=images", "data.source must be one of"),
        ("data.test_fraction=0.95", "must be < 1"),
    ],
)
def test_bad_mask_and_data_keys_are_rejected(override, needle):
    with pytest.raises(UserError) as e:
        config_from_dict({}, [override])
    assert needle in str(e.value)


def test_range_and_learned_fill_survive_a_dump_and_load(tmp_path):
    cfg = config_from_dict({}, ["mask.ratio_range=[0.3, 0.7]", "mask.fill=learned", "mask.strategy=block"])
    assert cfg.mask.ratio_range == (0.3, 0.7) and cfg.mask.fill == "learned"
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg
    assert config_from_dict({}, ["mask.fill=0"]).mask.fill == 0.0


def test_training_runs_with_block_masks_ratio_range_and_learned_fill(tmp_path, capsys):
    np.savez(tmp_path / "d.npz", images=(np.random.default_rng(0).random((60, 12, 12)) < 0.3))
    over = {
        "data": {"source": "npz", "path": str(tmp_path / "d.npz"), "fit": "pad"},
        "mask": {"strategy": "block", "ratio_range": [0.2, 0.6], "fill": "learned", "block_min_patches": 4},
        "train": {"max_steps": 4, "eval_every": 4, "checkpoint_every": 4, "log_every": 2},
    }
    cfg = write_config(tmp_path / "c.yaml", over)
    res = run_inproc(capsys, "train", "--config", cfg, "--run-dir", tmp_path / "run", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    state = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert state["step"] == 4 and "mask_token" in state["model"]
    assert tuple(state["config"]["mask"]["ratio_range"]) == (0.2, 0.6)


class OpCount:
    """Counts the aten ops run inside it (a torch dispatch mode)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.ops += 1
                return func(*args, **(kwargs or {}))

        self.ops, self.mode = 0, Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def test_block_and_mixed_masks_take_a_fixed_number_of_ops_whatever_the_batch_grid_and_count():
    from vitmask.config import MaskConfig
    from vitmask.data.masking import mixed_mask

    def ops(build) -> int:
        with OpCount() as c:
            build()
        return c.ops

    g = torch.Generator().manual_seed(0)
    blocks = {
        ops(lambda b=b, grid=grid, m=m: block_mask(b, grid, m, 16, (0.3, 3.3), g))
        for b, grid, m in [(2, 4, 3), (16, 16, 128), (128, 16, 200), (8, 28, 700)]
    }
    assert len(blocks) == 1, blocks
    cfg = MaskConfig(strategy="mixed", block_share=0.5)
    mixed = {ops(lambda b=b, grid=grid: mixed_mask(cfg, b, grid, 20, g)) for b, grid in [(16, 8), (256, 16), (64, 28)]}
    assert len(mixed) == 1, mixed
