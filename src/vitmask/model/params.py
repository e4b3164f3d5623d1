"""The parameter table printed by `vitmask count-params`: one row per tensor, with the name of
each in docs/notation.md beside ours, then (for an encoder-decoder model) the encoder's and the decoder's
totals, then the total. (The FLOP count lives in `flops.py`.)"""

from torch import nn

# each tensor's symbol in docs/notation.md, shown beside our name
NOTATION_NAMES = {
    "embed.weight": "A_up",
    "embed.bias": "b_up",
    "pos": "P",
    "mask_token": "(learned mask embedding)",
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


ParamRow = tuple[str, tuple[int, ...], int, str]  # tensor name, shape, parameter count, its symbol in docs/notation.md


def param_rows(model: nn.Module) -> list[ParamRow]:
    rows = []
    for name, p in model.named_parameters():
        short = name.split(".", 2)[-1] if name.startswith("blocks.") else name
        rows.append((name, tuple(p.shape), p.numel(), NOTATION_NAMES.get(short, "")))
    return rows


def is_decoder_param(name: str) -> bool:
    """Whether a parameter belongs to the decoder's side of an encoder-decoder model: `decoder.*` and the head."""
    return name.startswith("decoder.") or name.startswith("head.")


def format_table(rows: list[ParamRow]) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [f"{'tensor':<{width}}  {'shape':<14} {'params':>12}  notation"]
    for name, shape, n, symbol in rows:
        lines.append(f"{name:<{width}}  {'x'.join(map(str, shape)):<14} {n:>12,}  {symbol}".rstrip())
    total = sum(r[2] for r in rows)
    if any(r[0].startswith("decoder.") for r in rows):  # an encoder-decoder model: the two parts, then the total
        decoder = sum(r[2] for r in rows if is_decoder_param(r[0]))
        lines.append(f"{'encoder':<{width}}  {'':<14} {total - decoder:>12,}")
        lines.append(f"{'decoder (with the head)':<{width}}  {'':<14} {decoder:>12,}")
    lines.append(f"{'total':<{width}}  {'':<14} {total:>12,}")
    return "\n".join(lines)
