"""Positions on the grid of patches: fixed 2D sin-cos vectors added to the tokens, and 2D rotary
angles that turn queries and keys (docs/notation.md, "Positions").

Shapes: N patches (N = g * g, g patches per side), d head dim, B batch, H heads, L tokens gathered.
"""

import math

import torch
from torch import nn

from vitmask.config import ModelConfig

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: (N, d/2) for the full grid, or (B, 1, L, d/2) gathered

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
    """Rotate each pair (x_2i, x_2i+1) by its angle: [[cos, -sin], [sin, cos]] (docs/notation.md).

    x (B, H, N, d); cos, sin (N, d/2), or (B, 1, N, d/2) per image. Returns (B, H, N, d) in x's dtype.
    Any layout works whose tables broadcast against x's pairs (`rotate_qk` uses (B, N, H, d)).
    """
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)  # 2 x (B, H, N, d/2)
    y = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # (B, H, N, d/2, 2)
    return y.flatten(-2).type_as(x)  # (B, H, N, d)


def rotate_qk(qk: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Queries and keys of the same tokens turned in one application, in the projection's own layout.

    qk (B, N, H + K, d): the query heads then the key heads of every token, as the fused QKV matmul
    leaves them (no transpose first); rope: the tables 2 x (N, d/2), or 2 x (B, 1, N, d/2) gathered
    per image. Each table row turns every head of its token. Returns (B, N, H + K, d).
    """
    cos, sin = (t.unsqueeze(-2) if t.dim() == 2 else t.transpose(1, 2) for t in rope)  # (N or B, N, 1, d/2)
    return apply_rope(qk, cos, sin)


def gather_rope(rope: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-grid rotary tables 2 x (N, d/2) -> the rows of each image's tokens, 2 x (B, 1, L, d/2), for ids (B, L)."""
    return rope[0][ids].unsqueeze(1), rope[1][ids].unsqueeze(1)


def attach_positions(module: nn.Module, cfg: ModelConfig, width: int, head_dim: int, num_patches: int) -> None:
    """Give `module` (the encoder, or a decoder at its own width) the positions `cfg.pos` asks for.

    - `module.pos`: the vectors added to the tokens, (N, width): a trained parameter (learned,
      rope2d+learned), a fixed sin-cos buffer (sincos2d), or None (rope2d alone);
    - `module.rope_cos`, `module.rope_sin`: the rotary tables (N, head_dim / 2) under rope2d and
      rope2d+learned, buffers not saved in checkpoints (they follow from the grid);
    - `module.rotary`: whether queries and keys are turned.

    The names are those of the checkpoints' state dicts; `rope_tables(module)` reads the tables back.
    """
    grid = math.isqrt(num_patches)
    module.rotary = cfg.rotary
    if cfg.learned_pos:
        module.pos = nn.Parameter(torch.zeros(num_patches, width))  # (N, width), learned
    elif cfg.pos == "sincos2d":
        module.register_buffer("pos", sincos_2d(width, grid), persistent=False)  # (N, width), fixed
    else:  # rope2d alone: nothing is added to the tokens
        module.pos = None
    if module.rotary:
        angles = rope_2d_angles(head_dim, grid)  # (N, d/2)
        module.register_buffer("rope_cos", angles.cos(), persistent=False)
        module.register_buffer("rope_sin", angles.sin(), persistent=False)


def rope_tables(module: nn.Module) -> Rope | None:
    """The full-grid rotary tables 2 x (N, d/2) that `attach_positions` gave `module`, or None without rotary."""
    return (module.rope_cos, module.rope_sin) if module.rotary else None
