"""A pretrained masked-patch model from Python, images in: `vitmask.load_masked_model(PATH)` -> `MaskedModel`.

    import vitmask
    model = vitmask.load_masked_model("export/mnist")  # or runs/mnist/last.pt, or the shipped "mnist"
    feats = model.features(images)  # (B, F): the encoder's tokens pooled as vitmask probe pools them
    hidden = torch.zeros(model.num_patches, dtype=torch.bool)
    hidden[:98] = True  # patches are numbered row by row: the top half of a 14 x 14 grid
    filled = model.fill(images, hidden)  # (B, S, S): the hidden patches filled with the likeliest ones

PATH is what every verb's `--checkpoint` takes (a `vitmask train` checkpoint, its EMA weights when
it has them, or an export dir; an encoder-only export gives features only). Images go through
`model.processor` (the preprocessing it was trained with; the layouts it reads: data/processor.py,
docs/python.md) unless they are already `ProcessedImages` of the model's image size; `fit=` (pad,
center_crop, resize, none) fits images of another size by that choice instead of the model's
data.fit; `invert=` and `threshold=` must agree with the model's data.invert and data.threshold
unless `force_preprocessing=True` (ImageProcessor.with_preprocessing). `features`, `logits` and
`fill` warn once per call (one line) when the images' foreground share, after that preprocessing,
is far from the training images' (`trained_foreground_share`, binarization.warn_if_far). A mask is
(N,) or (B, N), bool or integers 0/1, True = hidden. `model.model` is the MaskedPatchViT itself (`model(patches,
mask)`). Every argument is checked before any work (a UserError in one line).

Shapes: B images, S image side, N patches, P pixels per patch, C token classes, F features.
"""

import numbers
from pathlib import Path

import numpy as np
import torch

from vitmask.data.processor import ImageProcessor, ProcessedImages, short
from vitmask.errors import UserError
from vitmask.evaluate.pictures import paste_predictions
from vitmask.evaluate.probe import DEFAULT_POOL, POOLS, check_layer, check_pool, extract_features
from vitmask.inference.classifier import check_load_arguments, checked_pixels, model_pixels
from vitmask.model.vit import predict_every_patch
from vitmask.runtime.process import api_device
from vitmask.store.export import load_model

BATCH = 256  # images per forward pass


class MaskedModel:
    """A masked-patch model (model/vit.py) with its processor."""

    def __init__(self, model, config, trained_foreground_share: float | None = None):
        self.model = model  # MaskedPatchViT, eval mode
        self.config = config
        self.processor = ImageProcessor.from_config(config)
        self.trained_foreground_share = trained_foreground_share  # of its training images; None: not recorded

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def num_patches(self) -> int:
        return self.config.data.num_patches

    def to(self, device: torch.device | str) -> "MaskedModel":
        self.model.to(api_device(device))
        return self

    def pixels(
        self, images, fit: str | None = None, invert=None, threshold=None, force_preprocessing: bool = False
    ) -> torch.Tensor:
        """Images (anything the processor takes, or ProcessedImages) -> (B, S, S) uint8 0/1 pixels."""
        return model_pixels(images, self.processor, fit, invert, threshold, force_preprocessing)

    def _checked_pixels(self, images, fit, invert, threshold, force_preprocessing) -> torch.Tensor:
        trained = self.trained_foreground_share
        return checked_pixels(images, self.processor, trained, fit, invert, threshold, force_preprocessing)

    def features(
        self,
        images,
        pool: str = DEFAULT_POOL,
        grid: int | None = None,
        layer=None,
        fit: str | None = None,
        invert=None,
        threshold=None,
        force_preprocessing: bool = False,
    ) -> torch.Tensor:
        """(B, F) float32 on the CPU: the encoder's tokens of the whole images (nothing hidden), pooled as
        `vitmask probe --pool POOL --grid G --layer K` pools them (default: the 4 x 4 grid of token
        means of the final normalised tokens)."""
        if not isinstance(pool, str) or pool not in POOLS:
            raise UserError(f"pool must be one of {', '.join(POOLS)}, got {short(pool)}")
        if grid is not None and not is_integer(grid):
            raise UserError(f"grid must be an integer or None, got {short(grid)} (type {type(grid).__name__})")
        layer = layer_argument(layer)
        check_layer(layer, self.config.model.depth, python=True)
        grid = check_pool(pool, None if grid is None else int(grid), self.config, python=True)
        pixels = self._checked_pixels(images, fit, invert, threshold, force_preprocessing)
        return extract_features(self.model, pixels, self.processor.patch_size, layer, grid).cpu()

    def hidden_mask(self, mask, count: int) -> torch.Tensor:
        """A patch mask (N,) or (B, N), bool or integers 0/1, True = hidden -> (B, N) bool on the model's device."""
        n = self.num_patches
        want = (
            f"pass one patch mask ({n},) or one per image ({count}, {n}), bool, True = hidden, patches numbered "
            "row by row"
        )
        if isinstance(mask, ProcessedImages) or not isinstance(mask, (torch.Tensor, np.ndarray, list, tuple)):
            raise UserError(f"the mask is of type {type(mask).__name__}; {want}")
        try:
            if isinstance(mask, torch.Tensor):
                values = mask.detach()
            else:
                a = np.asarray(mask)
                values = torch.as_tensor(a.astype(a.dtype.newbyteorder("=")) if a.dtype.kind in "biu" else a)
        except (TypeError, ValueError, RuntimeError):
            raise UserError(f"the mask cannot be read as an array of bools; {want}") from None
        if values.is_meta or values.layout != torch.strided:
            raise UserError(
                f"the mask is a {values.layout} tensor{' on the meta device' if values.is_meta else ''}; {want}"
            )
        if values.numel() == 0:
            raise UserError(f"the mask is empty (shape {tuple(values.shape)}); {want}")
        if values.dtype != torch.bool:
            if values.is_floating_point() or values.is_complex() or not bool(((values == 0) | (values == 1)).all()):
                raise UserError(f"the mask holds {values.dtype} values other than 0 and 1; {want}")
        mask = values.to(device=self.device, dtype=torch.bool)
        if mask.dim() == 1 and len(mask) == n:
            mask = mask.expand(count, -1)
        if tuple(mask.shape) != (count, n):
            raise UserError(f"the mask has shape {tuple(mask.shape)}; {want}")
        return mask

    def logits(
        self, images, mask, fit: str | None = None, invert=None, threshold=None, force_preprocessing: bool = False
    ) -> torch.Tensor:
        """(B, N, C) float32 on the CPU: the model's prediction for every patch, with the patches of
        `mask` ((N,) or (B, N) bool, True = hidden) hidden from it."""
        if self.model.head is None:
            raise UserError("this export holds the encoder only (--encoder-only): it gives features, not patches")
        pixels = self._checked_pixels(images, fit, invert, threshold, force_preprocessing)  # (B, S, S)
        return self._predict(pixels, self.hidden_mask(mask, len(pixels)))

    @torch.no_grad()
    def _predict(self, pixels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, N, C) float32 on the CPU for binary images (B, S, S) with the patches of `mask` (B, N) hidden."""
        p = self.processor.patch_size
        out = []
        for chunk, hidden in zip(pixels.split(BATCH), mask.split(BATCH), strict=True):
            patches = ProcessedImages(chunk.to(self.device), p).patches  # (b, N, P)
            out.append(predict_every_patch(self.model, patches, hidden).float().cpu())  # (b, N, C)
        return torch.cat(out)

    def fill(
        self, images, mask, fit: str | None = None, invert=None, threshold=None, force_preprocessing: bool = False
    ) -> torch.Tensor:
        """(B, S, S) uint8 0/1 on the CPU: the binary images with every hidden patch replaced by the
        model's likeliest patch (one shot), the visible ones kept."""
        if self.model.head is None:
            raise UserError("this export holds the encoder only (--encoder-only): it gives features, not patches")
        pixels = self._checked_pixels(images, fit, invert, threshold, force_preprocessing).cpu()
        mask = self.hidden_mask(mask, len(pixels))
        classes = self._predict(pixels, mask).argmax(-1)  # (B, N)
        mask = mask.cpu()
        return paste_predictions(pixels, mask, classes, self.processor.patch_size)


def is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def layer_argument(layer):
    """`layer` of `features`: None, an integer or a non-empty list of integers (as ints), or a UserError."""
    if layer is None or is_integer(layer):
        return None if layer is None else int(layer)
    if isinstance(layer, (list, tuple)) and not layer:
        raise UserError(
            f"layer={layer!r} names no layer; leave layer=None (the default) for the final normalised tokens, "
            "or pass an integer or a non-empty list of integers"
        )
    if isinstance(layer, (list, tuple)) and all(is_integer(k) for k in layer):
        return [int(k) for k in layer]
    raise UserError(f"layer must be None, an integer or a list of integers, got {short(layer)}")


def load_masked_model(path: str | Path, device: torch.device | str = "cpu", weights: str | None = None) -> MaskedModel:
    """A masked-patch checkpoint or export dir as a `MaskedModel`, in eval mode on `device` (cpu, cuda,
    cuda:K or auto). `weights` ema | raw picks a checkpoint's (default: the EMA's when it has them)."""
    check_load_arguments(path, weights, "load_masked_model")
    device = api_device(device)
    loaded = load_model(path, device, weights, need_head=False, flag="weights")
    return MaskedModel(loaded.model, loaded.config, loaded.state["foreground_share"])
