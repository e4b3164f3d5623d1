"""The reference the benchmark times vitmask against: the same model written the common way.

A stack of `nn.TransformerEncoderLayer(norm_first=True)` in an `nn.TransformerEncoder`, fed by a
per-sample `Dataset` whose `__getitem__` patchifies and masks one image, batched by a `DataLoader`.
It matches vitmask's default model (pre-norm LayerNorm blocks, fused QKV with bias, output
projection, GELU or ReLU FFN, learned positions, fill-value masking), so the two compute the same
function given the same weights, and a speed ratio between them measures the implementation only.

It runs with any masking and any decoder `vitmask train` accepts, written the common way: a learned mask embedding
(`mask.fill: learned`) becomes the fill value 0.5; a ratio schedule draws one masked count per
batch (`masking.draw_num_masked`), and every image of the batch hides that many (the batch sampler
hands it to `__getitem__` with the index); block and mixed masks become random ones of the same
count; a decoder, rotary or sin-cos positions and a token convolution become the plain stack of
the encoder's size with learned positions (`reference_flops` counts what it computes). Other norms,
norm positions, activations, or no QKV bias or output projection, are what `unsupported` names:
`ReferenceViT` refuses them in one line, and the benchmark then times vitmask alone.
It lives beside `benchmark.py`, its only user, and imports vitmask from `src/` (the caller puts it
on the path).

Shapes: B batch, N patches, P pixels per patch, D hidden_dim, M masked patches per image, C classes.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from vitmask.config import Config
from vitmask.data.masking import draw_num_masked
from vitmask.data.patches import patches_to_classes, patchify
from vitmask.errors import UserError
from vitmask.model.flops import train_flops_per_image
from vitmask.sizes import num_masked

REFERENCE_FILL = 0.5  # what masked pixels hold where vitmask learns a mask embedding


def reference_fill(cfg: Config) -> float:
    """The pixel value of a masked patch: mask.fill, or REFERENCE_FILL under a learned mask embedding."""
    return REFERENCE_FILL if cfg.mask.fill == "learned" else float(cfg.mask.fill)


def reference_flops(cfg: Config) -> int:
    """The reference's training FLOPs per image: every token in every block of the plain stack (no
    decoder, no token convolution), at the config's masked count."""
    plain = dataclasses.replace(cfg.model, decoder="none", token_conv=0)
    return train_flops_per_image(dataclasses.replace(cfg, model=plain), masked_last_block=False)


def unsupported(cfg: Config) -> str:
    """Why the common-way reference cannot build `cfg`'s model ('' when it can): nn.TransformerEncoderLayer
    has LayerNorm, a QKV bias and an output projection, and a relu or gelu FFN."""
    m = cfg.model
    if m.norm != "layernorm" or m.norm_position != "pre" or not m.qkv_bias or not m.out_proj:
        return "the reference model needs model.norm=layernorm, norm_position=pre, qkv_bias and out_proj"
    if m.activation not in ("relu", "gelu"):
        return f"the reference model supports model.activation relu or gelu, not {m.activation}"
    return ""


class MaskedCountBatches(Sampler):
    """Shuffled batches of (image index, masked count) pairs: one count per batch from the ratio
    schedule, drawn on a CPU generator of its own; the last incomplete batch is dropped."""

    def __init__(self, num_images: int, cfg: Config, seed: int):
        self.num_images, self.batch_size = num_images, cfg.data.batch_size
        self.mask_cfg, self.num_patches = cfg.mask, cfg.data.num_patches
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.num_images // self.batch_size

    def __iter__(self):
        order = torch.randperm(self.num_images, generator=self.generator).tolist()
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            m = draw_num_masked(self.mask_cfg, self.num_patches, self.generator)
            yield [(i, m) for i in order[start : start + self.batch_size]]


class PerSampleMaskedPatches(Dataset):
    """One image per `__getitem__`: patchify, draw a mask, and return tensors for the default collate.

    The item is an image index, masked at `ratio`, or an (index, masked count) pair (`MaskedCountBatches`).
    """

    def __init__(self, images: torch.Tensor, patch_size: int, ratio: float, fill: float):
        self.images = images  # (n, H, W) uint8
        self.patch_size = patch_size
        self.fill = fill
        self.num_patches = (images.shape[1] // patch_size) * (images.shape[2] // patch_size)
        self.num_mask = num_masked(self.num_patches, ratio)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, item: int | tuple[int, int]) -> dict[str, torch.Tensor]:
        i, num_mask = item if isinstance(item, tuple) else (item, self.num_mask)
        pix = patchify(self.images[i].unsqueeze(0), self.patch_size)[0]  # (N, P) uint8
        ids = torch.randperm(self.num_patches)[:num_mask]  # (M,)
        mask = torch.zeros(self.num_patches, dtype=torch.bool)  # (N,)
        mask[ids] = True
        inputs = pix.float()  # (N, P)
        inputs[mask] = self.fill
        return {"inputs": inputs, "targets": patches_to_classes(pix)[ids], "ids": ids}


class ReferenceViT(nn.Module):
    """Patch embedding + learned positions, `nn.TransformerEncoder` (pre-norm), a final norm, a head."""

    def __init__(self, cfg: Config):
        super().__init__()
        m, d = cfg.model, cfg.data
        if unsupported(cfg):
            raise UserError(f"{unsupported(cfg)}; change the config or time vitmask alone (--no-reference)")
        self.embed = nn.Linear(d.patch_dim, m.hidden_dim)
        self.pos = nn.Parameter(torch.randn(d.num_patches, m.hidden_dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            m.hidden_dim,
            m.num_heads,
            m.ffn_dim,
            dropout=m.dropout,
            activation=m.activation,
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(
            layer, m.depth, norm=nn.LayerNorm(m.hidden_dim), enable_nested_tensor=False
        )
        self.head = nn.Linear(m.hidden_dim, d.num_classes)

    def forward(self, inputs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """inputs (B, N, P) with masked patches already filled, ids (B, M) -> logits (B, M, C)."""
        x = self.encoder(self.embed(inputs) + self.pos)  # (B, N, D)
        x = x.gather(1, ids.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, M, D)
        return self.head(x)  # (B, M, C)


class ReferenceRun:
    """The reference's model, Adam optimizer and an endless DataLoader iterator over `images`."""

    def __init__(self, cfg: Config, images: torch.Tensor, device: torch.device, num_workers: int = 0):
        torch.manual_seed(cfg.seed)
        self.device = device
        self.model = ReferenceViT(cfg).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.train.lr)
        data = PerSampleMaskedPatches(images, cfg.data.patch_size, cfg.mask.ratio, reference_fill(cfg))
        self.loader = DataLoader(
            data,
            batch_sampler=MaskedCountBatches(len(images), cfg, cfg.seed),
            num_workers=num_workers,
            pin_memory=device.type == "cuda",
            persistent_workers=num_workers > 0,
        )
        self._it = iter(self.loader)

    def sample(self) -> dict[str, torch.Tensor]:
        try:
            batch = next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            batch = next(self._it)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def train_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.model.train()
        logits = self.model(batch["inputs"], batch["ids"])  # (B, M, C)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()
