"""`vitmask sweep`: run a study's trials, or report on it with --report. What it does lives in
vitmask/sweep (docs/sweeps.md); this module checks which options go together and prints."""

from pathlib import Path

from vitmask.errors import UserError, note
from vitmask.sweep import require_sweep_extra


def sweep(
    *,
    config: Path | list[Path] | None,
    sets: list[str],
    space: Path | None,
    trials: int | None,
    storage: str,
    study: str,
    out: Path | None,
    metric: str | None,
    direction: str | None,
    pruner: str,
    device: str,
    heartbeat: int,
    report: bool,
    top: int,
) -> None:
    require_sweep_extra("optuna")
    if report:
        options = (("--config", config), ("--set", sets), ("--space", space), ("--trials", trials))
        given = [flag for flag, v in options if v is not None and v != []]
        if given:
            raise UserError(
                f"--report reads the study and runs no trial, so it takes no {', '.join(given)}; "
                "drop them, or drop --report to run trials"
            )
        require_sweep_extra("optuna", "matplotlib")
        from vitmask.sweep.report import report as study_report

        r = study_report(storage, study, out, top)
        print("\n".join(r.lines))
        for line in r.notes:
            note(line)
        print(f"wrote {r.png}" + (f" and {r.best} (train it: vitmask train --config {r.best})" if r.best else ""))
        return
    missing = [flag for flag, v in (("--config", config), ("--space", space), ("--trials", trials)) if v is None]
    if missing:
        raise UserError(
            f"vitmask sweep needs {' and '.join(missing)} to run trials (or --report to read the study); "
            "see docs/sweeps.md"
        )
    from vitmask.sweep.study import run_sweep, summary_lines

    result = run_sweep(
        config=config,
        sets=sets,
        space=space,
        trials=trials,
        storage=storage,
        study=study,
        out=out,
        metric=metric,
        direction=direction,
        pruner=pruner,
        device=device,
        heartbeat=heartbeat,
    )
    print("\n".join(summary_lines(result)))
