"""Exact resume, in process: a trainer built with another seed that loads a checkpoint steps exactly
as the trainer that wrote it goes on stepping: weights, their EMA and optimizer moments bit for bit.

Dropout draws from torch's global RNG, `mask.ratio_range` from the sampler's count generator and the
masks from the sampler's own generator, so a checkpoint missing any of them, the optimizer's moments,
the schedule, or a step that forgets `zero_grad` (gradients carried from the last step before the
save) makes the two runs part.
"""

import random

import numpy as np
import pytest
import torch

from tests.conftest import TINY
from vitmask.config import config_from_dict
from vitmask.data.batches import load_splits
from vitmask.store.checkpoint import load_checkpoint
from vitmask.train.trainer import Trainer

STEPS_BEFORE, STEPS_AFTER = 3, 3


def config(seed: int, optimizer: str = "adamw"):
    train = {
        "max_steps": STEPS_BEFORE,
        "checkpoint_every": STEPS_BEFORE,
        "eval_every": STEPS_BEFORE,
        "log_every": STEPS_BEFORE,
        "optimizer": optimizer,
        "weight_decay": 0.01,
        "schedule": "cosine",
        "warmup_steps": 2,
        "grad_clip": 1.0,
        "deterministic": True,
        "ema_decay": 0.9,
    }
    raw = {
        **TINY,
        "seed": seed,
        "mask": {"ratio": 0.5, "ratio_range": [0.25, 0.75]},
        "model": {**TINY["model"], "dropout": 0.1},
        "train": {**TINY["train"], **train},
    }
    return config_from_dict(raw)


def go_on(trainer: Trainer) -> tuple[dict, dict, tuple]:
    """Draw Python's and NumPy's next numbers, take STEPS_AFTER steps; return the weights, the
    optimizer state per parameter, and the draws."""
    draws = (random.random(), float(np.random.rand()))
    for _ in range(STEPS_AFTER):
        trainer.train_step(trainer.sampler.sample())
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    weights.update({f"ema.{k}": v.clone() for k, v in trainer.ema.state_dict().items()})
    parts = trainer.optimizer.state_dict()
    parts = {name: parts[name] for name in ("muon", "adamw")} if "muon" in parts else {"": parts}
    moments = {
        (name, i): {k: v.clone() for k, v in s.items()}
        for name, part in parts.items()
        for i, s in part["state"].items()
    }
    return weights, moments, draws


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_resumed_trainer_of_another_seed_steps_bit_identically(tmp_path, optimizer):
    splits = load_splits(config(0))
    writer = Trainer(config(0, optimizer), splits, torch.device("cpu"))
    writer.fit(tmp_path, progress=False)  # writes last.pt at step 3
    want_weights, want_moments, want_draws = go_on(writer)

    reader = Trainer(config(1, optimizer), splits, torch.device("cpu"))  # other init, sampler and RNG seeds
    reader.load_state_dict(load_checkpoint(tmp_path / "last.pt"))
    assert reader.step == STEPS_BEFORE
    weights, moments, draws = go_on(reader)

    assert reader.step == writer.step == STEPS_BEFORE + STEPS_AFTER
    assert draws == want_draws  # Python's and NumPy's generators came back too
    assert weights.keys() == want_weights.keys()
    for k, v in want_weights.items():
        assert torch.equal(weights[k], v), k
    assert moments.keys() == want_moments.keys() and 2 * len(moments) == len(want_weights)
    moment_names = {"adamw": ("step", "exp_avg", "exp_avg_sq"), "muon": ("momentum_buffer",)}
    for (name, i), state in want_moments.items():
        for k in moment_names.get(name, moment_names["adamw"]):
            assert torch.equal(moments[name, i][k], state[k]), (name, i, k)
