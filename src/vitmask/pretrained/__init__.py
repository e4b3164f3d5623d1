"""The trained models shipped inside vitmask, and what a user's `--checkpoint` names.

Each shipped model lives in a folder of this package named after it, an export dir in vitmask's
export format (store/export.py: `model.safetensors`, `config.json`, a `README.md` model card; a
classifier's: store/classifier.py), plus:

- `shipped.json`: how it was built (the command, the host, the training time, the date), the data it
  learned from and its licence, and its figures on its own test split (`metrics`), read here with
  the standard library alone (no torch): `vitmask models` and the shipped-model checks read it;
- `examples.npz` (masked-patch models): a few dozen images of the model's own test split as it sees
  them, `images` (K, S, S) uint8 0/1, `labels` (K,) int64, `label_names` (the name of each label
  value), `split_index` (K,) their positions in the test split and, for an idx source (mnist),
  `source_index` (K,) their positions in the data file; the card says which.

`scripts/build_pretrained.py` (`make pretrained`) builds every folder.

What a user passes where a checkpoint goes: a path never becomes a name. Anything written as a
path (`written_as_path`: a `pathlib.Path` or other os.PathLike object, or text with a path separator
`/` or `\\`, a leading dot or a trailing separator: `./mnist`, `mnist/`, `runs/x`) is a path, and
where nothing is there and its last part is a shipped model's name, `check_model_arg` refuses it in
one line saying that a shipped model is named without a path (`--checkpoint mnist`,
`load_pretrained("mnist")`). Every entry point calls it on the argument as the user wrote it (the
command line's model options, the Python loaders), before anything turns the text into a `Path`.
Then `resolve_model_path`: an existing path always wins; else a shipped model's name gives its
folder here; else a bare name (no path separator, no file suffix) is one line listing the shipped
names; anything else is returned unchanged, for its loader to say what is wrong. This module
imports the standard library and errors only.
"""

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitmask.errors import UserError

HERE = Path(__file__).resolve().parent
METADATA_FILE = "shipped.json"  # the build's record, beside the export's files
EXAMPLES_FILE = "examples.npz"
MASKED, CLASSIFIER = "masked-patch", "classifier"  # shipped.json's `task`

REINSTALL = "reinstall vitmask, or build the models with make pretrained"  # the fix for a damaged shipped model
MNIST_PATH = "data/mnist/MNIST/raw/t10k-images-idx3-ubyte"  # where the README's tour has MNIST's test set
MNIST_DOWNLOAD = "python -c \"from torchvision.datasets import MNIST; MNIST('data/mnist', download=True)\""


@dataclass(frozen=True)
class ShippedModel:
    """A model shipped in this package: its name, task, recipe and how to get the data it is scored on."""

    name: str
    task: str  # MASKED or CLASSIFIER
    recipe: str  # the config it was trained with, in the checkout
    what: str  # one line: what it is
    download: str | None = None  # how a user gets the data of its test split; None: built in

    @property
    def folder(self) -> Path:
        return HERE / self.name

    def metadata(self) -> dict[str, Any]:
        """shipped.json of its folder (the build's record), or one line saying it is missing or unreadable."""
        file = self.folder / METADATA_FILE
        try:
            meta = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(
                f"the shipped model {self.name} has no readable {METADATA_FILE} ({e.__class__.__name__}); {REINSTALL}"
            ) from None
        if not isinstance(meta, dict):
            raise UserError(f"the shipped model {self.name}: {METADATA_FILE} is not a JSON object; {REINSTALL}")
        return meta

    def size_bytes(self) -> int:
        """The bytes of the files in its folder, as installed."""
        return sum(p.stat().st_size for p in self.folder.rglob("*") if p.is_file())


SHIPPED: dict[str, ShippedModel] = {
    m.name: m
    for m in (
        ShippedModel(
            "mnist",
            MASKED,
            "configs/mnist.yaml",
            "fills hidden patches of 28x28 MNIST digits, samples digits, bounds their likelihood",
            MNIST_DOWNLOAD,
        ),
        ShippedModel(
            "mnist-classifier",
            CLASSIFIER,
            "configs/finetune-mnist.yaml",
            "classifies 28x28 MNIST digits (mnist fine-tuned on the labels)",
            MNIST_DOWNLOAD,
        ),
        ShippedModel(
            "shapes",
            MASKED,
            "configs/default.yaml",
            "fills hidden patches of vitmask's built-in 32x32 shapes, samples shapes",
        ),
    )
}


def names() -> list[str]:
    """The shipped models' names, in the order `vitmask models` lists them."""
    return list(SHIPPED)


def is_bare_name(text: str) -> bool:
    """A name, not a path: no path separator and no file suffix (`mnist`, `my-model`; not `last.pt`, `runs/x`)."""
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return bool(text) and text not in (".", "..") and not any(s in text for s in seps) and not Path(text).suffix


PATH_SEPARATORS = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())


def written_as_path(path: str | os.PathLike) -> bool:
    """Whether `path` is written as a path, which never names a shipped model: any os.PathLike object
    (a `pathlib.Path`), or text with a path separator (`/` or `\\`: `runs/x`, `mnist/`) or a leading dot
    (`./mnist`, `.`). Only a bare name in a str (`mnist`) may name a shipped model."""
    if not isinstance(path, str):
        return True
    return path.startswith(".") or any(s in path for s in PATH_SEPARATORS)


def check_model_arg(path: str | os.PathLike, flag: str | None = None, call: str | None = None) -> None:
    """Refuse a model argument written as a path (`written_as_path`) where nothing is, when its last part
    is a shipped model's name (`./mnist`, `mnist/`, `Path("shapes")`, `models/mnist`): one line naming
    the path and saying that a shipped model is named without a path, as `flag` (a command-line option,
    `--checkpoint`) or `call` (a Python loader, `load_pretrained`) takes it. Any other path that is not
    there is left to its loader's own "not found"; an existing path, or a bare name, passes."""
    if not written_as_path(path):
        return
    text = os.fspath(path)
    if not isinstance(text, str) or os.path.lexists(text):
        return
    name = Path(text.replace("\\", "/")).name
    if name not in SHIPPED:
        return
    if call is not None:
        raise UserError(
            f"{call}: there is nothing at the path {text!r}; a model shipped with vitmask is named by its bare "
            f'name in a str, without a path: {call}("{name}") (or pass the path of an existing checkpoint or '
            "export dir)"
        )
    raise UserError(
        f"{flag or '--checkpoint'} {text}: there is nothing at that path; a model shipped with vitmask is named "
        f"without a path: {flag or '--checkpoint'} {name} (or pass the path of an existing checkpoint or export dir)"
    )


def unknown_name(text: str) -> UserError:
    return UserError(
        f"no file or folder {text} here, and no model of that name ships with vitmask (shipped: "
        f"{', '.join(names())}); pass one of those names, or a path to a .pt checkpoint or an export dir"
    )


def locate(path: str | Path) -> Path | None:
    """Where a model named by `path` is: the path itself when it exists, a shipped model's folder for
    its name, else None (never raises)."""
    p = Path(path)
    if os.path.lexists(p):  # False, not an error, for a path the file system refuses (too long)
        return p
    model = SHIPPED.get(str(path))
    return model.folder if model is not None else None


def resolve_model_path(path: str | Path) -> Path:
    """What a user's `--checkpoint` (or `--init`, or a loader's PATH) means, once its entry point has
    checked the argument as written (`check_model_arg`): an existing path always wins; else a shipped
    model's name gives its folder; else a bare name is one line listing the shipped names; anything
    else comes back unchanged, so its loader's "not found" says what is wrong. Calling it again on what
    it returned gives the same path."""
    found = locate(path)
    if found is not None:
        model = SHIPPED.get(str(path))
        if model is not None and found == model.folder and not found.is_dir():
            raise UserError(f"the shipped model {model.name} is missing from this installation ({found}); {REINSTALL}")
        return found
    if is_bare_name(str(path)):
        raise unknown_name(str(path))
    return Path(path)


def shipped_at(path: str | Path) -> ShippedModel | None:
    """The shipped model `path` names or points at (its folder here), else None (never raises)."""
    found = locate(path)
    if found is None:
        return None
    try:
        where = found.resolve()
    except (OSError, RuntimeError):
        return None
    return next((m for m in SHIPPED.values() if m.folder == where), None)


def check_data(path: str | Path, source: str, data_path: str) -> None:
    """Before a verb reads the data of the model at `path` (data.source `source`, data.path
    `data_path`): a shipped model whose data is not where its config says is one line saying where
    to get it. Anything else is left to the data's own reader."""
    model = shipped_at(path)
    if model is None or model.download is None or source == "shapes" or os.path.lexists(data_path):
        return
    raise UserError(
        f"the shipped model {model.name} reads its test split from {data_path} (MNIST's test-set file as "
        f"torchvision's download leaves it), which is not under {Path.cwd()}; download MNIST with torchvision: "
        f"{model.download}, and run the command from the folder that holds data/"
    )


# ---- the listing (`vitmask models`) ---------------------------------------------------------------
METRICS = {  # shipped.json's metrics: key -> label, in the order they are shown
    "acc_r0.5": "r=0.5 acc",
    "acc_nonempty_r0.5": "r=0.5 non-empty acc",
    "acc_nonempty_centre_box": "centre box non-empty acc",
    "nll_bound_nats": "NLL bound (nats/image)",
    "accuracy": "test accuracy",
}


def listing() -> list[dict[str, Any]]:
    """One record per shipped model: name, task, recipe, data, size on disk, figures on its own test split."""
    rows = []
    for model in SHIPPED.values():
        meta = model.metadata()
        metrics = meta.get("metrics") if isinstance(meta.get("metrics"), dict) else {}
        summary = meta["data"].get("summary") if isinstance(meta.get("data"), dict) else None
        images = metrics.get("images")
        rows.append(
            {
                "name": model.name,
                "task": model.task,
                "recipe": model.recipe,
                "what": model.what,
                "data": summary if isinstance(summary, str) else "",
                "bytes": model.size_bytes(),
                "test_images": images if type(images) is int and images > 0 else None,
                "metrics": {k: metrics[k] for k in METRICS if is_figure(metrics.get(k))},
                "quick": meta.get("quick") is True,
                "folder": str(model.folder),
            }
        )
    return rows


def is_figure(value: Any) -> bool:
    """A finite int or float (not a bool): what the listing shows, and what strict JSON can hold.
    Anything else in a shipped.json someone changed is left out, as a figure never recorded."""
    if type(value) not in (int, float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past the largest float
        return False


def format_metrics(metrics: dict[str, float]) -> str:
    """`r=0.5 acc 0.9071, ...`: each figure with its label, 4 decimals (the NLL bound 2)."""
    return ", ".join(
        f"{METRICS[k]} {v:.2f}" if k == "nll_bound_nats" else f"{METRICS[k]} {v:.4f}" for k, v in metrics.items()
    )


def format_size(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def format_listing(rows: list[dict[str, Any]]) -> str:
    """The listing as text: one block per model (name, task, recipe, data, size, figures)."""
    lines = []
    for r in rows:
        quick = " (a --quick build: a short stand-in for the full one)" if r["quick"] else ""
        scored = f" on its {r['test_images']:,} test images" if r["test_images"] else ""
        lines += [
            f"{r['name']}  {r['task']}, {format_size(r['bytes'])}{quick}",
            f"  {r['what']}; trained with {r['recipe']}",
            f"  data: {r['data']}",
            f"  figures{scored}: {format_metrics(r['metrics']) or 'none recorded'}",
            "",
        ]
    lines.append("Pass a name wherever a checkpoint goes: vitmask sample --checkpoint mnist --out samples.png")
    lines.append("Each model's card: its folder's README.md (vitmask models --json gives the folders).")
    return "\n".join(lines)
