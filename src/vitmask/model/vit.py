"""The masked-patch vision transformer.

Read top to bottom: positions, attention, feed-forward, block, then the full model.

Shapes: B batch, N patches (tokens), P pixels per patch, D hidden_dim, H heads, K key/value heads
(K = H unless grouped-query attention), d = D / H head dim, F ffn_dim, M masked patches per image,
C token classes, g patches per side of the grid (N = g * g).

The model follows seed 001: each patch's pixels (masked ones replaced by `fill`) are projected up
to D (Z = X A_up^T + b_up), a positional embedding P (N, D) is added, the blocks mix the
tokens, and a linear layer maps each token to C class logits (logits = C A_down^T + b_down).
With `mask.fill: learned`, a masked patch's embedded token is instead a trained vector (D,), as in
BEiT and SimMIM, before P is added.
The variants of seed 002 are config choices: RMSNorm, SwiGLU, grouped-query attention, and 2D
positions (fixed sin-cos added to the tokens, or rotary applied to queries and keys).
With `model.decoder: self | cross`, the blocks here are an encoder over the visible patches only
and a decoder (vitmask.model.decoder) predicts the masked ones; see `MaskedPatchViT`.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from vitmask.config import Config, ModelConfig
from vitmask.data.masking import apply_fill, mask_to_ids, visible_ids

ROPE_BASE = 100.0  # rotary base: grids are at most 64 patches a side, so 10000 would leave most frequencies unused


def sincos_1d(dim: int, positions: torch.Tensor) -> torch.Tensor:
    """(L,) positions -> (L, dim): [sin(pos * w_i), cos(pos * w_i)] with w_i = 1 / 10000^(i / (dim/2))."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))  # (dim/2,)
    angles = positions.double()[:, None] * omega[None]  # (L, dim/2)
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()  # (L, dim)


def sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """(N, dim) fixed 2D positions (as MAE): the first half encodes the row, the second the column."""
    n = torch.arange(grid * grid)
    return torch.cat([sincos_1d(dim // 2, n // grid), sincos_1d(dim // 2, n % grid)], dim=1)  # (N, dim)


def rope_2d_angles(head_dim: int, grid: int) -> torch.Tensor:
    """(N, d/2) rotation angles: pair i of the first half of a head turns by row * theta_i, of the
    second half by column * theta_i, with theta_i = ROPE_BASE^(-i / (d/4))."""
    q = head_dim // 4
    theta = ROPE_BASE ** (-torch.arange(q, dtype=torch.float64) / q)  # (d/4,)
    n = torch.arange(grid * grid)
    rows, cols = (n // grid).double(), (n % grid).double()  # (N,)
    return torch.cat([rows[:, None] * theta, cols[:, None] * theta], dim=1).float()  # (N, d/2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_2i, x_2i+1) by its angle: [[cos, -sin], [sin, cos]] (seed 002).

    x (B, H, N, d); cos, sin (N, d/2), or (B, 1, N, d/2) per image. Returns (B, H, N, d) in x's dtype.
    """
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)  # 2 x (B, H, N, d/2)
    y = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # (B, H, N, d/2, 2)
    return y.flatten(-2).type_as(x)  # (B, H, N, d)


def gather_rope(rope: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-grid rotary tables 2 x (N, d/2) -> the rows of each image's tokens, 2 x (B, 1, L, d/2), for ids (B, L)."""
    return rope[0][ids].unsqueeze(1), rope[1][ids].unsqueeze(1)


def gather_tokens(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x (B, N, ...) and ids (B, M) -> (B, M, ...): each image's tokens at its own indices."""
    index = ids.view(*ids.shape, *(1,) * (x.dim() - 2)).expand(-1, -1, *x.shape[2:])
    return x.gather(1, index)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, mode: str) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) V per head: q (B, H, L, d), k and v (B, H, S, d) -> (B, H, L, d).

    mode (ModelConfig.attention): sdpa, explicit (written out), or auto = SDPA except on CPU under
    bf16/fp16, where the written-out form is used.
    """
    if mode == "explicit" or (mode == "auto" and q.device.type == "cpu" and q.dtype != torch.float32):
        # on CPU in bf16 this beats SDPA's flash kernel 1.5x per training step (its backward is
        # slow); scaling Q, not the (L, S) scores, is cheaper and keeps torch.compile from
        # rewriting it back into SDPA (docs/benchmarks.md)
        a = torch.softmax((q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2), dim=-1)  # (B, H, L, S)
        return F.dropout(a, dropout) @ v  # (B, H, L, d)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)  # (B, H, L, d)


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, N, H*d) -> (B, H, N, d): head h takes columns h*d .. (h+1)*d - 1."""
    b, n, hd = x.shape
    return x.view(b, n, num_heads, hd // num_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) -> (B, N, H*d): the heads concatenated, the inverse of `split_heads`."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


class Attention(nn.Module):
    """Multi-head self-attention: softmax(Q K^T / sqrt(d)) V per head, through SDPA or written out.

    With K < H key/value heads (grouped-query attention), query head h reads key/value head
    h // (H / K). Rotary positions, when given, turn Q and K before the scores. With `ids`, only
    the tokens in ids ask queries (every token still gives keys and values): the output is theirs.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool,
        out_proj: bool,
        dropout: float,
        num_kv_heads: int = 0,
        mode: str = "auto",
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.dropout = dropout
        self.mode = mode  # auto | sdpa | explicit (ModelConfig.attention)
        kv_dim = self.num_kv_heads * (dim // num_heads)
        self.split = (dim, kv_dim, kv_dim)
        self.qkv = nn.Linear(dim, dim + 2 * kv_dim, bias=qkv_bias)  # W_q, W_k, W_v stacked: one matmul
        self.proj = nn.Linear(dim, dim) if out_proj else nn.Identity()

    @property
    def branch_output(self) -> nn.Linear | None:
        """The last linear layer of this residual branch (W_O), or None without an output projection."""
        return self.proj if isinstance(self.proj, nn.Linear) else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, N, D) -> (B, N, D), or (B, M, D) for the M query tokens in ids (B, M)."""
        if ids is None:
            q, k, v = self.qkv(x).split(self.split, dim=-1)  # (B, N, D), 2 x (B, N, K*d)
            rope_q = rope
        else:  # the same weights, cut in two: Q for the M selected tokens, K and V for all N
            cut = (self.split[0], 2 * self.split[1])
            w_q, w_kv = self.qkv.weight.split(cut)
            b_q, b_kv = self.qkv.bias.split(cut) if self.qkv.bias is not None else (None, None)
            q = F.linear(gather_tokens(x, ids), w_q, b_q)  # (B, M, D)
            k, v = F.linear(x, w_kv, b_kv).split(self.split[1:], dim=-1)  # 2 x (B, N, K*d)
            rope_q = None if rope is None else tuple(r[ids].unsqueeze(1) for r in rope)  # 2 x (B, 1, M, d/2)
        q = split_heads(q, self.num_heads)  # (B, H, N or M, d)
        k, v = split_heads(k, self.num_kv_heads), split_heads(v, self.num_kv_heads)  # 2 x (B, K, N, d)
        if rope is not None:
            q, k = apply_rope(q, *rope_q), apply_rope(k, *rope)
        if self.num_kv_heads != self.num_heads:
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # 2 x (B, H, N, d)
        y = attend(q, k, v, self.dropout if self.training else 0.0, self.mode)  # (B, H, N or M, d)
        return self.proj(merge_heads(y))  # (B, N or M, D)


class SquaredReLU(nn.Module):
    """max(0, x)^2, element-wise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()


class FeedForward(nn.Module):
    """Position-wise FFN: Y = act(X W_1 + b_1) W_2 + b_2, or with swiglu Y = (silu(X W_1) * X W_3) W_2.

    act is relu, gelu or relu2, the squared ReLU max(0, x)^2 (Primer, So et al. 2021).

    For swiglu, fc1 holds W_1 and W_3 stacked (one matmul), so it maps D to 2F.
    """

    def __init__(self, dim: int, hidden: int, activation: str):
        super().__init__()
        self.gated = activation == "swiglu"
        self.fc1 = nn.Linear(dim, 2 * hidden if self.gated else hidden, bias=not self.gated)
        self.act = {"relu": nn.ReLU(), "gelu": nn.GELU(), "relu2": SquaredReLU(), "swiglu": nn.SiLU()}[activation]
        self.fc2 = nn.Linear(hidden, dim, bias=not self.gated)

    @property
    def branch_output(self) -> nn.Linear:
        """The last linear layer of this residual branch (W_2)."""
        return self.fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # (B, N, F) or (B, N, 2F)
        if self.gated:
            gate, value = h.chunk(2, dim=-1)  # 2 x (B, N, F)
            return self.fc2(self.act(gate) * value)  # (B, N, D)
        return self.fc2(self.act(h))  # (B, N, D)


class TokenConv(nn.Module):
    """A depthwise k x k convolution over the g x g grid of tokens, zero-padded at the border: channel c
    of a token becomes b_c + sum over its k x k neighbours j of w_c[j] x_j[c] (as CPE, Chu et al. 2021).

    The mixing is local and the same at every position; a block adds it to its input first.
    """

    def __init__(self, dim: int, kernel: int):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, kernel, padding=kernel // 2, groups=dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, D) on a g x g grid, row-major -> (B, N, D)."""
        b, n, d = x.shape
        g = math.isqrt(n)
        y = self.conv(x.transpose(1, 2).reshape(b, d, g, g))  # (B, D, g, g)
        return y.flatten(2).transpose(1, 2)  # (B, N, D)


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-6)
    return nn.Identity()


class Block(nn.Module):
    """Attention then FFN, each a residual branch. Pre-norm: x + f(norm(x)); post-norm: norm(x + f(x)).
    With `model.token_conv` k, x + TokenConv(x) comes first (the whole grid, before any tokens are picked).

    With `ids`, the block computes only the tokens in ids (attending to all N): the model's last
    block does so for the masked tokens, the only ones the head reads.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.hidden_dim
        self.pre_norm = cfg.norm_position == "pre"
        self.norm1 = make_norm(cfg.norm, d)
        self.attn = Attention(
            d, cfg.num_heads, cfg.qkv_bias, cfg.out_proj, cfg.dropout, cfg.num_kv_heads, mode=cfg.attention
        )
        self.norm2 = make_norm(cfg.norm, d)
        self.ffn = FeedForward(d, cfg.ffn_dim, cfg.activation)
        self.drop = nn.Dropout(cfg.dropout)
        self.token_conv = TokenConv(d, cfg.token_conv) if cfg.token_conv else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, N, D) -> (B, N, D), or (B, M, D) for the tokens in ids (B, M)."""
        if self.token_conv is not None:
            x = x + self.token_conv(x)  # (B, N, D)
        res = x if ids is None else gather_tokens(x, ids)  # (B, N or M, D)
        if self.pre_norm:
            x = res + self.drop(self.attn(self.norm1(x), rope, ids))
            return x + self.drop(self.ffn(self.norm2(x)))
        x = self.norm1(res + self.drop(self.attn(x, rope, ids)))
        return self.norm2(x + self.drop(self.ffn(x)))


class MaskedPatchViT(nn.Module):
    """Predicts the class of masked patches from the visible ones.

    `model.decoder: none` (the default) is one stack over all N tokens, masked ones standing in as
    `fill`. With `self` or `cross`, the stack is an encoder over the visible tokens only and a
    `Decoder` (vitmask.model.decoder) predicts the masked ones: forward = `forward_encoder` then
    `forward_decoder`.
    """

    def __init__(self, cfg: ModelConfig, num_patches: int, patch_dim: int, num_classes: int, fill: float | str):
        super().__init__()
        d = cfg.hidden_dim
        self.fill = fill if cfg.decoder == "none" else None  # a decoder brings its own mask token
        self.zero_init_residual = cfg.zero_init_residual
        self.embed = nn.Linear(patch_dim, d)  # A_up, b_up
        if self.fill == "learned":
            self.mask_token = nn.Parameter(torch.zeros(d))  # the embedding of every masked patch
        grid = math.isqrt(num_patches)
        self.rotary = cfg.rotary  # rope2d, rope2d+learned: Q and K are rotated in every block
        if cfg.learned_pos:
            self.pos = nn.Parameter(torch.zeros(num_patches, d))  # P (N, D), learned
        elif cfg.pos == "sincos2d":
            self.register_buffer("pos", sincos_2d(d, grid), persistent=False)  # P (N, D), fixed
        else:  # rope2d alone: nothing is added to the tokens
            self.pos = None
        if self.rotary:
            angles = rope_2d_angles(cfg.head_dim, grid)  # (N, d/2)
            self.register_buffer("rope_cos", angles.cos(), persistent=False)
            self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        # a pre-norm stack leaves its residual stream un-normalised: normalise once before the head
        self.norm = make_norm(cfg.norm, d) if cfg.norm_position == "pre" else nn.Identity()
        self.decoder = None
        if cfg.decoder != "none":
            from vitmask.model.decoder import Decoder  # imported here: vitmask.model.decoder builds on this module

            self.decoder = Decoder(cfg, num_patches)
            d = cfg.decoder_width  # the head reads the decoder's features
        self.head = nn.Linear(d, num_classes)  # A_down, b_down
        self.init_weights()

    def init_weights(self) -> None:
        """All initialisation rules in one place.

        - Linear weights: Xavier-uniform, which keeps activation variance steady through the
          projections (as MAE does); biases zero, so the model starts unbiased between classes.
        - A learned positional embedding: normal with std 0.02, small beside the patch embedding so
          early training is driven by content. Fixed positions (sincos2d, rotary) are not trained.
          The learned mask embedding likewise (as in BEiT).
        - The patch embedding's bias, under rope2d alone with no learned mask embedding in the stack (a
          decoder design, or a fill value): normal with std 0.02. Nothing is added to the tokens
          there, so with a zero bias a blank patch would be the zero vector, and an input of blank
          patches alone (a mostly masked digit's border) all zeros, where each LayerNorm's gradient
          is 1/sqrt(eps) ~ 316: 1e20 at the embedding after the encoder's 8 norms, an infinite
          gradient norm at the first step (measured). Elsewhere it stays zero.
        - LayerNorm and RMSNorm: the identity (weight 1, bias 0), torch's default, left as is.
        - The token convolution (`model.token_conv`): torch's default for a convolution, as CPE.
        - With `model.zero_init_residual`, the last linear layer of every residual branch (each
          attention's output projection W_O, each FFN's W_2) starts at zero, so every block starts
          as the identity and the stack as the embedding followed by the head (GPT-2's and
          modded-nanogpt's practice). Without an output projection, attention's branch keeps its init.
        """
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if isinstance(self.pos, nn.Parameter):
            nn.init.normal_(self.pos, std=0.02)
        if self.fill == "learned":
            nn.init.normal_(self.mask_token, std=0.02)
        if self.pos is None and self.fill != "learned":
            nn.init.normal_(self.embed.bias, std=0.02)
        if self.decoder is not None:  # the decoder's positions and mask token, by the same rules
            self.decoder.init_weights()
        if self.zero_init_residual:  # every branch adds 0 at first: each block starts as the identity
            for m in self.modules():
                if getattr(m, "branch_output", None) is not None:
                    nn.init.zeros_(m.branch_output.weight)

    def forward(self, patches: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """patches (B, N, P) float pixels, mask (B, N) bool (True = masked), ids (B, M) masked indices.

        Returns logits (B, M, C) for the patches in `ids`, or (B, N, C) for every patch if ids is None.
        The masked patches' pixels are replaced by `fill` (or their tokens by the learned mask
        embedding) here, so callers pass the true pixels. With a decoder, the rows of visible
        patches in the (B, N, C) result are 0: the decoder predicts the masked patches only.
        """
        if self.decoder is not None:
            return self.forward_encoder_decoder(patches, mask, ids)
        if self.fill == "learned":
            x = torch.where(mask.unsqueeze(-1), self.mask_token, self.embed(patches))  # (B, N, D)
        else:
            x = self.embed(apply_fill(patches, mask, self.fill))  # (B, N, D)
        if self.pos is not None:
            x = x + self.pos  # (B, N, D)
        rope = (self.rope_cos, self.rope_sin) if self.rotary else None
        for block in self.blocks[:-1]:
            x = block(x, rope)  # (B, N, D)
        # the last block computes only the tokens the head reads: the masked ones when ids is given
        x = self.blocks[-1](x, rope, ids)  # (B, M or N, D)
        return self.head(self.norm(x))  # (B, M or N, C)

    # ---- the encoder-decoder designs (model.decoder: self | cross) ---------------------------
    def forward_encoder(
        self, patches: torch.Tensor, keep: torch.Tensor | None = None, depth: int | None = None
    ) -> torch.Tensor:
        """patches (B, N, P), keep (B, V) the visible patches' indices (None: all N) -> (B, V, D).

        The encoder sees the patches in `keep` only, gathered into a dense tensor; each token gets
        the position of its own patch (added, or rotated in by rope2d). A pre-norm stack ends in its norm.
        With `depth` K, the output of block K instead (0: the embedded patches), not normalised.
        """
        rope = (self.rope_cos, self.rope_sin) if self.rotary else None
        if keep is None:
            x = self.embed(patches)  # (B, N, D)
            pos = self.pos  # (N, D) or None
        else:
            x = self.embed(gather_tokens(patches, keep))  # (B, V, D)
            pos = None if self.pos is None else self.pos[keep]  # (B, V, D)
            rope = None if rope is None else gather_rope(rope, keep)  # 2 x (B, 1, V, d/2)
        if pos is not None:
            x = x + pos  # (B, V, D)
        if x.shape[1] > 0:  # every patch masked: no token, nothing to compute
            for block in self.blocks[:depth]:  # every block, or the first K
                x = block(x, rope)  # (B, V, D)
        return self.norm(x) if depth is None else x  # (B, V, D)

    def forward_decoder(self, encoded: torch.Tensor, keep: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """encoded (B, V, D) at the visible positions keep (B, V) -> logits (B, M, C) for the masked ids (B, M)."""
        return self.head(self.decoder(encoded, keep, ids))  # (B, M, C)

    def forward_encoder_decoder(
        self, patches: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`forward` with a decoder: logits (B, M, C) for ids, or (B, N, C) with zero rows at visible patches."""
        every = ids is None
        if every:
            ids = mask_to_ids(mask)  # (B, M); reads M from the mask (a host sync: never in a training step)
        keep = visible_ids(mask, ids.shape[1])  # (B, V)
        logits = self.forward_decoder(self.forward_encoder(patches, keep), keep, ids)  # (B, M, C)
        if not every:
            return logits
        full = logits.new_zeros(*mask.shape, logits.shape[-1])  # (B, N, C)
        return full.scatter(1, ids.unsqueeze(-1).expand_as(logits), logits)  # (B, N, C)


def build_model(cfg: Config) -> MaskedPatchViT:
    d = cfg.data
    return MaskedPatchViT(cfg.model, d.num_patches, d.patch_dim, d.num_classes, cfg.mask.fill)
