r"""The file `vitmask predict --out FILE` writes: one record per image, its top-k classes and their
probabilities, as CSV or JSON (by the suffix).

- `.csv`: a header `name,class_1,probability_1,...,class_k,probability_k`, then one row per image;
- `.json`: a list of `{"name": ..., "classes": [k names], "probabilities": [k numbers]}`.

With `--fit`, each record also names the fit applied: a last CSV column `fit`, a JSON entry `"fit"`;
with `--invert`/`--no-invert` and `--threshold`, likewise `invert` (true or false) and `threshold`.

Names are the classifier's class names (a folder's class subfolders, a pack's classes, ...; the
label values as text where the training data named none), likeliest first. Probabilities are
written in full (Python's shortest round-trip form of each float32 value), so the file holds the
same numbers as `ImageClassifier.predict`.

Every name (an image's, a class's) is written whole, whatever it holds: commas, quotes, line
breaks, control characters, right-to-left text, an empty name. The CSV quotes a field that holds a
comma, a quote, a carriage return or a line feed (RFC 4180: a quote doubled inside), so Python's
`csv` module (`open(path, newline="")`) reads back every name as it was; the JSON escapes as JSON
does. Both files are UTF-8. A file name whose bytes are not UTF-8 (which Python holds with one
`\udcNN` code per undecodable byte) is written escaped: in the JSON as those `\udcNN` escapes (so
`os.fsencode(name)` gives back its bytes), in the CSV with each such byte as the four characters
`\xNN`.

The file is written atomically, its missing folders made; an `--out` that exists is refused before
any work, and a file that appears there while predict runs is left as it is (outputs.py): nothing
is ever overwritten.
"""

import json
from pathlib import Path

from vitmask.errors import UserError
from vitmask.inference.classifier import Predictions
from vitmask.outputs import check_out_file, write_text

SUFFIXES = (".csv", ".json")
APPLIED = ("fit", "invert", "threshold")  # the preprocessing a record names, where predict was given it


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
    """The records as the text of a .csv or .json file (module docstring: how names are written)."""
    if suffix == ".json":
        return json.dumps(rows, indent=1) + "\n"  # ASCII: every other character as a JSON escape
    extra = [k for k in APPLIED if rows and k in rows[0]]  # --fit, --invert, --threshold: what was applied
    header = ["name", *(f"{kind}_{i}" for i in range(1, top_k + 1) for kind in ("class", "probability")), *extra]
    lines = [",".join(header)]
    for row in rows:
        pairs = [v for c, p in zip(row["classes"], row["probabilities"], strict=True) for v in (c, repr(p))]
        applied = (str(row[k]).lower() if isinstance(row[k], bool) else str(row[k]) for k in extra)
        lines.append(",".join(csv_field(v) for v in (row["name"], *pairs, *applied)))
    return "".join(line + "\n" for line in lines)


CSV_SPECIAL = (",", '"', "\r", "\n")


def csv_field(text: str) -> str:
    """One CSV field: `text` with each byte that is not UTF-8 as \\xNN (`utf8_text`), quoted when it
    holds a comma, a quote, a carriage return or a line feed (a quote doubled inside). Python's csv
    writer leaves a lone carriage return unquoted, which its reader then takes for a line end."""
    text = utf8_text(text)
    if any(c in text for c in CSV_SPECIAL):
        return '"' + text.replace('"', '""') + '"'
    return text


def utf8_text(text: str) -> str:
    """`text` as valid UTF-8 text: each byte of a file name that was not UTF-8 (held by Python as a
    lone surrogate U+DC80..U+DCFF, os.fsdecode's surrogateescape) as the four characters \\xNN, and
    any other lone surrogate as \\uXXXX; all else as it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "".join(_escaped(c) if "\ud800" <= c <= "\udfff" else c for c in text)
    return text


def _escaped(surrogate: str) -> str:
    code = ord(surrogate)
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"


def write_predictions(out: Path, rows: list[dict], top_k: int) -> Path:
    return write_text(out, predictions_text(rows, out.suffix.lower(), top_k), "--out")
