"""Checkpoints: plain data only, written atomically, read with `weights_only=True`.

A checkpoint is a dict of tensors, numbers, strings and nested dicts/lists: the model, optimizer,
scheduler and grad-scaler state dicts, the step, the best validation loss, every RNG state (the
data sampler's too) and the config as a dict. It is written to a temp file in the same folder,
flushed to disk, then moved over the target with `os.replace`, so a kill mid-write leaves the
previous file intact. Loading never unpickles code.

In a run dir, every checkpoint is `step_<step>.pt`; `last.pt` is a hard link to the newest one
(made atomically the same way) and only the newest `keep_last` step files are kept.
"""

import os
import re
from pathlib import Path
from typing import Any

import torch

from vitmask.errors import UserError

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
