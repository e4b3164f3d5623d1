"""What vitmask demo serves: a masked-patch model, a classifier or none, and test images to pick from.

The models are opened by the loaders the verbs use: the masked-patch model by
`inference.open.open_model` (as `vitmask inpaint` and `vitmask sample` open `--checkpoint`), the
classifier by `store.classifier.load_classifier_model` into an `ImageClassifier` (as `vitmask
predict` does). So a name or path given here means what it means to those verbs. Left out, the demo
serves the shipped models `mnist` and `mnist-classifier`, read from their folders in the package (a
folder `mnist` in the working directory is no model the user named); `--checkpoint` alone serves
that model without a classifier.

The test images the page offers: a model folder (an export dir) holding `examples.npz` gives its
array `images` ((n, S, S) uint8 0/1, the shipped models' test split); otherwise the test split of the
model's config is read, when its data can be read here (nothing is downloaded: data.download is
turned off for it); otherwise there are none, and the page hides its picker. They are read on first
use, so the server starts without reading any data.

Shapes: n images, S image side.
"""

import dataclasses
import threading
from pathlib import Path

import numpy as np
import torch

from vitmask.config import Config
from vitmask.data.batches import load_splits
from vitmask.errors import UserError
from vitmask.inference.classifier import ImageClassifier
from vitmask.inference.open import open_model
from vitmask.model.memory_estimate import check_fits
from vitmask.outputs import reason
from vitmask.pretrained import EXAMPLES_FILE, SHIPPED, resolve_model_path
from vitmask.store.classifier import load_classifier_model

DEFAULT_MODEL = "mnist"  # the shipped masked-patch model
DEFAULT_CLASSIFIER = "mnist-classifier"  # the classifier fine-tuned from it
MAX_EXAMPLES = 1000  # test images offered at most: the first ones of the split


@dataclasses.dataclass
class DemoModels:
    """The models one demo server serves, each opened once at start."""

    model: torch.nn.Module  # the masked-patch model, eval mode
    config: Config  # its config: data.image_size, data.patch_size, the test split
    name: str  # --checkpoint as given (or the shipped name)
    device: torch.device
    classifier: ImageClassifier | None
    classifier_name: str | None
    examples: "Examples"
    foreground_share: float | None = None  # of the model's training images (None: not recorded)


def open_models(
    checkpoint: Path | None, classifier: Path | None, device_name: str = "auto", weights: str | None = None
) -> DemoModels:
    """Open the models `vitmask demo --checkpoint --classifier` serves (see the module docstring)."""
    name, classifier_name = str(checkpoint), None if classifier is None else str(classifier)
    if checkpoint is None:  # the shipped models' own folders, whatever the working directory holds of their names
        checkpoint, name = SHIPPED[DEFAULT_MODEL].folder, DEFAULT_MODEL
        if classifier is None:
            classifier, classifier_name = SHIPPED[DEFAULT_CLASSIFIER].folder, DEFAULT_CLASSIFIER
    model, cfg, device, share = open_model(Path(checkpoint), device_name, 0, weights, loads_data=False)
    loaded = None
    if classifier is not None:
        loaded = ImageClassifier(load_classifier_model(Path(classifier), device, weights))
        theirs, ours = loaded.processor.image_size, cfg.data.image_size
        if theirs != ours:
            raise UserError(
                f"--classifier {classifier_name} classifies {theirs}x{theirs} images, and --checkpoint {name} "
                f"makes {ours}x{ours} ones; pass a classifier fine-tuned on images of the model's size, or none"
            )
    return DemoModels(
        model,
        cfg,
        name,
        device,
        loaded,
        classifier_name,
        # the folder the model was read from, fixed now: a shipped name gives its package folder, not the
        # working directory's folder of that name, whatever the working directory holds later
        Examples(resolve_model_path(Path(checkpoint)).absolute(), cfg, sum(p.numel() for p in model.parameters())),
        share,
    )


class Examples:
    """The test images the page offers, read on first use (thread-safe): `images()`."""

    def __init__(self, checkpoint: Path, cfg: Config, params: int | None = None):
        self.checkpoint, self.cfg = checkpoint, cfg
        self.params = params  # the model's parameter count, for sizing the test split's read (check_fits)
        self._lock = threading.Lock()
        self._read: tuple[torch.Tensor | None, str] | None = None

    def images(self) -> tuple[torch.Tensor | None, str]:
        """(n, S, S) uint8 0/1 images, and where they come from; or None, and why there are none."""
        with self._lock:
            if self._read is None:
                self._read = self._load()
            return self._read

    def _load(self) -> tuple[torch.Tensor | None, str]:
        size = self.cfg.data.image_size
        file = examples_file(self.checkpoint)
        if file is not None:
            try:
                return read_examples(file, size), f"{file.name} of {self.checkpoint}"
            except UserError as e:
                return None, str(e)
        return test_split(self.cfg, self.params)


def examples_file(checkpoint: Path) -> Path | None:
    """The examples.npz of a model folder (an export dir), or None."""
    file = Path(checkpoint) / EXAMPLES_FILE
    return file if file.is_file() else None


def read_examples(file: Path, size: int) -> torch.Tensor:
    """An examples.npz's array `images`, checked: (n, size, size) uint8 0/1 -> its first MAX_EXAMPLES images."""
    try:
        with np.load(file, allow_pickle=False) as archive:
            if "images" not in getattr(archive, "files", ()):
                raise UserError(f"{file} holds no array 'images'")
            images = archive["images"]
    except UserError:
        raise
    except Exception as e:  # numpy raises OSError, ValueError, zipfile.BadZipFile, EOFError, ... for a bad file
        raise UserError(f"{file} is not a readable .npz archive ({e.__class__.__name__})") from None
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (size, size) or images.max(initial=0) > 1:
        raise UserError(
            f"{file}: 'images' is {images.dtype} {images.shape}, not (n, {size}, {size}) uint8 0/1 images of the model"
        )
    return torch.from_numpy(np.ascontiguousarray(images[:MAX_EXAMPLES]))


def test_split(cfg: Config, params: int | None = None) -> tuple[torch.Tensor | None, str]:
    """The first MAX_EXAMPLES images of the config's test split, read without downloading; or None and why."""
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, download=False))
    try:
        check_fits(cfg, torch.device("cpu"), training=False, what="reading the test images of", params=params)
        test = load_splits(cfg)["test"]
        images = torch.as_tensor(test[: min(len(test), MAX_EXAMPLES)]).to(torch.uint8)  # (n, S, S)
    except UserError as e:
        return None, str(e)
    except OSError as e:
        return None, f"cannot read the {cfg.data.source} data under data.path {cfg.data.path} ({reason(e)})"
    if len(images) == 0:
        return None, "the config's test split is empty"
    return images, f"the test split of {cfg.data.source} data"
