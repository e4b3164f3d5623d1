import torch

from vitmask.data import shapes


def test_shapes_are_binary_deterministic_and_varied():
    a = shapes.make_splits(300, 50, 50, 32, seed=5)
    b = shapes.make_splits(300, 50, 50, 32, seed=5)
    c = shapes.make_splits(300, 50, 50, 32, seed=6)
    for split in ("train", "val", "test"):
        assert torch.equal(a[split], b[split])
        assert a[split].dtype == torch.uint8 and a[split].shape[1:] == (32, 32)
        assert set(a[split].unique().tolist()) == {0, 1}
    assert not torch.equal(a["train"][:50], c["train"][:50])
    fg = a["train"].float().mean((1, 2))  # foreground share per image
    assert (fg > 0).all() and 0.03 < fg.mean() < 0.4
    assert len(torch.unique(a["train"].flatten(1), dim=0)) == len(a["train"])  # no repeats


def test_splits_are_disjoint_and_stable_when_train_grows():
    small = shapes.make_splits(200, 100, 100, 16, seed=0)
    big = shapes.make_splits(2000, 100, 100, 16, seed=0)
    assert torch.equal(small["test"], big["test"]) and torch.equal(small["val"], big["val"])
    flat = {k: {bytes(x) for x in v.flatten(1).numpy()} for k, v in big.items()}
    assert not flat["train"] & flat["val"] and not flat["train"] & flat["test"] and not flat["val"] & flat["test"]


def test_each_shape_kind_draws_filled_and_outlined_forms():
    g = torch.Generator().manual_seed(0)
    imgs = shapes.generate(400, 32, g)
    # filled shapes have interior pixels (all 4 neighbours set); outlines and lines mostly do not
    interior = imgs[:, 1:-1, 1:-1] & imgs[:, :-2, 1:-1] & imgs[:, 2:, 1:-1] & imgs[:, 1:-1, :-2] & imgs[:, 1:-1, 2:]
    share = interior.flatten(1).sum(1).float() / imgs.flatten(1).sum(1).clamp_min(1)
    assert (share > 0.5).sum() > 40  # many mostly-solid images
    assert (share < 0.2).sum() > 40  # many thin ones (outlines, lines)
