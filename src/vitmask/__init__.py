"""vitmask: masked-patch vision transformers on binary images.

The Python API, each name imported on first use so that `import vitmask` stays cheap (no torch):

- `vitmask.load_pretrained(DIR)`: an exported masked-patch model (store/export.py), with its
  preprocessing as `model.processor`;
- each loader also takes the name of a model shipped inside vitmask (`vitmask.load_pretrained("mnist")`,
  `vitmask.load_classifier("mnist-classifier")`; vitmask/pretrained, `vitmask models`); an existing
  path of that name wins;
- `vitmask.load_classifier(PATH)`: a fine-tuned classifier with its preprocessing: `logits`,
  `predict` (top-k classes, names, probabilities) and `features` of images (inference/classifier.py);
- `vitmask.load_masked_model(PATH)`: a masked-patch model with its preprocessing: encoder `features`,
  the `logits` and `fill` of hidden patches, from images (inference/masked.py);
- `vitmask.ImageProcessor`: images (arrays, tensors, PIL images, files) -> binary pixels, patches and
  token classes, as a model was trained (data/processor.py).
"""

__version__ = "0.1.0"

__all__ = ["ImageProcessor", "__version__", "load_classifier", "load_masked_model", "load_pretrained"]

_LAZY = {
    "load_pretrained": "vitmask.store.export",
    "load_classifier": "vitmask.inference.classifier",
    "load_masked_model": "vitmask.inference.masked",
    "ImageProcessor": "vitmask.data.processor",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vitmask' has no attribute {name!r}")
