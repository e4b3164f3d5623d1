"""The analytic FLOP count of a training step: every matmul of the model, per image. The benchmark
turns it into achieved FLOP/s (docs/benchmarks.md); tests check it against torch's FLOP counter."""

from vitmask.config import Config
from vitmask.sizes import num_masked


def forward_flops_per_image(cfg: Config, masked_last_block: bool = True) -> int:
    """Multiply-adds x 2 of one image's forward pass in training: every matmul, nothing elementwise.

    Per block, with N tokens of which Q ask queries, D = hidden_dim, Dkv = kv_heads * head_dim,
    F = ffn_dim: Q projection 2 Q D^2, K and V 2 N D 2 Dkv, scores Q K^T 2 Q N D, weights x V
    2 Q N D, output projection 2 Q D^2, FFN 2 Q D F x (2, or 3 for swiglu), and with a token
    convolution of k x k (`model.token_conv`) 2 N D k^2 (it sees the whole grid). Q = N in every block
    but the last, which computes only the M masked tokens the head reads (Q = M; Q = N with
    masked_last_block=False, as a model that computes every token, like the reference). Plus the patch
    embedding 2 N P D and the head 2 M D C. Norms, softmax, GELU, RoPE and the loss are left out
    (under 2% here).
    """
    arch, data = cfg.model, cfg.data
    n, dim, f = data.num_patches, arch.hidden_dim, arch.ffn_dim
    kv = arch.kv_heads * arch.head_dim
    masked = num_masked(n, cfg.mask.ratio)

    def block(q: int) -> int:
        ffn = 2 * q * f * dim * arch.ffn_matrices
        proj = 2 * q * dim * dim if arch.out_proj else 0
        conv = 2 * n * dim * arch.token_conv**2
        return 2 * q * dim * dim + 2 * n * dim * 2 * kv + 2 * 2 * q * n * dim + proj + ffn + conv

    if arch.decoder != "none":
        return encoder_decoder_flops_per_image(cfg, masked_last_block)
    embed = 2 * n * data.patch_dim * dim
    head = 2 * masked * dim * data.num_classes
    return embed + (arch.depth - 1) * block(n) + block(masked if masked_last_block else n) + head


def attention_block_flops(q: int, n: int, dim: int, kv: int, ffn: int, ffn_matrices: int, out_proj: bool) -> int:
    """One self-attention block where q of n tokens ask queries: the matmuls of `forward_flops_per_image`."""
    proj = 2 * q * dim * dim if out_proj else 0
    return 2 * q * dim * dim + 2 * n * dim * 2 * kv + 2 * 2 * q * n * dim + proj + 2 * q * ffn * dim * ffn_matrices


def encoder_decoder_flops_per_image(cfg: Config, masked_last_block: bool = True) -> int:
    """The forward matmuls of one image with a decoder (model.decoder: self | cross).

    V = N - M visible, E decoder width, Fe its FFN. Encoder: embedding 2 V P D and `depth` blocks over
    the V visible tokens. Decoder: the projection 2 V D E; `self`: blocks over all N tokens, the last
    computing only the M masked ones (all N with masked_last_block=False); `cross`, per block: Q
    2 M E^2, K and V of the memory 2 V E 2E, scores and weights x V 2 x 2 M V E, output 2 M E^2,
    FFN 2 M E Fe x (2, or 3 for swiglu), plus with decoder_self_attn a self-attention among the M
    queries (Q, K, V 2 M E 3E, 2 x 2 M M E, output 2 M E^2). Head 2 M E C.
    """
    arch, data = cfg.model, cfg.data
    dm = arch.decoder_config
    n = data.num_patches
    masked = num_masked(n, cfg.mask.ratio)
    visible = n - masked
    mats = arch.ffn_matrices
    enc = 2 * visible * data.patch_dim * arch.hidden_dim + arch.depth * attention_block_flops(
        visible, visible, arch.hidden_dim, arch.kv_heads * arch.head_dim, arch.ffn_dim, mats, arch.out_proj
    )
    e, fe = dm.hidden_dim, dm.ffn_dim
    project = 2 * visible * arch.hidden_dim * e
    if arch.decoder == "self":
        last = masked if masked_last_block else n
        dec = (dm.depth - 1) * attention_block_flops(n, n, e, e, fe, mats, arch.out_proj)
        dec += attention_block_flops(last, n, e, e, fe, mats, arch.out_proj)
    else:
        out = 2 * masked * e * e if arch.out_proj else 0
        cross = 2 * masked * e * e + 2 * visible * e * 2 * e + 2 * 2 * masked * visible * e + out
        ffn = 2 * masked * fe * e * mats
        own = attention_block_flops(masked, masked, e, e, 0, mats, arch.out_proj) if arch.decoder_self_attn else 0
        dec = dm.depth * (cross + ffn + own)
    head = 2 * masked * e * data.num_classes
    return enc + project + dec + head


def train_flops_per_image(cfg: Config, masked_last_block: bool = True) -> int:
    """One training step per image: forward + backward = 3 x forward (the backward pass computes a
    gradient for the input and one for the weight of every matmul, each as costly as the forward)."""
    return 3 * forward_flops_per_image(cfg, masked_last_block)
