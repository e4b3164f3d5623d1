"""The trainer: one model, one optimizer and schedule, one batch sampler, and a loop.

`Trainer.state_dict()` is the whole state of a run (model, optimizer, schedule, grad scaler, step,
best metric, every RNG state, the config), so a run resumes exactly from any checkpoint.

The step does no host sync: training metrics are summed on the device and read back only on
logging steps. A non-finite loss is recorded on the device as the first bad step; that record is
read on logging steps and before every checkpoint write, so no checkpoint is ever written after a
bad step and the error names the step where the loss first went bad.

SIGINT and SIGTERM are caught: the current step finishes, a checkpoint is written, and `fit`
raises `Interrupted` (exit code 130 or 143).

Shapes: B batch, N patches, M masked patches per image, C token classes, P pixels per patch.
"""

import contextlib
import math
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vitmask import distributed
from vitmask.checkpoint import plain_state_dict, save_checkpoint, write_run_checkpoint
from vitmask.config import Config
from vitmask.data import Batch, BatchSampler, make_batch
from vitmask.distributed import World
from vitmask.errors import UserError
from vitmask.evaluate import class_counts, evaluate
from vitmask.masking import num_masked, random_mask
from vitmask.metrics_log import NullLogger
from vitmask.model import build_model
from vitmask.optim import build_optimizer, build_scheduler
from vitmask.patches import classes_to_patches
from vitmask.runtime import (
    autocast,
    check_compile,
    check_precision,
    grad_scaler,
    keep_freed_memory,
    rng_state,
    seed_everything,
    set_deterministic,
    set_rng_state,
)

# Device-side sums per logging window, in this order.
SUMS = ("loss", "grad_norm", "hits", "hits_nonempty", "count_nonempty", "bit_hits")
GRID_IMAGES = 8  # val images in the TensorBoard reconstruction grid


class Interrupted(Exception):
    """Training stopped by a signal after a checkpoint was written; `code` is the exit status."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def masked_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over masked patches: logits (B, M, C), targets (B, M) -> scalar."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def bit_hits(pred: torch.Tensor, targets: torch.Tensor, num_bits: int) -> torch.Tensor:
    """How many pixels (bits) of the predicted classes match the true ones: (B, M) x 2 -> scalar."""
    return (classes_to_patches(pred, num_bits) == classes_to_patches(targets, num_bits)).sum()


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Cut a batch into `parts` equal micro-batches along B (views, no copy)."""
    if parts == 1:
        return [batch]
    fields = (batch.patches, batch.targets, batch.mask, batch.ids)
    return [Batch(*chunk) for chunk in zip(*(f.chunk(parts) for f in fields), strict=True)]


class Trainer:
    def __init__(
        self,
        cfg: Config,
        splits: dict[str, torch.Tensor],
        device: torch.device,
        logger=None,
        world: World | None = None,
    ):
        t = cfg.train
        self.world = world or World()
        check_precision(t.precision, device)
        if device.type == "cpu":
            keep_freed_memory()  # no page faults on every step's activations (runtime.py)
        distributed.check_batch(cfg.data.batch_size, t.accum_steps, self.world)
        if t.compile:
            check_compile(device)
        set_deterministic(t.deterministic)
        seed_everything(cfg.seed)
        self.cfg = cfg
        self.device = device
        self.logger = logger or NullLogger()
        self.model = build_model(cfg).to(device)  # the plain module: state dicts and evaluation use it
        self.optimizer = build_optimizer(self.model, t)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.scaler = grad_scaler(t.precision, device)
        self.ddp = None
        net: torch.nn.Module = self.model
        if self.world.distributed:
            ids = [device.index] if device.type == "cuda" else None
            net = self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        self.net = torch.compile(net) if t.compile else net  # what the training step calls
        self.sampler = BatchSampler(splits["train"].to(device), cfg, self.world.rank, self.world.size)
        self.val_images = splits["val"].to(device)
        counts = class_counts(splits["train"], cfg.data.patch_size, cfg.data.num_classes)
        self.majority_class = int(counts.argmax())
        self.grid_batch = self._grid_batch()
        self.step = 0
        self.best_val_loss = math.inf
        self._sums = torch.zeros(len(SUMS), device=device)  # running sums since the last log
        self._since_log = 0
        self._bad_step = torch.zeros((), dtype=torch.long, device=device)  # first non-finite step; 0 = none
        self._lr = t.lr
        self._signal: int | None = None
        self.run_id: str | None = None  # the run's id, saved in every checkpoint (rundir.py)
        self._compiled = False  # whether a compiled step has run in this process

    def _grid_batch(self) -> Batch:
        """Fixed val images and masks for the reconstruction grid, the same at every evaluation."""
        c = self.cfg
        images = self.val_images[:GRID_IMAGES]
        g = torch.Generator(device=self.device).manual_seed(c.seed)
        n = c.data.num_patches
        ids, mask = random_mask(len(images), n, num_masked(n, c.mask.ratio), g, self.device)
        return make_batch(images, c.data.patch_size, ids, mask)

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One optimisation step over `batch` (this rank's shard), in `train.accum_steps` micro-batches."""
        t = self.cfg.train
        self.net.train()
        micro = split_batch(batch, t.accum_steps)
        losses, preds = [], []
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            sync = self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()
            with sync:
                with autocast(t.precision, self.device):
                    logits = self.net(mb.patches, mb.mask, mb.ids)  # (b, M, C)
                loss = masked_loss(logits, mb.targets.gather(1, mb.ids))
                self.scaler.scale(loss / len(micro)).backward()
            losses.append(loss.detach())
            preds.append(logits.detach().argmax(-1))  # (b, M)
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip or math.inf)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self._lr = self.scheduler.get_last_lr()[0]  # the lr this step used (a Python float)
        self.scheduler.step()
        self.step += 1

        loss = torch.stack(losses).mean()
        pred = torch.cat(preds)  # (B, M)
        targets = batch.targets.gather(1, batch.ids)  # (B, M)
        hit = pred == targets
        filled = targets != 0
        self._bad_step = torch.where((self._bad_step == 0) & ~torch.isfinite(loss), self.step, self._bad_step)
        bits = bit_hits(pred, targets, self.cfg.data.patch_dim)
        stats = torch.stack([loss, grad_norm, hit.sum(), (hit & filled).sum(), filled.sum(), bits]).float()
        self._sums += stats
        self._since_log += 1
        return {"loss": loss, "acc": hit.float().mean(), "grad_norm": grad_norm}

    def check_finite(self) -> None:
        """Raise a UserError naming the first step with a non-finite loss, if there was one (a host sync)."""
        bad = int(distributed.all_max(self._bad_step.clone(), self.world))
        if bad:
            raise UserError(
                f"training diverged: the loss is NaN or inf at step {bad}; no checkpoint was written after it; "
                "lower train.lr, set train.grad_clip, or use train.precision=fp32"
            )

    def evaluate(self, max_batches: int | None = None, ratio: float | None = None) -> dict[str, float]:
        """Validation metrics at `ratio` (default mask.ratio) on train.eval_batches (or max_batches) batches."""
        c = self.cfg
        limit = c.train.eval_batches if max_batches is None else max_batches
        ratio = c.mask.ratio if ratio is None else ratio
        with autocast(c.train.precision, self.device):
            return evaluate(self.model, self.val_images, c, ratio, c.seed, self.majority_class, max_batches=limit)

    @torch.no_grad()
    def reconstruction(self) -> torch.Tensor:
        """(3, H', W') grid of the fixed val images: original, masked, predicted, errors."""
        from vitmask.render import reconstruction_grid  # imports torchvision: only when a grid is drawn

        b = self.grid_batch
        self.model.eval()
        with autocast(self.cfg.train.precision, self.device):
            pred = self.model(b.patches, b.mask).argmax(-1)  # (B, N)
        images = self.val_images[: len(pred)]
        return reconstruction_grid(images, b.mask, pred, self.cfg.data.patch_size)

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
            "step": self.step,
            "best_val_loss": self.best_val_loss,
            "majority_class": self.majority_class,
            "config": self.cfg.to_dict(),
            "run_id": self.run_id,
        }

    def load_state_dict(self, state: dict) -> None:
        model_state = plain_state_dict(state["model"])
        check_model_state(self.model, model_state)
        self.model.load_state_dict(model_state)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as e:
            raise UserError(
                f"the checkpoint's optimizer state does not fit this run ({e}); resume with the config it was "
                "trained with"
            ) from None
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.best_val_loss = float(state["best_val_loss"])

    def save(self, run_dir: Path) -> Path:
        """Check the loss stayed finite, then (rank 0) write step_<step>.pt and last.pt."""
        self.check_finite()
        path = Path(run_dir) / "last.pt"
        if self.world.main:
            write_run_checkpoint(self.state_dict(), run_dir, self.cfg.train.keep_last)
        distributed.barrier(self.world)
        return path

    # ---- the loop ---------------------------------------------------------------------------
    def fit(self, run_dir: Path | None = None, progress: bool | None = None) -> dict[str, float]:
        """Train until train.max_steps; validate, log and checkpoint on the configured cadence."""
        t = self.cfg.train
        if progress is None:
            progress = sys.stdout.isatty() and self.world.main
        bar = tqdm(total=t.max_steps, initial=self.step, disable=not progress, file=sys.stdout, desc="train")
        val: dict[str, float] = {}
        self._window_start = time.perf_counter()
        with self._catch_signals():
            while self.step < t.max_steps:
                self._run_step()
                bar.update(1)
                last = self.step == t.max_steps
                if self.step % t.log_every == 0 or last:
                    self._log_train(bar, progress)
                if self.step % t.eval_every == 0 or last:
                    val = self._validate(run_dir, bar)
                saved = run_dir is not None and (self.step % t.checkpoint_every == 0 or last)
                if saved:
                    self.save(run_dir)
                if distributed.any_rank(self._signal is not None, self.world):
                    self._stop(run_dir, saved, bar)
        bar.close()
        if not val:
            val = self.evaluate()
        self._log_hparams(val)
        return val

    def _run_step(self) -> None:
        """One step of the loop; with train.compile, a failure to compile on the first one is a UserError."""
        batch = self.sampler.sample()
        if not self.cfg.train.compile or self._compiled:
            self.train_step(batch)
            return
        self._compiled = True
        try:
            self.train_step(batch)
        except UserError:
            raise
        except Exception as e:  # inductor raises many types when it cannot build a kernel
            reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else e.__class__.__name__
            raise UserError(
                f"torch.compile failed on the first step ({reason}); use --set train.compile=false"
            ) from None

    def _log_train(self, bar, progress: bool) -> None:
        sums = distributed.all_mean(self._sums.clone(), self.world)  # counts: the mean over ranks is fine
        loss, grad_norm, hits, hits_ne, count_ne, bit_hits = sums.tolist()  # the sync, on logging steps
        self.check_finite()
        now = time.perf_counter()
        n = self._since_log
        count = n * self.cfg.data.batch_size // self.world.size * self.sampler.num_mask  # masked patches per rank
        metrics = {
            "train/loss": loss / n,
            "train/acc": hits / count,
            "train/acc_nonempty": hits_ne / count_ne if count_ne else float("nan"),
            "train/bit_acc": bit_hits / (count * self.cfg.data.patch_dim),
            "train/lr": self._lr,
            "train/grad_norm": grad_norm / n,
            "train/images_per_s": n * self.cfg.data.batch_size / max(now - self._window_start, 1e-9),
        }
        if self.device.type == "cuda":
            metrics["train/peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self._sums.zero_()
        self._since_log = 0
        self._window_start = now
        if not self.world.main:
            return
        self.logger.log(metrics, self.step)
        if progress:
            bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
        else:
            print(
                f"step {self.step}/{self.cfg.train.max_steps}  loss {metrics['train/loss']:.5f}"
                f"  acc {metrics['train/acc']:.4f}  lr {self._lr:.3e}  grad norm {metrics['train/grad_norm']:.3f}"
                f"  {metrics['train/images_per_s']:.0f} img/s",
                flush=True,
            )

    def _validate(self, run_dir: Path | None, bar) -> dict[str, float]:
        self.check_finite()
        val = self.evaluate()
        if self.world.main:
            self.logger.log(
                {f"val/{k}": v for k, v in val.items() if k in ("loss", "acc", "acc_nonempty", "bit_acc")}, self.step
            )
            self.logger.log_image("val/reconstruction", self.reconstruction(), self.step)
            line = (
                f"step {self.step}/{self.cfg.train.max_steps}  val loss {val['loss']:.4f}  acc {val['acc']:.4f}"
                f"  non-empty acc {val['acc_nonempty']:.4f}  (majority {val['majority_acc']:.4f})"
            )
            bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        if val["loss"] < self.best_val_loss:
            self.best_val_loss = val["loss"]
            if run_dir is not None and self.world.main:
                save_checkpoint(self.state_dict(), Path(run_dir) / "best.pt")
        return val

    def _log_hparams(self, val: dict[str, float]) -> None:
        if not self.world.main:
            return
        hparams = {}  # every config key, as section.key
        raw = self.cfg.to_dict()
        for section in ("train", "model", "mask", "data"):
            hparams.update({f"{section}.{k}": v for k, v in raw.pop(section).items()})
        hparams.update(raw)
        # TensorBoard takes scalars and strings only: lists (ranges) and None become text
        hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in hparams.items()}
        metrics = {f"hparam/val_{k}": val[k] for k in ("loss", "acc", "acc_nonempty", "bit_acc") if k in val}
        metrics["hparam/best_val_loss"] = self.best_val_loss
        self.logger.log_hparams(hparams, metrics, self.step)

    @contextlib.contextmanager
    def _catch_signals(self):
        """While training, SIGINT/SIGTERM only set a flag; the loop stops after the current step."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            self._signal = signum

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _stop(self, run_dir: Path | None, saved: bool, bar) -> None:
        bar.close()
        signum = self._signal or signal.SIGTERM
        name = signal.Signals(signum).name
        if run_dir is None:
            raise Interrupted(f"stopped by {name} at step {self.step}; no run dir, so nothing was saved", 128 + signum)
        path = Path(run_dir) / "last.pt" if saved else self.save(run_dir)
        raise Interrupted(
            f"stopped by {name} at step {self.step}; checkpoint written to {path}; "
            f"resume with: vitmask train --run-dir {run_dir} --resume auto",
            128 + signum,
        )

    def close(self) -> None:
        self.logger.close()


def check_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise a UserError naming the keys where `state` does not fit `model`."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append("shape mismatch: " + "; ".join(shapes[:4]))
        if missing:
            parts.append("missing: " + ", ".join(missing[:4]))
        if unexpected:
            parts.append("unexpected: " + ", ".join(unexpected[:4]))
        raise UserError(
            "checkpoint does not fit this model (" + " | ".join(parts) + "); resume with the config it was trained with"
        )
