"""A fine-tuned classifier from Python: `vitmask.load_classifier(PATH)` -> `ImageClassifier`.

    import vitmask
    classifier = vitmask.load_classifier("export/mnist-classifier")  # or runs/finetune-mnist-finetune/last.pt
    top = classifier.predict(images, top_k=3)  # images: see data/processor.py
    top.names[0], top.probabilities[0]  # the first image's 3 likeliest classes and their probabilities

PATH is a `vitmask finetune` checkpoint (its EMA weights when it has them, unless `weights="raw"`)
or its export dir (store/classifier.py). Images go through `classifier.processor` (the preprocessing
the model was trained with) unless they are already `ProcessedImages`. Everything runs in fp32 in
eval mode, `BATCH` images at a time, under no_grad; `vitmask predict` and `vitmask eval` call the same
methods, so the CLI and Python give the same numbers for the same images.

Shapes: B images, S image side, N patches, P pixels per patch, F pooled features, L classes, k top-k.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from vitmask.data.patches import patchify
from vitmask.data.processor import ImageProcessor, ProcessedImages
from vitmask.errors import UserError
from vitmask.store.classifier import ClassLabels, LoadedClassifier, load_classifier_model

BATCH = 256  # images per forward pass


@dataclass
class Predictions:
    """The top-k classes of each image, likeliest first."""

    classes: torch.Tensor  # (B, k) int64 class indices (the logits' columns)
    labels: torch.Tensor  # (B, k) int64 the classes' label values in the training data
    names: list[list[str]]  # B lists of k class names
    probabilities: torch.Tensor  # (B, k) float32 softmax probabilities

    def __len__(self) -> int:
        return len(self.classes)


def check_top_k(top_k: int, num_classes: int, flag: str = "top_k") -> None:
    if not 1 <= top_k <= num_classes:
        raise UserError(
            f"{flag} {top_k} is out of range: the classifier has {num_classes} classes; pass 1 to {num_classes}"
        )


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
        self.model.to(device)
        return self

    def pixels(self, images) -> torch.Tensor:
        """Images (anything the processor takes, or ProcessedImages) -> (B, S, S) uint8 0/1 pixels."""
        return images.pixels if isinstance(images, ProcessedImages) else self.processor(images).pixels

    @torch.no_grad()
    def _batched(self, images, forward) -> torch.Tensor:
        pixels = self.pixels(images)  # (B, S, S)
        p = self.processor.patch_size
        out = [forward(patchify(chunk.to(self.device), p).float()).float() for chunk in pixels.split(BATCH)]
        return torch.cat(out).cpu()

    def logits(self, images) -> torch.Tensor:
        """(B, L) float32 logits, on the CPU."""
        return self._batched(images, self.model)

    def probabilities(self, images) -> torch.Tensor:
        """(B, L) float32 softmax probabilities, on the CPU."""
        return self.logits(images).softmax(-1)

    def features(self, images) -> torch.Tensor:
        """(B, F) float32: the encoder's final tokens pooled as the classifier pools them (`vitmask probe
        --pool` with the fine-tuning's finetune.pool and .grid), before its norm and head; on the CPU."""
        return self._batched(images, self.model.features)

    def predict(self, images, top_k: int = 1) -> Predictions:
        """The `top_k` likeliest classes of each image, with their names and probabilities."""
        check_top_k(top_k, len(self.classes))
        return self.top_k(self.probabilities(images), top_k)

    def top_k_of_pixels(self, pixels: torch.Tensor, top_k: int) -> Predictions:
        """Binary images (B, S, S) uint8 0/1, taken as they are (not thresholded again) -> the `top_k`
        likeliest classes of each: what `vitmask predict` gives each batch of images it has read
        (and vitmask demo each image on its page)."""
        return self.top_k(self.probabilities(ProcessedImages(pixels, self.processor.patch_size)), top_k)

    def top_k(self, probabilities: torch.Tensor, top_k: int) -> Predictions:
        """(B, L) probabilities -> the top_k classes of each row (ties: the lower index first)."""
        probs, classes = probabilities.topk(top_k, dim=1)  # (B, k), (B, k)
        values = torch.tensor(self.classes.values, dtype=torch.long)
        names = [[self.classes.names[c] for c in row] for row in classes.tolist()]
        return Predictions(classes, values[classes], names, probs)


def load_classifier(
    path: str | Path, device: torch.device | str = "cpu", weights: str | None = None
) -> ImageClassifier:
    """A fine-tuning checkpoint or a classifier's export dir as an `ImageClassifier`, in eval mode on `device`.
    `weights` ema | raw picks a checkpoint's (default: the EMA's when it has them)."""
    return ImageClassifier(load_classifier_model(path, device, weights, flag="weights"))
