"""Compile parity (train/parity.py, scripts/check_compile.py): the compiled step's loss and gradients
equal the eager step's, from the same state and batch, at every k-th step of a run.

The inductor cases compile a one-block model on the CPU (and on CUDA where there is one): together
they cover every compile_mode, both step shapes, a ratio schedule, mixed masks, Muon, the EMA and
accum_steps 2. The checker itself is shown to fail on a compiled net that computes a different loss
or gradients, and a checked step under compile to update with the compiled gradients, not the eager
ones. A run that would replay CUDA graphs with gradient accumulation is refused by its own set-up.
"""

import importlib.util

import pytest
import torch

from tests.conftest import ROOT, TINY
from vitmask.config import config_from_dict
from vitmask.data.batches import load_splits
from vitmask.errors import UserError
from vitmask.runtime.process import CUDA_GRAPH_MODES, check_cuda_graphs
from vitmask.train.parity import check_run, tolerance
from vitmask.train.trainer import Trainer, static_step

SMALL = [
    "model.depth=1",
    "data.num_train=64",
    "data.num_val=32",
    "data.num_test=32",
    "data.batch_size=16",
    "mask.strategy=mixed",
    "train.optimizer=muon",
    "train.ema_decay=0.9",
]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]

# each compile_mode and each step shape at least once; a ratio schedule, mixed masks, Muon, EMA, accum 2
CASES = [
    ("default", "static", "uniform", 2),
    ("reduce-overhead", "masked", "cosine", 1),
    ("max-autotune", "masked", "fixed", 2),
]


def small_cfg(*sets: str):
    return config_from_dict(TINY, [*SMALL, *sets])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("mode", "shapes", "schedule", "accum"), CASES)
def test_the_compiled_step_equals_the_eager_step_at_every_checked_step(device, mode, shapes, schedule, accum):
    device = torch.device(device)
    if device.type == "cuda" and mode in CUDA_GRAPH_MODES and accum > 1:
        pytest.skip("refused: CUDA graphs with gradient accumulation (check_cuda_graphs)")
    cfg = small_cfg(
        "train.compile=true",
        f"train.compile_mode={mode}",
        f"train.step_shapes={shapes}",
        f"mask.ratio_schedule={schedule}",
        f"train.accum_steps={accum}",
        "train.max_steps=6",
    )
    torch._dynamo.reset()
    trainer = Trainer(cfg, load_splits(cfg), device)
    assert static_step(cfg) == (shapes == "static")
    results = check_run(trainer, 6, 2, "fp32")
    torch._dynamo.reset()
    assert [r.step for r in results] == [0, 2, 4]
    assert trainer.step == 6
    for r in results:
        assert r.ok, r.line()
        assert r.tol == 1e-4
    # the checked run trained: its loss fell from the first checked step to the last
    assert results[-1].loss_eager < results[0].loss_eager


# the GPU recipe's features (configs/mnist-gpu.yaml): token conv 3, rope2d+learned, learned fill, mixed
# masks, Muon, bf16 autocast; SDPA attention, the path on which cuDNN's backend computed a wrong gradient
GPU_RECIPE = [
    "model.token_conv=3",
    "model.pos=rope2d+learned",
    "mask.fill=learned",
    "mask.ratio_schedule=uniform",
    "model.attention=sdpa",
    "train.precision=bf16",
    "train.muon_dtype=bf16",
    "train.step_shapes=static",
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune"])
def test_the_compiled_bf16_gpu_recipe_step_equals_the_eager_step(mode):
    """On CUDA, in bf16, with the GPU recipe's features: every checked step's gradient is eager's to the
    compile check's bound (cosine 0.999), not the 0.948 a compiled step on cuDNN's SDPA gave."""
    from vitmask.train.compile_check import COSINE_BOUND

    cfg = small_cfg(*GPU_RECIPE, "train.compile=true", f"train.compile_mode={mode}", "train.max_steps=6")
    torch._dynamo.reset()
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cuda"))
    results = check_run(trainer, 6, 2, "bf16")
    torch._dynamo.reset()
    assert [r.step for r in results] == [0, 2, 4]
    for r in results:
        assert r.ok, r.line()
        assert r.grad_cos >= COSINE_BOUND["bf16"], r.line()


@pytest.mark.parametrize("device", DEVICES)
def test_a_second_network_in_the_same_process_trains_as_if_compiled_for_it_alone(device):
    """torch.compile runs a second network of the same class through the code it compiled for the
    first (one graph for both), as a ladder of runs in one process does: the second network's
    checked steps equal eager, and its weights after training equal those of the same run compiled
    afresh (dynamo's caches reset), bit for bit."""
    from torch._dynamo.utils import counters

    device = torch.device(device)
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    sets = ["train.compile=true", f"train.compile_mode={mode}", "train.step_shapes=static", "train.max_steps=6"]
    torch._dynamo.reset()
    counters.clear()
    first_cfg = small_cfg(*sets, "seed=1")
    first = Trainer(first_cfg, load_splits(first_cfg), device)
    for _ in range(3):
        first.train_step(first.sampler.sample())
    graphs = counters["stats"]["unique_graphs"]
    cfg = small_cfg(*sets, "seed=2")
    second = Trainer(cfg, load_splits(cfg), device)  # the first stays alive, as in a ladder
    results = check_run(second, 6, 2, "fp32")
    assert counters["stats"]["unique_graphs"] == graphs  # the second network ran the first one's code
    for r in results:
        assert r.ok, r.line()
    torch._dynamo.reset()
    alone = Trainer(cfg, load_splits(cfg), device)
    check_run(alone, 6, 2, "fp32")
    torch._dynamo.reset()
    for (name, a), b in zip(second.model.state_dict().items(), alone.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert not all(torch.equal(a, b) for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True))


class ScaledLogits(torch.nn.Module):
    """A stand-in for a wrong compiled net: the model's logits times `factor`."""

    def __init__(self, model, factor: float):
        super().__init__()
        self.model, self.factor = model, factor

    def forward(self, *args):
        return self.model(*args) * self.factor


class DoubledGradient(torch.autograd.Function):
    """The identity forward, twice the gradient backward: what a replay that overwrote an earlier
    micro-batch's gradients with its own, then summed them, would give."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class DoublingNet(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return DoubledGradient.apply(self.model(*args))


@pytest.mark.parametrize(
    ("wrap", "loss_off", "grad_off"),
    [(lambda m: ScaledLogits(m, 1.01), True, True), (DoublingNet, False, True)],
    ids=["logits-1pct", "gradients-doubled"],
)
def test_the_check_fails_on_a_net_that_differs_from_the_eager_one(wrap, loss_off, grad_off):
    cfg = small_cfg("train.max_steps=4")
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    trainer.net = wrap(trainer.model)  # what the step calls; trainer.eager() swaps in the plain model
    results = check_run(trainer, 4, 2, "fp32")
    for r in results:
        assert not r.ok
        assert (r.loss_rel > r.tol) == loss_off, r.line()
        assert (r.grad_rel > r.tol) == grad_off, r.line()
    if not loss_off:  # the loss is the same, every gradient twice the eager one: relative error 1
        assert results[0].loss_rel == 0.0
        assert results[0].grad_rel == pytest.approx(1.0, rel=1e-5)


def test_a_checked_step_updates_as_an_unchecked_one():
    """A checked run follows the path of an unchecked one: the same weights after the same steps."""
    cfg = small_cfg("train.max_steps=3")
    splits = load_splits(cfg)
    checked = Trainer(cfg, splits, torch.device("cpu"))
    check_run(checked, 3, 1, "fp32")
    plain = Trainer(cfg, splits, torch.device("cpu"))
    for _ in range(3):
        plain.train_step(plain.sampler.sample())
    for (name, a), b in zip(checked.model.state_dict().items(), plain.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(checked.ema.module.parameters(), plain.ema.module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_tolerances_are_tight_in_fp32_and_loose_under_bf16():
    assert tolerance("fp32") == 1e-4
    assert tolerance("bf16") == 3e-2


@pytest.mark.parametrize(
    ("device", "mode", "accum", "refused"),
    [
        ("cuda", "reduce-overhead", 2, True),
        ("cuda", "max-autotune", 2, True),  # max-autotune captures CUDA graphs too
        ("cuda", "reduce-overhead", 1, False),
        ("cuda", "max-autotune", 1, False),
        ("cuda", "default", 2, False),
        ("cpu", "reduce-overhead", 2, False),  # no CUDA graphs on a CPU
        ("cpu", "max-autotune", 2, False),
    ],
)
def test_gradient_accumulation_under_cuda_graphs_is_refused(device, mode, accum, refused):
    train = small_cfg("train.compile=true", f"train.compile_mode={mode}", f"train.accum_steps={accum}").train
    if refused:
        with pytest.raises(UserError, match=rf"accum_steps=2 with train.compile_mode={mode} on CUDA.*accum_steps=1"):
            check_cuda_graphs(train, torch.device(device))
    else:
        check_cuda_graphs(train, torch.device(device))


def load_script():
    spec = importlib.util.spec_from_file_location("check_compile", ROOT / "scripts" / "check_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_prints_a_line_per_check_and_exits_by_the_verdict(tmp_path, monkeypatch, capsys):
    """scripts/check_compile.py end to end, with torch.compile's aot_eager backend (quick: no
    kernels are generated) as the compiled step, then with a net that is off."""
    import yaml

    script = load_script()
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda net, mode=None: real(net, backend="aot_eager"))
    torch._dynamo.reset()
    sets = [arg for s in SMALL for arg in ("--set", s)]
    assert script.main(["--config", str(config), "--steps", "5", "--every", "2", *sets]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"compile parity: {config} on cpu")
    assert [line.split()[1] for line in out[1:4]] == ["0", "2", "4"]
    assert all(line.endswith(" ok") for line in out[1:4])
    assert out[4].startswith("3 checks, 0 outside tolerance 1e-04")
    # two networks in one process: each is checked, the second with the next seed and the same images
    assert script.main(["--config", str(config), "--steps", "3", "--every", "2", "--networks", "2", *sets]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("checked every 2, 2 network(s) in one process")
    assert out[1] == "network 1 of 2, seed 0"
    assert out[4] == "network 2 of 2, seed 1"
    assert [line.split()[1] for line in (out[2], out[3], out[5], out[6])] == ["0", "2", "0", "2"]
    assert out[7].startswith("4 checks, 0 outside tolerance 1e-04")
    first_loss, second_loss = float(out[2].split()[3]), float(out[5].split()[3])
    assert first_loss != second_loss  # another initialisation
    monkeypatch.setattr(torch, "compile", lambda net, mode=None: ScaledLogits(net, 1.01))
    assert script.main(["--config", str(config), "--steps", "2", "--every", "1"]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    torch._dynamo.reset()
    with pytest.raises(UserError, match=r"--steps, --every and --networks must be >= 1, got 2, 1 and 0"):
        script.main(["--config", str(config), "--steps", "2", "--every", "1", "--networks", "0"])


def test_a_checked_step_under_compile_updates_with_the_compiled_steps_gradients():
    """A compiled net that computes another loss than the eager one (its logits 3x, through
    torch.compile's aot_eager backend): the checked run follows the compiled gradients, bit for bit as
    the same run unchecked, not the eager gradients it was compared against."""
    cfg = small_cfg("train.max_steps=3")
    splits = load_splits(cfg)

    def trainer(compiled: bool) -> Trainer:
        t = Trainer(cfg, splits, torch.device("cpu"))
        if compiled:
            t.net = torch.compile(ScaledLogits(t.model, 3.0), backend="aot_eager")
        return t

    torch._dynamo.reset()
    checked = trainer(compiled=True)
    results = check_run(checked, 3, 1, "fp32")
    assert [r.ok for r in results] == [False] * 3  # the compiled step differs from the eager one
    unchecked, eager = trainer(compiled=True), trainer(compiled=False)
    for t in (unchecked, eager):
        for _ in range(3):
            t.train_step(t.sampler.sample())
    torch._dynamo.reset()
    for (name, a), b in zip(checked.model.state_dict().items(), unchecked.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert not all(torch.equal(a, b) for a, b in zip(checked.model.parameters(), eager.model.parameters(), strict=True))


def test_a_run_with_cuda_graphs_and_gradient_accumulation_is_refused_by_its_set_up(
    monkeypatch, tmp_path, run_cli_in_process
):
    """`vitmask train --device cuda` as a real run sets it up (CUDA made to look available; no memory
    figure): refused in one line before any model is built or moved, the run dir not left behind; the
    fine-tuning trainer's set-up refuses it too."""
    from tests.conftest import assert_user_error, write_config
    from vitmask.data.batches import load_labelled_splits
    from vitmask.model import memory_estimate
    from vitmask.model.vit import build_model
    from vitmask.train.finetune import FinetuneTrainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory_estimate, "available_bytes", lambda device: None)
    built = []
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: built.append(a) or self)
    sets = ["train.compile=true", "train.compile_mode=reduce-overhead", "train.accum_steps=2"]
    config = write_config(tmp_path / "c.yaml")
    args = ["train", "--config", config, "--device", "cuda", "--run-dir", tmp_path / "run"]
    res = run_cli_in_process(*args, *[a for s in sets for a in ("--set", s)])
    assert_user_error(res, "train.accum_steps=2 with train.compile_mode=reduce-overhead on CUDA", "accum_steps=1")
    assert not (tmp_path / "run").exists()
    assert built == []  # no module was moved to the GPU

    cfg = small_cfg(*sets)
    with pytest.raises(UserError, match="accum_steps=2 with train.compile_mode=reduce-overhead"):
        FinetuneTrainer(cfg, load_labelled_splits(cfg), torch.device("cuda"), build_model(cfg).state_dict())
    assert built == []
