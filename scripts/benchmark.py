"""Benchmark vitmask's real training path against a reference timed in the same run.

vitmask: `Trainer(cfg, splits, device)`, `trainer.sampler.sample()`, `trainer.train_step(batch)`.
The reference (scripts/bench_reference.py): the same model as `nn.TransformerEncoder(norm_first=True)`, fed
by a per-sample Dataset + DataLoader that patchifies and masks in `__getitem__`, same config and
batch. Their steps alternate, one each, so both see the same machine load; on a shared machine the
ratio vitmask / reference is the figure to trust, not the absolute numbers.

The reference runs the common way by default: fp32, eager (--ref-autocast / --ref-compile change
that), while vitmask runs as its config says; --autocast and --compile set its train.precision and
train.compile, so the trainer's own autocast and torch.compile are what is timed. Reported for each: training
images/s and tokens/s (median of timed steps after warm-up), the share of the step spent building
the batch (timed alone and inside the step), peak memory (RSS on CPU, max allocated on CUDA),
achieved FLOP/s from the analytic count (vitmask.model.flops) and its percentage of a dense matmul peak
measured in this run (2048^2 fp32 and bf16 on CPU, 8192^3 bf16 on CUDA), and eval images/s.

    python scripts/benchmark.py                                   # the CPU target model, batch 128
    python scripts/benchmark.py --autocast bf16 --compile         # train.precision=bf16, train.compile=true
    python scripts/benchmark.py --set model.hidden_dim=512 --set model.depth=8 --set model.num_heads=8 \\
        --batch 1024 --device cuda                                # the large GPU config
"""

import argparse
import atexit
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Compiled contenders are timed as this code compiles them, in a cache of their own: artifacts that
# older runs left in the shared inductor cache replay their shape guards on a hit, which can pin the
# masked count M and recompile the step for every M until dynamo gives up and runs it eager
# (pytorch/pytorch#194001). A TORCHINDUCTOR_CACHE_DIR set by the caller is kept.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="vitmask-bench-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vitmask.config import load_config  # noqa: E402
from vitmask.data.batches import load_splits  # noqa: E402
from vitmask.errors import UserError  # noqa: E402
from vitmask.model.flops import train_flops_per_image  # noqa: E402
from vitmask.runtime.process import precision_on, resolve_device  # noqa: E402
from vitmask.train.trainer import Trainer, static_step  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from bench_reference import ReferenceRun, reference_flops, unsupported  # noqa: E402

# the benchmark needs a few thousand images, not the full split: step speed does not depend on it
DATA_OVERRIDES = ["data.num_train=4096", "data.num_val=1024", "data.num_test=16"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--batch", type=int, default=128, help="images per step (sets data.batch_size)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--steps", type=int, default=20, help="timed steps for each of vitmask and the reference")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (more with --compile)")
    p.add_argument(
        "--autocast", choices=("none", "bf16", "fp16"), default=None, help="vitmask's train.precision (none = fp32)"
    )
    p.add_argument("--compile", action="store_true", help="vitmask with train.compile=true")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch's default)")
    p.add_argument(
        "--fused-adam", choices=("auto", "on", "off"), default="auto", help="the reference's Adam; auto = on for CUDA"
    )
    p.add_argument(
        "--vs",
        action="append",
        default=[],
        metavar="SPEC",
        help="also time vitmask with comma-separated changes, e.g. model.attention=explicit,autocast=bf16 "
        "(config keys; autocast=X and compile=1 are short for train.precision and train.compile); "
        "interleaved with the others (repeatable)",
    )
    p.add_argument("--no-reference", action="store_true", help="time vitmask only")
    p.add_argument("--ref-workers", type=int, default=0, help="DataLoader workers of the reference")
    p.add_argument(
        "--ref-autocast",
        choices=("none", "bf16", "fp16", "same"),
        default="none",
        help="the reference's precision: none (fp32, the common way) or same as vitmask's train.precision",
    )
    p.add_argument("--ref-compile", action="store_true", help="torch.compile the reference too")
    p.add_argument("--eval-batches", type=int, default=4, help="eval batches (of 256 images) to time")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print a torch.profiler table of N steps")
    p.add_argument("--json", default="", help="also write every figure to this JSON file")
    p.add_argument(
        "--mask-timing",
        default="",
        metavar="B1,B2",
        help="also time building random, block and mixed masks at these batch sizes, e.g. 16,1024",
    )
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def autocast_ctx(device: torch.device, kind: str):
    if kind == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if kind == "bf16" else torch.float16)


def matmul_peak(n_max: int, dtype: torch.dtype, device: torch.device, reps: int = 5, budget_s: float = 0.05) -> float:
    """FLOP/s of the best of `reps` timed n x n x n matmuls (2 n^3 FLOPs each). n doubles from 256 up
    to n_max while one matmul takes under budget_s: a CPU without bf16 instructions (AVX2 only)
    emulates bf16 about 100x slower than fp32, and 2048^3 would take minutes there."""
    n = 256
    while True:
        a = torch.randn(n, n, device=device, dtype=dtype)  # (n, n)
        b = torch.randn(n, n, device=device, dtype=dtype)  # (n, n)
        a @ b  # warm-up
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        if n >= n_max or time.perf_counter() - t >= budget_s:
            break
        n *= 2
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def use_fused_adam(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The reference's Adam, fused (CUDA)."""
    return torch.optim.Adam(model.parameters(), lr=lr, fused=True)


class Timed:
    """Step times of one contender: the whole step, and the batch-building part inside it."""

    def __init__(self, name: str, sample, step, device: torch.device, amp: str):
        self.name, self._sample, self._step, self.device, self.amp = name, sample, step, device, amp
        self.step_s: list[float] = []
        self.sample_in_step_s: list[float] = []

    def run(self, record: bool = True) -> None:
        t0 = time.perf_counter()
        batch = self._sample()
        sync(self.device)  # only so that the batch-building share can be read; the trainer never syncs here
        t1 = time.perf_counter()
        with autocast_ctx(self.device, self.amp):
            self._step(batch)
        sync(self.device)
        t2 = time.perf_counter()
        if record:
            self.step_s.append(t2 - t0)
            self.sample_in_step_s.append(t1 - t0)

    def sample_alone_s(self, n: int) -> float:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            self._sample()
            sync(self.device)
            times.append(time.perf_counter() - t)
        return statistics.median(times)


def eval_images_per_s(trainer: Trainer, batches: int) -> float:
    """Images/s of `trainer.evaluate` (which runs under the trainer's own precision)."""
    trainer.evaluate(max_batches=1)  # warm-up
    sync(trainer.device)
    t = time.perf_counter()
    trainer.evaluate(max_batches=batches)
    sync(trainer.device)
    images = min(batches * 256, len(trainer.validator.images))
    return images / (time.perf_counter() - t)


def summarise(t: Timed, batch: int, tokens: int, flops: int, peak: float, memory_mb: float) -> dict:
    step = statistics.median(t.step_s)
    ips = batch / step
    return {
        "step_ms": 1000 * step,
        "images_per_s": ips,
        "tokens_per_s": ips * tokens,
        "batch_ms_in_step": 1000 * statistics.median(t.sample_in_step_s),
        "batch_share_in_step": statistics.median(t.sample_in_step_s) / step,
        "achieved_gflops": ips * flops / 1e9,
        "pct_of_peak": 100 * ips * flops / peak,
        "peak_memory_mb": memory_mb,
    }


PRECISION = {"none": "fp32", "bf16": "bf16", "fp16": "fp16"}  # --autocast value -> train.precision


def parse_vs(spec: str) -> list[str]:
    """'model.attention=explicit,autocast=bf16,compile=1' -> config overrides for vitmask."""
    overrides = []
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key == "autocast":
            if value not in PRECISION:
                raise UserError(f"--vs autocast must be none, bf16 or fp16, got {value!r}")
            overrides.append(f"train.precision={PRECISION[value]}")
        elif key == "compile":
            overrides.append(f"train.compile={str(value.lower() in ('1', 'true', 'on', 'yes')).lower()}")
        else:
            overrides.append(item)
    return overrides


def vitmask_flops(cfg) -> int:
    """vitmask's training FLOPs per image: the last block computes only the masked tokens, or every
    token where the step keeps static shapes (train.step_shapes, trainer.static_step)."""
    return train_flops_per_image(cfg, masked_last_block=not static_step(cfg))


def mask_timing(cfg, device: torch.device, batches: list[int], reps: int = 7) -> dict:
    """Milliseconds to build one batch of random, block and mixed masks at the config's grid and
    masked count, for each batch size: the best of `reps` calls, the three interleaved."""
    from vitmask.data.masking import block_mask, mixed_mask, random_mask
    from vitmask.sizes import num_masked

    m, grid, n = num_masked(cfg.data.num_patches, cfg.mask.ratio), cfg.data.grid, cfg.data.num_patches
    mixed_cfg = dataclasses.replace(cfg.mask, strategy="mixed")
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for b in batches:
        build = {
            "random": lambda b=b: random_mask(b, n, m, g, device),
            "block": lambda b=b: block_mask(b, grid, m, cfg.mask.block_min_patches, cfg.mask.block_aspect, g, device),
            "mixed": lambda b=b: mixed_mask(mixed_cfg, b, grid, m, g, device),
        }
        best = dict.fromkeys(build, math.inf)
        for _ in range(reps):
            for name, f in build.items():
                t = time.perf_counter()
                f()
                sync(device)
                best[name] = min(best[name], time.perf_counter() - t)
        out[b] = {name: 1000 * v for name, v in best.items()}
    return out


def print_mask_timing(timing: dict, cfg) -> None:
    print(
        f"\nmask building, ms per batch (grid {cfg.data.grid}, M at ratio {cfg.mask.ratio}, "
        f"block share {cfg.mask.block_share} in mixed)"
    )
    for b, t in timing.items():
        print(
            f"  batch {b:>5}: random {t['random']:8.2f}  block {t['block']:8.2f}  mixed {t['mixed']:8.2f}  "
            f"mixed/random {t['mixed'] / t['random']:.2f}x  mixed per image {1000 * t['mixed'] / b:.1f} us"
        )


def parse_batches(spec: str) -> list[int]:
    """'16,1024' -> [16, 1024]; '' -> []."""
    try:
        batches = [int(b) for b in spec.split(",") if b.strip()]
    except ValueError:
        batches = [0]
    if any(b < 1 for b in batches):
        raise UserError(f"--mask-timing takes batch sizes >= 1 separated by commas, e.g. 16,1024; got {spec!r}")
    return batches


def build_vitmask(cfg, splits, device, name: str) -> tuple[Trainer, Timed]:
    """vitmask as it trains: the trainer applies its own autocast, compile and optimizer."""
    trainer = Trainer(cfg, splits, device)
    return trainer, Timed(name, trainer.sampler.sample, trainer.train_step, device, "none")


def matmul_peak_for(cfg, peaks: dict[str, float]) -> float:
    """The yardstick: the bf16 peak whenever autocast is on or on CUDA, else fp32's."""
    if "fp32" not in peaks:  # CUDA
        return peaks["bf16"]
    return peaks["fp32"] if precision_on(cfg.train.precision, torch.device("cpu")) == "fp32" else peaks["bf16"]


def profile_steps(t: Timed, n: int) -> None:
    """A torch.profiler table of n steps. Compiled CPU steps show inductor's kernels by name only
    if they were compiled with `cpp.enable_kernel_profile` (set in main when --profile is given)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if t.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            t.run(record=False)
    key = "self_cuda_time_total" if t.device.type == "cuda" else "self_cpu_time_total"
    print(f"\n--- torch.profiler: {n} {t.name} steps, by self time ---")
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=48))


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.profile:
        from torch._inductor import config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # name each generated C++ kernel in the profile
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    specs = [(spec, parse_vs(spec)) for spec in args.vs]  # bad specs fail before any work
    mask_batches = parse_batches(args.mask_timing)
    ours_sets = []
    if args.autocast is not None:
        ours_sets.append(f"train.precision={PRECISION[args.autocast]}")
    if args.compile:
        ours_sets.append("train.compile=true")
    base = [*DATA_OVERRIDES, f"data.batch_size={args.batch}", *args.set]
    cfg = load_config(args.config, [*base, *ours_sets])
    fused = args.fused_adam == "on" or (args.fused_adam == "auto" and device.type == "cuda")
    if not args.no_reference and unsupported(cfg):
        print(f"reference skipped: {unsupported(cfg)}; timing vitmask alone")
        args.no_reference = True
    m = cfg.model
    print(
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.node()}  torch {torch.__version__}  "
        f"device {device}{' ' + torch.cuda.get_device_name() if device.type == 'cuda' else ''}  "
        f"threads {torch.get_num_threads()}  cpus {os.cpu_count()}  load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"model d={m.hidden_dim} depth {m.depth} heads {m.num_heads} kv {m.kv_heads} ffn {m.ffn_dim} "
        f"{m.activation} {m.norm} pos {m.pos} attention {m.attention}; tokens {cfg.data.num_patches}, "
        f"batch {args.batch}; precision {cfg.train.precision}, compile {cfg.train.compile}; "
        f"reference fused adam {fused}, "
        f"reference autocast {args.ref_autocast}, compile {args.ref_compile}"
    )

    # dense matmul peaks, in this run
    if device.type == "cuda":
        peaks = {"bf16": matmul_peak(8192, torch.bfloat16, device)}
    else:
        peaks = {"fp32": matmul_peak(2048, torch.float32, device), "bf16": matmul_peak(2048, torch.bfloat16, device)}
    peak = matmul_peak_for(cfg, peaks)
    print("matmul peak: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in peaks.items()))

    splits = load_splits(cfg)
    flops = vitmask_flops(cfg)
    warmup = args.warmup + (3 if cfg.train.compile else 0)

    # vitmask, alone first, so its peak memory is its own
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer, ours = build_vitmask(cfg, splits, device, "vitmask")
    for _ in range(warmup):
        ours.run(record=False)
    mem_ours = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else peak_rss_mb()

    contenders = [ours]
    if not args.no_reference:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ref = ReferenceRun(cfg, splits["train"], device, num_workers=args.ref_workers)
        if fused:
            ref.optimizer = use_fused_adam(ref.model, cfg.train.lr)
        if args.ref_compile:
            ref.model = torch.compile(ref.model)
        ours_amp = {v: k for k, v in PRECISION.items()}[precision_on(cfg.train.precision, device)]
        ref_amp = ours_amp if args.ref_autocast == "same" else args.ref_autocast
        theirs = Timed("reference", ref.sample, ref.train_step, device, ref_amp)
        for _ in range(args.warmup + (3 if args.ref_compile else 0)):
            theirs.run(record=False)
        contenders.append(theirs)
    variants = []
    for spec, overrides in specs:
        vcfg = load_config(args.config, [*base, *ours_sets, *overrides])
        vsplits = splits if vcfg.data == cfg.data else load_splits(vcfg)  # e.g. another data.image_size
        vtrainer, v = build_vitmask(vcfg, vsplits, device, spec)
        for _ in range(args.warmup + (3 if vcfg.train.compile else 0)):
            v.run(record=False)
        variants.append((v, vtrainer, vcfg, matmul_peak_for(vcfg, peaks)))
        contenders.append(v)
    for _ in range(args.steps):  # alternate, so both see the same load
        for c in contenders:
            c.run()
    mem_ref = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else peak_rss_mb()

    results = {
        "date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
        "host": platform.node(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": " ".join(sys.argv),
        "config": cfg.to_dict(),
        "precision": cfg.train.precision,
        "compile": cfg.train.compile,
        "matmul_peak_gflops": {k: v / 1e9 for k, v in peaks.items()},
        "train_gflop_per_image": flops / 1e9,
        "reference_train_gflop_per_image": reference_flops(cfg) / 1e9,
    }
    tokens = cfg.data.num_patches
    results["vitmask"] = summarise(ours, args.batch, tokens, flops, peak, mem_ours)
    results["vitmask"]["batch_share_alone"] = ours.sample_alone_s(10) / statistics.median(ours.step_s)
    results["vitmask"]["eval_images_per_s"] = eval_images_per_s(trainer, args.eval_batches)
    if not args.no_reference:
        ref_peak = peaks["bf16"] if ref_amp != "none" or device.type == "cuda" else peaks["fp32"]
        ref_flops = reference_flops(cfg)  # it computes every token in every block
        results["reference"] = summarise(theirs, args.batch, tokens, ref_flops, ref_peak, mem_ref)
        results["reference"]["batch_share_alone"] = theirs.sample_alone_s(10) / statistics.median(theirs.step_s)
        results["ratio"] = results["vitmask"]["images_per_s"] / results["reference"]["images_per_s"]
    results["variants"] = {}
    for v, vtrainer, vcfg, vpeak in variants:
        # a variant may change data.batch_size or the image size: its own images per step and tokens
        vd = vcfg.data
        out = summarise(v, vd.batch_size, vd.num_patches, vitmask_flops(vcfg), vpeak, float("nan"))
        out["precision"], out["compile"] = vcfg.train.precision, vcfg.train.compile
        out["eval_images_per_s"] = eval_images_per_s(vtrainer, args.eval_batches)
        out["vs_vitmask"] = out["images_per_s"] / results["vitmask"]["images_per_s"]
        if "reference" in results:
            out["vs_reference"] = out["images_per_s"] / results["reference"]["images_per_s"]
        results["variants"][v.name] = out

    print_table(results, device)
    if mask_batches:
        results["mask_timing_ms"] = mask_timing(cfg, device, mask_batches)
        print_mask_timing(results["mask_timing_ms"], cfg)
    if args.profile:
        profile_steps(ours, args.profile)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


def print_table(r: dict, device: torch.device) -> None:
    mem = "peak max-allocated MB" if device.type == "cuda" else "peak RSS MB"
    rows = [
        ("train images/s", "images_per_s", "{:.1f}"),
        ("train tokens/s", "tokens_per_s", "{:,.0f}"),
        ("step ms (median)", "step_ms", "{:.1f}"),
        ("batch building ms, in step", "batch_ms_in_step", "{:.2f}"),
        ("batch share of step, in step", "batch_share_in_step", "{:.1%}"),
        ("batch share of step, alone", "batch_share_alone", "{:.1%}"),
        ("achieved GFLOP/s", "achieved_gflops", "{:.0f}"),
        ("% of matmul peak", "pct_of_peak", "{:.0f}%"),
        (mem, "peak_memory_mb", "{:.0f}"),
        ("eval images/s", "eval_images_per_s", "{:.0f}"),
    ]
    names = [n for n in ("vitmask", "reference") if n in r]
    print(f"\n{'':<30}" + "".join(f"{n:>12}" for n in names))
    for label, key, fmt in rows:
        cells = [fmt.format(r[n][key]) if key in r[n] else "-" for n in names]
        print(f"{label:<30}" + "".join(f"{c:>12}" for c in cells))
    print(
        f"analytic training FLOPs per image: {r['train_gflop_per_image']:.3f} GFLOP "
        f"(the reference, every token in every block: {r['reference_train_gflop_per_image']:.3f})"
    )
    if "ratio" in r:
        print(f"vitmask / reference (train images/s): {r['ratio']:.2f}x")
    for name, v in r["variants"].items():
        vs_ref = f", {v['vs_reference']:.2f}x the reference" if "vs_reference" in v else ""
        print(
            f"vitmask [{name}]: {v['images_per_s']:.1f} images/s ({v['pct_of_peak']:.0f}% of peak), "
            f"step {v['step_ms']:.1f} ms, eval {v['eval_images_per_s']:.0f} images/s: "
            f"{v['vs_vitmask']:.2f}x vitmask{vs_ref} in images/s"
        )


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
