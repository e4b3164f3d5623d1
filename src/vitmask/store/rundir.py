"""The run dir: which checkpoint a run continues, who owns the dir, and what a failed run leaves.

Resolving a run (`resolve`), before anything is written:

- `--resume PATH`: that checkpoint; the run dir is `--run-dir`, else PATH's folder. A fine-tuning
  checkpoint (by either form) is refused, naming the `vitmask finetune` command that resumes it.
- `--resume auto`: the run dir's newest checkpoint that loads: last.pt, else the step_*.pt files
  newest first. A damaged one is passed over with one warning line; a run dir whose checkpoints
  all fail to load is refused (it is never started afresh over them). No checkpoint at all: a
  fresh start.
- A fresh run on a pack (data.source packed) takes how its images were made binary from the
  pack's header (data/binarization.py: one note line over the config file's values, a contradicting
  `--set` refused unless `force_preprocessing`); a resumed run keeps its checkpoint's config.
- A fresh run gets a new run id; a resumed one keeps its checkpoint's. Every checkpoint carries
  the id (`run_id`), and a run dir's id is that of its newest loadable checkpoint.
- Foreign runs: `--resume PATH --run-dir DIR` is refused when DIR holds checkpoints of another
  run, that is, when PATH is not in DIR and its run id differs from DIR's (checkpoints without an
  id, from before ids, count as another run's unless they lie in DIR). Into a dir without
  checkpoints it starts a new run (a fork, with a new id) from PATH's state.
- Config changes on resume: the checkpoint's config is the run's. Only the keys in `RESUMABLE`
  (run length, cadences, compile, determinism, precision, loggers, early stopping, where the data
  lives, the name) may differ, and they are applied; they are printed, and config.yaml and every
  later checkpoint hold them. Any other difference (`--set` or an edited `--config`) is refused, naming each key
  with its old and new value, since the optimizer and schedule state would silently keep the old
  value while config.yaml claimed the new one.

Owning the dir (`RunDir`, a context manager; under torchrun only rank 0 enters it):

- A lock: `fcntl.flock` on `.vitmask.lock` in the run dir, held for the run's life and released
  on any exit by the kernel itself (so a lock left by a killed process never blocks). A second
  process gets one line naming the holder's pid.
- A fresh run needs a dir without checkpoints and without files of its own (only leftovers of
  an earlier vitmask start that wrote no checkpoint are allowed with `--resume auto`).
- A run that fails or is stopped in a dir that held no checkpoint (a fresh start, or a resume
  forked into a new --run-dir) before it wrote its first checkpoint removes every file it made
  (config.yaml, event files, the lock, the dir if it made it), so the same command can simply be
  run again. A run continued in a dir with checkpoints removes none of the run's files; only an
  empty file it made itself (an event file a full disk left at 0 bytes) goes.
- Links: the lock is opened with O_NOFOLLOW, and a symbolic link in place of a file vitmask
  writes in the dir (the lock, config.yaml, a checkpoint, an event file) is refused before
  anything is written, so no file elsewhere is ever written or removed through the run dir.
- A full disk (or any failed write) during training ends in one line that says which file could
  not be written, where, which checkpoint is intact, and the command that resumes it
  (`write_failure`; `vitmask finetune` names itself there, `WriteFailure.resumed_with`).
"""

import contextlib
import errno
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from vitmask.config import Config, flatten_config, load_config
from vitmask.data.binarization import Asked, Said, follow_pack
from vitmask.errors import UserError, warn
from vitmask.outputs import WriteError, os_error_in, reason, write_error
from vitmask.signals import resume_command, signals_held
from vitmask.store.checkpoint import (
    STEP_FILE,
    check_resumable,
    config_of,
    load_checkpoint,
    remove_stale_temps,
    step_files,
)
from vitmask.store.init_weights import InitWeights

LOCK_NAME = ".vitmask.lock"
NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
CHECKPOINT_NAMES = ("last.pt", "best.pt")
METRICS_NAMES = ("metrics.csv", "metrics.jsonl")  # the csv and jsonl loggers' files (train/loggers.py)
# keys a resume may change: how long and how the run goes on, not what it learns from or how
RESUMABLE = (
    "name",
    "train.max_steps",
    "train.eval_every",
    "train.checkpoint_every",
    "train.log_every",
    "train.eval_images",
    "train.keep_last",
    "train.compile",
    "train.compile_mode",
    "train.step_shapes",
    "train.deterministic",
    "train.precision",
    "train.probe_every",
    "train.loggers",
    "train.early_stop_patience",
    "train.early_stop_metric",
    "train.early_stop_mode",
    "train.early_stop_min_delta",
    "data.path",
    "data.download",
)


@dataclass
class Resolved:
    """What `vitmask train` will do: where, with which config, from which checkpoint."""

    run_dir: Path
    cfg: Config
    state: dict | None  # the checkpoint continued from; None for a fresh start
    source: Path | None  # its path
    run_id: str
    changes: list[str]  # "key old -> new" for each RESUMABLE key changed on resume
    init: InitWeights | None = None  # the weights a new run starts from (vitmask train --init)
    said: Said = ()  # lines on what the config took from a record (binarization.follow), said as the run starts


# ---- which checkpoint -------------------------------------------------------------------------
def checkpoint_files(run_dir: Path) -> list[Path]:
    """Every checkpoint of a run dir, in the order --resume auto tries them: last.pt, the step
    files newest first, then best.pt (an earlier state, but a whole one)."""
    last, best = run_dir / "last.pt", run_dir / "best.pt"
    steps = [p for _, p in reversed(step_files(run_dir))]
    return [p for p in (last, *steps, best) if p.is_file()]


def has_checkpoints(run_dir: Path) -> bool:
    return run_dir.is_dir() and bool(checkpoint_files(run_dir))


def newest_good_checkpoint(run_dir: Path) -> tuple[dict, Path] | None:
    """The newest checkpoint of `run_dir` that loads and can be resumed (a warning line for each
    one passed over), or None when there is none; a dir whose checkpoints all fail is refused."""
    failures = []
    for path in checkpoint_files(run_dir):
        try:
            state = load_checkpoint(path)
            check_resumable(state, path)
        except UserError as e:
            failures.append((path, str(e)))
            continue
        if failures:
            first, why = failures[0]
            warn(f"{first.name} cannot be used ({why}); resuming from {path.name} instead")
        return state, path
    if failures:
        raise UserError(
            f"no checkpoint in {run_dir} can be resumed (last tried: {failures[-1][1]}); "
            "restore a good copy, or start a new run with another --run-dir"
        )
    return None


def run_id_of_dir(run_dir: Path) -> str | None:
    """The run id of the newest loadable checkpoint of `run_dir` (None: none has one)."""
    for path in checkpoint_files(run_dir):
        try:
            found = load_checkpoint(path).get("run_id")
        except UserError:
            continue
        return found if isinstance(found, str) else None
    return None


def check_same_run(state: dict, path: Path, run_dir: Path) -> bool:
    """Refuse to resume checkpoint `path` into a `run_dir` holding another run's checkpoints.

    Returns whether it is the same run: False for a new run forked from `path` into a dir without
    checkpoints. With run ids on both sides they decide; without, the checkpoint must lie in the dir.
    """
    inside = same_dir(path.parent, run_dir)
    if not has_checkpoints(run_dir):
        return inside
    theirs, ours = run_id_of_dir(run_dir), state.get("run_id")
    same = theirs == ours if isinstance(ours, str) and theirs is not None else inside
    if not same:
        raise UserError(
            f"run dir {run_dir} holds the checkpoints of another run, and {path} is not one of them; "
            f"resuming it there would overwrite them; continue it in its own run dir ({path.parent}) "
            "or in a new, empty --run-dir"
        )
    newest = max((step for step, _ in step_files(run_dir)), default=-1)
    if newest > int(state["step"]):
        warn(
            f"resuming {path.name} (step {state['step']}) although {run_dir} holds checkpoints up to step "
            f"{newest}; those later step files will be replaced as the run passes their steps"
        )
    return True


def same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


# ---- which config -----------------------------------------------------------------------------
def reconcile(trained: Config, asked: Config) -> list[str]:
    """The RESUMABLE changes from `trained` to `asked`; any other difference is refused."""
    old, new = flatten_config(trained), flatten_config(asked)
    diff = [k for k in new if old.get(k) != new[k]]
    refused = [k for k in diff if k not in RESUMABLE]
    if refused:
        shown = ", ".join(f"{k} ({old.get(k)!r} -> {new[k]!r})" for k in refused[:6])
        more = f" and {len(refused) - 6} more" if len(refused) > 6 else ""
        raise UserError(
            f"a resumed run keeps the config it was trained with, but this asks to change {shown}{more}; "
            f"drop those --set (or --config edits), or start a new run with another --run-dir "
            f"(a resume may change only {', '.join(RESUMABLE)})"
        )
    return [f"{k} {old.get(k)!r} -> {new[k]!r}" for k in diff]


def resolve(
    config: Path | None,
    overrides: list[str],
    run_dir: Path | None,
    resume: str | None,
    force_preprocessing: bool = False,
) -> Resolved:
    """Decide the run dir, the checkpoint and the config of `vitmask train` (nothing is written).
    A fresh run on a pack follows its header (`follow_pack`; `force_preprocessing` keeps a `--set`
    that contradicts it)."""
    state = source = None
    same_run = True
    if resume is not None and resume != "auto":
        source = Path(resume)
        state = load_checkpoint(source)
        run_dir = Path(run_dir) if run_dir is not None else source.parent
        refuse_finetuning(state, source, run_dir, resume)
        check_resumable(state, source)
        same_run = check_same_run(state, source, run_dir)
    elif resume == "auto":
        if run_dir is None:  # the config names the run dir
            if config is None:
                raise UserError("--resume auto needs --run-dir DIR, or --config PATH to name runs/<name>")
            run_dir = Path("runs") / load_config(config, overrides).name
        found = newest_good_checkpoint(Path(run_dir))
        if found is not None:
            state, source = found
            refuse_finetuning(state, source, Path(run_dir), resume)
    if state is None:
        if config is None:
            where = f" (no checkpoint in {run_dir} to continue)" if resume == "auto" else ""
            raise UserError(f"no config given{where}; pass --config PATH (for example configs/default.yaml)")
        cfg, said = follow_pack(load_config(config, overrides), Asked.of(config, overrides, force_preprocessing))
        where = Path(run_dir) if run_dir else Path("runs") / cfg.name
        return Resolved(where, cfg, None, None, new_run_id(), [], said=said)
    trained = config_of(state, source)
    asked = load_config(config, overrides) if config is not None else config_of(state, source, overrides)
    changes = reconcile(trained, asked)
    if asked.train.max_steps < state["step"]:
        raise UserError(
            f"checkpoint {source} is at step {state['step']}, past train.max_steps ({asked.train.max_steps}); "
            f"to train on, raise it: --set train.max_steps=N with N > {state['step']}"
        )
    run_id = state.get("run_id") if same_run and isinstance(state.get("run_id"), str) else new_run_id()
    return Resolved(Path(run_dir), asked, state, source, run_id, changes)


def refuse_finetuning(state: dict, source: Path, run_dir: Path, resume: str) -> None:
    """`vitmask train --resume` of a fine-tuning checkpoint: one line naming the command that resumes it."""
    if state.get("task") == "finetune":
        raise UserError(
            f"checkpoint {source} is a fine-tuned classifier (vitmask finetune), not a masked-patch model, so vitmask "
            f"train cannot resume it; resume it with: vitmask finetune --run-dir {run_dir} --resume {resume}"
        )


def new_run_id() -> str:
    return uuid.uuid4().hex


# ---- owning the dir ---------------------------------------------------------------------------
def _is_own_name(name: str) -> bool:
    """A name vitmask writes in a run dir: the lock, config.yaml, checkpoints, event and metrics files, temps."""
    return (
        name in (LOCK_NAME, "config.yaml", *CHECKPOINT_NAMES, *METRICS_NAMES)
        or STEP_FILE.fullmatch(name) is not None
        or name.startswith("events.out.tfevents.")
        or ".tmp-" in name
    )


def _is_leftover(p: Path) -> bool:
    """Files an earlier vitmask start leaves without a checkpoint: its config, events, metrics, temps, lock."""
    n = p.name
    return p.is_file() and (
        n in ("config.yaml", LOCK_NAME, ".write-test", *METRICS_NAMES)
        or n.startswith("events.out.tfevents.")
        or ".tmp-" in n
    )


class RunDir:
    """Own a run dir for the life of a run: create it, lock it, vet it, clean up after a failed start.

    `fresh` is a start without a checkpoint; `auto` says --resume auto asked for it (so leftovers of
    an earlier start without a checkpoint are allowed).
    """

    def __init__(self, path: Path, fresh: bool, auto: bool = False):
        self.path = Path(path)
        self.fresh = fresh
        self.auto = auto
        self._fd: int | None = None
        self._made: list[Path] = []  # folders this process created, outermost first
        self._before: set[str] = set()  # names in the dir before this process wrote anything

    # -- entering ---------------------------------------------------------------------------
    def __enter__(self) -> "RunDir":
        self._make_dir()
        try:
            self._before = {p.name for p in self.path.iterdir()}
            self._refuse_links()
            self._lock()
            if self.fresh:
                self._check_fresh()
            remove_stale_temps(self.path)
        except BaseException:
            self._release()
            self._remove_made()
            raise
        return self

    def _make_dir(self) -> None:
        p = self.path
        if p.exists() and not p.is_dir():
            raise UserError(f"run dir {p} is a file, not a folder; pass a folder path as --run-dir")
        missing = []
        for q in [p, *p.parents]:
            if q.exists():
                break
            missing.append(q)
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(
                f"run dir {p} is not writable: it cannot be created ({reason(e)}); pass a writable --run-dir"
            ) from None
        self._made = list(reversed(missing))
        if not os.access(p, os.W_OK | os.X_OK):
            self._remove_made()
            raise UserError(f"run dir {p} is not writable (permission denied); pass a writable --run-dir")

    def _refuse_links(self) -> None:
        """Refuse a symbolic link where vitmask writes a file of its own (a write or the removal of
        a failed start would otherwise reach the file it points to, or stand in for it)."""
        for p in self.path.iterdir():
            if p.is_symlink() and _is_own_name(p.name):
                raise UserError(
                    f"run dir {self.path}: {p.name} is a symbolic link (to {os.readlink(p)}), where vitmask writes "
                    "a file of its own; remove the link, or pick another --run-dir"
                )

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return
        lock = self.path / LOCK_NAME
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | NO_FOLLOW, 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise UserError(
                        f"run dir {self.path}: {LOCK_NAME} is a symbolic link, where vitmask keeps its lock file; "
                        "remove the link, or pick another --run-dir"
                    ) from None
                raise UserError(
                    f"run dir {self.path} is not writable ({reason(e)}); pass a writable --run-dir"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                raise UserError(
                    f"run dir {self.path} is in use by another vitmask process (pid {holder}); wait for it to end "
                    "or stop it, or pick another --run-dir"
                ) from None
            except OSError as e:  # a file system without flock: go on unlocked
                warn(f"cannot lock run dir {self.path} ({reason(e)}); make sure no other run writes there")
                os.close(fd)
                return
            # the file locked must still be the one at the path (a process releasing it unlinks it;
            # anyone may have put a link there meanwhile: lstat sees the link, and the next open refuses it)
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(lock))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            if os.fstat(fd).st_nlink != 1:  # a hard link to a file elsewhere: writing the pid would change it
                os.close(fd)
                raise UserError(
                    f"run dir {self.path}: {LOCK_NAME} has other hard links, so it is not vitmask's own lock file; "
                    "remove it, or pick another --run-dir"
                )
            self._fd = fd
            try:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
            except OSError as e:
                raise write_error(e, lock, "lock file") from None
            return

    def _check_fresh(self) -> None:
        others = sorted(
            p.name for p in self.path.iterdir() if p.name != LOCK_NAME and not (self.auto and _is_leftover(p))
        )
        if not others:
            return
        if has_checkpoints(self.path):
            raise UserError(
                f"run dir {self.path} already holds checkpoints; continue it with --resume auto, "
                "or start a new run with --run-dir DIR"
            )
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        if self.auto:
            raise UserError(
                f"run dir {self.path} has no checkpoint to resume and holds files that are not a vitmask run's "
                f"({shown}); pick another --run-dir"
            )
        raise UserError(
            f"run dir {self.path} already exists and is not empty ({shown}); continue it with --resume auto, "
            "or start a new run with --run-dir DIR"
        )

    # -- leaving ----------------------------------------------------------------------------
    def __exit__(self, kind, exc, tb) -> None:
        with signals_held():  # a second Ctrl-C must not cut the clean-up short; it is delivered after
            started = exc is not None and not has_checkpoints(self.path)  # a start, fresh or forked
            try:
                if started:
                    self._remove_own_files()
                elif exc is not None:
                    self._remove_own_files(empty_only=True)
            finally:
                self._release()
                if started:
                    self._remove_made()

    def _remove_own_files(self, empty_only: bool = False) -> None:
        """Remove the files this process made (`empty_only`: those left at 0 bytes), so a failed start
        does not block a retry and a full disk leaves no empty file."""
        for p in self.path.iterdir():
            if p.name not in self._before and p.name != LOCK_NAME and _is_leftover(p) and not p.is_symlink():
                with contextlib.suppress(OSError):
                    if not empty_only or p.stat().st_size == 0:
                        p.unlink()

    def _release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(self._fd), os.lstat(self.path / LOCK_NAME)):  # still ours, not a stand-in
                (self.path / LOCK_NAME).unlink()  # while still holding it: see _lock
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = None

    def _remove_made(self) -> None:
        for d in reversed(self._made):  # innermost first; only if empty
            with contextlib.suppress(OSError):
                d.rmdir()


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


# ---- a failed write during training -----------------------------------------------------------
def last_checkpoint(run_dir: Path) -> tuple[Path, int] | None:
    """The checkpoint --resume auto would continue (path, step): last.pt, else the newest step
    file, else best.pt; last.pt's step is read from the step file it links to where there is one."""
    last = run_dir / "last.pt"
    if last.is_file():
        for step, p in reversed(step_files(run_dir)):
            with contextlib.suppress(OSError):
                if os.path.samefile(p, last):
                    return last, step
        with contextlib.suppress(UserError):
            return last, int(load_checkpoint(last)["step"])
    steps = step_files(run_dir)
    if steps:
        return steps[-1][1], steps[-1][0]
    best = run_dir / "best.pt"
    with contextlib.suppress(UserError, KeyError, TypeError, ValueError):
        return best, int(load_checkpoint(best)["step"])
    return None


class WriteFailure(UserError):
    """A failed write during training, in one line: what could not be written, where, why, and which
    checkpoint is intact with the command that resumes it (`resumed_with` names another verb)."""

    def __init__(self, step: int, what: str, run_dir: Path, why: str, kept: tuple[Path, int] | None, verb: str):
        if kept is not None:
            intact = (
                f"the last checkpoint, {kept[0]} (step {kept[1]}), is intact; once there is room, "
                f"resume with: {resume_command(verb, run_dir)}"
            )
        else:
            intact = (
                "no checkpoint had been written yet, so the run left nothing behind; run it again once there is room"
            )
        super().__init__(f"training stopped at step {step}: cannot write {what} in {run_dir}: {why}; {intact}")
        self.parts = (step, what, run_dir, why, kept)

    def resumed_with(self, verb: str) -> "WriteFailure":
        return WriteFailure(*self.parts, verb)


def write_failure(e: BaseException, run_dir: Path, step: int, verb: str = "train") -> WriteFailure | None:
    """The one-line error for a failed write (a full disk, ...) during a run of `vitmask VERB`,
    naming what survived; None when `e` is not a failed write."""
    if isinstance(e, WriteError):
        what, why = e.path.name, e.reason
    else:
        os_err = os_error_in(e)
        if os_err is None:
            return None
        what = Path(os_err.filename).name if isinstance(os_err.filename, str) else "the TensorBoard event file"
        why = reason(os_err)
    return WriteFailure(step, what, run_dir, why, last_checkpoint(run_dir), verb)


@contextlib.contextmanager
def quiet_writer_threads():
    """TensorBoard writes its events from a thread, whose OSError (a full disk) is raised again in
    the main thread at the next log call; keep the thread from printing its own traceback too."""
    old = threading.excepthook

    def hook(args):
        if not isinstance(args.exc_value, OSError):
            old(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = old
