"""Fine-tuned classifiers on disk: a `vitmask finetune` checkpoint or a classifier's export dir,
loaded as one thing (`load_classifier_model`), and exported (`export_classifier`).

A fine-tuning checkpoint (`task: finetune`) holds the classifier's state dict (model/classifier.py:
`encoder.*`, `norm.*`, `head.*`; its EMA's too when the run kept one), the config it was trained
with (the pretrained model's `model` and `mask` sections, the fine-tuning's `data`, `train` and
`finetune`) and its classes (`labels`: the label value and name of each class index).

A classifier's export dir (`vitmask export --checkpoint FINETUNED.pt --out DIR`) holds the files of a
masked-patch export (export.py), written the same way (a temp dir renamed into place; an `--out`
that holds files is refused):

- `model.safetensors`: the classifier's state dict, fp32 (no pickle);
- `config.json`: `"task": "classifier"`, the format and vitmask's version, which weights (`ema` or
  `raw`), the encoder's constructor arguments (`model`, `num_patches`, `patch_dim`, `num_classes`
  (token classes), `fill`), the preprocessing (`data`: image_size, patch_size, threshold, invert,
  fit, bit_order), `classifier` (pool, grid, the feature width, and `classes`: index, label value
  and name of each), the run it came from (`training`: its config, step, run id, figures, the
  pretrained model it started from, `foreground_share`: the share of 1-pixels of its training
  images, where the checkpoint records it) and the SHA-256 of the weights;
- `README.md`: a model card: the classes, the data, the figures of the run, how to use it;
- `model.onnx` with `--onnx` (onnx_export.py): `images` (B, S, S) 0/1 pixels in, `logits` (B, L) out.

`load_classifier_model(PATH)` reads either (a checkpoint's EMA weights when it has them, unless
`weights="raw"`) through model_files.py, the reader of every trained model's files (each file read
once, checked as export.py's loader checks it, every weight entry a checkpoint holds checked to fit,
the trained weights and the EMA's), refuses a masked-patch model in one line (fine-tune it first),
and builds the classifier with its classes on top: a checkpoint's head of at least one row and its
`labels` entry, an export's `classifier.classes`; label values are integers in int64, each once,
and names any text. A shipped classifier's name reads its package folder
(vitmask/pretrained; an existing path wins).

Shapes: L label classes, S image side.
"""

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vitmask import __version__
from vitmask.config import Config, dump_config
from vitmask.errors import UserError
from vitmask.model.classifier import Classifier, build_classifier
from vitmask.model.pooling import feature_name
from vitmask.store import checkpoint, model_files
from vitmask.store import export as exports
from vitmask.store.export import BIT_ORDER, ONNX_FILE
from vitmask.store.model_files import CLASSIFIER_TASK, CONFIG_FILE, FORMAT, WEIGHTS_FILE, check_weights

CHECKPOINT_TASK = model_files.CHECKPOINT_TASK  # a fine-tuning checkpoint's `task` (train/finetune.py)
MAX_CARD_NAMES = 20  # classes named in the card's first paragraph; config.json names them all


@dataclasses.dataclass(frozen=True)
class ClassLabels:
    """The classes of a classifier, in the order of its logits."""

    values: list[int]  # the label value (in the source's labels) of each class index
    names: list[str]  # the name of each class index (the value as text where the source has no names)

    def __len__(self) -> int:
        return len(self.values)

    def entries(self) -> list[dict[str, Any]]:
        return [
            {"index": i, "label": v, "name": n} for i, (v, n) in enumerate(zip(self.values, self.names, strict=True))
        ]


class LoadedClassifier(NamedTuple):
    model: Classifier  # in eval mode, on the device asked for
    config: Config
    classes: ClassLabels
    weights: str  # ema | raw
    record: dict[str, Any]  # the run it came from: step, run_id, val, best_val_loss, pretrained, ema_decay,
    # foreground_share (None where the files record none)


# ---- which file is a classifier ---------------------------------------------------------------------
def is_classifier(path: str | Path) -> bool:
    """Whether `path` is a fine-tuned classifier: a fine-tuning checkpoint or a classifier's export dir
    (read cheaply: an export's config.json, a checkpoint through a memory map)."""
    return model_files.peek_task(path) == model_files.CLASSIFIER


def not_a_classifier(path: Path) -> UserError:
    return UserError(
        f"{path} is a masked-patch model (vitmask train), not a fine-tuned classifier; fine-tune it on labels "
        f"first: vitmask finetune --checkpoint {path} --config configs/finetune-mnist.yaml, then pass the "
        "fine-tuning's checkpoint (runs/<name>-finetune/last.pt) or its export"
    )


# ---- loading -----------------------------------------------------------------------------------------
def load_classifier_model(
    path: str | Path, device: torch.device | str = "cpu", weights: str | None = None, flag: str = "--weights"
) -> LoadedClassifier:
    """The classifier of a fine-tuning checkpoint or a classifier's export dir, in eval mode on `device`.
    `weights` ema | raw picks a checkpoint's (default: the EMA's when it has them). Each file is read
    once (model_files.py), and every weight entry it holds is checked to fit the classifier."""
    path = Path(path)
    check_weights(weights, flag)
    files = model_files.open_model_files(path)
    if files.task != model_files.CLASSIFIER:
        raise not_a_classifier(path)
    kind = files.weights_kind(weights, flag)
    cfg = files.config
    state = files.entry(kind)
    if files.is_export:
        classes = export_classes(files.meta, path)
        record = {**files.meta["training"], "foreground_share": files.foreground_share}
    else:
        classes = checkpoint_classes(files.meta.get("labels"), head_rows(state, path), path)
        record = {**checkpoint_record(files.meta, cfg), "foreground_share": files.foreground_share}
    model = new_classifier(cfg, len(classes))
    files.load_into(model, state)
    model.to(device).eval()
    return LoadedClassifier(model, cfg, classes, kind, record)


def head_rows(state: dict[str, torch.Tensor], path: Path) -> int:
    """The classes of a checkpoint's classifier: the rows of its head's weight (at least one)."""
    head = state.get("head.weight")
    if not torch.is_tensor(head) or head.dim() != 2:
        raise UserError(
            f"checkpoint {path} is damaged: its classifier has no head weights; {checkpoint.OTHER_CHECKPOINT}"
        )
    if head.shape[0] < 1:
        raise UserError(
            f"checkpoint {path} is damaged: its classifier's head has {head.shape[0]} rows, so it has no class; "
            f"{checkpoint.OTHER_CHECKPOINT}"
        )
    return head.shape[0]


def checkpoint_record(state: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """The run a fine-tuning checkpoint comes from: step, run id, figures, the pretrained model (the
    foreground share of its training images: ModelFiles.foreground_share, which checks it)."""
    return {
        "step": state.get("step"),
        "run_id": state.get("run_id"),
        "val": state.get("val") if isinstance(state.get("val"), dict) else None,
        "best_val_loss": state.get("best_val_loss"),
        "pretrained": state.get("pretrained"),
        "ema_decay": cfg.train.ema_decay,
    }


def checkpoint_classes(entry: Any, count: int, path: Path | None = None) -> ClassLabels:
    """A checkpoint's `labels` entry as ClassLabels for `count` classes (the head's rows); a checkpoint
    without one numbers its classes 0..count-1. An entry that is there must fit (`check_classes`)."""
    if entry is None:
        return ClassLabels(list(range(count)), [str(i) for i in range(count)])
    values = entry.get("values") if isinstance(entry, dict) else None
    names = entry.get("names") if isinstance(entry, dict) else None
    problem = check_classes(values, names, count)
    if problem:
        raise UserError(f"checkpoint {path} is damaged: its 'labels' entry {problem}; {checkpoint.OTHER_CHECKPOINT}")
    return ClassLabels(values, names)


def check_classes(values: Any, names: Any, count: int) -> str:
    """What is wrong with a classifier's classes, or "": `count` label values, each an integer in int64
    (not a bool) and each once, and `count` names, each a string (any string: see predictions.py)."""
    if not isinstance(values, list) or not isinstance(names, list):
        return "is not a list of label values and a list of names"
    if len(values) != count or len(names) != count:
        return f"holds {len(values)} label values and {len(names)} names for a head of {count} classes"
    bad = next((v for v in values if not model_files.is_int64(v)), None)
    if bad is not None:
        return f"holds the label {str(bad)[:40]}, not an integer in [-2^63, 2^63 - 1]"
    if len(set(values)) != len(values):
        return "holds a label value twice"
    if not all(isinstance(n, str) for n in names):
        return "holds a class name that is not text"
    return ""


def new_classifier(cfg: Config, num_labels: int) -> Classifier:
    """The classifier of `cfg`, built without touching the global RNG (its weights are loaded next)."""
    with torch.random.fork_rng(devices=[]):
        return build_classifier(cfg, num_labels)


def _bad(path: Path, what: str) -> UserError:
    return model_files.bad_export(path, what, model_files.CLASSIFIER)


def export_classes(meta: dict[str, Any], path: Path) -> ClassLabels:
    """config.json's classifier.classes as ClassLabels: index i, a label value (an integer in int64,
    each once) and a name each, at least one class."""
    entries = meta["classifier"].get("classes")
    ok = isinstance(entries, list) and bool(entries) and all(isinstance(e, dict) for e in entries)
    ok = ok and all(e.get("index") == i and not isinstance(e.get("index"), bool) for i, e in enumerate(entries))
    if not ok:
        raise _bad(path, f"{CONFIG_FILE} has no valid classifier.classes (index, label and name of each class)")
    values, names = [e.get("label") for e in entries], [e.get("name") for e in entries]
    problem = check_classes(values, names, len(entries))
    if problem:
        raise _bad(path, f"{CONFIG_FILE}: classifier.classes {problem}")
    return ClassLabels(values, names)


# ---- export ------------------------------------------------------------------------------------------
def classifier_metadata(loaded: LoadedClassifier, source: Path) -> dict[str, Any]:
    """config.json of a classifier's export (the SHA-256 of the weights is added when they are written)."""
    cfg, model = loaded.config, loaded.model
    features = model.norm.normalized_shape[0]
    record = loaded.record
    return {
        "format": FORMAT,
        "task": CLASSIFIER_TASK,
        "vitmask_version": __version__,
        "weights": loaded.weights,
        "encoder_only": False,  # the whole classifier: encoder, norm and head
        **exports.encoder_metadata(cfg),  # the encoder's constructor arguments and the preprocessing
        "classifier": {
            "pool": cfg.finetune.pool,
            "grid": model.grid,
            "features": features,
            "num_labels": len(loaded.classes),
            "classes": loaded.classes.entries(),
        },
        "training": {
            "config": cfg.to_dict(),
            "step": record.get("step"),
            "run_id": record.get("run_id"),
            "source": str(source),
            "pretrained": record.get("pretrained"),
            "ema_decay": cfg.train.ema_decay,
            "best_val_loss": record.get("best_val_loss"),
            "val": record.get("val") if isinstance(record.get("val"), dict) else None,
            "foreground_share": record.get("foreground_share"),
        },
    }


def classifier_card(meta: dict[str, Any], cfg: Config, params: int, onnx: bool) -> str:
    """README.md of a classifier's export: what it classifies, from what, how well, and how to use it."""
    d, m, t, c = cfg.data, cfg.model, meta["training"], meta["classifier"]
    source = {"torchvision": f"torchvision {d.name}", "shapes": "vitmask's built-in shapes"}.get(d.source, d.source)
    where = "" if d.source == "shapes" else f" from `{d.path}`"
    names = [e["name"] for e in c["classes"]]
    shown = ", ".join(names[:MAX_CARD_NAMES]) + (
        f" and {len(names) - MAX_CARD_NAMES} more" if len(names) > MAX_CARD_NAMES else ""
    )
    weights = f"the EMA of the weights (decay {t['ema_decay']})" if meta["weights"] == "ema" else "the trained weights"
    pooled = feature_name(None, c["grid"], d.grid)
    lines = [
        f"# {cfg.name}: a vitmask image classifier",
        "",
        f"Fine-tuned by vitmask {meta['vitmask_version']} on {source}{where}: {d.image_size}x{d.image_size} binary "
        f"images (fit {d.fit}, threshold {d.threshold}, invert {str(d.invert).lower()}) in {d.patch_size}x"
        f"{d.patch_size} patches, {len(names)} classes: {shown}; step {t['step']} of {cfg.train.max_steps}.",
        "",
        f"- Weights: {weights}, {params:,} parameters, fp32, in `{WEIGHTS_FILE}`.",
        f"- Model: a masked-patch encoder (depth {m.depth}, width {m.hidden_dim}, {m.num_heads} heads, FFN "
        f"{m.ffn_dim}, positions {m.pos}), its {pooled} ({c['features']} features), a LayerNorm and a linear head "
        f"of {len(names)} classes; `{CONFIG_FILE}` holds every argument and each class's index, label and name.",
        f"- Fine-tuned from: `{t.get('pretrained')}`, with `vitmask finetune --checkpoint PRETRAINED --config "
        f"config.yaml`, config.yaml being the config below (run id {t['run_id']}).",
        "",
        "## Figures of the run",
        "",
    ]
    val = t.get("val") or {}
    if val:
        lines += ["Validation at the last evaluation:", "", "| weights | loss | accuracy | majority class |"]
        lines.append("|---|---:|---:|---:|")
        for name, row in val.items():
            figures = [row.get(k, float("nan")) for k in ("loss", "acc", "majority_acc")]
            lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for v in figures) + " |")
        lines.append("")
    lines.append("Score it on its test split: `vitmask eval --checkpoint DIR --split test --confusion confusion.png`.")
    lines += [
        "",
        "## Use",
        "",
        "```bash",
        "vitmask predict --checkpoint DIR --input images/ --out predictions.csv --top-k 3",
        "```",
        "",
        "```python",
        "import vitmask",
        'classifier = vitmask.load_classifier("DIR")  # eval mode, on the CPU; no pickle is read',
        "top = classifier.predict(images, top_k=3)  # uint8 (H, W) or (B, H, W) arrays, tensors, PIL images, paths",
        "top.names, top.probabilities  # per image: the 3 likeliest classes' names and probabilities",
        "```",
        "",
        f"Images go through the preprocessing it was trained with (`data` in `{CONFIG_FILE}`): gray levels fitted "
        f"to {d.image_size}x{d.image_size} ({d.fit}), a pixel is foreground where its level is at least "
        f"{d.threshold} * 255{' (then inverted)' if d.invert else ''}; `classifier.processor` does it. "
        f"Pixels of a patch: {BIT_ORDER}.",
    ]
    if onnx:
        lines += [
            "",
            f"`{ONNX_FILE}`: input `images` (B, {d.image_size}, {d.image_size}) float 0/1 pixels (the processor's "
            f"`pixels`), output `logits` (B, {len(names)}).",
        ]
    lines += ["", "## Config", "", "```yaml", dump_config(cfg).rstrip(), "```", ""]
    return "\n".join(lines)


def export_classifier(
    path: str | Path, out: str | Path, weights: str | None = None, encoder_only: bool = False, onnx: bool = False
) -> dict[str, Any]:
    """`vitmask export` of a fine-tuned classifier (a fine-tuning checkpoint or a classifier's export)."""
    from vitmask.store.onnx_export import export_classifier_onnx, require_onnx

    path, out = Path(path), Path(out)
    check_weights(weights)
    if encoder_only:
        raise UserError(
            f"{path} is a fine-tuned classifier, which exports whole (encoder, norm and head); leave --encoder-only "
            "out, or export the masked-patch model it was fine-tuned from"
        )
    replaces = exports.check_out_dir(out)
    if onnx:
        require_onnx()
    loaded = load_classifier_model(path, "cpu", weights)
    meta = classifier_metadata(loaded, path)
    model, cfg = loaded.model, loaded.config
    files = exports.write_export_files(
        model,
        meta,
        out,
        lambda meta, params: classifier_card(meta, cfg, params, onnx),
        (lambda file: export_classifier_onnx(model, cfg, file)) if onnx else None,
        replaces,
    )
    return {
        "out": str(out),
        "weights": loaded.weights,
        "encoder_only": False,
        "classifier": True,
        "files": [f.name for f in files],
    }
