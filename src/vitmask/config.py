"""Configuration: frozen, typed dataclasses loaded from YAML.

A config file has the top-level keys `seed` and `name` and the sections `data`, `mask`, `model`,
`train` and `finetune`. Each key's meaning is the docstring under its field, from which
scripts/gen_reference.py writes docs/configuration.md. Keys are addressed with dots
(`model.hidden_dim`) by `--set KEY=VALUE` overrides, which are applied last. Several files compose
(`load_config([base, mine])`, `--config base.yaml --config mine.yaml`): a later file's keys win over
an earlier's, key by key within each section, then the overrides. Every check lives in a
`__post_init__`, so a bad config fails at load with the field's name. Unknown keys are rejected with
the nearest valid key (and the file that holds them). Every number must be finite (no NaN or inf)
and in its range; seeds must be ones torch's generators take (`SEED_RANGE`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from vitmask.errors import UserError


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise UserError(f"config: {key} {msg}")


def _choices(section: Any, prefix: str) -> None:
    """Every field annotated `Literal[...]` must hold one of its values: the annotation is the one
    list of a field's choices (a new choice is added there and nowhere else)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        tp, value = hints[f.name], getattr(section, f.name)
        if typing.get_origin(tp) is tuple and typing.get_args(tp)[-1:] == (Ellipsis,):  # a list of choices
            tp = typing.get_args(tp)[0]
            values = value if isinstance(value, tuple) else (value,)
        else:
            values = (value,)
        options = typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
        for v in values if options else ():
            if v not in options:
                raise UserError(
                    f"config: {prefix}{f.name} must be one of {', '.join(options)}, got {v!r}{_near(v, options)}"
                )


def _finite(section: Any, prefix: str) -> None:
    """Every float of a section (also inside a [min, max] pair) must be finite: NaN and inf pass
    many range checks (inf > 0) and would reach the optimizer or the masks."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                raise UserError(f"config: {prefix}{f.name} must be a finite number, got {v}")


# torch's generators take seeds in [-2^63, 2^64 - 1]; the trainer also seeds seed + 1 and seed + 2
SEED_RANGE = (-(2**63), 2**64 - 3)


def check_seed(seed: int, key: str) -> None:
    """A seed torch, NumPy and Python can all take (a config's `seed`, or a CLI `--seed`)."""
    lo, hi = SEED_RANGE
    if not lo <= seed <= hi:
        raise UserError(f"{key} must be an integer in [{lo}, {hi}], got {int_text(seed)}")


def int_text(value: int) -> str:
    """An integer as text, or its size where it is too long to show (Python refuses past 4300 digits)."""
    if -(10**40) < value < 10**40:
        return str(value)
    return f"a number of about {int(abs(value).bit_length() * 0.30103) + 1} digits"


# The choices of each choice field: the one place a new choice is added. The validation reads them from
# the fields' annotations (`_choices`, `_coerce`), and scripts/gen_reference.py lists them in
# docs/configuration.md from the same annotations.
Source = Literal["shapes", "torchvision", "idx", "folder", "npz", "npy", "packed"]
TorchvisionName = Literal["MNIST", "FashionMNIST", "KMNIST", "EMNIST", "QMNIST", "Omniglot"]
EmnistSplit = Literal["byclass", "bymerge", "balanced", "letters", "digits", "mnist"]
BadFiles = Literal["skip", "fail"]
Fit = Literal["pad", "resize", "center_crop", "none"]
MaskStrategy = Literal["random", "block", "mixed"]
RatioSchedule = Literal["fixed", "uniform", "cosine"]
Activation = Literal["relu", "gelu", "relu2", "swiglu"]
Norm = Literal["none", "layernorm", "rmsnorm"]
NormPosition = Literal["pre", "post"]
Positions = Literal["learned", "sincos2d", "rope2d", "rope2d+learned"]
AttentionImpl = Literal["auto", "sdpa", "explicit"]
DecoderDesign = Literal["none", "self", "cross"]
Optimizer = Literal["adam", "adamw", "muon"]
MuonDtype = Literal["fp32", "bf16"]
Schedule = Literal["constant", "cosine", "linear"]
Precision = Literal["fp32", "bf16", "fp16", "auto"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune"]  # torch.compile(mode=...)
StepShapes = Literal["auto", "static", "masked"]
CompileCheck = Literal["stop", "eager", "skip"]
LoggerName = Literal["tensorboard", "csv", "jsonl", "wandb", "mlflow"]
EarlyStopMetric = Literal[
    "val/loss", "val/acc", "val/acc_nonempty", "val/bit_acc", "val_ema/loss", "val_ema/acc", "val_ema/acc_nonempty",
    "val_ema/bit_acc",
]  # fmt: skip
EarlyStopMode = Literal["auto", "min", "max"]

MAX_DEPTH = 1024  # blocks: far beyond any model this trainer is for, and quick to build and count

# every other integer of a config fits torch's int64, so no size, count or step overflows a tensor's
INT_RANGE = (-(2**63), 2**63 - 1)
SEED_KEYS = ("seed", "data.split_seed")  # their range is SEED_RANGE
MAX_YAML_DEPTH = 32  # nested sections, lists and maps in a config file (a real one has 3)
EVAL_BATCH = 256  # images per validation batch (scores.evaluate's): older configs' eval_batches unit (_upgrade)
MAX_CONFIG_BYTES = 1 << 20  # a config file's size (a real one is under 4 KiB)


@dataclass(frozen=True)
class DataConfig:
    """The `data` section: where images come from, how they become binary images and patches, the batch."""

    source: Source = "shapes"
    """Where images come from: generated shapes, a torchvision dataset, idx files, a folder of image
    files or an .npz archive (docs/data.md), a folder of <class>.npy files or a pack written by
    `vitmask pack` (docs/corpora.md)."""
    path: str = "data"
    """What the source reads (unused by shapes): torchvision: the root it downloads to or reads from;
    idx: a folder of idx image files, or one such file; folder, npy, packed: a folder; npz: a .npz file."""
    name: TorchvisionName = "MNIST"
    """torchvision: the dataset."""
    emnist_split: EmnistSplit = "balanced"
    """torchvision EMNIST: the split."""
    download: bool = False
    """torchvision: fetch the dataset into `data.path` when it is not there."""
    npz_key: str = "images"
    """npz: the archive's key of the image array, (n, H, W) or (n, H, W, C)."""
    npz_labels_key: str = "labels"
    """npz: the key of the labels array (n,), one class per image; optional."""
    bad_files: BadFiles = "skip"
    """folder: unreadable image files are skipped (their count on stderr), or fail the run."""
    val_fraction: float = 0.1
    """Share held out for validation (of the train split where a source has one); in (0, 1)."""
    test_fraction: float = 0.1
    """Share held out for testing, where a source has no test split of its own; in (0, 1), and
    `val_fraction + test_fraction` < 1."""
    split_seed: int | None = None
    """Seed of the train/val/test split (shapes: of the images); null: the top-level `seed`."""
    image_size: int = 32
    """Images are square, image_size x image_size pixels; a multiple of `patch_size`."""
    patch_size: int = 2
    """Patches are patch_size x patch_size pixels, 1 to 4; 2^(patch_size^2) token classes."""
    batch_size: int = 128
    """Images per optimisation step (the global batch)."""
    num_train: int = 20000
    """shapes: training images generated."""
    num_val: int = 1000
    """shapes: validation images."""
    num_test: int = 2000
    """shapes: test images."""
    fit: Fit = "pad"
    """How images of another size are fitted to image_size: pad (centred on a canvas of background,
    black, or white with `invert`; the centre of a longer side cropped), resize (bilinear),
    center_crop (the centre cropped, a shorter side padded), none (images must already be
    image_size x image_size)."""
    threshold: float = 0.5
    """A pixel is foreground when its gray level >= threshold * 255; in [0, 1]."""
    invert: bool = False
    """Swap foreground and background after thresholding."""
    max_per_class: int = 0
    """npy: take at most this many images from each <class>.npy file; 0: all."""
    on_device: Literal["auto"] | bool = "auto"
    """packed: whether the packed training split is copied to the device: auto (on CUDA when it takes
    under half the free memory), true (always; refused when it does not fit) or false (batches are
    gathered from the memory map)."""

    def __post_init__(self) -> None:
        _finite(self, "data.")
        _choices(self, "data.")
        _check(self.max_per_class >= 0, "data.max_per_class", f"must be >= 0 (0 = all), got {self.max_per_class}")
        _check(
            self.on_device in ("auto", True, False),
            "data.on_device",
            f"must be auto, true or false, got {self.on_device!r}",
        )
        _check("\x00" not in self.path, "data.path", "must not contain a NUL character")
        if self.split_seed is not None:
            check_seed(self.split_seed, "config: data.split_seed")
        for k in ("val_fraction", "test_fraction"):
            v = getattr(self, k)
            _check(0.0 < v < 1.0, f"data.{k}", f"must be in (0, 1), got {v}")
        _check(
            self.val_fraction + self.test_fraction < 1.0,
            "data.val_fraction",
            f"+ data.test_fraction must be < 1 (nothing would be left to train on), got {self.val_fraction}"
            f" + {self.test_fraction}",
        )
        _check(self.patch_size >= 1, "data.patch_size", "must be >= 1")
        _check(self.patch_size <= 4, "data.patch_size", "must be <= 4 (2^16 token classes at most)")
        _check(self.image_size >= 1, "data.image_size", "must be >= 1")
        _check(
            self.image_size % self.patch_size == 0,
            "data.image_size",
            f"({self.image_size}) must be divisible by data.patch_size ({self.patch_size})",
        )
        _check(self.batch_size >= 1, "data.batch_size", "must be >= 1")
        for k in ("num_train", "num_val", "num_test"):
            _check(getattr(self, k) >= 1, f"data.{k}", "must be >= 1")
        _check(0.0 <= self.threshold <= 1.0, "data.threshold", f"must be in [0, 1], got {self.threshold}")

    @property
    def grid(self) -> int:
        """Patches along one side of the image."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid**2

    @property
    def patch_dim(self) -> int:
        """Pixels in one patch."""
        return self.patch_size**2

    @property
    def num_classes(self) -> int:
        """Token classes: every bit pattern of a patch."""
        return 2**self.patch_dim


@dataclass(frozen=True)
class MaskConfig:
    """The `mask` section: which patches are hidden from the model, and what it sees in their place."""

    strategy: MaskStrategy = "random"
    """random: patches drawn uniformly; block: BEiT-style rectangles of patches; mixed: per image,
    block with probability `block_share`, else random (validation and `vitmask eval` read mixed as
    random)."""
    ratio: float = 0.5
    """Share of patches masked per image (exactly round(ratio * N)); in (0, 1). Validation uses it,
    and `vitmask eval` unless given --mask-ratio."""
    ratio_schedule: RatioSchedule = "fixed"
    """How training draws the masked count M, once per batch: fixed (`mask.ratio`), uniform (over the
    counts of `ratio_range`) or cosine (MaskGIT: ratio = cos(pi/2 * u), u ~ U(0, 1), in `ratio_range`)."""
    ratio_range: tuple[float, float] | None = None
    """[min, max] of the uniform and cosine schedules, 0 < min <= max < 1; null: all of (0, 1). A
    config that sets the range and no `ratio_schedule` reads as uniform."""
    block_share: float = 0.5
    """mixed: the share of images that get a block mask; in [0, 1]."""
    block_min_patches: int = 16
    """block: the smallest rectangle, in patches (BEiT: 16)."""
    block_aspect: tuple[float, float] = (0.3, 3.3)
    """block: the range of a rectangle's height / width (BEiT: 0.3 to 1/0.3)."""
    fill: float | str = 0.5
    """What the model sees for a masked patch: a pixel value in [0, 1] that replaces its pixels, or
    `learned` (its token is replaced by a trained vector); must be `learned` with a `model.decoder`
    (docs/notation.md#input-of-a-masked-patch)."""

    def __post_init__(self) -> None:
        _finite(self, "mask.")
        _choices(self, "mask.")
        _check(0.0 < self.ratio < 1.0, "mask.ratio", f"must be in (0, 1), got {self.ratio}")
        if self.ratio_range is not None:
            lo, hi = self.ratio_range
            _check(
                0.0 < lo <= hi < 1.0, "mask.ratio_range", f"must be [min, max] with 0 < min <= max < 1, got {[lo, hi]}"
            )
            _check(
                self.ratio_schedule != "fixed",
                "mask.ratio_range",
                "is the range of the uniform and cosine schedules, but mask.ratio_schedule is fixed (every batch "
                "at mask.ratio); set mask.ratio_schedule=uniform or cosine, or drop ratio_range",
            )
        _check(0.0 <= self.block_share <= 1.0, "mask.block_share", f"must be in [0, 1], got {self.block_share}")
        _check(self.block_min_patches >= 1, "mask.block_min_patches", "must be >= 1")
        lo, hi = self.block_aspect
        _check(0.0 < lo <= hi, "mask.block_aspect", f"must be [min, max] with 0 < min <= max, got {[lo, hi]}")
        if isinstance(self.fill, str):
            _check(self.fill == "learned", "mask.fill", f"must be a number in [0, 1] or 'learned', got {self.fill!r}")
        else:
            _check(0.0 <= self.fill <= 1.0, "mask.fill", f"must be in [0, 1] or 'learned', got {self.fill}")


@dataclass(frozen=True)
class ModelConfig:
    """The `model` section: the transformer (and, with `decoder`, its decoder)."""

    hidden_dim: int = 128
    """Width of every token vector (D); a multiple of `num_heads`."""
    num_heads: int = 4
    """Attention heads; head_dim = hidden_dim / num_heads."""
    depth: int = 4
    """Transformer blocks; at most 1024."""
    ffn_dim: int = 512
    """Hidden width of the feed-forward network."""
    activation: Activation = "gelu"
    """The feed-forward network's activation: relu, gelu, relu2 (max(0, x)^2) or swiglu
    (silu(x W_1) * x W_3, then W_2; no biases)."""
    norm: Norm = "layernorm"
    """The norm of every block."""
    norm_position: NormPosition = "pre"
    """pre: x + f(norm(x)); post: norm(x + f(x))."""
    qkv_bias: bool = True
    """Bias on the Q, K and V projections."""
    out_proj: bool = True
    """A linear projection after concatenating the heads."""
    zero_init_residual: bool = False
    """The last linear of each branch (W_O, the FFN's W_2) starts at 0, so blocks start as the identity."""
    dropout: float = 0.0
    """Dropout on the attention weights and on each residual branch; in [0, 1)."""
    token_conv: int = 0
    """k > 0: each block first adds a depthwise k x k convolution over the zero-padded grid of tokens
    (local mixing, as CPE); k odd and at most 2 * the grid's side - 1; 0: none. Not with a decoder."""
    num_kv_heads: int = 0
    """Key/value heads for grouped-query attention; must divide `num_heads`; 0: num_heads (plain
    multi-head)."""
    pos: Positions = "learned"
    """Positions: learned (a learned vector added), sincos2d (fixed 2D sin-cos, added; hidden_dim a
    multiple of 4), rope2d (2D rotary on Q and K; head_dim a multiple of 4) or rope2d+learned (both:
    a token knows where it is even when all it sees is the mask embedding, where under rope2d alone
    a blank canvas looks the same at every position)."""
    attention: AttentionImpl = "auto"
    """auto: sdpa, except on CPU under bf16/fp16 autocast, where the written-out form trains faster;
    sdpa: F.scaled_dot_product_attention; explicit: softmax(Q K^T / sqrt(d)) V written out."""
    decoder: DecoderDesign = "none"
    """none: one stack over all N tokens (masked ones as `mask.fill`); self: MAE, the encoder (the keys
    above) sees the visible patches only and a decoder self-attends over them and mask tokens; cross:
    CrossMAE, mask queries at the masked positions cross-attend to the encoder's output
    (docs/architecture.md#encoder-decoder-designs). A decoder needs `mask.fill: learned`."""
    decoder_depth: int = 1
    """Decoder blocks (self, cross)."""
    decoder_dim: int = 0
    """Decoder width E (the encoder's output is projected to it); 0: hidden_dim."""
    decoder_heads: int = 0
    """Decoder attention heads (plain multi-head, no grouped K/V); 0: num_heads."""
    decoder_ffn_dim: int = 0
    """Decoder FFN width; 0: ffn_dim * E / hidden_dim (the encoder's ratio)."""
    decoder_self_attn: bool = False
    """cross: in each block the mask queries also self-attend, before cross-attending."""

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used: num_kv_heads, or num_heads when it is 0."""
        return self.num_kv_heads or self.num_heads

    @property
    def rotary(self) -> bool:
        """Queries and keys are turned by 2D rotary positions (pos rope2d or rope2d+learned)."""
        return self.pos in ("rope2d", "rope2d+learned")

    @property
    def learned_pos(self) -> bool:
        """A learned positional vector is added to every token (pos learned or rope2d+learned)."""
        return self.pos in ("learned", "rope2d+learned")

    @property
    def ffn_matrices(self) -> int:
        """Weight matrices of the feed-forward network: 3 for swiglu (W_1, W_3, W_2), else 2 (W_1, W_2)."""
        return 3 if self.activation == "swiglu" else 2

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    @property
    def decoder_width(self) -> int:
        """The decoder's width E: decoder_dim, or hidden_dim when it is 0."""
        return self.decoder_dim or self.hidden_dim

    @property
    def decoder_config(self) -> ModelConfig:
        """The decoder's blocks as a ModelConfig: its width, heads, FFN and depth, everything else the encoder's."""
        e = self.decoder_width
        return dataclasses.replace(
            self,
            hidden_dim=e,
            num_heads=self.decoder_heads or self.num_heads,
            num_kv_heads=0,
            ffn_dim=self.decoder_ffn_dim or max(1, self.ffn_dim * e // self.hidden_dim),
            depth=self.decoder_depth,
            decoder="none",
            decoder_depth=1,
            decoder_dim=0,
            decoder_heads=0,
            decoder_ffn_dim=0,
            decoder_self_attn=False,
        )

    def __post_init__(self) -> None:
        _finite(self, "model.")
        _choices(self, "model.")
        for k in ("hidden_dim", "num_heads", "depth", "ffn_dim"):
            _check(getattr(self, k) >= 1, f"model.{k}", "must be >= 1")
        _check(self.depth <= MAX_DEPTH, "model.depth", f"must be <= {MAX_DEPTH}, got {self.depth}")
        _check(
            self.hidden_dim % self.num_heads == 0,
            "model.hidden_dim",
            f"({self.hidden_dim}) must be divisible by model.num_heads ({self.num_heads})",
        )
        _check(0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}")
        _check(
            self.token_conv == 0 or (self.token_conv > 0 and self.token_conv % 2 == 1),
            "model.token_conv",
            f"must be 0 (off) or an odd kernel size such as 3, got {self.token_conv}",
        )
        _check(
            self.token_conv == 0 or self.decoder == "none",
            "model.token_conv",
            f"({self.token_conv}) convolves the whole grid of tokens, which an encoder of visible patches "
            f"(model.decoder={self.decoder}) does not have; set model.token_conv=0 or model.decoder=none",
        )
        _check(self.num_kv_heads >= 0, "model.num_kv_heads", "must be >= 0 (0 = num_heads)")
        _check(
            self.num_heads % self.kv_heads == 0,
            "model.num_kv_heads",
            f"({self.num_kv_heads}) must divide model.num_heads ({self.num_heads})",
        )
        if self.pos == "sincos2d":
            _check(
                self.hidden_dim % 4 == 0, "model.hidden_dim", f"({self.hidden_dim}) must be divisible by 4 for sincos2d"
            )
        if self.rotary:
            _check(
                self.head_dim % 4 == 0,
                "model.pos",
                f"rope2d needs hidden_dim / num_heads divisible by 4, got {self.head_dim}; change model.num_heads",
            )
        self._check_decoder()

    def _check_decoder(self) -> None:
        if self.decoder == "none":
            for k, default in (("decoder_depth", 1), ("decoder_dim", 0), ("decoder_heads", 0), ("decoder_ffn_dim", 0)):
                v = getattr(self, k)
                _check(v == default, f"model.{k}", f"is {v} but model.decoder is none; set model.decoder=self or cross")
            _check(
                not self.decoder_self_attn,
                "model.decoder_self_attn",
                "applies to model.decoder=cross only; set model.decoder=cross or drop it",
            )
            return
        _check(self.decoder_depth >= 1, "model.decoder_depth", f"must be >= 1 with a decoder, got {self.decoder_depth}")
        _check(
            self.decoder_depth <= MAX_DEPTH, "model.decoder_depth", f"must be <= {MAX_DEPTH}, got {self.decoder_depth}"
        )
        for k in ("decoder_dim", "decoder_heads", "decoder_ffn_dim"):
            _check(getattr(self, k) >= 0, f"model.{k}", f"must be >= 0 (0 = the encoder's), got {getattr(self, k)}")
        e, h = self.decoder_width, self.decoder_heads or self.num_heads
        _check(e % h == 0, "model.decoder_dim", f"({e}) must be divisible by the decoder's heads ({h})")
        if self.pos == "sincos2d":
            _check(e % 4 == 0, "model.decoder_dim", f"({e}) must be divisible by 4 for sincos2d")
        if self.rotary:
            _check(
                (e // h) % 4 == 0,
                "model.decoder_heads",
                f"rope2d needs the decoder's width / heads divisible by 4, got {e} / {h}; change model.decoder_heads",
            )
        _check(
            not self.decoder_self_attn or self.decoder == "cross",
            "model.decoder_self_attn",
            "applies to model.decoder=cross only (the self decoder always self-attends)",
        )


@dataclass(frozen=True)
class TrainConfig:
    """The `train` section: the optimisation, its schedule and precision, validation and checkpoints."""

    lr: float = 1e-3
    """Peak learning rate, reached at the end of warmup; in (0, 1]."""
    max_steps: int = 2000
    """Optimisation steps in the whole run."""
    eval_every: int = 250
    """Steps between validations (and at the last step)."""
    checkpoint_every: int = 500
    """Steps between checkpoints (and at the last step)."""
    log_every: int = 25
    """Steps between training-scalar logs."""
    eval_images: int = 10000
    """Val images per validation (and online probe), spread evenly over the val split, the same
    images under the same masks every time; the whole split when it holds no more; 0: the whole
    split, whatever its size (docs/training.md#validation)."""
    optimizer: Optimizer = "adam"
    """adam, adamw (decoupled decay) or muon (Muon on the blocks' weight matrices, AdamW elsewhere;
    docs/training.md#optimizer-and-schedule)."""
    muon_dtype: MuonDtype = "fp32"
    """muon: the dtype of its Newton-Schulz iteration, the same on every device."""
    weight_decay: float = 0.0
    """Decay of weight matrices only, never biases, norms, `pos` or `mask_token` (adam: an L2 term in
    the gradient; adamw and muon: decoupled); in [0, 1]."""
    beta1: float = 0.9
    """Adam's decay rate of the gradient mean; in [0, 1)."""
    beta2: float = 0.999
    """Adam's decay rate of the squared-gradient mean; in [0, 1)."""
    eps: float = 1e-8
    """Adam's epsilon; in (0, 1]."""
    schedule: Schedule = "constant"
    """The lr after warmup: constant, or a cosine or linear decay to `min_lr` at `max_steps`."""
    warmup_steps: int = 0
    """A linear warmup from 0 to lr over this many steps."""
    min_lr: float = 0.0
    """The lr the cosine and linear decays end at; in [0, lr]."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this; 0: no clipping (the norm is still logged)."""
    accum_steps: int = 1
    """Micro-batches per step; must divide `data.batch_size`."""
    precision: Precision = "fp32"
    """fp32; bf16 (autocast); fp16 (autocast and a GradScaler, CUDA only); auto (bf16 where the device
    runs it natively, else fp32; docs/training.md#precision-and-compile)."""
    compile: bool = False
    """Wrap the model in torch.compile (needs a C++ compiler on a CPU)."""
    compile_mode: CompileMode = "default"
    """The torch.compile mode: default, reduce-overhead (CUDA graphs) or max-autotune (docs/gpu.md)."""
    compile_check: CompileCheck = "stop"
    """With `compile`: the first step in each process (a run's first, and the first after a resume)
    also runs eager, and the two gradients are compared (docs/gpu.md#the-compiled-step-checks-itself).
    Below the bound: stop (one line, exit 2), eager (a warning, then the run goes on uncompiled), or
    skip (no check)."""
    step_shapes: StepShapes = "auto"
    """The training step's shapes: static (every token to the head, the loss weighted by the mask:
    one compiled graph for every masked count), masked (the last block computes only the masked
    tokens) or auto (static for a compiled step under a ratio schedule without a decoder, masked
    elsewhere). static needs `model.decoder: none`."""
    deterministic: bool = False
    """Ask torch for deterministic algorithms (slower; exact resume on a CPU)."""
    keep_last: int = 3
    """step_*.pt checkpoints kept in the run dir (last.pt and best.pt are always kept)."""
    probe_every: int = 0
    """Steps between online probes (k-NN and linear accuracy on the validation's val images, from the
    labels); 0: off."""
    probe_train_images: int = 2000
    """Online probe: the first this many train images are what the probes fit."""
    ema_decay: float = 0.0
    """An exponential moving average of the weights, kept in fp32 and updated after every step with
    decay min(ema_decay, (1 + t) / (10 + t)) at update t (0-based; timm's ModelEma warm-up); 0: off;
    in [0, 1) (docs/export.md)."""
    loggers: tuple[LoggerName, ...] = ("tensorboard",)
    """Where the run's metrics go, a list of: tensorboard (event files in the run dir), csv
    (metrics.csv in the run dir), jsonl (metrics.jsonl in the run dir), wandb (Weights & Biases, the
    wandb extra), mlflow (MLflow, the mlflow extra); [] for none (docs/training.md#loggers)."""
    early_stop_patience: int = 0
    """Early stopping: stop after this many validations in a row in which `early_stop_metric` did not
    improve on its best by more than `early_stop_min_delta`, with last.pt written and best.pt kept;
    0: off (docs/training.md#early-stopping)."""
    early_stop_metric: EarlyStopMetric = "val/loss"
    """Early stopping: the validation metric watched (fine-tuning has val/loss and val/acc; the
    val_ema ones need `ema_decay`)."""
    early_stop_mode: EarlyStopMode = "auto"
    """Early stopping: min (lower is better), max, or auto (max for an accuracy, min for a loss)."""
    early_stop_min_delta: float = 0.0
    """Early stopping: the least change of the metric that counts as an improvement; >= 0."""

    def __post_init__(self) -> None:
        _finite(self, "train.")
        _choices(self, "train.")
        _check(
            0 < self.lr <= 1,
            "train.lr",
            f"must be in (0, 1] (Adam moves each weight by about lr a step), got {self.lr}",
        )
        for k in ("max_steps", "eval_every", "checkpoint_every", "log_every", "accum_steps", "keep_last"):
            _check(getattr(self, k) >= 1, f"train.{k}", "must be >= 1")
        _check(self.eval_images >= 0, "train.eval_images", "must be >= 0 (0 = the whole val split)")
        _check(self.probe_every >= 0, "train.probe_every", "must be >= 0 (0 = off)")
        _check(self.probe_train_images >= 1, "train.probe_train_images", "must be >= 1")
        _check(0 <= self.weight_decay <= 1, "train.weight_decay", f"must be in [0, 1], got {self.weight_decay}")
        for k in ("beta1", "beta2"):
            _check(0.0 <= getattr(self, k) < 1.0, f"train.{k}", f"must be in [0, 1), got {getattr(self, k)}")
        _check(0 < self.eps <= 1, "train.eps", f"must be in (0, 1], got {self.eps}")
        _check(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _check(0 <= self.min_lr <= self.lr, "train.min_lr", f"must be in [0, train.lr ({self.lr})], got {self.min_lr}")
        _check(self.grad_clip >= 0, "train.grad_clip", f"must be >= 0 (0 = off), got {self.grad_clip}")
        _check(0 <= self.ema_decay < 1, "train.ema_decay", f"must be in [0, 1) (0 = off), got {self.ema_decay}")
        twice = sorted({k for k in self.loggers if self.loggers.count(k) > 1})
        _check(not twice, "train.loggers", f"names {', '.join(twice)} more than once; list each logger once")
        _check(
            self.early_stop_patience >= 0,
            "train.early_stop_patience",
            f"must be >= 0 (validations; 0 = off), got {self.early_stop_patience}",
        )
        _check(
            self.early_stop_min_delta >= 0,
            "train.early_stop_min_delta",
            f"must be >= 0, got {self.early_stop_min_delta}",
        )
        _check(
            self.early_stop_patience == 0 or not self.early_stop_metric.startswith("val_ema/") or self.ema_decay > 0,
            "train.early_stop_metric",
            f"{self.early_stop_metric} is the EMA's, and train.ema_decay is 0 (no EMA); set train.ema_decay or "
            "watch a val/ metric",
        )


Pooling = Literal["mean", "grid"]


@dataclass(frozen=True)
class FinetuneConfig:
    """The `finetune` section: a classifier on a pretrained encoder, trained by `vitmask finetune`
    (docs/export.md#fine-tuning-on-labels). A fine-tuned classifier keeps these keys, and `vitmask
    eval`, `predict` and `export` read its pooling and `per_class` (docs/classifier.md)."""

    pool: Pooling = "grid"
    """How the tokens become features: mean (of all tokens) or grid (the mean of each cell of a grid,
    concatenated)."""
    grid: int = 4
    """grid pooling: G cells a side (G * G * D features), 1 to the patches a side."""
    layer_decay: float = 1.0
    """Layer-wise lr decay: block k of L gets lr * layer_decay^(L + 1 - k); 1: off; in (0, 1]."""
    freeze_steps: int = 0
    """Steps at the start in which only the head trains (the encoder's lr is 0)."""
    head_init_std: float = 0.01
    """Std of the new head's normal init (its bias starts at 0); > 0."""
    shift: int = 0
    """Training batches only (never val or test), drawn per step from the run's seed: each image moves
    by a random whole number of pixels in [-shift, shift] on each axis, the background (0) filling
    in; 0: off; in [0, data.image_size - 1]."""
    mask_ratio: float = 0.0
    """Training batches only (never val or test), drawn per step from the run's seed: each image hides
    round(mask_ratio * N) random patches (at most N - 1) from the encoder, as pretraining hid them;
    0: off; in [0, 1)."""
    per_class: int = 0
    """Images of each class read from each split (train, val, test), a seeded choice that keeps the
    split's order (the split seed: `vitmask probe --per-class` with the same number reads the same
    images, and `vitmask eval` of the classifier scores the same test images); 0: every image. How a
    pack of any size is fine-tuned (docs/classifier.md#packs-and-large-corpora)."""

    def __post_init__(self) -> None:
        _finite(self, "finetune.")
        _choices(self, "finetune.")
        _check(self.shift >= 0, "finetune.shift", f"must be in [0, data.image_size - 1] (0 = off), got {self.shift}")
        _check(0 <= self.mask_ratio < 1, "finetune.mask_ratio", f"must be in [0, 1) (0 = off), got {self.mask_ratio}")
        _check(self.grid >= 1, "finetune.grid", f"must be >= 1, got {self.grid}")
        _check(
            0 < self.layer_decay <= 1, "finetune.layer_decay", f"must be in (0, 1] (1 = off), got {self.layer_decay}"
        )
        _check(self.freeze_steps >= 0, "finetune.freeze_steps", f"must be >= 0, got {self.freeze_steps}")
        _check(self.per_class >= 0, "finetune.per_class", f"must be >= 0 (0 = every image), got {self.per_class}")
        _check(self.head_init_std > 0, "finetune.head_init_std", f"must be > 0, got {self.head_init_std}")


@dataclass(frozen=True)
class Config:
    """A whole config: the top-level keys and one dataclass per section."""

    seed: int = 0
    """Seeds every random number generator of a run."""
    data: DataConfig = field(default_factory=DataConfig)
    mask: MaskConfig = field(default_factory=MaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    name: str = "default"
    """The run's name: it trains in runs/<name> unless --run-dir is given; a plain folder name, not a
    path. A config file without one is named after the file (`load_config`: configs/mnist.yaml is
    mnist); "default" is only the name of a config built in Python with none."""

    @property
    def split_seed(self) -> int:
        """The seed of the train/val/test split: `data.split_seed`, else `seed` (so runs of other
        training seeds can share one split)."""
        return self.seed if self.data.split_seed is None else self.data.split_seed

    def __post_init__(self) -> None:
        check_seed(self.seed, "config: seed")
        data = self.data
        _check(
            data.num_patches >= 2,
            "data.image_size",
            f"({data.image_size}) must hold at least 2 patches of data.patch_size ({data.patch_size}): "
            "one to mask and one to see",
        )
        _check(
            bool(self.name) and self.name not in (".", "..") and not any(c in self.name for c in "/\\\x00"),
            "name",
            f"must be a plain folder name (runs/<name>), got {self.name!r}",
        )
        _check(
            self.data.batch_size % self.train.accum_steps == 0,
            "train.accum_steps",
            f"({self.train.accum_steps}) must divide data.batch_size ({self.data.batch_size}); "
            "pick a divisor or change the batch size",
        )
        _check(
            self.train.step_shapes != "static" or self.model.decoder == "none",
            "train.step_shapes",
            f"static needs model.decoder=none (the encoder of model.decoder={self.model.decoder} sees the "
            "N - M visible patches, a count that changes with M); use train.step_shapes=auto or masked",
        )
        _check(
            self.finetune.shift < data.image_size,
            "finetune.shift",
            f"must be in [0, {data.image_size - 1}] (0 = off; a shift of data.image_size ({data.image_size}) or more "
            f"moves every pixel out of the image), got {self.finetune.shift}",
        )
        _check(
            self.model.token_conv <= 2 * data.grid - 1,
            "model.token_conv",
            f"({self.model.token_conv}) must be at most 2 * the grid's side - 1 ({2 * data.grid - 1}): a larger "
            "kernel reaches past every token and only adds zeros; pick a smaller odd size such as 3",
        )
        if self.model.decoder != "none":
            _check(
                self.mask.fill == "learned",
                "mask.fill",
                f"must be 'learned' with model.decoder={self.model.decoder}, got {self.mask.fill!r}: the encoder never "
                "sees masked patches and the decoder stands a learned mask token in for them; set mask.fill=learned",
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {
    "data": DataConfig,
    "mask": MaskConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "finetune": FinetuneConfig,
}


def valid_keys() -> list[str]:
    keys = [f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS]
    for sec, cls in SECTIONS.items():
        keys += [f"{sec}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def _unknown(key: str, where: str | Path | None = None) -> UserError:
    near = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(valid_keys())}"
    return UserError(f"config: unknown key '{key}'{f' in {where}' if where is not None else ''}{hint}")


def _near(value: Any, options: typing.Sequence[Any]) -> str:
    """`; did you mean 'x'?` for a text value close to one of `options`, else nothing."""
    if not isinstance(value, str):
        return ""
    near = difflib.get_close_matches(value, [str(o) for o in options], n=1, cutoff=0.6)
    return f"; did you mean '{near[0]}'?" if near else ""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; convert only int or numeric str -> float, list -> tuple."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for arm in typing.get_args(tp):
            if arm is type(None):
                continue
            try:
                return _coerce(value, arm, key)
            except UserError:
                pass
        raise UserError(f"config: {key} has the wrong type: got {value!r}, expected {_type_name(tp)}")
    if origin is Literal:
        options = typing.get_args(tp)
        if value not in options or isinstance(value, bool):
            raise UserError(
                f"config: {key} must be one of {', '.join(map(str, options))}, got {value!r}{_near(value, options)}"
            )
        return value
    if origin is tuple and typing.get_args(tp)[-1:] == (Ellipsis,):  # a list of any length; one value: a list of one
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, (list, tuple)):
            raise UserError(
                f"config: {key} must be a list such as [{_type_name(typing.get_args(tp)[0])}], got {value!r}"
            )
        return tuple(_coerce(v, typing.get_args(tp)[0], key) for v in value)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise UserError(f"config: {key} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args, strict=True))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > 2**1023:  # past the largest float
            raise UserError(f"config: {key} must be a finite number, got {int_text(value)}")
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if (tp is not bool and isinstance(value, bool)) or not isinstance(value, tp):
        raise UserError(f"config: {key} has the wrong type: got {value!r}, expected {_type_name(tp)}")
    if tp is int and key not in SEED_KEYS:
        _check_int_range(value, key)
    return value


def _check_int_range(value: int, key: str) -> None:
    """An integer torch can hold (seeds are checked against SEED_RANGE by their section)."""
    lo, hi = INT_RANGE
    if not lo <= value <= hi:
        raise UserError(f"config: {key} must be an integer in [{lo}, {hi}], got {int_text(value)}")


def _type_name(tp: Any) -> str:
    """What a value of type `tp` may be, as written in YAML: `auto, true or false`, `int or null`."""
    words = _type_words(tp)
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _type_words(tp: Any) -> list[str]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [w for a in typing.get_args(tp) for w in _type_words(a)]
    if typing.get_origin(tp) is Literal:
        return list(map(str, typing.get_args(tp)))
    if typing.get_origin(tp) is tuple and typing.get_args(tp)[-1:] == (Ellipsis,):
        return ["a list of " + _type_name(typing.get_args(tp)[0])]
    if typing.get_origin(tp) is tuple:
        return ["[" + ", ".join(_type_name(a) for a in typing.get_args(tp)) + "]"]
    if tp is bool:
        return ["true", "false"]
    return ["null" if tp is type(None) else tp.__name__]


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in values.items():
        key = f"{prefix}{k}"
        if k not in names:
            raise _unknown(key)
        if cls is Config and k in SECTIONS:
            if not isinstance(v, dict):
                raise UserError(f"config: section '{k}' must be a mapping of keys to values, got {v!r}")
            kwargs[k] = _build(SECTIONS[k], v, f"{k}.")
        else:
            kwargs[k] = _coerce(v, hints[k], key)
    return cls(**kwargs)


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"--set expects KEY=VALUE (for example --set train.lr=3e-4), got '{item}'")
    try:
        value = safe_load_limited(raw) if raw.strip() else ""
    except YamlTooDeep as e:
        raise UserError(f"--set {key}: {e}; give a plain value") from None
    except yaml.YAMLError:
        value = raw
    if key not in valid_keys():
        raise _unknown(key)
    return key.split("."), value


def override_keys(overrides: typing.Sequence[str]) -> dict[str, Any]:
    """The keys `KEY=VALUE` overrides set (the command line's `--set`s), each with the value it
    was given last, as YAML reads it: what a run asked for on the command line, told apart from
    what its config file says."""
    return {".".join(parts): value for parts, value in map(_parse_override, overrides)}


def config_from_dict(raw: dict[str, Any], overrides: typing.Sequence[str] = ()) -> Config:
    """Build a Config from nested plain data, then apply `KEY=VALUE` overrides."""
    merged: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for item in overrides:
        parts, value = _parse_override(item)
        target = merged
        for part in parts[:-1]:
            section = target.setdefault(part, {})
            if not isinstance(section, dict):
                raise UserError(f"config: section '{part}' must be a mapping of keys to values")
            target = section
        target[parts[-1]] = value
    _upgrade(merged)
    return _build(Config, merged, "")


def _upgrade(raw: dict[str, Any]) -> None:
    """Read configs written before a key existed as they behaved then.

    Before mask.ratio_schedule, a mask.ratio_range alone drew M uniformly over the range's counts:
    such a config (an old checkpoint's, or one that sets only the range) gets ratio_schedule uniform.

    Before train.eval_images, train.eval_batches counted validation batches of 256 images, 0 (its
    default) the whole val split: such a config gets eval_images 256 x eval_batches, 0 staying the
    whole split, so a run resumed from an old checkpoint validates on as many images as before.
    """
    mask = raw.get("mask")
    if isinstance(mask, dict) and mask.get("ratio_range") is not None and "ratio_schedule" not in mask:
        mask["ratio_schedule"] = "uniform"
    train = raw.get("train")
    if isinstance(train, dict) and "eval_batches" in train and "eval_images" not in train:
        batches = train.pop("eval_batches")
        train["eval_images"] = batches * EVAL_BATCH if type(batches) is int and batches > 0 else batches


# keys `_upgrade` reads into the keys that replaced them
LEGACY_KEYS = ("train.eval_batches",)
ConfigSource = str | Path | Config | typing.Mapping[str, Any] | typing.Sequence[str | Path]


def load_config(path: ConfigSource, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML config (safe_load), then apply `KEY=VALUE` overrides; its name defaults to the file's stem.

    A list of files composes them in order: each file's keys win over the earlier files', key by
    key within each section (a file that sets `train.lr` leaves the other `train` keys as they
    were), then the overrides. The name is the last `name` a file sets, else the last file's stem.
    An unknown key is refused naming the file that holds it. A `Config` or a mapping (a config as
    plain data) is taken as it is, the overrides applied."""
    if isinstance(path, Config):
        return config_from_dict(path.to_dict(), overrides)
    if isinstance(path, typing.Mapping):
        return config_from_dict(dict(path), overrides)
    paths = [Path(p) for p in path] if isinstance(path, (list, tuple)) else [Path(path)]
    if not paths:
        raise UserError("no config given; pass --config PATH (for example configs/default.yaml)")
    merged: dict[str, Any] = {}
    for raw in map(_read_config_file, paths):
        for key, value in raw.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = dict(value) if isinstance(value, dict) else value
    merged.setdefault("name", paths[-1].stem)
    return config_from_dict(merged, overrides)


def _check_keys(raw: dict[str, Any], path: Path) -> None:
    """Refuse a key of the config file `path` that no section has, naming the file."""
    top = {f.name for f in dataclasses.fields(Config)}
    for key, value in raw.items():
        if key not in top:
            raise _unknown(str(key), path)
        if key in SECTIONS and isinstance(value, dict):
            names = {f.name for f in dataclasses.fields(SECTIONS[key])}
            for sub in value:
                if sub not in names and f"{key}.{sub}" not in LEGACY_KEYS:
                    raise _unknown(f"{key}.{sub}", path)


def _read_config_file(path: Path) -> dict[str, Any]:
    """The mapping a YAML config file holds, its keys checked (`_check_keys`)."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise UserError(f"config {path} is not a file; pass a YAML file, e.g. configs/default.yaml")
    if not path.is_file():
        raise UserError(f"config file not found: {path}; pass an existing YAML file, e.g. configs/default.yaml")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise UserError(
                f"config file {path} is {size:,} bytes, more than a config may be ({MAX_CONFIG_BYTES:,}); "
                "pass the YAML config itself (a few sections of keys)"
            )
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"cannot read config file {path}: {e.__class__.__name__}; check it is a readable text file"
        ) from None
    try:
        raw = safe_load_limited(text)
    except YamlTooDeep as e:
        raise UserError(f"bad YAML in {path}: {e}; a config is sections of keys and values") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise UserError(f"bad YAML in {path}{at}: {getattr(e, 'problem', e)}; fix the file's syntax") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"config file {path} must hold a mapping of sections (data, mask, model, train)")
    _check_keys(raw, path)
    return raw


def flatten_config(cfg: Config) -> dict[str, Any]:
    """Every key as `section.key` (top-level keys as they are), in declaration order, with its value."""
    flat: dict[str, Any] = {}
    for key, value in cfg.to_dict().items():
        if key in SECTIONS:
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


class YamlTooDeep(yaml.YAMLError):
    """A YAML document nested deeper than MAX_YAML_DEPTH."""


class _DepthLimitedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing documents nested deeper than MAX_YAML_DEPTH: composing a node
    recurses once per level, so a document thousands of levels deep would exhaust Python's stack."""

    def compose_node(self, parent, index):
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlTooDeep(
                    f"nested more than {MAX_YAML_DEPTH} levels deep (at line {mark.line + 1}, column {mark.column + 1})"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def safe_load_limited(text: str) -> Any:
    """`yaml.safe_load` with a depth limit (`YamlTooDeep`, a YAMLError, beyond MAX_YAML_DEPTH)."""
    loader = _DepthLimitedLoader(text)
    try:
        return loader.get_single_data()
    except ValueError as e:  # an integer of more digits than Python converts (4300)
        raise yaml.YAMLError(str(e).split(";")[0]) from None
    finally:
        loader.dispose()


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
