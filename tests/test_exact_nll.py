"""Exact NLLs of fixed orders and of mixtures of orders (evaluate/exact_nll.py), against computations
written here: every image of a tiny size enumerated with each conditional read from a table of the
model's outputs per visible prefix (the probabilities then sum to 1), the chain rule written out one
step at a time, the bound as the mean over random orders, orders listed by hand, and `vitmask eval
--nll` end to end."""

import json
import math
import statistics

import pytest
import torch

from tests.conftest import TINY, assert_user_error, train_tiny
from tests.test_stop_latency import run_until_stopped
from vitmask.config import config_from_dict
from vitmask.data.patches import patches_to_classes, patchify
from vitmask.evaluate.exact_nll import (
    ORDERS,
    SYMMETRIES,
    chain_nll,
    exact_nll_report,
    mixture_nll,
    named_order,
    order_nll,
    symmetric_orders,
)
from vitmask.evaluate.likelihood import enumerated_bound, nll_report
from vitmask.model.vit import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(image_size: int, patch_size: int, decoder: str = "none", seed: int = 0):
    """A randomly initialised tiny transformer, its weights enlarged so that the conditionals depend
    on what is visible (a fresh init predicts nearly the same whatever it sees)."""
    data = {**TINY["data"], "image_size": image_size, "patch_size": patch_size}
    cfg = config_from_dict(
        {**TINY, "data": data}, ["mask.fill=learned", "model.pos=learned", f"model.decoder={decoder}"]
    )
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + seed)) * 0.5)
    return model


def random_images(n: int, size: int, seed: int = 0) -> torch.Tensor:
    return (torch.rand(n, size, size, generator=torch.Generator().manual_seed(seed)) < 0.4).to(torch.uint8)


# ---- the written-out computations -----------------------------------------------------------------
def class_bits(classes: torch.Tensor, pixels: int) -> torch.Tensor:
    """(..., N) patch classes -> (..., N, P) pixels: class 8a + 4b + 2c + d is the patch [[a, b], [c, d]]."""
    return (classes.unsqueeze(-1) >> torch.arange(pixels - 1, -1, -1)) & 1


def every_image(grid: int, patch_size: int) -> torch.Tensor:
    """Every binary image of grid x grid patches, (C^N, H, W); image number sum_j class_j C^(N-1-j)."""
    n, pixels = grid * grid, patch_size**2
    c = 2**pixels
    number = torch.arange(c**n)
    classes = (number.unsqueeze(1) // c ** torch.arange(n - 1, -1, -1)) % c  # (C^N, N) patch 0 first
    bits = class_bits(classes, pixels)  # (C^N, N, P)
    blocks = bits.view(-1, grid, grid, patch_size, patch_size).permute(0, 1, 3, 2, 4)  # (C^N, g, p, g, p)
    return blocks.reshape(-1, grid * patch_size, grid * patch_size).to(torch.uint8)


def enumerated_chain(model, order: list[int], grid: int, patch_size: int) -> torch.Tensor:
    """p_order(x) of every image (numbered as `every_image`), (C^N,) float64, from a table of the
    model's conditionals: at step t, one forward pass per assignment of classes to the t patches
    order[:t], read at patch order[t]. Hidden patches hold ones, which the model must not read."""
    n, pixels = grid * grid, patch_size**2
    c = 2**pixels
    probs = torch.ones(1, dtype=torch.float64)  # over the classes of order[:t], order[0] most significant
    for t, target in enumerate(order):
        prefix = (torch.arange(c**t).unsqueeze(1) // c ** torch.arange(t - 1, -1, -1)) % c  # (C^t, t)
        patches = torch.ones(c**t, n, pixels)  # (C^t, N, P)
        hidden = torch.ones(c**t, n, dtype=torch.bool)
        for s, patch in enumerate(order[:t]):
            patches[:, patch] = class_bits(prefix[:, s], pixels).float()
            hidden[:, patch] = False
        with torch.no_grad():
            p = torch.softmax(model(patches, hidden)[:, target].double(), -1)  # (C^t, C)
        probs = (probs.unsqueeze(1) * p).flatten()  # (C^(t+1),)
    rank = [order.index(j) for j in range(n)]  # dimension s of the table is patch order[s]
    return probs.view([c] * n).permute(rank).flatten()  # (C^N,) indexed by patch 0's class first


def written_chain_nll(model, images, patch_size: int, order: list[int]) -> torch.Tensor:
    """-log p_order(x): reveal the patches one by one in `order`, each step a forward pass over
    every patch (no ids), summing -log p(next | revealed) in float64."""
    pix = patchify(images, patch_size).float()
    truth = patches_to_classes(pix)
    n = len(images)
    hidden = torch.ones(pix.shape[:2], dtype=torch.bool)
    total = torch.zeros(n, dtype=torch.float64)
    with torch.no_grad():
        for i in order:
            logp = torch.log_softmax(model(pix, hidden).double(), -1)  # (n, N, C)
            total -= logp[torch.arange(n), i, truth[:, i]]
            hidden[:, i] = False
    return total


# ---- the orders -----------------------------------------------------------------------------------
def test_the_named_orders_of_a_3x3_and_a_4x4_grid_as_listed_by_hand():
    # 0 1 2
    # 3 4 5
    # 6 7 8
    want = {
        "raster": [0, 1, 2, 3, 4, 5, 6, 7, 8],
        "raster-reverse": [8, 7, 6, 5, 4, 3, 2, 1, 0],
        "column": [0, 3, 6, 1, 4, 7, 2, 5, 8],
        "column-reverse": [8, 5, 2, 7, 4, 1, 6, 3, 0],
        "spiral-in": [0, 1, 2, 5, 8, 7, 6, 3, 4],
        "spiral-out": [4, 3, 6, 7, 8, 5, 2, 1, 0],
    }
    assert {name: named_order(name, 3).tolist() for name in ORDERS} == want
    assert named_order("spiral-in", 4).tolist() == [0, 1, 2, 3, 7, 11, 15, 14, 13, 12, 8, 4, 5, 6, 10, 9]


def test_the_eight_orders_of_the_mixture_are_the_grids_symmetries_applied_to_the_order():
    raster_images = [
        [0, 1, 2, 3, 4, 5, 6, 7, 8],  # identity
        [8, 7, 6, 5, 4, 3, 2, 1, 0],  # rot180: from the bottom-right corner, right to left
        [0, 3, 6, 1, 4, 7, 2, 5, 8],  # transpose: column-major
        [8, 5, 2, 7, 4, 1, 6, 3, 0],  # anti-transpose: column-major from the bottom-right, upwards
        [2, 1, 0, 5, 4, 3, 8, 7, 6],  # mirror: rows, each right to left
        [6, 7, 8, 3, 4, 5, 0, 1, 2],  # flip: rows bottom to top
        [2, 5, 8, 1, 4, 7, 0, 3, 6],  # rot90: down the columns, right to left
        [6, 3, 0, 7, 4, 1, 8, 5, 2],  # rot270: up the columns, left to right
    ]
    assert symmetric_orders(named_order("raster", 3), 3, 8).tolist() == raster_images
    # a quarter turn clockwise of the spiral in from the top-left: the spiral in from the top-right
    spiral = symmetric_orders(named_order("spiral-in", 3), 3, 8)
    assert spiral[6].tolist() == [2, 5, 8, 7, 6, 3, 0, 1, 4]
    assert spiral[2].tolist() == [0, 3, 6, 7, 8, 5, 2, 1, 4]  # transposed: down first, anticlockwise
    assert len({tuple(o) for o in spiral.tolist()}) == 8 and SYMMETRIES[0] == "identity"


# ---- exact: every image enumerated ----------------------------------------------------------------
def test_the_fixed_order_nll_of_every_4x4_image_is_minus_log_its_enumerated_probability_and_they_sum_to_1():
    """2x2 patches on a 2x2 grid: N = 4, C = 16, all 65,536 images, one order whose inverse differs from it."""
    model = tiny_model(4, 2)
    order = [1, 3, 0, 2]  # its inverse, the step of each patch, is [2, 0, 3, 1]
    want = enumerated_chain(model, order, 2, 2)  # (65536,)
    got = chain_nll(model, every_image(2, 2), 2, torch.tensor([order]), batch_size=4096)[:, 0]
    assert float(torch.exp(-got).sum()) == pytest.approx(1.0, abs=1e-4)
    assert float(want.sum()) == pytest.approx(1.0, abs=1e-9)
    assert want.min() > 0  # every image has a log probability to compare
    assert torch.allclose(got, -want.log(), rtol=0, atol=2e-4)


@pytest.mark.parametrize("decoder", ["none", "self", "cross"])
def test_each_of_8_chains_and_their_mixture_give_every_3x3_image_its_enumerated_probability(decoder):
    """1x1 patches on a 3x3 grid: N = 9, C = 2, all 512 images, the 8 symmetries of the spiral out."""
    model = tiny_model(3, 1, decoder)
    orders = symmetric_orders(named_order("spiral-out", 3), 3, 8)  # (8, 9)
    chains = chain_nll(model, every_image(3, 1), 1, orders)  # (512, 8)
    want = torch.stack([enumerated_chain(model, o, 3, 1) for o in orders.tolist()], 1)  # (512, 8)
    assert torch.allclose(chains, -want.log(), rtol=0, atol=1e-4)
    assert torch.allclose(torch.exp(-chains).sum(0), torch.ones(8, dtype=torch.float64), atol=1e-4)
    assert (chains.std(1) > 0.05).float().mean() > 0.5  # the chains really differ: a mixture is not one of them
    for k in (1, 2, 8):
        mixture = mixture_nll(chains[:, :k])
        assert torch.allclose(mixture, -want[:, :k].mean(1).log(), rtol=0, atol=1e-4)
        assert float(torch.exp(-mixture).sum()) == pytest.approx(1.0, abs=1e-4)


def test_a_mixture_lies_between_its_best_chain_and_the_lesser_of_their_mean_and_the_best_plus_log_k():
    model, images = tiny_model(8, 2), random_images(12, 8)
    r = exact_nll_report(model, images, 2, orders=8, order="column")
    chains = torch.tensor([c["per_image"] for c in r["chains"]], dtype=torch.float64).t()  # (12, 8)
    for m in r["mixture_by_orders"]:
        k = m["orders"]
        direct = -torch.exp(-chains[:, :k]).mean(1).log()  # -log of the mean probability, not via logsumexp
        assert m["nats"] == pytest.approx(float(direct.mean()), abs=1e-6)
    mix = torch.tensor(r["mixture"]["per_image"], dtype=torch.float64)
    best, mean = chains.min(1).values, chains.mean(1)
    assert (mix >= best - 1e-9).all() and (mix <= mean + 1e-9).all() and (mix <= best + math.log(8) + 1e-9).all()
    assert (mean - mix).max() > 0.05  # the chains disagree, so the inequality is strict somewhere
    assert [m["orders"] for m in r["mixture_by_orders"]] == [1, 2, 4, 8]
    assert r["mixture_by_orders"][0]["nats"] == pytest.approx(r["fixed"]["nats"], abs=1e-9)
    assert r["fixed"]["per_image"] == r["chains"][0]["per_image"]
    assert r["chains"][0]["order"] == named_order("column", 4).tolist()


def test_each_standard_error_is_the_images_sample_std_over_the_square_root_of_their_count():
    model, images = tiny_model(8, 2), random_images(12, 8, seed=3)
    r = exact_nll_report(model, images, 2, orders=2, order="raster")
    for part in (r["fixed"], r["mixture"], *r["chains"]):
        x = part["per_image"]
        assert statistics.stdev(x) > 0.1  # the images differ: the error is not 0 whatever it is divided by
        assert part["se_images"] == pytest.approx(statistics.stdev(x) / math.sqrt(12), rel=1e-9)
    assert r["mixture_by_orders"][-1]["se_images"] == pytest.approx(r["mixture"]["se_images"], rel=1e-12)
    assert math.isnan(exact_nll_report(model, images[:1], 2, orders=1)["fixed"]["se_images"])  # one image: none


# ---- the bound is the mean over orders ----------------------------------------------------------------
def test_the_mean_exact_nll_over_random_orders_is_the_bound_within_its_monte_carlo_error():
    """N = 9 (6x6 images of 2x2 patches): 9! orders, too many to list; the bound enumerates the 511 hidden sets."""
    model, images = tiny_model(6, 2), random_images(3, 6, seed=4)
    gen = torch.Generator().manual_seed(0)
    orders = torch.stack([torch.randperm(9, generator=gen) for _ in range(400)])  # (400, 9)
    chains = chain_nll(model, images, 2, orders)  # (3, 400)
    assert chains.std(1).min() > 0.5  # the orders disagree: the mean has an error to be within
    bound = enumerated_bound(model, images, 2)  # (3,)
    z = (chains.mean(1) - bound) / (chains.std(1) / math.sqrt(400))
    assert z.abs().max() < 4, z
    # and the stratified estimate `eval --nll` reports, within both errors
    est = nll_report(model, images, images, 2, strata=9, samples=100, seed=1)
    se = math.sqrt(est["se_mc"] ** 2 + float((chains.std(1) ** 2).mean()) / 400 / 3)
    assert abs(est["nats"] - float(chains.mean())) < 4 * se


# ---- batching ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("decoder", ["none", "self", "cross"])
def test_batching_gives_the_numbers_of_the_chain_written_out_one_step_at_a_time(decoder):
    model, images = tiny_model(4, 2, decoder), random_images(5, 4, seed=2)
    gen = torch.Generator().manual_seed(1)
    orders = torch.stack([torch.randperm(4, generator=gen) for _ in range(3)])  # (3, 4)
    want = torch.stack([written_chain_nll(model, images, 2, o) for o in orders.tolist()], 1)  # (5, 3)
    # 60 rows: one pass of all 4 steps; passes of 5 rows across step boundaries; one row a pass
    for batch_size in (256, 5, 1):
        assert torch.allclose(chain_nll(model, images, 2, orders, batch_size=batch_size), want, rtol=0, atol=2e-5)
    one_by_one = torch.cat([chain_nll(model, images[i : i + 1], 2, orders) for i in range(5)])
    assert torch.allclose(one_by_one, want, rtol=0, atol=2e-5)
    assert torch.allclose(order_nll(model, images, 2, orders[1]), want[:, 1], rtol=0, atol=2e-5)


def test_a_model_that_predicts_uniformly_costs_log_c_per_patch_in_every_order():
    model = tiny_model(8, 2)
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
    r = exact_nll_report(model, random_images(4, 8), 2, orders=4)
    want = 16 * math.log(16)  # 16 patches of 16 equally likely classes
    assert r["fixed"]["nats"] == pytest.approx(want, abs=1e-4) and r["mixture"]["nats"] == pytest.approx(want, abs=1e-4)
    assert r["fixed"]["bits_per_pixel"] == pytest.approx(1.0, abs=1e-6)  # 4 bits a patch of 4 pixels


def test_the_exact_nlls_stop_on_their_first_forward_pass():
    model, images = tiny_model(8, 2), random_images(40, 8)
    orders = symmetric_orders(named_order("raster", 4), 4, 8)
    # 40 images x 8 orders x 16 steps at 8 rows a pass: 640 passes unstopped
    assert run_until_stopped(lambda: chain_nll(model, images, 2, orders, batch_size=8), model.embed) == 1


# ---- a trained model, and vitmask eval --nll ----------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 30-step tiny model on 16x16 shapes (8x8 patches of 2x2)."""
    return train_tiny(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


def test_eval_nll_reports_the_bound_the_fixed_order_and_the_mixture_in_the_table_and_the_json(run_cli, ckpt):
    args = ["eval", "--checkpoint", ckpt, "--split", "test", "--device", "cpu", "--mask-ratio", "0.5"]
    args += ["--nll", "--nll-strata", "4", "--nll-orders", "4"]
    table, as_json = run_cli(*args), run_cli(*args, "--json")
    assert table.returncode == 0 and as_json.returncode == 0, table.stderr + as_json.stderr
    nll = json.loads(as_json.stdout)["nll"]
    exact = nll["exact"]
    assert exact["order"] == "raster" and exact["orders"] == 4 and exact["chosen_on"] is None
    assert [c["symmetry"] for c in exact["chains"]] == ["identity", "rot180", "transpose", "anti-transpose"]
    assert [m["orders"] for m in exact["mixture_by_orders"]] == [1, 2, 4]
    assert exact["mixture"]["nats"] == pytest.approx(exact["mixture_by_orders"][-1]["nats"])
    assert len(exact["fixed"]["per_image"]) == len(exact["mixture"]["per_image"]) == nll["images"] == 64
    assert exact["fixed"]["bits_per_pixel"] == pytest.approx(exact["fixed"]["nats"] / (256 * math.log(2)))
    assert 0 < nll["seconds"] and 0 < exact["fixed"]["seconds"] < exact["mixture"]["seconds"]
    lines = table.stdout.splitlines()
    for label, r in [
        ("model (upper bound)", nll),
        ("model (exact), order raster", exact["fixed"]),
        ("model (exact), mixture of 4 orders", exact["mixture"]),
    ]:
        line = next(ln for ln in lines if ln.strip().startswith(label))
        assert f"{r['nats']:.2f}" in line and f"{r['bits_per_pixel']:.4f}" in line, line
    # the raster order's NLL, against the chain rule written out on the same test images
    from vitmask.data.batches import load_splits
    from vitmask.store.checkpoint import load_model

    loaded = load_model(ckpt)
    test_images = load_splits(loaded.config)["test"]
    want = written_chain_nll(loaded.model, test_images, 2, list(range(64)))
    assert torch.allclose(torch.tensor(exact["fixed"]["per_image"], dtype=torch.float64), want, rtol=0, atol=1e-3)


def test_training_brings_the_exact_nll_below_the_untrained_models_and_the_baselines(run_cli, ckpt):
    """30 steps on shapes; the same network at its initialisation (step 0) scores far worse."""
    from vitmask.data.batches import load_splits
    from vitmask.store.checkpoint import load_model

    loaded = load_model(ckpt)
    images = load_splits(loaded.config)["test"]
    torch.manual_seed(0)
    untrained = build_model(loaded.config).eval()
    trained = exact_nll_report(loaded.model, images, 2, orders=2)
    fresh = exact_nll_report(untrained, images, 2, orders=2)
    bound = nll_report(loaded.model, images, images, 2, strata=4)
    assert trained["fixed"]["nats"] < fresh["fixed"]["nats"] - 50
    assert trained["mixture"]["nats"] < bound["baselines"]["bernoulli"]["nats"] - 20
    assert trained["fixed"]["bits_per_pixel"] < 0.6  # against 1 bit per pixel


def test_eval_nll_order_auto_picks_the_order_of_least_nll_on_the_val_split(run_cli, ckpt):
    args = ["eval", "--checkpoint", ckpt, "--split", "test", "--device", "cpu", "--mask-ratio", "0.5"]
    res = run_cli(*args, "--nll", "--nll-strata", "2", "--nll-orders", "1", "--nll-order", "auto", "--json")
    assert res.returncode == 0, res.stderr
    exact = json.loads(res.stdout)["nll"]["exact"]
    chosen = exact["chosen_on"]
    assert chosen["split"] == "val" and chosen["images"] == 64 and set(chosen["candidates"]) == set(ORDERS)
    assert exact["order"] == min(chosen["candidates"], key=chosen["candidates"].get)
    from vitmask.data.batches import load_splits
    from vitmask.store.checkpoint import load_model

    loaded = load_model(ckpt)
    val = load_splits(loaded.config)["val"]
    spiral = written_chain_nll(loaded.model, val, 2, named_order("spiral-out", 8).tolist())
    assert chosen["candidates"]["spiral-out"] == pytest.approx(float(spiral.mean()), abs=1e-3)
    no_exact = run_cli(*args, "--nll", "--nll-strata", "2", "--nll-orders", "0", "--json")
    assert no_exact.returncode == 0 and "exact" not in json.loads(no_exact.stdout)["nll"]


def test_eval_nll_exact_images_scores_the_first_images_beside_the_bound_on_the_same_images(run_cli, ckpt):
    """--nll-exact-images 5: the exact rows are of the first 5 test images (the same per-image numbers as a run
    over all 64), and the table adds the bound's mean over those 5 images, read from its per-image column."""
    args = ["eval", "--checkpoint", ckpt, "--split", "test", "--device", "cpu", "--mask-ratio", "0.5"]
    args += ["--nll", "--nll-strata", "2", "--nll-orders", "2"]
    every, first = run_cli(*args, "--nll-exact-images", "0", "--json"), run_cli(*args, "--nll-exact-images", "5")
    as_json = run_cli(*args, "--nll-exact-images", "5", "--json")
    assert every.returncode == first.returncode == as_json.returncode == 0, every.stderr + first.stderr
    whole, part = json.loads(every.stdout)["nll"], json.loads(as_json.stdout)["nll"]
    assert whole["exact"]["images"] == 64 and part["exact"]["images"] == 5 and part["images"] == 64
    assert part["exact"]["fixed"]["per_image"] == pytest.approx(whole["exact"]["fixed"]["per_image"][:5], abs=1e-9)
    same = sum(part["per_image"][:5]) / 5
    assert part["exact"]["bound_same_images"] == pytest.approx(same)
    line = next(ln for ln in first.stdout.splitlines() if ln.strip().startswith("model (upper bound), first 5"))
    assert f"{same:.2f}" in line and "on the first 5 images" in first.stdout


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--nll-orders", "9"], ["--nll-orders must be between 0", "got 9"]),
        (["--nll-orders", "-1"], ["--nll-orders must be between 0", "got -1"]),
        (["--nll-order", "diagonal"], ["--nll-order must be one of raster,", "auto", "got 'diagonal'"]),
        (["--nll-orders", "0", "--nll-order", "column"], ["--nll-orders 0 asks for none", "leave out one"]),
        (["--nll-exact-images", "-3"], ["--nll-exact-images must be at least 0", "got -3"]),
    ],
)
def test_eval_refuses_bad_exact_nll_options_in_one_line(run_cli, ckpt, extra, needles):
    res = run_cli("eval", "--checkpoint", ckpt, "--device", "cpu", "--nll", *extra)
    assert_user_error(res, *needles)


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--nll-order", "column"], ["--nll-order picks the order of --nll's exact NLLs", "add --nll"]),
        (["--nll-order", "diagonal"], ["--nll-order picks the order", "add --nll"]),
        (["--nll-orders", "9"], ["--nll-orders must be between 0", "got 9"]),
        (["--nll-exact-images", "-3"], ["--nll-exact-images must be at least 0", "got -3"]),
    ],
)
def test_eval_without_nll_refuses_its_exact_nll_options_instead_of_ignoring_them(run_cli, ckpt, extra, needles):
    assert_user_error(run_cli("eval", "--checkpoint", ckpt, "--device", "cpu", *extra), *needles)


def test_the_table_marks_the_bound_and_the_exact_numbers_and_shows_a_mixture_only_of_several_orders():
    from vitmask.evaluate.likelihood import format_nll

    model, images = tiny_model(8, 2), random_images(6, 8)
    r = nll_report(model, images, images, 2, strata=2)
    one = format_nll({**r, "exact": exact_nll_report(model, images, 2, orders=1, order="spiral-in")})
    assert "model (upper bound)" in one and "model (exact), order spiral-in" in one and "mixture" not in one
    r["exact"] = exact_nll_report(model, images, 2, orders=2, order="spiral-in")
    two = format_nll(r)
    assert "model (exact), mixture of 2 orders" in two and "identity" in two and "rot180" in two
    k2 = r["exact"]["mixture_by_orders"][1]
    assert f"k=2 {k2['nats']:.2f} ({k2['nats'] - r['exact']['fixed']['nats']:+.2f})" in two
