"""The decoders of the encoder-decoder designs (`model.decoder: self | cross`), and the visible-token gather.

With a decoder, the encoder (`MaskedPatchViT.forward_encoder`) runs on the visible patches alone.
Every image of a batch hides exactly M patches, so the visible ones gather into a dense (B, V, D)
tensor with V = N - M and no padding (`masked_input.visible_ids`). The decoder takes the encoder's output,
projects it to its own width E, and predicts the masked patches:

- `self` (MAE, He et al. 2022): a learned mask token is put at every masked position, the visible
  tokens at theirs, positions are added back (or rotated in, for rope2d), and self-attention blocks
  run over all N tokens; the last block computes only the M masked ones, which the head reads.
- `cross` (CrossMAE, Fu et al. 2024): the queries are the mask token plus the position of each
  masked patch, (B, M, E) only. Each block cross-attends from the queries to the projected encoder
  output (docs/notation.md: Q from the decoder, K and V from the encoder), then runs the FFN, each a
  residual branch with its norm; with `model.decoder_self_attn` the queries first self-attend.
  Queries never see each other otherwise, so every masked patch is predicted independently.

Positions reach the decoder the way `model.pos` says: learned or sincos2d vectors (the decoder's
own, of width E) are added to the visible tokens and the mask tokens; rope2d rotates queries and
keys by each token's true grid position, gathered per image; rope2d+learned does both.

When M = N (all patches masked) the encoder has no token: cross-attention then reads nothing and
adds zero (a softmax over no keys is defined here as attending to nothing), and the self decoder
runs on mask tokens alone.

Shapes: B batch, N patches, M masked, V = N - M visible, D encoder width, E decoder width,
H decoder heads, d = E / H head dim, C classes.
"""

import torch
from torch import nn

from vitmask.config import ModelConfig
from vitmask.model.layers import Attention, Block, FeedForward, attend, make_norm, merge_heads, split_heads
from vitmask.model.positions import Rope, apply_rope, attach_positions, gather_rope, rope_tables


class CrossAttention(nn.Module):
    """Multi-head cross-attention: softmax(Q K^T / sqrt(d)) V per head, with Q = x W_q from the decoder's
    queries and K = m W_k, V = m W_v from the memory (the projected encoder output), then W_O.

    Rotary positions, when given, turn Q by the queries' positions and K by the memory's.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, out_proj: bool, dropout: float, mode: str = "auto"):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.mode = mode  # auto | sdpa | explicit (ModelConfig.attention)
        self.q = nn.Linear(dim, dim, bias=qkv_bias)  # W_q
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)  # W_k, W_v stacked: one matmul
        self.proj = nn.Linear(dim, dim) if out_proj else nn.Identity()  # W_O

    @property
    def branch_output(self) -> nn.Linear | None:
        """The last linear layer of this residual branch (W_O), or None without an output projection."""
        return self.proj if isinstance(self.proj, nn.Linear) else None

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, rope_q: Rope | None = None, rope_kv: Rope | None = None
    ) -> torch.Tensor:
        """x (B, M, E) queries, memory (B, V, E) -> (B, M, E)."""
        q = split_heads(self.q(x), self.num_heads)  # (B, H, M, d)
        k, v = (split_heads(t, self.num_heads) for t in self.kv(memory).chunk(2, dim=-1))  # 2 x (B, H, V, d)
        if rope_q is not None:
            q, k = apply_rope(q, *rope_q), apply_rope(k, *rope_kv)
        if memory.shape[1] == 0:  # nothing to attend to (every patch masked): the branch adds zero
            y = q.new_zeros(q.shape)  # (B, H, M, d)
        else:
            y = attend(q, k, v, self.dropout if self.training else 0.0, self.mode)  # (B, H, M, d)
        return self.proj(merge_heads(y))  # (B, M, E)


class CrossBlock(nn.Module):
    """A CrossMAE decoder block: [self-attention among the queries,] cross-attention to the memory, FFN.

    Each is a residual branch; pre-norm x + f(norm(x)) or post-norm norm(x + f(x)), as the encoder.
    """

    def __init__(self, cfg: ModelConfig, self_attn: bool):
        super().__init__()
        e = cfg.hidden_dim  # the decoder's config (ModelConfig.decoder_config): its width is E
        self.pre_norm = cfg.norm_position == "pre"
        if self_attn:
            self.norm_self = make_norm(cfg.norm, e)
            self.self_attn = Attention(e, cfg.num_heads, cfg.qkv_bias, cfg.out_proj, cfg.dropout, mode=cfg.attention)
        else:
            self.self_attn = None
        self.norm1 = make_norm(cfg.norm, e)
        self.cross = CrossAttention(e, cfg.num_heads, cfg.qkv_bias, cfg.out_proj, cfg.dropout, mode=cfg.attention)
        self.norm2 = make_norm(cfg.norm, e)
        self.ffn = FeedForward(e, cfg.ffn_dim, cfg.activation)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, rope_q: Rope | None = None, rope_kv: Rope | None = None
    ) -> torch.Tensor:
        """x (B, M, E) queries, memory (B, V, E) -> (B, M, E)."""
        if self.pre_norm:
            if self.self_attn is not None:
                x = x + self.drop(self.self_attn(self.norm_self(x), rope_q))
            x = x + self.drop(self.cross(self.norm1(x), memory, rope_q, rope_kv))
            return x + self.drop(self.ffn(self.norm2(x)))
        if self.self_attn is not None:
            x = self.norm_self(x + self.drop(self.self_attn(x, rope_q)))
        x = self.norm1(x + self.drop(self.cross(x, memory, rope_q, rope_kv)))
        return self.norm2(x + self.drop(self.ffn(x)))


class Decoder(nn.Module):
    """Encoder output of the visible tokens -> decoder features of the masked ones, (B, M, E).

    Parameters: `embed` (D -> E), `mask_token` (E,), `pos` (N, E) when positions are learned, the
    blocks, and a final norm for a pre-norm stack. The model's head maps the result to C logits.
    """

    def __init__(self, cfg: ModelConfig, num_patches: int):
        super().__init__()
        dcfg = cfg.decoder_config
        e = dcfg.hidden_dim
        self.kind = cfg.decoder  # self | cross
        self.embed = nn.Linear(cfg.hidden_dim, e)  # the encoder's width D to the decoder's E
        self.mask_token = nn.Parameter(torch.zeros(e))  # what the decoder starts from at every masked patch
        attach_positions(self, cfg, e, dcfg.head_dim, num_patches)  # the decoder's own, at its width E
        if self.kind == "self":
            self.blocks = nn.ModuleList(Block(dcfg) for _ in range(dcfg.depth))
        else:
            self.blocks = nn.ModuleList(CrossBlock(dcfg, cfg.decoder_self_attn) for _ in range(dcfg.depth))
        self.norm = make_norm(dcfg.norm, e) if dcfg.norm_position == "pre" else nn.Identity()

    def forward(self, encoded: torch.Tensor, keep: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """encoded (B, V, D) the encoder's output at the visible positions keep (B, V); ids (B, M) the
        masked positions -> (B, M, E), row j for patch ids[:, j]."""
        y = self.embed(encoded)  # (B, V, E)
        if self.kind == "self":
            return self.forward_self(y, keep, ids)
        return self.forward_cross(y, keep, ids)

    def forward_self(self, y: torch.Tensor, keep: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """MAE: y (B, V, E) back at its positions, the mask token elsewhere; self-attention over all N."""
        b, n, e = y.shape[0], keep.shape[1] + ids.shape[1], y.shape[2]
        index = keep.unsqueeze(-1).expand(-1, -1, e)  # (B, V, E)
        x = self.mask_token.to(y.dtype).expand(b, n, e).scatter(1, index, y)  # (B, N, E)
        if self.pos is not None:
            x = x + self.pos  # (B, N, E)
        rope = rope_tables(self)
        for block in self.blocks[:-1]:
            x = block(x, rope)  # (B, N, E)
        x = self.blocks[-1](x, rope, ids)  # (B, M, E): the last block computes only the masked tokens
        return self.norm(x)  # (B, M, E)

    def forward_cross(self, y: torch.Tensor, keep: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """CrossMAE: queries mask token + position (B, M, E) cross-attend to the memory y (B, V, E)."""
        b, m, e = ids.shape[0], ids.shape[1], y.shape[2]
        x = self.mask_token.expand(b, m, e)  # (B, M, E)
        rope_q = rope_kv = None
        if self.pos is not None:
            x = x + self.pos[ids]  # (B, M, E)
            y = y + self.pos[keep]  # (B, V, E)
        if self.rotary:
            rope_q, rope_kv = (
                gather_rope(rope_tables(self), ids),
                gather_rope(rope_tables(self), keep),
            )  # (B, 1, M or V, d/2)
        for block in self.blocks:
            x = block(x, y, rope_q, rope_kv)  # (B, M, E)
        return self.norm(x)  # (B, M, E)

    def init_weights(self) -> None:
        """As the encoder's: learned positions and the mask token normal with std 0.02 (MAE); the
        Linear layers are initialised by the model's `init_weights`."""
        if isinstance(self.pos, nn.Parameter):
            nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
