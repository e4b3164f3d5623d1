"""Device, precision, compilation and randomness, decided once per process (`prepare_process`).

Precision: fp32 runs as is; bf16 runs the forward pass under `torch.autocast`; fp16 adds a
`GradScaler` and needs CUDA. On CPU the autocast context is `nullcontext()` for fp32, so no
`torch.cuda` call is made on a CPU path. bf16 on a CPU without bf16 instructions (AVX2 only) gets
a warning: torch emulates it there, about 100x slower than fp32 (docs/benchmarks.md). `auto` is
bf16 where the device runs bf16 matmuls natively (a CUDA GPU with bf16; a CPU with AVX512_BF16 or
AMX, where one takes about half the fp32 time) and fp32 elsewhere, decided once per process and
device type (`precision_on`); the config keeps `auto`, the run's first line says what it ran.
"""

import contextlib
import ctypes
import ctypes.util
import functools
import os
import random
import shutil
import time

import numpy as np
import torch

from vitmask.config import Config
from vitmask.errors import UserError, warn
from vitmask.runtime.distributed import World, check_batch

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu. Asking for cuda without one is a user error."""
    if name not in DEVICES:
        raise UserError(f"unknown device '{name}'; use one of {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but torch sees no CUDA GPU here; use --device cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def api_device(device, what: str = "device") -> torch.device:
    """The `device` argument of the Python API's loaders, checked before any tensor moves: a str or a
    torch.device naming the CPU, a CUDA GPU torch sees (cuda, cuda:K) or `auto` (CUDA when there is one).
    Anything else (another type, a device type torch does not know, `meta`, which holds no weights, a
    GPU that is not there) is a UserError naming `what`."""
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        if device == "auto":
            return resolve_device("auto")
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError):
            raise UserError(f"{what} {device[:40]!r} is not a device; use 'cpu', 'cuda', 'cuda:K' or 'auto'") from None
    else:
        raise UserError(
            f"{what} must be a str or a torch.device ('cpu', 'cuda', 'auto'), got type {type(device).__name__}"
        )
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"{what} {str(dev)!r} was asked for, but torch sees no CUDA GPU here; use 'cpu' or 'auto'")
        if dev.index is not None and dev.index >= count:
            raise UserError(f"{what} {str(dev)!r}: torch sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
        return dev
    raise UserError(f"{what} {str(dev)!r} is not one vitmask runs models on; use 'cpu', 'cuda', 'cuda:K' or 'auto'")


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context the forward pass runs in: autocast for bf16/fp16, nothing for fp32 (auto: either)."""
    precision = precision_on(precision, device)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


BF16_TOO_SLOW = 4.0  # bf16/fp32 time of one matmul above which a CPU is taken to emulate bf16


def cpu_bf16_slowdown(size: int = 256, repeats: int = 5) -> float:
    """How many times longer one size x size matmul takes in bf16 than in fp32 here (best of `repeats`
    each, a few ms in all): about 0.5 on a CPU with bf16 instructions (AVX512_BF16 or AMX), about 100
    on one that emulates them."""
    a = torch.randn(size, size)
    best = []
    for dtype in (torch.float32, torch.bfloat16):
        x = a.to(dtype)
        x @ x  # the first call pays for dispatch and packing
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x @ x
            times.append(time.perf_counter() - start)
        best.append(min(times))
    return best[1] / best[0]


def precision_on(precision: str, device: torch.device) -> str:
    """The precision a run uses on `device`: `precision` itself, or what `auto` resolves to there."""
    return auto_precision(device.type) if precision == "auto" else precision


@functools.cache
def auto_precision(device_type: str) -> str:
    """train.precision=auto on a device type: bf16 where its bf16 matmuls are native (CUDA with bf16
    support; a CPU where one takes less time than in fp32), else fp32. Timed once per process."""
    if device_type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if device_type == "cpu":
        return "bf16" if cpu_bf16_slowdown() < 1.0 else "fp32"
    return "fp32"


def check_precision(precision: str, device: torch.device) -> None:
    if precision == "bf16" and device.type == "cpu" and (slowdown := cpu_bf16_slowdown()) > BF16_TOO_SLOW:
        warn(
            f"train.precision=bf16: this CPU runs bf16 matmuls {slowdown:.0f}x slower than fp32 (it has no "
            "bf16 instructions, so torch emulates them); --set train.precision=fp32 trains far faster here"
        )
    if precision == "fp16" and device.type != "cuda":
        raise UserError(
            "train.precision=fp16 needs a CUDA GPU (fp16 autocast with a GradScaler); "
            "on CPU use --set train.precision=bf16 or fp32"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("train.precision=bf16 is not supported by this GPU; use --set train.precision=fp16 or fp32")


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that scales only for fp16; for fp32/bf16 it is disabled and passes through."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def check_compile(device: torch.device) -> None:
    """Raise a UserError when torch.compile cannot work here (before any compilation is tried)."""
    if not torch._dynamo.is_dynamo_supported():
        raise UserError("train.compile=true, but torch.compile is not supported here; use --set train.compile=false")
    if device.type == "cpu":
        quiet_cuda_home_lookup()
        from torch._inductor import config as inductor_config

        candidates = [c for c in inductor_config.cpp.cxx if c]
        if not any(shutil.which(c) for c in candidates):
            raise UserError(
                f"train.compile=true on CPU needs a C++ compiler ({', '.join(candidates)}) and none was found; "
                "install one, set CXX, or use --set train.compile=false"
            )


# the torch.compile modes that capture the step as CUDA graphs on CUDA (max-autotune turns them on too;
# max-autotune-no-cudagraphs, which vitmask does not offer, is the one that does not)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def uses_cuda_graphs(train, device: torch.device) -> bool:
    """Whether the compiled step is captured and replayed as CUDA graphs (train.compile_mode, on CUDA)."""
    return train.compile and train.compile_mode in CUDA_GRAPH_MODES and device.type == "cuda"


# Below this many steps a compiled run on a CPU waits longer for its compile than compiling saves:
# configs/mnist.yaml's compiled step takes 54 ms against eager's 98.5 (docs/results.md, "Ten minutes
# on two cores"), 44 ms saved a step, while the first compile takes 30 to 45 s with a warm cache
# (minutes with a cold one): about 1,000 steps to break even with a warm cache.
SHORT_COMPILED_RUN = 1000


def short_compiled_run(cfg: Config, device: torch.device, steps_left: int) -> str | None:
    """The warning for a compiled CPU run too short to gain from compiling (None when it is not one)."""
    if not cfg.train.compile or device.type != "cpu" or steps_left >= SHORT_COMPILED_RUN:
        return None
    return (
        f"train.compile with {steps_left} steps to go: compiling the step takes 30 s to several minutes on "
        f"a CPU, more than it saves under about {SHORT_COMPILED_RUN} steps (44 ms a step for configs/mnist.yaml); "
        "--set train.compile=false trains it sooner"
    )


def quiet_cuda_home_lookup() -> None:
    """Import torch.utils.cpp_extension (inductor's C++ builds read it) with its logger held at ERROR.

    On import it looks for a CUDA toolkit, and on a machine with one but no GPU it logs "No CUDA
    runtime is found, using CUDA_HOME=..." to the terminal of a user who trains on the CPU, a line
    about nothing they asked for. The lookup runs once per process; the logger's level is restored."""
    import logging

    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension  # noqa: F401
    finally:
        logger.setLevel(level)


def check_cuda_graphs(train, device: torch.device) -> None:
    """Refuse gradient accumulation under CUDA graphs (compile_mode reduce-overhead or max-autotune on CUDA).

    Each replay of a CUDA graph writes its outputs, the backward's gradients among them, into the
    same memory of the graph's pool. The gradients of a step's first micro-batch would be that
    memory, and the next micro-batch's replay would overwrite them before they are summed: the
    step would apply the last micro-batch's gradient twice, silently (or torch raises "accessing
    tensor output of CUDAGraphs that has been overwritten"). One micro-batch a step keeps every
    replay's gradients alive until the optimizer has read them.
    """
    if uses_cuda_graphs(train, device) and train.accum_steps > 1:
        raise UserError(
            f"train.accum_steps={train.accum_steps} with train.compile_mode={train.compile_mode} on CUDA: each "
            "CUDA-graph replay would overwrite the gradients of the step's earlier micro-batches; use --set "
            "train.accum_steps=1 (a smaller data.batch_size per GPU, or more GPUs) or --set train.compile_mode=default"
        )


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc mallopt parameters (malloc.h)
ALLOCATOR_ENV = ("GLIBC_TUNABLES", "LD_PRELOAD")  # besides every MALLOC_* variable
_allocator_tuned = False


def keep_freed_memory() -> bool:
    """Make glibc malloc keep freed memory in the process instead of handing it back to the OS.

    By default glibc serves every block over its mmap threshold (128 KB, rising to at most 32 MB)
    with a fresh mmap and unmaps it on free, so each training step page-faults its activations in
    again (a (B, H, N, N) bf16 score tensor at batch 128 is 67 MB). On the 2-core VM of
    docs/benchmarks.md this costs up to 2x in attention and 1.2-1.4x per step. Blocks now come
    from the heap and are reused by the next step, so the peak does not grow, but the process
    keeps its peak resident until it exits. Skipped when the user has chosen an allocator
    setting (any MALLOC_* variable, GLIBC_TUNABLES or LD_PRELOAD set), or libc is not glibc.
    Returns whether the setting was applied.
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    if any(os.environ.get(k) for k in ALLOCATOR_ENV) or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _allocator_tuned = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    return _allocator_tuned


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (torch.manual_seed seeds CUDA too)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_deterministic(on: bool) -> None:
    """Ask torch for deterministic algorithms (and cuBLAS for a fixed workspace) when `on`."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.benchmark = False


def rng_state() -> dict:
    """The global RNG states, as plain data for a checkpoint."""
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": list(py[1]),
        "python_pos": py[2],
        "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    if "numpy" in state:
        np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def prepare_process(cfg: Config, device: torch.device, world: World) -> None:
    """Check that a training run can work here, then set the process-wide state it needs before its
    model is built: glibc keeping freed memory (CPU), deterministic algorithms, every RNG seeded."""
    train = cfg.train
    check_precision(train.precision, device)
    if train.precision == "auto" and world.main:
        print(f"train.precision=auto: {precision_on(train.precision, device)} on this {device.type}")
    if device.type == "cpu":
        keep_freed_memory()  # no page faults on every step's activations
    check_batch(cfg.data.batch_size, train.accum_steps, world)
    if train.compile:
        check_compile(device)
    check_cuda_graphs(train, device)
    set_deterministic(train.deterministic)
    seed_everything(cfg.seed)


@contextlib.contextmanager
def compile_failure_as_user_error():
    """Around the first compiled step: an error raised while torch.compile builds it becomes a UserError."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # inductor raises many types when it cannot build a kernel
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else e.__class__.__name__
        raise UserError(f"torch.compile failed on the first step ({reason}); use --set train.compile=false") from None
