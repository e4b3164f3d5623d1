"""Scoring a model, and the baselines beside it, on masked patches.

Every predictor (the model, each baseline) gets a `MaskedPatchMetrics` (metrics.py): sums kept on
the device while the split streams through in batches, read back once at the end. Each batch is a
stop point (signals.check_stop). From them come
the loss, the accuracy on all masked patches, on non-empty ones (true class not 0, the empty
patch), the bit (pixel) accuracy, and for the model the per-class accuracy and the most frequent
confusions.

Shapes: B batch, N patches, M masked patches per image, C token classes.
"""

import torch
import torch.nn.functional as F

from vitmask.config import Config
from vitmask.data.batches import eval_batches, eval_strategy
from vitmask.data.packed import spread
from vitmask.data.patches import patch_label
from vitmask.evaluate.baselines import LABELS, NAMES, Baselines, fit_baselines
from vitmask.evaluate.metrics import SCALARS, MaskedPatchMetrics
from vitmask.progress import track
from vitmask.signals import check_stop


def validation_images(val, cfg: Config):
    """What a validation during training scores: `train.eval_images` images of the val split `val`
    (a tensor, PackedImages, or the labels of one) spread evenly over it, in order, the same ones
    every time; all of them when the split holds no more, or when eval_images is 0."""
    limit = cfg.train.eval_images
    return val if limit == 0 else spread(val, limit)


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
    strategy: str | None = None,
) -> dict:
    """Masked-patch loss and accuracies of `model` on `images` (n, H, W), at mask `ratio`, with masks
    of `strategy` (default: data.eval_strategy of the config).

    Returns loss (mean cross-entropy in nats per masked patch), acc (all masked patches),
    acc_nonempty (masked patches whose true class is not 0, the empty patch), bit_acc (pixels of
    the masked patches), majority_acc (always predicting `majority_class`, on the same masks),
    per_class, confusions and the counts behind them. With `baselines`, also their acc,
    acc_nonempty and bit_acc under "baselines", scored on the same masks.
    """
    was_training = model.training
    model.eval()
    dev = images.device
    num_classes = cfg.data.num_classes
    scores = MaskedPatchMetrics(num_classes, dev, by_class=True)
    majority = MaskedPatchMetrics(num_classes, dev)
    others = {name: MaskedPatchMetrics(num_classes, dev) for name in NAMES} if baselines is not None else {}
    batches = eval_batches(images, cfg, ratio, seed, batch_size, strategy)
    total = -(-len(images) // batch_size)
    if max_batches:
        total = min(total, max_batches)
    desc = f"eval @ {ratio:g}"
    bar = track(batches, desc, "batch", total=total, enabled=progress)  # progress.py: a bar, or lines in a log
    for i, batch in enumerate(bar):
        if max_batches and i >= max_batches:
            break
        check_stop()  # a stop signal recorded during training ends the evaluation within a batch
        logits = model(batch.patches, batch.mask, batch.ids).float()  # (B, M, C)
        targets = batch.masked_targets  # (B, M)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        scores.add(logits.argmax(-1), targets, loss_sum)
        majority.add(torch.full_like(targets, majority_class), targets)
        if baselines is not None:
            for name, guess in baselines.predict(batch.targets, batch.mask, batch.ids).items():
                others[name].add(guess, targets)
    model.train(was_training)
    model_metrics = scores.read()
    out = {
        **{k: model_metrics[k] for k in SCALARS},
        "majority_acc": majority.read()["acc"],
        "masked_patches": model_metrics["masked_patches"],
        "nonempty_patches": model_metrics["nonempty_patches"],
        "per_class": scores.per_class(),
        "confusions": scores.confusions(),
    }
    if baselines is not None:  # acc, acc_nonempty, bit_acc: the scalars but the loss
        read = {name: b.read() for name, b in others.items() if b.patches}
        out["baselines"] = {name: {k: v for k, v in r.items() if k in SCALARS} for name, r in read.items()}
    return out


def evaluate_split(
    model: torch.nn.Module,
    cfg: Config,
    train: torch.Tensor,
    images: torch.Tensor,
    ratios: list[float],
    seed: int,
    progress: bool = False,
    strategy: str | None = None,
) -> list[dict]:
    """The model and the three baselines (fitted on `train`) on `images`, at each mask ratio, with
    masks of `strategy` (random | block | centre; default data.eval_strategy of the config).

    Both image sets must be on the model's device. Masks come from `seed`, so a rerun gives the
    same numbers. `centre` ignores the ratio: pass the box's own share of the patches.
    """
    results = []
    for ratio in ratios:
        base = fit_baselines(train, cfg, ratio, seed, strategy=strategy)
        m = evaluate(
            model, images, cfg, ratio, seed, base.majority, progress=progress, baselines=base, strategy=strategy
        )
        results.append({"mask_ratio": ratio, "strategy": eval_strategy(cfg, strategy), **m})
    return results


def mask_title(result: dict) -> str:
    """How a result's masks were drawn, e.g. 'mask ratio 0.5, random masks' or 'centre box (mask ratio 0.25)'."""
    strategy, ratio = result.get("strategy"), result["mask_ratio"]
    if strategy == "centre":
        return f"centre box (mask ratio {ratio:g})"
    return f"mask ratio {ratio:g}" + (f", {strategy} masks" if strategy else "")


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
            f"{mask_title(r)}  ({r['masked_patches']:,} masked patches, {r['nonempty_patches']:,} non-empty)",
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
            + "".join(
                f"{'box' if r.get('strategy') == 'centre' else '@' + format(r['mask_ratio'], 'g'):>9}" for r in results
            )
        )
        by_ratio = [{row["class"]: row for row in r["per_class"]} for r in results]
        masked = sum(r["masked_patches"] for r in results)
        for cls in sorted(set().union(*by_ratio)):
            share = sum(br[cls]["patches"] for br in by_ratio if cls in br) / masked
            accs = "".join(f"{br[cls]['acc']:9.4f}" if cls in br else f"{'-':>9}" for br in by_ratio)
            lines.append(f"  {cls:>5}  {patch_label(cls, patch_size):>{2 * patch_size**2}}  {share:7.2%}{accs}")
    return "\n".join(lines)
