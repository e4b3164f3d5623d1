"""Exported models: the folder a trained model leaves vitmask in, and the one loader every verb uses.

An export dir (`vitmask export --checkpoint X --out DIR`) holds:

- `model.safetensors`: the weights (fp32, safetensors: no pickle), the model's state dict;
- `config.json`: the model's constructor arguments (`model`, `num_patches`, `patch_dim`,
  `num_classes`, `fill`), the data keys a user needs to feed it (`data`: image size, patch size,
  threshold, invert, fit, bit order), the training config it came from, vitmask's version, the
  format version, which weights these are (`ema` or `raw`), whether the decoder and head were
  dropped (`encoder_only`), and the SHA-256 of the weights file. The layout is the one
  huggingface_hub's `PyTorchModelHubMixin` writes (weights beside a JSON of constructor arguments);
- `README.md`: a model card: the data, the command, the figures of the run when known;
- `model.onnx` with `--onnx` (onnx_export.py).

The dir is written beside its target under a temp name and renamed into place, so a failed export
leaves nothing; an `--out` that exists and holds files is refused.

Loading: `load_pretrained(DIR)` is the model in eval mode. `load_model(PATH, device, weights)` is
what every verb that takes `--checkpoint` calls: a `.pt` checkpoint (its EMA weights when it has
them, unless `weights="raw"`) or an export dir, checked file by file, one line for anything wrong.
Both take the name of a model shipped with vitmask too (vitmask/pretrained: an existing path wins).
The checks: config.json at most 1 MiB, nested at most 32 levels, its integers convertible, its entries (the
run's record too, `check_training_record`) of the types vitmask writes; model.safetensors with
the SHA-256 config.json names, every tensor float32 and finite, and fitting the config. A
checkpoint has both its weight entries checked, the one not loaded too (`check_weight_entries`).
A fine-tuned classifier (a `vitmask finetune` checkpoint, or an export whose config.json says
`"task": "classifier"`) is no masked-patch model: these loaders refuse it in one line, and
store/classifier.py loads and exports it.
"""

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitmask import __version__
from vitmask.config import INT_RANGE, MAX_CONFIG_BYTES, MAX_YAML_DEPTH, Config, config_from_dict, dump_config
from vitmask.data.processor import ImageProcessor
from vitmask.errors import UserError
from vitmask.model.vit import MaskedPatchViT, build_model
from vitmask.outputs import missing_folders_made, nearest_folder, write_error
from vitmask.pretrained import resolve_model_path
from vitmask.store import checkpoint
from vitmask.store.checkpoint import LoadedModel

FORMAT = "vitmask-export/1"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "README.md"
ONNX_FILE = "model.onnx"
WEIGHT_KINDS = ("ema", "raw")
BIT_ORDER = (
    "a patch's p*p pixels row by row, 1 = foreground; the first pixel is the most significant bit of its "
    "class: class = sum of pixel_i * 2^(p*p - 1 - i)"
)
CARD_METRICS = ("loss", "acc", "acc_nonempty", "bit_acc")


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


# ---- loading ------------------------------------------------------------------------------------
def is_export_dir(path: str | Path) -> bool:
    """A folder with a config.json or a model.safetensors: meant as an export dir (checked when read)."""
    p = Path(path)
    return p.is_dir() and ((p / CONFIG_FILE).exists() or (p / WEIGHTS_FILE).exists())


def drop_prediction_head(model: MaskedPatchViT) -> MaskedPatchViT:
    """The encoder alone: the decoder (where there is one) and the head removed, in place."""
    model.decoder = None
    model.head = None
    return model


def _bad_export(path: Path, what: str) -> UserError:
    return UserError(f"export dir {path}: {what}; export it again with vitmask export --checkpoint X --out DIR")


MAX_JSON_DEPTH = MAX_YAML_DEPTH  # nested objects and lists in config.json (one vitmask writes has 5)


def read_config_json(path: Path) -> Any:
    """config.json of the export dir `path`, parsed with every guard a hostile file needs: present, at
    most MAX_CONFIG_BYTES, JSON nested at most MAX_JSON_DEPTH levels, no integer past Python's limit on
    digits. One line (a UserError) for anything wrong; nothing about its entries is checked here."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise _bad_export(path, f"{CONFIG_FILE} is missing")
    try:
        size = file.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise _bad_export(
                path, f"{CONFIG_FILE} is {size:,} bytes, more than an export's may be ({MAX_CONFIG_BYTES:,})"
            )
        meta = json.loads(file.read_text())
    except RecursionError:  # json recurses once per level
        raise _bad_export(path, f"{CONFIG_FILE} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad_export(path, f"{CONFIG_FILE} cannot be read ({str(e).splitlines()[0][:120]})") from None
    except ValueError:  # Python's limit on converting text to integers
        raise _bad_export(
            path, f"{CONFIG_FILE} holds an integer of more than {sys.get_int_max_str_digits()} digits"
        ) from None
    if json_depth(meta) > MAX_JSON_DEPTH:
        raise _bad_export(path, f"{CONFIG_FILE} is nested more than {MAX_JSON_DEPTH} levels deep")
    return meta


def read_export_config(path: str | Path) -> dict[str, Any]:
    """config.json of an export dir, checked: read with `read_config_json`'s guards, this format, with
    its entries (`check_training_record` for the run's)."""
    path = Path(path)
    meta = read_config_json(path)
    found = meta.get("format") if isinstance(meta, dict) else None
    if not isinstance(found, str) or not found.startswith("vitmask-export/"):
        raise _bad_export(path, f"{CONFIG_FILE} is not a vitmask export's (no '{FORMAT}' format)")
    if found != FORMAT:
        raise UserError(
            f"export dir {path} was written by another version of vitmask (format {found[:40]}; this one reads "
            f"{FORMAT}); use that version, or export again with this one"
        )
    for key, kind in (("training", dict), ("weights", str), ("encoder_only", bool), ("sha256", dict)):
        if not isinstance(meta.get(key), kind):
            raise _bad_export(path, f"{CONFIG_FILE} has no valid '{key}' entry")
    if meta["weights"] not in WEIGHT_KINDS:
        raise _bad_export(path, f"{CONFIG_FILE} names weights '{meta['weights'][:40]}' (not ema or raw)")
    check_training_record(meta["training"], path)
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


def check_training_record(t: dict[str, Any], path: Path) -> None:
    """The run record of config.json (`training`): the entries the verbs read (the model card, the
    record a run from `--init` keeps) of the types vitmask writes, or one line naming the entry."""

    def bad(key: str, what: str) -> UserError:
        return _bad_export(path, f"{CONFIG_FILE}: training.{key} is not {what}")

    step = t.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= INT_RANGE[1]):
        raise bad("step", f"a step (an integer in [0, {INT_RANGE[1]}])")
    for key in ("run_id", "source"):
        if t.get(key) is not None and not (isinstance(t[key], str) and len(t[key]) <= 4096):
            raise bad(key, "a string")
    for key in ("best_val_loss", "ema_decay"):
        if t.get(key) is not None and not _is_number(t[key]):
            raise bad(key, "a number")
    val = t.get("val")
    if val is not None:
        rows = val.values() if isinstance(val, dict) else None
        if rows is None or not all(isinstance(row, dict) and all(_is_number(v) for v in row.values()) for row in rows):
            raise bad("val", "a table of numbers")
    init = t.get("init")
    if init is not None and not (
        isinstance(init, dict)
        and all(
            v is None or isinstance(v, str) or (type(v) is int and INT_RANGE[0] <= v <= INT_RANGE[1])
            for v in init.values()
        )
    ):
        raise bad("init", "a record of where the run's weights came from")


def export_config(meta: dict[str, Any], path: Path) -> Config:
    """The training config an export came from (its data keys are what the verbs read)."""
    try:
        return config_from_dict(meta["training"]["config"])
    except (UserError, KeyError, TypeError, AttributeError) as e:
        raise _bad_export(path, f"{CONFIG_FILE} holds a config this version cannot use ({e})") from None


def sha256_of(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_export_weights(path: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """model.safetensors of an export dir, checked against config.json's SHA-256 (no pickle is read),
    every tensor fp32 as vitmask writes it and finite, as a checkpoint's weights must be."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise _bad_export(path, f"{WEIGHTS_FILE} is missing")
    want = meta["sha256"].get(WEIGHTS_FILE)
    try:
        if sha256_of(file) != want:
            raise _bad_export(
                path, f"{WEIGHTS_FILE} is not the file {CONFIG_FILE} was written with (its SHA-256 differs)"
            )
        state = load_file(file, device="cpu")
    except (OSError, SafetensorError) as e:
        raise _bad_export(path, f"{WEIGHTS_FILE} cannot be read ({str(e).splitlines()[0][:120]})") from None
    for key, tensor in state.items():
        if tensor.dtype != torch.float32:
            raise _bad_export(path, f"{WEIGHTS_FILE} holds {key} as {tensor.dtype}, not the float32 vitmask writes")
    bad = checkpoint.first_non_finite({"model": state})
    if bad is not None:
        raise _bad_export(path, f"{WEIGHTS_FILE} holds NaN or inf values ({bad}); it cannot be evaluated or used")
    return state


def load_export(
    path: str | Path, device: torch.device | str = "cpu", weights: str | None = None, flag: str = "--weights"
) -> LoadedModel:
    """An export dir's model (eval mode, on `device`), its config and config.json as `state`."""
    path = Path(path)
    reject_classifier_export(path)
    check_weights(weights, flag)
    meta = read_export_config(path)
    if weights is not None and weights != meta["weights"]:
        raise UserError(
            f"{flag} {weights}: export dir {path} holds the {meta['weights']} weights only; leave {flag} out, "
            f"or export again with --weights {weights}"
        )
    cfg = export_config(meta, path)
    state = read_export_weights(path, meta)
    model = build_model(cfg)
    if meta["encoder_only"]:
        drop_prediction_head(model)
    try:
        checkpoint.load_model_state(model, state)
    except UserError as e:
        raise _bad_export(path, f"{WEIGHTS_FILE} does not fit {CONFIG_FILE} ({e})") from None
    return LoadedModel(model.to(device).eval(), cfg, {**meta, "config": cfg.to_dict()})


def load_pretrained(path: str | Path, device: torch.device | str = "cpu") -> MaskedPatchViT:
    """The model of an export dir, in eval mode, on `device` (no pickle is read), with its
    preprocessing as `model.processor` (data/processor.py):

    import vitmask
    model = vitmask.load_pretrained("export/mnist")
    patches = model.processor(images).patches  # uint8 (B, H, W) gray images -> (B, N, P) 0/1 pixels
    logits = model(patches, mask)  # (B, N, P) pixels, (B, N) bool -> (B, N, C)

    `path` a str or os.PathLike, or the name of a model shipped with vitmask
    (`vitmask.load_pretrained("mnist")`); `device` cpu, cuda, cuda:K or auto, checked before anything
    is read.
    """
    from vitmask.data.processor import check_path
    from vitmask.runtime.process import api_device

    check_path(path)
    device = api_device(device)
    loaded = load_export(resolve_model_path(path), device)
    loaded.model.processor = ImageProcessor.from_config(loaded.config)
    return loaded.model


def load_model(
    path: str | Path,
    device: torch.device | str = "cpu",
    weights: str | None = None,
    need_head: bool = True,
    flag: str = "--weights",
) -> LoadedModel:
    """The model behind a verb's `--checkpoint`: a .pt checkpoint (its EMA weights when it has them,
    unless `weights` is "raw") or an export dir, or a shipped model's name (`resolve_model_path`: an
    existing path wins). `need_head`: refuse an encoder-only export. `flag`: the option that gave
    `weights`, as the messages name it."""
    path = resolve_model_path(path)
    if is_export_dir(path):
        loaded = load_export(path, device, weights, flag)
        if need_head and loaded.model.head is None:
            raise UserError(
                f"export dir {path} holds the encoder only (exported with --encoder-only), which cannot predict "
                "patches; pass a full export (vitmask export without --encoder-only) or the checkpoint"
            )
        return loaded
    check_weights(weights, flag)
    state = checkpoint.load_checkpoint(path)
    reject_task_checkpoint(state, path)
    cfg = checkpoint.config_of(state, path)
    chosen, _ = checkpoint_weights(state, path, weights, flag)
    model = build_model(cfg)
    try:
        checkpoint.load_model_state(model, chosen)
    except (RuntimeError, TypeError, ValueError) as e:  # entries of the right shape but not loadable
        raise checkpoint.describe_load_failure(e, path) from None
    checkpoint.check_weight_entries(model, state, path)  # the entry not loaded, too
    return LoadedModel(model.to(device).eval(), cfg, state)


def loaded_weights(path: str | Path, state: dict[str, Any], weights: str | None) -> tuple[str, dict[str, Any]]:
    """Of a model `load_model(path, weights=weights)` loaded, with its `state`: which weights it holds
    (ema or raw) and the record of the run they come from (step, run id, figures)."""
    path = resolve_model_path(path)
    if is_export_dir(path):
        return state["weights"], state["training"]
    return checkpoint_weights(state, path, weights)[1], state


CLASSIFIER_TASK = "classifier"  # config.json's `task` of a fine-tuned classifier's export (store/classifier.py)
CLASSIFIER_USES = "vitmask predict, eval and export take it"


def reject_task_checkpoint(state: dict[str, Any], path: Path) -> None:
    """A fine-tuned classifier's checkpoint is no masked-patch model: one line that says so."""
    if state.get("task") == "finetune":
        raise UserError(
            f"checkpoint {path} is a fine-tuned classifier (vitmask finetune), not a masked-patch model "
            f"({CLASSIFIER_USES}); here pass the checkpoint it was fine-tuned from, or resume the fine-tuning "
            "with vitmask finetune"
        )


def export_task(path: str | Path) -> str | None:
    """config.json's `task` of an export dir: "classifier" for a fine-tuned classifier, None for a
    masked-patch model, and None for a config.json that cannot be read (its loader says what is wrong)."""
    try:
        meta = read_config_json(Path(path))
    except UserError:
        return None
    task = meta.get("task") if isinstance(meta, dict) else None
    return task if isinstance(task, str) else None


def reject_classifier_export(path: Path) -> None:
    """A fine-tuned classifier's export dir is no masked-patch model: one line that says so."""
    if export_task(path) == CLASSIFIER_TASK:
        raise UserError(
            f"export dir {path} holds a fine-tuned classifier (vitmask finetune), not a masked-patch model "
            f"({CLASSIFIER_USES}); here pass the masked-patch export or checkpoint it was fine-tuned from"
        )


def model_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of a checkpoint or an export dir (or a shipped model's name), `overrides` applied (count-params)."""
    path = resolve_model_path(path)
    if is_export_dir(path):
        return config_from_dict(export_config(read_export_config(Path(path)), Path(path)).to_dict(), overrides)
    return checkpoint.checkpoint_config(path, overrides)


# ---- writing --------------------------------------------------------------------------------------
def check_out_dir(out: Path) -> None:
    """Refuse an --out that exists and holds files, is not a folder, or whose folder cannot be written."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder; pass a new folder path")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out} already exists and holds files; nothing was written; pass a new or empty folder")
    parent = nearest_folder(out)  # missing folders above --out are made, as mkdir -p would
    if not parent.is_dir():
        raise UserError(f"the folder of --out {out} is a file ({parent}), not a folder; pick another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write into {parent} (permission denied); pick another --out")


def encoder_metadata(cfg: Config) -> dict[str, Any]:
    """The part of config.json that rebuilds the network and its preprocessing: MaskedPatchViT's
    constructor arguments and the data keys that turn an image into patches."""
    d = cfg.data
    return {
        "model": dataclasses.asdict(cfg.model),
        "num_patches": d.num_patches,
        "patch_dim": d.patch_dim,
        "num_classes": d.num_classes,
        "fill": cfg.mask.fill,
        "data": {
            "image_size": d.image_size,
            "patch_size": d.patch_size,
            "threshold": d.threshold,
            "invert": d.invert,
            "fit": d.fit,
            "bit_order": BIT_ORDER,
        },
    }


def export_metadata(cfg: Config, kind: str, encoder_only: bool, state: dict[str, Any], source: Path) -> dict:
    return {
        "format": FORMAT,
        "vitmask_version": __version__,
        "weights": kind,
        "encoder_only": encoder_only,
        **encoder_metadata(cfg),
        "training": {
            "config": cfg.to_dict(),
            "step": state.get("step"),
            "run_id": state.get("run_id"),
            "source": str(source),
            "ema_decay": cfg.train.ema_decay,
            "best_val_loss": state.get("best_val_loss"),
            "val": state.get("val") if isinstance(state.get("val"), dict) else None,
            "init": state.get("init") if isinstance(state.get("init"), dict) else None,  # train --init's source
        },
    }


def model_card(meta: dict[str, Any], cfg: Config, params: int) -> str:
    """README.md of an export: what the model is, what it was trained on and how, and its figures."""
    d, m, t = cfg.data, cfg.model, meta["training"]
    source = {"torchvision": f"torchvision {d.name}", "shapes": "vitmask's built-in shapes"}.get(d.source, d.source)
    where = "" if d.source == "shapes" else f" from `{d.path}`"
    what = "the encoder only (no decoder, no head)" if meta["encoder_only"] else "the whole model"
    weights = f"the EMA of the weights (decay {t['ema_decay']})" if meta["weights"] == "ema" else "the trained weights"
    lines = [
        f"# {cfg.name}: a vitmask masked-patch vision transformer",
        "",
        f"Trained by vitmask {meta['vitmask_version']} on {source}{where}: {d.image_size}x{d.image_size} binary "
        f"images (fit {d.fit}, threshold {d.threshold}, invert {str(d.invert).lower()}), cut into "
        f"{d.patch_size}x{d.patch_size} patches, {d.num_classes} token classes; step {t['step']} of "
        f"{cfg.train.max_steps}.",
        "",
        f"- Weights: {weights}, {what}, {params:,} parameters, fp32, in `{WEIGHTS_FILE}`.",
        f"- Model: depth {m.depth}, width {m.hidden_dim}, {m.num_heads} heads, FFN {m.ffn_dim}, positions {m.pos}, "
        f"decoder {m.decoder}; `{CONFIG_FILE}` holds every argument.",
        f"- Trained with: `vitmask train --config config.yaml`, config.yaml being the config below "
        f"(run id {t['run_id']}).",
        "",
        "## Figures of the run",
        "",
    ]
    init = t.get("init")
    if isinstance(init, dict):  # the run began with train --init
        started = f"- Started from: the {init.get('weights')} weights of the {init.get('kind')} `{init.get('path')}`."
        lines.insert(lines.index("## Figures of the run") - 1, started)
    val = t.get("val") or {}
    if val:
        lines += [f"Validation at the last evaluation (masked patches at ratio {cfg.mask.ratio}):", ""]
        lines += ["| weights | " + " | ".join(CARD_METRICS) + " |", "|---|" + "---:|" * len(CARD_METRICS)]
        for name, row in val.items():
            lines.append(f"| {name} | " + " | ".join(f"{row.get(k, float('nan')):.4f}" for k in CARD_METRICS) + " |")
        lines.append("")
    if isinstance(t.get("best_val_loss"), (int, float)):
        lines.append(f"Best validation loss: {t['best_val_loss']:.4f} nats per masked patch.")
    if not val and not isinstance(t.get("best_val_loss"), (int, float)):
        lines.append("Not recorded in the checkpoint; measure it with `vitmask eval --checkpoint DIR`.")
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "import vitmask",
        'model = vitmask.load_pretrained("DIR")  # eval mode, on the CPU; no pickle is read',
        "patches = model.processor(images).patches  # uint8 (B, H, W) gray images -> (B, N, P) 0/1 pixels",
        "logits = model(patches, mask)  # (B, N, P) 0/1 pixels, (B, N) bool True = hidden -> (B, N, C)",
        "```",
        "",
        f"Pixels of a patch: {BIT_ORDER}. Every verb that takes `--checkpoint` takes this folder too.",
        "",
        "## Config",
        "",
        "```yaml",
        dump_config(cfg).rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def save_weights(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """model.safetensors; a failed write (a full disk) is the OSError it was, which safetensors'
    writer reports as a SafetensorError whose text ends in "(os error N)"."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, file, metadata={"format": "pt", "vitmask": FORMAT})
    except SafetensorError as e:
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code) if code else str(e), str(file)) from None


def write_export(model: nn.Module, cfg: Config, meta: dict[str, Any], out: Path, onnx: bool = False) -> list[Path]:
    """Write the export dir `out` through a temp dir beside it, renamed into place; returns its files."""
    from vitmask.store.onnx_export import export_onnx

    return write_export_files(
        model,
        meta,
        out,
        lambda meta, params: model_card(meta, cfg, params),
        (lambda file: export_onnx(model, cfg, file)) if onnx else None,
    )


def write_export_files(model: nn.Module, meta: dict[str, Any], out: Path, card, write_onnx=None) -> list[Path]:
    """Write an export dir: the weights, config.json (`meta` and their SHA-256), the card
    (`card(meta, params)`) and, with `write_onnx(file)`, model.onnx; through a temp dir beside `out`,
    renamed into place. Returns its files."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with missing_folders_made(out):  # removed again when the export fails, after its temp dir
            try:
                _write_export_files(model, meta, tmp, out, card, write_onnx)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        raise write_error(e, out, "--out") from None
    return sorted(out.iterdir())


def _write_export_files(model: nn.Module, meta: dict[str, Any], tmp: Path, out: Path, card, write_onnx) -> None:
    """write_export_files' work: every file into `tmp`, then `tmp` renamed to `out`."""
    tmp.mkdir()
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_weights(tensors, tmp / WEIGHTS_FILE)
    meta = {**meta, "sha256": {WEIGHTS_FILE: sha256_of(tmp / WEIGHTS_FILE)}}
    (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    params = sum(p.numel() for p in model.parameters())
    (tmp / CARD_FILE).write_text(card(meta, params))
    if write_onnx is not None:
        write_onnx(tmp / ONNX_FILE)
    if out.is_dir():
        out.rmdir()  # empty: checked before the work
    os.replace(tmp, out)


def export(
    path: str | Path, out: str | Path, weights: str | None = None, encoder_only: bool = False, onnx: bool = False
) -> dict[str, Any]:
    """`vitmask export`: a checkpoint (or an export dir) to the export dir `out`."""
    from vitmask.store.onnx_export import require_onnx

    path, out = Path(path), Path(out)
    check_weights(weights)
    check_out_dir(out)
    if onnx:
        require_onnx()
    model, cfg, state = load_model(path, "cpu", weights, need_head=not encoder_only)
    kind, record = loaded_weights(path, state, weights)  # record: step, run id, figures
    if encoder_only:
        drop_prediction_head(model)
    meta = export_metadata(cfg, kind, encoder_only, record, path)
    files = write_export(model, cfg, meta, out, onnx)
    return {"out": str(out), "weights": kind, "encoder_only": encoder_only, "files": [f.name for f in files]}
