"""vitmask: masked-patch vision transformers on binary images.

`vitmask.load_pretrained(DIR)` loads an exported model (store/export.py); it is imported on first
use, so `import vitmask` stays cheap (no torch).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "load_pretrained"]


def __getattr__(name: str):
    if name == "load_pretrained":
        from vitmask.store.export import load_pretrained

        return load_pretrained
    raise AttributeError(f"module 'vitmask' has no attribute {name!r}")
