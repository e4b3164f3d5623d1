"""The analytic FLOP count (vitmask.model.flops) against torch's own FLOP counter, and for the encoder-decoder
designs (model.decoder: self | cross) also against a count by hand."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.test_decoder import DESIGNS, decoder_config
from vitmask.config import Config, DataConfig, MaskConfig, ModelConfig
from vitmask.data.batches import BatchSampler
from vitmask.model.flops import forward_flops_per_image, train_flops_per_image
from vitmask.model.vit import build_model


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"activation": "swiglu", "num_kv_heads": 2, "pos": "rope2d"},
        {"out_proj": False, "num_kv_heads": 1},
        {"token_conv": 3},
    ],
)
def test_flop_count_matches_torch_flop_counter(variant):
    # torch's counter sees every matmul of the explicit attention path (it does not count CPU SDPA)
    mcfg = ModelConfig(hidden_dim=32, num_heads=4, depth=2, ffn_dim=64, attention="explicit", **variant)
    cfg = Config(data=DataConfig(image_size=16, batch_size=4), model=mcfg)
    model = build_model(cfg)
    batch = BatchSampler(torch.randint(0, 2, (8, 16, 16), dtype=torch.uint8), cfg).sample()
    with FlopCounterMode(display=False) as fwd:
        model(batch.patches, batch.mask, batch.ids)
    assert fwd.get_total_flops() == 4 * forward_flops_per_image(cfg)
    with FlopCounterMode(display=False) as step:
        model(batch.patches, batch.mask, batch.ids).sum().backward()
    counted = step.get_total_flops()
    if mcfg.token_conv:  # torch's counter takes a grouped convolution's weight gradient for a dense one's
        # (groups ignored), D times too much: put the depthwise backward in by hand, both gradients 2 N D k^2 each
        counted -= step.get_flop_counts()["Global"][torch.ops.aten.convolution_backward]
        counted += 4 * mcfg.depth * 2 * (2 * 64 * 32 * mcfg.token_conv**2)  # 4 images of 64 patches, D = 32
    # the only matmul the 3x rule over-counts: the embedding's input gradient, never computed
    assert counted == pytest.approx(4 * train_flops_per_image(cfg), rel=0.01)


@pytest.mark.parametrize("design", [*DESIGNS, {"decoder": "self", "activation": "swiglu", "pos": "rope2d"}])
def test_decoder_flop_count_matches_torch_flop_counter(design):
    # torch's counter sees every matmul of the explicit attention path (it does not count CPU SDPA)
    cfg = decoder_config(image_size=16, attention="explicit", **design)  # 64 patches, 32 masked
    model = build_model(cfg)
    batch = BatchSampler(torch.randint(0, 2, (8, 16, 16), dtype=torch.uint8), cfg).sample()
    with FlopCounterMode(display=False) as fwd:
        model(batch.patches, batch.mask, batch.ids)
    assert fwd.get_total_flops() == 4 * forward_flops_per_image(cfg)
    with FlopCounterMode(display=False) as step:
        model(batch.patches, batch.mask, batch.ids).sum().backward()
    # the only matmul the 3x rule over-counts: the embedding's input gradient, never computed
    assert step.get_total_flops() == pytest.approx(4 * train_flops_per_image(cfg), rel=0.01)


def test_flops_by_hand_for_the_benchmark_model_at_ratio_three_quarters():
    # d=128, depth 4, FFN 512 on 256 tokens of 4 pixels, 16 classes; 192 masked, 64 visible; a
    # decoder of width 128, FFN 512, depth 1. Per encoder block over 64 tokens: QKV 2*64*128*384,
    # scores and weights x V 2*2*64*64*128, output 2*64*128^2, FFN 2*2*64*128*512.
    enc_block = 2 * 64 * 128 * 384 + 4 * 64 * 64 * 128 + 2 * 64 * 128**2 + 4 * 64 * 128 * 512
    enc = 2 * 64 * 4 * 128 + 4 * enc_block
    project, head = 2 * 64 * 128 * 128, 2 * 192 * 128 * 16
    # self: its one (last) block asks queries of the 192 masked tokens only, K and V of all 256
    self_block = 2 * 192 * 128**2 + 2 * 256 * 128 * 256 + 4 * 192 * 256 * 128 + 2 * 192 * 128**2
    self_block += 4 * 192 * 128 * 512
    # cross: 192 queries, K and V of the 64 visible tokens
    cross_block = 2 * 192 * 128**2 + 2 * 64 * 128 * 256 + 4 * 192 * 64 * 128 + 2 * 192 * 128**2
    cross_block += 4 * 192 * 128 * 512
    for kind, dec in (("self", self_block), ("cross", cross_block)):
        cfg = Config(
            mask=MaskConfig(ratio=0.75, fill="learned"),
            model=ModelConfig(hidden_dim=128, num_heads=4, depth=4, ffn_dim=512, decoder=kind),
        )
        assert forward_flops_per_image(cfg) == enc + project + dec + head, kind
