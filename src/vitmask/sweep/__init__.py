"""`vitmask sweep`: a hyper-parameter search over config keys on Optuna, in a database (docs/sweeps.md).

- space.py: the search space, a YAML file mapping config keys to distributions, checked against the
  config (an unknown key as `--set` refuses it, every bound and choice by building the config);
- objective.py: one trial, a normal training run in `<out>/trial-NNNN` through `vitmask.train`,
  each validation reported to Optuna and the run stopped cleanly when its pruner says so;
- study.py: the storage (SQLite, PostgreSQL, ...), the study and the loop of workers that share it:
  `--trials N` finished trials in all, a killed trial failed and run again once;
- report.py: the best trials as a table, the optimisation history and parameter importances as a
  PNG, the best trial's config as best.yaml.

Only this package imports optuna and matplotlib (the sweep extra); `require_sweep_extra` says how to
install them when they are missing. Importing this module imports neither, nor torch.
"""

import importlib

from vitmask.errors import UserError


def require_sweep_extra(*modules: str) -> None:
    """One line naming the install command when a module of the sweep extra (optuna, matplotlib) cannot
    be imported. An import, not a look-up: a package that is there but broken is missing too."""
    for name in modules or ("optuna",):
        try:
            importlib.import_module(name)
        except ImportError:
            raise UserError(
                f"vitmask sweep needs the sweep extra, and {name} is not installed; run: pip install 'vitmask[sweep]' "
                "(in a checkout: pip install -e '.[sweep]')"
            ) from None
