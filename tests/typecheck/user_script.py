"""A user's script of vitmask's documented Python API (docs/python.md), for the type checker alone: `make lint`
runs pyright on this file, which must find no error. It is never run (it names models that are not here);
the names `import vitmask` serves lazily resolve to the real objects, so every call below is checked
against their signatures, and tests/test_typecheck.py shows a wrong argument is reported."""

from pathlib import Path

import numpy as np
import torch

import vitmask
from vitmask.errors import UserError
from vitmask.train.callbacks import Callback, EarlyStopping


def classify(folder: Path) -> list[list[str]]:
    classifier = vitmask.load_classifier("export/mnist-classifier")
    images = [folder / "a.png", folder / "b.png"]
    predictions = classifier.predict(images, top_k=3, fit="pad")
    probabilities: torch.Tensor = predictions.probabilities
    assert probabilities.shape[1] == 3 and predictions.fit == "pad"
    return predictions.names


def fill_the_centre(images: np.ndarray) -> torch.Tensor:
    model = vitmask.load_masked_model(Path("runs/mnist/last.pt"), device="cpu", weights="ema")
    mask = np.zeros(model.num_patches, dtype=bool)
    mask[model.num_patches // 2] = True
    features: torch.Tensor = model.features(images, pool="grid", grid=2, layer=[1, 2])
    assert features.ndim == 2
    return model.fill(images, mask)


def processed(images: np.ndarray) -> torch.Tensor:
    net: torch.nn.Module = vitmask.load_pretrained("mnist")
    assert not net.training
    processor = vitmask.ImageProcessor.from_pretrained("mnist")
    own = vitmask.ImageProcessor(28, patch_size=2, threshold=0.5, invert=False, fit="none")
    from_dir = vitmask.ImageProcessor.from_pretrained("export/mnist").with_fit("resize")
    assert own.image_size == from_dir.image_size
    return processor(images, fit="pad").patches


def version() -> str:
    try:
        vitmask.load_classifier("")
    except UserError as e:
        return f"vitmask {vitmask.__version__}: {e}"
    return vitmask.__version__


class StopBelow(Callback):
    def on_validation_end(self, step: int, metrics: dict[str, float]) -> str | None:
        return f"val/loss below 0.1 at step {step}" if metrics["val/loss"] < 0.1 else None


def train(config: Path) -> tuple[Path | None, float]:
    result = vitmask.train(
        [config, "mine.yaml"],
        overrides=["train.max_steps=10"],
        run_dir="runs/x",
        callbacks=[EarlyStopping("val/loss", patience=2), StopBelow()],
        device="cpu",
        resume="auto",
    )
    best: float = result.best_metrics["val/loss"]
    classifier = vitmask.finetune("mnist", "configs/finetune.yaml", run_dir=Path("runs/ft"), baselines=False)
    assert classifier.stopped_early or classifier.stop_reason
    return result.best_checkpoint, best + classifier.test_accuracy
