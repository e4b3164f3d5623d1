"""Loading checkpoints: a file laid out exactly as the trainer writes it (format
'vitmask-checkpoint/1') loads for eval and for resume; a model of another shape is refused the same
way by every loader; count-params counts a checkpoint's model."""

import random

import numpy as np
import pytest
import torch

from tests.conftest import TINY
from vitmask.cli import verbs
from vitmask.config import config_from_dict
from vitmask.data.batches import load_splits
from vitmask.errors import UserError
from vitmask.model.vit import build_model
from vitmask.store.checkpoint import load_checkpoint, load_model
from vitmask.train.optim import build_optimizer, build_scheduler
from vitmask.train.trainer import Trainer

RAW = {**TINY, "train": {**TINY["train"], "max_steps": 8, "eval_every": 8, "checkpoint_every": 8}}
STEP, BEST = 7, 1.25


def write_todays_checkpoint(path, raw: dict = RAW) -> dict:
    """torch.save a dict with every key of the 'vitmask-checkpoint/1' format, made without the trainer:
    a model and an AdamW after one step, a LambdaLR at step 7, sampler generators, global RNGs."""
    cfg = config_from_dict(raw)
    torch.manual_seed(123)
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train)
    batch = torch.rand(2, cfg.data.num_patches, cfg.data.patch_dim)  # (B, N, P)
    mask = torch.zeros(2, cfg.data.num_patches, dtype=torch.bool)
    mask[:, ::3] = True
    model(batch, mask).logsumexp(-1).mean().backward()
    optimizer.step()
    for _ in range(STEP):
        scheduler.step()
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "format": "vitmask-checkpoint/1",
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": {},  # a disabled GradScaler (fp32 on CPU) has an empty state
        "sampler": {
            "generator": torch.Generator().manual_seed(77).get_state(),
            "count_generator": torch.Generator().manual_seed(78).get_state(),
        },
        "rng": {
            "torch": torch.Generator().manual_seed(99).get_state(),
            "python": list(py[1]),
            "python_pos": py[2],
            "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
            "numpy_pos": int(np_state[2]),
        },
        "step": STEP,
        "best_val_loss": BEST,
        "majority_class": 0,
        "config": cfg.to_dict(),
    }
    torch.save(state, path)
    return state


def test_todays_checkpoint_loads_for_eval(tmp_path):
    path = tmp_path / "old.pt"
    written = write_todays_checkpoint(path)
    model, cfg, state = load_model(path)
    assert cfg.to_dict() == written["config"] and state["step"] == STEP
    assert not model.training
    for k, v in written["model"].items():
        assert torch.equal(model.state_dict()[k], v), k
    report = verbs.evaluate_checkpoint(path, "val", [0.5], "cpu")
    assert report["images"] == TINY["data"]["num_val"]
    assert report["results"][0]["masked_patches"] == 64 * 32  # 64 val images, 32 of 64 patches masked


def test_todays_checkpoint_resumes_into_a_trainer_of_another_seed(tmp_path):
    path = tmp_path / "old.pt"
    written = write_todays_checkpoint(path)
    cfg = config_from_dict({**RAW, "seed": 5})
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    trainer.load_state_dict(load_checkpoint(path))
    assert trainer.step == STEP and trainer.validator.best_loss == BEST
    for k, v in written["model"].items():
        assert torch.equal(trainer.model.state_dict()[k], v), k
    moments = trainer.optimizer.state_dict()["state"]
    for i, s in written["optimizer"]["state"].items():
        assert torch.equal(moments[i]["exp_avg"], s["exp_avg"]) and torch.equal(
            moments[i]["exp_avg_sq"], s["exp_avg_sq"]
        )
    assert trainer.scheduler.last_epoch == STEP
    # a sampler state of generators (the format before the step-derived order) carries no seed or step:
    # the trainer seeks the sampler to the checkpoint's step, with this run's seed (5 + 1)
    assert (trainer.sampler.step, trainer.sampler.seed) == (STEP, 6)
    assert torch.equal(torch.get_rng_state(), written["rng"]["torch"])
    trainer.train_step(trainer.sampler.sample())
    assert trainer.step == STEP + 1


def test_todays_checkpoint_resumes_through_the_train_command(tmp_path, capsys):
    path = tmp_path / "run" / "old.pt"
    path.parent.mkdir()
    write_todays_checkpoint(path)
    run_dir, val = verbs.train(None, [], None, str(path), "cpu")  # its folder, its config: one step to 8
    assert run_dir == path.parent
    assert f"resuming {run_dir} from step {STEP}" in capsys.readouterr().out
    assert load_checkpoint(run_dir / "last.pt")["step"] == STEP + 1


def test_a_checkpoint_of_another_shape_is_refused_by_eval_and_resume(tmp_path):
    path = tmp_path / "wide.pt"
    state = write_todays_checkpoint(path)
    narrow = {**RAW, "model": {**RAW["model"], "hidden_dim": 16}}
    torch.save({**state, "config": config_from_dict(narrow).to_dict()}, path)  # weights of width 32
    with pytest.raises(
        UserError,
        match=r"does not fit this model \(shape mismatch: pos \(64, 32\) vs \(64, 16\); embed.weight \(32, 4\) vs",
    ):
        load_model(path)
    cfg = config_from_dict(narrow)
    with pytest.raises(UserError, match="does not fit this model"):
        Trainer(cfg, load_splits(cfg), torch.device("cpu")).load_state_dict(load_checkpoint(path))


def test_count_params_counts_the_checkpoints_model(tmp_path):
    path = tmp_path / "old.pt"
    written = write_todays_checkpoint(path)
    rows = verbs.count_params(None, path, [])
    want = {k: v.numel() for k, v in written["model"].items()}  # every model tensor is a parameter here
    assert {name: n for name, _, n, _ in rows} == want
    assert {name: shape for name, shape, _, _ in rows}["embed.weight"] == (32, 4)
    deeper = verbs.count_params(None, path, ["model.depth=3"])  # a variant of the checkpoint's config
    assert len(deeper) > len(rows)
