"""A sweep's storage, its study and the loop each worker runs (docs/sweeps.md#resuming-and-sharing).

Storage: a database URL as SQLAlchemy takes it, through Optuna's `RDBStorage`: `sqlite:///runs/sweep.db`
(one machine; the file's missing folders are made), `postgresql://user:pass@host/db` (several
machines). Every trial of a study lives there; the run dirs live under each worker's `--out`.

The study: the first worker makes it and keeps in its user attributes what defines it: the metric,
the space and the config the trials start from (every key but `name`); its direction is Optuna's
own. A later command on the same study must name the same four, or it is refused in one line.

`--trials N` is the number of finished trials (COMPLETE or PRUNED) the study has in all, whoever ran
them. Each worker loops: the study has N finished trials: done; finished and running trials reach N:
the rest is running elsewhere, so it waits (polling every POLL_S seconds) for them to end, going on
where one fails; else it runs one trial (`study.optimize(n_trials=1)`). A rerun of the same command
runs what is missing only; one with a larger N adds trials. Two workers that ask for a trial at the
same moment may make one too many: the one of the higher number gives way (objective.Surplus).

A killed worker (SIGKILL, a lost machine) leaves its trial RUNNING. That trial is marked FAIL and
run again once, as a new trial with the same values in a run dir of its own (Optuna's
`RetryHeartbeatStaleTrialCallback(max_retry=1)`; its `failed_trial` system attribute names the
trial it retries):
- by any worker on the same machine as soon as it starts or waits, when the trial's process is
  gone (its `worker` attribute: host, boot, pid and the process's start time);
- by any worker anywhere once the trial's heartbeat is older than twice `--heartbeat` seconds
  (Optuna's heartbeat: each running trial's worker records one every `--heartbeat` seconds).
A trial stopped by SIGINT or SIGTERM writes its checkpoint, is marked FAIL and is run again the
same way; the command exits 130 or 143 with one line.

No finished trial is ever run again, and no trial number is used twice (the database hands them out).
"""

import contextlib
import dataclasses
import difflib
import json
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.exceptions import ExperimentalWarning, UpdateFinishedTrialError
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from vitmask.config import ConfigSource, flatten_config, load_config
from vitmask.errors import Stopped, UserError, warn
from vitmask.outputs import missing_folders_made, reason
from vitmask.signals import STOP_SIGNALS, Interrupted
from vitmask.sweep.objective import Objective, Surplus, TrialFailed, param_text, process_start, this_worker
from vitmask.sweep.space import Space, check_values, load_space
from vitmask.train.callbacks import improvement_mode
from vitmask.train.trainer import Trainer

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
MAX_RETRY = 1  # a killed or stopped trial is run again once
HEARTBEAT_S = 60  # --heartbeat's default: a trial unheard of for twice this is stale
POLL_S = 1.0  # how often a worker waiting for others' trials looks at the study
FAILURES_IN_A_ROW = 3  # failed trials in a row that stop a worker
SQLITE_TIMEOUT_S = 60  # how long an SQLite write waits for another worker's lock
PRUNERS = ("median", "halving", "none")
DIRECTIONS = ("auto", "minimize", "maximize")


def shown_url(url: str) -> str:
    """The storage URL with its password hidden, as every line names it."""
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return url


def _quiet():
    """Optuna's experimental and deprecation warnings kept off the terminal (it logs its own lines at
    ERROR only, `quiet_optuna`): the sweep says what happens in its own lines."""
    context = warnings.catch_warnings()
    context.__enter__()
    warnings.simplefilter("ignore", ExperimentalWarning)
    warnings.simplefilter("ignore", FutureWarning)
    return context


class quiet_optuna:
    """Within it, Optuna logs errors only and its experimental warnings are off; as it was after."""

    def __enter__(self):
        self.level = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        self.warnings = _quiet()
        return self

    def __exit__(self, *exc):
        self.warnings.__exit__(*exc)
        optuna.logging.set_verbosity(self.level)
        return False


def open_storage(url: str, heartbeat: int | None = None, create: bool = True) -> RDBStorage:
    """Optuna's RDBStorage at `url`, with the heartbeat and the retry of stale trials where
    `heartbeat` is given; one line for a URL it cannot open (a bad URL, a missing driver, an
    unreachable server, an SQLite file that cannot be made, or without `create` is not there)."""
    shown = shown_url(url)
    try:
        parsed = sqlalchemy.engine.make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        raise UserError(
            f"--storage {url!r} is not a database URL; give one such as sqlite:///runs/sweep.db or "
            "postgresql://user:pass@host/db"
        ) from None
    engine: dict[str, Any] = {}
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:") or database.startswith("file::memory:"):
            raise UserError(
                f"--storage {shown} is an in-memory database, lost when the command ends; give a file such as "
                "sqlite:///runs/sweep.db"
            )
        folder = Path(database).parent
        if not create and not Path(database).is_file():
            raise UserError(f"no database at --storage {shown}: {database} is not there; check the URL")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(
                f"cannot open --storage {shown}: its folder {folder} cannot be made ({e.strerror or e}); "
                "give a path in a writable folder"
            ) from None
        engine = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    for attempt in range(5):
        try:
            with quiet_optuna():
                kwargs: dict[str, Any] = {}
                if heartbeat is not None:
                    retry = RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
                    kwargs = {"heartbeat_interval": heartbeat, "heartbeat_stale_trial_callback": retry}
                return RDBStorage(url, engine_kwargs=engine, **kwargs)
        except ImportError as e:
            driver = getattr(e.__cause__, "name", None) or "its database driver"
            postgres = parsed.get_backend_name() == "postgresql"
            example = " (for postgresql://: pip install 'psycopg[binary]')" if postgres else ""
            raise UserError(
                f"cannot open --storage {shown}: its driver, the Python package {driver}, is not installed; "
                f"install it{example}"
            ) from None
        except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError) as e:
            text = " ".join(str(e.orig if e.orig is not None else e).split())
            racing = "already exists" in text or "locked" in text or "UNIQUE constraint" in text
            if attempt < 4 and racing:  # two workers making a new database's tables at once: the second waits
                time.sleep(0.2 * (attempt + 1))
                continue
            raise UserError(f"cannot open --storage {shown}: {text}") from None
        except (sqlalchemy.exc.SQLAlchemyError, ValueError, RuntimeError) as e:
            text = " ".join(str(e).split()).split(" (Background on this error")[0]
            raise UserError(f"cannot open --storage {shown}: {type(e).__name__}: {text}") from None
    raise AssertionError("unreachable")


def direction_of(metric: str, direction: str | None) -> str:
    """minimize or maximize: `direction`, or for auto (None), maximize for an accuracy, minimize otherwise."""
    direction = direction or "auto"
    if direction not in DIRECTIONS:
        near = difflib.get_close_matches(direction, DIRECTIONS, n=1, cutoff=0.5)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise UserError(f"--direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}{hint}")
    if direction != "auto":
        return direction
    return "maximize" if improvement_mode(metric, "auto") == "max" else "minimize"


def check_metric(metric: str, cfg, space: Space) -> None:
    """Refuse a metric that no trial's validations would log: the names are `val/<scalar>`, and
    `val_ema/<scalar>` where every trial has an EMA of the weights (train.ema_decay above 0)."""
    plain = [f"val/{k}" for k in Trainer.VALIDATION_SCALARS]
    ema = [f"val_ema/{k}" for k in Trainer.VALIDATION_SCALARS]
    if metric in plain:
        return
    if metric in ema:
        searched = next((p for p in space.params if p.key == "train.ema_decay"), None)
        if searched is not None:
            if min(v for v in searched.edges() if isinstance(v, (int, float))) <= 0:
                raise UserError(
                    f"--metric {metric} is the EMA's, and the space's train.ema_decay reaches 0 (no EMA); "
                    "keep train.ema_decay above 0, or watch a val/ metric"
                )
            return
        if cfg.train.ema_decay > 0:
            return
        raise UserError(
            f"--metric {metric} is the EMA's, and train.ema_decay is 0 (no EMA) in the config; set train.ema_decay, "
            f"or watch one of {', '.join(plain)}"
        )
    logged = plain + (ema if cfg.train.ema_decay > 0 else [])
    near = difflib.get_close_matches(metric, plain + ema, n=1, cutoff=0.6)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    raise UserError(f"--metric {metric} is never logged by these runs, whose validations log {', '.join(logged)}{hint}")


def make_pruner(name: str) -> optuna.pruners.BasePruner:
    """median: Optuna's MedianPruner (once 5 trials have finished, a trial whose value at a step is worse
    than the median of theirs there); halving: SuccessiveHalvingPruner; none: NopPruner."""
    if name == "median":
        return optuna.pruners.MedianPruner()
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    if name == "none":
        return optuna.pruners.NopPruner()
    near = difflib.get_close_matches(str(name), PRUNERS, n=1, cutoff=0.5)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    raise UserError(f"--pruner must be one of {', '.join(PRUNERS)}, got {name!r}{hint}")


def check_study_name(name: str) -> None:
    if not isinstance(name, str) or not name.strip() or Path(name).name != name or name in (".", ".."):
        raise UserError(f"--study must be a plain name (letters, digits, - and _; no /), got {name!r}")


def _plain(value: Any) -> Any:
    """`value` as JSON gives it back: tuples as lists, what a study's attributes hold."""
    return json.loads(json.dumps(value))


def _defining_config(cfg) -> dict[str, Any]:
    """The config the trials start from, every key but `name` (each trial names itself)."""
    return _plain({k: v for k, v in flatten_config(cfg).items() if k != "name"})


def open_study(
    storage: RDBStorage,
    name: str,
    url: str,
    direction: str,
    metric: str,
    space: Space,
    cfg,
    pruner: optuna.pruners.BasePruner,
) -> optuna.Study:
    """The study `name`, made if new with its record (metric, space, config); an existing one must agree."""
    with quiet_optuna():
        try:
            study = optuna.create_study(
                storage=storage, study_name=name, direction=direction, pruner=pruner, load_if_exists=True
            )
        except sqlalchemy.exc.SQLAlchemyError as e:
            raise UserError(f"cannot open study {name} in {shown_url(url)}: {' '.join(str(e).split())[:300]}") from None
    record = {"metric": metric, "space": space.as_dict(), "config": _defining_config(cfg)}
    attrs = study.user_attrs
    where = f"study {name} in {shown_url(url)}"
    if "space" not in attrs:
        if study.get_trials(deepcopy=False):
            raise UserError(f"{where} was not made by vitmask sweep (it has trials and no space); pass another --study")
        for key, value in record.items():
            study.set_user_attr(key, value)
        attrs = record
    made = study.direction.name.lower()
    if attrs.get("metric") != metric or made != direction:
        raise UserError(
            f"{where} optimises {attrs.get('metric')} ({made}), and this command asks for {metric} ({direction}); "
            f"pass --metric {attrs.get('metric')} --direction {made}, or another --study"
        )
    if attrs.get("space") != record["space"]:
        raise UserError(
            f"{where} was made with another space ({space.difference(attrs.get('space') or {})}); pass the space "
            "it was made with, or another --study"
        )
    if attrs.get("config") != record["config"]:
        theirs, ours = attrs.get("config") or {}, record["config"]
        key = next(k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k))
        raise UserError(
            f"{where} was made with another config ({key}: {json.dumps(theirs.get(key))} there, "
            f"{json.dumps(ours.get(key))} here); pass the config and --set it was made with, or another --study"
        )
    return study


# ---- killed trials ------------------------------------------------------------------------------------
def _alive(trial: FrozenTrial, here: dict[str, Any]) -> bool:
    """Whether the process that runs a trial may still be running: False only for a process of this
    machine (same host and boot) that is gone, or whose pid now belongs to another process."""
    worker = trial.user_attrs.get("worker")
    if not isinstance(worker, dict) or worker.get("trial") != trial.number:
        return True  # not claimed yet (a retry holds its original's attributes until its worker sets its own)
    if worker.get("host") != here["host"] or worker.get("boot") != here["boot"]:
        return True  # another machine's: its heartbeat tells
    pid = worker.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    start = worker.get("start")
    return start is None or process_start(pid) in (None, start)


def _study_id(storage: RDBStorage, study: optuna.Study) -> int:
    return storage.get_study_id_from_name(study.study_name)


def fail_and_retry(study: optuna.Study, storage: RDBStorage, number: int, why: str | None = None) -> bool:
    """Mark trial `number` FAIL where it is still RUNNING (noting `why`), then, where it failed, queue
    it to run again unless it is already a retry (MAX_RETRY); whether a retry was queued."""
    trial_id = storage.get_trial_id_from_study_id_trial_number(_study_id(storage, study), number)
    trial = storage.get_trial(trial_id)
    if trial.state == TrialState.RUNNING:
        try:
            if why is not None:
                storage.set_trial_user_attr(trial_id, "error", why)
            if not storage.set_trial_state_values(trial_id, TrialState.FAIL):
                return False
        except UpdateFinishedTrialError:  # another worker marked it first, and retries it
            return False
        trial = storage.get_trial(trial_id)
    if trial.state != TrialState.FAIL:
        return False
    with quiet_optuna():
        RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)(study, trial)
    return len(trial.system_attrs.get("retry_history", [])) < MAX_RETRY


def fail_dead_trials(study: optuna.Study, storage: RDBStorage, say: Callable[[str], None]) -> None:
    """Mark FAIL, and retry once, the running trials whose process on this machine is gone; then those
    whose heartbeat is stale (Optuna's `fail_stale_trials`, any machine's)."""
    here = this_worker()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if _alive(t, here):
            continue
        why = "its process ended before it did (killed)"
        again = fail_and_retry(study, storage, t.number, why)
        say(f"trial {t.number} was left running by a process that is gone: marked FAIL{_again(again)}")
    with quiet_optuna():
        optuna.storages.fail_stale_trials(study)


def _again(retried: bool) -> str:
    return ", and its values are run again as a new trial" if retried else " (a retry already; not run again)"


# ---- the loop -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SweepResult:
    study: str
    storage: str  # the URL, its password hidden
    trials: int  # --trials
    counts: dict[str, int]  # trials of each state in the study (COMPLETE, PRUNED, FAIL, RUNNING, WAITING)
    ran: list[int]  # the numbers of the trials this worker ran
    best: FrozenTrial | None
    metric: str
    out: Path

    @property
    def finished(self) -> int:
        return self.counts.get("COMPLETE", 0) + self.counts.get("PRUNED", 0)


def counts_of(study: optuna.Study) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    if not complete:
        return None
    sign = 1 if study.direction == optuna.study.StudyDirection.MINIMIZE else -1
    return min(complete, key=lambda t: (sign * t.value, t.number))


def run_sweep(
    *,
    config: ConfigSource,
    sets: Sequence[str] = (),
    space: Path,
    trials: int,
    storage: str,
    study: str,
    out: Path | None = None,
    metric: str | None = None,
    direction: str | None = None,
    pruner: str | optuna.pruners.BasePruner = "median",
    device: str = "auto",
    heartbeat: int = HEARTBEAT_S,
    say: Callable[[str], None] | None = None,
) -> SweepResult:
    """Run trials of the study `study` in `storage` until it has `trials` finished trials (the module
    docstring); every check of the arguments comes before the storage is opened or a trial run."""
    metric = metric or "val/loss"
    say = say or _print
    if config is None:
        raise UserError("vitmask sweep needs --config: the config every trial starts from")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise UserError(f"--trials must be an integer of at least 1 (finished trials in the study), got {trials!r}")
    if isinstance(heartbeat, bool) or not isinstance(heartbeat, int) or heartbeat < 1:
        raise UserError(f"--heartbeat must be a whole number of seconds, at least 1, got {heartbeat!r}")
    check_study_name(study)
    direction = direction_of(metric, direction)
    pruner_name = pruner if isinstance(pruner, str) else type(pruner).__name__
    pruner_obj = make_pruner(pruner) if isinstance(pruner, str) else pruner
    the_space = load_space(space)
    cfg = load_config(config, sets)
    check_values(the_space, config, sets)
    check_metric(metric, cfg, the_space)
    out = Path(out) if out is not None else Path("runs") / study
    check_out(out)
    rdb = open_storage(storage, heartbeat)
    the_study = open_study(rdb, study, storage, direction, metric, the_space, cfg, pruner_obj)
    objective = Objective(
        study_name=study,
        trials=trials,
        config=config,
        sets=sets,
        space=the_space,
        metric=metric,
        pruner=pruner_name,
        out=out,
        device=device,
        say=say,
    )
    ran: list[int] = []
    with quiet_optuna(), HeldSignals() as held:
        objective.guard = held.released
        _loop(the_study, rdb, objective, trials, ran, say, held)
    counts = counts_of(the_study)
    return SweepResult(study, shown_url(storage), trials, counts, ran, best_trial(the_study), metric, out)


def check_out(out: Path) -> None:
    """Refuse, before the storage is opened and any trial runs, an --out where no trial's run dir could
    be made (each trial would fail on it): a file, or a folder that cannot be created or written. The
    folders made to find out are removed again."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder; pass the folder the trials' run dirs go in")
    fix = "pass a folder the trials can write in"
    try:
        with missing_folders_made(out / "trial") as made:  # out and the folders above it, as mkdir -p
            writable = os.access(out, os.W_OK | os.X_OK)
    except OSError as e:
        raise UserError(f"--out {out} cannot be made ({reason(e)}); {fix}") from None
    for q in made:  # innermost first: only what was made here
        with contextlib.suppress(OSError):
            q.rmdir()
    if not writable:
        raise UserError(f"--out {out} is not writable (permission denied); {fix}")


def _print(line: str) -> None:
    print(line, flush=True)


class HeldSignals:
    """SIGINT and SIGTERM between trials (Optuna's own bookkeeping, the waits): recorded, and acted on
    once the study is consistent (`check`); inside a trial's run (`released`): as a run handles them,
    its checkpoint written. Outside the main thread, where Python cannot install handlers, nothing."""

    def __init__(self):
        self.received: int | None = None
        self.previous: dict = {}

    def __enter__(self) -> "HeldSignals":
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}
        return self

    def _record(self, signum, frame) -> None:
        self.received = signum

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    @contextlib.contextmanager
    def released(self):
        """The handlers from before the sweep, for a trial's run (the trainer installs its own inside)."""
        self.check("before its next trial")
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        try:
            yield
        finally:
            for s in self.previous:
                signal.signal(s, self._record)

    def check(self, when: str) -> None:
        """Stop (`Interrupted`, one line) where a signal was recorded."""
        if self.received is not None:
            name = signal.Signals(self.received).name
            raise Interrupted(
                f"stopped by {name} {when}; every finished trial is kept in the study: run the same command again "
                "to go on",
                128 + self.received,
                self.received,
            )


def _loop(
    study: optuna.Study,
    storage: RDBStorage,
    objective: Objective,
    trials: int,
    ran: list[int],
    say,
    held: HeldSignals,
) -> None:
    failures = 0
    waiting_for: tuple[int, ...] = ()
    fail_dead_trials(study, storage, say)
    while True:
        held.check("between trials")
        finished = len(study.get_trials(deepcopy=False, states=FINISHED))
        if finished >= trials:
            return
        running = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
        if finished + len(running) >= trials:
            if tuple(running) != waiting_for:
                waiting_for = tuple(running)
                say(
                    f"waiting for trial{'s' if len(running) > 1 else ''} {', '.join(map(str, running))}, "
                    f"running elsewhere, to finish the study's {trials}"
                )
            time.sleep(POLL_S)
            fail_dead_trials(study, storage, say)
            continue
        waiting_for = ()
        objective.current = None
        try:
            study.optimize(objective, n_trials=1, catch=(TrialFailed, Surplus), gc_after_trial=True)
        except Interrupted as e:
            if objective.current is None:
                raise
            number = objective.current.number
            again = fail_and_retry(study, storage, number)
            raise _stopped(e, number, again) from None
        except (Stopped, KeyboardInterrupt):
            if objective.current is not None:
                fail_and_retry(study, storage, objective.current.number, "stopped by a signal")
            raise
        number = objective.current.number
        if objective.surplus:
            continue
        ran.append(number)
        if objective.failure is None:
            failures = 0
            continue
        warn(objective.failure)
        failures += 1
        if failures >= FAILURES_IN_A_ROW:
            raise UserError(
                f"{failures} trials in a row failed, the last as {objective.failure}; fix what they share "
                "(the config, the data, the space) and run the command again"
            )


def _stopped(e: Interrupted, number: int, again: bool) -> Interrupted:
    """The one line of a sweep stopped by a signal inside trial `number`'s run (after its checkpoint)."""
    name = signal.Signals(e.signum).name if e.signum is not None else "a signal"
    at = f" at step {e.step}" if e.step is not None else ""
    kept = f"; its checkpoint is {e.checkpoint}" if e.checkpoint is not None else ""
    then = "runs again as a new trial" if again else "is not run again (it was a retry)"
    return Interrupted(
        f"stopped by {name} in trial {number}{at}{kept}; the trial is marked FAIL and {then} when the sweep goes "
        "on: run the same command again",
        e.code,
    )


def summary_lines(result: SweepResult) -> list[str]:
    """What the command prints at its end: the study's counts, its best trial, the report's command."""
    c = result.counts
    others = ", ".join(f"{n} {s.lower()}" for s, n in sorted(c.items()) if s not in ("COMPLETE", "PRUNED"))
    lines = [
        f"study {result.study}: {result.finished} of {result.trials} trials finished ({c.get('COMPLETE', 0)} "
        f"complete, {c.get('PRUNED', 0)} pruned){'; ' + others if others else ''}; this worker ran "
        f"{len(result.ran)}"
    ]
    best = result.best
    if best is not None and best.value is not None and math.isfinite(best.value):
        lines.append(
            f"best: trial {best.number}, {result.metric} {best.value:.6g} ({param_text(best.params)}) "
            f"in {best.user_attrs.get('run_dir')}"
        )
    lines.append(f"report: vitmask sweep --storage {result.storage} --study {result.study} --report")
    return lines
