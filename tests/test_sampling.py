"""Sampling: temperature, seeds, the confidence and random orders, MaskGIT's choice noise, generating
from a fully masked canvas; each checked against a distribution computed independently.

Chi-square critical values (upper 0.001 tail, from the standard table): 15 degrees of freedom 37.70.
With fixed seeds every test is deterministic; the thresholds say how unlikely a pass would be by chance.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY
from vitmask.config import config_from_dict
from vitmask.data.masking import random_mask
from vitmask.data.patches import patches_to_classes, patchify, unpatchify
from vitmask.errors import UserError
from vitmask.generate.sampling import DecodeOptions, decode_masked, sample_images, unmask_counts, unmask_schedule
from vitmask.model.vit import build_model, predict_every_patch

CHI2_15_DF_0001 = 37.70


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


class FixedLogits(torch.nn.Module):
    """The same logits for every patch, whatever is visible."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, patches, mask, ids=None):
        b, n, _ = patches.shape
        return self.logits.expand(b, n, -1)


class CountVisible(torch.nn.Module):
    """Predicts class (number of visible patches) for every patch, with weight `weights[i]` on patch
    i's logit (so its confidence); the class a patch gets shows when it was decoded."""

    def __init__(self, weights: torch.Tensor):
        super().__init__()
        self.weights = weights

    def forward(self, patches, mask, ids=None):
        b, n, _ = patches.shape
        visible = (~mask).sum(1) % 16  # (B,)
        return F.one_hot(visible, 16).float().unsqueeze(1) * self.weights.view(1, n, 1)  # (B, N, 16)


class ExactJoint(torch.nn.Module):
    """The exact conditionals p(x_i | visible) of a joint distribution over 2x2 binary images with
    1x1 patches (N = 4, C = 2): every visible set gives the same joint, whatever the order."""

    def __init__(self, joint: torch.Tensor):
        super().__init__()
        self.joint = joint  # (16,) probabilities of the images, index = 8 x0 + 4 x1 + 2 x2 + x3
        self.configs = torch.tensor(list(itertools.product([0, 1], repeat=4)), dtype=torch.float32)  # (16, 4)

    def forward(self, patches, mask, ids=None):
        seen = patches[..., 0]  # (B, 4) pixel values (read only where visible)
        fits = ((self.configs.unsqueeze(0) == seen.unsqueeze(1)) | mask.unsqueeze(1)).all(-1)  # (B, 16)
        w = self.joint.unsqueeze(0) * fits  # (B, 16)
        p1 = (w @ self.configs) / w.sum(1, keepdim=True)  # (B, 4) p(x_i = 1 | visible)
        logits = torch.stack([(1 - p1), p1], -1).clamp_min(1e-12).log()  # (B, 4, 2)
        return logits if ids is None else logits.gather(1, ids.unsqueeze(-1).expand(-1, -1, 2))  # (B, M, 2)


def a_joint() -> torch.Tensor:
    """A fixed joint over the 16 images, far from independent pixels, every image likely enough to count."""
    w = torch.tensor([9.0, 1, 1, 3, 1, 4, 2, 1, 1, 2, 5, 1, 3, 1, 1, 8])
    return w / w.sum()


def tiny_vit(fill="learned", pos="learned", image_size=8, decoder="none"):
    cfg = config_from_dict(
        {**TINY, "data": {**TINY["data"], "image_size": image_size}},
        [
            f"mask.fill={fill}",
            f"model.pos={pos}",
            "model.num_heads=2",
            "model.hidden_dim=32",
            f"model.decoder={decoder}",
        ],
    )
    torch.manual_seed(0)
    return build_model(cfg).eval(), cfg


def test_temperature_zero_is_the_argmax_and_keeps_visible_patches():
    model, _ = tiny_vit()
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(6, 8, 8, generator=g) < 0.4).to(torch.uint8)
    _, mask = random_mask(6, 16, 9, g)
    truth = patches_to_classes(patchify(images, 2))
    out = decode_masked(model, images, mask, 2, DecodeOptions(steps=1, temperature=0.0))
    with torch.no_grad():
        argmax = model(patchify(images, 2).float(), mask).argmax(-1)  # (6, 16)
    assert torch.equal(out[mask], argmax[mask])
    assert torch.equal(out[~mask], truth[~mask])


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_classes_follow_the_softmax_at_the_temperature(temperature):
    logits = torch.linspace(-1.5, 1.5, 16)
    model = FixedLogits(logits)
    images = torch.zeros(2000, 4, 4, dtype=torch.uint8)  # 4 patches each: 8000 draws
    mask = torch.ones(2000, 4, dtype=torch.bool)
    g = torch.Generator().manual_seed(1)
    out = decode_masked(model, images, mask, 2, DecodeOptions(steps=1, temperature=temperature), g)
    counts = torch.bincount(out.flatten(), minlength=16)
    assert chi_square(counts, torch.softmax(logits / temperature, 0)) < CHI2_15_DF_0001
    other = torch.softmax(logits / (1.5 - temperature), 0)  # the other temperature: clearly rejected
    assert chi_square(counts, other) > 10 * CHI2_15_DF_0001


def test_random_order_draws_exactly_from_the_models_joint():
    # one patch per round, each drawn from its conditional in a random order: exact ancestral sampling
    joint = a_joint()
    g = torch.Generator().manual_seed(2)
    images = sample_images(ExactJoint(joint), 8000, 2, 1, DecodeOptions(steps=4, temperature=1.0, order="random"), g)
    index = (images.flatten(1).long() * torch.tensor([8, 4, 2, 1])).sum(1)
    assert chi_square(torch.bincount(index, minlength=16), joint) < CHI2_15_DF_0001
    # one round draws the four pixels independently from their marginals: not the joint, and the test sees it
    images = sample_images(ExactJoint(joint), 8000, 2, 1, DecodeOptions(steps=1, temperature=1.0), g)
    index = (images.flatten(1).long() * torch.tensor([8, 4, 2, 1])).sum(1)
    assert chi_square(torch.bincount(index, minlength=16), joint) > 10 * CHI2_15_DF_0001


def test_a_fixed_seed_repeats_and_another_seed_differs():
    model, _ = tiny_vit()
    opts = DecodeOptions(steps=4, temperature=1.0, order="confidence", choice_temperature=2.0)
    draw = lambda seed: sample_images(model, 8, 8, 2, opts, torch.Generator().manual_seed(seed))  # noqa: E731
    first = draw(5)
    assert first.shape == (8, 8, 8) and first.dtype == torch.uint8 and set(first.unique().tolist()) <= {0, 1}
    assert torch.equal(first, draw(5))
    assert not torch.equal(first, draw(6))


def test_confidence_order_without_noise_decodes_the_most_confident_first():
    # CountVisible: class = visible count, patch 0 the most confident; 16 hidden, 4 rounds fix 2, 3, 5, 6
    # (floor(16 cos(pi/8)) = 14, floor(16 cos(pi/4)) = 11, floor(16 cos(3pi/8)) = 6 stay hidden)
    model = CountVisible(torch.arange(16, 0, -1).float())
    images = torch.zeros(3, 8, 8, dtype=torch.uint8)
    out = decode_masked(model, images, torch.ones(3, 16, dtype=torch.bool), 2, DecodeOptions(steps=4))
    want = [0] * 2 + [2] * 3 + [5] * 5 + [10] * 6
    assert out.tolist() == [want] * 3


def test_random_order_keeps_uniformly_random_patches():
    model = CountVisible(torch.arange(16, 0, -1).float())  # confidences would pick patches 0 and 1
    images = torch.zeros(4000, 8, 8, dtype=torch.uint8)
    g = torch.Generator().manual_seed(3)
    out = decode_masked(model, images, torch.ones(4000, 16, dtype=torch.bool), 2, DecodeOptions(4, 0.0, "random"), g)
    first = (out == 0).sum(0).double()  # (16,) times each patch was among the 2 of round one
    assert (out == 0).sum(1).eq(2).all()
    sd = math.sqrt(4000 * (2 / 16) * (14 / 16))
    assert ((first - 4000 * 2 / 16).abs() < 5 * sd).all(), first


def test_maskgit_choice_noise_is_gumbel_scaled_and_annealed():
    # Two hidden patches (1 and 2), two rounds of one patch each. Round one ranks them by log p + s G with
    # s = choice_temperature * (1 - 1/2); a difference of two Gumbels is logistic, so patch 1 goes first
    # with probability sigmoid((a1 - a2) / s), a_i = log p of its class = w_i - log(e^w_i + 15).
    w = torch.tensor([0.0, 3.0, 1.0, 0.0])
    model = CountVisible(w)
    images = torch.zeros(4000, 4, 4, dtype=torch.uint8)
    mask = torch.tensor([[False, True, True, False]]).expand(4000, -1)
    a = [float(w[i] - math.log(math.exp(w[i]) + 15)) for i in (1, 2)]
    for choice, seed in ((2.0, 4), (6.0, 5)):
        g = torch.Generator().manual_seed(seed)
        out = decode_masked(model, images, mask, 2, DecodeOptions(2, 0.0, "confidence", choice), g)
        first = (out[:, 1] == 2).double().mean()  # patch 1 was decoded with 2 patches visible: it went first
        p = 1 / (1 + math.exp(-(a[0] - a[1]) / (choice / 2)))
        assert abs(float(first) - p) < 4 * math.sqrt(p * (1 - p) / 4000), (choice, float(first), p)
    strict = decode_masked(model, images[:5], mask[:5], 2, DecodeOptions(2, 0.0, "confidence", 0.0))
    assert (strict[:, 1] == 2).all()  # no noise: the more confident patch 1 always first


def test_the_schedule_runs_per_row_and_matches_the_cosine_counts():
    # unmask_counts(5, 3) = [1, 2, 2]; (1, 1) = [1]; 0 hidden: nothing; (3, 3) = [1, 1, 1]
    table = unmask_schedule(torch.tensor([5, 1, 0, 3]), 3)
    assert table.tolist() == [[1, 1, 0, 1], [2, 0, 0, 1], [2, 0, 0, 1]]
    model = CountVisible(torch.arange(16, 0, -1).float())
    images = torch.zeros(2, 8, 8, dtype=torch.uint8)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[0, :5] = True
    mask[1, 10:13] = True
    out = decode_masked(model, images, mask, 2, DecodeOptions(steps=3))
    # row 0: 11 visible; fixes patch 0, then 1-2, then 3-4. Row 1: 13 visible; patches 10, 11, 12 one by one
    assert out[0, :5].tolist() == [11, 12, 12, 14, 14] and out[1, 10:13].tolist() == [13, 14, 15]
    assert (out[0, 5:] == 0).all() and (out[1, :10] == 0).all() and (out[1, 13:] == 0).all()


@pytest.mark.parametrize(
    "patches,steps,expected",
    [
        (16, 16, [1] * 16),  # as many steps as patches: one patch a round
        (4, 64, [1] * 4),  # more steps than patches: one round per patch, no empty round
        (1, 1, [1]),
        (10, 1, [10]),  # one step: every patch at once
        # 64 patches, 8 rounds: floor(64 cos(pi/2 t/8)) = 62 59 53 45 35 24 12 stay hidden, then 0
        (64, 8, [2, 3, 6, 8, 10, 11, 12, 12]),
        # 17 patches, 16 rounds: floor(17 cos(pi/2 t/16)) = 16 16 16 15 14 14 13 12 10 9 8 6 4 3 1 for
        # t = 1..15, never fewer than 17 - t until t = 15: 14 rounds of one (16 15 ... 3 left), then 1, then 0
        (17, 16, [1] * 14 + [2, 1]),
    ],
)
def test_every_round_fixes_a_patch_and_there_are_min_steps_patches_rounds(patches, steps, expected):
    assert unmask_counts(patches, steps) == expected


def test_196_patches_in_64_rounds_fix_one_a_round_while_the_cosine_is_flat_then_follow_it():
    # MNIST's 196 patches over `vitmask sample`'s default 64 steps. floor(196 cos(pi/2 t/64)) stays hidden
    # after round t by the cosine alone: 195 195 195 195 194 ... for t = 1..5, no fewer than 196 - t up to
    # t = 17 (179.19 -> 179 = 196 - 17), so those 17 rounds fix one each; from round 18 (177.18 -> 177) the
    # cosine's drop is more than one and the rounds fix what it drops.
    counts = unmask_counts(196, 64)
    assert len(counts) == 64 and sum(counts) == 196 and min(counts) >= 1
    assert counts[:17] == [1] * 17
    left = [math.floor(196 * math.cos(math.pi / 2 * t / 64)) for t in range(17, 64)] + [0]  # after rounds 17..64
    assert counts[17:] == [left[i] - left[i + 1] for i in range(47)]  # rounds 18..64
    assert counts[17] == 2 and counts[-1] == left[-2] == 4  # floor(196 cos(63 pi/128)) = 4 left for the last round


@pytest.mark.parametrize("patches", [1, 2, 5, 16, 64, 196, 256, 1024])
@pytest.mark.parametrize("steps", [1, 2, 3, 8, 16, 64, 196, 1000])
def test_the_schedule_always_runs_min_steps_patches_rounds_of_at_least_one(patches, steps):
    counts = unmask_counts(patches, steps)
    assert len(counts) == min(steps, patches) and sum(counts) == patches and min(counts) >= 1


def test_steps_of_at_least_the_hidden_count_decode_one_patch_a_round():
    # CountVisible: each patch's class is the count of visible patches when it was decoded, so one patch a
    # round gives every hidden patch a distinct class: 0, 1, ..., 15 (16 hidden), whatever the order
    model = CountVisible(torch.arange(16, 0, -1).float())
    images = torch.zeros(2, 8, 8, dtype=torch.uint8)
    for steps in (16, 40):
        seen = []
        out = decode_masked(model, images, torch.ones(2, 16, dtype=torch.bool), 2, DecodeOptions(steps=steps), None,
                            seen.append)  # fmt: skip
        assert out.tolist() == [list(range(16))] * 2  # confidence order: patch 0 first
        assert len(seen) == 16 and all(r.picked.sum(1).tolist() == [1, 1] for r in seen)


@pytest.mark.parametrize("fill,pos", [("learned", "rope2d"), ("0.5", "learned"), ("0.5", "sincos2d")])
def test_a_fully_masked_canvas_gives_finite_logits_and_a_whole_image(fill, pos):
    model, _ = tiny_vit(fill, pos)
    pix = torch.rand(3, 16, 4)
    logits = model(pix, torch.ones(3, 16, dtype=torch.bool))  # every patch masked: M = N
    assert logits.shape == (3, 16, 16) and torch.isfinite(logits).all()
    g = torch.Generator().manual_seed(0)
    images = sample_images(model, 5, 8, 2, DecodeOptions(steps=16, temperature=1.0, order="random"), g)
    assert images.shape == (5, 8, 8) and set(images.unique().tolist()) <= {0, 1}


@pytest.mark.parametrize("decoder", ["self", "cross"])
def test_an_encoder_decoder_model_gets_rows_of_different_hidden_counts_right(decoder):
    # the decoder gathers each row's visible patches densely, so one call needs one count per row:
    # the result must equal calling the model on each row alone (counts 3, 9, 0 and 3)
    model, _ = tiny_vit("learned", "rope2d", decoder=decoder)
    pix = (torch.rand(4, 16, 4, generator=torch.Generator().manual_seed(1)) < 0.4).float()
    mask = torch.zeros(4, 16, dtype=torch.bool)
    mask[0, :3], mask[1, 4:13], mask[3, [1, 7, 15]] = True, True, True
    with torch.no_grad():
        one_by_one = torch.cat([model(pix[i : i + 1], mask[i : i + 1]) for i in range(4)])  # (4, 16, 16)
        assert not torch.allclose(model(pix, mask)[1], one_by_one[1], atol=1e-3)  # one call alone gets row 1 wrong
    assert torch.allclose(predict_every_patch(model, pix, mask), one_by_one, atol=1e-5)
    images = unpatchify(pix.to(torch.uint8), 2)  # (4, 8, 8)
    out = decode_masked(model, images, mask, 2, DecodeOptions(steps=3))
    assert torch.equal(out[~mask], patches_to_classes(pix)[~mask])  # visible patches kept, every row decoded


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"steps": 0}, "--steps must be at least 1"),
        ({"temperature": -0.5}, "--temperature must be >= 0"),
        ({"temperature": float("nan")}, "--temperature must be >= 0"),
        ({"order": "sorted"}, "--order must be one of confidence, random"),
        ({"choice_temperature": -1.0}, "--choice-temperature must be >= 0"),
    ],
)
def test_bad_decoding_options_are_refused(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        DecodeOptions(**kwargs)
