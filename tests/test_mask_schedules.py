"""Training masks for a generative model: the ratio schedules (fixed, uniform, cosine), mixed random and
block masks, the centre box, their config keys, and what validation and the training log count."""

import copy
import math

import pytest
import torch

from tests.conftest import TINY, RecordingLogger
from vitmask.config import config_from_dict
from vitmask.data.batches import BatchSampler, eval_batches
from vitmask.data.masking import centre_box_mask, draw_num_masked, mixed_mask
from vitmask.errors import UserError
from vitmask.sizes import num_masked
from vitmask.train.trainer import Trainer

KS_001 = 1.63  # Kolmogorov-Smirnov: sqrt(n) * max |ECDF - CDF| exceeds this with probability 0.01
CHI2_14_DF_0001 = 36.12  # chi-square, 14 degrees of freedom, upper 0.001 tail (standard table)


def mask_cfg(*overrides: str, image_size: int = 32):
    return config_from_dict({**TINY, "data": {**TINY["data"], "image_size": image_size}}, list(overrides))


def draws(cfg, count: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([draw_num_masked(cfg.mask, cfg.data.num_patches, g) for _ in range(count)])


def cosine_ratio_cdf(x: float, lo: float = 0.0, hi: float = 1.0) -> float:
    """P(cos(pi/2 u) < x) for u uniform on [2/pi acos(hi), 2/pi acos(lo)]."""
    x = min(max(x, lo), hi)
    return (math.acos(lo) - math.acos(x)) / (math.acos(lo) - math.acos(hi))


def neighbour_share(mask: torch.Tensor, grid: int) -> torch.Tensor:
    """(B,) masked-masked 4-neighbour pairs per masked patch: about 1 for scattered masks, near 2 for blocks."""
    m = mask.view(-1, grid, grid).float()
    pairs = (m[:, :, 1:] * m[:, :, :-1]).sum((1, 2)) + (m[:, 1:] * m[:, :-1]).sum((1, 2))
    return pairs / m.sum((1, 2))


@pytest.mark.parametrize("range_", [None, (0.25, 0.75)])
def test_the_cosine_schedule_draws_maskgits_ratio_distribution(range_):
    over = ["mask.ratio_schedule=cosine"] + ([f"mask.ratio_range=[{range_[0]}, {range_[1]}]"] if range_ else [])
    cfg = mask_cfg(*over)
    n = cfg.data.num_patches  # 256
    m = draws(cfg, 20000)
    lo, hi = range_ or (0.0, 1.0)
    assert m.min() >= num_masked(n, lo) and m.max() <= num_masked(n, hi)
    # M = round(ratio * N) clamped to [1, N - 1], so P(M <= k) = P(ratio < (k + 0.5) / N) for k < N - 1
    ks = torch.arange(1, n - 1)
    ecdf = (m.unsqueeze(1) <= ks).double().mean(0)
    cdf = torch.tensor([cosine_ratio_cdf((k + 0.5) / n, lo, hi) for k in ks.tolist()], dtype=torch.float64)
    assert math.sqrt(len(m)) * float((ecdf - cdf).abs().max()) < KS_001
    if range_ is None:  # E[cos(pi/2 u)] = 2/pi: most batches hide more than half
        assert abs(float(m.double().mean()) / n - 2 / math.pi) < 0.01


def test_the_uniform_schedule_draws_every_count_from_1_to_n_minus_1_equally():
    cfg = mask_cfg("mask.ratio_schedule=uniform", image_size=8)  # N = 16
    counts = torch.bincount(draws(cfg, 6000), minlength=16)
    assert counts[0] == 0 and counts[16:].sum() == 0 and (counts[1:16] > 0).all()
    expected = 6000 / 15
    assert float(((counts[1:16] - expected) ** 2 / expected).sum()) < CHI2_14_DF_0001


def test_the_fixed_schedule_and_old_configs_with_a_range_keep_todays_counts():
    assert set(draws(mask_cfg("mask.ratio=0.3"), 50).tolist()) == {num_masked(256, 0.3)}
    old = mask_cfg("mask.ratio_range=[0.25, 0.75]")  # written before ratio_schedule: uniform over the range
    assert old.mask.ratio_schedule == "uniform"
    m = draws(old, 2000)
    assert m.min() == 64 and m.max() == 192 and len(set(m.tolist())) > 100


def test_mixed_masks_hold_both_kinds_at_about_the_block_share():
    cfg = mask_cfg("mask.strategy=mixed", "mask.block_share=0.3")
    g = torch.Generator().manual_seed(0)
    ids, mask = mixed_mask(cfg.mask, 400, 16, 128, g)
    assert (mask.sum(1) == 128).all() and mask.gather(1, ids).all()
    blocky = neighbour_share(mask, 16) > 1.35
    assert abs(float(blocky.double().mean()) - 0.3) < 3 * math.sqrt(0.3 * 0.7 / 400)
    # the classifier is sound: all-random and all-block batches fall on either side of 1.35
    for share, want in ((0.0, False), (1.0, True)):
        c = mask_cfg("mask.strategy=mixed", f"mask.block_share={share}")
        _, only = mixed_mask(c.mask, 100, 16, 128, torch.Generator().manual_seed(1))
        assert ((neighbour_share(only, 16) > 1.35) == want).all()


def test_the_sampler_resumes_scheduled_mixed_masks_exactly():
    cfg = mask_cfg("mask.strategy=mixed", "mask.ratio_schedule=cosine", "mask.block_min_patches=4", image_size=16)
    images = torch.randint(0, 2, (50, 16, 16), dtype=torch.uint8)
    sampler = BatchSampler(images, cfg)
    sampler.sample()
    state = copy.deepcopy(sampler.state_dict())
    ahead = [sampler.sample() for _ in range(4)]
    assert len({b.ids.shape[1] for b in ahead}) > 1  # M changes from batch to batch
    resumed = BatchSampler(images, cfg)
    resumed.load_state_dict(state)
    for a in ahead:
        b = resumed.sample()
        assert torch.equal(a.mask, b.mask) and torch.equal(a.ids, b.ids) and torch.equal(a.targets, b.targets)


def test_validation_of_mixed_runs_uses_random_masks_and_eval_can_ask_for_blocks_or_the_centre_box():
    cfg = mask_cfg("mask.strategy=mixed", "mask.block_share=1.0")
    images = torch.randint(0, 2, (64, 32, 32), dtype=torch.uint8)
    default = torch.cat([b.mask for b in eval_batches(images, cfg, 0.5, 0, 32)])
    assert (neighbour_share(default, 16) < 1.35).all()  # scattered, though training would draw only blocks
    blocks = torch.cat([b.mask for b in eval_batches(images, cfg, 0.5, 0, 32, "block")])
    assert (neighbour_share(blocks, 16) > 1.35).all()
    box = torch.zeros(16, 16, dtype=torch.bool)
    box[4:12, 4:12] = True  # the centre 8x8 patches of the 16x16 grid: the centre 16x16 pixels of 32x32
    centre = list(eval_batches(images, cfg, 0.9, 0, 32, "centre"))
    assert all(torch.equal(b.mask, box.flatten().expand(len(b.mask), -1)) for b in centre)
    assert torch.equal(centre[0].ids[0], box.flatten().nonzero().flatten())
    # a box that cannot sit exactly in the middle grows by one: 3x3 of 5x5, 8x8 of 14x14 (rows and columns 3..10)
    assert centre_box_mask(5).view(5, 5).nonzero().tolist() == [[r, c] for r in (1, 2, 3) for c in (1, 2, 3)]
    assert centre_box_mask(14).view(14, 14).nonzero().tolist() == [[r, c] for r in range(3, 11) for c in range(3, 11)]
    assert centre_box_mask(16).view(16, 16).nonzero().tolist() == [[r, c] for r in range(4, 12) for c in range(4, 12)]


@pytest.mark.parametrize(
    "override,needle",
    [
        (["mask.ratio_schedule=linear"], "mask.ratio_schedule must be one of fixed, uniform, cosine"),
        (["mask.ratio_schedule=fixed", "mask.ratio_range=[0.2, 0.8]"], "but mask.ratio_schedule is fixed"),
        (["mask.block_share=1.5"], "mask.block_share must be in [0, 1]"),
        (["mask.strategy=centre"], "mask.strategy must be one of random, block, mixed"),
    ],
)
def test_bad_schedule_keys_are_rejected(override, needle):
    with pytest.raises(UserError) as e:
        config_from_dict({}, override)
    assert needle in str(e.value)


def test_a_checkpoint_config_from_before_the_new_keys_loads_with_todays_behaviour():
    old = {**TINY, "mask": {"strategy": "random", "ratio": 0.4, "ratio_range": None, "fill": 0.5}}
    cfg = config_from_dict(old)
    assert (cfg.mask.ratio_schedule, cfg.mask.strategy, cfg.mask.ratio_range) == ("fixed", "random", None)


def test_the_training_log_counts_the_masked_patches_each_batch_really_had():
    cfg = mask_cfg("mask.ratio_schedule=uniform", "train.max_steps=3", "train.log_every=3", image_size=16)
    logger = RecordingLogger()
    splits = {k: torch.randint(0, 2, (40, 16, 16), dtype=torch.uint8) for k in ("train", "val", "test")}
    trainer = Trainer(cfg, splits, torch.device("cpu"), logger=logger)
    hits, masked, step = [], [], trainer.train_step

    def recording_step(batch):  # the predictions the step makes, from the weights before it
        with torch.no_grad():
            pred = copy.deepcopy(trainer.model)(batch.patches, batch.mask, batch.ids).argmax(-1)
        targets = batch.targets.gather(1, batch.ids)
        hits.append(int((pred == targets).sum()))
        masked.append(targets.numel())
        return step(batch)

    trainer.train_step = recording_step
    trainer.fit(progress=False)
    assert len(set(masked)) > 1  # the batches hid different counts
    train_rows = [m for _, m in logger.rows if "train/acc" in m]
    assert train_rows[0]["train/acc"] == pytest.approx(sum(hits) / sum(masked))


@pytest.mark.parametrize("schedule", ["uniform", "cosine"])
def test_validation_hides_mask_ratio_while_training_draws_from_the_schedule(schedule):
    cfg = mask_cfg(
        f"mask.ratio_schedule={schedule}",
        "mask.ratio=0.25",
        "train.max_steps=4",
        "train.eval_every=2",
        "train.log_every=2",
        image_size=16,
    )
    splits = {k: torch.randint(0, 2, (40, 16, 16), dtype=torch.uint8) for k in ("train", "val", "test")}
    trainer = Trainer(cfg, splits, torch.device("cpu"))
    counts = {True: [], False: []}  # training mode -> the masked count of every image the model was shown

    def record(module, args):
        counts[module.training] += args[1].sum(1).tolist()  # args: patches (B, N, P), mask (B, N), ...

    trainer.model.register_forward_pre_hook(record)
    trainer.fit(progress=False)
    assert len(set(counts[True])) > 1  # training drew several counts from the schedule
    # validation (at steps 2 and 4: 40 val images each) and its reconstruction grid (8 images each):
    # round(0.25 * 64) = 16 masked patches, every image, every time
    assert counts[False] == [16] * (2 * (40 + 8))
    assert trainer.evaluate()["masked_patches"] == 40 * 16
