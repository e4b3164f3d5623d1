"""The fine-tuning regularisers: `finetune.shift` (random translations) and `finetune.mask_ratio` (hidden
patches) on the training batches only, drawn from the step, exact on resume, and refused out of range."""

import numpy as np
import pytest
import torch

from tests.conftest import TINY, assert_user_error, write_config
from vitmask.config import config_from_dict
from vitmask.data.batches import load_labelled_splits
from vitmask.data.patches import patchify, unpatchify
from vitmask.errors import UserError
from vitmask.store.checkpoint import load_checkpoint, step_path
from vitmask.train.finetune import Classifier, FinetuneTrainer, LabelledBatchSampler, shift_images

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


def ft_config(model: dict | None = None, mask: dict | None = None, **finetune):
    train = {**TINY["train"], "max_steps": 6, "eval_every": 3, "checkpoint_every": 3, "log_every": 3}
    train.update(deterministic=True, weight_decay=0.01, schedule="cosine", warmup_steps=2)
    return config_from_dict(
        {
            **TINY,
            "model": {**TINY["model"], **(model or {})},
            "mask": {**TINY["mask"], **(mask or {})},
            "train": train,
            "finetune": finetune,
        }
    )


def one_pixel_images(n: int, row: int, col: int, size: int = 16) -> torch.Tensor:
    images = torch.zeros(n, size, size, dtype=torch.uint8)
    images[:, row, col] = 1
    return images


# ---- shift ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dy, dx", [(2, -3), (-3, 0), (0, 2), (4, -5)])
def test_shift_moves_a_pixel_by_its_offset(dy, dx):
    image = np.zeros((8, 8), dtype=np.uint8)
    image[3, 5] = 1
    want = np.zeros((8, 8), dtype=np.uint8)
    want[3 + dy, 5 + dx] = 1  # every case stays inside the 8x8 image
    got = shift_images(torch.from_numpy(image)[None], torch.tensor([[dy, dx]]))[0]
    assert np.array_equal(got.numpy(), want)


def test_shift_fills_with_background_and_drops_what_leaves_the_image():
    ones = torch.ones(1, 6, 6, dtype=torch.uint8)
    got = shift_images(ones, torch.tensor([[1, -2]]))[0].numpy()
    want = np.ones((6, 6), dtype=np.uint8)
    want[0, :] = 0  # moved down by 1: the top row came from outside
    want[:, -2:] = 0  # moved left by 2: the two right columns came from outside
    assert np.array_equal(got, want)
    gone = shift_images(one_pixel_images(1, 3, 5, 8), torch.tensor([[5, 0]]))  # row 8 is past the edge
    assert gone.sum() == 0
    assert torch.equal(shift_images(ones, torch.zeros(1, 2, dtype=torch.int64)), ones)


def test_each_image_gets_its_own_shift_within_range_and_the_step_decides_it():
    shift, n, batch = 3, 40, 32
    cfg = ft_config(shift=shift)
    cfg = config_from_dict({**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "batch_size": batch}})
    images, labels = one_pixel_images(n, 7, 9), torch.arange(n) % 4
    sampler = LabelledBatchSampler(images, labels, cfg)
    sampler.seek(5)
    batch5 = sampler.sample()
    pixels = unpatchify(batch5.patches, cfg.data.patch_size)  # (B, 16, 16)
    assert torch.equal(pixels.flatten(1).sum(1), torch.ones(batch))  # nothing left the image, 0 all around
    where = pixels.flatten(1).argmax(1)  # the pixel's new place
    offsets = torch.stack([where // 16 - 7, where % 16 - 9], 1)  # (B, 2) rows, columns: read off the images
    assert offsets.abs().max() <= shift
    assert len({tuple(o) for o in offsets.tolist()}) > batch // 2  # per image, not one offset for the batch
    assert offsets[:, 0].unique().numel() > 3 and offsets[:, 1].unique().numel() > 3  # both axes move

    other = LabelledBatchSampler(images, labels, cfg)
    other.seek(5)
    assert torch.equal(other.sample().patches, batch5.patches)  # the same (seed, step): the same batch
    assert not torch.equal(other.sample().patches, batch5.patches)  # the next step: other offsets

    unshifted = LabelledBatchSampler(images, labels, config_from_dict({**cfg.to_dict(), "finetune": {}}))
    unshifted.seek(5)
    assert torch.equal(unpatchify(unshifted.sample().patches, 2), one_pixel_images(batch, 7, 9).float())


def test_shift_zero_gives_the_images_as_they_are():
    cfg = ft_config()
    data = load_labelled_splits(cfg)
    sampler = LabelledBatchSampler(data.images["train"], data.labels["train"], cfg)
    sampler.seek(2)
    idx = sampler.order.indices(2 * cfg.data.batch_size, cfg.data.batch_size)
    batch = sampler.sample()
    assert torch.equal(batch.patches, patchify(data.images["train"][idx], 2).float())
    assert torch.equal(batch.labels, data.labels["train"][idx])
    assert batch.mask is None and batch.ids is None


# ---- mask_ratio -------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio, hidden", [(0.3, 19), (0.5, 32), (0.9, 58)])  # round(ratio * 64)
def test_mask_ratio_hides_exactly_its_share_of_each_image_and_the_step_decides_which(ratio, hidden):
    cfg = ft_config(mask_ratio=ratio)
    data = load_labelled_splits(cfg)
    sampler = LabelledBatchSampler(data.images["train"], data.labels["train"], cfg)
    sampler.seek(4)
    batch = sampler.sample()
    assert batch.mask.shape == (32, 64) and batch.mask.dtype == torch.bool
    assert torch.equal(batch.mask.sum(1), torch.full((32,), hidden))
    assert batch.ids.shape == (32, hidden)
    assert batch.mask.gather(1, batch.ids).all()  # ids are the hidden patches
    assert len({tuple(row) for row in batch.mask.tolist()}) == 32  # each image its own patches
    plain = LabelledBatchSampler(data.images["train"], data.labels["train"], ft_config())
    plain.seek(4)
    assert torch.equal(plain.sample().patches, batch.patches)  # the pixels themselves are not touched
    again = LabelledBatchSampler(data.images["train"], data.labels["train"], cfg)
    again.seek(4)
    assert torch.equal(again.sample().mask, batch.mask)
    assert not torch.equal(again.sample().mask, batch.mask)


@pytest.mark.parametrize("decoder", ["none", "self"])
def test_the_classifier_does_not_see_the_hidden_patches(decoder):
    mask_cfg = {"fill": "learned"} if decoder == "self" else {}
    cfg = ft_config(model={"decoder": decoder}, mask=mask_cfg, mask_ratio=0.5)
    trainer = FinetuneTrainer(cfg, load_labelled_splits(cfg), CPU)
    batch = trainer.sampler.sample()
    model = trainer.model.eval()
    noise = torch.rand(batch.patches.shape, generator=torch.Generator().manual_seed(0)).round()
    scrambled = torch.where(batch.mask.unsqueeze(-1), noise, batch.patches)  # other pixels in the hidden patches
    with torch.no_grad():
        a = model(batch.patches, batch.mask, batch.ids)
        b = model(scrambled, batch.mask, batch.ids)
        whole = model(batch.patches)
    assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(a, whole, atol=1e-3)  # hiding them changes what it sees
    assert isinstance(model, Classifier) and a.shape == (32, trainer.num_labels)


def test_validation_and_test_see_whole_unmoved_images():
    data = load_labelled_splits(ft_config())
    plain = FinetuneTrainer(ft_config(), data, CPU)
    regularised = FinetuneTrainer(ft_config(shift=3, mask_ratio=0.5), data, CPU)  # the same seed: the same init
    assert not torch.equal(plain.sampler.sample().patches, regularised.sampler.sample().patches)
    assert plain.evaluate() == regularised.evaluate()
    assert plain.test_accuracy(data.images["test"]) == regularised.test_accuracy(data.images["test"])
    assert torch.equal(regularised.validator.images, data.images["val"])


# ---- resume -----------------------------------------------------------------------------------------
def test_a_resumed_run_with_both_regularisers_equals_an_unbroken_one(tmp_path):
    cfg = ft_config(shift=2, mask_ratio=0.4, freeze_steps=1)
    data = load_labelled_splits(cfg)
    for name in ("unbroken", "resumed"):
        (tmp_path / name).mkdir()
    unbroken = FinetuneTrainer(cfg, data, CPU)
    unbroken.fit(tmp_path / "unbroken", progress=False)  # 6 steps, a checkpoint at step 3 on the way

    state = load_checkpoint(step_path(tmp_path / "unbroken", 3))
    assert state["step"] == 3
    resumed = FinetuneTrainer(config_from_dict({**cfg.to_dict(), "seed": 5}), data, CPU)  # all from the checkpoint
    resumed.load_state_dict(state)
    resumed.fit(tmp_path / "resumed", progress=False)
    assert resumed.step == unbroken.step == 6
    a, b = unbroken.model.state_dict(), resumed.model.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---- config -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, needles",
    [
        ("finetune.shift=-1", ("finetune.shift", "[0, data.image_size - 1]", "got -1")),
        ("finetune.shift=16", ("finetune.shift", "[0, 15]", "got 16")),
        ("finetune.shift=40", ("finetune.shift", "[0, 15]", "got 40")),
        ("finetune.mask_ratio=1", ("finetune.mask_ratio", "[0, 1)", "got 1.0")),
        ("finetune.mask_ratio=-0.1", ("finetune.mask_ratio", "[0, 1)", "got -0.1")),
        ("finetune.mask_ratio=1.5", ("finetune.mask_ratio", "[0, 1)", "got 1.5")),
    ],
)
def test_out_of_range_regularisers_are_one_line_exit_2(run_cli_in_process, tmp_path, override, needles):
    config = write_config(tmp_path / "ft.yaml")
    assert_user_error(run_cli_in_process("finetune", "--config", config, "--set", override), *needles)


def test_the_edges_of_the_ranges_are_taken():
    cfg = config_from_dict(TINY, ["finetune.shift=15", "finetune.mask_ratio=0.99"])
    assert (cfg.finetune.shift, cfg.finetune.mask_ratio) == (15, 0.99)
    assert (config_from_dict({}).finetune.shift, config_from_dict({}).finetune.mask_ratio) == (0, 0.0)
    with pytest.raises(UserError, match="finetune.shift"):
        config_from_dict({}, ["finetune.shift=1.5"])
