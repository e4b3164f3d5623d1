"""The file `vitmask predict --out FILE` writes: one record per image, its top-k classes and their
probabilities, as CSV or JSON (by the suffix).

- `.csv`: a header `name,class_1,probability_1,...,class_k,probability_k`, then one row per image;
- `.json`: a list of `{"name": ..., "classes": [k names], "probabilities": [k numbers]}`.

With `--fit`, each record also names the fit applied: a last CSV column `fit`, a JSON entry `"fit"`.

Names are the classifier's class names (a folder's class subfolders, a pack's classes, ...; the
label values as text where the training data named none), likeliest first. Probabilities are
written in full (Python's shortest round-trip form of each float32 value), so the file holds the
same numbers as `ImageClassifier.predict`. The file is written atomically; an `--out` that exists
is refused before any work, and nothing is overwritten.
"""

import csv
import io
import json
from pathlib import Path

from vitmask.errors import UserError
from vitmask.inference.classifier import Predictions
from vitmask.outputs import check_out_file, write_text

SUFFIXES = (".csv", ".json")


def check_predictions_out(out: Path, inputs: tuple[Path, ...]) -> None:
    """--out must end in .csv or .json, be new, and be writable (before anything is loaded)."""
    check_out_file(out, "--out", SUFFIXES, inputs=inputs)
    if out.exists() or out.is_symlink():
        raise UserError(f"--out {out} already exists; nothing was written; pass a new file path, or remove it first")


def records(names: list[str], top: Predictions) -> list[dict]:
    """One record per image: its name, its top-k class names and their probabilities."""
    probs = top.probabilities.tolist()
    return [
        {"name": name, "classes": classes, "probabilities": p}
        for name, classes, p in zip(names, top.names, probs, strict=True)
    ]


def predictions_text(rows: list[dict], suffix: str, top_k: int) -> str:
    """The records as the text of a .csv or .json file."""
    if suffix == ".json":
        return json.dumps(rows, indent=1) + "\n"
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    extra = [k for k in ("fit",) if rows and k in rows[0]]  # --fit: the fit applied
    pairs_header = (f"{kind}_{i}" for i in range(1, top_k + 1) for kind in ("class", "probability"))
    writer.writerow(["name", *pairs_header, *extra])
    for row in rows:
        pairs = [v for c, p in zip(row["classes"], row["probabilities"], strict=True) for v in (c, repr(p))]
        writer.writerow([row["name"], *pairs, *(row[k] for k in extra)])
    return buffer.getvalue()


def write_predictions(out: Path, rows: list[dict], top_k: int) -> Path:
    return write_text(out, predictions_text(rows, out.suffix.lower(), top_k), "--out")
