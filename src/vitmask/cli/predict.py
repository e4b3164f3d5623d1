"""`vitmask predict`: a fine-tuned classifier's top-k classes for images, written as CSV or JSON.

Every check comes before the model is loaded or an image read (the output path, the input, the
flags); the classifier is `inference.classifier.ImageClassifier`, the one `vitmask.load_classifier`
gives, so the file holds what Python computes for the same images. The records are written at the
end, atomically, into the missing folders of `--out` made then: a run stopped by bad input (an
image that cannot be read, a damaged block of a pack) or a signal leaves no file and no folder,
and a file that appeared at `--out` meanwhile is left as it is (inference/predictions.py).
`fit` (--fit) fits images of another size by that choice instead of the model's data.fit; each
record then names it (`fit`: the CSV's last column, a JSON record's entry). `invert` (--invert,
--no-invert) and `threshold` (--threshold) must agree with the model's data.invert and
data.threshold, how its training images were made binary, unless `force_preprocessing`
(--force-preprocessing); each record then names them too (`invert`, `threshold`). A pack was made
binary when it was packed: none of the three applies to one. Once every image is read, one warning
line when their foreground share is far from the training images' (data/binarization.py), where
the classifier records it.
"""

from pathlib import Path

import torch

from vitmask.data.binarization import warn_if_far
from vitmask.data.processor import check_fit
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
    fit: str | None = None,
    invert: bool | None = None,
    threshold: float | None = None,
    force_preprocessing: bool = False,
) -> dict:
    """Classify the images of `input_path` with the classifier at `checkpoint`; write `out`."""
    out = Path(out)
    check_predictions_out(out, (Path(checkpoint), Path(input_path)))
    if top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {top_k}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    if fit is not None:
        check_fit(fit, "--fit")
    images = open_input(Path(input_path), split, npz_key)
    given = {"--fit": fit, "--invert/--no-invert": invert, "--threshold": threshold}
    for flag in (flag for flag, value in given.items() if value is not None and images.kind == "pack"):
        raise UserError(
            f"{flag} {'fits' if flag == '--fit' else 'binarizes'} images, folders and .npz archives; the pack "
            f"{input_path} was fitted and binarized when it was packed: leave {flag} out"
        )
    device = resolve_device(device_name)
    classifier = ImageClassifier(load_classifier_model(checkpoint, device, weights))
    check_top_k(top_k, len(classifier.classes), "--top-k")
    processor = classifier.processor.with_preprocessing(fit, invert, threshold, force_preprocessing, cli=True)
    images.check(classifier.processor)
    rows = []
    ones = pixel_count = 0  # foreground pixels, and all pixels, of the images read
    with Progress(images.count, "predict", "img", enabled=progress) as bar:
        for names, pixels in images.batches(processor, batch_size):
            rows += records(names, classifier.top_k_of_pixels(pixels, top_k))  # binary already
            ones += int(pixels.sum(dtype=torch.int64))
            pixel_count += pixels.numel()
            bar.update(len(names))
    if pixel_count:
        count = pixel_count // processor.image_size**2
        flags = "--invert/--no-invert and --threshold"
        warn_if_far(ones / pixel_count, count, classifier.trained_foreground_share, processor, flags)
    applied = {"fit": fit, "invert": invert, "threshold": None if threshold is None else processor.threshold}
    extra = {k: v for k, v in applied.items() if v is not None}
    if extra:
        rows = [{**row, **extra} for row in rows]
    write_predictions(out, rows, top_k)
    return {
        "out": str(out),
        "images": len(rows),
        "top_k": top_k,
        "classes": len(classifier.classes),
        "weights": classifier.weights,
        "fit": fit,
    }
