"""A study's results (`vitmask sweep --report`, docs/sweeps.md#results).

- the table: the finished trials, COMPLETE ones first, best first by the study's metric and
  direction, then PRUNED ones by the last value they reported; each with its state, its metric, the
  step it reached and its values of the space's keys; then how many trials are in each state;
- `sweep.png` in the out dir: the metric against the trials (Optuna's `plot_optimization_history`)
  beside the parameters' importances (`plot_param_importances`, Optuna's default evaluator, PED-ANOVA), each drawn by
  Optuna's matplotlib functions; importances need at least 2 completed trials and a key whose
  values differ among them: without, that panel says so, and so does one line;
- `best.yaml` in the out dir: the best completed trial's config as its run dir's config.yaml has it,
  ready for `vitmask train --config best.yaml`.
"""

import dataclasses
import io
import math
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from vitmask.config import config_from_dict, dump_config
from vitmask.errors import UserError
from vitmask.outputs import REPLACE_ANY, write_bytes, write_text
from vitmask.sweep.objective import param_text
from vitmask.sweep.study import best_trial, counts_of, open_storage, quiet_optuna, shown_url

PNG_NAME, BEST_NAME = "sweep.png", "best.yaml"
PANEL_INCHES = (6.4, 4.8)


@dataclasses.dataclass(frozen=True)
class Report:
    lines: list[str]  # the table and the counts, as printed
    png: Path
    best: Path | None  # best.yaml, where a trial completed
    notes: list[str]  # what could not be drawn or written, one line each


def load_study(storage: str, name: str) -> optuna.Study:
    """The existing study `name` in `storage`; one line naming the studies there when it is not one."""
    rdb = open_storage(storage, create=False)
    with quiet_optuna():
        names = optuna.study.get_all_study_names(rdb)
        if name not in names:
            there = f"its studies: {', '.join(sorted(names))}" if names else "it holds no study"
            raise UserError(f"no study {name} in {shown_url(storage)}; {there}")
        return optuna.load_study(study_name=name, storage=rdb)


def _last_reported(t: FrozenTrial) -> tuple[int, float] | None:
    if not t.intermediate_values:
        return None
    step = max(t.intermediate_values)
    return step, t.intermediate_values[step]


def _number(v: float | None) -> str:
    return "-" if v is None else f"{v:.6g}"


def table(study: optuna.Study, top: int = 10) -> list[str]:
    """The best `top` finished trials as a table, then the counts of each state (the module docstring)."""
    metric = study.user_attrs.get("metric", "value")
    minimize = study.direction == optuna.study.StudyDirection.MINIMIZE
    sign = 1 if minimize else -1
    trials = study.get_trials(deepcopy=False)
    complete = sorted(
        (t for t in trials if t.state == TrialState.COMPLETE and t.value is not None),
        key=lambda t: (sign * t.value if math.isfinite(t.value) else math.inf, t.number),
    )
    pruned = sorted(
        (t for t in trials if t.state == TrialState.PRUNED),
        key=lambda t: (sign * _last_reported(t)[1] if _last_reported(t) else math.inf, t.number),
    )
    keys = list(study.user_attrs.get("space") or {})
    for t in complete + pruned:
        keys += [k for k in t.params if k not in keys]
    rows = [["rank", "trial", "state", metric, "steps", *keys]]
    for rank, t in enumerate(complete + pruned, 1):
        last = _last_reported(t)
        value = t.value if t.state == TrialState.COMPLETE else (last[1] if last else None)
        steps = t.user_attrs.get("steps") or (last[0] if last else None)
        cells = [str(rank) if t.state == TrialState.COMPLETE else "-", str(t.number), t.state.name]
        cells += [_number(value), "-" if steps is None else str(steps)]
        cells += [param_text({k: t.params[k]}).partition("=")[2] if k in t.params else "-" for k in keys]
        rows.append(cells)
    rows = rows[: top + 1]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.rjust(w) if i != 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    counts = counts_of(study)
    states = ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items()))
    shown = min(top, len(complete) + len(pruned))
    direction = "lower is better" if minimize else "higher is better"
    head = (
        f"study {study.study_name}: {len(trials)} trials ({states or 'none'}); {metric}, {direction}; "
        f"the best {shown} finished"
    )
    return [head, *lines]


def _figure_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.set_size_inches(*PANEL_INCHES)
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _text_panel(text: str) -> bytes:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True)
    try:
        return _figure_png(fig)
    finally:
        plt.close(fig)


def importance_note(study: optuna.Study) -> str | None:
    """Why the importances cannot be computed, or None where they can: at least 2 completed trials,
    and a key whose values differ among them."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < 2:
        return f"parameter importances need at least 2 completed trials; the study has {len(complete)}"
    keys = {k for t in complete for k in t.params}
    if not any(len({repr(t.params.get(k)) for t in complete}) > 1 for k in keys):
        return "parameter importances need a key whose values differ among the completed trials; none does"
    return None


def panels(study: optuna.Study) -> tuple[bytes, bytes, list[str]]:
    """The history's and the importances' panels as PNG bytes, and the notes on what could not be drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization.matplotlib import plot_optimization_history, plot_param_importances

    metric = study.user_attrs.get("metric", "value")
    notes = []
    with quiet_optuna():
        if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            ax = plot_optimization_history(study, target_name=metric)
            try:
                history = _figure_png(ax.figure)
            finally:
                plt.close(ax.figure)
        else:
            notes.append("the history needs a completed trial; the study has none")
            history = _text_panel(notes[-1])
        why = importance_note(study)
        if why is None:
            try:
                ax = plot_param_importances(study, target_name=metric)
            except (RuntimeError, ValueError, ZeroDivisionError) as e:
                why = f"parameter importances could not be computed: {' '.join(str(e).split())}"
            else:
                try:
                    importances = _figure_png(ax.figure)
                finally:
                    plt.close(ax.figure)
        if why is not None:
            notes.append(why)
            importances = _text_panel(why)
    return history, importances, notes


def side_by_side(left: bytes, right: bytes) -> bytes:
    from PIL import Image

    a, b = Image.open(io.BytesIO(left)).convert("RGB"), Image.open(io.BytesIO(right)).convert("RGB")
    canvas = Image.new("RGB", (a.width + b.width, max(a.height, b.height)), "white")
    canvas.paste(a, (0, 0))
    canvas.paste(b, (a.width, 0))
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    return buf.getvalue()


def best_yaml(study: optuna.Study, best: FrozenTrial) -> str:
    """The best trial's config as a YAML config file, a comment saying where it comes from."""
    config = best.user_attrs.get("config")
    if not isinstance(config, dict):
        raise UserError(f"trial {best.number} of study {study.study_name} keeps no config; it was not run by vitmask")
    cfg = config_from_dict(config)
    metric = study.user_attrs.get("metric", "value")
    head = (
        f"# The best trial of study {study.study_name}: trial {best.number}, {metric} {best.value:.6g} "
        f"({param_text(best.params)}), run dir {best.user_attrs.get('run_dir')}.\n"
        "# Train it: vitmask train --config best.yaml\n"
    )
    return head + dump_config(cfg)


def report(storage: str, study: str, out: Path | None = None, top: int = 10) -> Report:
    """The table, sweep.png and best.yaml of the study `study` (the module docstring), in `out`
    (default runs/<study>)."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise UserError(f"--top must be an integer of at least 1 (rows), got {top!r}")
    the_study = load_study(storage, study)
    out = Path(out) if out is not None else Path("runs") / study
    lines = table(the_study, top)
    history, importances, notes = panels(the_study)
    png = write_bytes(out / PNG_NAME, side_by_side(history, importances), "the sweep's picture", replaces=REPLACE_ANY)
    best = best_trial(the_study)
    best_path = None
    if best is None:
        notes.append("no trial has completed yet, so there is no best.yaml")
    else:
        best_path = write_text(out / BEST_NAME, best_yaml(the_study, best), "best.yaml", replaces=REPLACE_ANY)
    return Report(lines, png, best_path, notes)
