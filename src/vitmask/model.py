"""The masked-patch vision transformer.

Read top to bottom: attention, feed-forward, block, then the full model.

Shapes: B batch, N patches (tokens), P pixels per patch, D hidden_dim, H heads, d = D / H head
dim, F ffn_dim, M masked patches per image, C token classes.

The model follows seed 001: each patch's pixels (masked ones replaced by `fill`) are projected up
to D (Z = X A_up^T + b_up), a learned positional embedding P (N, D) is added, the blocks mix the
tokens, and a linear layer maps each token to C class logits (logits = C A_down^T + b_down).
With `mask.fill: learned`, a masked patch's embedded token is instead a trained vector (D,), as in
BEiT and SimMIM, before P is added.
"""

import torch
import torch.nn.functional as F
from torch import nn

from vitmask.config import Config, ModelConfig
from vitmask.masking import apply_fill


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, N, H*d) -> (B, H, N, d): head h takes columns h*d .. (h+1)*d - 1."""
    b, n, hd = x.shape
    return x.view(b, n, num_heads, hd // num_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) -> (B, N, H*d): the heads concatenated, the inverse of `split_heads`."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


class Attention(nn.Module):
    """Multi-head self-attention: softmax(Q K^T / sqrt(d)) V per head, through SDPA."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, out_proj: bool, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)  # W_q, W_k, W_v stacked: one matmul
        self.proj = nn.Linear(dim, dim) if out_proj else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, N, D)
        q, k, v = (split_heads(t, self.num_heads) for t in (q, k, v))  # 3 x (B, H, N, d)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(merge_heads(y))  # (B, N, D)


class FeedForward(nn.Module):
    """Position-wise FFN: Y = act(X W_1 + b_1) W_2 + b_2."""

    def __init__(self, dim: int, hidden: int, activation: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.ReLU() if activation == "relu" else nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # (B, N, F) inside, (B, N, D) out


def make_norm(kind: str, dim: int) -> nn.Module:
    return nn.LayerNorm(dim) if kind == "layernorm" else nn.Identity()


class Block(nn.Module):
    """Attention then FFN, each a residual branch. Pre-norm: x + f(norm(x)); post-norm: norm(x + f(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.hidden_dim
        self.pre_norm = cfg.norm_position == "pre"
        self.norm1 = make_norm(cfg.norm, d)
        self.attn = Attention(d, cfg.num_heads, cfg.qkv_bias, cfg.out_proj, cfg.dropout)
        self.norm2 = make_norm(cfg.norm, d)
        self.ffn = FeedForward(d, cfg.ffn_dim, cfg.activation)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.drop(self.attn(self.norm1(x)))
            return x + self.drop(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.drop(self.attn(x)))
        return self.norm2(x + self.drop(self.ffn(x)))


class MaskedPatchViT(nn.Module):
    """Predicts the class of masked patches from the visible ones."""

    def __init__(self, cfg: ModelConfig, num_patches: int, patch_dim: int, num_classes: int, fill: float | str):
        super().__init__()
        d = cfg.hidden_dim
        self.fill = fill
        self.embed = nn.Linear(patch_dim, d)  # A_up, b_up
        if fill == "learned":
            self.mask_token = nn.Parameter(torch.zeros(d))  # the embedding of every masked patch
        self.pos = nn.Parameter(torch.zeros(num_patches, d))  # P, learned
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        # a pre-norm stack leaves its residual stream un-normalised: normalise once before the head
        self.norm = make_norm(cfg.norm, d) if cfg.norm_position == "pre" else nn.Identity()
        self.head = nn.Linear(d, num_classes)  # A_down, b_down
        self.init_weights()

    def init_weights(self) -> None:
        """All initialisation rules in one place.

        - Linear weights: Xavier-uniform, which keeps activation variance steady through the
          projections (as MAE does); biases zero, so the model starts unbiased between classes.
        - The positional embedding: normal with std 0.02, small beside the patch embedding so
          early training is driven by content. The learned mask embedding likewise (as in BEiT).
        - LayerNorm: the identity (weight 1, bias 0), torch's default, left as is.
        """
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.pos, std=0.02)
        if self.fill == "learned":
            nn.init.normal_(self.mask_token, std=0.02)

    def forward(self, patches: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """patches (B, N, P) float pixels, mask (B, N) bool (True = masked), ids (B, M) masked indices.

        Returns logits (B, M, C) for the patches in `ids`, or (B, N, C) for every patch if ids is None.
        The masked patches' pixels are replaced by `fill` (or their tokens by the learned mask
        embedding) here, so callers pass the true pixels.
        """
        if self.fill == "learned":
            x = torch.where(mask.unsqueeze(-1), self.mask_token, self.embed(patches)) + self.pos  # (B, N, D)
        else:
            x = self.embed(apply_fill(patches, mask, self.fill)) + self.pos  # (B, N, D)
        for block in self.blocks:
            x = block(x)  # (B, N, D)
        if ids is not None:
            x = x.gather(1, ids.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, M, D)
        return self.head(self.norm(x))  # (B, M or N, C)


def build_model(cfg: Config) -> MaskedPatchViT:
    d = cfg.data
    return MaskedPatchViT(cfg.model, d.num_patches, d.patch_dim, d.num_classes, cfg.mask.fill)
