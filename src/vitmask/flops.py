"""The analytic FLOP count of a training step: every matmul of the model, per image. The benchmark
turns it into achieved FLOP/s (docs/benchmarks.md); tests check it against torch's FLOP counter."""

from vitmask.config import Config
from vitmask.masking import num_masked


def forward_flops_per_image(cfg: Config, masked_last_block: bool = True) -> int:
    """Multiply-adds x 2 of one image's forward pass in training: every matmul, nothing elementwise.

    Per block, with N tokens of which Q ask queries, D = hidden_dim, Dkv = kv_heads * head_dim,
    F = ffn_dim: Q projection 2 Q D^2, K and V 2 N D 2 Dkv, scores Q K^T 2 Q N D, weights x V
    2 Q N D, output projection 2 Q D^2, FFN 2 Q D F x (2, or 3 for swiglu). Q = N in every block
    but the last, which computes only the M masked tokens the head reads (Q = M; Q = N with
    masked_last_block=False, as a model that computes every token, like the reference). Plus the patch
    embedding 2 N P D and the head 2 M D C. Norms, softmax, GELU, RoPE and the loss are left out
    (under 2% here).
    """
    m, d = cfg.model, cfg.data
    n, dim, f = d.num_patches, m.hidden_dim, m.ffn_dim
    kv = m.kv_heads * m.head_dim
    masked = num_masked(n, cfg.mask.ratio)

    def block(q: int) -> int:
        ffn = 2 * q * f * dim * (3 if m.activation == "swiglu" else 2)
        proj = 2 * q * dim * dim if m.out_proj else 0
        return 2 * q * dim * dim + 2 * n * dim * 2 * kv + 2 * 2 * q * n * dim + proj + ffn

    embed = 2 * n * d.patch_dim * dim
    head = 2 * masked * dim * d.num_classes
    return embed + (m.depth - 1) * block(n) + block(masked if masked_last_block else n) + head


def train_flops_per_image(cfg: Config, masked_last_block: bool = True) -> int:
    """One training step per image: forward + backward = 3 x forward (the backward pass computes a
    gradient for the input and one for the weight of every matmul, each as costly as the forward)."""
    return 3 * forward_flops_per_image(cfg, masked_last_block)
