"""The image classifier `vitmask finetune` trains: a pretrained encoder, its tokens pooled, a norm
and a linear head.

`Classifier` is the masked-patch model without its decoder and head (`MaskedPatchViT.forward_encoder`:
every patch visible, the final normalised tokens), the tokens pooled as `vitmask probe --pool` pools
them (pooling.py: `finetune.pool` mean, or the means of a `finetune.grid` x grid of cells,
concatenated), a LayerNorm over those features and a linear head, one logit per label class.
`build_classifier` builds it from a config (the encoder's keys and the pooling) and a class count;
`pool_grid` reads the pooling from the config.

Shapes: B batch, N patches, P pixels per patch, M hidden patches, V visible ones, D width,
F pooled features, L label classes.
"""

import torch
from torch import nn

from vitmask.config import Config
from vitmask.errors import UserError
from vitmask.model.masked_input import visible_ids
from vitmask.model.pooling import pool_tokens, pool_visible
from vitmask.model.vit import MaskedPatchViT, build_model


class Classifier(nn.Module):
    """patches (B, N, P) float 0/1 pixels, optionally some hidden (`forward`) -> logits (B, L)."""

    def __init__(self, encoder: MaskedPatchViT, num_labels: int, grid: int | None, head_init_std: float):
        super().__init__()
        encoder.decoder = None  # the encoder alone: no decoder, no prediction head
        encoder.head = None
        self.encoder = encoder
        self.grid = grid  # None: the mean of all tokens; G: the means of G x G cells
        width = encoder.embed.out_features * (1 if grid is None else grid * grid)  # F
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_labels)
        nn.init.normal_(self.head.weight, std=head_init_std)
        nn.init.zeros_(self.head.bias)

    @property
    def num_labels(self) -> int:
        return self.head.out_features

    def features(self, patches: torch.Tensor) -> torch.Tensor:
        """patches (B, N, P), every one visible -> (B, F): the encoder's tokens pooled, before the norm."""
        return pool_tokens(self.encoder.forward_encoder(patches), self.grid)  # (B, N, D) -> (B, F)

    def forward(self, patches: torch.Tensor, mask: torch.Tensor | None = None, ids: torch.Tensor | None = None):
        """patches (B, N, P) -> logits (B, L). With mask (B, N) True = hidden and ids (B, M) the hidden
        indices, the encoder sees the hidden patches as pretraining showed them: a one-stack model
        (model.decoder none) takes them as its masked input (mask.fill pixels or the learned mask
        token) and every token is pooled; the encoder of a decoder design drops them, and each pooled
        cell is the mean of its visible tokens (0 where it has none)."""
        if mask is None:
            return self.head(self.norm(self.features(patches)))  # (B, F) -> (B, L)
        if self.encoder.fill is not None:
            tokens = self.encoder.forward_encoder(patches, mask=mask)  # (B, N, D)
            return self.head(self.norm(pool_tokens(tokens, self.grid)))  # (B, L)
        keep = visible_ids(mask, ids.shape[1])  # (B, V)
        visible = self.encoder.forward_encoder(patches, keep)  # (B, V, D)
        return self.head(self.norm(pool_visible(visible, keep, patches.shape[1], self.grid)))  # (B, L)


def pool_grid(cfg: Config) -> int | None:
    """finetune.pool and .grid as the grid to pool over (None: the mean), checked against the patch grid."""
    if cfg.finetune.pool == "mean":
        return None
    g = cfg.data.grid
    if cfg.finetune.grid > g:
        raise UserError(
            f"config: finetune.grid ({cfg.finetune.grid}) is more cells than the {g}x{g} patch grid has; "
            f"pass 1 to {g}, or finetune.pool=mean"
        )
    return cfg.finetune.grid


def build_classifier(cfg: Config, num_labels: int) -> Classifier:
    """The classifier of a config (its model keys and pooling) with `num_labels` classes, freshly initialised."""
    return Classifier(build_model(cfg), num_labels, pool_grid(cfg), cfg.finetune.head_init_std)
