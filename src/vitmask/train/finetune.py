"""Fine-tuning on labels (`vitmask finetune`): a classifier on a pretrained encoder, trained end to end
on the Trainer's own loop, checkpoints, exact resume, signals, TensorBoard and run-dir lock.

The classifier (`Classifier`, model/classifier.py) is the pretrained model without its decoder and head
(`MaskedPatchViT.forward_encoder`: every patch visible, the final normalised tokens), the tokens
pooled as `vitmask probe --pool` pools them (`finetune.pool`: the mean, or the means of a
`finetune.grid` x grid of cells, concatenated), a LayerNorm over those features and a new linear
head. The encoder's weights come from a checkpoint (its EMA weights when it has them) or an export
dir; the head is new (normal, std `finetune.head_init_std`; bias 0).

`FinetuneTrainer` is a `Trainer` with the task hooks swapped: the network, AdamW with layer-wise
lr decay (`finetune.layer_decay`: block k of L at lr * decay^(L + 1 - k), the patch embedding and
positions at decay^(L + 1), the final norm and the head at lr; BEiT's rule), a schedule per group
that holds the encoder's lr at 0 for the first `finetune.freeze_steps` steps (the head warms up
on frozen features; the optimizer's state keeps its shape, so resume stays exact), batches of
images and labels, and cross-entropy on the labels. It trains with AdamW whatever
`train.optimizer` says (`train.lr`, betas, eps, weight decay and schedule are read).
Its checkpoints are marked `task: finetune` and keep the classes: `labels`, the label value and the
name of each class index (data/class_names.py), which `vitmask predict`, `eval` and `export` read,
and `foreground_share`, the share of 1-pixels of the train split it reads (over at most 4,096 of its
images, data/binarization.py), against which `vitmask predict` and the Python API check the images
they are given.

Two regularisers act on the training batches only (validation and test see whole, unmoved images),
both off by default and drawn, like the batch order, from generators seeded by (seed, step), so a
run is deterministic and resumes exactly: `finetune.shift` moves each image by a random whole
number of pixels per axis (`shift_images`, background filling in), and `finetune.mask_ratio` hides
a share of each image's patches from the encoder the way pretraining hid them (`Classifier.forward`).

Shapes: B batch, N patches, P pixels per patch, D width, F pooled features, L label classes.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vitmask.config import Config, TrainConfig
from vitmask.data.batches import EpochOrder, LabelledSplits, mix64
from vitmask.data.class_names import class_names
from vitmask.data.masking import random_mask
from vitmask.data.patches import patchify
from vitmask.data.per_class import take_per_class, unpacked_splits
from vitmask.data.prefetch import StepImages
from vitmask.evaluate.probe import FEATURE_BATCH, check_classes, class_indices, require_labels
from vitmask.evaluate.scores import validation_images
from vitmask.model.classifier import Classifier, pool_grid
from vitmask.model.vit import build_model
from vitmask.progress import Progress
from vitmask.runtime import distributed
from vitmask.runtime.distributed import World
from vitmask.runtime.process import autocast
from vitmask.signals import check_stop
from vitmask.store.checkpoint import check_model_state
from vitmask.store.export import drop_prediction_head
from vitmask.train.optim import decays, lr_factor
from vitmask.train.report import Reporter
from vitmask.train.trainer import Trainer


# ---- the regularisers -------------------------------------------------------------------------------
def shift_images(images: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """images (B, H, W), offsets (B, 2) int64 (rows down, columns right) -> (B, H, W): image i moved by
    its offset, pixels moved past the edge dropped, 0 (background) where nothing moved in. One gather."""
    b, h, w = images.shape
    rows = torch.arange(h, device=images.device) - offsets[:, :1]  # (B, H) source row of each row
    cols = torch.arange(w, device=images.device) - offsets[:, 1:]  # (B, W) source column of each column
    inside = ((rows >= 0) & (rows < h)).unsqueeze(2) & ((cols >= 0) & (cols < w)).unsqueeze(1)  # (B, H, W)
    batch = torch.arange(b, device=images.device).view(b, 1, 1)
    moved = images[batch, rows.clamp(0, h - 1).unsqueeze(2), cols.clamp(0, w - 1).unsqueeze(1)]  # (B, H, W)
    return moved * inside.to(images.dtype)


def layer_of(name: str, depth: int) -> int:
    """A classifier parameter's layer for lr decay: 0 the embedding and positions, k block k, depth + 1 the rest."""
    parts = name.split(".")
    if parts[0] != "encoder" or parts[1] == "norm":
        return depth + 1
    return int(parts[2]) + 1 if parts[1] == "blocks" else 0


# ---- batches, metrics, validation ----------------------------------------------------------------------
@dataclass
class LabelledBatch:
    patches: torch.Tensor  # (B, N, P) float 0/1 pixels
    labels: torch.Tensor  # (B,) int64 class indices
    mask: torch.Tensor | None = None  # (B, N) bool, True = hidden from the encoder (finetune.mask_ratio); None: none
    ids: torch.Tensor | None = None  # (B, M) int64 indices of the hidden patches

    def split(self, parts: int) -> list["LabelledBatch"]:
        fields = (self.patches, self.labels, self.mask, self.ids)
        chunks = [[None] * parts if f is None else f.chunk(parts) for f in fields]
        return [LabelledBatch(*c) for c in zip(*chunks, strict=True)]


# the (seed, step, stream) streams of the training draws; BatchSampler's masks and counts are 1 and 2
SHIFT_STREAM, MASK_STREAM = 3, 4


class LabelledBatchSampler:
    """Batches of a split's images and labels in the order of `EpochOrder` (as BatchSampler: batch s
    is the stream positions s * B .. s * B + B - 1, seeded by seed + 1); its state is the step, so a
    resumed run sees the same batches. Every rank computes the same global batch and keeps its shard;
    `prefetch` as BatchSampler's (prefetch.StepImages).

    With finetune.shift S, each image moves by offsets uniform in [-S, S] per axis (`shift_images`);
    with finetune.mask_ratio r, each hides M = round(r * N) patches (at most N - 1) chosen uniformly.
    Both are drawn for the whole global batch on the images' device, from a generator seeded afresh
    from (seed, step, stream) for each batch, so they follow from the step as the order does."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        cfg: Config,
        rank: int = 0,
        world: int = 1,
        prefetch: bool | None = None,
    ):
        self.images, self.labels = images, labels.to(images.device)
        self.patch_size, self.global_batch = cfg.data.patch_size, cfg.data.batch_size
        per_rank = self.global_batch // world
        self.shard = slice(rank * per_rank, (rank + 1) * per_rank)
        self.step_images = StepImages(images, self.global_batch, self.shard, prefetch)
        self.seed = cfg.seed + 1
        self.order = EpochOrder(len(images), self.seed)
        self.shift = cfg.finetune.shift
        n = cfg.data.num_patches
        self.num_patches, self.num_hidden = n, min(round(cfg.finetune.mask_ratio * n), n - 1)
        self.generator = torch.Generator(device=images.device)  # where the step's images are (StepImages)
        self.step = 0  # batches drawn: the next batch is batch `step`

    def seek(self, step: int) -> None:
        self.step = int(step)

    def sample(self) -> LabelledBatch:
        step, shard = self.step, self.shard
        idx, images = self.step_images(self.order, step)  # (b,) CPU int64, (b, H, W)
        self.step += 1
        dev = images.device
        if self.shift:
            self.generator.manual_seed(mix64(self.seed, step, SHIFT_STREAM))
            s = self.shift
            offsets = torch.randint(-s, s + 1, (self.global_batch, 2), generator=self.generator, device=dev)  # (B, 2)
            images = shift_images(images, offsets[shard])  # (b, H, W)
        mask = ids = None
        if self.num_hidden:
            self.generator.manual_seed(mix64(self.seed, step, MASK_STREAM))
            ids, mask = random_mask(self.global_batch, self.num_patches, self.num_hidden, self.generator, dev)
            ids, mask = ids[shard], mask[shard]  # (b, M), (b, N)
        patches = patchify(images, self.patch_size).float()  # (b, N, P)
        return LabelledBatch(patches, self.labels[idx.to(self.labels.device)], mask, ids)

    def close(self) -> None:
        self.step_images.close()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.seed = int(state["seed"])
        self.order = EpochOrder(len(self.images), self.seed)
        self.seek(state["step"])


class ClassifierMetrics:
    """Device-side sums of the loss and the hits since the last read (no host sync until `read`)."""

    def __init__(self, device: torch.device):
        self._sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, hits, count

    def add(self, pred: torch.Tensor, targets: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """pred, targets (B,) class indices; loss_sum their summed cross-entropy."""
        count = torch.tensor(float(targets.numel()), dtype=torch.float64, device=self._sums.device)
        self._sums += torch.stack([loss_sum.detach().double(), (pred == targets).sum().double(), count])

    def reset(self) -> None:
        self._sums.zero_()

    def read(self, world: World | None = None) -> dict[str, float]:
        sums = self._sums if world is None else distributed.all_sum(self._sums.clone(), world)
        loss, hits, count = sums.tolist()
        return {"loss": loss / count if count else math.nan, "acc": hits / count if count else math.nan}


@torch.no_grad()
def classify(model: nn.Module, images: torch.Tensor, patch_size: int, precision: str) -> torch.Tensor:
    """images (n, H, W) uint8 -> logits (n, L) float32, in batches, in eval mode (the mode is restored);
    each batch a stop point (signals.check_stop)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for chunk in images.split(FEATURE_BATCH):
        check_stop()
        with autocast(precision, device):
            out.append(model(patchify(chunk.to(device), patch_size).float()).float())  # (b, L)
    model.train(was_training)
    return torch.cat(out)


class ClassifierValidator:
    """Loss and accuracy on the val labels (of the validation's images: `train.eval_images` of val,
    spread evenly over it), the majority-class accuracy beside them, the best loss so far."""

    def __init__(self, cfg: Config, images: torch.Tensor, labels: torch.Tensor, majority: int, device: torch.device):
        self.cfg, self.images, self.labels = cfg, images.to(device), labels.to(device)
        self.majority_class = majority  # of the train labels
        self.best_loss = math.inf

    def evaluate(self, model: nn.Module, max_batches: int | None = None, ratio: float | None = None) -> dict:
        logits = classify(model, self.images, self.cfg.data.patch_size, self.cfg.train.precision)  # (n, L)
        return {
            "loss": float(F.cross_entropy(logits, self.labels)),
            "acc": float((logits.argmax(1) == self.labels).float().mean()),
            "majority_acc": float((self.labels == self.majority_class).float().mean()),
        }

    def reconstruction(self, model: nn.Module) -> None:
        return None

    def improved(self, val: dict) -> bool:
        if val["loss"] < self.best_loss:
            self.best_loss = val["loss"]
            return True
        return False


class ClassifierReporter(Reporter):
    """The Reporter's lines and scalars for a classifier: loss and accuracy only, no pictures."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scalars = ("loss", "acc")

    def validation(self, step: int, val: dict, grid=None) -> dict[str, float]:
        scalars = {"val/loss": val["loss"], "val/acc": val["acc"]}
        if not self.main:
            return scalars
        self.logger.log(scalars, step)
        self._say(
            f"step {step}/{self.cfg.train.max_steps}  val loss {val['loss']:.4f}  acc {val['acc']:.4f}"
            f"  (majority {val['majority_acc']:.4f})"
        )
        return scalars


class BaselineReporter(ClassifierReporter):
    """A baseline's run (`vitmask finetune`'s from-scratch classifier): its steps as one progress bar
    named `desc` (progress.py: a bar with the ETA on a terminal, a line every 30 s elsewhere), and no
    console lines of its own; the fine-tuning's lines are the ones the console shows."""

    def __init__(self, *args, desc: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.desc = desc
        self.phase = Progress(0, desc, enabled=False)

    def start(self, step: int, progress: bool | None = None) -> None:
        super().start(step, progress=False)
        self.phase = Progress(self.cfg.train.max_steps - step, self.desc, "steps", enabled=self.main)

    def advance(self) -> None:
        super().advance()
        self.phase.update()

    def end(self) -> None:
        super().end()
        self.phase.close()

    def _say(self, line: str) -> None:
        pass


# ---- the trainer ------------------------------------------------------------------------------------
class FinetuneTrainer(Trainer):
    """The Trainer on the classification task. `encoder` is the pretrained model's state dict (None:
    the encoder starts from its random init, the from-scratch baseline). `data` is cut to
    finetune.per_class images of each class of each split first (`self.data`: what it reads).
    `baseline`: the name of the baseline this run is (no run dir): its console shows its progress only
    (`BaselineReporter`)."""

    VALIDATION_SCALARS = ("loss", "acc")  # logged as val/loss, val/acc (ClassifierReporter)
    VERB = "finetune"

    def __init__(
        self,
        cfg: Config,
        data: LabelledSplits,
        device: torch.device,
        encoder: dict[str, torch.Tensor] | None = None,
        logger=None,
        world=None,
        pretrained: str | None = None,
        baseline: str | None = None,
    ):
        require_labels(data, cfg)
        self.data = data = per_class_data(data, cfg)  # the images this trainer reads (finetune.per_class)
        labels = data.labels
        check_classes(labels["train"], "the train split's images", "label the images with their real classes")
        self.labels, self.num_labels = class_indices(labels)
        values = torch.cat(list(labels.values())).unique().tolist()  # the label value of each class index
        self.classes = {"values": values, "names": class_names(cfg.data, values)}
        self.grid = pool_grid(cfg)
        self.encoder_state = encoder
        self.pretrained = pretrained
        super().__init__(cfg, data.images, device, logger=logger, world=world)
        self.train_metrics = ClassifierMetrics(device)
        if baseline is not None:
            self.reporter = BaselineReporter(cfg, logger, device, main=self.world.main, desc=baseline)
        else:
            self.reporter = ClassifierReporter(cfg, logger, device, main=self.world.main)

    def build_network(self) -> Classifier:
        encoder = build_model(self.cfg)
        if self.encoder_state is not None:
            encoder_keys = {k: v for k, v in self.encoder_state.items() if not k.startswith(("decoder.", "head."))}
            drop_prediction_head(encoder)
            check_model_state(encoder, encoder_keys)
            encoder.load_state_dict(encoder_keys)
        return Classifier(encoder, self.num_labels, self.grid, self.cfg.finetune.head_init_std)

    def build_optimization(self):
        t, ft, depth = self.cfg.train, self.cfg.finetune, self.cfg.model.depth
        groups: dict[tuple[int, bool, bool], list] = {}
        for name, p in self.model.named_parameters():
            key = (layer_of(name, depth), decays(name, p), name.startswith("encoder."))
            groups.setdefault(key, []).append(p)
        params, factors = [], []
        # the head's groups first: the lr the trainer logs is the first group's
        for (layer, decayed, in_encoder), ps in sorted(groups.items(), key=lambda kv: (kv[0][2], -kv[0][0], kv[0][1])):
            scale = ft.layer_decay ** (depth + 1 - layer)
            params.append({"params": ps, "lr": t.lr * scale, "weight_decay": t.weight_decay if decayed else 0.0})
            factors.append(group_factor(t, ft.freeze_steps if in_encoder else 0))
        optimizer = torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factors)

    def build_sampler(self, train_images: torch.Tensor) -> LabelledBatchSampler:
        return LabelledBatchSampler(train_images, self.labels["train"], self.cfg, self.world.rank, self.world.size)

    def build_validator(self, splits: dict[str, torch.Tensor]) -> ClassifierValidator:
        majority = int(torch.bincount(self.labels["train"], minlength=self.num_labels).argmax())
        images, labels = (validation_images(x, self.cfg) for x in (splits["val"], self.labels["val"]))
        return ClassifierValidator(self.cfg, images, labels, majority, self.device)

    def forward_loss(self, mb: LabelledBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with autocast(self.cfg.train.precision, self.device):
            # (b, L); hidden patches (finetune.mask_ratio) in training batches only
            logits = self.net(mb.patches) if mb.mask is None else self.net(mb.patches, mb.mask, mb.ids)
        return F.cross_entropy(logits.float(), mb.labels), logits.detach().argmax(-1), mb.labels

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "task": "finetune",
            "pretrained": self.pretrained,
            "labels": self.classes,
        }

    def test_accuracy(self, images: torch.Tensor) -> float:
        """Accuracy on the test split (the EMA's weights when there is an EMA), in fp32 as `vitmask eval`
        and `vitmask predict` score a classifier, so the three agree."""
        model = self.ema.module if self.ema is not None else self.model
        logits = classify(model, images, self.cfg.data.patch_size, "fp32")  # (n, L)
        return float((logits.argmax(1) == self.labels["test"].to(logits.device)).float().mean())


def per_class_data(data: LabelledSplits, cfg: Config) -> LabelledSplits:
    """The splits fine-tuning reads: with finetune.per_class K, at most K images of each class of each
    split (data/per_class.py), in memory (a pack's unpacked); else the splits as loaded."""
    if cfg.finetune.per_class == 0:
        return data
    subset = take_per_class(data, cfg.finetune.per_class, cfg)
    return unpacked_splits(subset, "lower finetune.per_class")


def group_factor(t: TrainConfig, frozen: int):
    """The lr multiplier of a group at each step: 0 for the first `frozen` steps, then optim.lr_factor.
    (A plain function: LambdaLR keeps nothing of it in the checkpoint; the step alone decides.)"""

    def factor(step: int) -> float:
        return 0.0 if step < frozen else lr_factor(step, t)

    return factor
