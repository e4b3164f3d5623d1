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
  pretrained model it started from) and the SHA-256 of the weights;
- `README.md`: a model card: the classes, the data, the figures of the run, how to use it;
- `model.onnx` with `--onnx` (onnx_export.py): `images` (B, S, S) 0/1 pixels in, `logits` (B, L) out.

`load_classifier_model(PATH)` reads either (a checkpoint's EMA weights when it has them, unless
`weights="raw"`), checks every file as export.py does, and refuses a masked-patch model in one
line (fine-tune it first).

Shapes: L label classes, S image side.
"""

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vitmask import __version__
from vitmask.config import Config, config_from_dict, dump_config
from vitmask.errors import UserError
from vitmask.model.classifier import Classifier, build_classifier
from vitmask.model.pooling import feature_name
from vitmask.store import checkpoint
from vitmask.store import export as exports
from vitmask.store.export import (
    BIT_ORDER,
    CLASSIFIER_TASK,
    CONFIG_FILE,
    FORMAT,
    ONNX_FILE,
    WEIGHT_KINDS,
    WEIGHTS_FILE,
)

CHECKPOINT_TASK = "finetune"  # a fine-tuning checkpoint's `task` (train/finetune.py)
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
    record: dict[str, Any]  # the run it came from: step, run_id, val, best_val_loss, pretrained, ema_decay


# ---- which file is a classifier ---------------------------------------------------------------------
def checkpoint_task(path: Path) -> str | None:
    """A .pt checkpoint's `task` ("finetune" for a classifier), read through a memory map (the tensors
    are not read); None for a masked-patch checkpoint or a file that cannot be read (its loader says why)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # anything torch raises for a file that is not a safe checkpoint
        return None
    task = state.get("task") if isinstance(state, dict) else None
    return task if isinstance(task, str) else None


def is_classifier(path: str | Path) -> bool:
    """Whether `path` is a fine-tuned classifier: a fine-tuning checkpoint or a classifier's export dir."""
    path = Path(path)
    if exports.is_export_dir(path):
        return exports.export_task(path) == CLASSIFIER_TASK
    return path.is_file() and checkpoint_task(path) == CHECKPOINT_TASK


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
    `weights` ema | raw picks a checkpoint's (default: the EMA's when it has them)."""
    path = Path(path)
    exports.check_weights(weights, flag)
    if exports.is_export_dir(path):
        loaded = load_classifier_export(path, weights, flag)
    else:
        loaded = load_classifier_checkpoint(path, weights, flag)
    loaded.model.to(device).eval()
    return loaded


def load_classifier_checkpoint(path: Path, weights: str | None, flag: str) -> LoadedClassifier:
    state = checkpoint.load_checkpoint(path)
    if state.get("task") != CHECKPOINT_TASK:
        raise not_a_classifier(path)
    cfg = checkpoint.config_of(state, path)
    chosen, kind = exports.checkpoint_weights(state, path, weights, flag)
    head = chosen.get("head.weight")
    if not torch.is_tensor(head) or head.dim() != 2:
        raise UserError(
            f"checkpoint {path} is damaged: its classifier has no head weights; {checkpoint.OTHER_CHECKPOINT}"
        )
    classes = checkpoint_classes(state.get("labels"), head.shape[0])
    model = new_classifier(cfg, len(classes))
    try:
        checkpoint.load_model_state(model, chosen)
    except (RuntimeError, TypeError, ValueError) as e:  # entries of the right shape but not loadable
        raise checkpoint.describe_load_failure(e, path) from None
    record = {
        "step": state.get("step"),
        "run_id": state.get("run_id"),
        "val": state.get("val") if isinstance(state.get("val"), dict) else None,
        "best_val_loss": state.get("best_val_loss"),
        "pretrained": state.get("pretrained"),
        "ema_decay": cfg.train.ema_decay,
    }
    return LoadedClassifier(model, cfg, classes, kind, record)


def checkpoint_classes(entry: Any, count: int) -> ClassLabels:
    """A checkpoint's `labels` entry as ClassLabels for `count` classes; a checkpoint without one (or
    with one that does not fit) numbers its classes 0..count-1."""
    if isinstance(entry, dict):
        values, names = entry.get("values"), entry.get("names")
        if (
            isinstance(values, list)
            and isinstance(names, list)
            and len(values) == len(names) == count
            and all(isinstance(v, int) for v in values)
            and all(isinstance(n, str) for n in names)
        ):
            return ClassLabels(values, names)
    return ClassLabels(list(range(count)), [str(i) for i in range(count)])


def new_classifier(cfg: Config, num_labels: int) -> Classifier:
    """The classifier of `cfg`, built without touching the global RNG (its weights are loaded next)."""
    with torch.random.fork_rng(devices=[]):
        return build_classifier(cfg, num_labels)


def _bad(path: Path, what: str) -> UserError:
    return UserError(
        f"export dir {path}: {what}; export it again with vitmask export --checkpoint FINETUNED.pt --out DIR"
    )


def read_classifier_config(path: Path) -> dict[str, Any]:
    """config.json of a classifier's export dir, checked: this format and task, with its entries."""
    meta = exports.read_config_json(path)
    if not isinstance(meta, dict) or meta.get("task") != CLASSIFIER_TASK:
        raise not_a_classifier(path)
    if meta.get("format") != FORMAT:
        raise UserError(
            f"export dir {path} was written by another version of vitmask (format {meta.get('format')}; this one "
            f"reads {FORMAT}); use that version, or export again with this one"
        )
    for key, kind in (("training", dict), ("weights", str), ("sha256", dict), ("classifier", dict)):
        if not isinstance(meta.get(key), kind):
            raise _bad(path, f"{CONFIG_FILE} has no valid '{key}' entry")
    if meta["weights"] not in WEIGHT_KINDS:
        raise _bad(path, f"{CONFIG_FILE} names weights '{meta['weights'][:40]}' (not ema or raw)")
    exports.check_training_record(meta["training"], path)
    return meta


def export_classes(meta: dict[str, Any], path: Path) -> ClassLabels:
    """config.json's classifier.classes as ClassLabels: index i, an integer label and a name each."""
    entries = meta["classifier"].get("classes")
    ok = isinstance(entries, list) and bool(entries) and all(isinstance(e, dict) for e in entries)
    if ok:
        ok = all(
            e.get("index") == i and isinstance(e.get("label"), int) and isinstance(e.get("name"), str)
            for i, e in enumerate(entries)
        )
    if not ok:
        raise _bad(path, f"{CONFIG_FILE} has no valid classifier.classes (index, label and name of each class)")
    return ClassLabels([e["label"] for e in entries], [e["name"] for e in entries])


def load_classifier_export(path: Path, weights: str | None, flag: str) -> LoadedClassifier:
    meta = read_classifier_config(path)
    if weights is not None and weights != meta["weights"]:
        raise UserError(
            f"{flag} {weights}: export dir {path} holds the {meta['weights']} weights only; leave {flag} out, "
            f"or export again with --weights {weights}"
        )
    try:
        cfg = config_from_dict(meta["training"]["config"])
    except (UserError, KeyError, TypeError, AttributeError) as e:
        raise _bad(path, f"{CONFIG_FILE} holds a config this version cannot use ({e})") from None
    classes = export_classes(meta, path)
    state = exports.read_export_weights(path, meta)
    model = new_classifier(cfg, len(classes))
    try:
        checkpoint.load_model_state(model, state)
    except UserError as e:
        raise _bad(path, f"{WEIGHTS_FILE} does not fit {CONFIG_FILE} ({e})") from None
    return LoadedClassifier(model, cfg, classes, meta["weights"], meta["training"])


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
    exports.check_weights(weights)
    if encoder_only:
        raise UserError(
            f"{path} is a fine-tuned classifier, which exports whole (encoder, norm and head); leave --encoder-only "
            "out, or export the masked-patch model it was fine-tuned from"
        )
    exports.check_out_dir(out)
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
    )
    return {
        "out": str(out),
        "weights": loaded.weights,
        "encoder_only": False,
        "classifier": True,
        "files": [f.name for f in files],
    }
