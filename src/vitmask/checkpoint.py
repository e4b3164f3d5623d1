"""Checkpoints: plain data only, written atomically, read with `weights_only=True`.

A checkpoint is a dict of tensors, numbers, strings and nested dicts/lists: the model, optimizer,
scheduler and grad-scaler state dicts, the step, the best validation loss, every RNG state (the
data sampler's too) and the config as a dict. It is written to a temp file in the same folder,
flushed to disk, then moved over the target with `os.replace`, so a kill mid-write leaves the
previous file intact. Loading never unpickles code.

In a run dir, every checkpoint is `step_<step>.pt`; `last.pt` is a hard link to the newest one
(made atomically the same way) and only the newest `keep_last` step files are kept.

Every command that needs a checkpoint's model goes through `load_model`: read the file
(`load_checkpoint`), build its config, build the model, and load the weights with
`load_model_state` (compile prefix stripped, every key and shape checked). Resuming a run loads
the same way into the trainer's model (`Trainer.load_state_dict`).
"""

import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vitmask.config import Config, config_from_dict
from vitmask.errors import UserError
from vitmask.model import MaskedPatchViT, build_model

FORMAT = "vitmask-checkpoint/1"
COMPILE_PREFIX = "_orig_mod."  # what torch.compile's wrapper puts before every state-dict key
STEP_FILE = re.compile(r"step_(\d+)\.pt")


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def step_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"step_{step:07d}.pt"


def step_files(run_dir: str | Path) -> list[tuple[int, Path]]:
    """The run dir's step_*.pt files as (step, path), oldest first."""
    found = [(int(m.group(1)), p) for p in Path(run_dir).glob("step_*.pt") if (m := STEP_FILE.fullmatch(p.name))]
    return sorted(found)


def write_run_checkpoint(state: dict[str, Any], run_dir: str | Path, keep_last: int) -> Path:
    """Write step_<step>.pt, point last.pt at it, and delete all but the newest `keep_last` step files."""
    run_dir = Path(run_dir)
    path = save_checkpoint(state, step_path(run_dir, int(state["step"])))
    _link_atomically(path, run_dir / "last.pt")
    for _, old in step_files(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def _link_atomically(src: Path, dst: Path) -> None:
    """Make `dst` the same file as `src`: a hard link (a copy where links fail), then os.replace."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(src, tmp)
        except OSError:
            tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of a run dir: last.pt, else the highest step_*.pt, else None."""
    last = Path(run_dir) / "last.pt"
    if last.is_file():
        return last
    steps = step_files(run_dir)
    return steps[-1][1] if steps else None


def remove_stale_temps(run_dir: str | Path) -> list[Path]:
    """Delete temp files left by a process killed mid-save (never a finished checkpoint)."""
    stale = [p for p in Path(run_dir).glob(".*.pt.tmp-*") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def plain_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A model state dict without torch.compile's key prefix, so compiled and plain models share checkpoints."""
    return {(k[len(COMPILE_PREFIX) :] if k.startswith(COMPILE_PREFIX) else k): v for k, v in state.items()}


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a vitmask checkpoint, or raise a UserError that says what is wrong with the file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}; pass the last.pt (or another .pt) of a vitmask run dir")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for a file that is not a safe checkpoint
        reason = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise UserError(
            f"cannot read checkpoint {path} ({reason[:120]}); pass a .pt file written by vitmask train"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(
            f"{path} is not a vitmask checkpoint (no '{FORMAT}' marker); pass a .pt written by vitmask train"
        )
    for key in ("model", "config"):
        if key not in state:
            raise UserError(
                f"checkpoint {path} has no '{key}' entry; pass a complete checkpoint written by vitmask train"
            )
    return state


def check_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise a UserError naming the keys where `state` does not fit `model`."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append("shape mismatch: " + "; ".join(shapes[:4]))
        if missing:
            parts.append("missing: " + ", ".join(missing[:4]))
        if unexpected:
            parts.append("unexpected: " + ", ".join(unexpected[:4]))
        raise UserError(
            "checkpoint does not fit this model (" + " | ".join(parts) + "); resume with the config it was trained with"
        )


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a checkpoint's model state dict into `model`: compile prefix stripped, checked to fit."""
    state = plain_state_dict(state)
    check_model_state(model, state)
    model.load_state_dict(state)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a checkpoint's optimizer state, or raise a UserError when it does not fit this run."""
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as e:
        raise UserError(
            f"the checkpoint's optimizer state does not fit this run ({e}); resume with the config it was trained with"
        ) from None


def checkpoint_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config a checkpoint was trained with, `overrides` applied (no model is built)."""
    return config_from_dict(load_checkpoint(path)["config"], overrides)


class LoadedModel(NamedTuple):
    model: MaskedPatchViT  # in eval mode, on the device asked for
    config: Config
    state: dict[str, Any]  # the whole checkpoint, as read


def load_model(path: str | Path, device: torch.device | str = "cpu") -> LoadedModel:
    """The model of a checkpoint file, with its config and the raw checkpoint, ready to predict."""
    state = load_checkpoint(path)
    cfg = config_from_dict(state["config"])
    model = build_model(cfg)
    load_model_state(model, state["model"])
    return LoadedModel(model.to(device).eval(), cfg, state)
