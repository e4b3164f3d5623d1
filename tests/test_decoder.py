"""The encoder-decoder designs (model.decoder: self | cross): cross-attention against torch's own
module and against the example of docs/notation.md computed by hand, the visible-token gather against a
per-image loop, what the encoder and the logits may not see, rotary positions of gathered tokens,
gradients, checkpoints, every verb, and the configs that are refused. (Their FLOP count is tested in
tests/test_flops.py, their parameter table in tests/test_params.py.)"""

import math

import pytest
import torch
from PIL import Image
from torch import nn

from tests.conftest import assert_user_error, run_cli, write_config
from vitmask.cli import verbs
from vitmask.config import Config, DataConfig, MaskConfig, ModelConfig, config_from_dict
from vitmask.data.masking import random_mask
from vitmask.errors import UserError
from vitmask.model.decoder import CrossAttention
from vitmask.model.layers import gather_tokens, split_heads
from vitmask.model.masked_input import visible_ids
from vitmask.model.params import format_table
from vitmask.model.positions import apply_rope, gather_rope, rope_2d_angles
from vitmask.model.vit import build_model
from vitmask.store.checkpoint import load_model, save_checkpoint
from vitmask.train.optim import param_groups

DESIGNS = [
    {"decoder": "self"},
    {"decoder": "cross"},
    {"decoder": "cross", "decoder_self_attn": True},
]
POSITIONS = ("learned", "sincos2d", "rope2d", "rope2d+learned")


def decoder_config(image_size: int = 8, ratio: float = 0.5, **model) -> Config:
    """A tiny encoder-decoder: 16 patches on a 4x4 grid (image_size 8), encoder 32 wide, decoder 16."""
    base = {"hidden_dim": 32, "num_heads": 2, "depth": 2, "ffn_dim": 64, "decoder_dim": 16, "decoder_depth": 2}
    return Config(
        data=DataConfig(image_size=image_size, batch_size=4),
        mask=MaskConfig(ratio=ratio, fill="learned"),
        model=ModelConfig(**{**base, **model}),
    )


def pixels_and_mask(b: int = 3, n: int = 16, m: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 2, (b, n, 4), generator=g).float()  # (B, N, P)
    ids, mask = random_mask(b, n, m, g)  # (B, M), (B, N)
    return x, ids, mask


# ---- cross-attention ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sdpa", "explicit"])
def test_cross_attention_equals_torch_multihead_attention_with_copied_weights(mode):
    torch.manual_seed(0)
    ours = CrossAttention(16, 4, qkv_bias=True, out_proj=True, dropout=0.0, mode=mode).eval()
    for p in ours.parameters():  # biases too: Xavier leaves none, so every term is checked
        nn.init.normal_(p, std=0.3)
    ref = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q.weight, ours.kv.weight]))  # rows W_q, W_k, W_v
        ref.in_proj_bias.copy_(torch.cat([ours.q.bias, ours.kv.bias]))
        ref.out_proj.weight.copy_(ours.proj.weight)
        ref.out_proj.bias.copy_(ours.proj.bias)
    queries, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)  # 5 queries read 7 other tokens
    want = ref(queries, memory, memory, need_weights=False)[0]
    torch.testing.assert_close(ours(queries, memory), want, rtol=1e-5, atol=1e-5)


def test_cross_attention_reproduces_the_decoder_example_computed_by_hand():
    # the decoder step of docs/notation.md: y = [0.1, 0.2, 0.3, 0.4], two heads of width 2, its W^Q, W^K, W^V,
    # then its W^O. By hand: Q_1 = [0.5, 0.6], K_1 = [0.6, 0.7], V_1 = [0.7, 0.8];
    # Q_2 = [0.6, 0.7], K_2 = [0.7, 0.8], V_2 = [0.8, 0.9]; Q_1 K_1^T = 0.30 + 0.42 = 0.72 (the notes
    # write 0.82), Q_2 K_2^T = 0.42 + 0.56 = 0.98 (the notes: 1.06). One key, so each softmax is 1
    # and the output is [V_1, V_2] W^O = [0.7, 0.8, 0.8, 0.9] W^O = [2.36, 2.68, 3.00, 3.32]
    # (the notes: [1.78, 1.90, 2.02, 2.14]).
    def w(start):  # the example's 4 x 2 matrices: rows start + 0.2 i, columns + 0.1 j
        return torch.tensor([[start + 0.2 * i + 0.1 * j for j in range(2)] for i in range(4)])

    w_q = torch.cat([w(0.1), w(0.2)], dim=1)  # (4, 4): head 1's columns, then head 2's
    w_k = torch.cat([w(0.2), w(0.3)], dim=1)
    w_v = torch.cat([w(0.3), w(0.4)], dim=1)
    w_o = torch.tensor([[0.1 + 0.4 * i + 0.1 * j for j in range(4)] for i in range(4)])
    attn = CrossAttention(4, 2, qkv_bias=False, out_proj=True, dropout=0.0, mode="explicit")
    with torch.no_grad():
        attn.q.weight.copy_(w_q.T)  # nn.Linear computes x W^T
        attn.kv.weight.copy_(torch.cat([w_k, w_v], dim=1).T)
        attn.proj.weight.copy_(w_o.T)
        attn.proj.bias.zero_()
    y = torch.tensor([[[0.1, 0.2, 0.3, 0.4]]])  # (1, 1, 4): the query, and here also the memory
    q = split_heads(attn.q(y), 2)  # (1, 2, 1, 2)
    k = split_heads(attn.kv(y)[..., :4], 2)
    torch.testing.assert_close((q * k).sum(-1).flatten(), torch.tensor([0.72, 0.98]))
    torch.testing.assert_close(attn(y, y).flatten(), torch.tensor([2.36, 2.68, 3.00, 3.32]))


# ---- the gather and what each stage sees -------------------------------------------------------
def test_visible_gather_equals_a_per_image_loop():
    x, ids, mask = pixels_and_mask(b=4, n=10, m=4, seed=3)
    keep = visible_ids(mask, 4)  # (4, 6)
    gathered = gather_tokens(x, keep)  # (4, 6, P)
    for b in range(4):
        loop_ids = [i for i in range(10) if not bool(mask[b, i])]
        assert keep[b].tolist() == loop_ids
        assert torch.equal(gathered[b], torch.stack([x[b, i] for i in loop_ids]))
    # the encoder on the gathered batch equals a per-image loop over each image's visible patches,
    # each token with its own patch's position
    for pos in POSITIONS:
        model = build_model(decoder_config(decoder="self", pos=pos, image_size=10)).eval()
        x25, _, mask25 = pixels_and_mask(b=3, n=25, m=9, seed=4)
        batched = model.forward_encoder(x25, visible_ids(mask25, 9))  # (3, 16, D)
        for b in range(3):
            torch.testing.assert_close(batched[b], encode_one(model, x25[b], mask25[b]), rtol=1e-5, atol=1e-5)


def encode_one(model, patches: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The encoder on one image's visible patches, written as a loop: patches (N, P) -> (V, D)."""
    vis = torch.tensor([i for i in range(len(mask)) if not bool(mask[i])])
    x = model.embed(patches[vis]).unsqueeze(0)  # (1, V, D)
    rope = None
    if hasattr(model, "rope_cos"):  # rope2d, rope2d+learned
        rope = (model.rope_cos[vis], model.rope_sin[vis])  # (V, d/2): the patches' own angles
    if model.pos is not None:  # learned, sincos2d, rope2d+learned
        x = x + model.pos[vis]
    for block in model.blocks:
        x = block(x, rope)
    return model.norm(x)[0]  # (V, D)


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("pos", POSITIONS)
def test_decoders_equal_a_per_image_loop(design, pos):
    # per image, no scatter and no gathered tables: `self` builds all N tokens one by one and runs
    # its blocks over every token; `cross` makes one query per masked patch
    torch.manual_seed(2)
    model = build_model(decoder_config(pos=pos, **design)).eval()
    dec = model.decoder
    x, ids, mask = pixels_and_mask(seed=6)
    logits = model(x, mask, ids)  # (B, M, C)
    for b in range(3):
        vis = [i for i in range(16) if not bool(mask[b, i])]
        memory = dec.embed(encode_one(model, x[b], mask[b]))  # (V, E)
        table = lambda where: (dec.rope_cos[where], dec.rope_sin[where]) if hasattr(dec, "rope_cos") else None  # noqa: E731
        add = lambda t, where: t if dec.pos is None else t + dec.pos[where]  # noqa: E731
        if design["decoder"] == "self":
            tokens = torch.stack([memory[vis.index(i)] if i in vis else dec.mask_token for i in range(16)])
            h = add(tokens, list(range(16))).unsqueeze(0)  # (1, N, E)
            for block in dec.blocks:
                h = block(h, table(list(range(16))))
            want = model.head(dec.norm(h))[0, ids[b]]  # (M, C), read at the masked patches
        else:
            h = add(dec.mask_token.expand(6, -1), ids[b]).unsqueeze(0)  # (1, M, E)
            mem = add(memory, vis).unsqueeze(0)  # (1, V, E)
            for block in dec.blocks:
                h = block(h, mem, table(ids[b]), table(vis))
            want = model.head(dec.norm(h))[0]  # (M, C)
        torch.testing.assert_close(logits[b], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pos", POSITIONS)
def test_encoder_output_of_visible_patches_does_not_depend_on_masked_pixels(pos):
    torch.manual_seed(0)
    model = build_model(decoder_config(decoder="cross", pos=pos)).eval()
    x, ids, mask = pixels_and_mask()
    keep = visible_ids(mask, ids.shape[1])
    other = torch.where(mask.unsqueeze(-1), 1 - x, x)  # every masked pixel flipped
    out = model.forward_encoder(x, keep)  # (B, V, D)
    assert torch.equal(out, model.forward_encoder(other, keep))
    visible_flipped = torch.where(mask.unsqueeze(-1), x, 1 - x)
    assert not torch.allclose(out, model.forward_encoder(visible_flipped, keep))


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("pos", POSITIONS)
def test_logits_of_masked_patches_do_not_change_when_masked_pixels_change(design, pos):
    torch.manual_seed(0)
    model = build_model(decoder_config(pos=pos, **design)).eval()
    x, ids, mask = pixels_and_mask()
    other = torch.where(mask.unsqueeze(-1), torch.randint(0, 2, x.shape).float(), x)
    logits = model(x, mask, ids)  # (B, M, C)
    assert logits.shape == (3, 6, 16)
    assert torch.equal(logits, model(other, mask, ids))
    assert not torch.allclose(logits, model(1 - x, mask, ids))  # the visible ones do count
    # without ids: (B, N, C), the same logits at the masked patches and zero rows at the visible ones
    full = model(x, mask)
    torch.testing.assert_close(full.gather(1, ids.unsqueeze(-1).expand(-1, -1, 16)), logits)
    assert torch.equal(full[~mask], torch.zeros(3 * 10, 16))  # 3 images, 10 visible patches each


@pytest.mark.parametrize("design", DESIGNS)
def test_every_patch_masked_gives_the_same_finite_logits_for_every_image(design):
    # M = N (sampling from nothing): the encoder has no token, cross-attention reads nothing
    model = build_model(decoder_config(**design)).eval()
    x = torch.randint(0, 2, (2, 16, 4)).float()
    logits = model(x, torch.ones(2, 16, dtype=torch.bool))  # (2, 16, C)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[0], logits[1])  # nothing of either image was seen
    assert not torch.allclose(logits[0, 0], logits[0, 5])  # but each patch has its own position


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("variant", [{"pos": "rope2d"}, {"pos": "learned", "norm_position": "post"}])
def test_gradients_reach_every_parameter(design, variant):
    torch.manual_seed(0)
    model = build_model(decoder_config(**design, **variant))
    x, ids, mask = pixels_and_mask()
    nn.functional.cross_entropy(model(x, mask, ids).flatten(0, 1), torch.randint(0, 16, (18,))).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert "mask_token" not in dict(model.named_parameters())  # the encoder never sees a masked patch
    no_decay = {id(p) for p in param_groups(model, 0.1)[1]["params"]}
    for name in ("decoder.mask_token", "decoder.pos") if variant["pos"] == "learned" else ("decoder.mask_token",):
        assert id(dict(model.named_parameters())[name]) in no_decay, name


def test_rope_on_gathered_tokens_equals_rope_on_the_full_sequence_restricted_to_them():
    torch.manual_seed(0)
    grid, heads, d = 5, 2, 8
    n = grid * grid
    angles = rope_2d_angles(d, grid)  # (N, d/2)
    rope = (angles.cos(), angles.sin())
    q_all, k_all = torch.randn(2, 3, heads, n, d).unbind(0)  # 2 x (B, H, N, d), one per patch
    _, ids, mask = pixels_and_mask(b=3, n=n, m=10, seed=5)
    keep = visible_ids(mask, 10)  # (3, 15)
    full = apply_rope(q_all, *rope) @ apply_rope(k_all, *rope).transpose(-1, -2)  # (B, H, N, N)

    def rotated(t, where):  # the tokens at `where` gathered first, then turned by their own angles
        picked = t.gather(2, where[:, None, :, None].expand(-1, heads, -1, d))  # (B, H, L, d)
        return apply_rope(picked, *gather_rope(rope, where))

    enc = rotated(q_all, keep) @ rotated(k_all, keep).transpose(-1, -2)  # (B, H, V, V): encoder scores
    cross = rotated(q_all, ids) @ rotated(k_all, keep).transpose(-1, -2)  # (B, H, M, V): decoder queries
    for b in range(3):
        vis, msk = keep[b], ids[b]
        torch.testing.assert_close(enc[b], full[b][:, vis][:, :, vis])
        torch.testing.assert_close(cross[b], full[b][:, msk][:, :, vis])
    # the angles are the patches' own: turned by their slot in the gathered tensor instead, they differ
    slot = (rope[0][:15], rope[1][:15])  # the angles of patches 0..14

    def by_slot(t):
        return apply_rope(t.gather(2, keep[:, None, :, None].expand(-1, heads, -1, d)), *slot)

    assert not torch.allclose(enc, by_slot(q_all) @ by_slot(k_all).transpose(-1, -2))


# ---- checkpoints, verbs (FLOPs: tests/test_flops.py; parameters: tests/test_params.py) ----------
@pytest.mark.parametrize("design", DESIGNS)
def test_each_decoder_round_trips_through_a_checkpoint(design, tmp_path):
    torch.manual_seed(1)
    cfg = decoder_config(pos="rope2d", **design)
    model = build_model(cfg).eval()
    path = save_checkpoint({"model": model.state_dict(), "config": cfg.to_dict(), "step": 0}, tmp_path / "m.pt")
    loaded, loaded_cfg, _ = load_model(path, torch.device("cpu"))
    assert loaded_cfg == cfg
    x, ids, mask = pixels_and_mask()
    assert torch.equal(loaded(x, mask, ids), model(x, mask, ids))
    # weights of one design under the config of another are refused, naming the keys that do not fit
    other = decoder_config(pos="rope2d", decoder="self" if design["decoder"] == "cross" else "cross")
    bad = save_checkpoint({"model": model.state_dict(), "config": other.to_dict()}, tmp_path / "x.pt")
    with pytest.raises(UserError, match="checkpoint does not fit this model"):
        load_model(bad, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_every_verb_runs_with_a_decoder(kind, tmp_path):
    config = write_config(tmp_path / "c.yaml", {"mask": {"ratio": 0.5, "fill": "learned"}})
    sets = [f"model.decoder={kind}", "model.decoder_dim=16", "model.pos=rope2d"]
    sets += ["train.max_steps=4", "train.eval_every=4", "train.checkpoint_every=4", "train.log_every=2"]
    run_dir, val = verbs.train(config, sets, tmp_path / "run", None, "cpu")
    ckpt = run_dir / "last.pt"
    assert 0.0 <= val["acc"] <= 1.0
    report = verbs.evaluate_checkpoint(ckpt, "test", [0.5, 0.75], "cpu")
    assert [r["mask_ratio"] for r in report["results"]] == [0.5, 0.75]
    assert set(report["results"][0]["baselines"]) == {"majority", "position", "neighbour"}
    assert verbs.reconstruct(ckpt, tmp_path / "r.png", 4, 0.5, "test", 0, "cpu").is_file()
    image = tmp_path / "me.png"
    Image.fromarray((torch.rand(16, 16) > 0.5).to(torch.uint8).numpy() * 255).save(image)
    for iterative in (False, True):
        r = verbs.inpaint(ckpt, image, ["2,2,10,10"], None, tmp_path / f"f{iterative}.png", iterative, 3, "cpu")
        assert r["filled_patches"] == 16
    table = format_table(verbs.count_params(None, ckpt, []))
    assert "decoder.mask_token" in table and "encoder" in table


# ---- refused configs ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sets,needles",
    [
        (["model.decoder=self", "mask.fill=0.5"], ("mask.fill", "learned", "model.decoder=self")),
        (["model.decoder=mae"], ("model.decoder", "none, self, cross")),
        (["model.decoder=cross", "model.decoder_depth=0"], ("model.decoder_depth", ">= 1")),
        (["model.decoder_depth=2"], ("model.decoder_depth", "model.decoder is none")),
        (["model.decoder_dim=16"], ("model.decoder_dim", "model.decoder is none")),
        (["model.decoder=self", "model.decoder_self_attn=true"], ("model.decoder_self_attn", "cross")),
        (["model.decoder=cross", "model.decoder_dim=20", "model.decoder_heads=3"], ("model.decoder_dim", "heads")),
        (["model.decoder=cross", "model.decoder_heads=16", "model.pos=rope2d"], ("model.decoder_heads", "rope2d")),
        (["model.decoder=self", "model.decoder_dim=6", "model.decoder_heads=1", "model.pos=sincos2d"], ("by 4",)),
        (["model.decoder=self", "model.decoder_ffn_dim=-1"], ("model.decoder_ffn_dim", ">= 0")),
    ],
)
def test_bad_decoder_settings_are_user_errors(sets, needles):
    base = {"mask": {"fill": "learned"}, "model": {"hidden_dim": 32, "num_heads": 2}}
    if "mask.fill=0.5" in sets:
        base = {"model": {"hidden_dim": 32, "num_heads": 2}}
    with pytest.raises(UserError) as e:
        config_from_dict(base, sets)
    for needle in needles:
        assert needle in str(e.value)


def test_a_decoder_with_a_fill_value_is_one_line_and_exit_2(tiny_config):
    res = run_cli("config", "--config", tiny_config, "--set", "model.decoder=cross")
    assert_user_error(res, "mask.fill", "set mask.fill=learned")


def test_the_decoder_width_defaults_follow_the_encoder():
    m = ModelConfig(hidden_dim=64, num_heads=4, ffn_dim=256, decoder="self", decoder_dim=32)
    dm = m.decoder_config
    assert (dm.hidden_dim, dm.num_heads, dm.ffn_dim, dm.depth, dm.decoder) == (32, 4, 128, 1, "none")
    assert math.isclose(dm.ffn_dim / dm.hidden_dim, m.ffn_dim / m.hidden_dim)


@pytest.mark.parametrize("design", DESIGNS)
def test_probe_features_of_a_decoder_model_are_its_encoder_on_the_whole_image(design):
    from vitmask.evaluate.probe import extract_features

    torch.manual_seed(0)
    model = build_model(decoder_config(**design)).eval()
    images = (torch.rand(5, 8, 8) < 0.4).to(torch.uint8)  # (n, H, W)
    seen = []
    hook = model.norm.register_forward_hook(lambda mod, inp, out: seen.append(out.detach()))
    feats = extract_features(model, images, 2)  # (n, D)
    hook.remove()
    tokens = torch.cat(seen)  # (n, N, D): the encoder's final norm saw every one of the N = 16 patches
    assert tokens.shape == (5, 16, model.embed.out_features)
    torch.testing.assert_close(feats, tokens.mean(1))
    # the decoder takes no part: changing every decoder weight leaves the features as they were
    with torch.no_grad():
        for p in model.decoder.parameters():
            p.add_(1.0)
    torch.testing.assert_close(extract_features(model, images, 2), feats)
    # and the features see the pixels of every patch, none of them masked
    flipped = images.clone()
    flipped[:, 0:2, 0:2] ^= 1  # patch 0 of every image
    assert not torch.allclose(extract_features(model, flipped, 2), feats)


@pytest.mark.parametrize(
    "model, fill",
    [({"decoder": "self"}, "learned"), ({"decoder": "cross"}, "learned"), ({"decoder": "none"}, 0.0)],
)
def test_a_view_of_blank_patches_alone_gives_a_finite_first_gradient_under_rope2d(model, fill):
    # Under rope2d nothing is added to the tokens. With a zero embedding bias a blank patch would be
    # the zero vector, and an encoder that sees blank patches only (a decoder design: the visible
    # ones; fill 0: every one) would run its LayerNorms on zero vectors, whose gradient is
    # 1/sqrt(eps) ~ 316 each: about 1e12 at the embedding through this stack's norms (1e20 on MNIST).
    shape = {"hidden_dim": 32, "num_heads": 2, "depth": 2, "ffn_dim": 64, "pos": "rope2d"}
    if model["decoder"] != "none":
        shape |= {"decoder_dim": 16, "decoder_depth": 2}
    cfg = Config(
        data=DataConfig(image_size=8, batch_size=4),
        mask=MaskConfig(ratio=0.75, fill=fill),
        model=ModelConfig(**shape, **model),
    )
    torch.manual_seed(0)
    net = build_model(cfg)
    x = torch.zeros(4, 16, 4)  # (B, N, P): blank images
    ids, mask = random_mask(4, 16, 12, torch.Generator().manual_seed(0))
    logits = net(x, mask, ids)  # (B, M, C)
    nn.functional.cross_entropy(logits.reshape(-1, 16), torch.zeros(4 * 12, dtype=torch.long)).backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), math.inf)
    assert torch.isfinite(norm) and norm < 1e3, float(norm)
