"""The training step with static shapes (`train.step_shapes`) and the torch.compile mode
(`train.compile_mode`): the mask-weighted loss against a written-out cross-entropy, the static step
against the masked-only one, no recompilation under a ratio schedule, and the config keys."""

import math

import pytest
import torch

from tests.conftest import TINY, write_config
from tests.test_sources import run_inproc
from vitmask.config import config_from_dict, dump_config, load_config
from vitmask.data.batches import load_splits
from vitmask.train.report import flat_hparams
from vitmask.train.trainer import Trainer, mask_weighted_loss, static_step

pytestmark = pytest.mark.usefixtures("one_thread")


def written_out_masked_ce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over every image's masked patches of -log softmax(logits)[target], one patch at a time."""
    total, count = 0.0, 0
    for b in range(logits.shape[0]):
        for n in range(logits.shape[1]):
            if mask[b, n]:
                row = logits[b, n].double().tolist()
                log_sum = math.log(sum(math.exp(v) for v in row))
                total += log_sum - row[int(targets[b, n])]
                count += 1
    return total / count


def test_mask_weighted_loss_is_the_mean_cross_entropy_over_exactly_the_masked_patches():
    g = torch.Generator().manual_seed(0)
    b, n, c = 3, 10, 5
    logits = 3 * torch.randn(b, n, c, generator=g)  # (B, N, C)
    targets = torch.randint(0, c, (b, n), generator=g)  # (B, N)
    mask = torch.zeros(b, n, dtype=torch.bool)
    for row, cols in enumerate(([0, 1, 2, 3], [9, 8, 2, 5], [4, 6, 1, 7])):  # M = 4 in every image
        mask[row, cols] = True
    want = written_out_masked_ce(logits, targets, mask)
    assert (mask.sum(1) == 4).all()
    assert math.isclose(float(mask_weighted_loss(logits, targets, mask)), want, rel_tol=1e-6)
    # the unmasked patches' logits do not count: change them and the loss stays
    other = torch.where(mask.unsqueeze(-1), logits, torch.randn(b, n, c, generator=g))
    assert math.isclose(float(mask_weighted_loss(other, targets, mask)), want, rel_tol=1e-6)


def tiny_cfg(tmp_path, **train):
    over = {"mask": {"ratio": 0.5, "ratio_schedule": "uniform", "strategy": "mixed", "fill": "learned"}}
    over["train"] = {**TINY["train"], **train}
    return load_config(write_config(tmp_path / "tiny.yaml", over))


def test_the_static_step_trains_exactly_as_the_masked_step(tmp_path):
    # the same seed, the same batch: the same loss, metrics and weights after a step, to float tolerance
    trainers = {}
    for shapes in ("static", "masked"):
        cfg = tiny_cfg(tmp_path, step_shapes=shapes)
        trainers[shapes] = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    static, masked = trainers["static"], trainers["masked"]
    assert static.static and not masked.static
    for _ in range(3):
        batch = static.sampler.sample()
        masked.sampler.sample()  # keep the two samplers in step
        a, b = static.train_step(batch), masked.train_step(batch)
        torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a["acc"], b["acc"])
        torch.testing.assert_close(a["grad_norm"], b["grad_norm"], rtol=1e-4, atol=1e-6)
    d = static.cfg.model.hidden_dim
    for (name, p), q in zip(static.model.named_parameters(), masked.model.parameters(), strict=True):
        if name.endswith("attn.qkv.bias"):
            # the key bias adds q.b_k to every score of a query, which softmax ignores: its true
            # gradient is 0, its float one rounding noise that Adam scales up to lr-sized steps
            p, q = torch.cat([p[:d], p[2 * d :]]), torch.cat([q[:d], q[2 * d :]])
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    assert static.train_metrics.patches == masked.train_metrics.patches  # M per image, not N


def test_static_step_loss_is_the_written_out_cross_entropy_of_the_batch(tmp_path):
    cfg = tiny_cfg(tmp_path, step_shapes="static", lr=1e-9)  # a tiny lr: the weights barely move
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    batch = trainer.sampler.sample()
    with torch.no_grad():
        trainer.model.train()
        want = written_out_masked_ce(trainer.model(batch.patches, batch.mask), batch.targets, batch.mask)
    assert math.isclose(float(trainer.train_step(batch)["loss"]), want, rel_tol=1e-5)


class CountingCompile:
    """Stands in for torch.compile: dynamo with a backend that counts the graphs it is given (no
    inductor, so the test is quick), and the mode it was asked for."""

    def __init__(self):
        from torch._dynamo.testing import CompileCounter

        self.counter = CompileCounter()
        self.modes = []
        self.real = torch.compile

    def __call__(self, model, mode=None, **kwargs):
        self.modes.append(mode)
        return self.real(model, backend=self.counter, **kwargs)


@pytest.mark.parametrize("shapes", ["static", "masked"])
def test_a_compiled_step_under_the_uniform_schedule_stops_compiling_after_its_first_steps(
    tmp_path, monkeypatch, shapes
):
    torch._dynamo.reset()
    fake = CountingCompile()
    monkeypatch.setattr(torch, "compile", fake)
    cfg = tiny_cfg(tmp_path, compile=True, step_shapes=shapes, compile_mode="max-autotune")
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    assert fake.modes == ["max-autotune"]  # train.compile_mode reaches torch.compile
    counts, frames = [], []
    for _ in range(10):
        batch = trainer.sampler.sample()
        counts.append(batch.ids.shape[1])
        trainer.train_step(batch)
        frames.append(fake.counter.frame_count)
    assert len(set(counts)) >= 6  # M changed from step to step (uniform over 1..63)
    assert frames[1] >= 1
    assert frames[-1] == frames[1], (counts, frames)  # nothing compiled after the second step
    torch._dynamo.reset()


def test_the_counter_sees_a_recompile_when_a_size_changes():
    # the control: the same counting compile does count a graph per shape when sizes are static
    torch._dynamo.reset()
    fake = CountingCompile()
    f = fake(lambda x: (x * 2).sum(), dynamic=False)
    f(torch.ones(3))
    f(torch.ones(4))
    assert fake.counter.frame_count == 2
    torch._dynamo.reset()


def test_auto_step_shapes_are_static_for_a_compiled_step_under_a_ratio_schedule():
    def cfg(*sets):
        return config_from_dict(TINY, ["mask.ratio_schedule=uniform", "train.compile=true", *sets])

    assert static_step(cfg())  # on any device: the rule reads the config alone
    assert not static_step(cfg("train.compile=false"))  # eager: the masked last block's fewer FLOPs
    assert not static_step(cfg("mask.ratio_schedule=fixed"))  # M never changes: masked is static too
    assert not static_step(cfg("model.decoder=cross", "mask.fill=learned"))
    assert static_step(cfg("train.compile=false", "train.step_shapes=static"))
    assert not static_step(cfg("train.step_shapes=masked"))


@pytest.mark.parametrize("schedule", ["uniform", "cosine"])
def test_auto_step_shapes_under_each_ratio_schedule_that_varies_the_masked_count(schedule):
    """Uniform and cosine both change M from step to step: a compiled step is static under either, an
    eager one or one with a decoder masked, and an explicit choice is kept."""

    def cfg(*sets):
        return config_from_dict(TINY, [f"mask.ratio_schedule={schedule}", "train.compile=true", *sets])

    assert static_step(cfg())
    assert not static_step(cfg("train.compile=false"))
    assert not static_step(cfg("model.decoder=cross", "mask.fill=learned"))
    assert not static_step(cfg("train.step_shapes=masked"))
    assert static_step(cfg("train.compile=false", "train.step_shapes=static"))


def test_fixed_is_the_one_ratio_schedule_that_keeps_the_masked_count():
    from typing import get_args

    from vitmask.config import RatioSchedule

    assert set(get_args(RatioSchedule)) == {"fixed", "uniform", "cosine"}  # a new one: add it above
    assert not static_step(config_from_dict(TINY, ["mask.ratio_schedule=fixed", "train.compile=true"]))


def test_compile_mode_and_step_shapes_are_recorded_in_the_config_and_hparams(tmp_path):
    cfg = config_from_dict(TINY, ["train.compile_mode=reduce-overhead", "train.step_shapes=static"])
    assert (cfg.train.compile_mode, cfg.train.step_shapes) == ("reduce-overhead", "static")
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg
    hp = flat_hparams(cfg)
    assert hp["train.compile_mode"] == "reduce-overhead" and hp["train.step_shapes"] == "static"
    assert config_from_dict(TINY).train.compile_mode == "default"


@pytest.mark.parametrize(
    "sets,needles",
    [
        (["train.compile_mode=fast"], ("train.compile_mode", "reduce-overhead", "'fast'")),
        (["train.step_shapes=padded"], ("train.step_shapes", "static", "masked")),
        (
            ["train.step_shapes=static", "model.decoder=self", "mask.fill=learned"],
            ("train.step_shapes", "decoder=none", "auto or masked"),
        ),
    ],
)
def test_bad_compile_mode_and_step_shapes_are_refused_in_one_line(tmp_path, capsys, sets, needles):
    cfg = write_config(tmp_path / "c.yaml")
    args = ["train", "--config", cfg, "--run-dir", tmp_path / "run", "--device", "cpu"]
    for s in sets:
        args += ["--set", s]
    res = run_inproc(capsys, *args)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not (tmp_path / "run").exists()  # nothing written
