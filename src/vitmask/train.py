"""The trainer: one model, one optimizer, one batch sampler, and a loop.

`Trainer.state_dict()` is the whole state of a run, so a run resumes from any checkpoint.
The step does no host sync: training metrics are summed on the device and read back only on
logging steps.

Shapes: B batch, N patches, M masked patches per image, C token classes.
"""

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vitmask.checkpoint import save_checkpoint
from vitmask.config import Config
from vitmask.data import Batch, BatchSampler
from vitmask.errors import UserError
from vitmask.evaluate import class_counts, evaluate
from vitmask.metrics_log import NullLogger
from vitmask.model import build_model
from vitmask.runtime import rng_state, seed_everything, set_rng_state


def masked_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over masked patches: logits (B, M, C), targets (B, M) -> scalar."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Trainer:
    def __init__(self, cfg: Config, splits: dict[str, torch.Tensor], device: torch.device, logger=None):
        seed_everything(cfg.seed)
        self.cfg = cfg
        self.device = device
        self.logger = logger or NullLogger()
        self.model = build_model(cfg).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.train.lr)
        self.sampler = BatchSampler(splits["train"].to(device), cfg)
        self.val_images = splits["val"].to(device)
        counts = class_counts(splits["train"], cfg.data.patch_size, cfg.data.num_classes)
        self.majority_class = int(counts.argmax())
        self.step = 0
        self.best_val_loss = math.inf
        self._sums = torch.zeros(2, device=device)  # running (loss, acc) sums since the last log
        self._since_log = 0

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        self.model.train()
        logits = self.model(batch.patches, batch.mask, batch.ids)  # (B, M, C)
        targets = batch.targets.gather(1, batch.ids)  # (B, M)
        loss = masked_loss(logits, targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        acc = (logits.detach().argmax(-1) == targets).float().mean()
        return {"loss": loss.detach(), "acc": acc}

    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        c = self.cfg
        limit = c.train.eval_batches if max_batches is None else max_batches
        return evaluate(self.model, self.val_images, c, c.mask.ratio, c.seed, self.majority_class, max_batches=limit)

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
            "step": self.step,
            "best_val_loss": self.best_val_loss,
            "majority_class": self.majority_class,
            "config": self.cfg.to_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        check_model_state(self.model, state["model"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.best_val_loss = float(state["best_val_loss"])

    # ---- the loop ---------------------------------------------------------------------------
    def fit(self, run_dir: Path | None = None, progress: bool | None = None) -> dict[str, float]:
        """Train until train.max_steps; validate, log and checkpoint on the configured cadence."""
        t = self.cfg.train
        if progress is None:
            progress = sys.stdout.isatty()
        bar = tqdm(total=t.max_steps, initial=self.step, disable=not progress, file=sys.stdout, desc="train")
        val: dict[str, float] = {}
        while self.step < t.max_steps:
            out = self.train_step(self.sampler.sample())
            self.step += 1
            bar.update(1)
            self._sums += torch.stack([out["loss"], out["acc"]])
            self._since_log += 1
            last = self.step == t.max_steps
            if self.step % t.log_every == 0 or last:
                loss, acc = (self._sums / self._since_log).tolist()  # the one sync, on logging steps
                if not math.isfinite(loss):
                    raise UserError(f"training diverged: the loss is {loss} at step {self.step}; lower train.lr")
                self.logger.log({"train/loss": loss, "train/acc": acc, "train/lr": t.lr}, self.step)
                bar.set_postfix(loss=f"{loss:.4f}")
                self._sums.zero_()
                self._since_log = 0
            if self.step % t.eval_every == 0 or last:
                val = self.evaluate()
                self.logger.log({f"val/{k}": val[k] for k in ("loss", "acc", "acc_nonempty")}, self.step)
                line = (
                    f"step {self.step}/{t.max_steps}  val loss {val['loss']:.4f}  acc {val['acc']:.4f}"
                    f"  non-empty acc {val['acc_nonempty']:.4f}  (majority {val['majority_acc']:.4f})"
                )
                bar.write(line, file=sys.stdout)
                sys.stdout.flush()
                if run_dir is not None and val["loss"] < self.best_val_loss:
                    self.best_val_loss = val["loss"]
                    save_checkpoint(self.state_dict(), run_dir / "best.pt")
            if run_dir is not None and (self.step % t.checkpoint_every == 0 or last):
                save_checkpoint(self.state_dict(), run_dir / "last.pt")
        bar.close()
        return val

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
