"""`vitmask pack`: any configured source -> a packed dataset directory (packed.py), streamed.

The images pass through the training preprocessing (`preprocess.binarize_images`: fit, threshold,
invert) in chunks and are written as packed rows in the source's own order: the npy source is read
chunk by chunk from its memory maps, so a pack of any size holds a few chunks, the split's row
numbers (int32: 4 bytes an image) and the labels; the other sources are read as they are for
training, then packed chunk by chunk. The train/val/test split is the one training on the source
would make (`sources.split_plan`, the config's split seed and fractions), stored as row numbers, so
a packed dataset trains on the same images in the same order as its source.

The labels are the source's, as training reads them. Labels that are there but cannot be used (a
labels array or file that cannot be read or does not match the images, labels for some images only:
`sources.UnusableLabels`) are refused in one line that gives their reason, before anything is
written, unless `--no-labels` (`labels=False`) asks for a pack without labels; a source that has no
labels gives a pack without them (`classes: null`) and one note on stderr saying so.

Everything is written into a hidden temporary directory beside `--out` and moved onto it only
when complete, and only over the pack (or empty folder) that `--out` named when the pack began:
anything else found there at the end (a file, a folder or a link that appeared meanwhile) is left
as it is, in one line (outputs.py). An interrupted pack (a signal, a kill, a full disk) never
leaves a directory that looks whole, and a stop by SIGINT or SIGTERM (`errors.Stopped`) removes
the temporary directory before the process ends (the renames and the removals run with both
signals held back, so a signal cannot land between them). An `--out` that is a symbolic link to a
pack (or to an empty folder) is packed where the link points; the link stays. The missing folders
above `--out` are made, and removed again when the pack fails. The same inputs and config give
the same bytes (no times, sorted JSON keys). A pack whose images are more than half foreground
once binarized ends with one warning line: they look inverted, and the line names data.invert
(binarization.warn_if_inverted).

The checksums (packed.py): the rows' SHA-256 and each block's CRC-32 are computed from the bytes
as they are written; `packed.seal` adds the SHA-256 of the other files and of the header.
"""

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from vitmask import outputs
from vitmask.config import Config
from vitmask.data import shapes, sources
from vitmask.data.binarization import warn_if_inverted
from vitmask.data.class_names import pack_classes
from vitmask.data.packed import (
    BLOCKS,
    FORMAT,
    HEADER,
    LABELS,
    ROWS,
    BlockSums,
    is_packed_dir,
    pack_rows,
    row_bytes,
    seal,
)
from vitmask.data.preprocess import binarize_images, binarize_list
from vitmask.errors import UserError
from vitmask.outputs import FileId, OutputTaken, missing_folders_made, nearest_folder, reason
from vitmask.progress import Progress, note
from vitmask.signals import signals_held

CHUNK = 1 << 16  # images binarized and packed at a time
BLOCK_BYTES = 1 << 20  # bytes of rows a block checksum covers (block_rows = BLOCK_BYTES // row bytes, at least 1)
TEMP_MARK = ".packing-"  # a temporary pack directory: .<out name>.packing-<pid>


class PackPlan:
    """What a pack writes: the source's parts (name -> image count, in row order), a generator of
    binary image chunks in that order, the labels (int32 per row) or None, the class names (label i
    is classes[i]: the source's names, as `class_names.source_names` reads them, else the values)."""

    def __init__(self, sizes: dict[str, int], chunks: Iterator[torch.Tensor], labels, classes, description: str):
        self.sizes, self.chunks, self.labels, self.classes, self.description = (
            sizes,
            chunks,
            labels,
            classes,
            description,
        )


def _binary_chunks(raw: dict, cfg) -> Iterator[torch.Tensor]:
    """Raw parts of a source (tensors or lists of mixed-size images) -> (k, S, S) 0/1 chunks, in order."""
    for part in raw.values():
        for start in range(0, len(part), CHUNK):
            chunk = part[start : start + CHUNK]
            yield binarize_list(chunk, cfg) if isinstance(chunk, list) else binarize_images(chunk, cfg)


def plan_npy(cfg: Config) -> PackPlan:
    d = cfg.data
    files = sources.npy_files(d)

    def chunks():
        for f in files:
            for gray in f.gray_chunks(CHUNK):
                yield binarize_images(gray, d)

    labels = np.concatenate([np.full(f.count, i, dtype=np.int32) for i, f in enumerate(files)])
    return PackPlan({"all": sum(f.count for f in files)}, chunks(), labels, [f.name for f in files], f"npy {d.path}")


def plan_in_memory(cfg: Config, seed: int, want_labels: bool = True) -> PackPlan:
    """The other sources, read whole as training reads them (shapes: its own three splits). Their
    labels, unless `want_labels` is False: labels that are there but cannot be used are refused in one
    line (their reason, and --no-labels), a source without labels is one note saying the pack has none."""
    d = cfg.data
    if d.source == "shapes":
        images, labels = shapes.make_labelled_splits(d.num_train, d.num_val, d.num_test, d.image_size, seed)
        flat = np.concatenate([labels[k].numpy() for k in images]).astype(np.int32)
        classes = pack_classes(d, int(flat.max()) + 1 if len(flat) else 0)  # the kinds' names
        return PackPlan({k: len(v) for k, v in images.items()}, iter(images.values()), flat, classes, "shapes")
    readers = {"torchvision": sources.read_torchvision, "idx": sources.read_idx, "folder": sources.read_folder}
    raw, labels = {**readers, "npz": sources.read_npz}[d.source](d)
    what = f"{d.source} {d.name}" if d.source == "torchvision" else f"{d.source} {d.path}"
    flat, classes = None, None
    if want_labels and isinstance(labels, sources.UnusableLabels):
        raise UserError(
            f"the labels of {what} cannot be packed: {labels}; or pass --no-labels to pack the images without labels"
        )
    if want_labels and isinstance(labels, str):
        note(f"vitmask: note: the pack has no labels (classes: null): {labels}")
    elif want_labels:
        flat = np.concatenate([labels[k].numpy() for k in raw]).astype(np.int32)
        classes = pack_classes(d, int(flat.max()) + 1 if len(flat) else 0)  # the source's names, else the values
    return PackPlan({k: len(v) for k, v in raw.items()}, _binary_chunks(raw, d), flat, classes, what)


def check_out(out: Path) -> None:
    """`--out` may be new, an empty folder, or a packed dataset (replaced); anything else is refused."""
    if not out.exists() and not out.is_symlink():
        folder = nearest_folder(out)  # missing folders above --out are made, as mkdir -p would
        if not folder.is_dir():
            raise UserError(f"--out {out}: {folder} is a file, not a folder; pick another --out")
        return
    if out.is_dir() and (is_packed_dir(out) or not any(out.iterdir())):
        return
    raise UserError(
        f"--out {out} exists and is not a vitmask packed dataset, so it is left alone; pass a new path, "
        "or remove it first"
    )


def remove_stale_temps(out: Path) -> None:
    """Delete the temporary directories of packs to `out` whose process is gone (killed mid-pack)."""
    for d in out.parent.glob(f".{out.name}{TEMP_MARK}*"):
        pid = d.name.rsplit("-", 1)[-1]
        alive = pid.isdigit() and _alive(int(pid))
        if d.is_dir() and not alive:
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_rows(
    path: Path, chunks: Iterator[torch.Tensor], count: int, side: int, bar, blocks: BlockSums
) -> tuple[str, int]:
    """Stream packed rows to a .npy file (header, then the rows in order) with plain writes, so a full
    disk is an OSError (a memory map would die of SIGBUS); return their SHA-256 and the count, and
    feed them to `blocks` (each block's CRC-32)."""
    r = row_bytes(side, side)
    h, written = hashlib.sha256(), 0
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False, "shape": (count, r)})
        for images in chunks:
            rows = pack_rows(images)  # (k, R)
            data = rows.tobytes()
            h.update(data)
            blocks.update(rows)
            f.write(data)
            written += len(rows)
            bar.update(len(rows))
        f.flush()
        os.fsync(f.fileno())
    return f"sha256:{h.hexdigest()}", written


def _save(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def split_entries(plan, sizes: dict[str, int], tmp: Path) -> dict[str, dict]:
    """A `split_plan` over parts laid out in order -> the header's splits, writing index files."""
    offsets, at = {}, 0
    for k, n in sizes.items():
        offsets[k] = at
        at += n
    entries = {}
    for name, (part, idx) in plan.items():
        if idx is None:
            entries[name] = {"count": sizes[part], "start": offsets[part]}
            continue
        dtype = np.int32 if at < 2**31 else np.int64
        _save(tmp / f"{name}.npy", idx.numpy().astype(dtype) + dtype(offsets[part]))
        entries[name] = {"count": len(idx), "index": f"{name}.npy"}
    return entries


def target_of(out: Path) -> Path:
    """Where a pack to `out` is written: `out` itself, or where it points when it is a symbolic link
    (so the link keeps pointing at the pack, and its old pack is replaced, not left beside it)."""
    return Path(os.path.realpath(out)) if out.is_symlink() else out


def pack(cfg: Config, out: str | Path, progress: bool = True, labels: bool = True) -> dict:
    """Pack the configured source into the directory `out`; return its header. `labels` False
    (`vitmask pack --no-labels`): the pack holds no labels (classes: null), whatever the source has."""
    given = Path(out)
    d = cfg.data
    if d.source == "packed":
        raise UserError("data.source is already packed; pack the source the dataset was made from")
    check_out(given)
    out = target_of(given)
    check_out(out)
    replaces = outputs.file_id(out)  # the pack or empty folder given, if any: the only thing the pack may replace
    with missing_folders_made(out):
        return _pack(cfg, given, out, progress, replaces, labels)


def _pack(cfg: Config, given: Path, out: Path, progress: bool, replaces: FileId | None, labels: bool = True) -> dict:
    """pack's work, once `out`'s folder exists: the rows into a temp dir beside `out`, renamed into place."""
    d = cfg.data
    seed = cfg.split_seed
    remove_stale_temps(out)
    tmp = out.parent / f".{out.name}{TEMP_MARK}{os.getpid()}"
    try:
        source = plan_npy(cfg) if d.source == "npy" else plan_in_memory(cfg, seed, labels)
        if not labels:
            source.labels, source.classes = None, None
        count = sum(source.sizes.values())
        if d.source == "shapes":
            plan = {k: (k, None) for k in ("train", "val", "test")}
        else:
            plan = sources.split_plan(source.sizes, d, seed, torch.int32 if count < 2**31 else torch.int64)
        tmp.mkdir()
        r = row_bytes(d.image_size, d.image_size)
        blocks = BlockSums(max(1, BLOCK_BYTES // r))
        ink = [0]  # foreground pixels of every image written

        def counted(chunks: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
            for images in chunks:
                ink[0] += int(images.sum(dtype=torch.int64))
                yield images

        with Progress(count, "pack", "img", enabled=progress) as bar:
            checksum, written = write_rows(tmp / ROWS, counted(source.chunks), count, d.image_size, bar, blocks)
        if written != count:
            raise UserError(f"the source gave {written} images where it announced {count}; check data.path")
        if source.labels is not None:
            _save(tmp / LABELS, source.labels)
        _save(tmp / BLOCKS, blocks.finish())
        header = {
            "format": FORMAT,
            "count": count,
            "height": d.image_size,
            "width": d.image_size,
            "row_bytes": r,
            "bit_order": "row-major, first pixel in the most significant bit (np.packbits)",
            "threshold": d.threshold,
            "invert": d.invert,
            "fit": d.fit,
            "classes": source.classes,
            "splits": split_entries(plan, source.sizes, tmp),
            "split_seed": seed,
            "val_fraction": d.val_fraction,
            "test_fraction": d.test_fraction,
            "max_per_class": d.max_per_class,
            "source": source.description,
            "checksum": checksum,
            "block_rows": blocks.block_rows,
        }
        header = seal(header, tmp)
        (tmp / HEADER).write_text(json.dumps(header, indent=1, sort_keys=True) + "\n")
        with signals_held():
            _replace(tmp, out, replaces)
        if count:
            warn_if_inverted(ink[0] / (count * d.image_size**2), d, "the packed images", repack=True)
        return header
    except OSError as e:
        raise UserError(
            f"could not write the packed dataset {given} ({reason(e)}); nothing was written there"
        ) from None
    finally:
        with signals_held():
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def _replace(tmp: Path, out: Path, replaces: FileId | None) -> None:
    """Move the finished `tmp` onto `out` (a real path, not a link). The pack or empty folder that
    stood there when the pack began (`replaces`), if it is still there and still one, is moved aside
    first and then removed; anything else at `out` (a file, a folder, a link that appeared, or a
    pack swapped for something else) is left as it is (`OutputTaken`)."""
    old = None
    if os.path.lexists(out):
        if replaces is None or outputs.file_id(out) != replaces or not (is_packed_dir(out) or _empty_dir(out)):
            raise OutputTaken(out, "--out")
        old = out.parent / f".{out.name}.replaced-{os.getpid()}"
        os.rename(out, old)
    try:
        outputs.rename_new(tmp, out)
    except OSError as e:
        if old is not None:
            with contextlib.suppress(OSError):
                outputs.rename_new(old, out)
        if isinstance(e, FileExistsError):
            raise OutputTaken(out, "--out") from None
        raise
    if old is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())
