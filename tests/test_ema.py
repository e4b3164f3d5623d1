"""The EMA of the weights (`train.ema_decay`): its warm-up, its update against a written-out
recursion, what validation reports and what best.pt follows. Exact resume with it: test_trainer_resume
and test_long_run's SIGKILL test."""

import pytest
import torch
from torch import nn

from tests.conftest import TINY, RecordingLogger
from vitmask.config import config_from_dict
from vitmask.data.batches import load_splits
from vitmask.errors import UserError
from vitmask.store.checkpoint import load_checkpoint
from vitmask.train.ema import WeightEMA, ema_decay_at
from vitmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_decay_warms_up_as_one_plus_t_over_ten_plus_t_and_is_capped():
    assert ema_decay_at(0.999, 0) == pytest.approx(0.1)  # 1/10
    assert ema_decay_at(0.999, 8) == pytest.approx(0.5)  # 9/18
    assert ema_decay_at(0.999, 80) == pytest.approx(0.9)  # 81/90
    assert ema_decay_at(0.9, 80) == 0.9 and ema_decay_at(0.9, 10_000) == 0.9
    assert ema_decay_at(0.999, 10_000) == 0.999  # 10001/10010 > 0.999


def test_an_update_is_the_lerp_of_the_written_out_formula():
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.fill_(4.0)
    ema = WeightEMA(model, decay=0.9)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 0.0]]))
        model.bias.fill_(0.0)
    ema.update(model, 0)  # decay 0.1: 0.1 * old + 0.9 * new
    assert torch.allclose(ema.module.weight, torch.tensor([[0.1 * 1 + 0.9 * 3, 0.1 * 2]]))
    assert torch.allclose(ema.module.bias, torch.tensor([0.4]))
    ema.update(model, 1000)  # capped at 0.9
    assert torch.allclose(ema.module.weight, torch.tensor([[0.9 * 2.8 + 0.1 * 3, 0.9 * 0.2]]))
    assert model.weight.requires_grad and not ema.module.weight.requires_grad
    assert ema.module.weight.dtype == torch.float32


def config(**train):
    return config_from_dict({**TINY, "train": {**TINY["train"], "ema_decay": 0.8, **train}})


def test_the_trainers_ema_follows_the_recursion_over_its_steps():
    cfg = config(max_steps=6)
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    want = {k: v.double().clone() for k, v in trainer.model.state_dict().items()}  # the EMA starts at the init
    for t in range(6):
        trainer.train_step(trainer.sampler.sample())
        d = min(0.8, (1 + t) / (10 + t))
        for k, v in trainer.model.state_dict().items():
            want[k] = d * want[k] + (1 - d) * v.double()
    got = trainer.ema.state_dict()
    for k, v in want.items():
        assert torch.allclose(got[k].double(), v, atol=1e-6), k
    assert trainer.state_dict()["ema"].keys() == want.keys()


def test_validation_reports_raw_and_ema_and_best_pt_follows_the_ema(tmp_path):
    cfg = config(max_steps=30, eval_every=10, checkpoint_every=30)
    logger = RecordingLogger()
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"), logger=logger)
    trainer.fit(tmp_path, progress=False)
    raw = [m["val/loss"] for _, m in logger.rows if "val/loss" in m]
    ema = [m["val_ema/loss"] for _, m in logger.rows if "val_ema/loss" in m]
    assert len(raw) == len(ema) == 3 and raw != ema
    best = load_checkpoint(tmp_path / "best.pt")
    assert best["best_val_loss"] == min(ema)
    assert best["val"]["ema"]["loss"] == min(ema)  # the state written at the EMA's best evaluation
    last = load_checkpoint(tmp_path / "last.pt")
    assert last["val"]["raw"]["loss"] == raw[-1] and last["val"]["ema"]["loss"] == ema[-1]


def test_a_checkpoint_without_ema_does_not_resume_a_run_with_it(tmp_path):
    cfg = config(max_steps=2)
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    state = trainer.state_dict()
    del state["ema"]
    with pytest.raises(UserError, match="no EMA weights"):
        Trainer(cfg, load_splits(cfg), torch.device("cpu")).load_state_dict(state)


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5])
def test_ema_decay_outside_0_1_is_refused(value):
    with pytest.raises(UserError, match=r"train.ema_decay must be in \[0, 1\)"):
        config(ema_decay=value)
