"""The layers the encoder and the decoders share: the token gather, attention (SDPA or written
out), the feed-forward network, the token convolution, norms and the transformer block.

Shapes: B batch, N tokens, D width, H heads, K key/value heads, d = D / H head dim, F ffn_dim,
L tokens asked for by ids.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from vitmask.config import ModelConfig
from vitmask.model.positions import apply_rope, rotate_qk


def gather_tokens(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x (B, N, ...) and ids (B, M) -> (B, M, ...): each image's tokens at its own indices."""
    index = ids.view(*ids.shape, *(1,) * (x.dim() - 2)).expand(-1, -1, *x.shape[2:])
    return x.gather(1, index)


def writes_out_scores(mode: str, device_type: str, low_precision: bool) -> bool:
    """Whether attention is written out, its scores (B, H, L, S) materialised, rather than run by SDPA:
    always for `explicit`; for `auto` on CPU under bf16/fp16, where the written-out form trains faster."""
    return mode == "explicit" or (mode == "auto" and device_type == "cpu" and low_precision)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, mode: str) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) V per head: q (B, H, L, d), k and v (B, H, S, d) -> (B, H, L, d).

    mode (ModelConfig.attention): sdpa, explicit (written out), or auto = SDPA except on CPU under
    bf16/fp16, where the written-out form is used.
    """
    if writes_out_scores(mode, q.device.type, q.dtype != torch.float32):
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
        if ids is None and rope is not None:  # Q and K of the same tokens: rotated together, in one op
            return self.attend_rotated(x, rope)
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
        if rope is not None:  # the last block: Q of the M picked tokens, K of all N, each with its own rows
            q, k = apply_rope(q, *rope_q), apply_rope(k, *rope)
        return self.mix(q, k, v)  # (B, N or M, D)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, L, d), k and v (B, K, N, d) -> (B, L, D): grouped heads, attention, output projection."""
        if self.num_kv_heads != self.num_heads:
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # 2 x (B, H, N, d)
        y = attend(q, k, v, self.dropout if self.training else 0.0, self.mode)  # (B, H, L, d)
        return self.proj(merge_heads(y))  # (B, L, D)

    def attend_rotated(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x (B, N, D) -> (B, N, D) with rotary positions: Q and K turned in one `rotate_qk` on the
        projection's (B, N, H + K, d) layout, then split into heads."""
        qk, v = self.qkv(x).split(
            (self.split[0] + self.split[1], self.split[2]), dim=-1
        )  # (B, N, D + K*d), (B, N, K*d)
        qk = rotate_qk(qk.unflatten(-1, (self.num_heads + self.num_kv_heads, -1)), rope)  # (B, N, H + K, d)
        q, k = qk.transpose(1, 2).split((self.num_heads, self.num_kv_heads), dim=1)  # (B, H, N, d), (B, K, N, d)
        return self.mix(q, k, split_heads(v, self.num_kv_heads))  # (B, N, D)


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
