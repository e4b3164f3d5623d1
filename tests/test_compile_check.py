"""The compiled step checks itself (train/compile_check.py): a compiled run's first step in each
process runs eager too, the two gradients are compared, and a disagreement stops the run or sends
it on eager, as `train.compile_check` says. SDPA's cuDNN backend is kept out of compiled CUDA steps
(train/sdpa.py).

The planted fault is a compiled net whose gradient for one parameter is three times what the
compiled kernels computed (`ScaledGradient`): the loss is untouched, as in the GPU fault, so only a
gradient comparison can see it.
"""

import math

import pytest
import torch

from tests.conftest import TINY, assert_user_error, write_config
from vitmask.config import config_from_dict
from vitmask.data.batches import load_splits
from vitmask.errors import UserError
from vitmask.train import sdpa
from vitmask.train.compile_check import COSINE_BOUND, CompileCheck
from vitmask.train.parity import StepParity
from vitmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

TORCH_COMPILE = torch.compile
SMALL = ["model.depth=1", "data.num_train=64", "data.num_val=32", "data.num_test=32", "data.batch_size=16"]


class ScaledGradient(torch.nn.Module):
    """A compiled net whose gradient for `param` is `factor` times the one it computes: a hook put on
    the parameter for the next backward only, so the eager pass (the plain module) is untouched."""

    def __init__(self, net, param: torch.nn.Parameter, factor: float = 3.0):
        super().__init__()
        self.net, self.factor = net, factor
        self.param = [param]  # not a submodule's parameter: the net's own are the model's

    def forward(self, *args):
        handle = None

        def scale(grad):
            handle.remove()
            return grad * self.factor

        handle = self.param[0].register_hook(scale)
        return self.net(*args)


def quick_compile(monkeypatch, fault: bool):
    """torch.compile as aot_eager (no kernels generated: quick), with the planted fault when `fault`."""

    def compile_(net, mode=None):
        compiled = TORCH_COMPILE(net, backend="aot_eager")
        if not fault:
            return compiled
        model = net.module if hasattr(net, "module") else net
        return ScaledGradient(compiled, model.head.weight)

    monkeypatch.setattr(torch, "compile", compile_)
    torch._dynamo.reset()


def small_cfg(*sets: str):
    return config_from_dict(TINY, [*SMALL, "train.compile=true", "train.step_shapes=static", *sets])


def test_a_compiled_cpu_run_prints_the_checks_line_and_checks_again_after_a_resume(tmp_path, run_cli_in_process):
    """Real inductor kernels: the first step agrees with eager (fp32 on this config: cosine above
    0.9999), the line is on stdout, in the run dir's compile_check.txt, and a resume checks its own
    first step (step 15) and appends a second line."""
    config = write_config(
        tmp_path / "c.yaml",
        {"model": {"depth": 1, "hidden_dim": 32, "num_heads": 2, "ffn_dim": 64}, "train": {"compile": True}},
    )
    run = tmp_path / "run"
    torch._dynamo.reset()
    res = run_cli_in_process("train", "--config", config, "--run-dir", run, "--set", "train.max_steps=15")
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("compile check")]
    assert len(lines) == 1
    assert lines[0].startswith("compile check at step 0: the compiled step agrees with eager: gradient cosine ")
    assert "cpu, fp32, attention SDPA (torch's choice)" in lines[0]
    cosine = float(lines[0].split("gradient cosine ")[1].split()[0])
    assert COSINE_BOUND["fp32"] <= cosine <= 1.0
    assert (run / "compile_check.txt").read_text().splitlines() == lines
    res = run_cli_in_process("train", "--config", config, "--run-dir", run, "--resume", "auto")
    torch._dynamo.reset()
    assert res.returncode == 0, res.stderr
    kept = (run / "compile_check.txt").read_text().splitlines()
    assert len(kept) == 2 and kept[1].startswith("compile check at step 15: the compiled step agrees")


def test_the_check_stops_a_run_whose_compiled_gradient_is_wrong(tmp_path, monkeypatch, run_cli_in_process):
    """`vitmask train` with the planted fault: one line, exit 2, naming the device, the precision, the
    attention, the figures and the settings that avoid it; no checkpoint, no step applied."""
    quick_compile(monkeypatch, fault=True)
    config = write_config(tmp_path / "c.yaml", {"model": {"depth": 1}, "train": {"compile": True}})
    res = run_cli_in_process("train", "--config", config, "--run-dir", tmp_path / "run")
    torch._dynamo.reset()
    # stderr: the short run's warning and the compile note, then the one error line
    warning, note, rest = res.stderr.split("\n", 2)
    assert warning.startswith("vitmask: warning: train.compile with 30 steps to go")
    assert note.startswith("train.compile: compiling the training step")
    res.stderr = rest
    assert_user_error(
        res,
        "the compiled training step's gradient disagrees with the eager step's at step 0 on cpu (fp32, attention",
        "gradient cosine",
        "largest relative difference 2.00e+00 (head.weight)",
        "--set train.compile=false",
        "--set train.compile_check=eager",
    )
    assert not list((tmp_path / "run").glob("*.pt"))


def test_the_check_with_the_fault_stops_the_trainer_before_any_update(monkeypatch):
    quick_compile(monkeypatch, fault=True)
    cfg = small_cfg()
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(UserError, match=r"gradient cosine 0\.\d+ \(bound 0\.9999\)"):
        trainer.fit(progress=False)
    torch._dynamo.reset()
    assert trainer.step == 0
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_compile_check_eager_warns_and_trains_on_exactly_as_an_eager_run(monkeypatch, capsys):
    """train.compile_check=eager with the planted fault: a warning, the first step applied with the eager
    gradient, the rest eager: the weights at the end equal, bit for bit, those of the run trained eager."""
    quick_compile(monkeypatch, fault=True)
    cfg = small_cfg("train.compile_check=eager", "train.max_steps=4", "train.eval_every=4")
    splits = load_splits(cfg)
    fallen_back = Trainer(cfg, splits, torch.device("cpu"))
    fallen_back.fit(progress=False)
    torch._dynamo.reset()
    err = capsys.readouterr().err
    assert "vitmask: warning: the compiled training step's gradient disagrees" in err
    assert "train.compile_check=eager: this step and the rest of the run go on eager" in err
    assert fallen_back.net is fallen_back.plain_net
    eager_cfg = small_cfg("train.compile=false", "train.max_steps=4", "train.eval_every=4")
    eager = Trainer(eager_cfg, splits, torch.device("cpu"))
    eager.fit(progress=False)
    for (name, a), b in zip(fallen_back.model.state_dict().items(), eager.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_correct_compiled_step_passes_and_trains_with_the_compiled_gradient(monkeypatch, capsys):
    """Without the fault the check agrees (aot_eager computes eager's gradient: cosine 1) and the run
    trains compiled to its end; compile_check=skip runs no eager pass at all."""
    quick_compile(monkeypatch, fault=False)
    cfg = small_cfg("train.max_steps=3", "train.eval_every=3")
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    trainer.fit(progress=False)
    out = capsys.readouterr().out
    assert "compile check at step 0: the compiled step agrees with eager: gradient cosine 1.000000" in out
    assert trainer.net is not trainer.plain_net and trainer.step == 3
    quick_compile(monkeypatch, fault=True)
    off = Trainer(
        small_cfg("train.max_steps=3", "train.eval_every=3", "train.compile_check=skip"),
        load_splits(cfg),
        torch.device("cpu"),
    )
    eager_passes = []
    real_eager = off.eager
    monkeypatch.setattr(off, "eager", lambda: eager_passes.append(1) or real_eager())
    off.fit(progress=False)  # the fault trains on unseen: what the check is for
    torch._dynamo.reset()
    assert eager_passes == [] and "compile check" not in capsys.readouterr().out


def parity(cos: float, loss_rel: float = 0.0) -> StepParity:
    return StepParity(0, 1.0, 1.0, loss_rel, 0.0, cos, "head.weight", 0.1, 1e-4)


@pytest.mark.parametrize(
    ("precision", "cos", "ok"),
    [("fp32", 0.99995, True), ("fp32", 0.9998, False), ("bf16", 0.9992, True), ("bf16", 0.948, False)],
)
def test_the_bound_is_per_precision(precision, cos, ok):
    """fp32 steps agree to 1e-4 in cosine; bf16 ones to 1e-3; the GPU fault's 0.948 is far below both."""
    assert CompileCheck(parity(cos), "cpu", precision, "SDPA").ok == ok


def test_a_loss_that_disagrees_fails_the_check_whatever_the_cosine():
    assert not CompileCheck(parity(1.0, loss_rel=1e-2), "cpu", "fp32", "SDPA").ok


def test_a_compiled_cuda_step_runs_sdpa_without_cudnn_and_restores_the_flags():
    """The scope turns cuDNN's SDPA off inside, for a compiled CUDA step only, and leaves the process's
    flags as they were after (no flag flipped for a user's other code)."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        with sdpa.scoped(torch.device("cuda"), compiled=True):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        for device, compiled in (("cuda", False), ("cpu", True)):
            with sdpa.scoped(torch.device(device), compiled=compiled):
                assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_the_trainer_scopes_the_compiled_pass_and_not_the_eager_one(monkeypatch):
    """compare_step's compiled pass asks for the compiled scope, its eager pass for the plain one."""
    quick_compile(monkeypatch, fault=False)
    asked = []
    real = sdpa.scoped
    monkeypatch.setattr(sdpa, "scoped", lambda device, compiled: asked.append(compiled) or real(device, compiled))
    cfg = small_cfg("train.max_steps=2", "train.eval_every=2")
    Trainer(cfg, load_splits(cfg), torch.device("cpu")).fit(progress=False)
    torch._dynamo.reset()
    assert asked == [True, False, True]  # step 0 compiled then eager (the check), step 1 compiled


@pytest.mark.parametrize(
    ("attention", "device", "precision", "compiled", "name"),
    [
        ("auto", "cuda", "bf16", True, "SDPA (flash, memory-efficient or math; cuDNN off)"),
        ("auto", "cpu", "bf16", True, "explicit softmax"),
        ("explicit", "cuda", "fp32", True, "explicit softmax"),
        ("sdpa", "cuda", "bf16", False, "SDPA (torch's choice)"),
        ("auto", "cpu", "fp32", True, "SDPA (torch's choice)"),
    ],
)
def test_the_attention_is_named_as_it_runs(attention, device, precision, compiled, name):
    assert sdpa.attention_name(attention, torch.device(device), precision, compiled) == name


def test_cosine_of_known_vectors():
    from vitmask.train.parity import _cosine

    a, b = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])
    assert _cosine(a, b) == pytest.approx(1 / math.sqrt(2))
    assert _cosine(a, -a) == pytest.approx(-1.0)
    assert _cosine(torch.zeros(2), torch.zeros(2)) == 1.0


def test_the_cost_script_times_a_plain_and_a_checked_step(tmp_path, monkeypatch, capsys):
    """scripts/bench_compile_check.py on a tiny config (aot_eager: quick): one line with both medians and
    their difference; a bad --repeats is one line."""
    import importlib.util

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("bench_compile_check", ROOT / "scripts" / "bench_compile_check.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    quick_compile(monkeypatch, fault=False)
    config = write_config(tmp_path / "c.yaml")
    sets = [a for s in SMALL for a in ("--set", s)]
    assert script.main(["--config", str(config), "--device", "cpu", "--repeats", "2", *sets]) == 0
    torch._dynamo.reset()
    line = capsys.readouterr().out.strip()
    plain = float(line.split("compiled step ")[1].split(" ms")[0])
    checked = float(line.split("checked step ")[1].split(" ms")[0])
    cost = float(line.split("the check costs ")[1].split(" ms")[0])
    assert cost == pytest.approx(checked - plain, abs=0.11)
    with pytest.raises(UserError, match="--repeats must be >= 1, got 0"):
        script.main(["--config", str(config), "--repeats", "0"])


def test_a_cpu_compile_does_not_print_torchs_cuda_home_line():
    """torch.utils.cpp_extension logs "No CUDA runtime is found" when imported on a machine with a CUDA
    toolkit and no GPU; a CPU run's compile check imports it quietly. A process of its own: the module
    logs once, on its first import."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = (
        "import torch; from vitmask.runtime.process import check_compile; check_compile(torch.device('cpu')); "
        "import torch.utils.cpp_extension as c; print('home', c.CUDA_HOME)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src")}, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("home ")
    assert "No CUDA runtime" not in res.stderr


@pytest.mark.parametrize(
    ("steps", "compile_", "device", "warned"),
    [
        (300, True, "cpu", True),
        (999, True, "cpu", True),
        (1000, True, "cpu", False),
        (300, False, "cpu", False),
        (300, True, "cuda", False),
    ],
)
def test_a_short_compiled_cpu_run_is_told_that_compiling_costs_more_than_it_saves(steps, compile_, device, warned):
    """Under 1,000 steps a CPU compile (30 s to minutes) costs more than the 44 ms a step it saves."""
    from vitmask.runtime.process import short_compiled_run

    cfg = config_from_dict(TINY, [f"train.compile={str(compile_).lower()}", f"train.max_steps={steps}"])
    line = short_compiled_run(cfg, torch.device(device), steps)
    assert (line is not None) == warned
    if warned:
        assert line.startswith(f"train.compile with {steps} steps to go:") and "--set train.compile=false" in line


def test_the_trainer_warns_a_short_compiled_run_once_before_its_first_step(monkeypatch, capsys):
    quick_compile(monkeypatch, fault=False)
    cfg = small_cfg("train.max_steps=2", "train.eval_every=2")
    Trainer(cfg, load_splits(cfg), torch.device("cpu")).fit(progress=False)
    torch._dynamo.reset()
    err = capsys.readouterr().err
    assert err.count("vitmask: warning: train.compile with 2 steps to go") == 1
