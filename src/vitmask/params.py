"""The parameter table printed by `vitmask count-params`, one row per tensor, as in seed 001 (with a
decoder, the encoder's and the decoder's totals too), and the analytic FLOP count the benchmark
turns into achieved FLOP/s."""

from torch import nn

from vitmask.config import Config
from vitmask.masking import num_masked

# the seed's names for the tensors of its model, shown beside ours
SEED_NAMES = {
    "embed.weight": "A_up",
    "embed.bias": "b_up",
    "pos": "P",
    "mask_token": "(learned mask embedding, not in the seed)",
    "attn.qkv.weight": "W_q, W_k, W_v",
    "attn.qkv.bias": "b_q, b_k, b_v",
    "attn.proj.weight": "W_O",
    "ffn.fc1.weight": "A_1",
    "ffn.fc1.bias": "b_1",
    "ffn.fc2.weight": "A_2",
    "ffn.fc2.bias": "b_2",
    "head.weight": "A_down",
    "head.bias": "b_down",
}


def param_rows(model: nn.Module) -> list[tuple[str, tuple[int, ...], int, str]]:
    rows = []
    for name, p in model.named_parameters():
        short = name.split(".", 2)[-1] if name.startswith("blocks.") else name
        rows.append((name, tuple(p.shape), p.numel(), SEED_NAMES.get(short, "")))
    return rows


def is_decoder_param(name: str) -> bool:
    """Whether a parameter belongs to the decoder's side of an encoder-decoder model: `decoder.*` and the head."""
    return name.startswith("decoder.") or name.startswith("head.")


def format_table(model: nn.Module) -> str:
    rows = param_rows(model)
    width = max(len(r[0]) for r in rows)
    lines = [f"{'tensor':<{width}}  {'shape':<14} {'params':>12}  seed"]
    for name, shape, n, seed in rows:
        lines.append(f"{name:<{width}}  {'x'.join(map(str, shape)):<14} {n:>12,}  {seed}".rstrip())
    total = sum(r[2] for r in rows)
    if any(r[0].startswith("decoder.") for r in rows):  # an encoder-decoder model: the two parts, then the total
        decoder = sum(r[2] for r in rows if is_decoder_param(r[0]))
        lines.append(f"{'encoder':<{width}}  {'':<14} {total - decoder:>12,}")
        lines.append(f"{'decoder (with the head)':<{width}}  {'':<14} {decoder:>12,}")
    lines.append(f"{'total':<{width}}  {'':<14} {total:>12,}")
    return "\n".join(lines)


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

    if m.decoder != "none":
        return encoder_decoder_flops_per_image(cfg, masked_last_block)
    embed = 2 * n * d.patch_dim * dim
    head = 2 * masked * dim * d.num_classes
    return embed + (m.depth - 1) * block(n) + block(masked if masked_last_block else n) + head


def attention_block_flops(q: int, n: int, dim: int, kv: int, ffn: int, swiglu: bool, out_proj: bool) -> int:
    """One self-attention block where q of n tokens ask queries: the matmuls of `forward_flops_per_image`."""
    proj = 2 * q * dim * dim if out_proj else 0
    return (
        2 * q * dim * dim + 2 * n * dim * 2 * kv + 2 * 2 * q * n * dim + proj + 2 * q * ffn * dim * (3 if swiglu else 2)
    )


def encoder_decoder_flops_per_image(cfg: Config, masked_last_block: bool = True) -> int:
    """The forward matmuls of one image with a decoder (model.decoder: self | cross).

    V = N - M visible, E decoder width, Fe its FFN. Encoder: embedding 2 V P D and `depth` blocks over
    the V visible tokens. Decoder: the projection 2 V D E; `self`: blocks over all N tokens, the last
    computing only the M masked ones (all N with masked_last_block=False); `cross`, per block: Q
    2 M E^2, K and V of the memory 2 V E 2E, scores and weights x V 2 x 2 M V E, output 2 M E^2,
    FFN 2 M E Fe x (2, or 3 for swiglu), plus with decoder_self_attn a self-attention among the M
    queries (Q, K, V 2 M E 3E, 2 x 2 M M E, output 2 M E^2). Head 2 M E C.
    """
    m, d = cfg.model, cfg.data
    dm = m.decoder_config
    n = d.num_patches
    masked = num_masked(n, cfg.mask.ratio)
    visible = n - masked
    swiglu = m.activation == "swiglu"
    enc = 2 * visible * d.patch_dim * m.hidden_dim + m.depth * attention_block_flops(
        visible, visible, m.hidden_dim, m.kv_heads * m.head_dim, m.ffn_dim, swiglu, m.out_proj
    )
    e, fe = dm.hidden_dim, dm.ffn_dim
    project = 2 * visible * m.hidden_dim * e
    if m.decoder == "self":
        last = masked if masked_last_block else n
        dec = (dm.depth - 1) * attention_block_flops(n, n, e, e, fe, swiglu, m.out_proj)
        dec += attention_block_flops(last, n, e, e, fe, swiglu, m.out_proj)
    else:
        out = 2 * masked * e * e if m.out_proj else 0
        cross = 2 * masked * e * e + 2 * visible * e * 2 * e + 2 * 2 * masked * visible * e + out
        ffn = 2 * masked * fe * e * (3 if swiglu else 2)
        own = attention_block_flops(masked, masked, e, e, 0, swiglu, m.out_proj) if m.decoder_self_attn else 0
        dec = dm.depth * (cross + ffn + own)
    head = 2 * masked * e * d.num_classes
    return enc + project + dec + head


def train_flops_per_image(cfg: Config, masked_last_block: bool = True) -> int:
    """One training step per image: forward + backward = 3 x forward (the backward pass computes a
    gradient for the input and one for the weight of every matmul, each as costly as the forward)."""
    return 3 * forward_flops_per_image(cfg, masked_last_block)
