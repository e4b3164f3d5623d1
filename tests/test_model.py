"""The model's parts against independent computations: the worked FFN example and head split of
docs/notation.md, a hand-written attention, torch's own modules, and configs/seed.yaml's parameter count."""

import math

import pytest
import torch
from torch import nn

from tests.conftest import ROOT, TINY
from vitmask.config import Config, ModelConfig, config_from_dict, load_config
from vitmask.model import layers
from vitmask.model.layers import Attention, Block, FeedForward, merge_heads, split_heads
from vitmask.model.masked_input import mask_to_ids
from vitmask.model.positions import apply_rope, gather_rope, rope_2d_angles
from vitmask.model.vit import MaskedPatchViT, build_model


def test_ffn_matches_the_worked_example_forward_and_backward():
    # docs/notation.md, worked examples. W_2 and b_2 are not printed there; these are the ones consistent with its
    # Y: row 1 of W_2 follows from Y_1 - Y_2 = 2 * W_2[0], the rest is one valid choice.
    X = torch.tensor([[1.0, 0, 2, 1], [0, 1, 1, 0]])
    W1 = torch.tensor([[1.0, 0, 1], [0, 1, 1], [1, 0, 0], [0, 1, 0]])
    b1 = torch.tensor([0.0, 1, 0])
    W2 = torch.tensor([[1.0, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]])
    b2 = torch.tensor([0.0, 0, 1, 0])
    T = torch.tensor([[1.0, 0, 0, 1], [0, 0, 1, 1]])
    ffn = FeedForward(4, 3, "relu")
    with torch.no_grad():  # nn.Linear computes x W^T + b, so it holds the transposes
        ffn.fc1.weight.copy_(W1.T)
        ffn.fc1.bias.copy_(b1)
        ffn.fc2.weight.copy_(W2.T)
        ffn.fc2.bias.copy_(b2)
    V = ffn.act(ffn.fc1(X))
    Y = ffn(X)
    assert V.tolist() == [[3, 2, 1], [1, 2, 1]]
    assert Y.tolist() == [[4, 2, 5, 2], [2, 2, 3, 2]]
    loss = 0.5 * ((Y - T) ** 2).sum()
    loss.backward()
    dW2 = ffn.fc2.weight.grad.T  # dL/dW_2 = V^T dY, in the example's orientation
    assert dW2.tolist() == [[11, 8, 17, 4], [10, 8, 14, 4], [5, 4, 7, 2]]
    assert ffn.fc2.bias.grad.tolist() == [5, 4, 7, 2]


def test_head_split_of_the_worked_q_example():
    Q = torch.tensor([[1.0, 2, 3, 4, 5, 6, 7, 8], [2, 1, 0, 1, 3, 3, 2, 2], [0, 1, 1, 0, 9, 8, 7, 6]])
    heads = split_heads(Q.unsqueeze(0), 2)  # (1, 2, 3, 4)
    assert heads.shape == (1, 2, 3, 4)
    assert heads[0, 0].tolist() == [[1, 2, 3, 4], [2, 1, 0, 1], [0, 1, 1, 0]]
    assert heads[0, 1].tolist() == [[5, 6, 7, 8], [3, 3, 2, 2], [9, 8, 7, 6]]
    assert torch.equal(merge_heads(heads), Q.unsqueeze(0))


@pytest.mark.parametrize("qkv_bias,out_proj", [(False, False), (True, True)])
def test_attention_equals_hand_written_softmax(qkv_bias, out_proj):
    torch.manual_seed(0)
    B, N, D, H = 2, 5, 8, 2
    attn = Attention(D, H, qkv_bias, out_proj, dropout=0.0).eval()
    x = torch.randn(B, N, D)
    Wq, Wk, Wv = attn.qkv.weight.chunk(3, dim=0)
    bq, bk, bv = attn.qkv.bias.chunk(3) if qkv_bias else (0, 0, 0)
    d = D // H
    heads = []
    for h in range(H):
        cols = slice(h * d, (h + 1) * d)
        q = (x @ Wq.T + bq)[..., cols]
        k = (x @ Wk.T + bk)[..., cols]
        v = (x @ Wv.T + bv)[..., cols]
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
        heads.append(a @ v)
    expected = torch.cat(heads, dim=-1)
    if out_proj:
        expected = expected @ attn.proj.weight.T + attn.proj.bias
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-6)


def test_attention_matches_torch_multihead_attention():
    torch.manual_seed(1)
    D, H = 16, 4
    ours = Attention(D, H, qkv_bias=True, out_proj=True, dropout=0.0).eval()
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv.weight)
        ref.in_proj_bias.copy_(ours.qkv.bias)
        ref.out_proj.weight.copy_(ours.proj.weight)
        ref.out_proj.bias.copy_(ours.proj.bias)
    x = torch.randn(3, 7, D)
    torch.testing.assert_close(ours(x), ref(x, x, x, need_weights=False)[0], rtol=1e-5, atol=1e-5)


def test_pre_and_post_norm_blocks_match_torch_encoder_layer():
    torch.manual_seed(2)
    for norm_first in (True, False):
        cfg = ModelConfig(
            hidden_dim=16, num_heads=2, ffn_dim=32, activation="relu", norm_position="pre" if norm_first else "post"
        )
        ours = Block(cfg).eval()
        ref = nn.TransformerEncoderLayer(
            16, 2, 32, dropout=0.0, activation="relu", batch_first=True, norm_first=norm_first
        ).eval()
        with torch.no_grad():
            ref.self_attn.in_proj_weight.copy_(ours.attn.qkv.weight)
            ref.self_attn.in_proj_bias.copy_(ours.attn.qkv.bias)
            ref.self_attn.out_proj.weight.copy_(ours.attn.proj.weight)
            ref.self_attn.out_proj.bias.copy_(ours.attn.proj.bias)
            for a, b in [
                (ref.linear1, ours.ffn.fc1),
                (ref.linear2, ours.ffn.fc2),
                (ref.norm1, ours.norm1),
                (ref.norm2, ours.norm2),
            ]:
                a.weight.copy_(b.weight)
                a.bias.copy_(b.bias)
        x = torch.randn(2, 6, 16)
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


def test_seed_config_has_314640_parameters():
    cfg = load_config(ROOT / "configs" / "seed.yaml")
    assert cfg.data.num_patches == 1024 and cfg.data.num_classes == 16 and cfg.data.batch_size == 32
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == 314_640


def test_forward_shapes_and_every_parameter_gets_a_gradient():
    cfg = Config(model=ModelConfig(hidden_dim=32, num_heads=4, depth=2, ffn_dim=64))
    model = MaskedPatchViT(cfg.model, num_patches=64, patch_dim=4, num_classes=16, fill=0.5)
    x = torch.randint(0, 2, (3, 64, 4)).float()
    mask = torch.zeros(3, 64, dtype=torch.bool)
    mask[:, :20] = True
    ids = torch.arange(20).expand(3, 20)
    logits = model(x, mask, ids)
    assert logits.shape == (3, 20, 16)
    assert torch.isfinite(logits).all()
    full = model(x, mask)
    assert full.shape == (3, 64, 16)
    torch.testing.assert_close(full[:, :20], logits)
    logits.logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_masked_pixels_do_not_reach_the_model():
    torch.manual_seed(0)
    model = MaskedPatchViT(ModelConfig(hidden_dim=16, num_heads=2, depth=1, ffn_dim=32), 16, 4, 16, 0.5).eval()
    x = torch.randint(0, 2, (1, 16, 4)).float()
    mask = torch.zeros(1, 16, dtype=torch.bool)
    mask[0, 3] = True
    y = x.clone()
    y[0, 3] = 1 - y[0, 3]  # change only the hidden patch
    torch.testing.assert_close(model(x, mask), model(y, mask))


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"pos": "rope2d", "num_kv_heads": 2},
        {"norm_position": "post", "attention": "explicit"},
        {"qkv_bias": False, "activation": "swiglu", "norm": "rmsnorm", "out_proj": False},
    ],
)
def test_last_block_on_masked_tokens_only_equals_the_full_forward(variant):
    # with ids, the last block computes only the masked tokens: logits and every gradient must be
    # those of the full forward pass read at the same tokens, each image at its own positions
    torch.manual_seed(0)
    mcfg = ModelConfig(hidden_dim=32, num_heads=4, depth=2, ffn_dim=64, **variant)
    model = MaskedPatchViT(mcfg, 64, 4, 16, "learned")
    x = torch.randint(0, 2, (3, 64, 4)).float()
    ids = torch.stack([torch.randperm(64)[:24] for _ in range(3)])  # (3, 24), different per image
    mask = torch.zeros(3, 64, dtype=torch.bool).scatter_(1, ids, True)
    targets = torch.randint(0, 16, (3, 24))

    def loss_and_grads(logits):
        model.zero_grad()
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    part = model(x, mask, ids)  # (3, 24, 16)
    full = model(x, mask).gather(1, ids.unsqueeze(-1).expand(-1, -1, 16))  # (3, 24, 16)
    torch.testing.assert_close(part, full)
    loss_p, grads_p = loss_and_grads(model(x, mask, ids))
    loss_f, grads_f = loss_and_grads(model(x, mask).gather(1, ids.unsqueeze(-1).expand(-1, -1, 16)))
    torch.testing.assert_close(loss_p, loss_f)
    for name in grads_f:
        torch.testing.assert_close(grads_p[name], grads_f[name], msg=name)


def hand_forward(model: MaskedPatchViT, patches: torch.Tensor, mask: torch.Tensor, fill, heads: int) -> torch.Tensor:
    """The single stack of docs/notation.md written out with plain torch ops from the model's own parameters:
    embed (masked pixels set to `fill`, or the token set to the mask embedding), add the learned
    positions, pre-norm blocks of softmax(Q K^T / sqrt(d)) V attention and a GELU FFN, the final norm,
    the head. patches (B, N, P), mask (B, N) -> logits (B, N, C)."""
    w = dict(model.named_parameters())
    b, n, _ = patches.shape
    if fill == "learned":
        x = patches @ w["embed.weight"].T + w["embed.bias"]  # (B, N, D)
        x = torch.where(mask[..., None], w["mask_token"], x)
    else:
        x = torch.where(mask[..., None], torch.full_like(patches, fill), patches) @ w["embed.weight"].T
        x = x + w["embed.bias"]  # (B, N, D)
    x = x + w["pos"]
    dim = x.shape[-1]
    d = dim // heads

    def norm(t, name):
        mean, var = t.mean(-1, keepdim=True), t.var(-1, unbiased=False, keepdim=True)
        return (t - mean) / torch.sqrt(var + 1e-5) * w[f"{name}.weight"] + w[f"{name}.bias"]

    for i in range(len(model.blocks)):
        p = f"blocks.{i}."
        h = norm(x, p + "norm1")
        q, k, v = (h @ w[p + "attn.qkv.weight"].T + w[p + "attn.qkv.bias"]).split(dim, -1)  # 3 x (B, N, D)
        q, k, v = (t.view(b, n, heads, d).transpose(1, 2) for t in (q, k, v))  # 3 x (B, H, N, d)
        scores = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)  # (B, H, N, N)
        att = (scores @ v).transpose(1, 2).reshape(b, n, dim)  # (B, N, D)
        x = x + att @ w[p + "attn.proj.weight"].T + w[p + "attn.proj.bias"]
        h = norm(x, p + "norm2")
        hidden = h @ w[p + "ffn.fc1.weight"].T + w[p + "ffn.fc1.bias"]  # (B, N, F)
        hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))  # GELU, exact form
        x = x + hidden @ w[p + "ffn.fc2.weight"].T + w[p + "ffn.fc2.bias"]
    return norm(x, "norm") @ w["head.weight"].T + w["head.bias"]  # (B, N, C)


@pytest.mark.parametrize("fill", [0.5, "learned"])
def test_decoder_none_is_the_single_stack_written_out_by_hand(fill):
    # model.decoder: none (the default, and given explicitly) must be exactly the one stack over all N
    # tokens: the decoder option cannot have changed the default path
    raw = {
        "data": {"image_size": 8, "patch_size": 2},  # 16 patches of 4 pixels
        "mask": {"ratio": 0.25, "fill": fill},
        "model": {"hidden_dim": 16, "num_heads": 2, "depth": 2, "ffn_dim": 32, "pos": "learned"},
    }
    default = build_model(config_from_dict(raw))
    explicit = build_model(config_from_dict({**raw, "model": {**raw["model"], "decoder": "none"}}))
    assert explicit.decoder is None and default.decoder is None
    assert sorted(default.state_dict()) == sorted(explicit.state_dict())
    torch.manual_seed(0)
    with torch.no_grad():  # non-trivial biases, norms and mask token, so each one shows
        for p in default.parameters():
            p.add_(0.3 * torch.randn_like(p))
    explicit.load_state_dict(default.state_dict())
    default, explicit = default.double().eval(), explicit.double().eval()
    x = torch.randint(0, 2, (3, 16, 4)).double()
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(3)])  # (3, 4)
    mask = torch.zeros(3, 16, dtype=torch.bool).scatter_(1, ids, True)
    want = hand_forward(default, x, mask, fill, heads=2)  # (3, 16, 16)
    with torch.no_grad():
        for model in (default, explicit):
            torch.testing.assert_close(model(x, mask), want, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(
                model(x, mask, ids), want.gather(1, ids[..., None].expand(-1, -1, 16)), rtol=1e-10, atol=1e-10
            )


def written_out_rotation(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x (L, d), angles (L, d/2): pair i of row l turned by [[cos t, -sin t], [sin t, cos t]], t = angles[l, i]."""
    out = torch.empty_like(x)
    for row in range(x.shape[0]):
        for i in range(x.shape[1] // 2):
            t = float(angles[row, i])
            a, b = float(x[row, 2 * i]), float(x[row, 2 * i + 1])
            out[row, 2 * i] = math.cos(t) * a - math.sin(t) * b
            out[row, 2 * i + 1] = math.sin(t) * a + math.cos(t) * b
    return out


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("gathered", [False, True])
def test_attention_turns_queries_and_keys_in_one_rotation_as_written_out(num_kv_heads, gathered):
    # every query and key head of token l turned by its patch's angles; then plain attention by hand
    torch.manual_seed(num_kv_heads)
    dim, heads, grid, b = 32, 4, 3, 2
    d = dim // heads
    attn = Attention(dim, heads, True, True, 0.0, num_kv_heads=num_kv_heads, mode="explicit").eval()
    angles = rope_2d_angles(d, grid)  # (9, d/2)
    if gathered:  # each image's tokens at its own patches, as the encoder sees its visible ones
        where = torch.tensor([[0, 4, 8, 2, 6], [7, 1, 3, 5, 0]])  # (B, L)
        rope = gather_rope((angles.cos(), angles.sin()), where)  # 2 x (B, 1, L, d/2)
    else:
        where = torch.arange(grid * grid).expand(b, -1)
        rope = (angles.cos(), angles.sin())
    x = torch.randn(b, where.shape[1], dim)
    w, bias, kv = attn.qkv.weight, attn.qkv.bias, num_kv_heads * d
    with torch.no_grad():
        out = attn(x, rope)
        for img in range(b):
            q_all, k_all = x[img] @ w[:dim].T + bias[:dim], x[img] @ w[dim : dim + kv].T + bias[dim : dim + kv]
            v_all = x[img] @ w[dim + kv :].T + bias[dim + kv :]
            heads_out = []
            for h in range(heads):
                g = h // (heads // num_kv_heads)
                q = written_out_rotation(q_all[:, h * d : (h + 1) * d], angles[where[img]])
                k = written_out_rotation(k_all[:, g * d : (g + 1) * d], angles[where[img]])
                a = torch.softmax(q @ k.T / math.sqrt(d), dim=-1)
                heads_out.append(a @ v_all[:, g * d : (g + 1) * d])
            want = torch.cat(heads_out, -1) @ attn.proj.weight.T + attn.proj.bias
            torch.testing.assert_close(out[img], want, rtol=1e-5, atol=1e-5)


def test_a_rotary_model_gives_the_same_logits_with_the_joint_rotation(monkeypatch):
    # the whole rope2d stack against the same blocks with Q and K turned one at a time (apply_rope
    # each, itself checked against the written-out rotation in tests/test_variants.py)
    cfg = config_from_dict(TINY, ["model.pos=rope2d", "model.num_kv_heads=1"])
    model = build_model(cfg).eval()
    x = torch.randint(0, 2, (2, 64, 4)).float()
    mask = torch.zeros(2, 64, dtype=torch.bool)
    mask[:, ::3] = True
    ids = mask_to_ids(mask)
    with torch.no_grad():
        joint_all, joint_ids = model(x, mask), model(x, mask, ids)

    def one_at_a_time(self, x, rope):
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = apply_rope(split_heads(q, self.num_heads), *rope)
        k = apply_rope(split_heads(k, self.num_kv_heads), *rope)
        return self.mix(q, k, split_heads(v, self.num_kv_heads))

    monkeypatch.setattr(layers.Attention, "attend_rotated", one_at_a_time)
    with torch.no_grad():
        sep_all, sep_ids = model(x, mask), model(x, mask, ids)
    torch.testing.assert_close(joint_all, sep_all, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(joint_ids, sep_ids, rtol=1e-5, atol=1e-5)
