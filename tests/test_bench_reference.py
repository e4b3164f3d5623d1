"""The benchmark's reference (scripts/bench_reference.py) computes the same function as vitmask's
model, and its per-sample Dataset builds the same kind of batch as vitmask's sampler."""

import sys

import pytest
import torch

from tests.conftest import ROOT
from vitmask.config import Config, DataConfig, MaskConfig, ModelConfig
from vitmask.errors import UserError
from vitmask.model.vit import build_model

sys.path.insert(0, str(ROOT / "scripts"))
from bench_reference import PerSampleMaskedPatches, ReferenceRun, ReferenceViT  # noqa: E402

FILL = 0.3  # not the default 0.5: a fill value hard-coded anywhere shows
CFG = Config(
    data=DataConfig(image_size=8, batch_size=4),
    mask=MaskConfig(fill=FILL),
    model=ModelConfig(hidden_dim=16, num_heads=2, depth=2, ffn_dim=32),
)


def copy_into_reference(ours, ref) -> None:
    with torch.no_grad():
        ref.embed.load_state_dict(ours.embed.state_dict())
        ref.pos.copy_(ours.pos)
        ref.head.load_state_dict(ours.head.state_dict())
        ref.encoder.norm.load_state_dict(ours.norm.state_dict())
        for layer, block in zip(ref.encoder.layers, ours.blocks, strict=True):
            layer.self_attn.in_proj_weight.copy_(block.attn.qkv.weight)
            layer.self_attn.in_proj_bias.copy_(block.attn.qkv.bias)
            layer.self_attn.out_proj.load_state_dict(block.attn.proj.state_dict())
            layer.linear1.load_state_dict(block.ffn.fc1.state_dict())
            layer.linear2.load_state_dict(block.ffn.fc2.state_dict())
            layer.norm1.load_state_dict(block.norm1.state_dict())
            layer.norm2.load_state_dict(block.norm2.state_dict())


def test_reference_model_equals_vitmask_model_with_the_same_weights():
    torch.manual_seed(0)
    ours, ref = build_model(CFG).eval(), ReferenceViT(CFG).eval()
    copy_into_reference(ours, ref)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    x = torch.randint(0, 2, (3, 16, 4)).float()
    mask = torch.zeros(3, 16, dtype=torch.bool)
    mask[:, 3:11] = True
    ids = torch.arange(3, 11).expand(3, 8)
    filled = x.clone()
    filled[:, 3:11, :] = FILL  # the reference's input, masked by hand: patches 3..10 hold the fill value
    torch.testing.assert_close(ref(filled, ids), ours(x, mask, ids), rtol=1e-5, atol=1e-5)


def test_per_sample_dataset_patchifies_and_masks_one_image():
    images = torch.randint(0, 2, (5, 8, 8), dtype=torch.uint8)
    item = PerSampleMaskedPatches(images, 2, 0.5, FILL)[2]
    # image 2 cut by hand into its 16 patches of 2x2, row-major, pixels row by row: class 8a + 4b + 2c + d
    pix = torch.stack([images[2, r : r + 2, c : c + 2].flatten() for r in range(0, 8, 2) for c in range(0, 8, 2)])
    classes = pix.long() @ torch.tensor([8, 4, 2, 1])  # (16,)
    ids = item["ids"]
    assert ids.shape == (8,) and len(set(ids.tolist())) == 8  # round(0.5 * 16) distinct patches
    assert torch.equal(item["targets"], classes[ids])
    masked = torch.zeros(16, dtype=torch.bool)
    masked[ids] = True
    assert (item["inputs"][masked] == FILL).all()
    assert torch.equal(item["inputs"][~masked], pix[~masked].float())


def test_reference_run_trains_on_loader_batches():
    run = ReferenceRun(CFG, torch.randint(0, 2, (6, 8, 8), dtype=torch.uint8), torch.device("cpu"))
    for _ in range(3):  # 3 batches of 4 from 6 images: the loader wraps around
        batch = run.sample()
        assert batch["inputs"].shape == (4, 16, 4) and batch["ids"].shape == (4, 8)
        before = [p.detach().clone() for p in run.model.parameters()]
        with torch.no_grad():  # the loss by hand: mean cross-entropy of the masked patches' logits
            logits = run.model(batch["inputs"], batch["ids"])  # (4, 8, 16)
            want = -logits.log_softmax(-1).gather(-1, batch["targets"].unsqueeze(-1)).mean()
        torch.testing.assert_close(run.train_step(batch), want)
        assert all(not torch.equal(a, b) for a, b in zip(before, run.model.parameters(), strict=True))  # Adam moved all


def test_the_reference_runs_the_shipped_generative_recipe(one_thread):
    # configs/default.yaml: a learned mask embedding, the uniform ratio schedule, mixed masks, rope2d
    from vitmask.config import load_config
    from vitmask.data.batches import load_splits

    small = ["data.num_train=64", "data.num_val=16", "data.num_test=16", "data.batch_size=8"]
    cfg = load_config(ROOT / "configs" / "default.yaml", small)
    assert cfg.mask.fill == "learned" and cfg.mask.ratio_schedule == "uniform" and cfg.mask.strategy == "mixed"
    run = ReferenceRun(cfg, load_splits(cfg)["train"], torch.device("cpu"))
    counts = []
    for step in range(8):
        batch = run.sample()
        m = batch["ids"].shape[1]
        counts.append(m)
        assert batch["inputs"].shape == (8, 256, 4) and batch["targets"].shape == (8, m)
        masked = torch.zeros(8, 256, dtype=torch.bool).scatter_(1, batch["ids"], True)
        assert (masked.sum(1) == m).all()  # every image of the batch hides the batch's count
        assert (batch["inputs"][masked] == 0.5).all()  # the learned embedding's stand-in: pixels of 0.5
        assert set(batch["inputs"][~masked].unique().tolist()) <= {0.0, 1.0}
        if step < 2:  # two steps train; the masks of all eight are checked
            assert torch.isfinite(run.train_step(batch))
    assert len(set(counts)) >= 5 and all(1 <= m <= 255 for m in counts)  # uniform over 1..N-1, one per batch


def test_the_reference_counts_the_plain_stack_for_a_decoder_config():
    from vitmask.config import config_from_dict
    from vitmask.model.flops import train_flops_per_image

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_reference import reference_flops

    plain = config_from_dict({"data": {"image_size": 8}, "model": {"hidden_dim": 16, "num_heads": 2, "depth": 2}})
    cross = config_from_dict(
        {"data": {"image_size": 8}, "model": {"hidden_dim": 16, "num_heads": 2, "depth": 2, "decoder": "cross"}},
        ["mask.fill=learned"],
    )
    assert reference_flops(cross) == reference_flops(plain) == train_flops_per_image(plain, masked_last_block=False)
    assert ReferenceViT(cross)(torch.zeros(2, 16, 4), torch.zeros(2, 3, dtype=torch.long)).shape == (2, 3, 16)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_the_reference_builds_or_names_why_not_for_every_shipped_config(name, one_thread):
    from vitmask.config import load_config
    from vitmask.data.batches import load_splits

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_reference import unsupported

    small = ["data.source=shapes", "data.num_train=16", "data.num_val=8", "data.num_test=8", "data.batch_size=4"]
    cfg = load_config(ROOT / "configs" / name, small)
    if unsupported(cfg):  # the benchmark then times vitmask alone; the reference itself says why in one line
        with pytest.raises(UserError, match="--no-reference"):
            ReferenceViT(cfg)
        return
    run = ReferenceRun(cfg, load_splits(cfg)["train"], torch.device("cpu"))
    batch = run.sample()
    assert batch["inputs"].shape == (4, cfg.data.num_patches, cfg.data.patch_dim)
    assert torch.isfinite(run.train_step(batch))
