"""Training: the trainer and its step (trainer.py), optimizers and schedules (optim.py), the EMA of the
weights (ema.py), validation during training (validation.py), the divergence watch (divergence.py),
compile parity (parity.py), the compiled step's check against eager at run time (compile_check.py),
the SDPA kernels a compiled CUDA step may use (sdpa.py), fine-tuning a classifier on labels (finetune.py), console and
TensorBoard reporting (report.py), metric loggers (loggers.py), callbacks and early stopping (callbacks.py),
and a whole run as `vitmask train` and `vitmask finetune` run it (run.py), with its result (result.py).

This package is also `vitmask.train`, the Python call that trains: calling it runs `run.train`
(`vitmask.train("configs/default.yaml", run_dir="runs/x")`, docs/python.md#training-from-python), and
`inspect.signature(vitmask.train)` and `help` read that function's. Importing the package imports
no torch; calling it does.
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    """The module type of this package: a module that, called, runs `run.train`."""

    def __call__(self, *args, **kwargs):
        from vitmask.train.run import train

        return train(*args, **kwargs)


def __getattr__(name: str):
    if name == "__wrapped__":  # what inspect.signature and help() follow: the function a call runs
        from vitmask.train.run import train

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


sys.modules[__name__].__class__ = _CallablePackage
