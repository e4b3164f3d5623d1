"""`vitmask finetune`: a classifier trained end to end on the labels, on a pretrained encoder
(train/finetune.py), in a run dir of its own through the same run machinery as `vitmask train`
(cli/verbs.py `run_plan`: the lock, resume, signals, TensorBoard, checkpoints); then its test
accuracy beside two baselines at the same budget.

A fresh fine-tuning follows how its images were made binary (data/binarization.py): a pack's
header, or the pretrained model's config where it was trained on the same raw images, over the
`--config` file's data keys (one note line); a contradicting `--set` is refused unless
`force_preprocessing`. The classifier records the values it ends with."""

import contextlib
import dataclasses
from pathlib import Path

import torch

from vitmask.cli import verbs
from vitmask.config import Config, load_config
from vitmask.data.binarization import Asked, follow_pack, follow_pretrained
from vitmask.data.per_class import check_unpackable, unpacked_splits
from vitmask.errors import UserError
from vitmask.evaluate.probe import run_probes
from vitmask.model.memory_estimate import check_fits
from vitmask.pretrained import locate
from vitmask.runtime import distributed
from vitmask.runtime.process import resolve_device
from vitmask.signals import Interrupted
from vitmask.store import rundir
from vitmask.store.checkpoint import check_resumable, config_of, load_checkpoint
from vitmask.store.export import load_model
from vitmask.store.init_weights import check_same_images


def finetune(
    checkpoint: Path | None,
    config: Path | None,
    overrides: list[str],
    run_dir: Path | None,
    resume: str | None,
    device_name: str,
    weights: str | None = None,
    baselines: bool = True,
    force_preprocessing: bool = False,
) -> dict:
    """Fine-tune a classifier on the labels (train/finetune.py) in a run dir of its own, on the
    trainer's loop; then its test accuracy beside the baselines at the same budget: the same
    architecture from scratch and the linear probe of the pretrained checkpoint.
    `force_preprocessing` keeps a `--set` data key that contradicts the record it follows."""
    from vitmask.train.finetune import FinetuneTrainer

    world, device = distributed.init(resolve_device(device_name))
    try:
        plan, pretrained = _finetune_plan(checkpoint, config, overrides, run_dir, resume, weights, force_preprocessing)
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
                verbs.run_plan(plan, device, world, make_trainer)
            except (Interrupted, rundir.WriteFailure) as e:  # the resume command they print names finetune
                raise e.resumed_with("finetune") from None
        distributed.barrier(world)
        trainer, data = made["trainer"], made["data"]
        report = {
            "run_dir": str(plan.run_dir),
            "checkpoint": source,
            "steps": trainer.step,
            "test_images": len(data.images["test"]),
            "finetuned": trainer.test_accuracy(data.images["test"]),
        }
        if baselines and world.main:
            report.update(_finetune_baselines(plan.cfg, data, device, source, weights))
        return report
    finally:
        distributed.shutdown()


LINEAR_PROBE_FIX = "set finetune.per_class (images per class), or pass --no-baselines"


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
    config: Path | None,
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
