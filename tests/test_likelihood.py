"""The NLL bound and its baselines, against computations written here: every order's chain rule on a
tiny model with N = 4 patches, a model whose conditionals come from one joint (the bound is then
exact), and the Bernoulli baseline counted by hand."""

import itertools
import math

import pytest
import torch

from tests.test_sampling import ExactJoint, a_joint, tiny_vit
from vitmask.data.patches import patches_to_classes, patchify
from vitmask.errors import UserError
from vitmask.evaluate.exact_nll import order_nll
from vitmask.evaluate.likelihood import (
    bernoulli_nll,
    check_nll_args,
    enumerated_bound,
    nll_bound,
    nll_report,
    strata_edges,
)


def four_patch_model():
    """A randomly initialised tiny transformer on 4x4 images of 2x2 patches: N = 4, C = 16."""
    model, _ = tiny_vit(image_size=4)
    with torch.no_grad():  # larger weights than the init, so the conditionals depend on what is visible
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    return model


def images4(n: int, seed: int = 0) -> torch.Tensor:
    return (torch.rand(n, 4, 4, generator=torch.Generator().manual_seed(seed)) < 0.4).to(torch.uint8)


def chain_rule_nll(model, images, order) -> torch.Tensor:
    """-log p_order(x): reveal the patches one by one in `order`, summing -log p(next | revealed)."""
    pix = patchify(images, 2).float()
    truth = patches_to_classes(pix)
    hidden = torch.ones(len(images), 4, dtype=torch.bool)
    total = torch.zeros(len(images), dtype=torch.float64)
    with torch.no_grad():
        for i in order:
            logp = torch.log_softmax(model(pix, hidden).double(), -1)  # (n, 4, 16)
            total -= logp[torch.arange(len(images)), i, truth[:, i]]
            hidden[:, i] = False
    return total


def test_enumerated_bound_is_the_mean_exact_nll_over_all_24_orders():
    model, images = four_patch_model(), images4(5)
    per_order = torch.stack([chain_rule_nll(model, images, order) for order in itertools.permutations(range(4))])
    assert per_order.std(0).min() > 0.1  # the orders really disagree: the conditionals are not one joint's
    assert torch.allclose(enumerated_bound(model, images, 2), per_order.mean(0), rtol=0, atol=1e-4)
    for order in [(0, 1, 2, 3), (3, 1, 0, 2)]:
        assert torch.allclose(order_nll(model, images, 2, torch.tensor(order)), chain_rule_nll(model, images, order),
                              rtol=0, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("decoder", ["self", "cross"])
def test_the_bound_of_an_encoder_decoder_model_is_the_mean_over_orders_too(decoder):
    # the hidden sets of one call hide different counts; the decoder needs them grouped by count
    model, _ = tiny_vit("learned", "learned", image_size=4, decoder=decoder)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    images = images4(3, seed=1)
    per_order = torch.stack([chain_rule_nll(model, images, order) for order in itertools.permutations(range(4))])
    assert torch.allclose(enumerated_bound(model, images, 2), per_order.mean(0), rtol=0, atol=1e-4)


def test_the_bound_is_exact_when_the_conditionals_are_one_joints():
    joint = a_joint()
    images = torch.tensor(list(itertools.product([0, 1], repeat=4)), dtype=torch.uint8).view(16, 2, 2)  # every image
    exact = -joint.double().log()
    model = ExactJoint(joint)
    assert torch.allclose(enumerated_bound(model, images, 1), exact, atol=1e-5)
    assert torch.allclose(order_nll(model, images, 1, torch.tensor([2, 0, 3, 1])), exact, atol=1e-5)


@pytest.mark.parametrize("strata", [4, 3, 1])
def test_the_stratified_estimate_is_unbiased_within_its_standard_error(strata):
    model, images = four_patch_model(), images4(3, seed=1)
    exact = enumerated_bound(model, images, 2)
    est = nll_bound(model, images, 2, strata=strata, samples=300, seed=0)
    z = (est["per_image"] - exact) / est["variance"].sqrt()
    assert z.abs().max() < 4, z


def test_the_reported_standard_error_matches_the_spread_over_seeds():
    model, images = four_patch_model(), images4(4, seed=2)
    runs = [nll_report(model, images, images, 2, strata=2, samples=2, seed=s) for s in range(40)]
    spread = torch.tensor([r["nats"] for r in runs]).std()
    mean_se = sum(r["se_mc"] for r in runs) / len(runs)
    assert 0.6 < float(spread) / mean_se < 1.5, (float(spread), mean_se)


def test_the_estimate_is_deterministic_by_seed():
    model, images = four_patch_model(), images4(3)
    a = nll_bound(model, images, 2, strata=4, samples=2, seed=7)["per_image"]
    assert torch.equal(a, nll_bound(model, images, 2, strata=4, samples=2, seed=7)["per_image"])
    assert not torch.equal(a, nll_bound(model, images, 2, strata=4, samples=2, seed=8)["per_image"])


def test_strata_split_the_hidden_counts_into_near_equal_runs():
    assert strata_edges(256, 16) == list(range(0, 257, 16))
    assert strata_edges(10, 4) == [0, 2, 5, 8, 10]  # counts 1-2, 3-5, 6-8, 9-10
    assert strata_edges(4, 4) == [0, 1, 2, 3, 4]


def test_bernoulli_baseline_against_a_hand_count():
    train = torch.tensor([[[1, 0]], [[1, 1]], [[0, 0]]], dtype=torch.uint8)  # 3 images of 1x2 pixels
    # ones per position: 2 and 1; add-one smoothing: p = (2 + 1) / (3 + 2) = 0.6 and (1 + 1) / 5 = 0.4
    test = torch.tensor([[[1, 0]], [[0, 1]]], dtype=torch.uint8)
    want = [-math.log(0.6) - math.log(0.6), -math.log(0.4) - math.log(0.4)]
    assert torch.allclose(bernoulli_nll(train, test), torch.tensor(want, dtype=torch.float64))
    padding = torch.zeros(3, 1, 2, dtype=torch.uint8)  # a pixel never on costs -log(1 - 1/5), never log 0
    assert torch.allclose(bernoulli_nll(padding, padding[:1]), torch.tensor([-2 * math.log(0.8)], dtype=torch.float64))


def test_report_units_baselines_and_strata():
    model, images = four_patch_model(), images4(6)
    train = images4(20, seed=3)
    r = nll_report(model, train, images, 2, strata=3, samples=2, seed=0)
    assert r["pixels"] == 16 and r["images"] == 6 and len(r["per_image"]) == 6
    assert r["nats"] == pytest.approx(sum(r["per_image"]) / 6)
    assert r["bits_per_pixel"] == pytest.approx(r["nats"] / (16 * math.log(2)))
    assert r["baselines"]["one_bit"]["nats"] == pytest.approx(16 * math.log(2))
    assert r["baselines"]["bernoulli"]["nats"] == pytest.approx(float(bernoulli_nll(train, images).mean()))
    assert [(s["m_from"], s["m_to"]) for s in r["by_stratum"]] == [(1, 1), (2, 3), (4, 4)]  # edges 0, 1, 3, 4


@pytest.mark.parametrize(
    "args,needle",
    [
        ((256, 2**25, 16, 2), "patches of 25 pixels"),
        ((256, 16, 0, 2), "--nll-strata must be between 1 and the 256 patches"),
        ((64, 16, 65, 2), "--nll-strata must be between 1 and the 64 patches"),
        ((256, 16, 16, 1), "--nll-samples must be at least 2"),
    ],
)
def test_what_the_estimator_cannot_do_is_refused(args, needle):
    with pytest.raises(UserError, match=needle):
        check_nll_args(*args)


def test_enumeration_is_refused_beyond_sixteen_patches():
    model, _ = tiny_vit(image_size=10)
    with pytest.raises(UserError, match="at most 16 patches, got 25"):
        enumerated_bound(model, torch.zeros(1, 10, 10, dtype=torch.uint8), 2)
