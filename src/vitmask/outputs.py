"""Every file vitmask writes outside a checkpoint's own logic goes through here: checked, atomic,
never over a file nobody asked to replace.

`check_out_file` vets an output path before any work is done (a folder, a regular file where a
folder is needed, a device or FIFO, the wrong suffix, a loop of symbolic links, an input it would
overwrite, a file of the dataset's folder; links followed), so a long eval never ends in an
unwritable path and never writes over what it reads. `write_atomically` writes to a temp file
beside the target, flushes it to disk, then moves it into place: a crash, a signal or a full disk
mid-write leaves the old file (or none), never a 0-byte or partial one, and the temp file is
removed on any failure. The temp file is created afresh with O_EXCL and O_NOFOLLOW (`open_new`),
so a symbolic link planted under its name is never written through.

**No output replaces a file the user did not ask to replace.** The last step of every write is
told what it may replace (`replaces`): nothing (a new file: `rename_new`, which fails when
anything stands at the path, a file, a folder or a link, even one that appeared a moment before);
the very file the user named when the command started (`file_id`, compared again at the end); or,
for a run dir's own files under its lock, whatever is there (`REPLACE_ANY`). A command that loses
such a race ends in one line (`OutputTaken`) and leaves what it found.

**Missing folders.** Every verb that writes makes the missing folders above its output, as
`mkdir -p` would, and removes the ones it made when it fails (`missing_folders_made`, or
`make_folder=True`), so a failed command leaves no empty folders behind.

A failed write raises `WriteError`, a `UserError` that says in one line what failed and why (the
disk is full, the file system is read-only, permission denied, ...) and keeps the `errno`, so a
caller with more context (the trainer: which checkpoint survived) can say more.
"""

import contextlib
import ctypes
import errno
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NamedTuple

from vitmask.errors import UserError

DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
REASONS = {
    errno.ENOSPC: "the disk is full (no space left on the device)",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "the file would be too large for the file system",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EISDIR: "it is a folder",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.ENOENT: "no such file or folder",
    errno.ENAMETOOLONG: "the file name is too long",
    errno.EIO: "an input/output error from the device",
    errno.ELOOP: "a symbolic link where a file was expected, or a loop of links",
}
NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # open the link itself, never the file it points to


class WriteError(UserError):
    """A file could not be written; `errno` says why, `path` is the file."""

    def __init__(self, message: str, path: Path, err: int | None, why: str):
        super().__init__(message)
        self.path = path
        self.errno = err
        self.reason = why

    @property
    def disk_full(self) -> bool:
        return self.errno in DISK_FULL


def reason(e: OSError) -> str:
    """A short, plain reason for an OSError: 'the disk is full (...)', 'permission denied', ..."""
    return REASONS.get(e.errno, (e.strerror or e.__class__.__name__).lower())


def os_error_in(e: BaseException) -> OSError | None:
    """`e` itself if it is an OSError, else the first OSError it was raised from (torch wraps them)."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def write_error(e: OSError, path: Path, what: str = "") -> WriteError:
    """The WriteError for an OSError met while writing `path`."""
    label = f"{what} {path}" if what else str(path)
    fix = "free some space and run it again" if e.errno in DISK_FULL else "pick a writable path"
    where = f" (on the device holding {path.parent})" if e.errno in DISK_FULL else ""
    why = reason(e)
    return WriteError(f"cannot write {label}: {why}{where}; nothing was written; {fix}", path, e.errno, why)


def nearest_folder(path: Path) -> Path:
    """The nearest folder above `path` that exists (where missing folders of an output are made)."""
    return next(q for q in path.parents if q.exists() or q == q.parent)


@contextlib.contextmanager
def missing_folders_made(path: Path):
    """Make the missing folders above `path` (as `mkdir -p` would) for the block, and remove the ones
    it made when the block fails, so a failed output leaves no empty folders behind."""
    made = []
    for q in path.parents:
        if q.exists():
            break
        made.append(q)  # innermost first
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield made
    except BaseException:
        for q in made:
            with contextlib.suppress(OSError):
                q.rmdir()
        raise


def temp_path(path: Path, n: int = 0) -> Path:
    """The temp file beside `path` that an atomic write goes through: hidden, per process (and per
    write under way in it: `n`), and ending in the target's suffix (so a library that picks a format
    by the name picks the right one)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}{f'-{n}' if n else ''}{path.suffix}")


_temps_in_use: set[Path] = set()
_temps_lock = threading.Lock()


@contextlib.contextmanager
def temp_file_name(path: Path):
    """A temp name beside `path` that no other write of this process is using now (two threads, or
    a write inside another, writing the same target each get their own)."""
    with _temps_lock:
        n = 0
        while temp_path(path, n) in _temps_in_use:
            n += 1
        tmp = temp_path(path, n)
        _temps_in_use.add(tmp)
    try:
        yield tmp
    finally:
        with _temps_lock:
            _temps_in_use.discard(tmp)


# ---- the last step: what it may replace ------------------------------------------------------------
class FileId(NamedTuple):
    """Which file stands at a path (its device and inode, links not followed)."""

    device: int
    inode: int


REPLACE_ANY = "any"  # a run dir's own files (checkpoints, config.yaml), written under the run dir's lock
Replaces = FileId | str | None  # None: the output must be new


def file_id(path: str | Path) -> FileId | None:
    """The file (or folder, or link) at `path` now, or None when nothing is there: taken when a
    command starts, it is the file the user named, which the command may replace at its end."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return FileId(st.st_dev, st.st_ino)


class OutputTaken(UserError):
    """Something that the command may not replace stood at its output path when the result was to be
    moved there (it appeared, or was swapped, while the command ran)."""

    def __init__(self, path: Path, what: str = ""):
        label = f"{what} {path}" if what else str(path)
        super().__init__(
            f"{label} was created or changed by someone else while this command ran, so it is left as it is "
            "and this command's result was not written; run the command again (with a new path if need be)"
        )
        self.path = path


RENAME_NOREPLACE = 1  # renameat2's flag: fail with EEXIST rather than replace
AT_FDCWD = -100
_renameat2_fn = None


def _renameat2(src: Path, dst: Path) -> int:
    """renameat2(src, dst, RENAME_NOREPLACE): 0, or the errno; ENOSYS where the C library lacks it."""
    global _renameat2_fn
    if _renameat2_fn is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):  # not glibc 2.28+ (or not Linux)
            fn = False
        _renameat2_fn = fn
    if not _renameat2_fn:
        return errno.ENOSYS
    if _renameat2_fn(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) == 0:
        return 0
    return ctypes.get_errno()


NOT_SUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM}


def rename_new(src: str | Path, dst: str | Path) -> None:
    """Move the file or folder `src` to `dst` only when nothing stands at `dst` (a file, a folder,
    an empty folder, a link, a dangling link): FileExistsError otherwise, and `dst` is untouched.

    One atomic renameat2(RENAME_NOREPLACE) where the kernel and the file system take it (Linux);
    elsewhere a file is hard-linked to `dst` (link() never replaces) and `src` unlinked, or, where
    the file system has no hard links, `dst` is first created empty with O_EXCL and then replaced;
    a folder, which cannot be linked, is renamed after a last look at `dst`.
    """
    src, dst = Path(src), Path(dst)
    err = _renameat2(src, dst)
    if err == 0:
        return
    if err not in NOT_SUPPORTED:
        raise OSError(err, os.strerror(err), str(dst))
    if src.is_dir() and not src.is_symlink():
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
        os.rename(src, dst)
        return
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in NOT_SUPPORTED | {errno.EMLINK, errno.EXDEV}:
            raise
        os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o666))  # FileExistsError
        os.replace(src, dst)
        return
    os.unlink(src)


def place(tmp: Path, path: Path, replaces: Replaces, what: str = "") -> None:
    """The last step of a write: move the finished `tmp` to `path`, replacing only what `replaces`
    allows (module docstring); `OutputTaken` when something else stands there."""
    if replaces == REPLACE_ANY:
        os.replace(tmp, path)
        return
    if replaces is not None and file_id(path) == replaces:  # the file the user named, still there
        os.replace(tmp, path)
        return
    try:
        rename_new(tmp, path)
    except FileExistsError:
        raise OutputTaken(path, what) from None


def write_atomically(
    path: str | Path,
    write: Callable[[BinaryIO], None],
    what: str = "",
    make_folder: bool = True,
    replaces: Replaces = None,
) -> Path:
    """Call `write(f)` on a temp file beside `path`, fsync it, and move it to `path`, replacing only
    what `replaces` allows: None (the default), nothing, `path` must be new; a `FileId`, that file
    (the one the user named when the command started); `REPLACE_ANY`, whatever is there.

    On any failure the temp file is removed and `path` is as it was; an OSError (also one that a
    library wrapped in another exception) becomes a one-line `WriteError`, something else standing
    at `path` an `OutputTaken`. With `make_folder` (the default), the missing folders of `path` are
    created first, and removed again when the write fails.
    """
    path = Path(path)
    try:
        with missing_folders_made(path) if make_folder else contextlib.nullcontext(), temp_file_name(path) as tmp:
            try:
                with open_new(tmp) as f:
                    write(f)
                    f.flush()
                    os.fsync(f.fileno())
                place(tmp, path, replaces, what)
            finally:
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass
    except Exception as e:
        if isinstance(e, UserError):
            raise
        cause = os_error_in(e)
        if cause is None:
            raise
        raise write_error(cause, path, what) from None
    return path


def open_new(path: Path) -> BinaryIO:
    """A new file at `path` for writing (its descriptor can also read it back, as the checkpoint
    checksum does), opened without following a symbolic link: whatever stood there (a temp file of
    a killed process, a link planted by someone else) is unlinked first, and the open fails rather
    than write through a link created in between."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | NO_FOLLOW  # readable: the checkpoint checksum reads it back
    return open(path, "wb", opener=lambda p, _: os.open(p, flags, 0o666))  # keeps its name (a library reads it)


def write_bytes(
    path: str | Path, data: bytes, what: str = "", make_folder: bool = True, replaces: Replaces = None
) -> Path:
    return write_atomically(path, lambda f: f.write(data), what, make_folder, replaces)


def write_text(
    path: str | Path, text: str, what: str = "", make_folder: bool = True, replaces: Replaces = None
) -> Path:
    return write_bytes(path, text.encode(), what, make_folder, replaces)


def check_out_file(
    path: str | Path,
    flag: str = "--out",
    suffixes: tuple[str, ...] = (".png",),
    inputs: tuple[str | Path | None, ...] = (),
    make_folder: bool = True,
    input_folders: tuple[str | Path | None, ...] = (),
) -> Path:
    """Refuse an output path that cannot or must not be written, before any work is done.

    `suffixes` are the accepted endings (empty: any); `inputs` are files the command reads, which
    the output must not replace (links followed); `input_folders` are folders every file of which
    the command reads (a dataset): the output must not be an existing file inside one. With `make_folder`, the
    folder may be missing (the writer creates it: `write_atomically(..., make_folder=True)`) if the
    nearest existing one is writable. A path that is a loop of symbolic links is refused.
    """
    path = Path(path)
    check_not_a_link_loop(path, flag)
    example = f"out{suffixes[0]}" if suffixes else "out.txt"
    if suffixes and path.suffix.lower() not in suffixes:
        kinds = " or ".join(suffixes)
        raise UserError(f"{flag} {path} must end in {kinds} (it must be a {kinds} file); pass a path such as {example}")
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; pass a file path such as {path / example}")
    if path.exists() and not path.is_file():
        raise UserError(f"{flag} {path} exists and is not a regular file; pass a new file path such as {example}")
    for source in inputs:
        if source is not None and _same_file(path, Path(source)):
            raise UserError(f"{flag} {path} is the input file {source}; it would be overwritten; write to another path")
    for folder in input_folders:
        if folder is not None and _inside(path, Path(folder)):
            raise UserError(
                f"{flag} {path} is a file of the data folder {folder}, which the command reads; it would be "
                "overwritten; write to another path"
            )
    folder = path.parent
    if make_folder:  # the nearest folder that exists must take the new ones
        folder = next(q for q in [folder, *folder.parents] if q.exists() or q == q.parent)
    if not folder.exists():
        raise UserError(f"the folder of {flag} {path} does not exist; create {folder} or pick another {flag}")
    if not folder.is_dir():
        raise UserError(f"the folder of {flag} {path} is a file ({folder}), not a folder; pick another {flag}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"cannot write into {folder} (permission denied); pick another {flag}")
    return path


def check_not_a_link_loop(path: str | Path, flag: str) -> None:
    """Refuse a path that is a loop of symbolic links (or runs through one), in one line."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(
                f"{flag} {path} is a loop of symbolic links (it never reaches a file); pass a plain file path"
            ) from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a loop of links (pathlib before 3.13)
        return False


def _inside(path: Path, folder: Path) -> bool:
    """Whether `path` (links followed) is an existing file under `folder`."""
    try:
        if not folder.is_dir() or not path.is_file():
            return False
        target, root = path.resolve(), folder.resolve()
    except (OSError, RuntimeError):
        return False
    return root in target.parents


def mute_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, after its reader went away or its disk filled:
    nothing more is said there, and the interpreter's last flush at exit fails quietly."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
