"""`vitmask count-params`: one row per parameter tensor with its shape, count and docs/notation.md name, then
the total, counted by hand (for an encoder-decoder model the encoder's and the decoder's totals
first); from a config or from a checkpoint, and its bad input."""

import torch

from tests.conftest import assert_user_error, write_config
from tests.test_decoder import DESIGNS, decoder_config
from tests.test_sources import run_inproc
from vitmask.config import Config, ModelConfig, config_from_dict, load_config
from vitmask.data.batches import load_splits
from vitmask.model.params import format_table, param_rows
from vitmask.model.vit import build_model
from vitmask.train.trainer import Trainer


def test_table_rows_and_total_by_hand():
    # D = 8, P = 4 pixels, N = 4 patches, F = 16, C = 16 classes, one block
    cfg = config_from_dict(
        {
            "data": {"image_size": 4, "patch_size": 2},
            "model": {"hidden_dim": 8, "num_heads": 2, "depth": 1, "ffn_dim": 16, "pos": "learned"},
        }
    )
    lines = format_table(param_rows(build_model(cfg))).splitlines()
    rows = {ln.split()[0]: ln.split(None, 3)[1:] for ln in lines[1:-1]}  # name -> [shape, count, seed name]
    assert rows["pos"] == ["4x8", "32", "P"]  # N x D
    assert rows["embed.weight"] == ["8x4", "32", "A_up"]  # D x P
    assert rows["blocks.0.attn.qkv.weight"] == ["24x8", "192", "W_q, W_k, W_v"]  # 3D x D
    assert rows["blocks.0.attn.proj.weight"] == ["8x8", "64", "W_O"]
    assert rows["blocks.0.ffn.fc1.weight"] == ["16x8", "128", "A_1"]  # F x D
    assert rows["blocks.0.ffn.fc2.bias"] == ["8", "8", "b_2"]
    assert rows["head.weight"] == ["16x8", "128", "A_down"]  # C x D
    assert rows["blocks.0.norm1.weight"] == ["8", "8"]  # no symbol in the notation
    assert len(rows) == 19
    # pos N D + embed (D P + D) + block [2 norms 4 D, qkv 3 D^2 + 3 D, proj D^2 + D, FFN 2 F D + F + D]
    # + final norm 2 D + head (C D + C)
    total = 4 * 8 + (8 * 4 + 8) + (4 * 8 + 3 * 64 + 24 + 64 + 8 + 2 * 16 * 8 + 16 + 8) + 2 * 8 + (16 * 8 + 16)
    assert lines[-1].split() == ["total", f"{total:,}"] and total == 832


def test_count_params_from_a_checkpoint_and_with_overrides(tmp_path, capsys):
    path = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 1, "checkpoint_every": 1}})
    cfg = load_config(path)
    Trainer(cfg, load_splits(cfg), torch.device("cpu")).fit(run_dir=tmp_path, progress=False)
    res = run_inproc(capsys, "count-params", "--checkpoint", tmp_path / "last.pt")
    assert res.returncode == 0, res.stderr
    # TINY: D = 32, 2 blocks, F = 64, N = 64, P = 4, C = 16, learned positions
    block = 4 * 32 + (3 * 32 * 32 + 3 * 32) + (32 * 32 + 32) + (2 * 64 * 32 + 64 + 32)
    total = 64 * 32 + (32 * 4 + 32) + 2 * block + 2 * 32 + (16 * 32 + 16)
    assert res.stdout.splitlines()[-1].split() == ["total", f"{total:,}"] and total == 19_888
    res = run_inproc(capsys, "count-params", "--checkpoint", tmp_path / "last.pt", "--set", "model.depth=3")
    assert res.stdout.splitlines()[-1].split() == ["total", f"{total + block:,}"]


def test_count_params_needs_exactly_one_source(tmp_path, capsys):
    path = write_config(tmp_path / "c.yaml")
    assert_user_error(run_inproc(capsys, "count-params"), "exactly one of --config PATH or --checkpoint PATH")
    both = run_inproc(capsys, "count-params", "--config", path, "--checkpoint", tmp_path / "x.pt")
    assert_user_error(both, "exactly one of")


def test_count_params_shows_encoder_and_decoder_totals():
    # encoder 32 wide (P = 4, N = 16): embed 4*32+32, pos 16*32, 2 blocks of
    # LN 64 + QKV 32*96+96 + out 32*32+32 + LN 64 + FFN 32*64+64 + 64*32+32, final LN 64
    enc_block = 64 + 32 * 96 + 96 + 32 * 32 + 32 + 64 + 32 * 64 + 64 + 64 * 32 + 32
    encoder = 4 * 32 + 32 + 16 * 32 + 2 * enc_block + 64
    # decoder 16 wide, FFN 64 * 16 / 32 = 32: embed 32*16+16, mask token 16, pos 16*16, 2 blocks,
    # final LN 32, head 16*16+16
    dec_block = 32 + 16 * 48 + 48 + 16 * 16 + 16 + 32 + 16 * 32 + 32 + 32 * 16 + 16
    decoder = 32 * 16 + 16 + 16 + 16 * 16 + 2 * dec_block + 32 + 16 * 16 + 16
    for design in DESIGNS[:2]:  # a cross block holds the same matrices: W_q (E, E) and W_k, W_v (2E, E)
        model = build_model(decoder_config(**design))
        lines = format_table(param_rows(model)).splitlines()
        assert lines[-3].split()[-1] == f"{encoder:,}" and lines[-3].startswith("encoder")
        assert lines[-2].split()[-1] == f"{decoder:,}" and lines[-2].startswith("decoder")
        assert lines[-1].split()[-1] == f"{encoder + decoder:,}"
        assert sum(p.numel() for p in model.parameters()) == encoder + decoder
    single = format_table(param_rows(build_model(Config(model=ModelConfig(hidden_dim=32, num_heads=2)))))
    assert not any(line.startswith(("encoder", "decoder")) for line in single.splitlines())  # no split without one
