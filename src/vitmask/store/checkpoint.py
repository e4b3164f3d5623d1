"""Checkpoints: plain data only, written atomically, read with `weights_only=True`.

A checkpoint is a dict of tensors, numbers, strings and nested dicts/lists: the model, optimizer,
scheduler and grad-scaler state dicts, the step, the best validation loss, every RNG state (the
data sampler's too) and the config as a dict. It is written to a temp file in the same folder,
flushed to disk, then moved over the target with `os.replace`, so a kill mid-write leaves the
previous file intact. Loading never unpickles code.

In a run dir, every checkpoint is `step_<step>.pt`; `last.pt` is a hard link to the newest one
(made atomically the same way) and only the newest `keep_last` step files are kept.

A checkpoint holding a NaN or inf in its weights or optimizer state is never written, and is
refused when read (`first_non_finite`), so a diverged run cannot leave one behind for eval or
resume. A file that is a vitmask checkpoint but damaged or of another version (missing entries,
entries of the wrong type, a config this version cannot build) is refused with one line naming
the entry (`check_resumable` for what a resume needs beyond the model and config).

Every checkpoint carries a checksum, checked on every load (`verify_checksum`), so a file whose
bytes changed after it was written (a flipped bit on disk, a bad copy, an edit) is refused in one
line. torch.save writes a zip file whose records (the pickle and each tensor's bytes) already hold
their CRC-32; the rest of the file (every header, the record list, the end record) is covered by a
SHA-256 that vitmask stores in the zip's own comment field, which torch and every zip reader skip.
torch.save writes straight to the file; the save then maps the file into memory and hashes only
its headers and record list, never the tensors' bytes, so it costs little more than torch.save. A
load checks each record's CRC-32 and the SHA-256. A checkpoint from before the checksum loads with
one warning line (its records' CRC-32s are still checked).

Every command that needs a checkpoint's model goes through `load_model`: read the file
(`load_checkpoint`), build its config, build the model, and load the weights with
`load_model_state` (compile prefix stripped, every key and shape checked). Both weight entries
are checked, whichever one is loaded: the trained weights and, where the run kept an EMA, the EMA's
(`check_weight_entries`), so a checkpoint whose other entry is damaged is refused by eval as it
would be by a resume. Resuming a run loads the same way into the trainer's model
(`Trainer.load_state_dict`).
"""

import contextlib
import hashlib
import io
import mmap
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vitmask.config import Config, config_from_dict
from vitmask.errors import UserError, warn
from vitmask.model.vit import MaskedPatchViT, build_model
from vitmask.outputs import REPLACE_ANY, check_not_a_link_loop, open_new, os_error_in, write_atomically, write_error

FORMAT = "vitmask-checkpoint/1"
COMPILE_PREFIX = "_orig_mod."  # what torch.compile's wrapper puts before every state-dict key
STEP_FILE = re.compile(r"step_(\d+)\.pt")


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write `state` atomically (temp file, fsync, os.replace); refuse one with non-finite values.

    A failed write raises `outputs.WriteError` (its `disk_full` says whether the disk is full) and
    leaves `path` as it was.
    """
    path = Path(path)
    bad = first_non_finite(state)
    if bad is not None:
        raise UserError(
            f"the {bad} holds NaN or inf values at step {state.get('step', '?')}, so {path.name} was not written "
            "(the checkpoints already on disk are unchanged); lower train.lr, set train.grad_clip, or use "
            "train.precision=fp32"
        )
    return _write(path, lambda f: _save_with_checksum({"format": FORMAT, **state}, f))


def write_checkpoint_file(obj: dict[str, Any], path: str | Path) -> Path:
    """Write `obj` as it is (no checks, no format marker added), atomically and with its checksum:
    for tools and tests that build a checkpoint's dict by hand."""
    return _write(Path(path), lambda f: _save_with_checksum(obj, f))


def _write(path: Path, write) -> Path:
    """A checkpoint file, written atomically over whatever stood there: a run dir's own files
    (step files, last.pt, best.pt) are replaced as the run goes, under the run dir's lock."""
    return write_atomically(path, write, "checkpoint", make_folder=False, replaces=REPLACE_ANY)


# ---- the checksum -----------------------------------------------------------------------------
CHECKSUM_MARK = b"vitmask-sha256:"  # the zip comment: this, then 64 hex digits
CHECKSUM_TAIL = len(CHECKSUM_MARK) + 64
END_RECORD = b"PK\x05\x06"  # the zip's end-of-central-directory record: 22 bytes, then the comment


class ChecksumMismatch(ValueError):
    """A checkpoint's bytes are not those it was written with; the message says where."""


READ_CHUNK = 1 << 30  # one read of a file that cannot be mapped (a single read returns at most about 2 GiB)
_END = struct.Struct("<4sHHHHIIH")  # end-of-central-directory record, without its comment
_ENTRY = struct.Struct("<4s6xH4xIIIHHH8xI")  # central-directory entry: method, CRC, sizes, lengths, offset
_LOCAL = struct.Struct("<4s22xHH")  # local header: its name and extra lengths


def _save_with_checksum(obj: dict[str, Any], f) -> None:
    """torch.save `obj` into the open file `f`, then append the SHA-256 of its bytes outside the
    records' data (module docstring) as the zip comment. torch.save writes straight to `f`; the
    bytes hashed are read back from the file, mapped into memory, so only the pages that hold
    headers and the record list are read, never the tensors."""
    torch.save(obj, f)
    f.flush()
    size = f.tell()
    with _mapped(f, size) as data:
        if data[size - 22 : size - 18] != END_RECORD or data[size - 2 : size] != b"\x00\x00":
            return  # not torch's layout: leave it unsigned (load then warns)
        outside = _outside_records(data, _record_data(data, size - 22), size - 2)
    digest = hashlib.sha256(outside + struct.pack("<H", CHECKSUM_TAIL) + CHECKSUM_MARK).hexdigest()
    f.seek(size - 2)
    f.write(struct.pack("<H", CHECKSUM_TAIL) + CHECKSUM_MARK + digest.encode())


@contextlib.contextmanager
def _mapped(f, size: int):
    """The first `size` bytes of the open file `f` (opened for reading too, as `open_new` does), as
    a read-only memory map; read into memory where the file system cannot map it."""
    try:
        data = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        yield _pread_all(f.fileno(), size)
        return
    try:
        yield data
    finally:
        data.close()


def _pread_all(fd: int, size: int) -> bytes:
    """The first `size` bytes of the file open as `fd`, read without moving its position."""
    chunks, at = [], 0
    while at < size:
        chunk = os.pread(fd, min(size - at, READ_CHUNK), at)
        if not chunk:
            break
        chunks.append(chunk)
        at += len(chunk)
    return b"".join(chunks)


def _outside_records(data, regions: list[tuple[int, int, int, int]], end: int) -> bytes:
    """Every byte of a zip file's bytes `data` (bytes or a memory map) before offset `end` that is
    not in one of the records' data `regions` (`_record_data`), in order: the local headers, the
    data descriptors, the record list and the end records."""
    kept, at = [], 0
    for start, length, _, _ in sorted(regions):
        kept.append(data[at:start])
        at = start + length
    kept.append(data[at:end])
    return b"".join(kept)


def _record_data(data, end_record: int) -> list[tuple[int, int, int, int]]:
    """(offset, length, CRC-32, central-directory offset) of the stored bytes of each record of a
    zip file's bytes `data`, from its central directory (zip64 where torch writes it) and each
    record's local header (`_record_name` gives a record's name from the last field)."""
    size = len(data)
    try:
        sig, _, _, _, count, cd_size, cd_offset, _ = _END.unpack(_read(data, end_record, 22))
        if sig != END_RECORD:
            raise ChecksumMismatch("its end record is damaged")
        if count == 0xFFFF or 0xFFFFFFFF in (cd_size, cd_offset):
            locator = _read(data, end_record - 20, 20)
            if locator[:4] != b"PK\x06\x07":
                raise ChecksumMismatch("its zip64 locator is damaged")
            zip64 = _read(data, struct.unpack_from("<Q", locator, 8)[0], 56)
            if zip64[:4] != b"PK\x06\x06":
                raise ChecksumMismatch("its zip64 end record is damaged")
            count, cd_size, cd_offset = struct.unpack_from("<QQQ", zip64, 32)
        if cd_offset + cd_size > size or count > cd_size // 46:
            raise ChecksumMismatch("its record list is damaged")
        cd = data[cd_offset : cd_offset + cd_size]
        regions, at = [], 0
        for _ in range(count):
            sig, method, crc, stored, raw, name_len, extra_len, comment_len, offset = _ENTRY.unpack_from(cd, at)
            if sig != b"PK\x01\x02":
                raise ChecksumMismatch("its record list is damaged")
            if 0xFFFFFFFF in (stored, raw, offset):  # the real values are in the zip64 extra field, in this order
                wide = _zip64_extra(cd[at + 46 + name_len : at + 46 + name_len + extra_len])
                raw = wide.pop(0) if raw == 0xFFFFFFFF else raw
                stored = wide.pop(0) if stored == 0xFFFFFFFF else stored
                offset = wide.pop(0) if offset == 0xFFFFFFFF else offset
            if method != 0 or stored != raw:
                name = _record_name(data, cd_offset + at)
                raise ChecksumMismatch(f"record {name} is compressed, which vitmask never writes")
            if offset + 30 > size:
                raise ChecksumMismatch("its zip structure is damaged (an offset past the end of the file)")
            sig, local_name, local_extra = _LOCAL.unpack_from(data, offset)
            if sig != b"PK\x03\x04":
                raise ChecksumMismatch(f"the header of record {_record_name(data, cd_offset + at)} is damaged")
            start = offset + 30 + local_name + local_extra
            if start + stored > size:
                raise ChecksumMismatch("its zip structure is damaged (an offset past the end of the file)")
            regions.append((start, stored, crc, cd_offset + at))
            at += 46 + name_len + extra_len + comment_len
        return regions
    except struct.error:
        raise ChecksumMismatch("its zip structure is damaged (a record cut short)") from None


def _read(data, offset: int, n: int) -> bytes:
    """`n` bytes of `data` from `offset`; reading past the end is a damaged file."""
    if offset < 0 or offset + n > len(data):
        raise ChecksumMismatch("its zip structure is damaged (an offset past the end of the file)")
    return data[offset : offset + n]


def _record_name(data, entry: int) -> str:
    """The name of the record whose central-directory entry starts at `data[entry]`."""
    name_len = struct.unpack_from("<H", data, entry + 28)[0]
    return bytes(data[entry + 46 : entry + 46 + name_len]).decode(errors="replace")


def _zip64_extra(extra: bytes) -> list[int]:
    """The 8-byte values of the zip64 field (id 1) of a central-directory entry's extra data."""
    at = 0
    while at + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            return [struct.unpack_from("<Q", extra, at + 4 + 8 * i)[0] for i in range(n // 8)]
        at += 4 + n
    raise ChecksumMismatch("its record list is damaged (no zip64 sizes)")


def verify_checksum(data: bytes) -> bool:
    """Check a checkpoint file's bytes: each record's CRC-32, and the SHA-256 of the rest where the
    file has one. Returns whether it had one; raises ChecksumMismatch naming what changed."""
    unsigned = data[-22:-18] == END_RECORD and data[-2:] == b"\x00\x00"  # no zip comment: before the checksum
    if not unsigned and (
        data[-CHECKSUM_TAIL:-64] != CHECKSUM_MARK
        or data[-CHECKSUM_TAIL - 2 : -CHECKSUM_TAIL] != struct.pack("<H", CHECKSUM_TAIL)
    ):
        raise ChecksumMismatch("its checksum record at the end of the file changed")
    end_record = len(data) - 22 - (0 if unsigned else CHECKSUM_TAIL)
    regions = _record_data(data, end_record)
    view = memoryview(data)
    for start, length, crc, entry in regions:
        if zlib.crc32(view[start : start + length]) != crc:
            raise ChecksumMismatch(f"the bytes of record {_record_name(data, entry)} changed")
    if unsigned:
        return False
    found = hashlib.sha256(_outside_records(data, regions, len(data) - 64)).hexdigest().encode()
    if found != bytes(data[-64:]):
        raise ChecksumMismatch("its headers or record list changed (SHA-256 mismatch)")
    return True


_warned_unsigned: set[str] = set()


def _warn_unsigned(path: Path) -> None:
    """One warning line per file and process for a checkpoint written before the checksum."""
    key = str(path.resolve()) if path.exists() else str(path)
    if key not in _warned_unsigned:
        _warned_unsigned.add(key)
        warn(
            f"checkpoint {path} has no checksum (written by an earlier vitmask); only its records' CRC-32s were checked"
        )


def first_non_finite(state: dict[str, Any]) -> str | None:
    """Where the first NaN or inf of a checkpoint's model or optimizer state is ('model weight X',
    'optimizer state ...'), or None when every floating-point tensor there is finite."""

    def walk(obj: Any, where: str) -> str | None:
        if isinstance(obj, torch.Tensor):
            return where if obj.is_floating_point() and not bool(torch.isfinite(obj).all()) else None
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
        for k, v in items:
            if (found := walk(v, f"{where}.{k}")) is not None:
                return found
        return None

    for key, label in (("model", "model weight"), ("optimizer", "optimizer state"), ("ema", "EMA weight")):
        if key in state and (found := walk(state[key], "")) is not None:
            return f"{label} {found.lstrip('.')}"
    return None


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
    try:
        _link_atomically(path, run_dir / "last.pt")
    except OSError as e:
        raise write_error(e, run_dir / "last.pt", "checkpoint") from None
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
            with open_new(tmp) as f:  # never through a link planted under the temp name
                f.write(src.read_bytes())
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, dst)
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def remove_stale_temps(run_dir: str | Path) -> list[Path]:
    """Delete temp files left by a process killed mid-save (never a finished file); call it only
    while holding the run dir's lock, so no live process is writing them."""
    stale = [p for p in Path(run_dir).glob(".*.tmp-*") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def plain_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A model state dict without torch.compile's key prefix, so compiled and plain models share checkpoints."""
    return {(k[len(COMPILE_PREFIX) :] if k.startswith(COMPILE_PREFIX) else k): v for k, v in state.items()}


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a vitmask checkpoint, or raise a UserError that says what is wrong with the file."""
    path = Path(path)
    check_not_a_link_loop(path, "checkpoint")
    if path.is_dir():
        raise UserError(f"checkpoint {path} is a folder; pass a .pt file in it, such as {path / 'last.pt'}")
    if path.exists() and not path.is_file():
        raise UserError(f"checkpoint {path} is not a regular file; pass the last.pt (or another .pt) of a run dir")
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}; pass the last.pt (or another .pt) of a vitmask run dir")
    try:
        with open(path, "rb") as f:
            data = f.read()
        if data[:4] != b"PK\x03\x04":  # torch.save's zip format, the only one vitmask writes
            raise ValueError("not a PyTorch zip file: empty, truncated at the start, or not a checkpoint")
        try:
            signed = verify_checksum(data)
        except ChecksumMismatch as e:
            raise UserError(
                f"checkpoint {path} is damaged: its bytes changed after it was written ({e}); it cannot be trusted; "
                "use another checkpoint of the run (step_*.pt, best.pt) or a good copy"
            ) from None
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except UserError:
        raise
    except Exception as e:  # torch raises many types for a file that is not a safe checkpoint
        reason = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise UserError(
            f"cannot read checkpoint {path} ({reason[:120]}); pass a .pt file written by vitmask train"
        ) from None
    found = state.get("format") if isinstance(state, dict) else None
    if isinstance(found, str) and found.startswith("vitmask-checkpoint/") and found != FORMAT:
        raise UserError(
            f"checkpoint {path} was written by another version of vitmask (format {found}; this one reads {FORMAT}); "
            "use that version, or a checkpoint of this one"
        )
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(
            f"{path} is not a vitmask checkpoint (no '{FORMAT}' marker); pass a .pt written by vitmask train"
        )
    if not signed:
        _warn_unsigned(path)
    for key in ("model", "config"):
        if key not in state:
            raise UserError(
                f"checkpoint {path} has no '{key}' entry; pass a complete checkpoint written by vitmask train"
            )
    model = state["model"]
    if not isinstance(model, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in model.items()):
        raise UserError(f"checkpoint {path} is damaged: its 'model' entry is not a dict of tensors; {OTHER_CHECKPOINT}")
    ema = state.get("ema", {})
    if not isinstance(ema, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in ema.items()):
        raise UserError(f"checkpoint {path} is damaged: its 'ema' entry is not a dict of tensors; {OTHER_CHECKPOINT}")
    if not isinstance(state["config"], dict):
        raise UserError(f"checkpoint {path} is damaged: its 'config' entry is not a mapping; {OTHER_CHECKPOINT}")
    bad = first_non_finite(state)
    if bad is not None:
        raise UserError(
            f"checkpoint {path} holds NaN or inf values ({bad}); it cannot be evaluated or resumed; "
            "use an earlier checkpoint of the run (step_*.pt)"
        )
    return state


OTHER_CHECKPOINT = "use another checkpoint of the run (step_*.pt) or one written by this version of vitmask"

# what resuming needs beyond the model and config: entry -> (type, what it must be)
RESUME_ENTRIES = {
    "optimizer": (dict, "a dict"),
    "sampler": (dict, "a dict"),
    "rng": (dict, "a dict"),
    "step": (int, "an integer"),
    "best_val_loss": ((int, float), "a number"),
}


def check_resumable(state: dict[str, Any], path: str | Path) -> None:
    """Raise a one-line UserError when a checkpoint lacks an entry a resume needs, or has one of
    the wrong type (a damaged file, or one from another version of vitmask)."""
    for key, (kind, what) in RESUME_ENTRIES.items():
        if key not in state:
            raise UserError(f"checkpoint {path} has no '{key}' entry, so it cannot be resumed; {OTHER_CHECKPOINT}")
        value = state[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UserError(
                f"checkpoint {path} is damaged: '{key}' is {type(value).__name__}, not {what}; {OTHER_CHECKPOINT}"
            )
    if state["step"] < 0:
        raise UserError(f"checkpoint {path} is damaged: its step is {state['step']}; {OTHER_CHECKPOINT}")
    if state["best_val_loss"] != state["best_val_loss"]:  # NaN: no later loss would ever count as better
        raise UserError(f"checkpoint {path} is damaged: its best_val_loss is NaN; {OTHER_CHECKPOINT}")
    sched = state.get("scheduler", {})
    lrs = sched.get("base_lrs", []) if isinstance(sched, dict) else None
    if (
        not isinstance(sched, dict)
        or not isinstance(sched.get("last_epoch", 0), int)
        or not isinstance(lrs, list)
        or not all(isinstance(v, (int, float)) for v in lrs)
    ):
        raise UserError(f"checkpoint {path} is damaged: its 'scheduler' entry is not a schedule; {OTHER_CHECKPOINT}")
    if not isinstance(state.get("scaler", {}), dict):
        raise UserError(f"checkpoint {path} is damaged: its 'scaler' entry is not a dict; {OTHER_CHECKPOINT}")


def describe_load_failure(e: BaseException, path: str | Path) -> UserError:
    """A one-line UserError for a checkpoint whose entries do not load into the trainer."""
    os_err = os_error_in(e)
    why = str(os_err or e).strip().splitlines()[0][:160] if str(os_err or e).strip() else e.__class__.__name__
    return UserError(f"checkpoint {path} is damaged or from another version ({why}); {OTHER_CHECKPOINT}")


def fit_problems(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> str:
    """Where `state` does not fit `model` ("shape mismatch: ... | missing: ... | unexpected: ..."),
    or "" when every key is there with its shape and there is no other."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    parts = []
    if shapes:
        parts.append("shape mismatch: " + "; ".join(shapes[:4]))
    if missing:
        parts.append("missing: " + ", ".join(missing[:4]))
    if unexpected:
        parts.append("unexpected: " + ", ".join(unexpected[:4]))
    return " | ".join(parts)


def check_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise a UserError naming the keys where `state` does not fit `model`."""
    problems = fit_problems(model, state)
    if problems:
        raise UserError(
            "checkpoint does not fit this model (" + problems + "); resume with the config it was trained with"
        )


# a checkpoint's weight entries: the trained weights, and the EMA's where the run kept one
WEIGHT_ENTRIES = {"model": "trained weights", "ema": "EMA weights"}


def check_weight_entries(model: torch.nn.Module, state: dict[str, Any], path: str | Path) -> None:
    """Refuse a checkpoint whose trained weights or EMA weights (where it has an EMA) do not fit
    `model`, the model its config describes: whichever of the two a command loads, a damaged other
    one would otherwise pass until a resume fails on it."""
    for key, label in WEIGHT_ENTRIES.items():
        entry = state.get(key)
        if key == "ema" and not entry:
            continue
        problems = fit_problems(model, plain_state_dict(entry))
        if problems:
            raise UserError(
                f"checkpoint {path} is damaged: its {label} ('{key}' entry) do not fit the model its config "
                f"describes ({problems}); {OTHER_CHECKPOINT}"
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
    return config_of(load_checkpoint(path), path, overrides)


def config_of(state: dict[str, Any], path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of a checkpoint already read, `overrides` applied; a stored config this version
    cannot build (an unknown key, a value out of range) is one line naming the file."""
    try:
        config_from_dict(state["config"])
    except UserError as e:
        raise UserError(f"checkpoint {path} holds a config this version cannot use ({e})") from None
    return config_from_dict(state["config"], overrides)


class LoadedModel(NamedTuple):
    model: MaskedPatchViT  # in eval mode, on the device asked for
    config: Config
    state: dict[str, Any]  # the whole checkpoint, as read


def load_model(path: str | Path, device: torch.device | str = "cpu") -> LoadedModel:
    """The model of a checkpoint file, with its config and the raw checkpoint, ready to predict."""
    state = load_checkpoint(path)
    cfg = config_of(state, path)
    model = build_model(cfg)
    try:
        load_model_state(model, state["model"])
    except (RuntimeError, TypeError, ValueError) as e:  # entries of the right shape but not loadable
        raise describe_load_failure(e, path) from None
    check_weight_entries(model, state, path)  # the EMA's too, where there is one
    return LoadedModel(model.to(device).eval(), cfg, state)
