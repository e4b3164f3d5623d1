"""The benchmark's reference computes the same function as vitmask's model, and its per-sample
Dataset builds the same kind of batch as vitmask's sampler."""

import torch

from vitmask.config import Config, DataConfig, ModelConfig
from vitmask.masking import apply_fill
from vitmask.model import build_model
from vitmask.patches import patches_to_classes, patchify
from vitmask.reference import PerSampleMaskedPatches, ReferenceRun, ReferenceViT

CFG = Config(
    data=DataConfig(image_size=8, batch_size=4), model=ModelConfig(hidden_dim=16, num_heads=2, depth=2, ffn_dim=32)
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
    torch.testing.assert_close(ref(apply_fill(x, mask, 0.5), ids), ours(x, mask, ids), rtol=1e-5, atol=1e-5)


def test_per_sample_dataset_patchifies_and_masks_one_image():
    images = torch.randint(0, 2, (5, 8, 8), dtype=torch.uint8)
    item = PerSampleMaskedPatches(images, 2, 0.5, 0.5)[2]
    pix = patchify(images[2:3], 2)[0]  # (16, 4)
    ids = item["ids"]
    assert ids.shape == (8,) and len(set(ids.tolist())) == 8
    assert torch.equal(item["targets"], patches_to_classes(pix)[ids])
    masked = torch.zeros(16, dtype=torch.bool)
    masked[ids] = True
    assert (item["inputs"][masked] == 0.5).all()
    assert torch.equal(item["inputs"][~masked], pix[~masked].float())


def test_reference_run_trains_on_loader_batches():
    run = ReferenceRun(CFG, torch.randint(0, 2, (6, 8, 8), dtype=torch.uint8), torch.device("cpu"))
    losses = [float(run.train_step(run.sample())) for _ in range(3)]  # 3 batches of 4 from 6 images: wraps
    batch = run.sample()
    assert batch["inputs"].shape == (4, 16, 4) and batch["ids"].shape == (4, 8)
    assert all(torch.isfinite(torch.tensor(losses)))
