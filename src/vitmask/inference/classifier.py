"""A fine-tuned classifier from Python: `vitmask.load_classifier(PATH)` -> `ImageClassifier`.

    import vitmask
    classifier = vitmask.load_classifier("export/mnist-classifier")  # or a checkpoint, or "mnist-classifier"
    top = classifier.predict(images, top_k=3)  # images: see data/processor.py
    top.names[0], top.probabilities[0]  # the first image's 3 likeliest classes and their probabilities

PATH is a `vitmask finetune` checkpoint (its EMA weights when it has them, unless `weights="raw"`),
its export dir (store/classifier.py), or a shipped classifier's name (`mnist-classifier`). Images go
through `classifier.processor` (the preprocessing the model was trained with; the layouts it reads:
data/processor.py, docs/python.md) unless they are already `ProcessedImages` of the model's image
size. `fit=` (pad, center_crop, resize, none) fits images of another size by that choice instead of
the model's data.fit; `Predictions.fit` says which fit was applied. `invert=` and `threshold=` must
agree with the model's data.invert and data.threshold, how its training images were made binary,
unless `force_preprocessing=True` (ImageProcessor.with_preprocessing); `Predictions.invert` and
`.threshold` say which were applied. Each call that reads images warns once (one line on stderr)
when their foreground share is far from that of the model's training images, where the classifier's
files record it (data/binarization.py `far_from`). Everything runs in fp32 in
eval mode, `BATCH` images at a time, under no_grad; `vitmask predict` and `vitmask eval` call the
same methods, so the CLI and Python give the same numbers for the same images. Every argument is
checked before any work (a UserError in one line).

Shapes: B images, S image side, N patches, P pixels per patch, F pooled features, L classes, k top-k.
"""

import numbers
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vitmask.data.binarization import pixels_share, warn_if_far
from vitmask.data.patches import patchify
from vitmask.data.processor import ImageProcessor, ProcessedImages, check_path, short
from vitmask.errors import UserError
from vitmask.pretrained import check_model_arg
from vitmask.runtime.process import api_device
from vitmask.store.classifier import ClassLabels, LoadedClassifier, load_classifier_model

BATCH = 256  # images per forward pass


@dataclass
class Predictions:
    """The top-k classes of each image, likeliest first."""

    classes: torch.Tensor  # (B, k) int64 class indices (the logits' columns)
    labels: torch.Tensor  # (B, k) int64 the classes' label values in the training data
    names: list[list[str]]  # B lists of k class names
    probabilities: torch.Tensor  # (B, k) float32 softmax probabilities
    fit: str | None = None  # the fit applied to the images (pad, center_crop, resize, none); None: given processed
    invert: bool | None = None  # the invert applied to the images; None: given processed
    threshold: float | None = None  # the threshold applied to the images; None: given processed

    def __len__(self) -> int:
        return len(self.classes)


def check_top_k(top_k: int, num_classes: int, flag: str = "top_k") -> int:
    """`top_k` as an int from 1 to `num_classes`, or a UserError naming `flag`."""
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, numbers.Integral):
        raise UserError(f"{flag} must be an integer from 1 to {num_classes}, got {short(top_k)}")
    if not 1 <= top_k <= num_classes:
        raise UserError(
            f"{flag} {short(top_k)} is out of range: the classifier has {num_classes} classes; pass 1 to {num_classes}"
        )
    return int(top_k)


class ImageClassifier:
    """A fine-tuned classifier (model/classifier.py) with its processor and classes."""

    def __init__(self, loaded: LoadedClassifier):
        self.model = loaded.model  # Classifier, eval mode
        self.config = loaded.config
        self.classes: ClassLabels = loaded.classes
        self.weights = loaded.weights  # ema | raw
        self.record = loaded.record  # the run it came from
        self.processor = ImageProcessor.from_config(loaded.config)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def names(self) -> list[str]:
        """The name of each class, in the order of the logits."""
        return list(self.classes.names)

    def to(self, device: torch.device | str) -> "ImageClassifier":
        self.model.to(api_device(device))
        return self

    def pixels(
        self, images, fit: str | None = None, invert=None, threshold=None, force_preprocessing: bool = False
    ) -> torch.Tensor:
        """Images (anything the processor takes, or ProcessedImages) -> (B, S, S) uint8 0/1 pixels."""
        return model_pixels(images, self.processor, fit, invert, threshold, force_preprocessing)

    @property
    def trained_foreground_share(self) -> float | None:
        """The share of 1-pixels of the images it was fine-tuned on; None where its files record none."""
        return self.record.get("foreground_share")

    def applied_fit(self, images, fit: str | None) -> str | None:
        """The fit `pixels(images, fit)` applies: `fit`, else the processor's; None for ProcessedImages."""
        return None if isinstance(images, ProcessedImages) else fit or self.processor.fit

    def _checked_pixels(self, images, fit, invert, threshold, force_preprocessing) -> torch.Tensor:
        trained = self.trained_foreground_share
        return checked_pixels(images, self.processor, trained, fit, invert, threshold, force_preprocessing)

    @torch.no_grad()
    def _batched(self, pixels: torch.Tensor, forward) -> torch.Tensor:
        p = self.processor.patch_size
        out = [forward(patchify(chunk.to(self.device), p).float()).float() for chunk in pixels.split(BATCH)]
        return torch.cat(out).cpu()

    def logits(
        self, images, fit: str | None = None, invert=None, threshold=None, force_preprocessing: bool = False
    ) -> torch.Tensor:
        """(B, L) float32 logits, on the CPU."""
        pixels = self._checked_pixels(images, fit, invert, threshold, force_preprocessing)
        return self._batched(pixels, self.model)

    def probabilities(
        self, images, fit: str | None = None, invert=None, threshold=None, force_preprocessing: bool = False
    ) -> torch.Tensor:
        """(B, L) float32 softmax probabilities, on the CPU."""
        return self.logits(images, fit, invert, threshold, force_preprocessing).softmax(-1)

    def features(
        self, images, fit: str | None = None, invert=None, threshold=None, force_preprocessing: bool = False
    ) -> torch.Tensor:
        """(B, F) float32: the encoder's final tokens pooled as the classifier pools them (`vitmask probe
        --pool` with the fine-tuning's finetune.pool and .grid), before its norm and head; on the CPU."""
        pixels = self._checked_pixels(images, fit, invert, threshold, force_preprocessing)
        return self._batched(pixels, self.model.features)

    def predict(
        self,
        images,
        top_k: int = 1,
        fit: str | None = None,
        invert=None,
        threshold=None,
        force_preprocessing: bool = False,
    ) -> Predictions:
        """The `top_k` likeliest classes of each image, with their names and probabilities, and the
        preprocessing applied (`fit`: pad, center_crop, resize or none for images of another size;
        `invert`, `threshold`: the model's unless forced; default the model's)."""
        top_k = check_top_k(top_k, len(self.classes))
        top = self.top_k(self.probabilities(images, fit, invert, threshold, force_preprocessing), top_k)
        if not isinstance(images, ProcessedImages):
            processor = self.processor.with_preprocessing(fit, invert, threshold, force_preprocessing)
            top.fit, top.invert, top.threshold = processor.fit, processor.invert, processor.threshold
        return top

    def top_k_of_pixels(self, pixels: torch.Tensor, top_k: int) -> Predictions:
        """Binary images (B, S, S) uint8 0/1, taken as they are (not thresholded again) -> the `top_k`
        likeliest classes of each: what `vitmask predict` gives each batch of images it has read
        (and vitmask demo each image on its page)."""
        pixels = model_pixels(ProcessedImages(pixels, self.processor.patch_size), self.processor, None)
        return self.top_k(self._batched(pixels, self.model).softmax(-1), top_k)

    def top_k(self, probabilities: torch.Tensor, top_k: int) -> Predictions:
        """(B, L) probabilities -> the top_k classes of each row (ties: the lower index first)."""
        top_k = check_top_k(top_k, len(self.classes))
        tensor = isinstance(probabilities, torch.Tensor)
        if not tensor or probabilities.ndim != 2 or probabilities.shape[1] != len(self.classes):
            given = f"of shape {tuple(probabilities.shape)}" if tensor else f"of type {type(probabilities).__name__}"
            raise UserError(
                f"probabilities {given} are not a tensor of shape (images, {len(self.classes)}); "
                "pass what classifier.probabilities(images) returns"
            )
        probs, classes = probabilities.topk(top_k, dim=1)  # (B, k), (B, k)
        values = torch.tensor(self.classes.values, dtype=torch.long)
        names = [[self.classes.names[c] for c in row] for row in classes.tolist()]
        return Predictions(classes, values[classes], names, probs)


def model_pixels(
    images,
    processor: ImageProcessor,
    fit: str | None,
    invert=None,
    threshold=None,
    force_preprocessing: bool = False,
) -> torch.Tensor:
    """Images -> (B, S, S) uint8 0/1 pixels by `processor` (by `fit` for other sizes, `invert` and
    `threshold` when given: ImageProcessor.with_preprocessing); or ProcessedImages, checked: the
    processor's image size S, 0/1 values, at least one image."""
    if not isinstance(images, ProcessedImages):
        return processor(images, fit, invert, threshold, force_preprocessing).pixels
    if fit is not None:
        raise UserError(f"fit={short(fit)} fits raw images; these are ProcessedImages, fitted already: leave fit out")
    for name, value in (("invert", invert), ("threshold", threshold)):
        if value is not None:
            raise UserError(
                f"{name}={short(value)} binarizes raw images; these are ProcessedImages, binary already: leave "
                f"{name} out"
            )
    pixels, s = images.pixels, processor.image_size
    if len(pixels) == 0:
        raise UserError("the ProcessedImages hold no images; pass at least one")
    if tuple(pixels.shape[1:]) != (s, s):
        h, w = pixels.shape[1:]
        raise UserError(
            f"the ProcessedImages are {h}x{w} pixels, but the model takes {s}x{s}; process the images with the "
            f"model's processor (model.processor(images), with fit= to fit another size)"
        )
    if bool((pixels > 1).any()):
        raise UserError("the ProcessedImages hold pixels other than 0 and 1; make them with model.processor(images)")
    return pixels


def checked_pixels(
    images, processor: ImageProcessor, trained: float | None, fit, invert, threshold, force_preprocessing
) -> torch.Tensor:
    """`model_pixels`, with one warning line when their foreground share is far from `trained`, the
    training images' (binarization.warn_if_far; None: not recorded, no check)."""
    pixels = model_pixels(images, processor, fit, invert, threshold, force_preprocessing)  # (B, S, S)
    chosen = processor.with_preprocessing(fit, invert, threshold, force_preprocessing)
    warn_if_far(pixels_share(pixels), len(pixels), trained, chosen, "invert= and threshold=")
    return pixels


def check_load_arguments(path, weights, call: str) -> None:
    """The path and weights of the loader `call`: a path (processor.check_path; one written as a path
    never names a shipped model: pretrained.check_model_arg), and None, ema or raw."""
    check_path(path)
    check_model_arg(path, call=call)
    if weights is not None and not isinstance(weights, str):
        raise UserError(f"weights must be 'ema', 'raw' or None, got {short(weights)} (type {type(weights).__name__})")


def load_classifier(
    path: str | Path, device: torch.device | str = "cpu", weights: str | None = None
) -> ImageClassifier:
    """A fine-tuning checkpoint or a classifier's export dir as an `ImageClassifier`, in eval mode on `device`
    (cpu, cuda, cuda:K or auto). `weights` ema | raw picks a checkpoint's (default: the EMA's when it has them)."""
    check_load_arguments(path, weights, "load_classifier")
    device = api_device(device)
    return ImageClassifier(load_classifier_model(path, device, weights, flag="weights"))
