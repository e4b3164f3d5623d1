"""The masked-patch metrics accumulator against hand counts, and eval and inpainting reporting the
numbers it gives on the same predictions."""

import math

import pytest
import torch
import torch.nn.functional as F

from vitmask.config import config_from_dict
from vitmask.data.batches import eval_batches
from vitmask.data.patches import patches_to_classes, patchify
from vitmask.data.shapes import make_splits
from vitmask.evaluate.metrics import MaskedPatchMetrics
from vitmask.evaluate.scores import evaluate
from vitmask.generate.inpaint import fill_accuracy

# Two batches of masked patches (2x2 patches: class 8a + 4b + 2c + d for pixels [[a, b], [c, d]]).
PRED_1, TRUE_1 = [[0, 1, 3, 4]], [[0, 0, 3, 5]]
PRED_2, TRUE_2 = [[15, 8, 6, 0]], [[0, 8, 9, 12]]


def fed() -> MaskedPatchMetrics:
    m = MaskedPatchMetrics(16, "cpu", by_class=True)
    m.add(torch.tensor(PRED_1), torch.tensor(TRUE_1), torch.tensor(4.0))
    m.add(torch.tensor(PRED_2), torch.tensor(TRUE_2), torch.tensor(2.0))
    return m


def test_scalars_are_the_hand_counts():
    r = fed().read()
    # hits: 0=0, 3=3, 8=8 -> 3 of 8 patches
    assert r["acc"] == 3 / 8
    # non-empty true classes: 3, 5, 8, 9, 12 -> 5, of which 3 and 8 are right
    assert r["acc_nonempty"] == 2 / 5
    assert r["masked_patches"] == 8 and r["nonempty_patches"] == 5
    # wrong pixels: 0001 vs 0000: 1; 0100 vs 0101: 1; 1111 vs 0000: 4; 0110 vs 1001: 4; 0000 vs 1100: 2
    assert r["bit_acc"] == 1 - 12 / 32
    assert r["loss"] == (4.0 + 2.0) / 8  # summed cross-entropy per masked patch


def test_per_class_and_confusions_are_the_hand_counts():
    m = fed()
    assert m.per_class() == [
        {"class": 0, "patches": 3, "acc": 1 / 3},  # predicted 0, 1 and 15
        {"class": 3, "patches": 1, "acc": 1.0},
        {"class": 5, "patches": 1, "acc": 0.0},
        {"class": 8, "patches": 1, "acc": 1.0},
        {"class": 9, "patches": 1, "acc": 0.0},
        {"class": 12, "patches": 1, "acc": 0.0},
    ]
    pairs = sorted((c["true"], c["pred"], c["patches"], c["share"]) for c in m.confusions())
    assert pairs == [(0, 1, 1, 1 / 3), (0, 15, 1, 1 / 3), (5, 4, 1, 1.0), (9, 6, 1, 1.0), (12, 0, 1, 1.0)]
    assert len(m.confusions(top=2)) == 2


def test_bit_accuracy_of_larger_patches_counts_every_pixel():
    m = MaskedPatchMetrics(512, "cpu")  # 3x3 patches: 9 pixels, 512 classes
    # 0 vs 511: all 9 pixels wrong; 256 (first pixel) vs 257 (first and last): 1 wrong; 7 vs 7: none
    m.add(torch.tensor([[0, 256, 7]]), torch.tensor([[511, 257, 7]]))
    r = m.read()
    assert r["bit_acc"] == 1 - 10 / 27
    assert r["acc"] == 1 / 3 and r["acc_nonempty"] == 1 / 3
    assert "loss" not in r  # no loss was fed


def test_reset_starts_a_new_window_and_empty_ratios_are_nan():
    m = fed()
    m.reset()
    r = m.read()
    assert r["masked_patches"] == 0 and math.isnan(r["acc"]) and math.isnan(r["bit_acc"])
    m.add(torch.tensor([[0, 0]]), torch.tensor([[0, 0]]))  # only empty patches
    r = m.read()
    assert r["acc"] == 1.0 and math.isnan(r["acc_nonempty"]) and r["nonempty_patches"] == 0
    assert m.per_class() == [{"class": 0, "patches": 2, "acc": 1.0}]


def hand_counts(pairs: list[tuple[int, int]], bits: int = 4) -> dict[str, float]:
    """acc, acc_nonempty and bit_acc of (pred, true) pairs, counted in plain Python."""
    hits = sum(p == t for p, t in pairs)
    nonempty = [(p, t) for p, t in pairs if t != 0]
    wrong = sum(bin(p ^ t).count("1") for p, t in pairs)
    return {
        "acc": hits / len(pairs),
        "acc_nonempty": sum(p == t for p, t in nonempty) / len(nonempty),
        "bit_acc": 1 - wrong / (bits * len(pairs)),
    }


def xor_odd(classes: torch.Tensor) -> torch.Tensor:
    """(B, N) classes -> the same with the last pixel flipped at odd patch positions."""
    flip = (torch.arange(classes.shape[1]) % 2).expand_as(classes)  # (B, N)
    return classes ^ flip


class XorOdd(torch.nn.Module):
    """Reads the true pixels the caller passes and predicts `xor_odd` of their classes."""

    def forward(self, patches, mask, ids=None):
        guess = xor_odd(patches_to_classes(patches))  # (B, N)
        if ids is not None:
            guess = guess.gather(1, ids)  # (B, M)
        return 5.0 * F.one_hot(guess, 16).float()  # (B, M or N, C)


CFG = config_from_dict({"data": {"image_size": 8, "patch_size": 2}, "mask": {"ratio": 0.5}})


def test_eval_reports_the_accumulators_numbers():
    images = make_splits(40, 1, 1, 8, seed=3)["train"]  # (n, 8, 8)
    r = evaluate(XorOdd(), images, CFG, 0.5, seed=1, majority_class=0, batch_size=16)
    pairs, acc = [], MaskedPatchMetrics(16, "cpu")
    for b in eval_batches(images, CFG, 0.5, 1, 16):
        pred = xor_odd(b.targets).gather(1, b.ids)  # (B, M)
        pairs += list(zip(pred.flatten().tolist(), b.masked_targets.flatten().tolist(), strict=True))
        acc.add(pred, b.masked_targets)
    want = hand_counts(pairs)
    assert 0.3 < want["acc"] < 0.7  # masked odd positions are always wrong, even ones right: a real mix
    for key in ("acc", "acc_nonempty", "bit_acc"):
        assert r[key] == pytest.approx(want[key], abs=1e-12), key
        assert r[key] == acc.read()[key], key
    assert r["masked_patches"] == len(pairs) == len(images) * 8  # 16 patches, half masked


def test_inpaint_fill_accuracy_reports_the_accumulators_numbers():
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(6, 8, 8, generator=g) < 0.4).to(torch.uint8)  # (6, 8, 8)
    mask = torch.zeros(6, 16, dtype=torch.bool)
    mask[:, 3:10] = True  # patches 3..9: four odd positions (flipped), three even (kept)
    truth = patches_to_classes(patchify(images, 2))  # (6, 16)
    pairs = list(zip(xor_odd(truth)[mask].tolist(), truth[mask].tolist(), strict=True))
    r = fill_accuracy(XorOdd(), images, mask, 2, steps=1, batch_size=4)
    want = hand_counts(pairs)
    for key in ("acc", "acc_nonempty", "bit_acc"):
        assert r[key] == pytest.approx(want[key], abs=1e-12), key
    assert r["acc"] == 3 / 7  # the even positions only: the flip never leaves a class unchanged
    assert r["bit_acc"] == 1 - 4 / (7 * 4)  # one wrong pixel in each of the four odd patches
