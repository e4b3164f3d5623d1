"""The packed dataset format: one bit per pixel, memory-mapped, split by index, checked as it is read.

A packed dataset is a directory (docs/corpora.md) holding:

- `rows.npy`: uint8 (count, row_bytes), each row `np.packbits` of one binary image read row-major,
  the first pixel in the most significant bit (the bit order of a patch's class, patches.py), the
  last byte zero-padded; row_bytes = ceil(height * width / 8);
- `labels.npy` (when the source has labels): int32 (count,), the class of each row;
- `<split>.npy` for a split that is not a contiguous run of rows: int32 (or int64 past 2^31 rows)
  row numbers, in the split's order;
- `blocks.npy`: uint32 (ceil(count / block_rows),), the CRC-32 of the bytes of each block of
  `block_rows` consecutive rows (the last block shorter);
- `header.json`: the format marker, count, height, width, row_bytes, the binarization (threshold,
  invert, fit), the class names, each split's size and where its rows are, the split seed and
  fractions, a description of the source, the SHA-256 of the rows' bytes (`checksum`), block_rows,
  the SHA-256 of every other .npy file (`files`) and of the header itself (`header_checksum`).

Every array is a plain .npy file read with `np.load(..., mmap_mode="r")`. `open_packed` checks
everything but the rows, whose size alone is checked: the header (a regular file of at most 16 MiB,
JSON, every field of its type and in range, its own checksum), every file (a regular file of the
shape and dtype the header gives; the indices, labels and block sums against their SHA-256), the
splits (inside the rows, disjoint, no row twice, a non-empty train split) and the labels (each one
a class). The rows are checked by blocks, each the first time any of its rows is read in this
process (`BlockCheck`), and all of them by `verify_packed` (`vitmask pack --verify`). A pack
written without checksums opens with one warning line and the structural checks only. Every
failure is a `UserError` of one line.

`PackedImages` is one split: indexing gathers the packed rows of a batch and unpacks them on the
device with shifts and masks, so the unpacked corpus is never held in memory.

Shapes: B batch, R row bytes, H, W image side.
"""

import hashlib
import json
import math
import os
import reprlib
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitmask.data.preprocess import FITS
from vitmask.errors import UserError, warn
from vitmask.outputs import reason
from vitmask.progress import Progress

FORMAT = "vitmask-packed/1"
HEADER = "header.json"
ROWS = "rows.npy"
LABELS = "labels.npy"
BLOCKS = "blocks.npy"
SPLIT_NAMES = ("train", "val", "test")
BIT_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)  # np.packbits' default (big) bit order: the first pixel is bit 7
HEADER_LIMIT = 16 << 20  # bytes: a header is a few KiB (its class names); a bigger file is not one
MAX_SIDE = 1 << 16  # pixels a side


def row_bytes(height: int, width: int) -> int:
    """Bytes of one packed image."""
    return math.ceil(height * width / 8)


def pack_rows(images: torch.Tensor) -> np.ndarray:
    """(B, H, W) uint8 0/1 images -> (B, R) uint8 packed rows (np.packbits, big bit order)."""
    flat = images.reshape(len(images), -1).numpy()  # (B, H*W)
    return np.packbits(flat, axis=1)  # (B, R)


def unpack_rows(rows: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, R) uint8 packed rows -> (B, H, W) uint8 0/1 images, on the rows' device (shifts and masks)."""
    shifts = torch.tensor(BIT_SHIFTS, dtype=torch.uint8, device=rows.device)  # (8,)
    bits = (rows.unsqueeze(-1) >> shifts) & 1  # (B, R, 8)
    return bits.reshape(len(rows), -1)[:, : height * width].reshape(len(rows), height, width)  # (B, H, W)


# ---- checksums, written by pack ------------------------------------------------------------------
def file_digest(path: Path) -> str:
    """'sha256:<hex>' of a file's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            h.update(piece)
    return f"sha256:{h.hexdigest()}"


def header_digest(header: dict) -> str:
    """'sha256:<hex>' of the header without its `header_checksum`, as canonical JSON (sorted keys, no spaces)."""
    body = {k: v for k, v in header.items() if k != "header_checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"


class BlockSums:
    """The CRC-32 of each block of `block_rows` consecutive rows, fed the rows in order in chunks of any size."""

    def __init__(self, block_rows: int):
        self.block_rows = block_rows
        self.sums: list[int] = []
        self._crc, self._filled = 0, 0

    def update(self, rows: np.ndarray) -> None:
        """(k, R) uint8: the next k rows."""
        at = 0
        while at < len(rows):
            take = min(len(rows) - at, self.block_rows - self._filled)
            self._crc = zlib.crc32(np.ascontiguousarray(rows[at : at + take]), self._crc)
            self._filled += take
            at += take
            if self._filled == self.block_rows:
                self.sums.append(self._crc)
                self._crc, self._filled = 0, 0

    def finish(self) -> np.ndarray:
        """(blocks,) uint32: the CRC-32 of every block, the last (shorter) one included."""
        if self._filled:
            self.sums.append(self._crc)
            self._crc, self._filled = 0, 0
        return np.asarray(self.sums, dtype=np.uint32)


def seal(header: dict, root: Path) -> dict:
    """`header` with `files` (the SHA-256 of blocks.npy, labels.npy and each index file in `root`,
    all written already) and then `header_checksum` added."""
    names = [BLOCKS] + ([LABELS] if header.get("classes") is not None else [])
    names += [v["index"] for v in header["splits"].values() if "index" in v]
    sealed = {**header, "files": {name: file_digest(root / name) for name in names}}
    sealed["header_checksum"] = header_digest(sealed)
    return sealed


# ---- checking as read ----------------------------------------------------------------------------
class DamagedRows(UserError):
    """Rows whose bytes do not match the block checksums pack wrote for them."""


class BlockCheck:
    """The rows' block checksums (blocks.npy), each block checked the first time any of its rows is read.

    A read whose blocks were all checked costs one boolean gather (microseconds for a batch); a
    block not yet checked is read whole (about 1 MiB), its CRC-32 compared, and marked, once per
    process. Thread-safe: two threads that meet the same new block both check it.
    """

    def __init__(self, rows: np.ndarray, block_rows: int, sums: np.ndarray, path: Path):
        self.rows, self.block_rows, self.sums, self.path = rows, block_rows, sums, path
        self.verified = np.zeros(len(sums), dtype=bool)  # (blocks,)

    def __len__(self) -> int:
        return len(self.sums)

    def span(self, block: int) -> tuple[int, int]:
        """The rows [start, stop) of `block`."""
        start = block * self.block_rows
        return start, min(start + self.block_rows, len(self.rows))

    def matches(self, block: int) -> bool:
        start, stop = self.span(block)
        return zlib.crc32(self.rows[start:stop]) == int(self.sums[block])

    def before_reading(self, row_numbers: np.ndarray) -> None:
        """Check the blocks of (k,) int64 `row_numbers` not checked yet; a damaged one raises DamagedRows."""
        blocks = row_numbers // self.block_rows  # (k,)
        fresh = ~self.verified[blocks]  # (k,)
        if not fresh.any():
            return
        for block in np.unique(blocks[fresh]).tolist():
            if not self.matches(block):
                raise self.damaged([block])
            self.verified[block] = True

    def damaged(self, blocks: list[int]) -> DamagedRows:
        start, stop = self.span(blocks[0])
        which = f"rows {start:,} to {stop - 1:,} (block {blocks[0]:,} of {len(self):,})"
        if len(blocks) > 1:
            which = f"{len(blocks):,} of its {len(self):,} blocks, the first rows {start:,} to {stop - 1:,},"
        return DamagedRows(
            f"{self.path} is damaged: {which} do not match the checksums vitmask pack wrote for them, so no "
            f"image of them was used; check the whole pack with vitmask pack --verify {self.path.parent}, "
            f"and pack the source again"
        )


# ---- reading --------------------------------------------------------------------------------------
@dataclass
class PackedDataset:
    """An opened packed directory: its header and memory-mapped arrays (no row read yet)."""

    root: Path
    header: dict
    rows: np.ndarray  # (count, R) uint8 memmap
    labels: np.ndarray | None  # (count,) int32 memmap, or None
    splits: dict[str, np.ndarray | tuple[int, int]]  # split -> row numbers (memmap) or (start, count)
    check: BlockCheck | None = None  # None: a pack written without block checksums

    @property
    def height(self) -> int:
        return int(self.header["height"])

    @property
    def width(self) -> int:
        return int(self.header["width"])

    def split(self, name: str, device: torch.device | str = "cpu") -> "PackedImages":
        return PackedImages(self.rows, self.splits[name], self.height, self.width, torch.device(device), self.check)

    def split_labels(self, name: str) -> torch.Tensor | None:
        """(n,) int64 labels of a split, in its order (read whole: 8 bytes an image), or None."""
        if self.labels is None:
            return None
        where = self.splits[name]
        if isinstance(where, tuple):
            start, count = where
            return torch.from_numpy(np.asarray(self.labels[start : start + count], dtype=np.int64))
        return torch.from_numpy(np.asarray(self.labels[np.asarray(where)], dtype=np.int64))


def _regular_size(path: Path) -> int | None:
    """The size of `path` if it is a regular file (links followed), else None; OSError as os.stat raises it."""
    st = os.stat(path)
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def is_packed_dir(path: Path) -> bool:
    """Whether `path` is a directory with a vitmask packed header (a regular file: a FIFO is never read)."""
    try:
        size = _regular_size(path / HEADER) if path.is_dir() else None
        if size is None or size > HEADER_LIMIT:
            return False
        return json.loads((path / HEADER).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def _check_regular(path: Path, fix: str) -> None:
    """A file the pack needs must be there and be a regular file: a FIFO or a device would block the read."""
    try:
        size = _regular_size(path)
    except FileNotFoundError:
        raise UserError(f"{path} is missing: the packed dataset is incomplete; {fix}") from None
    except OSError as e:
        raise UserError(f"{path} cannot be read ({reason(e)}); {fix}") from None
    if size is None:
        raise UserError(f"{path} is not a regular file (a folder, a FIFO or a device), so it is not read; {fix}")


def _load_npy(path: Path, what: str, fix: str) -> np.ndarray:
    _check_regular(path, fix)
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:  # a truncated file: "mmap length is greater than file size"
        raise UserError(f"{path} is damaged or truncated ({e.__class__.__name__}: {what}); {fix}") from None


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} is out of range")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _read_header(root: Path, fix: str) -> dict:
    path = root / HEADER
    try:
        size = _regular_size(path)
    except FileNotFoundError:
        raise UserError(f"{root} has no {HEADER}, so it is not a packed dataset; write one with vitmask pack") from None
    except OSError as e:
        raise UserError(f"{path} cannot be read ({reason(e)}); {fix}") from None
    if size is None:
        raise UserError(f"{path} is not a regular file (a folder, a FIFO or a device), so it is not read; {fix}")
    if size > HEADER_LIMIT:
        raise UserError(f"{path} is {size:,} bytes, where a header takes a few KiB; {fix}")
    try:
        header = json.loads(path.read_text(), parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise UserError(f"{path} is not a header: it nests too deeply to read; {fix}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not readable JSON ({e.__class__.__name__}); {fix}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        found = header.get("format") if isinstance(header, dict) else None
        raise UserError(f"{path} is not a {FORMAT} header (format {reprlib.repr(found)}); {fix}")
    return header


class _Fields:
    """Typed reads of a header's fields: a missing or mistyped one is a UserError naming it."""

    def __init__(self, path: Path, fix: str):
        self.path, self.fix = path, fix

    def error(self, what: str) -> UserError:
        return UserError(f"{self.path}: {what}; {self.fix}")

    def integer(self, where: dict, key: str, name: str, low: int = 0, high: int = 1 << 62) -> int:
        if not isinstance(where, dict) or key not in where:
            raise self.error(f"the entry {name} is missing")
        value = where[key]
        if type(value) is not int or not low <= value <= high:
            raise self.error(f"{name} is {reprlib.repr(value)}, not an integer from {low:,} to {high:,}")
        return value

    def splits(self, header: dict, count: int) -> dict[str, dict]:
        """Each split's entry: {"count": n, "start": s} inside the rows, or {"count": n, "index": "<split>.npy"}."""
        raw = header.get("splits")
        if not isinstance(raw, dict):
            raise self.error("the entry splits is missing or not a map of train, val and test")
        out = {}
        for name in SPLIT_NAMES:
            info = raw.get(name)
            if not isinstance(info, dict):
                raise self.error(f"the entry splits.{name} is missing or not a map")
            n = self.integer(info, "count", f"splits.{name}.count")
            if ("start" in info) == ("index" in info):
                raise self.error(f"splits.{name} must give either start or index")
            if "start" in info:
                start = self.integer(info, "start", f"splits.{name}.start")
                if start + n > count:
                    raise self.error(f"split {name} (rows {start:,} to {start + n - 1:,}) runs past the {count:,} rows")
            elif info["index"] != f"{name}.npy":
                raise self.error(f"splits.{name}.index is {reprlib.repr(info['index'])}, not {name}.npy")
            out[name] = info
        return out


def open_packed(path: str | Path) -> PackedDataset:
    """Open a packed directory and check it (module doc); a bad one is a UserError of one line."""
    root = Path(path)
    fix = f"pack the source again with vitmask pack --out {root}"
    if not root.is_dir():
        raise UserError(f"data.path {root} is not a folder; point data.path at a directory written by vitmask pack")
    header = _read_header(root, fix)
    fields = _Fields(root / HEADER, fix)
    count = fields.integer(header, "count", "count")
    height = fields.integer(header, "height", "height", 1, MAX_SIDE)
    width = fields.integer(header, "width", "width", 1, MAX_SIDE)
    r = row_bytes(height, width)
    if "row_bytes" in header and header["row_bytes"] != r:
        raise fields.error(f"row_bytes is {reprlib.repr(header['row_bytes'])}, but {height}x{width} images take {r}")
    classes = header.get("classes")
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise fields.error("classes is neither null nor a list of names")
    split_info = fields.splits(header, count)

    rows = _load_npy(root / ROWS, "its size disagrees with its own .npy header", fix)
    if rows.dtype != np.uint8 or rows.shape != (count, r):
        raise UserError(
            f"{root / ROWS} holds {rows.dtype} {rows.shape} but the header says {count} rows of {r} bytes "
            f"({height}x{width} images); {fix}"
        )
    extra = (root / ROWS).stat().st_size - rows.offset - rows.nbytes
    if extra:  # bytes after the rows: rows of another size, or a file appended to
        raise UserError(f"{root / ROWS} holds {extra:,} bytes after its {count:,} rows of {r} bytes; {fix}")
    labels = None
    if classes is not None:
        labels = _load_npy(root / LABELS, "labels", fix)
        if labels.shape != (count,) or not np.issubdtype(labels.dtype, np.integer):
            raise UserError(f"{root / LABELS} holds {labels.dtype} {labels.shape}, not {count} labels; {fix}")
    splits: dict[str, np.ndarray | tuple[int, int]] = {}
    for name, info in split_info.items():
        if "start" in info:
            splits[name] = (info["start"], info["count"])
            continue
        index = _load_npy(root / info["index"], f"index of split {name}", fix)
        if index.shape != (info["count"],) or not np.issubdtype(index.dtype, np.integer):
            raise UserError(
                f"{root / name}.npy holds {index.dtype} {index.shape}, not {info['count']} row numbers; {fix}"
            )
        splits[name] = index
    _check_splits(fields, splits, count)
    if labels is not None and count:
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= len(classes):
            bad = low if low < 0 else high
            raise UserError(
                f"{root / LABELS} holds the label {bad}, but the header names {len(classes)} classes "
                f"(labels 0 to {len(classes) - 1}); {fix}"
            )
    check = _check_checksums(root, header, fields, rows, splits, fix)
    return PackedDataset(root, header, rows, labels, splits, check)


def _check_splits(fields: _Fields, splits: dict, count: int) -> None:
    """Every split inside the rows, no row in two splits or twice in one, a non-empty train split."""
    seen = np.zeros(count, dtype=bool)  # (count,): rows some split holds
    held = 0
    sizes = {}
    for name, where in splits.items():
        if isinstance(where, tuple):
            start, n = where
            seen[start : start + n] = True
        else:
            n = len(where)
            if n:
                low, high = int(where.min()), int(where.max())
                if low < 0 or high >= count:
                    raise fields.error(
                        f"{name}.npy holds the row number {low if low < 0 else high}, outside the {count:,} rows"
                    )
                for at in range(0, n, 1 << 20):  # in pieces: NumPy turns an int32 index into int64
                    seen[where[at : at + (1 << 20)]] = True
        held += n
        sizes[name] = n
        if np.count_nonzero(seen) != held:
            earlier = ", ".join(SPLIT_NAMES[: SPLIT_NAMES.index(name)])
            also = f" rows of an earlier split ({earlier}) or" if earlier else ""
            raise fields.error(f"split {name} holds{also} one row twice: the splits must be disjoint")
    if sizes["train"] == 0:
        raise fields.error("split train is empty: there is nothing to train on")


def _check_checksums(root: Path, header: dict, fields: _Fields, rows, splits: dict, fix: str) -> BlockCheck | None:
    """The header's own checksum, the small files' SHA-256 and the block sums' shape; None (and one
    warning line) for a pack written without them."""
    if "header_checksum" not in header:
        warn(
            f"{root} was packed without checksums (by an earlier vitmask): its rows, indices and labels are read "
            f"unchecked; {fix} to have them checked"
        )
        return None
    if header_digest(header) != header["header_checksum"]:
        raise UserError(
            f"{root / HEADER} changed after vitmask pack wrote it (it does not match its header_checksum); {fix}"
        )
    block_rows = fields.integer(header, "block_rows", "block_rows", 1)
    if not isinstance(header.get("checksum"), str):
        raise fields.error("the entry checksum, the SHA-256 of the rows, is missing")
    files = header.get("files")
    names = [BLOCKS] + ([LABELS] if header.get("classes") is not None else [])
    names += [f"{name}.npy" for name, where in splits.items() if not isinstance(where, tuple)]
    for name in names:
        want = files.get(name) if isinstance(files, dict) else None
        if not isinstance(want, str):
            raise fields.error(f"files.{name}, the checksum of {name}, is missing")
        _check_regular(root / name, fix)
        if file_digest(root / name) != want:
            raise UserError(
                f"{root / name} does not match its checksum in {HEADER}: it changed after vitmask pack wrote it, "
                f"or it belongs to another pack; {fix}"
            )
    sums = _load_npy(root / BLOCKS, "block checksums", fix)
    blocks = -(-len(rows) // block_rows)
    if sums.dtype != np.uint32 or sums.shape != (blocks,):
        raise UserError(f"{root / BLOCKS} holds {sums.dtype} {sums.shape}, not {blocks} block checksums; {fix}")
    return BlockCheck(rows, block_rows, np.asarray(sums), root / ROWS)


def verify_packed(path: str | Path, progress: bool = True) -> dict:
    """Open a pack (every check of `open_packed`) and read all of its rows: every block against its
    CRC-32 and all of them against the header's SHA-256. Returns what was checked; a damaged pack is a
    UserError of one line naming the first bad block."""
    if not Path(path).is_dir():
        raise UserError(f"{path} is not a folder; --verify takes a directory written by vitmask pack")
    ds = open_packed(path)
    check, want = ds.check, ds.header.get("checksum")
    if check is None and not isinstance(want, str):
        raise UserError(f"{ds.root} holds no checksums to verify its rows against; pack the source again to add them")
    step = check.block_rows if check is not None else 1 << 16
    h, bad = hashlib.sha256(), []
    with Progress(ds.rows.nbytes, "verify", "B", enabled=progress, unit_scale=True) as bar:
        for block, start in enumerate(range(0, len(ds.rows), step)):
            piece = ds.rows[start : start + step]  # (<= step, R): read here
            h.update(piece)
            if check is not None and zlib.crc32(piece) != int(check.sums[block]):
                bad.append(block)
            bar.update(piece.nbytes)
    if bad:
        raise check.damaged(bad)
    if isinstance(want, str) and f"sha256:{h.hexdigest()}" != want:
        raise UserError(
            f"{ds.root / ROWS} does not match the rows' checksum in {HEADER}: it changed after vitmask pack "
            f"wrote it; pack the source again with vitmask pack --out {ds.root}"
        )
    return {"count": len(ds.rows), "blocks": len(check) if check is not None else 0, "sha256": isinstance(want, str)}


def binarization(path: str | Path) -> dict[str, Any]:
    """How a pack's images were made binary, read from its header alone (no other file is opened):
    `image_size` (the side of its square images), `fit`, `threshold` and `invert`, each where the
    header records it. A recorded value of the wrong type is a UserError of one line naming it."""
    root = Path(path)
    fix = f"pack the source again with vitmask pack --out {root}"
    if not root.is_dir():
        raise UserError(f"data.path {root} is not a folder; point data.path at a directory written by vitmask pack")
    header = _read_header(root, fix)
    fields = _Fields(root / HEADER, fix)
    height = fields.integer(header, "height", "height", 1, MAX_SIDE)
    width = fields.integer(header, "width", "width", 1, MAX_SIDE)
    found: dict[str, Any] = {"image_size": height} if height == width else {}
    if "fit" in header:
        if header["fit"] not in FITS:
            raise fields.error(f"fit is {reprlib.repr(header['fit'])}, not one of {', '.join(FITS)}")
        found["fit"] = header["fit"]
    if "threshold" in header:
        t = header["threshold"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1:
            raise fields.error(f"threshold is {reprlib.repr(t)}, not a number in [0, 1]")
        found["threshold"] = float(t)
    if "invert" in header:
        if not isinstance(header["invert"], bool):
            raise fields.error(f"invert is {reprlib.repr(header['invert'])}, not true or false")
        found["invert"] = header["invert"]
    return found


def check_matches_config(ds: PackedDataset, image_size: int) -> None:
    """A packed dataset of another image size than the config cannot be trained on: one line."""
    if (ds.height, ds.width) != (image_size, image_size):
        raise UserError(
            f"the packed dataset {ds.root} holds {ds.height}x{ds.width} images but data.image_size is {image_size}; "
            f"set data.image_size={ds.height}, or pack the source again at this size"
        )


# ---- one split, as images -------------------------------------------------------------------------
class PackedImages:
    """One split of a packed dataset, indexed like an (n, H, W) uint8 tensor of 0/1 images.

    `x[i]`, `x[a:b]` and `x[idx]` (an index tensor) gather the packed rows of those images, from the
    memory map (through pinned memory to a CUDA device) or from a copy of the split's rows already
    on the device (`rows_to_device`), and unpack them there. Nothing else is read.
    """

    def __init__(self, rows, where, height: int, width: int, device: torch.device, check: BlockCheck | None = None):
        self.rows = rows  # (count, R) uint8: np.memmap of the whole dataset, or a tensor of this split's rows
        self.where = where  # split -> rows: (start, count), or (n,) row numbers; None: `rows` is the split
        self.height, self.width = height, width
        self.device = device
        self.check = check  # the memory map's block checksums (None: unchecked, or rows already checked)

    def __len__(self) -> int:
        if self.where is None:
            return len(self.rows)
        return self.where[1] if isinstance(self.where, tuple) else len(self.where)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self), self.height, self.width)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def packed_bytes(self) -> int:
        return len(self) * row_bytes(self.height, self.width)

    def to(self, device: torch.device | str) -> "PackedImages":
        """The same split, unpacked on `device` (its rows stay where they are)."""
        rows = self.rows if not torch.is_tensor(self.rows) else self.rows.to(device)
        return PackedImages(rows, self.where, self.height, self.width, torch.device(device), self.check)

    def rows_to_device(self) -> "PackedImages":
        """The split with its packed rows copied, in split order, to its device (gathered in chunks)."""
        if torch.is_tensor(self.rows):
            return self
        out = torch.empty(len(self), row_bytes(self.height, self.width), dtype=torch.uint8, device=self.device)
        step = 1 << 20
        for start in range(0, len(self), step):
            pos = np.arange(start, min(start + step, len(self)))
            out[start : start + len(pos)] = torch.from_numpy(self._gather(pos)).to(self.device)
        return PackedImages(out, None, self.height, self.width, self.device)

    def _row_numbers(self, pos: np.ndarray) -> np.ndarray:
        if self.where is None:
            return pos
        if isinstance(self.where, tuple):
            return pos + self.where[0]
        return np.asarray(self.where[pos], dtype=np.int64)

    def _gather(self, pos: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """(k,) positions in the split -> (k, R) packed rows from the memory map (into `out` if given),
        their blocks checked first where they were not yet."""
        rows = self._row_numbers(pos)
        if self.check is not None:
            self.check.before_reading(rows)
        return np.take(self.rows, rows, axis=0, out=out)

    @property
    def mapped(self) -> bool:
        """Whether batches are gathered from the memory map (not from rows copied to the device)."""
        return not torch.is_tensor(self.rows)

    def gather(self, pos: torch.Tensor) -> torch.Tensor:
        """(k,) int positions in the split -> (k, R) uint8 packed rows from the memory map, on the CPU:
        in pinned memory when the split is unpacked on a CUDA device, ready for a non-blocking copy.
        Thread-safe: only reads."""
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        rows = torch.empty(len(pos), row_bytes(self.height, self.width), dtype=torch.uint8, pin_memory=pin)  # (k, R)
        self._gather(pos.cpu().numpy(), out=rows.numpy())
        return rows

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """(k, R) packed rows from `gather` -> (k, H, W) uint8 0/1 images on the device (NumPy's
        unpackbits on the CPU, the fastest there; shifts and masks on a GPU, after a non-blocking copy)."""
        if self.device.type == "cpu":
            bits = np.unpackbits(rows.numpy(), axis=1, count=self.height * self.width)  # (k, H*W)
            return torch.from_numpy(bits.reshape(len(bits), self.height, self.width))
        return unpack_rows(rows.to(self.device, non_blocking=True), self.height, self.width)

    def __getitem__(self, key) -> torch.Tensor:
        n = len(self)
        if isinstance(key, int):
            if not -n <= key < n:
                raise IndexError(f"index {key} is out of range for a split of {n} images")
            return self[torch.tensor([key % n])][0]
        if isinstance(key, slice):
            pos = torch.arange(n)[key]
        else:
            pos = torch.as_tensor(key).long()
            pos = torch.where(pos < 0, pos + n, pos)
        if self.mapped:
            return self.unpack(self.gather(pos))  # (k, H, W)
        return unpack_rows(self.rows[pos.to(self.rows.device)], self.height, self.width)  # (k, H, W)

    def subset(self, pos: np.ndarray) -> "PackedImages":
        """The images at positions `pos` of the split, as a split of their own (no rows read)."""
        if torch.is_tensor(self.rows):
            return PackedImages(
                self.rows[torch.from_numpy(pos).to(self.rows.device)], None, *self.shape[1:], self.device
            )
        return PackedImages(self.rows, self._row_numbers(pos), self.height, self.width, self.device, self.check)

    def split(self, size: int):
        """Consecutive unpacked chunks of `size` images (the last one shorter), like Tensor.split."""
        return (self[start : start + size] for start in range(0, len(self), size))

    def unpacked(self) -> torch.Tensor:
        """The whole split unpacked, (n, H, W) uint8 on the device: for small splits only."""
        from vitmask.runtime.memory import check_bytes

        check_bytes(len(self) * self.height * self.width, f"{len(self):,} unpacked images", "pack fewer images")
        return self[:]


def spread(images, limit: int):
    """At most `limit` images of `images` (a tensor or PackedImages), evenly spaced, in order, of the
    same kind; all of them when there are no more than `limit`."""
    n = len(images)
    if n <= limit:
        return images
    pos = np.linspace(0, n - 1, limit).round().astype(np.int64)
    if isinstance(images, PackedImages):
        return images.subset(pos)
    return images[torch.from_numpy(pos)]
