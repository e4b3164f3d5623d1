"""`vitmask predict`: a fine-tuned classifier's top-k classes for images, written as CSV or JSON.

Every check comes before the model is loaded or an image read (the output path, the input, the
flags); the classifier is `inference.classifier.ImageClassifier`, the one `vitmask.load_classifier`
gives, so the file holds what Python computes for the same images. The records are written at the
end, atomically: a run stopped by bad input (an image that cannot be read) or a signal leaves no file.
"""

from pathlib import Path

from vitmask.data.processor import ProcessedImages
from vitmask.errors import UserError
from vitmask.inference.classifier import ImageClassifier, check_top_k
from vitmask.inference.inputs import open_input
from vitmask.inference.predictions import check_predictions_out, records, write_predictions
from vitmask.progress import Progress
from vitmask.runtime.process import resolve_device
from vitmask.store.classifier import load_classifier_model


def predict(
    checkpoint: Path,
    input_path: Path,
    out: Path,
    top_k: int = 1,
    batch_size: int = 256,
    weights: str | None = None,
    device_name: str = "auto",
    split: str | None = None,
    npz_key: str = "images",
    progress: bool = True,
) -> dict:
    """Classify the images of `input_path` with the classifier at `checkpoint`; write `out`."""
    out = Path(out)
    check_predictions_out(out, (Path(checkpoint), Path(input_path)))
    if top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {top_k}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    images = open_input(Path(input_path), split, npz_key)
    device = resolve_device(device_name)
    classifier = ImageClassifier(load_classifier_model(checkpoint, device, weights))
    check_top_k(top_k, len(classifier.classes), "--top-k")
    images.check(classifier.processor)
    rows = []
    with Progress(images.count, "predict", "img", enabled=progress) as bar:
        for names, pixels in images.batches(classifier.processor, batch_size):
            # binary already: not thresholded again
            processed = ProcessedImages(pixels, classifier.processor.patch_size)
            rows += records(names, classifier.top_k(classifier.probabilities(processed), top_k))
            bar.update(len(names))
    write_predictions(out, rows, top_k)
    return {
        "out": str(out),
        "images": len(rows),
        "top_k": top_k,
        "classes": len(classifier.classes),
        "weights": classifier.weights,
    }
