"""Eval metrics on hand-made predictions with known answers."""

import math

import torch
import torch.nn.functional as F

from vitmask.config import config_from_dict
from vitmask.data.batches import eval_batches
from vitmask.data.patches import classes_to_patches, patches_to_classes
from vitmask.data.shapes import make_splits
from vitmask.evaluate.scores import evaluate, format_report

CFG = config_from_dict({"data": {"image_size": 8, "patch_size": 2}, "mask": {"ratio": 0.5}})
SCALE = 5.0


class Oracle(torch.nn.Module):
    """Reads the true pixels the caller passes and puts SCALE on the true class of each masked patch."""

    def forward(self, patches, mask, ids=None):
        targets = patches_to_classes(patches)  # (B, N)
        if ids is not None:
            targets = targets.gather(1, ids)  # (B, M)
        return SCALE * F.one_hot(targets, 16).float()  # (B, M, C)


class Constant(torch.nn.Module):
    """Always predicts class `cls`."""

    def __init__(self, cls: int):
        super().__init__()
        self.cls = cls

    def forward(self, patches, mask, ids=None):
        shape = (*ids.shape, 16) if ids is not None else (*mask.shape, 16)
        return F.one_hot(torch.full(shape[:-1], self.cls), 16).float()


def images():
    return make_splits(40, 1, 1, 8, seed=3)["train"]  # (40, 8, 8)


def test_a_perfect_predictor_scores_one():
    imgs = images()
    m = evaluate(Oracle(), imgs, CFG, 0.5, seed=1, majority_class=0, batch_size=16)
    assert m["acc"] == 1.0 and m["acc_nonempty"] == 1.0 and m["bit_acc"] == 1.0
    assert all(row["acc"] == 1.0 for row in m["per_class"])
    assert m["confusions"] == []
    assert math.isclose(m["loss"], math.log(1 + 15 * math.exp(-SCALE)), rel_tol=1e-5)
    assert m["masked_patches"] == len(imgs) * 8  # 16 patches, half masked


def test_a_constant_predictor_scores_the_majority_rate():
    imgs = images()
    m = evaluate(Constant(0), imgs, CFG, 0.5, seed=1, majority_class=0, batch_size=16)
    # an independent count over the same masks
    truth = torch.cat([b.targets.gather(1, b.ids).flatten() for b in eval_batches(imgs, CFG, 0.5, 1, 16)])
    assert m["acc"] == m["majority_acc"] == int((truth == 0).sum()) / truth.numel()
    assert m["acc_nonempty"] == 0.0
    assert math.isclose(m["bit_acc"], 1 - int(classes_to_patches(truth, 4).sum()) / (4 * truth.numel()))
    assert m["nonempty_patches"] == int((truth != 0).sum())
    row0 = next(r for r in m["per_class"] if r["class"] == 0)
    assert row0["acc"] == 1.0 and all(r["acc"] == 0.0 for r in m["per_class"] if r["class"] != 0)
    top = m["confusions"][0]
    assert top["pred"] == 0 and top["patches"] == max(int((truth == c).sum()) for c in range(1, 16))


def test_eval_masks_are_seeded():
    a = evaluate(Constant(15), images(), CFG, 0.5, seed=7, majority_class=0)
    b = evaluate(Constant(15), images(), CFG, 0.5, seed=7, majority_class=0)
    c = evaluate(Constant(15), images(), CFG, 0.5, seed=8, majority_class=0)
    assert a == b and a["acc"] != c["acc"]


def test_report_table_by_hand():
    result = {
        "mask_ratio": 0.5,
        "loss": 0.25,
        "acc": 0.75,
        "acc_nonempty": 0.5,
        "bit_acc": 0.875,
        "masked_patches": 8,
        "nonempty_patches": 4,
        "baselines": {"majority": {"acc": 0.5, "acc_nonempty": 0.0, "bit_acc": 0.75}},
        "confusions": [{"true": 9, "pred": 0, "patches": 2, "share": 0.5}],
        "per_class": [{"class": 0, "patches": 4, "acc": 1.0}, {"class": 9, "patches": 4, "acc": 0.5}],
    }
    report = {"checkpoint": "x.pt", "split": "val", "seed": 3, "images": 2, "patch_size": 2, "results": [result]}
    lines = format_report(report).splitlines()
    assert lines[0].split() == ["checkpoint", "x.pt", "split", "val", "(2", "images)", "seed", "3"]
    assert "mask ratio 0.5  (8 masked patches, 4 non-empty)" in lines
    row = lambda label: next(ln for ln in lines if ln.startswith(f"  {label} ")).split()[-4:]  # noqa: E731
    assert row("model") == ["0.2500", "0.7500", "0.5000", "0.8750"]  # loss, acc, acc non-empty, bit acc
    assert row("majority class") == ["-", "0.5000", "0.0000", "0.7500"]
    assert "    10/01 -> 00/00: 2, 50.0%" in lines  # class 9 read as its pixel rows
    start = next(i for i, ln in enumerate(lines) if ln.startswith("per-class")) + 2  # after the title and header
    per_class = [ln.split() for ln in lines[start:]]
    assert per_class == [["0", "00/00", "50.00%", "1.0000"], ["9", "10/01", "50.00%", "0.5000"]]
