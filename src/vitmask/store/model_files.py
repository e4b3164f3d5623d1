"""A trained model's files, read in one pass: a `.pt` checkpoint or an export dir, whatever it holds.

`open_model_files(PATH)` is the one reader behind every loader of a trained model: store/export.py
(a masked-patch model: `load_model`, `load_pretrained`) and store/classifier.py (a fine-tuned
classifier: `load_classifier_model`) build their model on what it gives and call nothing back.
Each file is read once, and checked as it is read:

- a checkpoint: `checkpoint.load_checkpoint` (its checksum, its entries, finite values);
- an export dir: `config.json` once (`read_config_json`: present, at most 1 MiB, nested at most 32
  levels, no integer past Python's limit on digits); its entries checked for its task when first
  used (`meta`: this format, `weights` ema or raw, the SHA-256 of the weights, the run's record by
  `check_training_record`; a masked-patch export's `encoder_only`, a classifier's `classifier`);
  `model.safetensors` once, when its tensors are first asked for (`entry`): the SHA-256 config.json
  names, every tensor float32 and finite.

`ModelFiles` says what the path is (`kind`: checkpoint | export) and what it holds (`task`: masked
| classifier) before anything else is checked, so a loader refuses the other task in its own words
first. Then: `meta` (a checkpoint's dict, an export's config.json, checked), `config` (the training
config, built once), `weights_kind` (which weights `--weights` picks: ema | raw), `entry` (that
weight entry's tensors), and `load_into(model, state)`: the chosen entry loaded into the model the
loader built, then EVERY weight entry the files hold checked to fit that model (a checkpoint's
trained weights and its EMA's), so a damaged entry that a command does not load is refused too.

Shapes: none; state dicts map names to tensors.
"""

import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from vitmask.config import INT_RANGE, MAX_CONFIG_BYTES, MAX_YAML_DEPTH, Config, config_from_dict
from vitmask.errors import UserError
from vitmask.pretrained import REINSTALL, resolve_model_path, shipped_at
from vitmask.store import checkpoint

FORMAT = "vitmask-export/1"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHT_KINDS = ("ema", "raw")
MASKED, CLASSIFIER = "masked", "classifier"  # what a model's files hold (`ModelFiles.task`)
CLASSIFIER_TASK = "classifier"  # config.json's `task` of a fine-tuned classifier's export
CHECKPOINT_TASK = "finetune"  # a fine-tuning checkpoint's `task` (train/finetune.py)
MAX_JSON_DEPTH = MAX_YAML_DEPTH  # nested objects and lists in config.json (one vitmask writes has 5)
EXPORT_AGAIN = {
    MASKED: "export it again with vitmask export --checkpoint X --out DIR",
    CLASSIFIER: "export it again with vitmask export --checkpoint FINETUNED.pt --out DIR",
}


# ---- which weights ----------------------------------------------------------------------------------
def check_weights(weights: str | None, flag: str = "--weights") -> None:
    """`flag` is the option that asked for `weights`, as the messages name it."""
    if weights is not None and weights not in WEIGHT_KINDS:
        raise UserError(f"{flag} must be ema or raw, got '{weights}'")


def has_ema(state: dict[str, Any]) -> bool:
    return isinstance(state.get("ema"), dict) and bool(state["ema"])


def checkpoint_weights(
    state: dict[str, Any], path: str | Path, weights: str | None, flag: str = "--weights"
) -> tuple[dict, str]:
    """The state dict a checkpoint's model is loaded from, and its kind: the EMA's when the
    checkpoint has one (or `weights` asks), the trained weights with `weights="raw"`."""
    check_weights(weights, flag)
    if weights == "ema" and not has_ema(state):
        raise UserError(
            f"{flag} ema: checkpoint {path} holds no EMA weights (it was trained with train.ema_decay=0); "
            f"pass {flag} raw, or leave {flag} out"
        )
    kind = weights or ("ema" if has_ema(state) else "raw")
    return state["ema" if kind == "ema" else "model"], kind


# ---- an export dir's config.json --------------------------------------------------------------------
def is_export_dir(path: str | Path) -> bool:
    """A folder with a config.json or a model.safetensors: meant as an export dir (checked when read)."""
    p = Path(path)
    return p.is_dir() and ((p / CONFIG_FILE).exists() or (p / WEIGHTS_FILE).exists())


def bad_export(path: Path, what: str, task: str = MASKED) -> UserError:
    """One line for an export dir's fault; for a shipped model's folder (its files in the installed package
    changed), that it is damaged and the package is to be reinstalled: exporting again is no user's fix."""
    shipped = shipped_at(path)
    if shipped is not None:
        return UserError(f"the shipped model {shipped.name} is damaged ({path}: {what}); {REINSTALL}")
    return UserError(f"export dir {path}: {what}; {EXPORT_AGAIN[task]}")


def read_config_json(path: Path) -> Any:
    """config.json of the export dir `path`, parsed with every guard a hostile file needs: present, at
    most MAX_CONFIG_BYTES, JSON nested at most MAX_JSON_DEPTH levels, no integer past Python's limit on
    digits. One line (a UserError) for anything wrong; nothing about its entries is checked here."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise bad_export(path, f"{CONFIG_FILE} is missing")
    try:
        size = file.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise bad_export(
                path, f"{CONFIG_FILE} is {size:,} bytes, more than an export's may be ({MAX_CONFIG_BYTES:,})"
            )
        meta = json.loads(file.read_text())
    except RecursionError:  # json recurses once per level
        raise bad_export(path, f"{CONFIG_FILE} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_export(path, f"{CONFIG_FILE} cannot be read ({str(e).splitlines()[0][:120]})") from None
    except ValueError:  # Python's limit on converting text to integers
        raise bad_export(
            path, f"{CONFIG_FILE} holds an integer of more than {sys.get_int_max_str_digits()} digits"
        ) from None
    if json_depth(meta) > MAX_JSON_DEPTH:
        raise bad_export(path, f"{CONFIG_FILE} is nested more than {MAX_JSON_DEPTH} levels deep")
    return meta


def json_depth(value: Any) -> int:
    """How deep objects and lists nest in `value` (parsed JSON; a number or a string is 0), counted
    without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:  # deeper is refused anyway: no need to walk on
            todo.extend((child, depth + 1) for child in children)
    return deepest


def check_export_meta(meta: Any, path: Path, task: str) -> dict[str, Any]:
    """config.json's entries for an export of `task`: this format, `training` (the run's record,
    `check_training_record`), `weights` ema or raw, `sha256` with the hex SHA-256 of model.safetensors
    (never skipped: without one the weights are refused); a masked-patch export's
    `encoder_only`, a classifier's `classifier`. One line naming the entry for anything wrong."""
    found = meta.get("format") if isinstance(meta, dict) else None
    if not isinstance(found, str) or not found.startswith("vitmask-export/"):
        raise bad_export(path, f"{CONFIG_FILE} is not a vitmask export's (no '{FORMAT}' format)", task)
    if found != FORMAT:
        raise UserError(
            f"export dir {path} was written by another version of vitmask (format {found[:40]}; this one reads "
            f"{FORMAT}); use that version, or export again with this one"
        )
    own = ("classifier", dict) if task == CLASSIFIER else ("encoder_only", bool)
    for key, kind in (("training", dict), ("weights", str), (own[0], own[1]), ("sha256", dict)):
        if not isinstance(meta.get(key), kind):
            raise bad_export(path, f"{CONFIG_FILE} has no valid '{key}' entry", task)
    if meta["weights"] not in WEIGHT_KINDS:
        raise bad_export(path, f"{CONFIG_FILE} names weights '{meta['weights'][:40]}' (not ema or raw)", task)
    digest = meta["sha256"].get(WEIGHTS_FILE)
    if not isinstance(digest, str) or len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        raise bad_export(
            path,
            f"{CONFIG_FILE} names no SHA-256 of {WEIGHTS_FILE} (its 'sha256' entry), so the weights cannot be checked",
            task,
        )
    check_training_record(meta["training"], path)
    return meta


def _is_number(v: Any) -> bool:
    """An int or a float (not a bool) that a float can hold, as a figure of a run is (NaN and inf
    included: a validation without non-empty patches has no acc_nonempty, a run before its first
    validation no best loss)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        float(v)
    except OverflowError:  # an integer past the largest float
        return False
    return True


def is_share(v: Any) -> bool:
    """A share: an int or a float (not a bool) in [0, 1] (NaN is not)."""
    return _is_number(v) and 0 <= v <= 1


def is_int64(v: Any) -> bool:
    """An int (not a bool) that torch's int64 holds."""
    return type(v) is int and INT_RANGE[0] <= v <= INT_RANGE[1]


def check_training_record(t: dict[str, Any], path: Path) -> None:
    """The run record of config.json (`training`): the entries the verbs read (the model card, the
    record a run from `--init` keeps) of the types vitmask writes, or one line naming the entry."""

    def bad(key: str, what: str) -> UserError:
        return bad_export(path, f"{CONFIG_FILE}: training.{key} is not {what}")

    step = t.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= INT_RANGE[1]):
        raise bad("step", f"a step (an integer in [0, {INT_RANGE[1]}])")
    for key in ("run_id", "source"):
        if t.get(key) is not None and not (isinstance(t[key], str) and len(t[key]) <= 4096):
            raise bad(key, "a string")
    for key in ("best_val_loss", "ema_decay"):
        if t.get(key) is not None and not _is_number(t[key]):
            raise bad(key, "a number")
    if t.get("foreground_share") is not None and not is_share(t["foreground_share"]):
        raise bad("foreground_share", "a share of pixels (a number in [0, 1])")
    val = t.get("val")
    if val is not None:
        rows = val.values() if isinstance(val, dict) else None
        if rows is None or not all(isinstance(row, dict) and all(_is_number(v) for v in row.values()) for row in rows):
            raise bad("val", "a table of numbers")
    init = t.get("init")
    if init is not None and not (
        isinstance(init, dict) and all(v is None or isinstance(v, str) or is_int64(v) for v in init.values())
    ):
        raise bad("init", "a record of where the run's weights came from")


# ---- an export dir's weights ------------------------------------------------------------------------
def sha256_of(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_export_weights(path: Path, meta: dict[str, Any], task: str = MASKED) -> dict[str, torch.Tensor]:
    """model.safetensors of an export dir, checked against config.json's SHA-256 (no pickle is read),
    every tensor fp32 as vitmask writes it and finite, as a checkpoint's weights must be."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise bad_export(path, f"{WEIGHTS_FILE} is missing", task)
    want = meta["sha256"].get(WEIGHTS_FILE)
    try:
        if sha256_of(file) != want:
            raise bad_export(
                path, f"{WEIGHTS_FILE} is not the file {CONFIG_FILE} was written with (its SHA-256 differs)", task
            )
        state = load_file(file, device="cpu")
    except (OSError, SafetensorError) as e:
        raise bad_export(path, f"{WEIGHTS_FILE} cannot be read ({str(e).splitlines()[0][:120]})", task) from None
    for key, tensor in state.items():
        if tensor.dtype != torch.float32:
            raise bad_export(
                path, f"{WEIGHTS_FILE} holds {key} as {tensor.dtype}, not the float32 vitmask writes", task
            )
    bad = checkpoint.first_non_finite({"model": state})
    if bad is not None:
        raise bad_export(path, f"{WEIGHTS_FILE} holds NaN or inf values ({bad}); it cannot be evaluated or used", task)
    return state


# ---- the files of one model -------------------------------------------------------------------------
def checkpoint_task(path: Path) -> str | None:
    """A .pt checkpoint's `task` ("finetune" for a classifier), read through a memory map (the tensors
    are not read); None for a masked-patch checkpoint or a file that cannot be read (its loader says why)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # anything torch raises for a file that is not a safe checkpoint
        return None
    task = state.get("task") if isinstance(state, dict) else None
    return task if isinstance(task, str) else None


def export_task(path: str | Path) -> str | None:
    """config.json's `task` of an export dir: "classifier" for a fine-tuned classifier, None for a
    masked-patch model, and None for a config.json that cannot be read (its loader says what is wrong)."""
    try:
        meta = read_config_json(Path(path))
    except UserError:
        return None
    task = meta.get("task") if isinstance(meta, dict) else None
    return task if isinstance(task, str) else None


def peek_task(path: str | Path) -> str:
    """What `path` holds, read cheaply (an export's config.json, a checkpoint's record list through
    a memory map): CLASSIFIER or MASKED (also for a file that cannot be read: its loader says why).
    A shipped model's name reads its package folder (`resolve_model_path`; an existing path wins)."""
    path = resolve_model_path(path)
    if is_export_dir(path):
        return CLASSIFIER if export_task(path) == CLASSIFIER_TASK else MASKED
    if path.is_file() and checkpoint_task(path) == CHECKPOINT_TASK:
        return CLASSIFIER
    return MASKED


class ModelFiles:
    """The files of one trained model, each read once (module docstring). Built by `open_model_files`."""

    def __init__(self, path: Path, kind: str, task: str, raw: dict[str, Any]):
        self.path = path
        self.kind = kind  # checkpoint | export
        self.task = task  # MASKED | CLASSIFIER
        self._raw = raw  # the checkpoint's dict, or config.json as parsed (its entries not checked yet)
        self._entries: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def is_export(self) -> bool:
        return self.kind == "export"

    @functools.cached_property
    def meta(self) -> dict[str, Any]:
        """A checkpoint's dict; an export's config.json, its entries checked for its task."""
        if not self.is_export:
            return self._raw
        return check_export_meta(self._raw, self.path, self.task)

    @functools.cached_property
    def config(self) -> Config:
        """The training config, built once; one line naming the file when this version cannot build it."""
        if not self.is_export:
            return checkpoint.config_of(self._raw, self.path)
        try:
            return config_from_dict(self.meta["training"]["config"])
        except (UserError, KeyError, TypeError, AttributeError) as e:
            raise bad_export(
                self.path, f"{CONFIG_FILE} holds a config this version cannot use ({e})", self.task
            ) from None

    @functools.cached_property
    def foreground_share(self) -> float | None:
        """The share of 1-pixels of the images the model trained on (`foreground_share` in a checkpoint,
        `training.foreground_share` in an export), None where the files record none; one line for a
        checkpoint whose value is not a share."""
        if self.is_export:
            return self.meta["training"].get("foreground_share")  # checked with the training record
        share = self._raw.get("foreground_share")
        if share is not None and not is_share(share):
            raise UserError(
                f"checkpoint {self.path} is damaged: its foreground_share is {str(share)[:40]}, not a number in "
                f"[0, 1]; {checkpoint.OTHER_CHECKPOINT}"
            )
        return share

    def config_with(self, overrides: list[str] | tuple[str, ...]) -> Config:
        """The training config with `overrides` applied (count-params)."""
        return config_from_dict(self.config.to_dict(), overrides) if overrides else self.config

    def weights_kind(self, weights: str | None, flag: str = "--weights") -> str:
        """Which weights `weights` (ema | raw | None: the EMA's where there are any) picks, refused in one
        line when the files do not hold them."""
        check_weights(weights, flag)
        if not self.is_export:
            return checkpoint_weights(self._raw, self.path, weights, flag)[1]
        held = self.meta["weights"]
        if weights is not None and weights != held:
            again = "--checkpoint FINETUNED.pt " if self.task == CLASSIFIER else ""
            raise UserError(
                f"{flag} {weights}: export dir {self.path} holds the {held} weights only; leave {flag} out, "
                f"or export again {again}with --weights {weights}"
            )
        return held

    def entry(self, kind: str) -> dict[str, torch.Tensor]:
        """The weights of `kind` (ema | raw) as a state dict; an export's model.safetensors is read and
        checked the first time."""
        if not self.is_export:
            return self._raw["ema" if kind == "ema" else "model"]
        if kind not in self._entries:
            self._entries[kind] = read_export_weights(self.path, self.meta, self.task)
        return self._entries[kind]

    def load_into(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load the chosen weights `state` into `model` (the model the files' config describes, built by
        the loader), then check that every weight entry the files hold fits it; one line for a misfit."""
        if self.is_export:
            try:
                checkpoint.load_model_state(model, state)
            except UserError as e:
                raise bad_export(self.path, f"{WEIGHTS_FILE} does not fit {CONFIG_FILE} ({e})", self.task) from None
            return
        try:
            checkpoint.load_model_state(model, state)
        except (RuntimeError, TypeError, ValueError) as e:  # entries of the right shape but not loadable
            raise checkpoint.describe_load_failure(e, self.path) from None
        checkpoint.check_weight_entries(model, self._raw, self.path)  # the entry not loaded, too


def open_model_files(path: str | Path) -> ModelFiles:
    """A checkpoint (read whole and checked: `checkpoint.load_checkpoint`) or an export dir (its
    config.json read with its guards; its entries and weights checked when first used). A shipped
    model's name reads its package folder (`resolve_model_path`; an existing path wins)."""
    path = resolve_model_path(path)
    if is_export_dir(path):
        raw = read_config_json(path)
        task = CLASSIFIER if isinstance(raw, dict) and raw.get("task") == CLASSIFIER_TASK else MASKED
        return ModelFiles(path, "export", task, raw)
    state = checkpoint.load_checkpoint(path)
    task = CLASSIFIER if state.get("task") == CHECKPOINT_TASK else MASKED
    return ModelFiles(path, "checkpoint", task, state)
