"""The weights a new run starts from: `vitmask train --config C --init PATH [--init-weights ema|raw]`.

PATH is a full export dir (`vitmask export` without `--encoder-only`: the decoder and head are
trained on too), a shipped model's name (vitmask/pretrained: `mnist`, `shapes`) or a `.pt`
checkpoint of `vitmask train` (its EMA weights when it has them, its trained weights with
`--init-weights raw`). It is read by `export.load_model`, the loader of every
verb's `--checkpoint`, with every check of the files. The run itself is new: step 0, a new run id,
a fresh optimizer and schedule, its own run dir; only the model's weights (and the EMA's, which
starts as their copy) come from PATH.

On the very raw images the weights were trained on (the same source and path), the run follows
how they were made binary (data/binarization.py `follow_pretrained`: the weights' data.fit,
threshold, invert and image size over the config file's, in one note line; a contradicting `--set`
refused unless forced). The run's config must describe the same weights (`check_same_model`): the image and patch size,
`mask.fill`, and every `model` key except the few that leave the weights as they are
(`WEIGHT_FREE`: dropout, the attention implementation, an init that the loaded weights replace).
The first key that differs is one line naming it and the fix. Everything here runs before the run
dir is made, so a refusal writes nothing.

The run keeps where its weights came from (`InitWeights.record`: path, export or checkpoint, ema or
raw, the source's step and run id) in every checkpoint as `init`: a resume reads the weights from
its own checkpoint and needs no `--init`, and the record stays with the run.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vitmask.config import Config, flatten_config
from vitmask.data.binarization import Asked, Said, follow_pretrained
from vitmask.errors import UserError
from vitmask.pretrained import resolve_model_path
from vitmask.store import export as exports

# model keys the weights do not depend on: they may differ between the source and the new run
WEIGHT_FREE = ("model.dropout", "model.attention", "model.zero_init_residual")
INIT_FLAG = "--init-weights"


@dataclass
class InitWeights:
    """Weights a new run starts from: the model's state dict (CPU) and the record the run keeps."""

    state: dict[str, torch.Tensor]
    record: dict[str, Any]  # path, kind (export | checkpoint), weights (ema | raw), step, run_id
    config: Config | None = None  # the run's config, following the weights' binarization (`load_init`)
    said: Said = ()  # the lines that say what it took from them (binarization.tell)

    def describe(self) -> str:
        r = self.record
        return f"the {r['weights']} weights of {r['kind']} {r['path']} (step {r['step']} of its run)"


def check_flags(init: Path | None, weights: str | None, resume: str | None) -> None:
    """--init starts a new run, --resume continues one: never both; --init-weights needs --init."""
    if init is not None and resume is not None:
        raise UserError(
            "--init starts a new run from weights and --resume continues a run, so they cannot go together; "
            "drop --resume to start from the weights (a run started with --init resumes with --resume alone)"
        )
    if weights is not None and init is None:
        raise UserError(f"{INIT_FLAG} picks the weights of --init; pass --init PATH too, or drop {INIT_FLAG}")
    exports.check_weights(weights, INIT_FLAG)


def load_init(path: Path, cfg: Config, weights: str | None = None, asked: Asked | None = None) -> InitWeights:
    """The weights at `path` for a new run of `cfg` (`weights`: ema | raw, default the EMA's when there
    are any), checked to be the same model; a UserError in one line for anything wrong. `path` may name a
    shipped model (`resolve_model_path`: an existing path wins); the record keeps what the user passed.
    With `asked` (what the command line set), `cfg` follows the weights' binarization on the same raw
    images first (`follow_pretrained`); the config the run then has is the result's `config`."""
    given, path = Path(path), resolve_model_path(path)
    if not path.exists() and not path.is_symlink():
        raise UserError(
            f"--init {path} does not exist; pass an export dir written by vitmask export, a .pt checkpoint "
            "written by vitmask train, or a shipped model's name (vitmask models lists them)"
        )
    loaded = exports.load_model(path, "cpu", weights, need_head=True, flag=INIT_FLAG)
    said: Said = ()
    if asked is not None:
        cfg, said = follow_pretrained(cfg, loaded.config, f"the weights of --init {given}", asked)
    check_same_images(loaded.config, cfg, f"--init {given}")
    check_same_model(loaded.config, cfg, given)
    kind, source = exports.loaded_weights(path, loaded.state, weights)
    record = {
        "path": str(given),
        "kind": "export dir" if exports.is_export_dir(path) else "checkpoint",
        "weights": kind,
        "step": source.get("step"),
        "run_id": source.get("run_id"),
    }
    return InitWeights(loaded.model.state_dict(), record, cfg, said)


def check_same_images(trained: Config, asked: Config, what: str) -> None:
    """Refuse weights trained on another image or patch size than the config's (`what`: where they are)."""
    a, b = trained.data, asked.data
    if (a.image_size, a.patch_size) != (b.image_size, b.patch_size):
        raise UserError(
            f"{what} was trained on {a.image_size}x{a.image_size} images in {a.patch_size}-pixel "
            f"patches, but the config asks for {b.image_size}x{b.image_size} in {b.patch_size}-pixel patches; "
            f"set data.image_size={a.image_size} and data.patch_size={a.patch_size}, or use weights of that size"
        )


def weight_keys(cfg: Config) -> list[str]:
    """The config keys the weights depend on besides the image and patch size: mask.fill and the model's."""
    return ["mask.fill", *(k for k in flatten_config(cfg) if k.startswith("model.") and k not in WEIGHT_FREE)]


def check_same_model(trained: Config, asked: Config, path: Path) -> None:
    """Refuse a config whose model differs from the weights' in a key they depend on (the first one)."""
    old, new = flatten_config(trained), flatten_config(asked)
    for key in weight_keys(asked):
        if old[key] != new[key]:
            raise UserError(
                f"--init {path} holds a model with {key}={_value(old[key])}, but the config asks for "
                f"{key}={_value(new[key])}; the weights fit only their own model: pass --set {key}={_value(old[key])} "
                "(or a config with the same model section)"
            )


def _value(v: Any) -> str:
    """A config value as --set takes it."""
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)
