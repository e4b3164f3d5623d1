"""Patches and token classes: patchify/unpatchify, the row-major patch order, the bit order inside a
patch (first pixel most significant), class labels and patch masks as pixel masks."""

import torch

from vitmask.data.patches import (
    classes_to_patches,
    patch_label,
    patch_mask_to_pixels,
    patches_to_classes,
    patchify,
    unpatchify,
)


def test_unpatchify_inverts_patchify():
    g = torch.Generator().manual_seed(0)
    for p, size in [(1, 5), (2, 8), (4, 16)]:
        x = torch.randint(0, 2, (3, size, size), generator=g, dtype=torch.uint8)
        pat = patchify(x, p)
        assert pat.shape == (3, (size // p) ** 2, p * p)
        assert torch.equal(unpatchify(pat, p), x)


def test_patches_are_row_major_over_the_grid_and_inside_a_patch():
    x = torch.arange(16).view(1, 4, 4)
    pat = patchify(x, 2)
    assert pat[0, 0].tolist() == [0, 1, 4, 5]  # top-left patch, its pixels row by row
    assert pat[0, 1].tolist() == [2, 3, 6, 7]  # the patch to its right
    assert pat[0, 2].tolist() == [8, 9, 12, 13]  # first patch of the second row


def test_bit_order_first_pixel_is_most_significant():
    # [[a, b], [c, d]] -> 8a + 4b + 2c + d, the column order of the logits (docs/notation.md)
    assert patches_to_classes(torch.tensor([0, 0, 0, 1])).item() == 1
    assert patches_to_classes(torch.tensor([0, 0, 1, 0])).item() == 2
    assert patches_to_classes(torch.tensor([1, 0, 0, 0])).item() == 8
    assert patches_to_classes(torch.tensor([1, 1, 1, 1])).item() == 15
    img = torch.tensor([[[1, 0], [0, 1]]], dtype=torch.uint8)
    assert patches_to_classes(patchify(img, 2)).tolist() == [[9]]


def test_patch_label_spells_a_class_as_its_pixel_rows():
    assert patch_label(9, 2) == "10/01" and patch_label(1, 2) == "00/01" and patch_label(8, 2) == "10/00"
    assert patch_label(1, 1) == "1" and patch_label(0, 1) == "0"
    assert patch_label(2**8 + 1, 3) == "100/000/001"  # 3x3: the first pixel is bit 8, the last bit 0


def test_patch_mask_to_pixels_covers_exactly_the_masked_patches():
    mask = torch.tensor([[False, True, False, False, False, False, False, False, True]])  # a 3x3 grid
    pix = patch_mask_to_pixels(mask, 2)  # (1, 6, 6)
    want = torch.zeros(1, 6, 6, dtype=torch.bool)
    want[0, 0:2, 2:4] = True  # patch 1: row 0, column 1
    want[0, 4:6, 4:6] = True  # patch 8: row 2, column 2
    assert pix.dtype == torch.bool and torch.equal(pix, want)


def test_classes_round_trip_for_every_class():
    for bits in (1, 4, 9):
        c = torch.arange(2**bits)
        pix = classes_to_patches(c, bits)
        assert pix.shape == (2**bits, bits)
        assert set(pix.unique().tolist()) <= {0, 1}
        assert torch.equal(patches_to_classes(pix), c)
