"""The names of a labelled source's classes, so that a classifier's answers read as names.

`vitmask finetune` keeps, beside each class's label value, its name (`class_names`): the built-in
shapes' kinds, a folder's class subfolders (sorted, as torchvision's ImageFolder and
`sources.folder_labels` number them), an npy folder's file names (sorted), a pack's `classes`, an
npz archive's labels where they are not numbers (numbered in sorted order by `sources.npz_labels`).
Anything else (idx, torchvision, an npz of integer labels) names each class by its label value,
as text. Reading names never fails: where the source's names cannot be matched to its label
values, the values are the names.
"""

import json
from pathlib import Path

from vitmask.config import DataConfig
from vitmask.data import shapes
from vitmask.data.sources import IMAGE_SUFFIXES


def class_names(data: DataConfig, values: list[int]) -> list[str]:
    """One name for each label value in `values` (the classes in the classifier's order)."""
    try:
        names = source_names(data)
    except (OSError, ValueError, KeyError, TypeError):
        names = None
    if names is None or any(not 0 <= v < len(names) for v in values):
        return [str(v) for v in values]
    if data.source == "folder" and len(names) != len(values):  # a class folder with no readable image
        return [str(v) for v in values]
    return [str(names[v]) for v in values]


def source_names(data: DataConfig) -> list[str] | None:
    """The names of the source's label values 0, 1, ... (None: it has none, or they are the numbers)."""
    if data.source == "shapes":
        return list(shapes.KINDS)
    if data.source == "folder":
        return folder_names(Path(data.path))
    if data.source == "npy":
        return sorted(p.stem for p in Path(data.path).iterdir() if p.suffix == ".npy" and p.is_file())
    if data.source == "packed":
        classes = json.loads((Path(data.path) / "header.json").read_text()).get("classes")
        return [str(c) for c in classes] if isinstance(classes, list) else None
    if data.source == "npz":
        return npz_names(Path(data.path), data.npz_labels_key)
    return None


def folder_names(root: Path) -> list[str] | None:
    """A folder's class subfolders, sorted (under train/, val/ and test/ where it has train/ and test/)."""
    own = [root / k for k in ("train", "val", "test") if (root / k).is_dir()]
    tops = own if {p.name for p in own} >= {"train", "test"} else [root]
    names = set()
    for top in tops:
        for p in top.rglob("*"):
            if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file():
                parts = p.relative_to(top).parts
                if len(parts) == 1:
                    return None  # an image outside a class folder: the folder has no labels
                names.add(parts[0])
    return sorted(names)


def npz_names(path: Path, key: str) -> list[str] | None:
    """The sorted distinct labels of an npz archive whose labels are not integers >= 0 (as npz_labels numbers them)."""
    import numpy as np

    with np.load(path, allow_pickle=False) as archive:
        if key not in archive.files:
            return None
        labels = archive[key]
    if np.issubdtype(labels.dtype, np.integer) and (labels.size == 0 or labels.min() >= 0):
        return None
    return [str(v) for v in np.unique(labels)]
