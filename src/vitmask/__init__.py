"""vitmask: masked-patch vision transformers on binary images."""

__version__ = "0.1.0"
