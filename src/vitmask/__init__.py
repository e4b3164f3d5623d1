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
  token classes, as a model was trained (data/processor.py);
- `vitmask.train(config, overrides=[...], run_dir=..., callbacks=[...], device="auto", resume=...)`:
  a training run, the very one `vitmask train` runs, returning a `TrainResult`; `vitmask.finetune(...)`
  the same for `vitmask finetune`, returning a `FinetuneResult` (train/run.py). `vitmask.train` is the
  package vitmask.train, which runs `run.train` when called (vitmask/train/__init__.py);
- `vitmask.__version__`: the version pyproject.toml holds.

Type checkers see the real objects (the `TYPE_CHECKING` block below; the package ships `py.typed`), and
no `__getattr__`, so a misspelt name is an error to them as it is at run time.
"""

# typing.TYPE_CHECKING without importing typing (~8 ms): False at run time; type checkers read any
# name TYPE_CHECKING as True
TYPE_CHECKING = False

__all__ = [
    "ImageProcessor",
    "__version__",
    "finetune",
    "load_classifier",
    "load_masked_model",
    "load_pretrained",
    "train",
]

if TYPE_CHECKING:  # the real objects, for type checkers; at run time __getattr__ imports each on first use
    from vitmask.data.processor import ImageProcessor
    from vitmask.inference.classifier import load_classifier
    from vitmask.inference.masked import load_masked_model
    from vitmask.store.export import load_pretrained
    from vitmask.train.run import finetune, train

    __version__: str

_LAZY = {
    "load_pretrained": "vitmask.store.export",
    "load_classifier": "vitmask.inference.classifier",
    "load_masked_model": "vitmask.inference.masked",
    "ImageProcessor": "vitmask.data.processor",
    "train": "vitmask.train.run",
    "finetune": "vitmask.train.run",
}


def _read_version() -> str:
    """The version in pyproject.toml, the one place it is written, as the installed package's metadata
    holds it (`pip install`, editable or not, writes it there; `make install` reinstalls the project each
    time, so an editable install follows pyproject.toml).

    Fallback, where vitmask is not installed (its sources on PYTHONPATH): the version line of the
    pyproject.toml of the checkout these sources sit in (src/vitmask/../../pyproject.toml); with no such
    file either, "0+unknown" (a valid version that sorts below every release)."""
    import re
    from importlib import metadata
    from pathlib import Path

    try:
        return metadata.version("vitmask")
    except metadata.PackageNotFoundError:
        pass
    try:
        text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    except OSError:
        return "0+unknown"
    found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M) if 'name = "vitmask"' in text else None
    return found.group(1) if found else "0+unknown"


if not TYPE_CHECKING:  # hidden from type checkers: with it, any attribute of the module would type-check

    def __getattr__(name: str):
        if name == "__version__":  # read on first use: importing importlib.metadata costs ~30 ms
            version = globals()["__version__"] = _read_version()
            return version
        if name in _LAZY:
            import importlib

            if name == "train":  # the package vitmask.train, which the import system sets here anyway: callable
                return importlib.import_module("vitmask.train")
            return getattr(importlib.import_module(_LAZY[name]), name)
        raise AttributeError(f"module 'vitmask' has no attribute {name!r}")
