"""Which of SDPA's kernels a compiled training step may run on CUDA, and how a run names its attention.

On an H200 with torch 2.11, a compiled bf16 training step whose attention ran on SDPA's
cuDNN backend computed a wrong gradient: cosine 0.948 against the eager step's at step 0, before
any weight had moved, while the loss agreed (docs/gpu.md "The cuDNN attention fault"). The
compiled graph hands the attention tensors of strides eager never makes, and cuDNN's SDPA backward
(before cuDNN 9.26) reads its softmax statistics as packed whatever their strides. With the flash
or the memory-efficient backend, or the explicit softmax, the same compiled step agreed with eager
(cosine 0.999995).

So a compiled step on CUDA runs SDPA with every backend but cuDNN's (`COMPILED_STEP_BACKENDS`),
through `torch.nn.attention.sdpa_kernel` around the step's forward: a context, so the choice holds
for vitmask's own calls and no process-wide flag changes under a user's other code. The backward
runs the kernel its forward chose. Eager steps keep torch's own choice, which was right and fastest.
"""

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from vitmask.model.layers import writes_out_scores

# flash first, then memory-efficient, then the math fallback: every backend but CUDNN_ATTENTION
COMPILED_STEP_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def scoped(device: torch.device, compiled: bool) -> contextlib.AbstractContextManager:
    """The context a training forward runs in: SDPA without cuDNN for a compiled step on CUDA, else nothing."""
    if compiled and device.type == "cuda":
        return sdpa_kernel(COMPILED_STEP_BACKENDS)
    return contextlib.nullcontext()


def attention_name(attention: str, device: torch.device, precision: str, compiled: bool) -> str:
    """How the step computes attention, in words for a log line: `explicit softmax`, or SDPA and the
    backends it may use (`attention`: ModelConfig.attention; `precision`: the one the step runs)."""
    if writes_out_scores(attention, device.type, precision != "fp32"):
        return "explicit softmax"
    if compiled and device.type == "cuda":
        return "SDPA (flash, memory-efficient or math; cuDNN off)"
    return "SDPA (torch's choice)"
