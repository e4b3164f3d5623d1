"""The reference the benchmark times vitmask against: the same model written the common way.

A stack of `nn.TransformerEncoderLayer(norm_first=True)` in an `nn.TransformerEncoder`, fed by a
per-sample `Dataset` whose `__getitem__` patchifies and masks one image, batched by a `DataLoader`.
It matches vitmask's default model (pre-norm LayerNorm blocks, fused QKV with bias, output
projection, GELU or ReLU FFN, learned positions, fill-value masking), so the two compute the same
function given the same weights, and a speed ratio between them measures the implementation only.
It lives beside `benchmark.py`, its only user, and imports vitmask from `src/` (the caller puts it
on the path).

Shapes: B batch, N patches, P pixels per patch, D hidden_dim, M masked patches per image, C classes.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from vitmask.config import Config
from vitmask.data.masking import num_masked
from vitmask.data.patches import patches_to_classes, patchify
from vitmask.errors import UserError


class PerSampleMaskedPatches(Dataset):
    """One image per `__getitem__`: patchify, draw a mask, and return tensors for the default collate."""

    def __init__(self, images: torch.Tensor, patch_size: int, ratio: float, fill: float):
        self.images = images  # (n, H, W) uint8
        self.patch_size = patch_size
        self.fill = fill
        self.num_patches = (images.shape[1] // patch_size) * (images.shape[2] // patch_size)
        self.num_mask = num_masked(self.num_patches, ratio)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        pix = patchify(self.images[i].unsqueeze(0), self.patch_size)[0]  # (N, P) uint8
        ids = torch.randperm(self.num_patches)[: self.num_mask]  # (M,)
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
        if m.norm != "layernorm" or m.norm_position != "pre" or not m.qkv_bias or not m.out_proj:
            raise UserError("the reference model needs model.norm=layernorm, norm_position=pre, qkv_bias and out_proj")
        if m.activation not in ("relu", "gelu"):
            raise UserError(f"the reference model supports model.activation relu or gelu, not {m.activation}")
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
        data = PerSampleMaskedPatches(images, cfg.data.patch_size, cfg.mask.ratio, cfg.mask.fill)
        self.loader = DataLoader(
            data,
            batch_size=cfg.data.batch_size,
            shuffle=True,
            drop_last=True,
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
