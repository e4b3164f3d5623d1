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
them, unless `weights="raw"`) or an export dir, each file read once and checked as it is read by
model_files.py, one line for anything wrong: config.json at most 1 MiB, nested at most 32 levels,
its integers convertible, its entries (the run's record too) of the types vitmask writes;
model.safetensors with the SHA-256 config.json names, every tensor float32 and finite, and
fitting the config. Both take the name of a model shipped with vitmask too (vitmask/pretrained:
an existing path wins). A checkpoint has both its weight entries checked, the one not loaded too. A
fine-tuned classifier (a `vitmask finetune` checkpoint, or an export whose config.json says
`"task": "classifier"`) is no masked-patch model: these loaders refuse it in one line, and
store/classifier.py loads and exports it.
"""

import dataclasses
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitmask import __version__, outputs
from vitmask.config import Config, dump_config
from vitmask.data.processor import ImageProcessor
from vitmask.errors import UserError
from vitmask.model.vit import MaskedPatchViT, build_model
from vitmask.outputs import missing_folders_made, nearest_folder, write_error
from vitmask.pretrained import check_model_arg, resolve_model_path
from vitmask.store import model_files
from vitmask.store.checkpoint import LoadedModel
from vitmask.store.model_files import (  # the format's names, read by model_files.py, written here
    CONFIG_FILE,
    FORMAT,
    WEIGHTS_FILE,
    check_weights,
    checkpoint_weights,
    sha256_of,
)

CARD_FILE = "README.md"
ONNX_FILE = "model.onnx"
BIT_ORDER = (
    "a patch's p*p pixels row by row, 1 = foreground; the first pixel is the most significant bit of its "
    "class: class = sum of pixel_i * 2^(p*p - 1 - i)"
)
CARD_METRICS = ("loss", "acc", "acc_nonempty", "bit_acc")


# ---- loading ------------------------------------------------------------------------------------
def is_export_dir(path: str | Path) -> bool:
    """A folder with a config.json or a model.safetensors: meant as an export dir (checked when read)."""
    return model_files.is_export_dir(path)


def drop_prediction_head(model: MaskedPatchViT) -> MaskedPatchViT:
    """The encoder alone: the decoder (where there is one) and the head removed, in place."""
    model.decoder = None
    model.head = None
    return model


def read_export_config(path: str | Path) -> dict[str, Any]:
    """config.json of an export dir, checked: read with `read_config_json`'s guards, this format, with
    its entries (`check_training_record` for the run's)."""
    path = Path(path)
    if not is_export_dir(path):
        model_files.read_config_json(path)  # says config.json is missing, as for any export dir
    return model_files.open_model_files(path).meta


def load_pretrained(path: str | Path, device: torch.device | str = "cpu") -> MaskedPatchViT:
    """The model of an export dir, in eval mode, on `device` (no pickle is read), with its
    preprocessing as `model.processor` (data/processor.py):

        import vitmask
        model = vitmask.load_pretrained("export/mnist")
        patches = model.processor(images).patches  # uint8 (B, H, W) gray images -> (B, N, P) 0/1 pixels
        logits = model(patches, mask)  # (B, N, P) pixels, (B, N) bool -> (B, N, C)

    `path` a str or os.PathLike, or the name of a model shipped with vitmask as a bare str
    (`vitmask.load_pretrained("mnist")`; a path such as `"./mnist"` or `Path("mnist")` is a path, and
    one that is not there is refused); `device` cpu, cuda, cuda:K or auto, checked before anything
    is read.
    """
    from vitmask.data.processor import check_path
    from vitmask.runtime.process import api_device

    check_path(path)
    check_model_arg(path, call="load_pretrained")  # a path never becomes a shipped model's name
    device = api_device(device)
    path = resolve_model_path(path)
    if not is_export_dir(path):
        model_files.read_config_json(path)  # says config.json is missing, as for any export dir
    loaded = load_model(path, device, need_head=False)
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
    unless `weights` is "raw") or an export dir, each file read once (model_files.py). `need_head`:
    refuse an encoder-only export. `flag`: the option that gave `weights`, as the messages name it.
    `state` is the checkpoint's dict, or an export's config.json with its config as `config`; either
    with `foreground_share`, the share of 1-pixels of the training images (None: not recorded)."""
    path = Path(path)
    check_weights(weights, flag)
    files = model_files.open_model_files(path)
    if files.task == model_files.CLASSIFIER:
        raise classifier_refused(files)
    kind = files.weights_kind(weights, flag)
    cfg = files.config
    state = files.entry(kind)
    model = build_model(cfg)
    encoder_only = files.is_export and files.meta["encoder_only"]
    if encoder_only:
        drop_prediction_head(model)
    files.load_into(model, state)
    if need_head and encoder_only:
        raise UserError(
            f"export dir {path} holds the encoder only (exported with --encoder-only), which cannot predict "
            "patches; pass a full export (vitmask export without --encoder-only) or the checkpoint"
        )
    record = {**files.meta, "config": cfg.to_dict()} if files.is_export else files.meta
    record = {**record, "foreground_share": files.foreground_share}  # checked, for exports and checkpoints alike
    return LoadedModel(model.to(device).eval(), cfg, record)


def loaded_weights(path: str | Path, state: dict[str, Any], weights: str | None) -> tuple[str, dict[str, Any]]:
    """Of a model `load_model(path, weights=weights)` loaded, with its `state`: which weights it holds
    (ema or raw) and the record of the run they come from (step, run id, figures)."""
    path = resolve_model_path(path)
    if is_export_dir(path):
        return state["weights"], state["training"]
    return checkpoint_weights(state, path, weights)[1], state


CLASSIFIER_USES = "vitmask predict, eval and export take it"


def classifier_refused(files: model_files.ModelFiles) -> UserError:
    """A fine-tuned classifier (its checkpoint or export) is no masked-patch model: one line that says so."""
    if files.is_export:
        return UserError(
            f"export dir {files.path} holds a fine-tuned classifier (vitmask finetune), not a masked-patch model "
            f"({CLASSIFIER_USES}); here pass the masked-patch export or checkpoint it was fine-tuned from"
        )
    return UserError(
        f"checkpoint {files.path} is a fine-tuned classifier (vitmask finetune), not a masked-patch model "
        f"({CLASSIFIER_USES}); here pass the checkpoint it was fine-tuned from, or resume the fine-tuning "
        "with vitmask finetune"
    )


def model_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of a checkpoint or an export dir, `overrides` applied (count-params)."""
    return model_files.open_model_files(path).config_with(overrides)


# ---- writing --------------------------------------------------------------------------------------
def check_out_dir(out: Path) -> outputs.FileId | None:
    """Refuse an --out that exists and holds files, is not a folder, or whose folder cannot be written.
    Returns the empty folder given (`outputs.file_id`), the only thing the export may replace, or None."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder; pass a new folder path")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out} already exists and holds files; nothing was written; pass a new or empty folder")
    parent = nearest_folder(out)  # missing folders above --out are made, as mkdir -p would
    if not parent.is_dir():
        raise UserError(f"the folder of --out {out} is a file ({parent}), not a folder; pick another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write into {parent} (permission denied); pick another --out")
    return outputs.file_id(out)


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
            "foreground_share": state.get("foreground_share"),  # of its training images (load_model checked it)
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


def write_export(
    model: nn.Module,
    cfg: Config,
    meta: dict[str, Any],
    out: Path,
    onnx: bool = False,
    replaces: outputs.FileId | None = None,
) -> list[Path]:
    """Write the export dir `out` through a temp dir beside it, moved into place; returns its files."""
    from vitmask.store.onnx_export import export_onnx

    return write_export_files(
        model,
        meta,
        out,
        lambda meta, params: model_card(meta, cfg, params),
        (lambda file: export_onnx(model, cfg, file)) if onnx else None,
        replaces,
    )


def write_export_files(
    model: nn.Module,
    meta: dict[str, Any],
    out: Path,
    card,
    write_onnx=None,
    replaces: outputs.FileId | None = None,
) -> list[Path]:
    """Write an export dir: the weights, config.json (`meta` and their SHA-256), the card
    (`card(meta, params)`) and, with `write_onnx(file)`, model.onnx; through a temp dir beside `out`,
    moved into place only where nothing stands (or the empty folder `replaces`, `check_out_dir`'s,
    still stands empty): anything else there is left as it is (`outputs.OutputTaken`). The missing
    folders above `out` are made, and removed again when the export fails. Returns its files."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with missing_folders_made(out):  # removed again when the export fails, after its temp dir
            try:
                _write_export_files(model, meta, tmp, out, card, write_onnx, replaces)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        raise write_error(e, out, "--out") from None
    return sorted(out.iterdir())


def _write_export_files(
    model: nn.Module, meta: dict[str, Any], tmp: Path, out: Path, card, write_onnx, replaces
) -> None:
    """write_export_files' work: every file into `tmp`, then `tmp` moved to `out`."""
    tmp.mkdir()
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_weights(tensors, tmp / WEIGHTS_FILE)
    meta = {**meta, "sha256": {WEIGHTS_FILE: sha256_of(tmp / WEIGHTS_FILE)}}
    (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")  # ASCII: JSON escapes
    params = sum(p.numel() for p in model.parameters())
    # UTF-8; a name that is not (a file name's undecodable bytes, held as lone surrogates) as escapes
    (tmp / CARD_FILE).write_text(card(meta, params), encoding="utf-8", errors="backslashreplace")
    if write_onnx is not None:
        write_onnx(tmp / ONNX_FILE)
    if replaces is not None and outputs.file_id(out) == replaces:
        try:
            out.rmdir()  # the empty folder given (it held nothing when checked)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise outputs.OutputTaken(out, "--out") from None  # files were put in it meanwhile
    try:
        outputs.rename_new(tmp, out)
    except FileExistsError:
        raise outputs.OutputTaken(out, "--out") from None


def export(
    path: str | Path, out: str | Path, weights: str | None = None, encoder_only: bool = False, onnx: bool = False
) -> dict[str, Any]:
    """`vitmask export`: a checkpoint (or an export dir) to the export dir `out`."""
    from vitmask.store.onnx_export import require_onnx

    path, out = Path(path), Path(out)
    check_weights(weights)
    replaces = check_out_dir(out)
    if onnx:
        require_onnx()
    model, cfg, state = load_model(path, "cpu", weights, need_head=not encoder_only)
    kind, record = loaded_weights(path, state, weights)  # record: step, run id, figures
    if encoder_only:
        drop_prediction_head(model)
    meta = export_metadata(cfg, kind, encoder_only, record, path)
    files = write_export(model, cfg, meta, out, onnx, replaces)
    return {"out": str(out), "weights": kind, "encoder_only": encoder_only, "files": [f.name for f in files]}
