"""A gradient norm that blows up while the loss looks fine (train/divergence.py): a warning once when a
log window's mean norm passes 1000x the first window after warm-up, a stop in one line when it stays
there 3 windows in a row; a healthy run says nothing."""

import pytest
import torch

from tests.conftest import TINY
from vitmask.config import config_from_dict
from vitmask.data.batches import load_splits
from vitmask.errors import UserError
from vitmask.train.divergence import DivergenceWatch
from vitmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def watch(warmup: int = 0) -> DivergenceWatch:
    return DivergenceWatch(torch.device("cpu"), warmup)


def test_warm_up_windows_are_not_the_reference(capsys):
    w = watch(warmup=10)
    w.grad_norm(5, 100.0, 2.0)
    w.grad_norm(10, 50.0, 2.0)  # the window ending at the warm-up's last step is still warm-up
    assert w.reference is None
    w.grad_norm(15, 0.5, 1.0)
    assert w.reference == (15, 0.5)
    w.grad_norm(20, 499.0, 1.0)  # 998x: not over
    assert capsys.readouterr().err == ""


def test_a_thousandfold_window_warns_once_and_three_in_a_row_stop(capsys):
    w = watch()
    w.grad_norm(25, 0.2, 1.0)
    w.grad_norm(50, 201.0, 0.9)
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (
        "vitmask: warning: the mean gradient norm is 201 at step 50, over 1000x the 0.2 of the window to step 25" in err
    )
    w.grad_norm(75, 300.0, 0.9)
    assert capsys.readouterr().err == ""  # once
    with pytest.raises(
        UserError,
        match=r"training is blowing up: the mean gradient norm is 1e\+04 at step 100.*"
        r"for 3 log windows in a row; lower train.lr or set train.grad_clip",
    ):
        w.grad_norm(100, 1e4, 0.9)


def test_a_window_back_below_resets_the_count_and_nan_counts_as_over():
    w = watch()
    w.grad_norm(1, 1.0, 1.0)
    w.grad_norm(2, 2000.0, 1.0)
    w.grad_norm(3, 2000.0, 1.0)
    w.grad_norm(4, 5.0, 1.0)  # back: the count starts again
    w.grad_norm(5, float("nan"), 1.0)
    w.grad_norm(6, float("inf"), 1.0)
    with pytest.raises(UserError, match="blowing up"):
        w.grad_norm(7, 2000.0, 1.0)


def test_the_reference_is_kept_across_a_resume():
    w = watch()
    w.grad_norm(5, 0.3, 1.0)
    resumed = watch()
    resumed.load_state_dict(w.state_dict())
    assert resumed.reference == (5, 0.3)
    resumed.load_state_dict({})  # an older checkpoint: a new reference
    assert resumed.reference is None


def blowup_cfg(*sets: str):
    return config_from_dict(TINY, ["data.num_train=128", "train.max_steps=30", "train.log_every=5", *sets])


def test_a_run_whose_gradient_grows_100000x_after_step_10_is_stopped_while_its_loss_looks_fine(capsys):
    """One parameter's gradient 1e5 times larger from step 10 on (Adam normalises it: the loss keeps
    falling): warned at the window to step 15, stopped at the third such window, step 25."""
    cfg = blowup_cfg()
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    trainer.model.head.weight.register_hook(lambda g: g * (1e5 if trainer.step >= 10 else 1.0))
    with pytest.raises(UserError, match=r"blowing up: the mean gradient norm is .* at step 25, over 1000x .* step 5"):
        trainer.fit(progress=False)
    assert trainer.step == 25
    err = capsys.readouterr().err
    assert "warning: the mean gradient norm is" in err and "at step 15" in err


def test_a_healthy_run_says_nothing_of_its_gradient(capsys):
    cfg = blowup_cfg()
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    trainer.fit(progress=False)
    assert trainer.step == 30
    assert "gradient norm" not in capsys.readouterr().err
    assert trainer.divergence.reference[0] == 5
