"""Rules that a bug could break while every other test passed: each test here fails with its bug.

- fine-tuning: `finetune.shift` S draws every offset of [-S, S], both ends included; the mask of
  `finetune.mask_ratio` follows from (seed, step) alone, so a run resumed with it alone equals an
  unbroken one; the test accuracy of an EMA run is the EMA's;
- a stopped fine-tuning (a signal, a full disk) prints a resume command that works, and
  `vitmask train --resume` of a fine-tuning checkpoint is refused, naming that command;
- `train --init`: every model key that changes what the same weights compute (the norm's position,
  the activation, the heads, mask.fill) is refused, and the keys it lets differ change nothing;
- block masks: each pass draws from exactly the count the earlier passes left uncovered;
- a resume may change `train.compile_mode` and every key docs/guarantees.md lists;
- a fresh run (no --resume) into a dir holding only vitmask's own leftovers is refused.
"""

import errno
import math
import re
import shlex
import signal
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TINY, assert_user_error, train_tiny, write_config
from tests.test_finetune_regularisers import ft_config, one_pixel_images
from vitmask.config import config_from_dict, flatten_config
from vitmask.data import masking
from vitmask.data.batches import load_labelled_splits
from vitmask.data.patches import unpatchify
from vitmask.errors import UserError
from vitmask.model.vit import build_model
from vitmask.store import rundir
from vitmask.store.checkpoint import load_checkpoint, step_path
from vitmask.store.init_weights import WEIGHT_FREE, check_same_model
from vitmask.train import loggers
from vitmask.train.finetune import FinetuneTrainer, LabelledBatchSampler
from vitmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """Four steps of the tiny masked-patch model."""
    train = {"max_steps": 4, "eval_every": 4, "checkpoint_every": 4, "log_every": 4}
    return train_tiny(tmp_path_factory.mktemp("pre"), {"train": train})


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# ---- fine-tuning's regularisers and its test accuracy -------------------------------------------------
def test_shift_draws_every_offset_from_minus_s_to_plus_s():
    shift, batch = 2, 32
    cfg = ft_config(shift=shift)
    images, labels = one_pixel_images(64, 7, 9), torch.arange(64) % 4  # the pixel at (7, 9): 2 moves stay inside
    sampler = LabelledBatchSampler(images, labels, cfg)
    rows, cols = set(), set()
    for _ in range(4):  # 128 draws per axis: a value of 5 missing from all has odds (4/5)^128
        pixels = unpatchify(sampler.sample().patches, cfg.data.patch_size)  # (B, 16, 16)
        where = pixels.flatten(1).argmax(1)  # (B,) the pixel's new place
        rows |= set((where // 16 - 7).tolist())
        cols |= set((where % 16 - 9).tolist())
    assert rows == cols == set(range(-shift, shift + 1)), (rows, cols)
    assert batch == cfg.data.batch_size


def test_the_hidden_patches_of_a_step_do_not_depend_on_the_steps_before():
    cfg = ft_config(mask_ratio=0.4)
    data = load_labelled_splits(cfg)
    walked = LabelledBatchSampler(data.images["train"], data.labels["train"], cfg)
    for _ in range(4):
        walked.sample()
    jumped = LabelledBatchSampler(data.images["train"], data.labels["train"], cfg)
    jumped.seek(4)
    assert torch.equal(walked.sample().mask, jumped.sample().mask)


def test_a_run_resumed_with_the_mask_regulariser_alone_equals_an_unbroken_one(tmp_path):
    cfg = ft_config(mask_ratio=0.4)  # no shift: the mask's generator is seeded by nothing else
    data = load_labelled_splits(cfg)
    for name in ("unbroken", "resumed"):
        (tmp_path / name).mkdir()
    unbroken = FinetuneTrainer(cfg, data, CPU)
    unbroken.fit(tmp_path / "unbroken", progress=False)  # 6 steps, a checkpoint at step 3
    resumed = FinetuneTrainer(config_from_dict({**cfg.to_dict(), "seed": 5}), data, CPU)  # all from the checkpoint
    resumed.load_state_dict(load_checkpoint(step_path(tmp_path / "unbroken", 3)))
    resumed.fit(tmp_path / "resumed", progress=False)
    a, b = unbroken.model.state_dict(), resumed.model.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_the_test_accuracy_of_an_ema_run_is_the_emas():
    cfg = config_from_dict({**ft_config().to_dict()}, ["train.ema_decay=0.5"])
    data = load_labelled_splits(cfg)
    trainer = FinetuneTrainer(cfg, data, CPU)
    labels = trainer.labels["test"]
    counts = torch.bincount(labels, minlength=trainer.num_labels)  # (L,)
    rare, common = int(counts.argmin()), int(counts.argmax())
    assert counts[rare] != counts[common]
    with torch.no_grad():  # each head predicts one class for every image: its accuracy is that class's share
        for model, label in ((trainer.model, rare), (trainer.ema.module, common)):
            model.head.weight.zero_()
            model.head.bias.copy_(torch.nn.functional.one_hot(torch.tensor(label), trainer.num_labels).float())
    want = float(counts[common]) / len(labels)
    assert trainer.test_accuracy(data.images["test"]) == pytest.approx(want, abs=1e-7)


# ---- the resume command of a stopped fine-tuning ------------------------------------------------------
def finetune_config(tmp_path: Path) -> Path:
    train = {"max_steps": 4, "eval_every": 2, "checkpoint_every": 2, "log_every": 2}
    return write_config(tmp_path / "ft.yaml", {"train": train})


def test_a_stopped_finetuning_prints_a_resume_command_that_works(run_cli, pretrained, tmp_path, monkeypatch):
    run = tmp_path / "ft"
    step = Trainer._run_step

    def stop_at_2(self):
        step(self)
        if self.step == 2:
            signal.raise_signal(signal.SIGTERM)  # recorded by the loop: it checkpoints and stops

    monkeypatch.setattr(Trainer, "_run_step", stop_at_2)
    args = ["--checkpoint", pretrained, "--config", finetune_config(tmp_path), "--run-dir", run, "--no-baselines"]
    res = run_cli("finetune", *args)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr
    line = res.stderr.strip()
    # the signal lands before the step's validation, which the stop cuts: the resume redoes it
    head = f"vitmask: stopped by SIGTERM at step 2 with its validation left to do; checkpoint written to {run}"
    assert line.startswith(head), line
    assert line.endswith(" (the resume does that first)"), line
    command = line.split("resume with: ")[1].removesuffix(" (the resume does that first)")
    assert command == f"vitmask finetune --run-dir {run} --resume auto"
    monkeypatch.undo()

    before = files_of(run)
    for resume in (run / "last.pt", "auto"):  # vitmask train refuses it, naming the command that resumes it
        res = run_cli("train", "--run-dir", run, "--resume", resume, "--device", "cpu")
        assert_user_error(res, "is a fine-tuned classifier", f"vitmask finetune --run-dir {run} --resume {resume}")
    res = run_cli("train", "--resume", run / "last.pt")  # the run dir: the checkpoint's folder
    assert_user_error(res, f"vitmask finetune --run-dir {run} --resume {run / 'last.pt'}")
    assert files_of(run) == before

    res = run_cli(*shlex.split(command)[1:])  # the command as printed
    assert res.returncode == 0, res.stderr
    assert load_checkpoint(run / "last.pt")["step"] == 4


def test_a_full_disk_during_finetuning_names_the_finetune_resume(run_cli, pretrained, tmp_path, monkeypatch):
    log = loggers.TensorBoardLogger.log

    def full_at_step_4(self, metrics, step):
        if step >= 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        log(self, metrics, step)

    monkeypatch.setattr(loggers.TensorBoardLogger, "log", full_at_step_4)
    run = tmp_path / "ft"
    args = ["--checkpoint", pretrained, "--config", finetune_config(tmp_path), "--run-dir", run, "--no-baselines"]
    needles = ("training stopped at step 4", "(step 2), is intact", f"vitmask finetune --run-dir {run} --resume auto")
    assert_user_error(run_cli("finetune", *args), *needles)


# ---- train --init: the keys the weights are checked against ---------------------------------------------
# another value for every model key, and mask.fill: the --set it takes (the decoder's keys on CROSS)
CROSS = ["model.decoder=cross", "mask.fill=learned"]
ALTERNATIVES = {
    "model.hidden_dim": ["model.hidden_dim=64"],
    "model.num_heads": ["model.num_heads=4"],
    "model.depth": ["model.depth=3"],
    "model.ffn_dim": ["model.ffn_dim=32"],
    "model.activation": ["model.activation=relu2"],
    "model.norm": ["model.norm=rmsnorm"],
    "model.norm_position": ["model.norm_position=post"],
    "model.qkv_bias": ["model.qkv_bias=false"],
    "model.out_proj": ["model.out_proj=false"],
    "model.zero_init_residual": ["model.zero_init_residual=true"],
    "model.dropout": ["model.dropout=0.1"],
    "model.token_conv": ["model.token_conv=3"],
    "model.num_kv_heads": ["model.num_kv_heads=1"],
    "model.pos": ["model.pos=sincos2d"],
    "model.attention": ["model.attention=explicit"],
    "model.decoder": ["model.decoder=self", "mask.fill=learned"],
    "model.decoder_depth": ["model.decoder_depth=2"],
    "model.decoder_dim": ["model.decoder_dim=16"],
    "model.decoder_heads": ["model.decoder_heads=1"],
    "model.decoder_ffn_dim": ["model.decoder_ffn_dim=16"],
    "model.decoder_self_attn": ["model.decoder_self_attn=true"],
    "mask.fill": ["mask.fill=1.0"],
}


def changes_what_the_weights_compute(base, other) -> bool:
    """Whether `other`'s model differs from `base`'s: other weight shapes, or, loaded with `base`'s
    weights, other outputs in eval mode."""
    torch.manual_seed(0)
    a = build_model(base).eval()
    b = build_model(other).eval()
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys() or any(sa[k].shape != sb[k].shape for k in sa):
        return True
    b.load_state_dict(sa)
    g = torch.Generator().manual_seed(1)
    patches = torch.randint(0, 2, (4, 64, 4), generator=g).float()  # (B, N, P)
    ids = torch.rand(4, 64, generator=g).argsort(1)[:, :20]  # (B, M) 20 hidden patches per image
    mask = torch.zeros(4, 64, dtype=torch.bool).scatter(1, ids, True)  # (B, N)
    with torch.no_grad():
        return not torch.allclose(a(patches, mask), b(patches, mask), atol=1e-5)


def test_init_refuses_every_key_that_changes_what_the_weights_compute():
    model_keys = {k for k in flatten_config(config_from_dict(TINY)) if k.startswith("model.")}
    assert model_keys <= set(ALTERNATIVES), model_keys - set(ALTERNATIVES)  # a new key needs a value here
    for key, sets in ALTERNATIVES.items():
        first = CROSS if key.startswith("model.decoder_") else []
        base, other = config_from_dict(TINY, first), config_from_dict(TINY, first + sets)
        if changes_what_the_weights_compute(base, other):
            changed = "|".join(re.escape(c.split("=")[0]) for c in sets)  # the first key that differs is named
            with pytest.raises(UserError, match=f"--set ({changed})="):
                check_same_model(base, other, Path("w"))
        else:  # only the keys that leave the weights as they are may be let through
            assert key in WEIGHT_FREE, key
    base = config_from_dict(TINY)
    for key in WEIGHT_FREE:  # and those change nothing the weights compute
        assert not changes_what_the_weights_compute(base, config_from_dict(TINY, ALTERNATIVES[key])), key
    # the cases that need the outputs compared: the same weight shapes, or only the final norm's
    for key in ("model.activation", "model.num_heads", "model.norm_position", "mask.fill"):
        assert changes_what_the_weights_compute(base, config_from_dict(TINY, ALTERNATIVES[key])), key


def test_init_from_pre_norm_weights_with_a_post_norm_config_is_one_line(run_cli, pretrained, tmp_path):
    train = {"max_steps": 2, "eval_every": 2, "checkpoint_every": 2}
    for key, value, was in (("norm_position", "post", "pre"), ("activation", "relu2", "gelu")):
        config = write_config(tmp_path / "c.yaml", {"model": {**TINY["model"], key: value}, "train": train})
        run = tmp_path / "run"
        res = run_cli("train", "--config", config, "--init", pretrained, "--run-dir", run, "--device", "cpu")
        assert_user_error(res, f"model.{key}={was}", f"model.{key}={value}", f"--set model.{key}={was}")
        assert not run.exists()


# ---- block masks: the count each pass draws from ----------------------------------------------------------
def test_each_block_pass_draws_from_exactly_the_count_left_uncovered(monkeypatch):
    """One square a pass (aspect 1): pass 0 draws from M, pass 1 from M minus the patches of pass 0's
    square (side round(sqrt(area)), at most the grid), counted by hand from the area drawn."""
    seen = []
    real = masking.block_areas

    def record(missing, min_patches, u, later):
        area, active = real(missing, min_patches, u, later)
        seen.append((missing.clone(), area.clone(), active.clone()))
        return area, active

    monkeypatch.setattr(masking, "block_areas", record)
    grid, m, batch = 8, 30, 64
    g = torch.Generator().manual_seed(0)
    ids, mask = masking.block_mask(batch, grid, m, 4, (1.0, 1.0), g, rounds=1, passes=3)
    assert len(seen) == 3 and torch.equal(mask.sum(1), torch.full((batch,), m))
    (missing0, area0, active0), (missing1, _, _) = seen[0], seen[1]
    assert missing0.tolist() == [m] * batch and active0.all()
    sides = [min(max(round(math.sqrt(a)), 1), grid) for a in area0[:, 0].tolist()]
    assert len(set(sides)) > 1  # squares of several sizes
    assert missing1.tolist() == [m - s * s for s in sides]


# ---- what a resume may change, and where a fresh run may start ----------------------------------------------
def documented_resumable() -> list[str]:
    """The keys docs/guarantees.md says a resume may change."""
    text = (ROOT / "docs" / "guarantees.md").read_text()
    bullet = text[text.index("**A resume keeps its config") :]
    listed = bullet[bullet.index("Only") : bullet.index("may change")]
    names = re.findall(r"`([a-z_.]+)`", listed)
    return [n if "." in n or n == "name" else f"train.{n}" for n in names]


RESUME_VALUES = {
    "train.max_steps": 40,
    "train.eval_every": 7,
    "train.checkpoint_every": 7,
    "train.log_every": 3,
    "train.eval_images": 500,
    "train.keep_last": 5,
    "train.compile": True,
    "train.compile_mode": "max-autotune",
    "train.step_shapes": "static",
    "train.deterministic": True,
    "train.precision": "bf16",
    "train.probe_every": 9,
    "data.path": "elsewhere",
    "data.download": True,
    "name": "renamed",
}


def test_a_resume_may_change_every_key_the_guarantees_list(pretrained):
    documented = documented_resumable()
    assert "train.compile_mode" in documented and len(documented) == len(RESUME_VALUES)
    trained = config_from_dict(load_checkpoint(pretrained)["config"])
    for key in documented:
        asked = config_from_dict(trained.to_dict(), [f"{key}={RESUME_VALUES[key]}"])
        assert flatten_config(asked)[key] != flatten_config(trained)[key], key
        assert [c.split()[0] for c in rundir.reconcile(trained, asked)] == [key]


def test_a_resume_changing_compile_mode_is_resolved_with_the_change(pretrained):
    plan = rundir.resolve(None, ["train.compile_mode=reduce-overhead"], pretrained.parent, "auto")
    assert plan.cfg.train.compile_mode == "reduce-overhead" and plan.state["step"] == 4
    assert plan.changes == ["train.compile_mode 'default' -> 'reduce-overhead'"]


def test_a_fresh_run_into_a_dir_of_vitmask_leftovers_is_refused_without_resume(run_cli, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 3\n")
    (run / "events.out.tfevents.1.host.1.0").write_bytes(b"events")
    before = files_of(run)
    res = run_cli("train", "--config", write_config(tmp_path / "c.yaml"), "--run-dir", run, "--device", "cpu")
    assert_user_error(res, f"run dir {run} already exists and is not empty", "--resume auto")
    assert files_of(run) == before
