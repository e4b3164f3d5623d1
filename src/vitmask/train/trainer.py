"""The trainer: one model, its optimizer and schedule, one batch sampler, the step and the loop.

`Trainer.state_dict()` is the whole state of a run (model, optimizer, schedule, grad scaler, step,
best validation loss, every RNG state, the config), so a run resumes exactly from any checkpoint.
The step does no host sync: its metrics are summed on the device (metrics.py), a non-finite loss
is recorded there (divergence.py), and both are read on logging steps and before checkpoints.

Everything else is a component: process setup (process.prepare_process), validation and the
reconstruction grid (validation.py), checkpoint cadence and best.pt (store/saving.py, `Checkpointer`),
console lines, TensorBoard and hparams (report.py), SIGINT/SIGTERM (signals.py: a stop is acted on
after the step, or within a batch of the validation or the probe, which are then redone first on
resume), the online probe every `train.probe_every` steps beside validation (probe.OnlineProbe,
given by the runner on rank 0),
the EMA of the weights with `train.ema_decay` (ema.py: updated after every step, validated beside
the raw weights, best.pt following its validation loss). A new run may start from given weights
(`init`, store/init_weights.py: `vitmask train --init`); where they came from is kept in every
checkpoint as `init`. Every checkpoint also keeps `foreground_share`, the share of 1-pixels of the
train split (binarization.foreground_share; None for an empty split), which the models' Python calls,
`inpaint` and `predict` compare new images with (binarization.warn_if_far).

Callbacks (callbacks.py, `self.callbacks`: the config's early stopping, then the caller's): their
hooks run on logging steps, after validations, after checkpoints, at the start and at the end; a
stop one asks for (`request_stop`) or an error one raises is acted on after the step, once its
evaluations and checkpoint are done, with last.pt written. Their state is kept in every checkpoint.
A run that ends by itself leaves its `TrainResult` in `self.result` (result.py).

What is trained is a hook: `build_network`, `build_optimization`, `build_sampler`,
`build_validator` and `forward_loss` make the masked-patch task here; a subclass swaps them for
another task on the same loop, checkpoints, resume and signals (finetune.FinetuneTrainer).

Shapes: B batch, M masked patches per image, C token classes.
"""

import contextlib
import math
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import vitmask.train.parity as parity  # the modules, not through the package vitmask.train (it calls run.py)
import vitmask.train.sdpa as sdpa
from vitmask.config import Config
from vitmask.data.batches import Batch, BatchSampler, training_images
from vitmask.data.binarization import foreground_share
from vitmask.errors import Stopped, UserError, warn
from vitmask.evaluate.metrics import SCALARS, MaskedPatchMetrics
from vitmask.model.vit import build_model
from vitmask.progress import note
from vitmask.runtime import distributed, process
from vitmask.runtime.distributed import World
from vitmask.signals import StopSignals, interrupted
from vitmask.store.checkpoint import load_model_state, load_optimizer_state, step_path
from vitmask.store.init_weights import InitWeights
from vitmask.store.saving import Checkpointer
from vitmask.train.callbacks import EarlyStopping, callback_error
from vitmask.train.compile_check import CompileCheck, device_name
from vitmask.train.divergence import DivergenceWatch
from vitmask.train.ema import WeightEMA
from vitmask.train.optim import build_optimizer, build_scheduler
from vitmask.train.report import Reporter
from vitmask.train.result import MAX_STEPS, TrainResult
from vitmask.train.validation import Validator

EVALUATIONS = ("validation", "probe")  # what may run after a step, in this order; a stop may cut either short


def masked_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over masked patches: logits (B, M, C), targets (B, M) -> scalar."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def plain_numbers(metrics: dict) -> dict[str, float]:
    """The float entries of a metrics dict (what a checkpoint keeps of a validation)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def mask_weighted_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over masked patches from every patch's logits: logits (B, N, C), targets (B, N),
    mask (B, N) bool -> scalar. Each patch's cross-entropy is weighted by its mask bit, the sum divided
    by the masked count: `masked_loss` over the masked patches, in shapes that do not depend on M."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")  # (B*N,)
    weight = mask.flatten().float()  # (B*N,) 1 at masked patches
    return (ce * weight).sum() / weight.sum()


def static_step(cfg: Config) -> bool:
    """Whether the training step keeps its shapes fixed for every masked count M (`train.step_shapes`).

    static: the last block and the head compute all N tokens and the loss is weighted by the mask
    (`mask_weighted_loss`), so one compiled graph serves every M and CUDA graphs can replay it.
    masked: the last block computes only the M masked tokens the loss reads (fewer FLOPs; under a
    ratio schedule and train.compile, M is a dynamic size of the graph). auto: static for a compiled
    step under a ratio schedule without a decoder, on any device (on a CPU the compiled static step is
    1.4x the masked one's rate, configs/mnist.yaml; eager, the masked one is faster for
    configs/default.yaml: docs/benchmarks.md); masked elsewhere (a fixed ratio keeps M fixed; with a
    decoder the encoder's token count is N - M).
    """
    train = cfg.train
    if train.step_shapes != "auto":
        return train.step_shapes == "static"
    return train.compile and cfg.mask.ratio_schedule != "fixed" and cfg.model.decoder == "none"


class Trainer:
    VALIDATION_SCALARS = SCALARS  # the validation's metrics, logged as val/<name> (and val_ema/<name>)
    VERB = "train"  # the command that resumes its runs

    def __init__(
        self,
        cfg: Config,
        splits: dict[str, torch.Tensor],
        device: torch.device,
        logger=None,
        world=None,
        probe=None,
        init: InitWeights | None = None,
    ):
        self.world: World = world or World()
        process.prepare_process(cfg, device, self.world)  # checks, then seeds: before the model is built
        self.cfg, self.device, train = cfg, device, cfg.train
        self.probe = probe  # probe.OnlineProbe, run every train.probe_every steps (rank 0), or None
        self.model = self.build_network().to(device)  # the plain module: state dicts and evaluation use it
        if init is not None:  # a new run from given weights: before the optimizer and the EMA see the model
            load_model_state(self.model, init.state)
        self.init = init.record if init is not None else None  # where the weights came from, kept in checkpoints
        share = foreground_share(splits["train"])  # what new images are compared with (binarization.warn_if_far)
        self.foreground_share: float | None = share if math.isfinite(share) else None
        self.optimizer, self.scheduler = self.build_optimization()
        self.ema = WeightEMA(self.model, train.ema_decay) if train.ema_decay > 0 else None  # fp32 copy
        self.scaler = process.grad_scaler(train.precision, device)
        self.ddp = distributed.data_parallel(self.model, device, self.world)  # None in a world of one
        self.plain_net = self.ddp if self.ddp is not None else self.model  # the uncompiled step's net
        self.net = torch.compile(self.plain_net, mode=train.compile_mode) if train.compile else self.plain_net
        self.static = static_step(cfg)  # every token to the head: one graph for every M
        # under a ratio schedule M changes from batch to batch: compile the step for any M at once,
        # not first for the M of batch 1 and again when the second differs (28 s of a cold start)
        self.any_masked_count = train.compile and cfg.mask.ratio_schedule != "fixed" and not self.static
        self.cuda_graphs = process.uses_cuda_graphs(train, device)
        self.sampler = self.build_sampler(training_images(splits["train"], cfg, device))
        self.validator = self.build_validator(splits)
        self.reporter = Reporter(cfg, logger, device, main=self.world.main)
        self.divergence = DivergenceWatch(device, train.warmup_steps)
        self.step = 0
        self.train_metrics = MaskedPatchMetrics(cfg.data.num_classes, device)  # since the last log
        self._grad_norm_sum = torch.zeros((), device=device)  # since the last log
        self._steps_since_log = 0
        self._lr = train.lr  # the lr of the last step (a Python float)
        self.run_id: str | None = None  # the run's id, saved in every checkpoint (rundir.py)
        self._stepped = False  # whether a step has run in this process (a compiled one compiles)
        self.run_dir: Path | None = None  # where fit writes, when it writes
        self.last_val: dict[str, dict[str, float]] = {}  # the last validation's numbers ("raw", "ema"), saved
        self.pending: tuple[str, ...] = ()  # this step's EVALUATIONS a stop cut short (saved; redone on resume)
        self.callbacks: list = self.config_callbacks()  # callbacks.py; the caller may add its own
        self.stop_reason: str | None = None  # a stop a callback asked for, acted on after its step
        self._callback_failure: tuple[str, Exception] | None = None  # (hook, error), acted on after its step
        self.logged_val: dict[str, float] = {}  # the last validation's scalars as logged (val/..., val_ema/...)
        self.best_metrics: dict[str, float] = {}  # the scalars of the validation best.pt holds, and its step
        self.best_step: int | None = None
        self.result: TrainResult | None = None  # set when fit ends by itself

    # ---- the task (hooks) -------------------------------------------------------------------
    def build_network(self) -> torch.nn.Module:
        """The model to train (built after the seeding, so its init comes from `seed`)."""
        return build_model(self.cfg)

    def build_optimization(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        optimizer = build_optimizer(self.model, self.cfg.train)
        return optimizer, build_scheduler(optimizer, self.cfg.train)

    def build_sampler(self, train_images: torch.Tensor) -> BatchSampler:
        """What draws the training batches (train_images on the device): state_dict, load_state_dict, close."""
        return BatchSampler(train_images, self.cfg, self.world.rank, self.world.size)

    def build_validator(self, splits: dict[str, torch.Tensor]) -> Validator:
        return Validator(self.cfg, splits, self.device)

    def forward_loss(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One micro-batch through the training net: (loss, predictions, targets), the last two (b, M)."""
        if self.any_masked_count:
            torch._dynamo.maybe_mark_dynamic(mb.ids, 1)  # M: a size of the graph, not a constant
        with process.autocast(self.cfg.train.precision, self.device):
            if self.static:
                logits = self.net(mb.patches, mb.mask)  # (b, N, C): the same shapes for every M
            else:
                logits = self.net(mb.patches, mb.mask, mb.ids)  # (b, M, C)
        if self.static:
            loss = mask_weighted_loss(logits, mb.targets, mb.mask)
            return loss, logits.detach().argmax(-1).gather(1, mb.ids), mb.masked_targets  # (b, M) twice
        return masked_loss(logits, mb.masked_targets), logits.detach().argmax(-1), mb.masked_targets

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One optimisation step over `batch` (this rank's shard), in `train.accum_steps` micro-batches."""
        self.net.train()
        return self.apply_step(*self.backward(batch))

    def backward(self, batch: Batch) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Forward and backward of each of the `train.accum_steps` micro-batches of `batch` through the
        training net, the gradients summed into `.grad` (each micro-batch's loss divided by their count).
        Returns each micro-batch's (detached loss, predictions (b, M), targets (b, M))."""
        micro = batch.split(self.cfg.train.accum_steps)
        losses, preds, targets = [], [], []
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            sync = self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()
            with sync:
                if self.cuda_graphs:  # one micro-batch a step (process.check_cuda_graphs): a new replay
                    torch.compiler.cudagraph_mark_step_begin()
                with sdpa.scoped(self.device, compiled=self.net is not self.plain_net):  # no cuDNN SDPA
                    loss, pred, target = self.forward_loss(mb)
                self.scaler.scale(loss / len(micro)).backward()
            losses.append(loss.detach())
            preds.append(pred)  # (b, M)
            targets.append(target)  # (b, M)
        return losses, preds, targets

    def apply_step(
        self, losses: list[torch.Tensor], preds: list[torch.Tensor], targets: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The update from the gradients in `.grad` (clip, optimizer, schedule, EMA), then the step's
        metrics from what `backward` returned."""
        train = self.cfg.train
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.grad_clip or math.inf)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self._lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update(self.model, self.step)  # update t = the steps before this one
        self.step += 1

        loss = torch.stack(losses).mean()
        pred, target = torch.cat(preds), torch.cat(targets)  # (B, M), (B, M)
        self.divergence.record(loss, self.step)
        self.train_metrics.add(pred, target, loss * target.numel())  # the step's mean loss over its patches
        self._grad_norm_sum += grad_norm
        self._steps_since_log += 1
        return {"loss": loss, "acc": (pred == target).float().mean(), "grad_norm": grad_norm}

    @contextlib.contextmanager
    def eager(self):
        """Within it, the step's net is the uncompiled one (the same parameters): what the compiled
        step is checked against (train/parity.py)."""
        compiled, cuda_graphs = self.net, self.cuda_graphs
        self.net, self.cuda_graphs = self.plain_net, False
        try:
            yield
        finally:
            self.net, self.cuda_graphs = compiled, cuda_graphs

    def validation_metrics(self) -> list[str]:
        """The names of the metrics each validation gives the loggers and the callbacks."""
        names = [f"val/{k}" for k in self.VALIDATION_SCALARS]
        return names + ([f"val_ema/{k}" for k in self.VALIDATION_SCALARS] if self.ema is not None else [])

    def config_callbacks(self) -> list:
        """The callbacks the config asks for: early stopping (`train.early_stop_*`), its metric one of
        this run's validation metrics."""
        stopping = EarlyStopping.from_config(self.cfg.train)
        if stopping is None:
            return []
        names = self.validation_metrics()
        if stopping.metric not in names:
            raise UserError(
                f"config: train.early_stop_metric {stopping.metric} is not a metric of this run's validations; "
                f"use one of {', '.join(names)}"
            )
        return [stopping]

    def request_stop(self, reason: str) -> None:
        """Stop the run after the current step (its evaluations and checkpoint as due), writing last.pt;
        `reason` is the line that says why (the first reason given is kept)."""
        self.stop_reason = self.stop_reason or " ".join(str(reason).split()) or "a stop was asked for"

    def evaluate(self, max_batches: int | None = None, ratio: float | None = None) -> dict[str, float]:
        """Validation metrics at `ratio` (default mask.ratio) on the validation images (train.eval_images of
        val; their first `max_batches` batches of 256, when given)."""
        return self.validator.evaluate(self.model, max_batches, ratio)

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": process.rng_state(),
            "step": self.step,
            "best_val_loss": self.validator.best_loss,
            "majority_class": self.validator.majority_class,
            "config": self.cfg.to_dict(),
            "run_id": self.run_id,
            "val": self.last_val,
            "init": self.init,
            "foreground_share": self.foreground_share,
            "pending": list(self.pending),
            "divergence": self.divergence.state_dict(),
            "best": {"step": self.best_step, "metrics": dict(self.best_metrics)},
            "callbacks": self._callback_states(),
            **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
        }

    def _callback_keys(self) -> list[str]:
        """Each callback's key in a checkpoint: its class name, `Name#2` for the second of a class, ..."""
        seen: dict[str, int] = {}
        keys = []
        for cb in self.callbacks:
            name = type(cb).__name__
            seen[name] = seen.get(name, 0) + 1
            keys.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
        return keys

    def _callback_states(self) -> dict:
        states = {}
        for key, cb in zip(self._callback_keys(), self.callbacks, strict=True):
            state = cb.state_dict() if hasattr(cb, "state_dict") else None
            if isinstance(state, dict):
                states[key] = state
        return states

    def load_state_dict(self, state: dict) -> None:
        load_model_state(self.model, state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        process.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.sampler.seek(self.step)  # the data order is a function of the step
        self.validator.best_loss = float(state["best_val_loss"])
        self.init = state.get("init") if isinstance(state.get("init"), dict) else None
        pending = state.get("pending", [])  # absent from checkpoints that no stop cut short
        self.pending = tuple(n for n in pending if n in EVALUATIONS) if isinstance(pending, list) else ()
        if isinstance(state.get("divergence"), dict):  # absent from older checkpoints: a new reference
            self.divergence.load_state_dict(state["divergence"])
        best = state.get("best")  # absent from older checkpoints
        if isinstance(best, dict) and isinstance(best.get("metrics"), dict):
            self.best_step, self.best_metrics = best.get("step"), dict(best["metrics"])
        saved = state.get("callbacks") if isinstance(state.get("callbacks"), dict) else {}
        for key, cb in zip(self._callback_keys(), self.callbacks, strict=True):
            if isinstance(saved.get(key), dict) and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(saved[key])
        if self.ema is not None:
            if not isinstance(state.get("ema"), dict):
                raise UserError("the checkpoint holds no EMA weights (an 'ema' entry) although train.ema_decay is set")
            load_model_state(self.ema.module, state["ema"])

    # ---- the loop ---------------------------------------------------------------------------
    def fit(self, run_dir: Path | None = None, progress: bool | None = None) -> dict[str, float]:
        """Train until train.max_steps; validate, log and checkpoint on the configured cadence.

        A stop signal is acted on after the step it arrives in, or within a batch when it arrives
        during the step's validation or online probe: those are abandoned, a checkpoint of the step
        is written with them in `pending`, and a resume redoes them before its first step (and then
        writes the step's checkpoint where one was due), so the resumed run reports, keeps best.pt,
        checkpoints and trains exactly as the unbroken one."""
        train = self.cfg.train
        self.run_dir = run_dir
        checkpointer = Checkpointer(run_dir, train, self.world)
        short = process.short_compiled_run(self.cfg, self.device, train.max_steps - self.step)
        if short is not None and self.net is not self.plain_net:
            warn(short)
        self.reporter.start(self.step, progress)
        val: dict[str, float] = {}
        with StopSignals() as stop:
            self._start_callbacks()
            ended = False  # a callback asked for a stop
            if self.pending:  # resumed from a stop that cut this step's evaluations short: redo them
                val = self._evaluations(checkpointer, self.pending) or val
                saved = not self.pending and checkpointer.due(self.step)  # as the unbroken run saved after them
                if saved:
                    self._save(checkpointer)
                ended = self._stop_if_asked(stop, checkpointer, saved)
            while self.step < train.max_steps and not ended:
                self._run_step()
                self.reporter.advance()
                last = self.step == train.max_steps
                if self.step % train.log_every == 0 or last:
                    self._log_train()
                due = {
                    "validation": self.step % train.eval_every == 0 or last,
                    "probe": self.probe is not None and (self.step % train.probe_every == 0 or last),
                }
                val = self._evaluations(checkpointer, tuple(k for k in EVALUATIONS if due[k])) or val
                saved = checkpointer.due(self.step)
                if saved:
                    self._save(checkpointer)
                ended = self._stop_if_asked(stop, checkpointer, saved)
        self.reporter.end()
        if not val:
            val = self.evaluate()
        self.reporter.hparams(val, self.validator.best_loss, self.step, self.init)
        self.result = self._result(checkpointer, val)
        self._hook("on_end", self.result)
        if self._callback_failure is not None:
            raise self._failed(checkpointer, self.result.last_checkpoint)
        return val

    def _result(self, checkpointer: Checkpointer, val: dict[str, float]) -> TrainResult:
        """The TrainResult of the run that has just ended by itself."""
        run_dir, max_steps = checkpointer.run_dir, self.cfg.train.max_steps
        early = self.stop_reason is not None and self.step < max_steps
        final = self.logged_val or {f"val/{k}": float(val[k]) for k in self.VALIDATION_SCALARS if k in val}
        best = run_dir / "best.pt" if run_dir is not None else None
        return TrainResult(
            run_dir=run_dir,
            step=self.step,
            stop_reason=self.stop_reason if early else MAX_STEPS,
            stopped_early=early,
            final_metrics=dict(final),
            best_metrics=dict(self.best_metrics),
            best_step=self.best_step,
            best_checkpoint=best if best is not None and best.is_file() else None,
            last_checkpoint=checkpointer.last if run_dir is not None and checkpointer.last.is_file() else None,
        )

    # ---- callbacks ---------------------------------------------------------------------------
    def _hook(self, name: str, *args) -> None:
        """Call hook `name` of every callback that has it, in order. A returned reason asks for a stop
        (`request_stop`); an exception is kept, and after it no hook runs: both are acted on after the
        step (`_stop_if_asked`)."""
        if self._callback_failure is not None:
            return
        for cb in self.callbacks:
            hook = getattr(cb, name, None)
            if hook is None:
                continue
            try:
                asked = hook(*args)
            except Exception as e:
                self._callback_failure = (f"{type(cb).__name__}.{name}", e)
                return
            if asked and name != "on_end":
                self.request_stop(
                    asked if isinstance(asked, str) else f"a stop asked for by {type(cb).__name__}.{name}"
                )

    def _start_callbacks(self) -> None:
        """on_start; one that raises ends the run before its first step."""
        self._hook("on_start", self)
        if self._callback_failure is not None:
            self.reporter.end()
            hook, error = self._callback_failure
            raise callback_error(hook, error, self.step, self.run_dir, None, False, self.VERB) from error

    def _failed(self, checkpointer: Checkpointer, path: Path | None):
        """The CallbackError of the hook that raised (on this rank, or another's), after the checkpoint `path`."""
        hook, error = self._callback_failure or ("of another rank", RuntimeError("see that rank's error"))
        failure = callback_error(hook, error, self.step, checkpointer.run_dir, path, True, self.VERB)
        failure.__cause__ = error
        return failure

    def _run_step(self) -> None:
        """One step of the loop; with train.compile, a failure to compile the first one is a UserError,
        and rank 0 says on stderr when it starts compiling and how long the first step took with it.
        The first compiled step in this process is checked against eager (`_checked_step`)."""
        batch = self.sampler.sample()
        first_compiled = self.net is not self.plain_net and not self._stepped
        self._stepped = True
        if first_compiled and self.world.main:
            note("train.compile: compiling the training step (the first step waits for it)")
        started = time.perf_counter()
        with process.compile_failure_as_user_error() if first_compiled else contextlib.nullcontext():
            if first_compiled and self.cfg.train.compile_check != "skip":
                self._checked_step(batch)
            else:
                self.train_step(batch)
        if first_compiled and self.world.main:
            note(f"train.compile: compiled in {time.perf_counter() - started:.1f} s (the first step included)")

    def _checked_step(self, batch: Batch) -> None:
        """The step through the compiled net and through the plain module, the gradients compared
        (compile_check.py); reported, then applied, or refused as train.compile_check says."""
        precision = process.precision_on(self.cfg.train.precision, self.device)
        compared = parity.compare_step(self, batch, precision)
        attention = sdpa.attention_name(self.cfg.model.attention, self.device, precision, compiled=True)
        check = CompileCheck(compared.parity, device_name(self.device), precision, attention)
        self.reporter.compile_check(check, self.run_dir)
        if check.ok:
            compared.apply(self, "compiled")
        elif self.cfg.train.compile_check == "eager":
            warn(check.warning())
            self.net, self.cuda_graphs, self.any_masked_count = self.plain_net, False, False
            compared.apply(self, "eager")
        else:
            raise UserError(check.failure())

    def _log_train(self) -> None:
        metrics = self.train_metrics.read(self.world)  # the host sync, on logging steps only
        grad_norm = float(self._grad_norm_sum) / self._steps_since_log  # the same on every rank under DDP
        self.divergence.check(self.world)
        self.divergence.grad_norm(self.step, grad_norm, metrics.get("loss", math.nan))
        images = self._steps_since_log * self.cfg.data.batch_size
        scalars = self.reporter.train(self.step, metrics, grad_norm, self._lr, images)
        self.train_metrics.reset()
        self._grad_norm_sum.zero_()
        self._steps_since_log = 0
        self._hook("on_step_end", self.step, dict(scalars))

    def _evaluations(self, checkpointer: Checkpointer, due: tuple[str, ...]) -> dict[str, float]:
        """Run the EVALUATIONS `due` at this step, in order; return the validation's metrics ({} if
        none ran). A stop signal during one (signals.check_stop raises Stopped within a batch) abandons
        it and those after it: they stay in `pending`, which the stop's checkpoint keeps."""
        self.pending = due
        val: dict[str, float] = {}
        try:
            for name in due:
                if name == "validation":
                    val = self._validate(checkpointer)
                elif self.probe is not None:  # the probe runs on rank 0 only, and may be off on resume
                    self._probe()
                self.pending = tuple(p for p in self.pending if p != name)
        except Stopped:
            pass  # the stop is acted on after this step's checkpoint: _stop_if_asked
        return val

    def _validate(self, checkpointer: Checkpointer) -> dict[str, float]:
        """Validate the weights (and the EMA's), draw the grid, then report them and keep best.pt. The
        reports and best.pt come after everything a stop may cut short, so a cut validation leaves no
        trace and its redo on resume reports it once."""
        self.divergence.check(self.world)
        val = self.evaluate()
        ema = self.validator.evaluate(self.ema.module) if self.ema is not None else None
        grid = self.validator.reconstruction(self.model) if self.world.main else None  # drawn on rank 0 only
        logged = dict(self.reporter.validation(self.step, val, lambda: grid))
        watched = val  # what best.pt follows: the EMA's validation loss when there is an EMA
        self.last_val = {"raw": plain_numbers(val)}
        if ema is not None:
            watched = ema
            logged.update(self.reporter.validation_ema(self.step, watched))
            self.last_val["ema"] = plain_numbers(watched)
        self.logged_val = logged
        self.pending = tuple(p for p in self.pending if p != "validation")  # done: best.pt holds it whole
        self._hook("on_validation_end", self.step, dict(logged))  # before best.pt, which keeps the callbacks' state
        if self.validator.improved(watched):
            self.best_metrics, self.best_step = dict(logged), self.step
            checkpointer.save_best(self.state_dict)
            if checkpointer.run_dir is not None:
                self._checkpointed("best", checkpointer.run_dir / "best.pt", checkpointer.run_dir / "best.pt")
        return val

    def _probe(self) -> None:
        """The online probe's accuracies on val (probe.OnlineProbe), to the reporter."""
        self.reporter.probe(self.step, self.probe(self.model))

    def _save(self, checkpointer: Checkpointer) -> Path:
        """Check the loss stayed finite, then write step_<step>.pt and last.pt."""
        self.divergence.check(self.world)
        last = checkpointer.save(self.state_dict)
        self._checkpointed("last", last, step_path(checkpointer.run_dir, self.step))
        return last

    def _checkpointed(self, kind: str, path: Path, written: Path) -> None:
        """A checkpoint was written: its path (`path`: last.pt or best.pt) to the loggers, the file
        written (`written`: step_<step>.pt or best.pt) to the callbacks' on_checkpoint (rank 0)."""
        self.reporter.checkpoint(kind, path)
        if self.world.main:
            self._hook("on_checkpoint", written)

    def _stop_if_asked(self, stop: StopSignals, checkpointer: Checkpointer, saved: bool) -> bool:
        """Stop when any rank got a signal or lost its stdout (Interrupted), or when a callback raised
        (CallbackError) or asked for a stop (returns True: the run ends), with last.pt written. One CPU
        collective a step (not a GPU sync); more only on the way to a stop."""
        signalled = stop.received is not None or self.reporter.stdout_closed
        asked = self.stop_reason is not None or self._callback_failure is not None
        if not distributed.any_rank(signalled or asked, self.world):
            return False
        if distributed.any_rank(signalled, self.world):
            self._stop(self._stop_cause(stop), checkpointer, saved)
        path = None if checkpointer.run_dir is None else checkpointer.last if saved else self._save(checkpointer)
        if distributed.any_rank(self._callback_failure is not None, self.world):
            self.reporter.end()
            raise self._failed(checkpointer, path)
        self.stop_reason = self.stop_reason or "a stop asked for on another rank"
        if self.step < self.cfg.train.max_steps:
            where = f"; checkpoint written to {path}" if path is not None else "; no run dir, so nothing was saved"
            self.reporter.stopped(
                f"stopped at step {self.step} of {self.cfg.train.max_steps}: {self.stop_reason}{where}"
            )
        return True

    def _stop_cause(self, stop: StopSignals) -> int:
        """The signal a stop is reported as: the one received, SIGPIPE for a closed stdout, or SIGTERM
        (another rank's)."""
        if stop.received is not None:
            return stop.received
        return signal.SIGPIPE if self.reporter.stdout_closed else signal.SIGTERM

    def _stop(self, signum: int, checkpointer: Checkpointer, saved: bool) -> None:
        """After a signal: write a checkpoint (unless this step did) and raise Interrupted."""
        self.reporter.end()
        path = None if checkpointer.run_dir is None else checkpointer.last if saved else self._save(checkpointer)
        raise interrupted(signum, self.step, checkpointer.run_dir, path, self.pending)

    def close(self) -> None:
        self.sampler.close()
        self.reporter.close()
