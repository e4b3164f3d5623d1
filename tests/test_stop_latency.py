"""Stop latency: SIGINT or SIGTERM ends every long phase within one batch (validation, the online probe,
the reconstruction grid, checkpoint saves, eval --nll, probe, sample, the fine-tuned classifier's
passes), a training stopped mid-validation writes its checkpoint and resumes exactly, and validation
scores `train.eval_images` of the val split (docs/guarantees.md "Stop latency", docs/training.md).

Phases are caught in the act by a forward hook that raises the signal on the model's first pass in
that phase; "within one batch" is then the count of passes the phase made: one."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from vitmask.config import config_from_dict, load_config
from vitmask.data.batches import load_labelled_splits, load_splits
from vitmask.errors import Stopped
from vitmask.evaluate import baselines, likelihood, probe
from vitmask.evaluate.probe import OnlineProbe, online_probe
from vitmask.generate.sampling import DecodeOptions, sample_images
from vitmask.model.vit import build_model
from vitmask.signals import Interrupted, StopSignals, check_stop, stop_requested
from vitmask.sizes import num_masked
from vitmask.store import saving
from vitmask.store.checkpoint import load_checkpoint, write_checkpoint_file
from vitmask.train.finetune import FinetuneTrainer, classify
from vitmask.train.trainer import Trainer
from vitmask.train.validation import Validator

from .conftest import ROOT, TINY, RecordingLogger, run_main, train_tiny, write_config

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
STOP_BOUND_S = 10.0  # SIGTERM to exit, on a busy 2-core machine: docs/guarantees.md "Stop latency"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def tiny(train: dict | None = None, data: dict | None = None):
    """TINY with `train` and `data` keys changed."""
    sections = {"data": {**TINY["data"], **(data or {})}, "train": {**TINY["train"], **(train or {})}}
    return config_from_dict({**TINY, **sections})


def signal_on_first_pass(module: nn.Module, passes: list, sig: int = signal.SIGTERM):
    """A forward hook on `module` that counts its passes in `passes` and raises `sig` on the first."""

    def hook(mod, args, out):
        passes.append(1)
        if len(passes) == 1:
            signal.raise_signal(sig)

    return module.register_forward_hook(hook)


def same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---- the stop point -------------------------------------------------------------------------------
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_check_stop_raises_only_after_a_signal_inside_stop_signals_and_forgets_it_after(sig, code):
    check_stop()  # nothing recorded: returns
    with StopSignals() as stop:
        check_stop()
        signal.raise_signal(sig)  # recorded, not acted on
        assert stop.received == sig and stop_requested() == sig
        with pytest.raises(Stopped) as e:
            check_stop()
        assert e.value.code == code and e.value.name == signal.Signals(sig).name
    assert stop_requested() is None
    check_stop()  # the next phase of this process starts clean
    with StopSignals():
        check_stop()


# ---- every long loop stops within one batch -------------------------------------------------------
def run_until_stopped(work, module: nn.Module) -> int:
    """Run `work()` inside StopSignals with SIGTERM raised on `module`'s first pass; it must raise
    Stopped. Returns the passes `module` made."""
    passes: list = []
    handle = signal_on_first_pass(module, passes)
    try:
        with StopSignals(), pytest.raises(Stopped) as e:
            work()
    finally:
        handle.remove()
    assert e.value.code == 143
    return len(passes)


@pytest.fixture(scope="module")
def model_and_images():
    cfg = tiny(data={"num_val": 600})  # 3 validation batches of 256
    torch.manual_seed(0)
    return cfg, build_model(cfg).eval(), load_splits(cfg)


def test_validation_and_its_grid_stop_within_one_batch(model_and_images):
    cfg, model, splits = model_and_images
    validator = Validator(cfg, splits, CPU)
    assert run_until_stopped(lambda: validator.evaluate(model), model.embed) == 1  # of 3 batches
    assert run_until_stopped(lambda: validator.reconstruction(model), model.embed) == 1


def test_nll_sample_and_probe_features_stop_within_one_batch(model_and_images):
    cfg, model, splits = model_and_images
    images = splits["val"][:40]
    # one image per pass (8 rows of 4 strata x 2 draws): 40 passes unstopped
    nll = lambda: likelihood.nll_bound(model, images, 2, strata=4, samples=2, batch_size=8)  # noqa: E731
    assert run_until_stopped(nll, model.embed) == 1
    options = DecodeOptions(steps=8, temperature=1.0, order="random")
    gen = torch.Generator().manual_seed(0)
    assert run_until_stopped(lambda: sample_images(model, 4, 16, 2, options, gen), model.embed) == 1  # of 8 rounds
    assert run_until_stopped(lambda: probe.extract_features(model, splits["val"], 2), model.embed) == 1  # of 3


def test_the_online_probe_and_the_classifier_stop_within_one_batch(model_and_images):
    _, model, _ = model_and_images
    cfg = tiny({"probe_every": 5, "probe_train_images": 300}, {"num_val": 600})
    online = OnlineProbe(cfg, load_labelled_splits(cfg), CPU)
    assert run_until_stopped(lambda: online(model), model.embed) == 1  # of 2 + 3 feature batches
    flat = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4, 3))  # patches (n, 64, 4) -> 3 logits
    images = load_splits(cfg)["val"]
    assert run_until_stopped(lambda: classify(flat, images, 2, "fp32"), flat[1]) == 1  # of 3 batches


@pytest.mark.parametrize("work", ["fit_linear", "knn", "fit_baselines"])
def test_the_loops_without_a_model_stop_before_their_first_batch(work, model_and_images):
    cfg, _, splits = model_and_images
    x, y = torch.randn(3000, 8), torch.arange(3000) % 3
    run = {
        "fit_linear": lambda: probe.fit_linear(x, y, 3, 1e-3, iters=50),
        "knn": lambda: probe.knn_predict(x, y, x, 5, 3),
        "fit_baselines": lambda: baselines.fit_baselines(splits["train"], cfg, 0.5, 0),
    }[work]
    with StopSignals():
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(Stopped):
            run()


# ---- the CLI's verbs (its handler raises at once) -------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("stop"), {"train": {"max_steps": 2, "eval_every": 2}})


@pytest.mark.parametrize(
    "verb",
    [
        ["eval", "--split", "test", "--nll", "--nll-strata", "4"],
        ["probe", "--split", "test"],
        ["sample", "--n", "4", "--steps", "8", "--out", "OUT"],
    ],
    ids=["eval-nll", "probe", "sample"],
)
def test_a_verb_stops_on_its_first_forward_pass_with_one_line_and_writes_nothing(
    verb, trained, tmp_path, capsys, monkeypatch
):
    from vitmask.model import vit

    passes: list = []
    for name in ("forward", "forward_encoder"):
        real = getattr(vit.MaskedPatchViT, name)

        def counted(self, *args, _real=real, **kwargs):
            passes.append(1)
            if len(passes) == 1:
                signal.raise_signal(signal.SIGTERM)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(vit.MaskedPatchViT, name, counted)
    args = [str(tmp_path / "out.png") if a == "OUT" else a for a in verb]
    code, out, err = run_main(capsys, args[0], "--checkpoint", trained, *args[1:], "--device", "cpu")
    assert code == 143, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "stopped by SIGTERM" in lines[0] and out == ""
    assert passes == [1]  # no second pass after the signal
    assert list(tmp_path.iterdir()) == []


# ---- the trainer: saves, the probe, resume --------------------------------------------------------
def test_a_stop_during_a_save_finishes_that_save_and_writes_no_second_one(tmp_path, monkeypatch):
    cfg = tiny({"max_steps": 12, "eval_every": 12, "checkpoint_every": 4})
    writes = []
    real = saving.write_run_checkpoint

    def write(state, run_dir, keep_last):
        writes.append(state["step"])
        if len(writes) == 1:
            signal.raise_signal(signal.SIGTERM)  # arrives while step 4's checkpoint is being written
        return real(state, run_dir, keep_last)

    monkeypatch.setattr(saving, "write_run_checkpoint", write)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(Interrupted) as e:
        Trainer(cfg, load_splits(cfg), CPU).fit(run, progress=False)
    assert e.value.code == 143 and "at step 4;" in str(e.value)
    assert writes == [4] and load_checkpoint(run / "last.pt")["step"] == 4


def test_a_stop_during_the_online_probe_keeps_the_validation_and_the_resume_redoes_only_the_probe(tmp_path):
    train = {"max_steps": 6, "eval_every": 3, "checkpoint_every": 6, "log_every": 3}
    cfg = tiny({**train, "probe_every": 3, "probe_train_images": 100, "deterministic": True})
    data = load_labelled_splits(cfg)

    def trainer(log):
        return Trainer(cfg, data.images, CPU, logger=log, probe=online_probe(cfg, data, CPU))

    whole_log, cut_log, resumed_log = RecordingLogger(), RecordingLogger(), RecordingLogger()
    (tmp_path / "whole").mkdir()
    trainer(whole_log).fit(tmp_path / "whole", progress=False)

    run = tmp_path / "cut"
    run.mkdir()
    cut = trainer(cut_log)
    real, passes = cut.probe, []

    def probe_with_a_signal(model):  # SIGTERM on the probe's first forward pass, at step 3
        handle = signal_on_first_pass(model.embed, passes)
        try:
            return real(model)
        finally:
            handle.remove()

    cut.probe = probe_with_a_signal
    with pytest.raises(Interrupted) as e:
        cut.fit(run, progress=False)
    assert e.value.code == 143 and "at step 3 with its probe left to do;" in str(e.value)
    assert passes == [1]  # abandoned within its first batch
    state = load_checkpoint(run / "last.pt")
    assert state["step"] == 3 and state["pending"] == ["probe"]

    def steps(log, tag):
        return [s for s, m in log.rows if tag in m]

    assert steps(cut_log, "val/loss") == [3] and steps(cut_log, "probe/knn_acc") == []

    resumed = trainer(resumed_log)
    resumed.load_state_dict(state)
    resumed.fit(run, progress=False)
    assert steps(resumed_log, "probe/knn_acc") == [3, 6] and steps(resumed_log, "val/loss") == [6]
    probes = {s: m for s, m in whole_log.rows if "probe/knn_acc" in m}
    assert [m for s, m in resumed_log.rows if "probe/knn_acc" in m] == [probes[3], probes[6]]
    a, b = (load_checkpoint(p / "last.pt") for p in (tmp_path / "whole", run))
    same_tensors(a["model"], b["model"])
    assert b["pending"] == [] and a["best_val_loss"] == b["best_val_loss"] and a["val"] == b["val"]


SLOW_VALIDATION = """
import atexit, sys, time
from vitmask.evaluate import scores
from vitmask.cli.entry import main
atexit.register(time.sleep, 120)  # a stand-in for the interpreter's tear-down, slow under load
batches, calls = scores.eval_batches, []
def slow(*args, **kwargs):  # the second validation (the last step's) takes 100,000 batches
    calls.append(1)
    if len(calls) == 1:
        yield from batches(*args, **kwargs)
        return
    first = next(batches(*args, **kwargs))
    print("validating", flush=True)
    for _ in range(100000):
        time.sleep(0.01)
        yield first
scores.eval_batches = slow
sys.argv = ["vitmask", *sys.argv[1:]]
main()
"""


def test_sigterm_mid_validation_exits_within_the_bound_with_its_checkpoint_and_resumes_exactly(tmp_path, capsys):
    train = {"max_steps": 8, "eval_every": 4, "checkpoint_every": 4, "log_every": 4, "deterministic": True}
    cfg_path = write_config(tmp_path / "c.yaml", {"train": train, "model": {**TINY["model"], "dropout": 0.1}})
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir()
    cfg = load_config(cfg_path)
    Trainer(cfg, load_splits(cfg), CPU).fit(whole, progress=False)  # the unbroken run

    args = ["train", "--config", cfg_path, "--run-dir", cut, "--device", "cpu"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_VALIDATION, *map(str, args)],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        printed = []
        for line in proc.stdout:  # until the last step's validation is under way
            printed.append(line)
            if line == "validating\n":
                break
        assert printed[-1] == "validating\n", (printed, proc.stderr.read())
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert elapsed < STOP_BOUND_S, f"{elapsed:.1f} s from SIGTERM to exit"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"stopped by SIGTERM at step 8 with its validation left to do; checkpoint written to {cut}" in lines[0]
    assert lines[0].endswith(f"resume with: vitmask train --run-dir {cut} --resume auto (the resume does that first)")
    assert "step 8/8  val loss" not in "".join(printed) + out  # the cut validation reported nothing
    state = load_checkpoint(cut / "last.pt")
    assert state["step"] == 8 and state["pending"] == ["validation"]

    code, out, err = run_main(capsys, "train", "--run-dir", cut, "--resume", "auto", "--device", "cpu")
    assert code == 0, err
    assert "resuming" in out and out.count("step 8/8  val loss") == 1  # redone, once
    for name in ("last.pt", "best.pt"):
        a, b = load_checkpoint(whole / name), load_checkpoint(cut / name)
        assert a["step"] == b["step"], name
        same_tensors(a["model"], b["model"])
        assert a["best_val_loss"] == b["best_val_loss"] and a["val"] == b["val"] and b["pending"] == [], name


# ---- validation on train.eval_images ---------------------------------------------------------------
def test_validation_scores_eval_images_spread_over_the_split_the_same_ones_every_time(model_and_images):
    _, model, _ = model_and_images
    m = num_masked(64, 0.5)  # 16x16 images of 2x2 patches at ratio 0.5: 32 masked patches each
    chosen = [0, 4, 9, 13, 17, 22, 26, 30, 35, 39]  # 10 of 40, evenly spaced: round(i * 39 / 9)
    cfg = tiny({"eval_images": 10, "probe_every": 5, "probe_train_images": 50})
    data = load_labelled_splits(cfg)
    data.images["val"], data.labels["val"] = data.images["val"][:40], data.labels["val"][:40]  # a 40-image split
    val = data.images["val"]
    validator = Validator(cfg, data.images, CPU)
    assert torch.equal(validator.images, val[chosen])
    first = validator.evaluate(model)
    assert first["masked_patches"] == 10 * m and validator.evaluate(model) == first
    online = OnlineProbe(cfg, data, CPU)  # the online probe scores the same images, labels alike
    assert torch.equal(online.images["val"], val[chosen])
    assert torch.equal(online.labels["val"], data.labels["val"][chosen])
    classifier = FinetuneTrainer(cfg, data, CPU).validator  # and so does the fine-tuned classifier's validation
    assert torch.equal(classifier.images, val[chosen]) and len(classifier.labels) == 10
    for limit in (0, 40, 10000):  # 0: the whole split; at least its size: the whole split too
        whole = Validator(tiny({"eval_images": limit}), data.images, CPU)
        assert torch.equal(whole.images, val) and whole.evaluate(model)["masked_patches"] == 40 * m


def test_by_default_a_1000_image_val_split_is_validated_whole(model_and_images):
    _, model, _ = model_and_images
    default_train = {k: v for k, v in TINY.items() if k != "train"}  # train.eval_images at its default
    cfg = config_from_dict(default_train | {"data": {**TINY["data"], "num_val": 1100}})
    splits = load_splits(cfg)
    splits["val"] = splits["val"][:1000]  # MNIST's val split in the tests: 1,000 images
    assert Validator(cfg, splits, CPU).evaluate(model)["masked_patches"] == 1000 * num_masked(64, 0.5)


def test_a_checkpoint_with_eval_batches_and_no_pending_entry_resumes_on_as_many_images(tmp_path, capsys):
    assert config_from_dict({"train": {"eval_batches": 3}}).train.eval_images == 768  # 3 batches of 256
    assert config_from_dict({"train": {"eval_batches": 0}}).train.eval_images == 0  # the whole split
    last = train_tiny(tmp_path)
    state = torch.load(last, weights_only=True)
    del state["pending"], state["config"]["train"]["eval_images"]
    state["config"]["train"]["eval_batches"] = 0  # what every checkpoint held before eval_images
    for p in tmp_path.glob("*.pt"):
        p.unlink()
    write_checkpoint_file(state, tmp_path / "last.pt")
    code, out, err = run_main(capsys, "train", "--run-dir", tmp_path, "--resume", "auto", "--set", "train.max_steps=32")
    assert code == 0, err
    resumed = load_checkpoint(tmp_path / "last.pt")
    assert resumed["step"] == 32 and resumed["config"]["train"]["eval_images"] == 0
