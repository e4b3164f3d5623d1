"""The modern variants (RMSNorm, SwiGLU, grouped-query attention, 2D positions) and the
explicit attention path, each against a hand-written computation, plus shapes and gradients of the
whole model in every variant, and the config errors they bring."""

import math

import pytest
import torch

from tests.conftest import assert_user_error, run_cli
from vitmask.config import ModelConfig, config_from_dict
from vitmask.errors import UserError
from vitmask.model.layers import Attention, Block, FeedForward, TokenConv, make_norm
from vitmask.model.positions import apply_rope, rope_2d_angles, sincos_2d
from vitmask.model.vit import MaskedPatchViT


def test_rmsnorm_is_the_written_out_formula():
    torch.manual_seed(0)
    norm = make_norm("rmsnorm", 6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(6))
    a = torch.randn(3, 4, 6)
    rms = torch.sqrt((a**2).mean(-1, keepdim=True) + 1e-6)  # RMS(a) = sqrt(1/m sum a_i^2)
    torch.testing.assert_close(norm(a), a / rms * norm.weight, rtol=1e-5, atol=1e-6)


def test_swiglu_ffn_is_silu_gate_times_value():
    torch.manual_seed(0)
    ffn = FeedForward(8, 12, "swiglu")
    x = torch.randn(2, 5, 8)
    W1, W3 = ffn.fc1.weight.chunk(2, dim=0)  # (F, D) each
    silu = lambda z: z / (1 + torch.exp(-z))  # noqa: E731
    expected = (silu(x @ W1.T) * (x @ W3.T)) @ ffn.fc2.weight.T
    torch.testing.assert_close(ffn(x), expected, rtol=1e-5, atol=1e-6)
    assert ffn.fc1.weight.shape == (24, 8) and ffn.fc1.bias is None and ffn.fc2.bias is None


def test_relu2_ffn_squares_the_positive_part():
    torch.manual_seed(0)
    ffn = FeedForward(8, 12, "relu2")
    x = torch.randn(2, 5, 8)
    h = x @ ffn.fc1.weight.T + ffn.fc1.bias
    expected = torch.where(h > 0, h * h, torch.zeros_like(h)) @ ffn.fc2.weight.T + ffn.fc2.bias
    torch.testing.assert_close(ffn(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("extra", [{}, {"out_proj": False}, {"decoder": "cross", "decoder_depth": 2}])
def test_zero_init_residual_starts_every_block_as_the_identity(extra):
    cfg = ModelConfig(hidden_dim=16, num_heads=2, depth=3, ffn_dim=32, zero_init_residual=True, **extra)
    torch.manual_seed(0)
    model = MaskedPatchViT(cfg, num_patches=16, patch_dim=4, num_classes=16, fill="learned")
    zeroed = {n for n, p in model.named_parameters() if n.endswith("weight") and p.ndim == 2 and not p.any()}
    # by hand: each FFN's W_2, and each attention's W_O where there is one
    want = {f"blocks.{i}.ffn.fc2.weight" for i in range(3)}
    if extra.get("out_proj", True):
        want |= {f"blocks.{i}.attn.proj.weight" for i in range(3)}
    if extra.get("decoder") == "cross":
        want |= {f"decoder.blocks.{i}.{m}.weight" for i in range(2) for m in ("cross.proj", "ffn.fc2")}
    assert zeroed == want
    if not extra:  # the blocks add nothing: the output is the head on the normalised embedding
        patches = torch.randint(0, 2, (2, 16, 4)).float()
        mask = torch.zeros(2, 16, dtype=torch.bool)
        mask[:, ::3] = True
        x = torch.where(mask.unsqueeze(-1), model.mask_token, patches @ model.embed.weight.T + model.embed.bias)
        x = torch.nn.functional.layer_norm(x + model.pos, (16,))  # the final norm, still the identity affine
        torch.testing.assert_close(model(patches, mask), x @ model.head.weight.T + model.head.bias)


def test_token_conv_sums_each_channel_over_its_zero_padded_neighbours():
    torch.manual_seed(0)
    conv = TokenConv(2, 3)
    x = torch.randn(2, 16, 2)  # a 4x4 grid of tokens, 2 channels
    w, b = conv.conv.weight[:, 0], conv.conv.bias  # (2, 3, 3), (2,)
    want = torch.zeros_like(x)
    for r in range(4):
        for c in range(4):
            want[:, 4 * r + c] = b
            for dr in (-1, 0, 1):
                for dc in (-1, 0, 1):
                    if 0 <= r + dr < 4 and 0 <= c + dc < 4:  # outside the grid counts as 0
                        want[:, 4 * r + c] += w[:, dr + 1, dc + 1] * x[:, 4 * (r + dr) + c + dc]
    torch.testing.assert_close(conv(x), want, rtol=1e-5, atol=1e-6)


def test_a_block_with_a_token_conv_adds_it_to_its_input_first():
    cfg = ModelConfig(hidden_dim=8, num_heads=2, depth=1, ffn_dim=16, token_conv=3)
    torch.manual_seed(0)
    block, plain = Block(cfg), Block(ModelConfig(hidden_dim=8, num_heads=2, depth=1, ffn_dim=16))
    plain.load_state_dict({k: v for k, v in block.state_dict().items() if not k.startswith("token_conv")})
    x, ids = torch.randn(2, 9, 8), torch.tensor([[0, 4], [8, 3]])
    y = x + block.token_conv(x)
    torch.testing.assert_close(block(x), plain(y))
    torch.testing.assert_close(block(x, ids=ids), plain(y, ids=ids))  # the last block: the grid first, then ids


def hand_attention(x, attn, num_heads, num_kv_heads, rope=None):
    """Per-head loop: query head h reads key/value head h // (H / K)."""
    D = x.shape[-1]
    d = D // num_heads
    W, b = attn.qkv.weight, attn.qkv.bias
    q_all = x @ W[:D].T + b[:D]
    k_all = x @ W[D : D + num_kv_heads * d].T + b[D : D + num_kv_heads * d]
    v_all = x @ W[D + num_kv_heads * d :].T + b[D + num_kv_heads * d :]
    heads = []
    for h in range(num_heads):
        g = h // (num_heads // num_kv_heads)
        q, k, v = q_all[..., h * d : (h + 1) * d], k_all[..., g * d : (g + 1) * d], v_all[..., g * d : (g + 1) * d]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
        heads.append(a @ v)
    return torch.cat(heads, -1) @ attn.proj.weight.T + attn.proj.bias


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("mode", ["sdpa", "explicit"])
def test_grouped_query_attention_equals_hand_written(num_kv_heads, mode):
    torch.manual_seed(num_kv_heads)
    D, H = 16, 4
    attn = Attention(D, H, True, True, 0.0, num_kv_heads=num_kv_heads, mode=mode).eval()
    assert attn.qkv.weight.shape == (D + 2 * num_kv_heads * (D // H), D)
    x = torch.randn(2, 9, D)
    torch.testing.assert_close(attn(x), hand_attention(x, attn, H, num_kv_heads), rtol=1e-5, atol=1e-5)


def test_attention_with_rope_equals_hand_written():
    torch.manual_seed(3)
    D, H = 32, 2
    attn = Attention(D, H, True, True, 0.0, num_kv_heads=1).eval()
    angles = rope_2d_angles(D // H, 3)  # (9, 8)
    rope = (angles.cos(), angles.sin())
    x = torch.randn(2, 9, D)
    torch.testing.assert_close(attn(x, rope), hand_attention(x, attn, H, 1, rope), rtol=1e-5, atol=1e-5)


def test_sincos2d_matches_mae_formula():
    D, g = 16, 4
    pos = sincos_2d(D, g)
    assert pos.shape == (g * g, D)
    q = D // 4  # frequencies per axis
    for n in range(g * g):
        row, col = divmod(n, g)
        expected = []
        for coord in (row, col):
            w = [1 / 10000 ** (i / q) for i in range(q)]
            expected += [math.sin(coord * wi) for wi in w] + [math.cos(coord * wi) for wi in w]
        torch.testing.assert_close(pos[n], torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_rope_rotates_each_pair_by_its_rotation_matrix():
    torch.manual_seed(0)
    d, g = 8, 3
    angles = rope_2d_angles(d, g)  # (9, 4): pairs 0-1 follow the row, pairs 2-3 the column
    x = torch.randn(1, 1, g * g, d)
    y = apply_rope(x, angles.cos(), angles.sin())
    for n in range(g * g):
        row, col = divmod(n, g)
        for i in range(d // 2):
            theta = 100.0 ** (-(i % 2) / 2)
            t = (row if i < 2 else col) * theta
            R = torch.tensor([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]])
            torch.testing.assert_close(y[0, 0, n, 2 * i : 2 * i + 2], R @ x[0, 0, n, 2 * i : 2 * i + 2])


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    d, g = 16, 6
    angles = rope_2d_angles(d, g)
    cos, sin = angles.cos(), angles.sin()
    q, k = torch.randn(d), torch.randn(d)

    def score(a, b):  # q at patch a, k at patch b, both rotated
        x = torch.stack([q, k]).view(1, 1, 2, d)
        idx = torch.tensor([a, b])
        r = apply_rope(x, cos[idx], sin[idx])[0, 0]
        return (r[0] @ r[1]).item()

    at = lambda r, c: r * g + c  # noqa: E731
    s = score(at(1, 2), at(3, 1))
    assert score(at(2, 3), at(4, 2)) == pytest.approx(s, abs=1e-4)  # both moved by (+1, +1)
    assert score(at(1, 4), at(3, 3)) == pytest.approx(s, abs=1e-4)  # both moved by (0, +2)
    assert abs(score(at(1, 2), at(4, 1)) - s) > 1e-3  # another offset, another score


VARIANTS = [
    {},
    {"norm": "rmsnorm"},
    {"activation": "swiglu"},
    {"num_kv_heads": 1},
    {"num_kv_heads": 2, "attention": "explicit"},
    {"pos": "sincos2d"},
    {"pos": "rope2d"},
    {"pos": "rope2d+learned"},
    {"activation": "relu2"},
    {"token_conv": 3},
    {"norm": "rmsnorm", "activation": "swiglu", "num_kv_heads": 2, "pos": "rope2d"},
    {"norm": "rmsnorm", "activation": "relu2", "num_kv_heads": 2, "pos": "rope2d+learned", "token_conv": 5},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) or "plain")
def test_every_variant_gives_shapes_and_gradients(variant):
    torch.manual_seed(0)
    mcfg = ModelConfig(hidden_dim=32, num_heads=4, depth=2, ffn_dim=48, **variant)
    model = MaskedPatchViT(mcfg, num_patches=64, patch_dim=4, num_classes=16, fill=0.5)
    x = torch.randint(0, 2, (3, 64, 4)).float()
    mask = torch.zeros(3, 64, dtype=torch.bool)
    mask[:, 10:30] = True
    ids = torch.arange(10, 30).expand(3, 20)
    logits = model(x, mask, ids)
    assert logits.shape == (3, 20, 16)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(model(x, mask)[:, 10:30], logits)
    logits.logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    has_learned_pos = any(n == "pos" for n, _ in model.named_parameters())
    assert has_learned_pos == (mcfg.pos in ("learned", "rope2d+learned"))
    assert hasattr(model, "rope_cos") == (mcfg.pos in ("rope2d", "rope2d+learned"))


def test_fixed_positions_are_not_in_the_checkpoint_state():
    for pos in ("sincos2d", "rope2d"):
        model = MaskedPatchViT(ModelConfig(hidden_dim=32, num_heads=2, depth=1, pos=pos), 16, 4, 16, 0.5)
        assert not any(k.startswith(("pos", "rope")) for k in model.state_dict()), pos


def test_rope_model_sees_where_tokens_are():
    # rope2d adds nothing to the tokens, so without it attention would be permutation-equivariant
    torch.manual_seed(0)
    model = MaskedPatchViT(ModelConfig(hidden_dim=32, num_heads=2, depth=1, pos="rope2d"), 16, 4, 16, 0.5).eval()
    x = torch.randint(0, 2, (1, 16, 4)).float()
    mask = torch.zeros(1, 16, dtype=torch.bool)
    perm = torch.randperm(16)
    assert not torch.allclose(model(x, mask)[:, perm], model(x[:, perm], mask))


def blank_canvas_logits(model: MaskedPatchViT, n: int) -> torch.Tensor:
    """Logits (N, C) of one image with every patch masked (the first step of `vitmask sample`)."""
    return model(torch.zeros(1, n, 4), torch.ones(1, n, dtype=torch.bool))[0]


def test_rope2d_alone_cannot_tell_positions_apart_on_a_blank_canvas():
    # every token is the mask embedding, so every value vector is the same and each token's
    # attention output is that vector whatever its (relative-position) weights: all N rows equal.
    # With a learned vector added (rope2d+learned) the rows differ, as per-position marginals need.
    torch.manual_seed(0)
    cfg = dict(hidden_dim=32, num_heads=2, depth=2, ffn_dim=48)
    alone = MaskedPatchViT(ModelConfig(pos="rope2d", **cfg), 16, 4, 16, "learned").eval()
    both = MaskedPatchViT(ModelConfig(pos="rope2d+learned", **cfg), 16, 4, 16, "learned").eval()
    logits = blank_canvas_logits(alone, 16)  # (16, 16)
    torch.testing.assert_close(logits, logits[:1].expand(16, -1), rtol=1e-5, atol=1e-5)
    logits = blank_canvas_logits(both, 16)
    assert (logits - logits[:1]).abs().amax(-1)[1:].min() > 1e-3  # every position its own


def test_rope2d_learned_is_rope2d_plus_an_added_vector():
    # the same weights: with P = 0 it is the rope2d model; with the rotations made the identity
    # (cos 1, sin 0) it is the `learned` model with the same P
    torch.manual_seed(0)
    cfg = dict(hidden_dim=32, num_heads=2, depth=2, ffn_dim=48)
    both = MaskedPatchViT(ModelConfig(pos="rope2d+learned", **cfg), 16, 4, 16, "learned").eval()
    x = torch.randint(0, 2, (2, 16, 4)).float()
    mask = torch.rand(2, 16) < 0.5
    rope = MaskedPatchViT(ModelConfig(pos="rope2d", **cfg), 16, 4, 16, "learned").eval()
    rope.load_state_dict({k: v for k, v in both.state_dict().items() if k != "pos"})
    learned = MaskedPatchViT(ModelConfig(pos="learned", **cfg), 16, 4, 16, "learned").eval()
    learned.load_state_dict(both.state_dict())
    with torch.no_grad():
        out = both(x, mask)
        assert not torch.allclose(out, rope(x, mask), atol=1e-4)
        assert not torch.allclose(out, learned(x, mask), atol=1e-4)
        p = both.pos.clone()
        both.pos.zero_()
        torch.testing.assert_close(both(x, mask), rope(x, mask))
        both.pos.copy_(p)
        both.rope_cos.fill_(1.0)
        both.rope_sin.zero_()
        torch.testing.assert_close(both(x, mask), learned(x, mask))


@pytest.mark.parametrize(
    "setting,needles",
    [
        ("model.num_kv_heads=3", ("model.num_kv_heads", "must divide model.num_heads")),
        ("model.pos=rope", ("model.pos", "learned, sincos2d, rope2d, rope2d+learned")),
        ("model.norm=batchnorm", ("model.norm", "rmsnorm")),
        ("model.activation=geglu", ("model.activation", "swiglu")),
        ("model.attention=flash", ("model.attention", "auto, sdpa, explicit")),
        ("model.hidden_dim=24", ("rope2d", "model.num_heads")),  # with rope2d and 4 heads: head dim 6
        ("model.token_conv=2", ("model.token_conv", "odd kernel size")),
        ("model.token_conv=-3", ("model.token_conv", "odd kernel size")),
        ("model.decoder=cross,model.token_conv=3", ("model.token_conv", "model.decoder=cross", "token_conv=0")),
    ],
)
def test_bad_variant_settings_are_user_errors(setting, needles):
    base = {"model": {"hidden_dim": 32, "num_heads": 4, "pos": "rope2d" if "hidden_dim" in setting else "learned"}}
    with pytest.raises(UserError) as e:
        config_from_dict({**base, "mask": {"fill": "learned"}}, setting.split(","))
    for needle in needles:
        assert needle in str(e.value)


def test_bad_variant_setting_from_the_cli_is_one_line_and_exit_2(tiny_config):
    # hidden 24 over 4 heads is a head dim of 6: its rotation pairs cannot split into rows and columns
    sets = ("model.pos=rope2d", "model.hidden_dim=24", "model.num_heads=4")
    res = run_cli("config", "--config", tiny_config, *(a for s in sets for a in ("--set", s)))
    assert_user_error(res, "rope2d", "model.num_heads")


def test_auto_attention_is_sdpa_in_fp32_and_the_written_out_form_under_cpu_bf16():
    torch.manual_seed(5)
    modules = {m: Attention(32, 4, True, True, 0.0, mode=m).eval() for m in ("auto", "sdpa", "explicit")}
    for m in ("sdpa", "explicit"):
        modules[m].load_state_dict(modules["auto"].state_dict())
    x = torch.randn(2, 16, 32)
    out = {m: a(x) for m, a in modules.items()}
    assert torch.equal(out["auto"], out["sdpa"])
    torch.testing.assert_close(out["explicit"], out["sdpa"], rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = {m: a(x) for m, a in modules.items()}
    assert low["auto"].dtype == torch.bfloat16
    assert torch.equal(low["auto"], low["explicit"])
    torch.testing.assert_close(low["auto"].float(), out["sdpa"], rtol=0.05, atol=0.05)
