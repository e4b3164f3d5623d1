"""A pretrained masked-patch model from Python, images in: `vitmask.load_masked_model(PATH)` -> `MaskedModel`.

    import vitmask
    model = vitmask.load_masked_model("export/mnist")  # or runs/mnist/last.pt, or the shipped "mnist"
    feats = model.features(images)  # (B, F): the encoder's tokens pooled as vitmask probe pools them
    hidden = torch.zeros(model.num_patches, dtype=torch.bool)
    hidden[:98] = True  # patches are numbered row by row: the top half of a 14 x 14 grid
    filled = model.fill(images, hidden)  # (B, S, S): the hidden patches filled with the likeliest ones

PATH is what every verb's `--checkpoint` takes (a `vitmask train` checkpoint, its EMA weights when
it has them, or an export dir; an encoder-only export gives features only). Images go through
`model.processor` (the preprocessing it was trained with, data/processor.py) unless they are already
`ProcessedImages`; `model.model` is the MaskedPatchViT itself (`model(patches, mask)`).

Shapes: B images, S image side, N patches, P pixels per patch, C token classes, F features.
"""

from pathlib import Path

import torch

from vitmask.data.processor import ImageProcessor, ProcessedImages
from vitmask.errors import UserError
from vitmask.evaluate.pictures import paste_predictions
from vitmask.evaluate.probe import DEFAULT_POOL, check_layer, check_pool, extract_features
from vitmask.model.vit import predict_every_patch
from vitmask.store.export import load_model

BATCH = 256  # images per forward pass


class MaskedModel:
    """A masked-patch model (model/vit.py) with its processor."""

    def __init__(self, model, config):
        self.model = model  # MaskedPatchViT, eval mode
        self.config = config
        self.processor = ImageProcessor.from_config(config)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def num_patches(self) -> int:
        return self.config.data.num_patches

    def pixels(self, images) -> torch.Tensor:
        """Images (anything the processor takes, or ProcessedImages) -> (B, S, S) uint8 0/1 pixels."""
        return images.pixels if isinstance(images, ProcessedImages) else self.processor(images).pixels

    def features(self, images, pool: str = DEFAULT_POOL, grid: int | None = None, layer=None) -> torch.Tensor:
        """(B, F) float32 on the CPU: the encoder's tokens of the whole images (nothing hidden), pooled as
        `vitmask probe --pool POOL --grid G --layer K` pools them (default: the 4 x 4 grid of token
        means of the final normalised tokens)."""
        check_layer(layer, self.config.model.depth)
        grid = check_pool(pool, grid, self.config)
        pixels = self.pixels(images)
        return extract_features(self.model, pixels, self.processor.patch_size, layer, grid).cpu()

    def hidden_mask(self, mask, count: int) -> torch.Tensor:
        """A patch mask (N,) or (B, N), True = hidden -> (B, N) bool on the model's device."""
        mask = torch.as_tensor(mask, dtype=torch.bool, device=self.device)
        n = self.num_patches
        if mask.dim() == 1:
            mask = mask.expand(count, -1)
        if mask.shape != (count, n):
            raise UserError(
                f"the mask has shape {tuple(mask.shape)}; pass one patch mask ({n},) or one per image ({count}, {n}), "
                "True = hidden, patches numbered row by row"
            )
        return mask

    @torch.no_grad()
    def logits(self, images, mask) -> torch.Tensor:
        """(B, N, C) float32 on the CPU: the model's prediction for every patch, with the patches of
        `mask` ((N,) or (B, N) bool, True = hidden) hidden from it."""
        if self.model.head is None:
            raise UserError("this export holds the encoder only (--encoder-only): it gives features, not patches")
        pixels = self.pixels(images)  # (B, S, S)
        mask = self.hidden_mask(mask, len(pixels))  # (B, N)
        p = self.processor.patch_size
        out = []
        for chunk, hidden in zip(pixels.split(BATCH), mask.split(BATCH), strict=True):
            patches = ProcessedImages(chunk.to(self.device), p).patches  # (b, N, P)
            out.append(predict_every_patch(self.model, patches, hidden).float().cpu())  # (b, N, C)
        return torch.cat(out)

    def fill(self, images, mask) -> torch.Tensor:
        """(B, S, S) uint8 0/1 on the CPU: the binary images with every hidden patch replaced by the
        model's likeliest patch (one shot), the visible ones kept."""
        pixels = self.pixels(images).cpu()
        mask = self.hidden_mask(mask, len(pixels)).cpu()
        classes = self.logits(ProcessedImages(pixels, self.processor.patch_size), mask).argmax(-1)  # (B, N)
        return paste_predictions(pixels, mask, classes, self.processor.patch_size)


def load_masked_model(path: str | Path, device: torch.device | str = "cpu", weights: str | None = None) -> MaskedModel:
    """A masked-patch checkpoint or export dir as a `MaskedModel`, in eval mode on `device`.
    `weights` ema | raw picks a checkpoint's (default: the EMA's when it has them)."""
    loaded = load_model(path, device, weights, need_head=False, flag="weights")
    return MaskedModel(loaded.model, loaded.config)
