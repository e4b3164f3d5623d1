"""How much memory a config needs, estimated before anything is allocated, and refusing early.

An image size, width, depth or batch far beyond the machine would otherwise end minutes later in
an allocation traceback (or the kernel's OOM killer). `check_fits` compares an estimate from the
config alone with the memory free on the device and refuses with the figure and its biggest
parts. The estimate counts, in bytes:

- weights, gradients and the two Adam moments: 16 per parameter (`param_count`: the model built
  on the meta device, so nothing is allocated);
- activations kept for the backward pass, per block: about 8 (B, N, D) tensors and 2 (B, N, F)
  (3 with swiglu), the same for each decoder block at its width, plus the logits (B, M, C) three
  times; 4 bytes a value in fp32, 2 under bf16/fp16 autocast;
- attention scores (B, H, N, N), once per block, where the attention is written out (`explicit`,
  or `auto` on CPU under bf16/fp16: see `model.Attention`); SDPA's fused kernels never hold them;
- evaluation (256 images a batch, no gradients): one block's tensors at a time, scores included
  where written out;
- the images: every split as uint8 plus the patch-class map of train (int64 per patch) and one
  copy while splitting, about 8 bytes a pixel; for `shapes`, also one generation chunk's float
  temporaries (`sizes.CHUNK_PIXELS`).

It is a rough figure (within 2x of the peak for the shipped configs), meant to catch configs that
are off by orders of magnitude. A config that passes and still runs out of memory on the device
ends in one line too (`out_of_memory`).

Shapes: B batch, N patches, M masked patches per image, D hidden_dim, F ffn_dim, H heads, C classes.
"""

from dataclasses import dataclass

import torch

from vitmask.config import Config
from vitmask.errors import UserError
from vitmask.model.layers import writes_out_scores
from vitmask.runtime.memory import available_bytes, gib
from vitmask.runtime.process import precision_on
from vitmask.sizes import CHUNK_IMAGES, CHUNK_PIXELS, MAX_SHAPES, num_masked

EVAL_BATCH = 256  # evaluate()'s batch size


def param_count(cfg: Config) -> int:
    """Trainable parameters of `build_model(cfg)`, counted on the meta device: shapes only, nothing
    allocated, so a model of any size (and any variant, decoders included) is counted in moments."""
    from vitmask.model.vit import build_model

    try:
        with torch.device("meta"):
            model = build_model(cfg)
    except (TypeError, RuntimeError, OverflowError, ValueError):  # a size past int64: torch cannot even describe it
        arch, data = cfg.model, cfg.data
        dim, ffn = arch.hidden_dim, arch.ffn_dim
        return (
            data.num_patches * dim
            + arch.depth * (4 * dim * dim + 3 * dim * ffn)
            + dim * (data.patch_dim + data.num_classes)
        )
    return sum(p.numel() for p in model.parameters())


def writes_out_attention(cfg: Config, device_type: str) -> bool:
    """Whether the attention scores (B, H, N, N) are materialised (model.Attention's rule)."""
    return writes_out_scores(cfg.model.attention, device_type, precision(cfg, device_type) != "fp32")


def precision(cfg: Config, device_type: str) -> str:
    """train.precision as it runs on the device type (`auto` resolved)."""
    return precision_on(cfg.train.precision, torch.device(device_type))


@dataclass
class Estimate:
    parts: dict[str, int]  # what -> bytes

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self, top: int = 2) -> str:
        big = sorted(self.parts.items(), key=lambda kv: -kv[1])[:top]
        return ", ".join(f"{name} {gib(b)}" for name, b in big if b)


def estimate(cfg: Config, device_type: str = "cpu", training: bool = True, params: int | None = None) -> Estimate:
    """The memory `cfg` needs to train (or, with training=False, to evaluate) on a device type; `params`:
    the model's parameter count where it is built already (else `param_count`, on the meta device,
    whose ops import torch's compiler: over a CPU-second a process that compiles nothing need not pay)."""
    arch, data = cfg.model, cfg.data
    n, dim, ffn, c = data.num_patches, arch.hidden_dim, arch.ffn_dim, data.num_classes
    masked = num_masked(n, cfg.mask.ratio)
    value = 4 if precision(cfg, device_type) == "fp32" else 2
    params = param_count(cfg) if params is None else params
    scores = writes_out_attention(cfg, device_type)
    b = data.batch_size
    ffn_tensors = arch.ffn_matrices  # each FFN matrix keeps one (B, N, F) activation
    per_block = b * n * (8 * dim + ffn_tensors * ffn) * value
    if arch.decoder != "none":  # its blocks see all N tokens (self) or ask from the M masked ones (cross)
        dec = arch.decoder_config
        per_block += dec.depth * b * n * (8 * dec.hidden_dim + ffn_tensors * dec.ffn_dim) * value // max(arch.depth, 1)
    parts = {
        "weights, gradients and Adam state": (16 if training else 4) * params,
        "activations": arch.depth * per_block + 3 * b * masked * c * 4 if training else 0,
        f"attention scores (B, H, N, N) = {b} x {arch.num_heads} x {n} x {n}": (
            arch.depth * b * arch.num_heads * n * n * value if training and scores else 0
        ),
        f"evaluation (batch {EVAL_BATCH})": EVAL_BATCH
        * n
        * (4 * dim + ffn_tensors * ffn + scores * arch.num_heads * n)
        * 4,
    }
    images = data.num_train + data.num_val + data.num_test if data.source == "shapes" else 0
    pixels = data.image_size * data.image_size
    image_bytes = images * pixels * 8
    if data.source == "shapes":
        chunk = max(1, min(CHUNK_IMAGES, CHUNK_PIXELS // pixels, images))
        image_bytes += chunk * MAX_SHAPES * pixels * 64  # a chunk's (n, S, H, W) float temporaries
    parts["images"] = image_bytes
    return Estimate(parts)


def check_fits(
    cfg: Config, device: torch.device, training: bool = True, what: str = "", params: int | None = None
) -> Estimate:
    """Refuse (one line, with the figure) a config whose estimate exceeds the free memory (`params`: as
    `estimate` takes it)."""
    est = estimate(cfg, device.type, training, params)
    free = available_bytes(device)
    if free is not None and est.total > free:
        doing = what or ("training" if training else "evaluating")
        raise UserError(
            f"{doing} this config needs about {gib(est.total)} of memory ({est.describe()}), but only "
            f"{gib(free)} is free on {device.type}; lower data.batch_size, data.image_size, model.hidden_dim, "
            "model.ffn_dim or model.depth"
        )
    return est


def check_model_fits(cfg: Config, device: torch.device | None = None) -> int:
    """Refuse a model whose weights alone exceed the free memory (count-params); returns the count."""
    params = param_count(cfg)
    free = available_bytes(device or torch.device("cpu"))
    if free is not None and 4 * params > free:
        raise UserError(
            f"a model of {params:,} parameters needs {gib(4 * params)} for its weights alone, but only {gib(free)} "
            "is free; lower model.hidden_dim, model.ffn_dim or model.depth"
        )
    return params
