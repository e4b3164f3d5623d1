"""Checkpoints: plain data only, written atomically, read with `weights_only=True`.

A checkpoint is a dict of tensors, numbers, strings and nested dicts/lists: the model and optimizer
state dicts, the step, the best validation loss, RNG states and the config as a dict. It is
written to a temp file in the same folder, flushed to disk, then moved over the target with
`os.replace`, so a kill mid-write leaves the previous file intact. Loading never unpickles code.
"""

import os
from pathlib import Path
from typing import Any

import torch

from vitmask.errors import UserError

FORMAT = "vitmask-checkpoint/1"


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
