"""`vitmask finetune`: the classifier on a pretrained encoder, its optimizer groups, the frozen warm-up,
exact resume on the trainer's machinery, the report with its baselines, and bad input."""

import json

import numpy as np
import pytest
import torch

from tests.conftest import TINY, assert_user_error, train_tiny, write_config
from vitmask.config import config_from_dict
from vitmask.data.batches import load_labelled_splits
from vitmask.evaluate.probe import pool_tokens
from vitmask.model.vit import build_model
from vitmask.store.checkpoint import load_checkpoint
from vitmask.train.finetune import FinetuneTrainer

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """30 steps of the tiny masked-patch model on 16x16 shapes, with an EMA."""
    return train_tiny(tmp_path_factory.mktemp("pre"), {"train": {"ema_decay": 0.9}})


def ft_config(**finetune):
    train = {**TINY["train"], "max_steps": 6, "eval_every": 3, "checkpoint_every": 3, "log_every": 3}
    train.update(deterministic=True, weight_decay=0.01, schedule="cosine", warmup_steps=2)
    return config_from_dict({**TINY, "train": train, "finetune": finetune})


def test_the_classifier_starts_from_the_pretrained_ema_and_pools_as_the_probe(pretrained):
    state = load_checkpoint(pretrained)
    cfg = ft_config()
    data = load_labelled_splits(cfg)
    trainer = FinetuneTrainer(cfg, data, CPU, state["ema"])
    encoder = trainer.model.encoder.state_dict()
    assert encoder.keys() == {k for k in state["ema"] if not k.startswith("head.")}
    for k, v in encoder.items():
        assert torch.equal(v, state["ema"][k]), k
    # the features the head reads: the probe's 4x4 grid of token means of the pretrained model
    want = build_model(cfg)
    want.load_state_dict(state["ema"])
    patches = torch.rand(3, 64, 4).round()
    with torch.no_grad():
        feats = pool_tokens(want.eval().forward_encoder(patches), 4)  # (3, 16 * 32)
        got = trainer.model.head(trainer.model.norm(feats))
        assert torch.allclose(trainer.model.eval()(patches), got, atol=1e-6)
    assert trainer.model.head.out_features == len(torch.cat(list(data.labels.values())).unique())


def test_layer_decay_sets_each_groups_lr_and_freeze_steps_hold_the_encoder(pretrained):
    cfg = ft_config(layer_decay=0.5, freeze_steps=2)
    trainer = FinetuneTrainer(cfg, load_labelled_splits(cfg), CPU, load_checkpoint(pretrained)["ema"])
    lr = cfg.train.lr
    want = {"encoder.embed.weight": lr / 8, "encoder.pos": lr / 8, "encoder.blocks.0.attn.qkv.weight": lr / 4}
    want.update({"encoder.blocks.1.ffn.fc2.bias": lr / 2, "encoder.norm.weight": lr, "head.weight": lr})
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            if names[id(p)] in want:
                assert group["initial_lr"] == pytest.approx(want[names[id(p)]]), names[id(p)]
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    for _ in range(2):  # the frozen steps: the head moves, the encoder does not
        trainer.train_step(trainer.sampler.sample())
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if k.startswith("encoder."))
    assert not torch.equal(after["head.weight"], before["head.weight"])
    trainer.train_step(trainer.sampler.sample())
    assert not torch.equal(trainer.model.state_dict()["encoder.embed.weight"], before["encoder.embed.weight"])


def test_a_resumed_finetuning_steps_bit_identically(pretrained, tmp_path):
    cfg = ft_config(layer_decay=0.75, freeze_steps=4)
    short = config_from_dict({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "max_steps": 3}})
    data = load_labelled_splits(cfg)
    writer = FinetuneTrainer(short, data, CPU, load_checkpoint(pretrained)["ema"])
    writer.fit(tmp_path, progress=False)  # last.pt at step 3
    state = load_checkpoint(tmp_path / "last.pt")
    assert state["task"] == "finetune"
    for _ in range(3):
        writer.train_step(writer.sampler.sample())

    other = config_from_dict({**short.to_dict(), "seed": 5})
    reader = FinetuneTrainer(other, data, CPU, None)  # a random encoder, other seeds: all from the checkpoint
    reader.load_state_dict(state)
    for _ in range(3):
        reader.train_step(reader.sampler.sample())
    a, b = writer.model.state_dict(), reader.model.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_the_cli_fine_tunes_resumes_and_reports_the_baselines(run_cli, pretrained, tmp_path):
    config = write_config(tmp_path / "ft.yaml", {"train": {"max_steps": 4, "eval_every": 2, "checkpoint_every": 2}})
    run = tmp_path / "ft"
    args = ["finetune", "--checkpoint", pretrained, "--config", config, "--run-dir", run, "--device", "cpu"]
    res = run_cli(*args, "--json", "--set", "finetune.freeze_steps=1")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.splitlines()[-1])
    assert report["steps"] == 4 and report["test_images"] == 64
    for key in ("finetuned", "from_scratch", "linear_probe"):
        assert 0.0 <= report[key] <= 1.0 and report[key] * 64 == round(report[key] * 64), key
    assert {"config.yaml", "last.pt", "best.pt"} <= {p.name for p in run.iterdir()}

    more = run_cli("finetune", "--run-dir", run, "--resume", "auto", "--set", "train.max_steps=6", "--no-baselines")
    assert more.returncode == 0, more.stderr
    assert "resuming" in more.stdout and "from step 4" in more.stdout
    assert load_checkpoint(run / "last.pt")["step"] == 6
    assert_user_error(
        run_cli("sample", "--checkpoint", run / "last.pt", "--out", tmp_path / "s.png"), "fine-tuned classifier"
    )


def test_bad_finetune_input_is_one_line_and_leaves_nothing(run_cli, pretrained, tmp_path):
    np.savez(tmp_path / "d.npz", images=(np.random.default_rng(0).random((60, 16, 16)) > 0.5).astype(np.uint8))
    unlabelled = write_config(tmp_path / "npz.yaml", {"data": {"source": "npz", "path": str(tmp_path / "d.npz")}})
    run = tmp_path / "run"
    res = run_cli("finetune", "--checkpoint", pretrained, "--config", unlabelled, "--run-dir", run, "--device", "cpu")
    assert_user_error(res, "gives no labels")
    assert not run.exists()

    bigger = write_config(tmp_path / "big.yaml", {"data": {"image_size": 20}})
    res = run_cli("finetune", "--checkpoint", pretrained, "--config", bigger, "--run-dir", run)
    assert_user_error(res, "16x16 images", "20x20", "data.image_size=16")
    assert not run.exists()

    config = write_config(tmp_path / "ok.yaml")
    res = run_cli("finetune", "--checkpoint", pretrained, "--config", config, "--set", "finetune.grid=9")
    assert_user_error(res, "finetune.grid (9)", "8x8 patch grid")
    res = run_cli("finetune", "--resume", pretrained, "--config", config)
    assert_user_error(res, "not a fine-tuning checkpoint")
    assert_user_error(run_cli("finetune", "--config", config), "--checkpoint PATH")
