"""Scoring a model, and the baselines beside it, on masked patches.

Every predictor (the model, each baseline) gets a `Tally`: counts kept as tensors on the device
while the split streams through in batches, read back once at the end. From them come the
accuracy on all masked patches, on non-empty ones (true class not 0, the empty patch), the bit
(pixel) accuracy, the per-class accuracy and the most frequent confusions.

Shapes: B batch, N patches, M masked patches per image, C token classes.
"""

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vitmask.baselines import LABELS, NAMES, Baselines, fit_baselines
from vitmask.config import Config
from vitmask.data import eval_batches
from vitmask.patches import classes_to_patches, patch_label, patches_to_classes, patchify

MAX_CONFUSION_CLASSES = 1024  # a dense C x C confusion matrix is kept up to this many classes
TOP_CONFUSIONS = 5


def class_counts(images: torch.Tensor, patch_size: int, num_classes: int) -> torch.Tensor:
    """(C,) int64 count of each token class over every patch of `images` (n, H, W)."""
    classes = patches_to_classes(patchify(images, patch_size))  # (n, N)
    return torch.bincount(classes.flatten(), minlength=num_classes)


class Tally:
    """The counts behind the accuracy metrics of one predictor, as device tensors (no host sync)."""

    def __init__(self, num_classes: int, device: torch.device):
        c = num_classes
        self.num_classes = c
        self.popcount = classes_to_patches(torch.arange(c, device=device), c.bit_length() - 1).sum(-1).long()  # (C,)
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        self.count, self.correct, self.nonempty, self.nonempty_correct, self.wrong_bits = (z(()) for _ in range(5))
        self.class_total, self.class_correct = z(c), z(c + 1)  # the last slot of class_correct takes misses
        self.confusion = z(c * c) if c <= MAX_CONFUSION_CLASSES else None  # (C * C,) true * C + pred

    def add(self, pred: torch.Tensor, targets: torch.Tensor) -> None:
        """pred, targets (B, M) int64 classes of the masked patches."""
        pred, targets = pred.flatten(), targets.flatten()
        hit = pred == targets
        filled = targets != 0
        self.count += targets.numel()
        self.correct += hit.sum()
        self.nonempty += filled.sum()
        self.nonempty_correct += (hit & filled).sum()
        self.wrong_bits += self.popcount[pred ^ targets].sum()
        self.class_total.scatter_add_(0, targets, torch.ones_like(targets))
        self.class_correct.scatter_add_(0, torch.where(hit, targets, self.num_classes), torch.ones_like(targets))
        if self.confusion is not None:
            self.confusion.scatter_add_(0, targets * self.num_classes + pred, torch.ones_like(targets))

    def summary(self) -> dict[str, float]:
        count, nonempty = int(self.count), int(self.nonempty)
        bits = count * (self.num_classes.bit_length() - 1)
        return {
            "acc": int(self.correct) / count if count else float("nan"),
            "acc_nonempty": int(self.nonempty_correct) / nonempty if nonempty else float("nan"),
            "bit_acc": 1.0 - int(self.wrong_bits) / bits if bits else float("nan"),
        }

    def per_class(self) -> list[dict]:
        """One row per class that occurs among the masked patches: class, patches, acc."""
        total, correct = self.class_total.tolist(), self.class_correct[:-1].tolist()
        return [
            {"class": c, "patches": t, "acc": k / t} for c, (t, k) in enumerate(zip(total, correct, strict=True)) if t
        ]

    def confusions(self, top: int = TOP_CONFUSIONS) -> list[dict]:
        """The `top` most frequent (true, predicted) pairs with true != predicted; share = of the true class."""
        if self.confusion is None:
            return []
        c = self.num_classes
        off = self.confusion.view(c, c).clone()
        off.fill_diagonal_(0)
        counts, flat = off.flatten().topk(min(top, c * c))
        total = self.class_total.tolist()
        rows = []
        for n, i in zip(counts.tolist(), flat.tolist(), strict=True):
            if n:
                t, p = divmod(i, c)
                rows.append({"true": t, "pred": p, "patches": n, "share": n / total[t]})
        return rows


@torch.inference_mode()
def evaluate(
    model: torch.nn.Module,
    images: torch.Tensor,
    cfg: Config,
    ratio: float,
    seed: int,
    majority_class: int,
    batch_size: int = 256,
    max_batches: int = 0,
    progress: bool = False,
    baselines: Baselines | None = None,
) -> dict:
    """Masked-patch loss and accuracies of `model` on `images` (n, H, W), at mask `ratio`.

    Returns loss (mean cross-entropy in nats per masked patch), acc (all masked patches),
    acc_nonempty (masked patches whose true class is not 0, the empty patch), bit_acc (pixels of
    the masked patches), majority_acc (always predicting `majority_class`, on the same masks),
    per_class, confusions and the counts behind them. With `baselines`, also their acc,
    acc_nonempty and bit_acc under "baselines", scored on the same masks.
    """
    was_training = model.training
    model.eval()
    dev = images.device
    c = cfg.data.num_classes
    loss_sum = torch.zeros((), device=dev, dtype=torch.float64)
    majority = torch.zeros((), device=dev, dtype=torch.long)
    tally = Tally(c, dev)
    others = {name: Tally(c, dev) for name in NAMES} if baselines is not None else {}
    batches = eval_batches(images, cfg, ratio, seed, batch_size)
    total = -(-len(images) // batch_size)
    if max_batches:
        total = min(total, max_batches)
    desc = f"eval @ {ratio:g}"
    for i, batch in enumerate(tqdm(batches, total=total, desc=desc, leave=False, disable=not progress)):
        if max_batches and i >= max_batches:
            break
        logits = model(batch.patches, batch.mask, batch.ids).float()  # (B, M, C)
        targets = batch.targets.gather(1, batch.ids)  # (B, M)
        loss_sum += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        tally.add(logits.argmax(-1), targets)
        majority += (targets == majority_class).sum()
        if baselines is not None:
            for name, guess in baselines.predict(batch.targets, batch.mask, batch.ids).items():
                others[name].add(guess, targets)
    model.train(was_training)
    count, n_nonempty = int(tally.count), int(tally.nonempty)
    out = {
        "loss": float(loss_sum) / count,
        **tally.summary(),
        "majority_acc": int(majority) / count,
        "masked_patches": count,
        "nonempty_patches": n_nonempty,
        "per_class": tally.per_class(),
        "confusions": tally.confusions(),
    }
    if baselines is not None:
        out["baselines"] = {name: t.summary() for name, t in others.items() if int(t.count)}
    return out


def evaluate_split(
    model: torch.nn.Module,
    cfg: Config,
    train: torch.Tensor,
    images: torch.Tensor,
    ratios: list[float],
    seed: int,
    progress: bool = False,
) -> list[dict]:
    """The model and the three baselines (fitted on `train`) on `images`, at each mask ratio.

    Both image sets must be on the model's device. Masks come from `seed`, so a rerun gives the
    same numbers.
    """
    results = []
    for ratio in ratios:
        base = fit_baselines(train, cfg, ratio, seed)
        m = evaluate(model, images, cfg, ratio, seed, base.majority, progress=progress, baselines=base)
        results.append({"mask_ratio": ratio, **m})
    return results


def format_report(report: dict) -> str:
    """The eval report as a plain-text table: one block per mask ratio, then per-class accuracy."""
    patch_size = report["patch_size"]
    lines = [
        f"checkpoint {report['checkpoint']}  split {report['split']} ({report['images']:,} images)  "
        f"seed {report['seed']}"
    ]
    head = f"  {'':24}{'loss':>8}{'acc':>9}{'acc non-empty':>15}{'bit acc':>9}"
    row = "  {:24}{:>8}{:9.4f}{:15.4f}{:9.4f}"
    for r in report["results"]:
        lines += [
            "",
            f"mask ratio {r['mask_ratio']:g}  ({r['masked_patches']:,} masked patches, "
            f"{r['nonempty_patches']:,} non-empty)",
            head,
        ]
        lines.append(row.format("model", f"{r['loss']:.4f}", r["acc"], r["acc_nonempty"], r["bit_acc"]))
        for name, b in r.get("baselines", {}).items():
            lines.append(row.format(LABELS[name], "-", b["acc"], b["acc_nonempty"], b["bit_acc"]))
        lines.append("  most frequent confusions of the model (true -> predicted: patches, share of the true class)")
        for c in r["confusions"] or [{}]:
            if not c:
                lines.append("    none")
                continue
            pair = f"{patch_label(c['true'], patch_size)} -> {patch_label(c['pred'], patch_size)}"
            lines.append(f"    {pair}: {c['patches']:,}, {c['share']:.1%}")
    results = report["results"]
    if results:
        lines += ["", "per-class accuracy of the model (class: pixel rows, share of masked patches, acc per ratio)"]
        lines.append(
            "  "
            + f"{'class':>5}  {'pixels':>{2 * patch_size**2}}  {'share':>7}"
            + "".join(f"{'@' + format(r['mask_ratio'], 'g'):>9}" for r in results)
        )
        by_ratio = [{row["class"]: row for row in r["per_class"]} for r in results]
        masked = sum(r["masked_patches"] for r in results)
        for cls in sorted(set().union(*by_ratio)):
            share = sum(br[cls]["patches"] for br in by_ratio if cls in br) / masked
            accs = "".join(f"{br[cls]['acc']:9.4f}" if cls in br else f"{'-':>9}" for br in by_ratio)
            lines.append(f"  {cls:>5}  {patch_label(cls, patch_size):>{2 * patch_size**2}}  {share:7.2%}{accs}")
    return "\n".join(lines)
