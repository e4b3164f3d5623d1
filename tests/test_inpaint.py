"""Inpainting: boxes and mask images to patches, one-shot and iterative (most confident first) filling."""

import pytest
import torch
import torch.nn.functional as F

from vitmask.config import DataConfig
from vitmask.data.patches import patches_to_classes, patchify
from vitmask.errors import UserError
from vitmask.generate.inpaint import (
    boxes_to_mask,
    check_patch_mask,
    fill_accuracy,
    mask_image_to_pixels,
    parse_box,
    pixels_to_patches,
)
from vitmask.generate.sampling import DecodeOptions, decode_masked, unmask_counts


def fill(model, images, mask, patch_size, steps):
    """The most likely classes over `steps` rounds (temperature 0, most confident first)."""
    return decode_masked(model, images, mask, patch_size, DecodeOptions(steps=steps))


def test_a_box_masks_every_patch_it_touches():
    pix = boxes_to_mask([parse_box("0,0,3,1", 8)], 8)  # columns 0-2 of row 0
    assert int(pix.sum()) == 3 and pix[0, :3].all()
    assert pixels_to_patches(pix, 2).nonzero().flatten().tolist() == [0, 1]  # the first two patches of row 0
    corner = pixels_to_patches(boxes_to_mask([parse_box("6,6,8,8", 8)], 8), 2)
    assert corner.nonzero().flatten().tolist() == [15]


@pytest.mark.parametrize("text", ["0,0,9,4", "-1,0,4,4", "4,4,4,6", "1,2,3", "a,b,c,d"])
def test_bad_boxes_are_refused(text):
    with pytest.raises(UserError, match="--box"):
        parse_box(text, 8)


def test_a_mask_covering_all_or_no_patches_is_refused():
    with pytest.raises(UserError, match="all 16 patches"):
        check_patch_mask(torch.ones(16, dtype=torch.bool))
    with pytest.raises(UserError, match="no patch"):
        check_patch_mask(torch.zeros(16, dtype=torch.bool))


def test_a_mask_image_is_fitted_like_the_image_and_must_match_its_size():
    cfg = DataConfig(image_size=8, fit="pad")
    mask = torch.zeros(4, 6, dtype=torch.uint8)
    mask[0, 0] = 255
    pix = mask_image_to_pixels(mask, (4, 6), cfg)  # padded to 8x8: offsets 2 (rows) and 1 (columns)
    assert pix.nonzero().tolist() == [[2, 1]]
    gray = torch.tensor([[127, 128, 255, 0]], dtype=torch.uint8)  # white: a gray level of 128 or more
    assert mask_image_to_pixels(gray, (1, 4), DataConfig(image_size=4, fit="pad"))[1].tolist() == [0, 1, 1, 0]
    with pytest.raises(UserError, match="mask image is 6x4 pixels but the image is 5x4"):
        mask_image_to_pixels(mask, (4, 5), cfg)


def test_unmask_schedule_is_cosine_and_fills_every_patch():
    assert unmask_counts(10, 1) == [10]
    counts = unmask_counts(100, 4)
    assert sum(counts) == 100 and counts[0] == 100 - 92  # floor(100 * cos(pi / 8)) = 92 stay hidden


class CountVisible(torch.nn.Module):
    """Predicts, for every patch, the class (number of visible patches) % 16, with confidence falling
    with the patch index: so it shows which patches were visible when each was filled."""

    def forward(self, patches, mask, ids=None):
        b, n, _ = patches.shape
        visible = (~mask).sum(1) % 16  # (B,)
        logits = F.one_hot(visible, 16).float().unsqueeze(1).expand(b, n, 16)  # (B, N, C)
        return logits * (n - torch.arange(n)).view(1, n, 1)  # patch 0 most confident


def test_iterative_fills_the_most_confident_first_and_re_predicts():
    images = torch.zeros(1, 4, 8, dtype=torch.uint8)  # 8 patches of 2x2
    mask = torch.tensor([[False, True, True, False, True, True, True, False]])  # 5 hidden, 3 visible
    one_shot = fill(CountVisible(), images, mask, 2, steps=1)[0].tolist()
    assert one_shot == [0, 3, 3, 0, 3, 3, 3, 0]
    # 3 rounds over 5 patches: floor(5 cos(pi/6)) = 4 and floor(5 cos(pi/3)) = 2 stay hidden -> fix 1, 2, 2
    iterative = fill(CountVisible(), images, mask, 2, steps=3)[0].tolist()
    assert iterative == [0, 3, 4, 0, 4, 6, 6, 0]


class Oracle(torch.nn.Module):
    def forward(self, patches, mask, ids=None):
        return F.one_hot(patches_to_classes(patches), 16).float()  # (B, N, C)


def test_fill_keeps_visible_patches_and_an_oracle_scores_one():
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(5, 8, 8, generator=g) < 0.5).to(torch.uint8)
    mask = torch.zeros(5, 16, dtype=torch.bool)
    mask[:, 5:11] = True
    truth = patches_to_classes(patchify(images, 2))
    for steps in (1, 4):
        assert torch.equal(fill(Oracle(), images, mask, 2, steps), truth)
        assert fill_accuracy(Oracle(), images, mask, 2, steps, batch_size=2)["acc"] == 1.0
    wrong = fill(CountVisible(), images, mask, 2, 1)
    assert torch.equal(wrong[~mask], truth[~mask])
