"""The training metrics a run logs (train/loss, acc, acc_nonempty, bit_acc) against a hand count on
tiny hand-made batches, through the real loop: step, logging window, reporter."""

import math

import pytest
import torch

from tests.conftest import RecordingLogger
from vitmask.config import config_from_dict
from vitmask.data.batches import Batch
from vitmask.train.trainer import Trainer

CFG = config_from_dict(
    {
        "data": {"image_size": 8, "patch_size": 2, "batch_size": 2},  # 4 x 4 = 16 patches of 2x2
        "mask": {"ratio": 0.25},  # 4 masked patches per image
        "model": {"hidden_dim": 16, "num_heads": 2, "depth": 1, "ffn_dim": 32},
        "train": {"lr": 1e-9, "max_steps": 3, "log_every": 2, "eval_every": 3, "checkpoint_every": 3},
    }
)


def hand_batch(ids: list[list[int]], classes: list[list[int]]) -> Batch:
    """Two images whose patches at `ids` have the given classes and every other patch is empty.

    A 2x2 patch [[a, b], [c, d]] is class 8a + 4b + 2c + d, so class k's pixels are the bits of k.
    """
    targets = torch.zeros(2, 16, dtype=torch.long)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    for row, (where, what) in enumerate(zip(ids, classes, strict=True)):
        for n, k in zip(where, what, strict=True):
            targets[row, n], mask[row, n] = k, True
    pixels = torch.tensor([[[(k >> s) & 1 for s in (3, 2, 1, 0)] for k in row] for row in targets.tolist()])
    return Batch(pixels.float(), targets, mask, torch.tensor(ids))


# batch A: masked classes 0, 15, 5, 0 | 3, 0, 15, 8 ; batch B: 1, 2, 0, 0 | 0, 0, 0, 15
A = hand_batch([[1, 4, 6, 9], [0, 2, 3, 15]], [[0, 15, 5, 0], [3, 0, 15, 8]])
B = hand_batch([[0, 5, 10, 11], [7, 8, 12, 14]], [[1, 2, 0, 0], [0, 0, 0, 15]])
LN3, LN6, LN18 = math.log(3), math.log(6), math.log(18)


def test_logged_training_metrics_are_the_hand_counts():
    blank = torch.zeros(4, 8, 8, dtype=torch.uint8)  # the sampler's images are never drawn
    trainer = Trainer(CFG, {"train": blank, "val": blank}, torch.device("cpu"), logger=RecordingLogger())
    # every logit is the head's bias: 0 for every class but 15, ln 3 for 15. So the model always
    # predicts 15, and a patch's loss is ln(15 + 3) - ln 3 = ln 6 when its class is 15, else ln 18.
    with torch.no_grad():
        trainer.model.head.weight.zero_()
        trainer.model.head.bias.zero_()
        trainer.model.head.bias[15] = LN3
    trainer.sampler.sample = iter([A, A, B]).__next__  # lr 1e-9: the prediction stays 15 throughout
    trainer.fit(progress=False)
    train = [
        (step, {k[6:]: v for k, v in m.items() if k.startswith("train/")}) for step, m in trainer.reporter.logger.rows
    ]
    train = [(step, m) for step, m in train if m]
    assert [step for step, _ in train] == [2, 3]  # every log_every steps, and at the last
    (_, first), (_, second) = train
    # window 1, batch A twice: right where the class is 15 (2 of 8); non-empty: 15, 5, 3, 15, 8 (2 of 5);
    # pixels right against 1111: the 1 bits of 0, 15, 5, 0, 3, 0, 15, 8 = 0+4+2+0+2+0+4+1 = 13 of 32
    assert first["acc"] == 2 / 8
    assert first["acc_nonempty"] == 2 / 5
    assert first["bit_acc"] == 13 / 32
    assert first["loss"] == pytest.approx((6 * LN18 + 2 * LN6) / 8, rel=1e-6)
    # window 2, batch B alone: one 15 of 8; non-empty: 1, 2, 15 (1 of 3); pixels: 1+1+0+0+0+0+0+4 = 6 of 32
    assert second["acc"] == 1 / 8
    assert second["acc_nonempty"] == 1 / 3
    assert second["bit_acc"] == 6 / 32
    assert second["loss"] == pytest.approx((7 * LN18 + LN6) / 8, rel=1e-6)
