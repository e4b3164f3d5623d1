"""Optimisation: no-decay groups, the LR schedule, clipping, accumulation, precision, compile interop."""

import math

import pytest
import torch
from torch import nn

from vitmask.config import config_from_dict
from vitmask.data.batches import load_splits
from vitmask.train.optim import MuonAdamW, lr_factor, param_groups
from vitmask.train.trainer import Trainer

from .conftest import TINY, RecordingLogger

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed: int = 0, **train):
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TINY.items()}
    raw["train"].update(train)
    return config_from_dict({**raw, "seed": seed})


def test_weight_decay_skips_biases_norms_pos_and_mask_token():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.norm = nn.LayerNorm(3)
            self.pos = nn.Parameter(torch.zeros(5, 3))
            self.mask_token = nn.Parameter(torch.zeros(1, 3))
            self.head = nn.Linear(3, 2, bias=False)

    toy = Toy()
    decay, no_decay = param_groups(toy, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(decay["params"]) == ids([toy.fc.weight, toy.head.weight])
    assert ids(no_decay["params"]) == ids([toy.fc.bias, toy.norm.weight, toy.norm.bias, toy.pos, toy.mask_token])


def test_the_real_model_decays_only_its_weight_matrices():
    trainer = Trainer(tiny(optimizer="adamw", weight_decay=0.05), load_splits(tiny()), torch.device("cpu"))
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    decay, no_decay = trainer.optimizer.param_groups
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    assert all(names[id(p)].endswith("weight") and p.ndim == 2 for p in decay["params"])
    assert "pos" in {names[id(p)] for p in no_decay["params"]}
    assert all(p.ndim < 2 or names[id(p)] == "pos" for p in no_decay["params"])
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's orthogonalisation, written out in float64: scale to Frobenius norm 1, then `steps` of
    the quintic X <- a X + (b A + c A^2) X with A = X X^T, on the wide orientation (Jordan et al. 2024)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = g.shape[0] > g.shape[1]
    x = (g.T if tall else g).double()
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def test_muon_steps_the_blocks_matrices_and_adamw_everything_else():
    lr, wd = 0.01, 0.1
    cfg = tiny(optimizer="muon", lr=lr, weight_decay=wd, beta1=0.9, beta2=0.99)
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    assert isinstance(trainer.optimizer, MuonAdamW)
    named = dict(trainer.model.named_parameters())
    # by hand: the 2 blocks' Q/K/V, output, FFN-in and FFN-out matrices; not the patch embedding or the head
    muon_names = {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "ffn.fc1", "ffn.fc2")}
    assert muon_names <= named.keys()
    gen = torch.Generator().manual_seed(0)
    before, grads = {}, {}
    for n, p in named.items():
        before[n], grads[n] = p.detach().clone(), torch.randn(p.shape, generator=gen)
        p.grad = grads[n].clone()
    assert {g["lr"] for g in trainer.optimizer.param_groups} == {lr}  # no warmup: the peak lr from step 0
    trainer.optimizer.step()
    for n, p in named.items():
        w, g = before[n], grads[n]
        if n in muon_names:  # Nesterov on a zero buffer: g + 0.95 g; the step scaled to AdamW's RMS
            rows, cols = g.shape
            want = w * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(rows, cols)) * newton_schulz(1.95 * g)
            tol = 1e-5 * lr * 0.2 * math.sqrt(max(rows, cols))  # float32 on a CPU against float64
        else:  # AdamW's first step: m_hat = g, v_hat = g^2, so lr * g / (|g| + eps)
            decay = wd if p.ndim == 2 and n not in ("pos", "mask_token") else 0.0
            want, tol = w * (1 - lr * decay) - lr * g / (g.abs() + 1e-8), 1e-6
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=tol, msg=n)


@pytest.mark.parametrize(
    ("muon_dtype", "dtype", "rel"), [("fp32", torch.float32, 1e-5), ("bf16", torch.bfloat16, 2e-2)]
)
def test_muon_orthogonalises_in_the_configured_dtype_on_every_device(monkeypatch, muon_dtype, dtype, rel):
    """train.muon_dtype picks the Newton-Schulz dtype (not the device): the step then matches the
    float64 reference within that dtype's rounding, and an fp32 bound fails for bf16."""
    from vitmask.train import optim

    seen, real = [], optim.orthogonalize
    monkeypatch.setattr(optim, "orthogonalize", lambda g, *a: seen.append(g.dtype) or real(g, *a))
    lr = 0.01
    cfg = tiny(optimizer="muon", lr=lr, muon_dtype=muon_dtype)
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    p = trainer.model.blocks[0].ffn.fc1.weight
    w, g = p.detach().clone(), torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
    for q in trainer.model.parameters():
        q.grad = torch.zeros_like(q)
    p.grad = g.clone()
    trainer.optimizer.step()
    assert seen and set(seen) == {dtype}
    scale = lr * 0.2 * math.sqrt(max(p.shape))
    step = (w - p.detach()) / scale  # the orthogonalised update
    err = float((step - newton_schulz(1.95 * g)).abs().max())
    assert err <= rel
    if muon_dtype == "bf16":
        assert err > 1e-4  # bf16's 8-bit mantissa shows: this is not the fp32 iteration


def test_muon_makes_its_momentum_buffers_once(monkeypatch):
    cfg = tiny(optimizer="muon", lr=0.01)
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    for q in trainer.model.parameters():
        q.grad = torch.ones_like(q)
    trainer.optimizer.step()
    muon = trainer.optimizer.muon
    buffers = {id(muon.state[p]["momentum_buffer"]) for g in muon.param_groups for p in g["params"]}
    calls = []
    real = torch.zeros_like
    monkeypatch.setattr(torch, "zeros_like", lambda *a, **k: calls.append(1) or real(*a, **k))
    trainer.optimizer.muon.step()
    assert calls == []  # no buffer allocated and zeroed on a later step
    assert {id(muon.state[p]["momentum_buffer"]) for g in muon.param_groups for p in g["params"]} == buffers


def test_muon_follows_the_schedule_in_every_group():
    cfg = tiny(optimizer="muon", lr=0.01, warmup_steps=4, max_steps=8, schedule="cosine", min_lr=0.001)
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    inner = trainer.optimizer.muon.param_groups + trainer.optimizer.adamw.param_groups
    for step in range(3):
        assert [g["lr"] for g in inner] == pytest.approx([0.01 * lr_factor(step, cfg.train)] * len(inner))
        trainer.optimizer.step()  # no gradients: moves nothing, but keeps the scheduler's order
        trainer.scheduler.step()


def test_warmup_then_cosine_reaches_min_lr():
    t = tiny(lr=1.0, warmup_steps=2, max_steps=6, schedule="cosine", min_lr=0.1).train
    # by hand: warmup 1/2, 2/2; then 0.1 + 0.9 * (1 + cos(pi * k / 3)) / 2 for k = 0..3
    expected = [0.5, 1.0, 1.0, 0.775, 0.325, 0.1]
    assert [lr_factor(s, t) for s in range(6)] == pytest.approx(expected)
    flat = tiny(lr=1.0, warmup_steps=3, max_steps=6).train
    assert [lr_factor(s, flat) for s in range(6)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1])


def test_warmup_then_linear_reaches_min_lr():
    t = tiny(lr=1.0, warmup_steps=2, max_steps=6, schedule="linear", min_lr=0.1).train
    # by hand: warmup 1/2, 2/2; then 1 - 0.9 * k / 3 for k = 0..3, a straight line down to 0.1
    assert [lr_factor(s, t) for s in range(6)] == pytest.approx([0.5, 1.0, 1.0, 0.7, 0.4, 0.1])
    to_zero = tiny(lr=0.5, warmup_steps=0, max_steps=5, schedule="linear").train
    assert [lr_factor(s, to_zero) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_the_optimizer_uses_the_scheduled_lr_at_every_step():
    cfg = tiny(lr=0.01, warmup_steps=2, max_steps=5, schedule="cosine", min_lr=0.001, log_every=1, eval_every=100)
    seen = []
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"), logger=RecordingLogger())
    trainer.optimizer.register_step_pre_hook(lambda opt, a, k: seen.append(opt.param_groups[0]["lr"]))
    trainer.fit(progress=False)
    want = [0.01 * lr_factor(s, cfg.train) for s in range(5)]
    assert seen == pytest.approx(want)
    logged = [m["train/lr"] for _, m in trainer.reporter.logger.rows if "train/lr" in m]
    assert logged == pytest.approx(want)


def test_clipping_bounds_the_gradient_the_optimizer_sees_and_logs_the_raw_norm():
    cfg = tiny(grad_clip=0.05)
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    norms = []
    params = list(trainer.model.parameters())
    trainer.optimizer.register_step_pre_hook(
        lambda *_: norms.append(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params)))
    )
    batch = trainer.sampler.sample()
    # the raw norm, computed independently on a copy of the model
    ref = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    logits = ref.model(batch.patches, batch.mask, batch.ids)
    nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.gather(1, batch.ids).flatten()).backward()
    raw = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref.model.parameters()))
    out = trainer.train_step(batch)
    assert float(out["grad_norm"]) == pytest.approx(raw, rel=1e-5)
    assert raw > 0.05 and norms[0] == pytest.approx(0.05, rel=1e-4)


def test_accumulating_four_micro_batches_gives_the_full_batch_gradient():
    cfg1, cfg4 = tiny(), tiny(accum_steps=4)
    splits = load_splits(cfg1)
    a = Trainer(cfg1, splits, torch.device("cpu"))
    b = Trainer(cfg4, splits, torch.device("cpu"))
    grads = {}
    for name, t in (("a", a), ("b", b)):
        hook = lambda opt, *_, n=name, m=t.model: grads.__setitem__(n, [p.grad.clone() for p in m.parameters()])  # noqa: E731
        t.optimizer.register_step_pre_hook(hook)
    batch = a.sampler.sample()
    la, lb = a.train_step(batch)["loss"], b.train_step(batch)["loss"]
    assert float(la) == pytest.approx(float(lb), abs=1e-6)
    for (name, _), ga, gb in zip(a.model.named_parameters(), grads["a"], grads["b"], strict=True):
        torch.testing.assert_close(ga, gb, atol=1e-6, rtol=1e-4, msg=name)


def test_bf16_autocast_runs_the_forward_in_bf16_and_keeps_fp32_weights():
    cfg = tiny(precision="bf16")
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    dtypes = []
    trainer.model.head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    out = trainer.train_step(trainer.sampler.sample())
    assert dtypes == [torch.bfloat16]
    assert math.isfinite(float(out["loss"]))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


@pytest.mark.parametrize("slowdown, dtype", [(0.5, torch.bfloat16), (95.0, torch.float32)])
def test_auto_precision_trains_in_bf16_only_where_the_cpu_runs_it_natively(monkeypatch, capsys, slowdown, dtype):
    from vitmask.runtime import process

    # 0.5: a CPU with AVX512_BF16 or AMX (a bf16 matmul takes half the fp32 time); 95: an AVX2-only one
    monkeypatch.setattr(process, "cpu_bf16_slowdown", lambda: slowdown)
    process.auto_precision.cache_clear()
    try:
        cfg = tiny(precision="auto")
        trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
        want = "bf16" if dtype == torch.bfloat16 else "fp32"
        assert capsys.readouterr().out.splitlines()[0] == f"train.precision=auto: {want} on this cpu"
        dtypes = []
        trainer.model.head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
        trainer.train_step(trainer.sampler.sample())
        trainer.evaluate()
        assert dtypes[0] == dtype and set(dtypes) == {dtype}  # the step, then validation
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        assert trainer.cfg.train.precision == "auto"  # the config keeps what was asked for
    finally:
        process.auto_precision.cache_clear()


def test_compiled_and_plain_models_share_checkpoints():
    splits = load_splits(tiny())
    compiled = Trainer(tiny(compile=True), splits, torch.device("cpu"))
    assert compiled.net is not compiled.model  # the step calls the torch.compile wrapper
    assert all(k.startswith("_orig_mod.") for k in compiled.net.state_dict())
    plain = Trainer(tiny(seed=1), splits, torch.device("cpu"))
    state = compiled.state_dict()
    assert not any(k.startswith("_orig_mod.") for k in state["model"])
    plain.load_state_dict(state)  # compiled -> plain
    for k, v in compiled.model.state_dict().items():
        assert torch.equal(plain.model.state_dict()[k], v), k
    other = Trainer(tiny(seed=2), splits, torch.device("cpu"))
    prefixed = {**other.state_dict(), "model": torch.compile(other.model).state_dict()}
    compiled.load_state_dict(prefixed)  # keys written by a compiled module load too
    for k, v in other.model.state_dict().items():
        assert torch.equal(compiled.model.state_dict()[k], v), k


@pytest.mark.parametrize(("schedule", "graphs"), [("uniform", 1), ("cosine", 1), ("fixed", 2)])
def test_a_compiled_step_is_traced_once_for_every_masked_count(monkeypatch, schedule, graphs):
    """Under a ratio schedule (uniform or cosine) batches hiding 5, 9 and 13 patches share one graph,
    traced for any M; a fixed ratio keeps torch's default (a static graph first, then a dynamic one
    when M changes)."""
    from torch._dynamo.testing import CompileCounter

    from vitmask.data.batches import make_batch
    from vitmask.data.masking import random_mask

    counter, real_compile = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda net, **_: real_compile(net, backend=counter))  # mode: any
    torch._dynamo.reset()
    cfg = config_from_dict(TINY, [f"mask.ratio_schedule={schedule}", "train.compile=true"])
    trainer = Trainer(cfg, splits := load_splits(cfg), torch.device("cpu"))
    images = splits["train"][:8]
    for m in (5, 9, 13):
        ids, mask = random_mask(8, cfg.data.num_patches, m, torch.Generator().manual_seed(m))
        trainer.train_step(make_batch(images, cfg.data.patch_size, ids, mask))
    torch._dynamo.reset()
    assert counter.frame_count == graphs


def test_optimizer_is_fused_on_cuda_only():
    from vitmask.config import TrainConfig
    from vitmask.train.optim import build_optimizer

    model = torch.nn.Linear(4, 4)
    assert not build_optimizer(model, TrainConfig()).defaults.get("fused")
    if torch.cuda.is_available():
        assert build_optimizer(model.cuda(), TrainConfig()).defaults["fused"] is True
