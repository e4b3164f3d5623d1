"""A training run from start to end: what `vitmask train` and `vitmask finetune` run, and what
`vitmask.train(...)` and `vitmask.finetune(...)` run from Python. The command line parses its
options, calls `train` or `finetune` here and prints the result; Python gets the result itself
(result.py), so the two give the same checkpoints for the same config and seed.

- `train`: resolve the run (rundir.resolve: which run dir, which checkpoint, which config), check
  the loggers' extras and the memory, own the run dir (lock, clean-up of a failed start), then
  `run_plan`;
- `finetune`: the same for a classifier on a pretrained encoder (train/finetune.py), then its test
  accuracy beside the baselines at the same budget (from scratch, the linear probe);
- `run_plan`: load the data, build the loggers of `train.loggers` (loggers.py) and the trainer,
  add the caller's callbacks (callbacks.py), restore a resumed checkpoint, write config.yaml, train;
  a failed write (a full disk), an allocation or damaged rows of a pack end in one line.

Bad input is a `UserError` (one line); a stop by SIGINT or SIGTERM raises `signals.Interrupted`
after writing a checkpoint; a callback that raises, `callbacks.CallbackError` after writing one.
"""

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from vitmask.config import Config, ConfigSource, dump_config, load_config
from vitmask.data.batches import load_labelled_splits, load_splits
from vitmask.data.binarization import Asked, follow_pack, follow_pretrained, tell, warn_if_inverted
from vitmask.data.packed import DamagedRows
from vitmask.data.per_class import check_unpackable, unpacked_splits
from vitmask.errors import UserError
from vitmask.evaluate.probe import online_probe, run_probes
from vitmask.model.memory_estimate import check_fits
from vitmask.outputs import REPLACE_ANY, reason, write_text
from vitmask.pretrained import check_model_arg, locate
from vitmask.runtime import distributed
from vitmask.runtime.memory import is_out_of_memory, out_of_memory
from vitmask.runtime.process import resolve_device
from vitmask.signals import Interrupted
from vitmask.store import rundir
from vitmask.store.checkpoint import check_resumable, config_of, describe_load_failure, load_checkpoint
from vitmask.store.export import load_model
from vitmask.store.init_weights import check_flags as init_weights_check
from vitmask.store.init_weights import check_same_images, load_init
from vitmask.train.callbacks import CallbackError, check_callbacks
from vitmask.train.loggers import build_loggers, check_extras
from vitmask.train.result import FinetuneResult, TrainResult
from vitmask.train.trainer import Trainer

PathLike = str | os.PathLike


def train(
    config: ConfigSource | None = None,
    overrides: Sequence[str] = (),
    run_dir: PathLike | None = None,
    *,
    callbacks: Iterable = (),
    device: str | torch.device = "auto",
    resume: PathLike | None = None,
    init: PathLike | None = None,
    init_weights: str | None = None,
    force_preprocessing: bool = False,
) -> TrainResult:
    """Train a masked-patch model; return its `TrainResult` (docs/python.md#training-from-python).

    `config`: a YAML file, a list of them (composed in order, later keys winning: config.load_config),
    a `Config`, or a config as plain data; None to continue a run from its checkpoint's config.
    `overrides`: `KEY=VALUE` strings applied last (`--set`). `run_dir`: where it writes (default
    runs/<name>). `callbacks`: `Callback` objects (callbacks.py). `device`: auto, cpu, cuda, cuda:K.
    `resume`: a checkpoint, or "auto" (the run dir's newest, or a fresh start). `init` (an export
    dir, a checkpoint or a shipped model's name) starts a new run from its weights, `init_weights`
    ema | raw. A fresh run follows how its images were made binary (a pack's header, `init`'s
    config: data/binarization.py); `force_preprocessing` keeps a `--set` that contradicts them.

    Which checkpoint, which run dir, which config changes a resume may make, the lock and the
    clean-up of a failed start: store/rundir.py. Under torchrun every rank trains; only rank 0
    owns and writes the run dir."""
    config, overrides, run_dir, callbacks, device_name = _arguments(config, overrides, run_dir, callbacks, device)
    resume, init = _optional_path(resume, "resume"), _model_path(init, "init", flag="init")
    world, device = distributed.init(resolve_device(device_name))
    try:
        init_weights_check(init, init_weights, resume)
        plan = rundir.resolve(config, overrides, run_dir, resume, force_preprocessing)
        if init is not None:
            weights = load_init(init, plan.cfg, init_weights, Asked.of(config, overrides, force_preprocessing))
            plan = dataclasses.replace(plan, cfg=weights.config, init=weights, said=plan.said + weights.said)
        check_extras(plan.cfg)
        check_fits(plan.cfg, device)
        fresh = plan.state is None
        owner = rundir.RunDir(plan.run_dir, fresh, auto=resume == "auto") if world.main else contextlib.nullcontext()
        with owner, rundir.quiet_writer_threads():
            trainer = run_plan(plan, device, world, callbacks=callbacks)
        distributed.barrier(world)  # no rank tears the process group down while another still uses it
        return trainer.result
    finally:
        distributed.shutdown()


def _masked_patch_trainer(cfg: Config, data, device: torch.device, **kwargs) -> Trainer:
    return Trainer(cfg, data.images, device, **kwargs)


def run_plan(
    plan: rundir.Resolved,
    device: torch.device,
    world: distributed.World,
    make_trainer=_masked_patch_trainer,
    callbacks: Iterable = (),
) -> Trainer:
    """Load the data, build (and restore) the trainer (`make_trainer(cfg, labelled splits, device,
    logger=, world=, probe=)`, and `init=` for a plan with initial weights) with `callbacks` after the
    config's, write config.yaml, train; return the trainer, its `result` set. Failed writes (a full
    disk) and allocations end in one line. Before training: the lines on what the config took from a
    record (`plan.said`), and a warning when the train split looks inverted (binarization.warn_if_inverted)."""
    cfg, run_dir = plan.cfg, plan.run_dir
    data = load_data(cfg, device, load_labelled_splits)
    trainer = None
    start = int(plan.state["step"]) if plan.state is not None else 0  # the step where this process begins
    try:
        probe = online_probe(cfg, data, device) if world.main else None
        logger = build_loggers(cfg, run_dir, plan.run_id, start) if world.main else None
        init = {"init": plan.init} if plan.init is not None else {}
        trainer = make_trainer(cfg, data, device, logger=logger, world=world, probe=probe, **init)
        trainer.run_id = plan.run_id
        trainer.callbacks = [*trainer.callbacks, *callbacks]  # before the restore: it restores their state
        if plan.state is not None:
            _restore(trainer, plan)
        elif plan.init is not None and world.main:
            print(f"starting a new run in {run_dir} from {plan.init.describe()}", flush=True)
        if world.main:
            tell(plan.said)
            share = trainer.foreground_share
            if share is not None:
                warn_if_inverted(share, cfg.data, "the training images", repack=cfg.data.source == "packed")
            write_text(run_dir / "config.yaml", dump_config(cfg), "config", make_folder=False, replaces=REPLACE_ANY)
        trainer.fit(run_dir)
        trainer.close()
        return trainer
    except Exception as e:
        if trainer is not None:
            with contextlib.suppress(Exception):
                trainer.close()
        if isinstance(e, CallbackError):  # the callback's own error, after its checkpoint: as it is
            raise
        if is_out_of_memory(e):
            raise out_of_memory(e, device, f"training at step {trainer.step if trainer else start}") from None
        if isinstance(e, DamagedRows):  # a damaged block of a pack, met as its rows were first read
            raise _stopped_by_damage(e, run_dir, trainer.step if trainer else start) from None
        if isinstance(e, UserError) and not hasattr(e, "errno"):
            raise
        failure = rundir.write_failure(e, run_dir, trainer.step if trainer else start) if world.main else None
        if failure is None:
            raise
        raise failure from None
    except BaseException:
        if trainer is not None:
            with contextlib.suppress(Exception):
                trainer.close()
        raise


def _stopped_by_damage(e: DamagedRows, run_dir: Path, step: int) -> UserError:
    """The one line for a run stopped by damaged rows of its pack: what is damaged, and which checkpoint is kept."""
    kept = rundir.last_checkpoint(run_dir)
    if kept is None:
        what = "no checkpoint had been written yet, so the run left nothing behind"
    else:
        what = f"the last checkpoint, {kept[0]} (step {kept[1]}), is kept; resume from it once the pack is whole"
    return UserError(f"training stopped at step {step}: {e}; {what}")


def load_data(cfg: Config, device: torch.device, loader=load_splits):
    """`loader(cfg)` (`load_splits` or `load_labelled_splits`), with a file-system error or an
    allocation failure as one line."""
    try:
        return loader(cfg)
    except OSError as e:
        where = f" under data.path {cfg.data.path}" if cfg.data.source != "shapes" else ""
        raise UserError(f"cannot read the {cfg.data.source} data{where} ({reason(e)}); check data.path") from None
    except Exception as e:
        if is_out_of_memory(e):
            raise out_of_memory(e, device, "loading the data") from None
        raise


def _restore(trainer: Trainer, plan: rundir.Resolved) -> None:
    """Load the resumed checkpoint into the trainer and say so (one stdout line)."""
    try:
        trainer.load_state_dict(plan.state)
    except UserError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as e:
        raise describe_load_failure(e, plan.source) from None
    for group in trainer.optimizer.param_groups:  # torch checks the counts, not the shapes, of the moments
        for p in group["params"]:
            for k, v in trainer.optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.dim() > 0 and v.shape != p.shape:
                    raise describe_load_failure(
                        ValueError(f"optimizer {k} of shape {tuple(v.shape)} for a parameter of {tuple(p.shape)}"),
                        plan.source,
                    )
    if not trainer.world.main:
        return
    changed = f" (changed: {'; '.join(plan.changes)})" if plan.changes else ""
    if plan.run_id == plan.state.get("run_id") or rundir.same_dir(plan.source.parent, plan.run_dir):
        print(f"resuming {plan.run_dir} from step {trainer.step}{changed}", flush=True)
    else:
        print(f"starting a new run in {plan.run_dir} from {plan.source} (step {trainer.step}){changed}", flush=True)


# ---- the arguments of the Python calls ------------------------------------------------------------------
def _arguments(config, overrides, run_dir, callbacks, device):
    """The arguments `train` and `finetune` share, checked (one line each) and in the forms below them."""
    if config is not None and not isinstance(config, (str, os.PathLike, Config, dict, list, tuple)):
        raise UserError(
            f"config must be a YAML file's path, a list of them, a Config or a dict, got {type(config).__name__}"
        )
    if isinstance(config, (list, tuple)):
        if not all(isinstance(p, (str, os.PathLike)) for p in config):
            raise UserError("config: a list of configs must hold YAML files' paths (str or Path) only")
        config = [Path(p) for p in config] if len(config) != 1 else Path(config[0])
    elif isinstance(config, (str, os.PathLike)):
        config = Path(config)
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise UserError(f"overrides must be a list of 'KEY=VALUE' strings (as --set takes), got {overrides!r}")
    callbacks = check_callbacks(callbacks)
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise UserError(f"device must be 'auto', 'cpu', 'cuda', 'cuda:K' or a torch.device, got {device!r}")
    return config, list(overrides), _optional_path(run_dir, "run_dir"), callbacks, device


def _optional_path(value, name: str) -> Path | str | None:
    """A path argument (a str or os.PathLike) as a Path, "auto" as it is, None as None."""
    if value is None or value == "auto":
        return value
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise UserError(f"{name} must be a path (str or Path){' or auto' if name == 'resume' else ''}, got {value!r}")
    return Path(value)


def _model_path(value, name: str, flag: str | None = None, call: str | None = None) -> Path | None:
    """A model argument: a path, or a shipped model's bare name in a str (pretrained.check_model_arg), as a Path."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise UserError(f"{name} must be a path (str or Path) or a shipped model's name, got {value!r}")
    check_model_arg(value, flag, call)
    return Path(value)


# ---- fine-tuning ---------------------------------------------------------------------------------------
LINEAR_PROBE_FIX = "set finetune.per_class (images per class), or pass --no-baselines"


def finetune(
    checkpoint: PathLike | None = None,
    config: ConfigSource | None = None,
    overrides: Sequence[str] = (),
    run_dir: PathLike | None = None,
    *,
    callbacks: Iterable = (),
    device: str | torch.device = "auto",
    resume: PathLike | None = None,
    weights: str | None = None,
    baselines: bool = True,
    force_preprocessing: bool = False,
) -> FinetuneResult:
    """Fine-tune a classifier on the labels (train/finetune.py) in a run dir of its own (default
    runs/<name>-finetune), on the trainer's loop; then its test accuracy beside the baselines at the
    same budget: the same architecture from scratch and the linear probe of the pretrained checkpoint
    (`baselines`). `checkpoint`: the pretrained model (a .pt checkpoint, an export dir, a shipped
    model's name), its EMA weights where it has them unless `weights` says raw. The other arguments
    as `train`'s. Returns a `FinetuneResult`."""
    from vitmask.train.finetune import FinetuneTrainer

    config, overrides, run_dir, callbacks, device_name = _arguments(config, overrides, run_dir, callbacks, device)
    checkpoint, resume = (
        _model_path(checkpoint, "checkpoint", call="vitmask.finetune"),
        _optional_path(resume, "resume"),
    )
    world, device = distributed.init(resolve_device(device_name))
    try:
        plan, pretrained = _finetune_plan(checkpoint, config, overrides, run_dir, resume, weights, force_preprocessing)
        check_extras(plan.cfg)
        check_fits(plan.cfg, device)
        source = str(checkpoint) if checkpoint is not None else plan.state.get("pretrained")
        made: dict = {}

        def make_trainer(cfg, data, device, logger=None, world=None, probe=None):
            encoder = pretrained.model.state_dict() if pretrained is not None else None
            made["trainer"] = FinetuneTrainer(cfg, data, device, encoder, logger, world, source)
            made["data"] = made["trainer"].data  # finetune.per_class's subset, or the splits as loaded
            if baselines and world.main and source is not None and locate(source) is not None:
                check_unpackable(made["data"], LINEAR_PROBE_FIX)  # the linear probe's, refused before training
            return made["trainer"]

        owner = rundir.RunDir(plan.run_dir, plan.state is None, auto=resume == "auto") if world.main else None
        with owner or contextlib.nullcontext(), rundir.quiet_writer_threads():
            try:
                run_plan(plan, device, world, make_trainer, callbacks)
            except (Interrupted, rundir.WriteFailure) as e:  # the resume command they print names finetune
                raise e.resumed_with("finetune") from None
        distributed.barrier(world)
        trainer, data = made["trainer"], made["data"]
        done = {f.name: getattr(trainer.result, f.name) for f in dataclasses.fields(TrainResult)}
        out = {"test_images": len(data.images["test"]), "test_accuracy": trainer.test_accuracy(data.images["test"])}
        if baselines and world.main:
            out.update(_finetune_baselines(plan.cfg, data, device, source, weights))
        return FinetuneResult(**done, pretrained=source, **out)
    finally:
        distributed.shutdown()


def _finetune_baselines(cfg: Config, data, device: torch.device, source: str | None, weights: str | None) -> dict:
    """The same architecture fine-tuned from its random init at the same budget (no run dir), and the
    linear probe of the pretrained checkpoint with the same pooling."""
    from vitmask.train.finetune import FinetuneTrainer

    print(f"baseline: the same classifier from a random init, {cfg.train.max_steps} steps", flush=True)
    scratch = FinetuneTrainer(cfg, data, device, baseline="baseline from scratch")
    scratch.fit(None, progress=False)
    out = {"from_scratch": scratch.test_accuracy(data.images["test"])}
    if source is not None and locate(source) is not None:  # a path, or a shipped model's name
        data = unpacked_splits(data, LINEAR_PROBE_FIX)
        model, pre_cfg, _ = load_model(source, device, weights, need_head=False)
        pool = cfg.finetune.pool
        grid = cfg.finetune.grid if pool == "grid" else None
        print("baseline: the linear probe of the pretrained checkpoint, with the same pooling", flush=True)
        probe = run_probes(model, pre_cfg, data, "test", None, 20, cfg.seed, pool, grid, progress=True)
        out["linear_probe"] = probe["results"]["model"]["linear_acc"]
    return out


def _finetune_plan(
    checkpoint: Path | None,
    config,
    overrides: list[str],
    run_dir: Path | None,
    resume: str | None,
    weights: str | None,
    force_preprocessing: bool = False,
):
    """What `vitmask finetune` runs: (rundir.Resolved, the pretrained model or None on resume).

    A fresh run takes the data and training keys from `config` and the model from `checkpoint`
    (its `model` and `mask` sections); how the images were made binary follows the pack's header,
    or the pretrained model's config on the same raw images (data/binarization.py). A resume
    (`--resume PATH|auto`) continues a fine-tuning checkpoint; only rundir.RESUMABLE keys may change."""
    asked = load_config(config, overrides) if config is not None else None
    if run_dir is None and asked is not None:
        run_dir = Path("runs") / f"{asked.name}-finetune"
    state = source = None
    if resume == "auto":
        if run_dir is None:
            raise UserError("--resume auto needs --run-dir DIR, or --config PATH to name runs/<name>-finetune")
        found = rundir.newest_good_checkpoint(Path(run_dir))
        state, source = found if found is not None else (None, None)
    elif resume is not None:
        source = Path(resume)
        state = load_checkpoint(source)
        check_resumable(state, source)
        run_dir = Path(run_dir) if run_dir is not None else source.parent
        rundir.check_same_run(state, source, Path(run_dir))
    if state is not None:
        if state.get("task") != "finetune":
            raise UserError(
                f"checkpoint {source} is not a fine-tuning checkpoint (it was written by vitmask train); "
                "pass it as --checkpoint to start a fine-tuning, or resume a run dir of vitmask finetune"
            )
        trained = config_of(state, source)
        if asked is not None:
            asked = dataclasses.replace(asked, model=trained.model, mask=trained.mask)
        else:
            asked = config_of(state, source, overrides)
        changes = rundir.reconcile(trained, asked)
        if asked.train.max_steps < state["step"]:
            raise UserError(f"checkpoint {source} is at step {state['step']}, past train.max_steps; raise it")
        return rundir.Resolved(Path(run_dir), asked, state, source, state.get("run_id"), changes), None
    if checkpoint is None:
        raise UserError("finetune needs --checkpoint PATH: the pretrained checkpoint or export dir to start from")
    if asked is None:
        raise UserError("no config given; pass --config PATH (the data and training keys, e.g. configs/finetune.yaml)")
    told = Asked.of(config, overrides, force_preprocessing)
    asked, said = follow_pack(asked, told)
    pretrained = load_model(checkpoint, "cpu", weights, need_head=False)
    asked, more = follow_pretrained(asked, pretrained.config, f"the pretrained model ({checkpoint})", told)
    check_same_images(pretrained.config, asked, f"checkpoint {checkpoint}")
    cfg = dataclasses.replace(asked, model=pretrained.config.model, mask=pretrained.config.mask)
    plan = rundir.Resolved(Path(run_dir), cfg, None, None, rundir.new_run_id(), [], said=said + more)
    return plan, pretrained
