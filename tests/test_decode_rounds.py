"""decode_masked's per-round hook (`on_round`), which vitmask demo animates: it sees every round of a fill
as it ends, its last round is the fill decode_masked returns, and watching changes nothing.

Expectations come from outside the hook: the returned classes of a run without it, the cosine schedule
counted by hand (unmask_counts' formula written out), and the model's own softmax on the round's input."""

import math

import pytest
import torch

from tests.conftest import TINY
from vitmask.config import config_from_dict
from vitmask.data.patches import patches_to_classes, patchify
from vitmask.generate.inpaint import fill_image
from vitmask.generate.sampling import DecodeOptions, decode_masked, sample_from_seed
from vitmask.model.vit import build_model

pytestmark = pytest.mark.usefixtures("one_thread")
N = (TINY["data"]["image_size"] // 2) ** 2  # 64 patches of 2x2 on a 16x16 image


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(config_from_dict(TINY)).eval()


def images_and_mask(rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    images = (torch.rand(rows, 16, 16, generator=g) < 0.3).to(torch.uint8)  # (B, 16, 16)
    mask = torch.rand(rows, N, generator=g) < torch.tensor([[0.2], [0.5], [0.9]])[:rows]  # (B, N), counts differ
    return images, mask


def cosine_counts(m: int, steps: int) -> list[int]:
    """Patches fixed per round: after round t of T, floor(M cos(pi/2 t/T)) stay hidden, or one fewer than
    after the round before where the cosine would fix none (the module's formula)."""
    left = [m]
    for t in range(1, steps):
        left.append(min(math.floor(m * math.cos(math.pi / 2 * t / steps)), left[-1] - 1))
    left.append(0)
    return [left[t] - left[t + 1] for t in range(steps)]


@pytest.mark.parametrize(
    "options",
    [
        DecodeOptions(steps=6, temperature=1.0, order="random"),
        DecodeOptions(steps=6, temperature=0.7, order="confidence", choice_temperature=4.5),
        DecodeOptions(steps=1),
    ],
)
def test_the_last_round_is_the_fill_and_watching_draws_nothing(model, options):
    images, mask = images_and_mask()
    plain = decode_masked(model, images, mask, 2, options, torch.Generator().manual_seed(7))  # (B, N)
    seen = []
    watched = decode_masked(model, images, mask, 2, options, torch.Generator().manual_seed(7), seen.append)
    assert torch.equal(watched, plain)
    assert torch.equal(seen[-1].classes, plain)
    assert not seen[-1].hidden.any()
    picked = torch.stack([r.picked for r in seen])  # (T, B, N)
    assert torch.equal(picked.sum(0), mask.long())  # every hidden patch is fixed exactly once, no visible one
    for row in range(len(mask)):
        m = int(mask[row].sum())
        expected = cosine_counts(m, min(options.steps, m))
        assert picked[:, row].sum(1).tolist()[: len(expected)] == expected
        assert min(expected) >= 1 and picked[len(expected) :, row].sum() == 0  # min(steps, M) rounds, then none
    for before, r in zip([mask] + [s.hidden for s in seen[:-1]], seen, strict=True):
        assert torch.equal(r.hidden, before & ~r.picked)  # what a round fixed leaves the hidden set
        assert torch.isnan(r.probability[~before]).all()  # no probability for a patch visible as it began
        assert ((r.probability[before] > 0) & (r.probability[before] <= 1)).all()
    assert [r.index for r in seen] == list(range(len(seen)))
    assert {r.rounds for r in seen} == {len(seen)}


def test_a_rounds_probability_is_the_models_softmax_of_the_class_it_gave(model):
    images, mask = images_and_mask()
    seen = []
    decode_masked(model, images, mask, 2, DecodeOptions(steps=4), None, seen.append)
    first = seen[0]
    with torch.no_grad():
        probs = model(patchify(images, 2).float(), mask).softmax(-1)  # (B, N, C) what the first round saw
    best, best_class = probs.max(-1)  # temperature 0: each hidden patch takes its likeliest class
    torch.testing.assert_close(first.probability[mask], best[mask])
    assert torch.equal(first.classes[first.picked], best_class[first.picked])
    visible = patches_to_classes(patchify(images, 2))
    assert torch.equal(first.classes[~mask], visible[~mask])  # visible patches keep their input's class


def test_fill_image_and_sample_from_seed_pass_the_hook_on(model):
    images, mask = images_and_mask(1)
    seen = []
    options = DecodeOptions(steps=5, temperature=1.0)
    filled = fill_image(model, images[0], mask[0], 2, options, seed=3, samples=2, on_round=seen.append)  # (2, S, S)
    assert seen and seen[-1].classes.shape == (2, N)
    assert torch.equal(patches_to_classes(patchify(filled, 2)), seen[-1].classes)
    seen.clear()
    drawn = sample_from_seed(model, 2, 16, 2, DecodeOptions(steps=4, temperature=1.0), 5, on_round=seen.append)
    assert len(seen) == 4 and seen[0].picked.sum(1).tolist() == [cosine_counts(N, 4)[0]] * 2
    assert torch.equal(patches_to_classes(patchify(drawn, 2)), seen[-1].classes)


@pytest.mark.parametrize("steps", [16, 40, 64, 100])
def test_each_of_min_steps_hidden_rounds_fixes_a_patch_and_one_a_round_when_steps_reach_the_count(model, steps):
    images, mask = images_and_mask()
    counts = mask.sum(1).tolist()  # the rows' hidden counts, by the mask itself
    seen = []
    decode_masked(model, images, mask, 2, DecodeOptions(steps=steps, temperature=1.0, order="random"),
                  torch.Generator().manual_seed(2), seen.append)  # fmt: skip
    assert len(seen) == min(steps, max(counts))  # the hook sees every round that runs, and no other
    per_round = torch.stack([r.picked.sum(1) for r in seen])  # (T, B)
    for row, m in enumerate(counts):
        rounds = min(steps, m)
        assert (per_round[:rounds, row] >= 1).all() and (per_round[rounds:, row] == 0).all()
        assert int(per_round[:, row].sum()) == m
        if steps >= m:
            assert per_round[:m, row].tolist() == [1] * m  # one patch a round: random-order (ARDM) sampling
