"""The packed dataset format: one bit per pixel, memory-mapped, split by index.

A packed dataset is a directory (docs/corpora.md) holding:

- `rows.npy`: uint8 (count, row_bytes), each row `np.packbits` of one binary image read row-major,
  the first pixel in the most significant bit (the bit order of a patch's class, patches.py), the
  last byte zero-padded; row_bytes = ceil(height * width / 8);
- `labels.npy` (when the source has labels): int32 (count,), the class of each row;
- `<split>.npy` for a split that is not a contiguous run of rows: int32 (or int64 past 2^31 rows)
  row numbers, in the split's order;
- `header.json`: the format marker, count, height, width, row_bytes, the binarization (threshold,
  invert, fit), the class names, each split's size and where its rows are, the split seed and
  fractions, a description of the source, and the SHA-256 of the rows' bytes.

Every array is a plain .npy file read with `np.load(..., mmap_mode="r")`: opening a dataset reads
the header and the .npy headers, nothing else. `PackedImages` is one split of it: indexing gathers
the packed rows of a batch and unpacks them on the device with shifts and masks, so the unpacked
corpus is never held in memory. `open_packed` checks every file against the header, so a
truncated or mismatched dataset is one line, not a wrong batch.

Shapes: B batch, R row bytes, H, W image side.
"""

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vitmask.errors import UserError

FORMAT = "vitmask-packed/1"
HEADER = "header.json"
ROWS = "rows.npy"
LABELS = "labels.npy"
SPLIT_NAMES = ("train", "val", "test")
BIT_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)  # np.packbits' default (big) bit order: the first pixel is bit 7


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


def rows_checksum(rows: np.ndarray, chunk: int = 1 << 16) -> str:
    """'sha256:<hex>' of the rows' bytes, read in chunks (a memory map stays unread until then)."""
    h = hashlib.sha256()
    for start in range(0, len(rows), chunk):
        h.update(np.ascontiguousarray(rows[start : start + chunk]).tobytes())
    return f"sha256:{h.hexdigest()}"


# ---- reading --------------------------------------------------------------------------------------
@dataclass
class PackedDataset:
    """An opened packed directory: its header and memory-mapped arrays (nothing read yet)."""

    root: Path
    header: dict
    rows: np.ndarray  # (count, R) uint8 memmap
    labels: np.ndarray | None  # (count,) int32 memmap, or None
    splits: dict[str, np.ndarray | tuple[int, int]]  # split -> row numbers (memmap) or (start, count)

    @property
    def height(self) -> int:
        return int(self.header["height"])

    @property
    def width(self) -> int:
        return int(self.header["width"])

    def split(self, name: str, device: torch.device | str = "cpu") -> "PackedImages":
        return PackedImages(self.rows, self.splits[name], self.height, self.width, torch.device(device))

    def split_labels(self, name: str) -> torch.Tensor | None:
        """(n,) int64 labels of a split, in its order (read whole: 8 bytes an image), or None."""
        if self.labels is None:
            return None
        where = self.splits[name]
        if isinstance(where, tuple):
            start, count = where
            return torch.from_numpy(np.asarray(self.labels[start : start + count], dtype=np.int64))
        return torch.from_numpy(np.asarray(self.labels[np.asarray(where)], dtype=np.int64))


def is_packed_dir(path: Path) -> bool:
    """Whether `path` is a directory with a vitmask packed header."""
    try:
        return path.is_dir() and json.loads((path / HEADER).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _load_npy(path: Path, what: str, fix: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise UserError(f"{path} is missing: the packed dataset is incomplete; {fix}") from None
    except (OSError, ValueError, EOFError) as e:  # a truncated file: "mmap length is greater than file size"
        raise UserError(f"{path} is damaged or truncated ({e.__class__.__name__}: {what}); {fix}") from None


def open_packed(path: str | Path) -> PackedDataset:
    """Open a packed directory, checking every file against its header; a bad one is a UserError."""
    root = Path(path)
    fix = f"pack the source again with vitmask pack --out {root}"
    if not root.is_dir():
        raise UserError(f"data.path {root} is not a folder; point data.path at a directory written by vitmask pack")
    try:
        header = json.loads((root / HEADER).read_text())
    except FileNotFoundError:
        raise UserError(f"{root} has no {HEADER}, so it is not a packed dataset; write one with vitmask pack") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{root / HEADER} is not readable JSON ({e.__class__.__name__}); {fix}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        found = header.get("format") if isinstance(header, dict) else None
        raise UserError(f"{root / HEADER} is not a {FORMAT} header (format {found!r}); {fix}")
    try:
        count, height, width = int(header["count"]), int(header["height"]), int(header["width"])
        split_info = {k: header["splits"][k] for k in SPLIT_NAMES}
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{root / HEADER} lacks or garbles the entry {e}; {fix}") from None
    rows = _load_npy(root / ROWS, "its size disagrees with its own .npy header", fix)
    r = row_bytes(height, width)
    if rows.dtype != np.uint8 or rows.shape != (count, r):
        raise UserError(
            f"{root / ROWS} holds {rows.dtype} {rows.shape} but the header says {count} rows of {r} bytes "
            f"({height}x{width} images); {fix}"
        )
    labels = None
    if header.get("classes") is not None:
        labels = _load_npy(root / LABELS, "labels", fix)
        if labels.shape != (count,) or not np.issubdtype(labels.dtype, np.integer):
            raise UserError(f"{root / LABELS} holds {labels.dtype} {labels.shape}, not {count} labels; {fix}")
    splits: dict[str, np.ndarray | tuple[int, int]] = {}
    for name, info in split_info.items():
        n = int(info["count"])
        if "start" in info:
            start = int(info["start"])
            if not (0 <= start and start + n <= count):
                raise UserError(f"{root / HEADER}: split {name} ({start}+{n}) runs past the {count} rows; {fix}")
            splits[name] = (start, n)
        else:
            index = _load_npy(root / f"{name}.npy", f"index of split {name}", fix)
            if index.shape != (n,) or not np.issubdtype(index.dtype, np.integer):
                raise UserError(f"{root / name}.npy holds {index.dtype} {index.shape}, not {n} row numbers; {fix}")
            splits[name] = index
    return PackedDataset(root, header, rows, labels, splits)


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

    def __init__(self, rows, where, height: int, width: int, device: torch.device):
        self.rows = rows  # (count, R) uint8: np.memmap of the whole dataset, or a tensor of this split's rows
        self.where = where  # split -> rows: (start, count), or (n,) row numbers; None: `rows` is the split
        self.height, self.width = height, width
        self.device = device

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
        return PackedImages(rows, self.where, self.height, self.width, torch.device(device))

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
        """(k,) positions in the split -> (k, R) packed rows from the memory map (into `out` if given)."""
        return np.take(self.rows, self._row_numbers(pos), axis=0, out=out)

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
        return PackedImages(self.rows, self._row_numbers(pos), self.height, self.width, self.device)

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
