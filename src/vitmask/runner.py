"""What each CLI command does, as plain functions: run dirs, resuming, evaluating a checkpoint.

The CLI only parses arguments and renders results and errors; everything here is callable from
Python and raises `UserError` for bad input.
"""

from pathlib import Path

import torch

from vitmask import distributed
from vitmask.checkpoint import latest_checkpoint, load_checkpoint, remove_stale_temps
from vitmask.config import Config, config_from_dict, dump_config, load_config
from vitmask.data import SPLITS, load_splits
from vitmask.errors import UserError
from vitmask.evaluate import class_counts, evaluate
from vitmask.metrics_log import TensorBoardLogger
from vitmask.model import MaskedPatchViT, build_model
from vitmask.runtime import resolve_device
from vitmask.train import Trainer, check_model_state


def resolve_config(config: Path | None, overrides: list[str], state: dict | None = None) -> Config:
    if config is not None:
        return load_config(config, overrides)
    if state is not None:
        return config_from_dict(state["config"], overrides)
    raise UserError("no config given; pass --config PATH (for example configs/default.yaml)")


def _prepare_run_dir(run_dir: Path, may_exist: bool) -> None:
    if not may_exist and run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(
            f"run dir {run_dir} already exists and is not empty; continue it with --resume auto, "
            "or start a new run with --run-dir DIR"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"run dir {run_dir} is not writable ({e.strerror}); pass a writable --run-dir") from None


def train(
    config: Path | None,
    overrides: list[str],
    run_dir: Path | None,
    resume: str | None,
    device_name: str,
) -> tuple[Path, dict[str, float]]:
    """Start or continue a run. Returns the run dir and the final validation metrics.

    `resume` is a checkpoint path, or "auto": the newest checkpoint in the run dir, or a fresh start
    when it has none. Under torchrun every rank trains; only rank 0 writes the run dir.
    """
    world, device = distributed.init(resolve_device(device_name))
    try:
        state = None
        if resume is not None and resume != "auto":
            state = load_checkpoint(resume)
            run_dir = run_dir or Path(resume).parent
        if resume == "auto" and run_dir is not None and (latest := latest_checkpoint(run_dir)) is not None:
            state = load_checkpoint(latest)
        cfg = resolve_config(config, overrides, state)
        if run_dir is None:  # --resume auto with a config: the config names the run dir
            run_dir = Path("runs") / cfg.name
            if resume == "auto" and (latest := latest_checkpoint(run_dir)) is not None:
                state = load_checkpoint(latest)
        if world.main:
            _prepare_run_dir(run_dir, may_exist=state is not None or resume == "auto")
            remove_stale_temps(run_dir)
        splits = load_splits(cfg)
        logger = TensorBoardLogger(run_dir) if world.main else None
        trainer = Trainer(cfg, splits, device, logger=logger, world=world)
        if state is not None:
            trainer.load_state_dict(state)
            if world.main:
                print(f"resuming {run_dir} from step {trainer.step}")
        if world.main:
            (run_dir / "config.yaml").write_text(dump_config(cfg))
        try:
            val = trainer.fit(run_dir)
        finally:
            trainer.close()
        return run_dir, val
    finally:
        distributed.shutdown()


def load_model(path: Path, device: torch.device) -> tuple[MaskedPatchViT, Config, dict]:
    """The model of a checkpoint, in eval mode on `device`, with its config and the raw state."""
    state = load_checkpoint(path)
    cfg = config_from_dict(state["config"])
    model = build_model(cfg)
    check_model_state(model, state["model"])
    model.load_state_dict(state["model"])
    return model.to(device).eval(), cfg, state


def check_ratio(ratio: float) -> None:
    if not 0.0 < ratio < 1.0:
        raise UserError(f"--mask-ratio must be strictly between 0 and 1, got {ratio}")


def evaluate_checkpoint(
    path: Path, split: str, ratio: float | None, device_name: str, seed: int = 0
) -> dict[str, float]:
    if split not in SPLITS:
        raise UserError(f"unknown split '{split}'; use one of {', '.join(SPLITS)}")
    if ratio is not None:
        check_ratio(ratio)
    device = resolve_device(device_name)
    model, cfg, _ = load_model(path, device)
    ratio = cfg.mask.ratio if ratio is None else ratio
    splits = load_splits(cfg)
    majority = int(class_counts(splits["train"], cfg.data.patch_size, cfg.data.num_classes).argmax())
    metrics = evaluate(model, splits[split].to(device), cfg, ratio, seed, majority, progress=True)
    return {"split": split, "mask_ratio": ratio, "seed": seed, **metrics}


def count_params(config: Path | None, checkpoint: Path | None, overrides: list[str]) -> MaskedPatchViT:
    if (config is None) == (checkpoint is None):
        raise UserError("count-params needs exactly one of --config PATH or --checkpoint PATH")
    if checkpoint is not None:
        state = load_checkpoint(checkpoint)
        cfg = config_from_dict(state["config"], overrides)
    else:
        cfg = load_config(config, overrides)
    return build_model(cfg)


def preview(config: Path | None, overrides: list[str], out: Path, count: int, seed: int) -> str:
    """Write the preview grid of the configured data to `out`; return the statistics as text."""
    from vitmask.preview import format_stats, write_preview

    cfg = resolve_config(config, overrides)
    stats = write_preview(load_splits(cfg), cfg, out, count, seed)
    return format_stats(stats, cfg)
