"""Probes: how much a model's features know about the labels, beside honest floors.

A frozen model sees each whole image (no patch masked) and gives one feature vector per image:
its tokens (the final normalised ones, or block K's output, `MaskedPatchViT.forward_encoder`)
pooled by `pool_tokens`, either their mean (D features) or, with a grid G, the mean of each of the
G x G cells of the patch grid, concatenated (G*G*D features: where the strokes are is kept); cells
are torch's adaptive average pooling's, so any G up to the patches a side works (where G does not
divide it, neighbouring cells share a row or column of patches). With
several layers, each layer's pooled tokens are concatenated. Two probes are trained on the train
split and scored on val or test:

- linear: multinomial logistic regression on features standardised by the train split's mean and
  standard deviation, fitted full-batch by L-BFGS; its L2 strength is the one of `L2_GRID` that
  scores best on val (ties go to the stronger);
- k-NN: cosine similarity to every train image; the k most similar vote for their class with
  weight exp(similarity / 0.07), as in DINO's k-NN evaluation; the heaviest class wins.

Beside the model, the same probes run on the raw pixels and on the same architecture with random
weights (built from the checkpoint's config with a fixed seed): the floor that pretraining must
beat. The majority class of the train split is the last floor. Nothing is random but the random
weights, which come from the seed, so a report is repeatable.

The online probe (`train.probe_every`) is the k-NN and linear probe on val during training, from
the first `train.probe_train_images` train images, with a fixed L2 strength, scored on the
validation's own images (`train.eval_images` of val, spread over it: scores.validation_images).

Every long loop here is a stop point (signals.check_stop): each batch of features, each chunk of
k-NN queries, each loss evaluation of L-BFGS. `run_probes(progress=True)` reports two phases on
stderr (progress.py): the features, in images, then the fits, a linear fit per L2 strength and the
k-NN for each kind of features (FITS_PER_PROBE each).

Features are pooled by the grid by default (`--pool grid`, 4 x 4 cells, or as many as the patch
grid has when it has fewer): on the shipped MNIST model the linear probe scores 0.983 so, and 0.943
on the mean of all tokens, which throws away where the strokes are. `--pool mean` is the mean.

Shapes: n images, D feature width, C classes, k neighbours, N patches, P pixels per patch,
g patches per side of the grid (N = g * g), G cells per side of the pooling grid.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vitmask.config import Config
from vitmask.data.batches import LabelledSplits
from vitmask.data.patches import patchify
from vitmask.errors import UserError
from vitmask.evaluate.scores import validation_images
from vitmask.model.pooling import as_layers, feature_name, pool_tokens
from vitmask.model.vit import MaskedPatchViT, build_model
from vitmask.progress import Progress
from vitmask.signals import check_stop

TEMPERATURE = 0.07  # DINO's k-NN temperature: a neighbour's vote weighs exp(similarity / 0.07)
L2_GRID = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5)  # linear probe: L2 strengths tried on val, strongest first
LBFGS_ITERS = 300  # linear probe: L-BFGS iterations at most (it stops earlier when converged)
ONLINE_L2 = 1e-3  # online probe: the linear probe's fixed L2 strength (val is what it reports on)
ONLINE_ITERS = 100
FEATURE_BATCH = 256  # images per forward pass when extracting features
FITS_PER_PROBE = len(L2_GRID) + 1  # a probe of one kind of features: a linear fit per L2 strength, then the k-NN
FLOORS = ("random_weights", "raw_pixels")
POOLS = ("mean", "grid")  # --pool: the mean of all tokens, or the mean of each cell of a grid
DEFAULT_POOL = "grid"  # probe, the online probe and finetune pool by the grid unless told otherwise
DEFAULT_GRID = 4  # --pool grid without --grid: 4 x 4 cells (of 4 x 4 patches on a 16 x 16 grid, 3 to 4 on 14 x 14)


# ---- features -------------------------------------------------------------------------------------
@torch.no_grad()
def extract_features(
    model: MaskedPatchViT,
    images: torch.Tensor,
    patch_size: int,
    layer: int | Sequence[int] | None = None,
    grid: int | None = None,
    progress: Progress | None = None,
) -> torch.Tensor:
    """images (n, H, W) uint8 -> (n, F) float32 features, in batches on the model's device, in eval mode
    (each batch's images counted on `progress`, when given).

    Each layer's tokens (None: the final normalised ones; K: block K's output) pooled by
    `pool_tokens(tokens, grid)`, the layers concatenated in the order given: F = layers * D, or
    layers * G*G*D with a grid. Each layer is its own forward pass through the first K blocks.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for chunk in images.split(FEATURE_BATCH):
        check_stop()
        patches = patchify(chunk.to(device), patch_size).float()  # (b, N, P)
        # nothing masked, so no fill applies: every token sees the whole image
        pooled = [pool_tokens(model.forward_encoder(patches, depth=k), grid) for k in as_layers(layer)]
        out.append(torch.cat(pooled, dim=1).float())  # (b, F)
        if progress is not None:
            progress.update(len(chunk))
    model.train(was_training)
    if out:
        return torch.cat(out)
    cells = 1 if grid is None else grid * grid
    return torch.zeros(0, len(as_layers(layer)) * cells * model.embed.out_features, device=device)


def pixel_features(images: torch.Tensor) -> torch.Tensor:
    """images (n, H, W) uint8 -> (n, H*W) float32: the raw pixels, 0 or 1."""
    return images.flatten(1).float()


def random_model(cfg: Config, seed: int, device: torch.device) -> MaskedPatchViT:
    """The checkpoint's architecture with its initial (random) weights, drawn from `seed` without
    touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(cfg)
    return model.to(device).eval()


# ---- the probes -----------------------------------------------------------------------------------
def standardise(train: torch.Tensor, *others: torch.Tensor) -> list[torch.Tensor]:
    """Centre and scale every column by the train features' mean and standard deviation (a constant
    column is only centred)."""
    mean, std = train.mean(0), train.std(0, unbiased=False)  # (D,)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))
    return [(x - mean) / std for x in (train, *others)]


def fit_linear(
    x: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float, iters: int = 300
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression: minimise mean cross-entropy + l2 * ||W||^2 (the bias is not
    decayed) by full-batch L-BFGS from zeros. x (n, D) float, y (n,) int64 -> W (C, D), b (C,)."""
    weight = torch.zeros(num_classes, x.shape[1], device=x.device, requires_grad=True)  # (C, D)
    bias = torch.zeros(num_classes, device=x.device, requires_grad=True)  # (C,)
    opt = torch.optim.LBFGS(
        [weight, bias], lr=1.0, max_iter=iters, history_size=20, tolerance_grad=1e-6, line_search_fn="strong_wolfe"
    )

    def closure():  # L-BFGS calls it once per evaluation of the loss: a stop point
        check_stop()
        opt.zero_grad()
        loss = F.cross_entropy(x @ weight.T + bias, y) + l2 * weight.square().sum()  # logits (n, C)
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return weight.detach(), bias.detach()


def linear_predict(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x (n, D) -> (n,) int64 predicted classes."""
    return (x @ weight.T + bias).argmax(1)  # logits (n, C) -> (n,)


def knn_predict(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    query_x: torch.Tensor,
    k: int,
    num_classes: int,
    temperature: float = TEMPERATURE,
    chunk: int = 1024,
) -> torch.Tensor:
    """DINO's weighted k-NN: the k train features most cosine-similar to each query vote for their
    class with weight exp(sim / temperature); the class with the most weight wins (ties: the smallest).
    train_x (n, D), train_y (n,) int64, query_x (q, D) -> (q,) int64."""
    bank = F.normalize(train_x, dim=1)  # (n, D)
    preds = []
    for q in query_x.split(chunk):
        check_stop()
        sim = F.normalize(q, dim=1) @ bank.T  # (b, n) cosine similarities
        top, idx = sim.topk(k, dim=1)  # (b, k), (b, k)
        votes = torch.zeros(len(q), num_classes, device=q.device)  # (b, C)
        votes.scatter_add_(1, train_y[idx], (top / temperature).exp())
        preds.append(votes.argmax(1))  # (b,)
    return torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long, device=query_x.device)


def accuracy(pred: torch.Tensor, y: torch.Tensor) -> float:
    """The share of predictions equal to the labels (an exact count over n)."""
    return int((pred == y).sum()) / len(y) if len(y) else float("nan")


def probe_features(
    feats: dict[str, torch.Tensor],
    labels: dict[str, torch.Tensor],
    split: str,
    k: int,
    num_classes: int,
    progress: Progress | None = None,
) -> dict:
    """Both probes on one kind of features: fitted on "train", L2 chosen on "val", scored on `split`.
    feats: split -> (n, D); labels: split -> (n,) class indices in [0, num_classes). Each linear fit
    and the k-NN count one on `progress`, when given (FITS_PER_PROBE in all)."""
    y_train, y_val, y_eval = labels["train"], labels["val"], labels[split]
    train, val, ev = standardise(feats["train"], feats["val"], feats[split])
    best_l2, best_val, best_fit = L2_GRID[0], -1.0, None
    for l2 in L2_GRID:
        fit = fit_linear(train, y_train, num_classes, l2, LBFGS_ITERS)
        val_acc = accuracy(linear_predict(val, *fit), y_val)
        if val_acc > best_val:
            best_l2, best_val, best_fit = l2, val_acc, fit
        if progress is not None:
            progress.update()
    linear = accuracy(linear_predict(ev, *best_fit), y_eval)
    knn = accuracy(knn_predict(feats["train"], y_train, feats[split], k, num_classes), y_eval)
    if progress is not None:
        progress.update()
    return {"linear_acc": linear, "knn_acc": knn, "l2": best_l2, "val_linear_acc": best_val}


# ---- checks ---------------------------------------------------------------------------------------
def require_labels(data: LabelledSplits, cfg: Config) -> dict[str, torch.Tensor]:
    if data.labels is None:
        raise UserError(f"data.source={cfg.data.source} gives no labels to probe with: {data.no_labels}")
    return data.labels


def named(option: str, value, python: bool) -> str:
    """How a message names an option and its value: `--grid 2` (`--pool 'max'`) to the CLI's user, `grid=2`
    (`pool='max'`) to Python's."""
    if python:
        return f"{option}={value!r}"
    return f"--{option} '{value}'" if isinstance(value, str) else f"--{option} {value}"


def check_layer(layer: int | Sequence[int] | None, depth: int, python: bool = False) -> None:
    """Refuse an empty list of layers, a layer out of range or given twice; `python`: name it as an
    argument, not a flag (the command line's no --layer is None)."""
    if layer is not None and not isinstance(layer, int) and len(layer) == 0:
        what = f"layer={layer!r}" if python else "an empty list of --layer"
        raise UserError(
            f"{what} names no layer; leave it out (None) for the final normalised tokens, or name 0 to the "
            f"model's {depth} blocks"
        )
    layers = as_layers(layer)
    for k in layers:
        if k is not None and not 0 <= k <= depth:
            raise UserError(
                f"{named('layer', k, python)} is out of range: the model has {depth} blocks; pass 1 to {depth} for "
                "a block's output, 0 for the embedded patches, or leave it out for the final normalised tokens"
            )
    repeated = sorted({k for k in layers if layers.count(k) > 1})
    if repeated:
        raise UserError(
            f"{named('layer', repeated[0], python)} is given twice; name each layer once (they are concatenated)"
        )


def check_pool(pool: str, grid: int | None, cfg: Config, python: bool = False) -> int | None:
    """--pool and --grid -> the grid G to pool over (None: the mean of all tokens); `python`: the messages
    name them as arguments (pool=, grid=), not flags."""
    if pool not in POOLS:
        raise UserError(
            f"unknown {named('pool', pool, python)}; use mean (all tokens) or grid (the mean of each cell of a grid)"
        )
    if pool == "mean":
        if grid is not None:
            fix = "pool='grid'" if python else "--pool grid"
            raise UserError(f"{named('grid', grid, python)} needs {fix}; add {fix}, or leave the grid out for the mean")
        return None
    g = cfg.data.image_size // cfg.data.patch_size
    grid = min(DEFAULT_GRID, g) if grid is None else grid
    if not 1 <= grid <= g:
        raise UserError(
            f"{named('grid', grid, python)} is not a cell count for the {g}x{g} patch grid "
            f"({cfg.data.image_size}-pixel images in {cfg.data.patch_size}-pixel patches); pass 1 (the mean) to {g} "
            "(every token)"
        )
    return grid


def check_k(k: int, num_train: int) -> None:
    if not 1 <= k <= num_train:
        raise UserError(
            f"--k {k} is not possible with {num_train:,} train images; pass a k from 1 to {num_train:,} "
            "(k-NN votes among the k nearest train images)"
        )


def check_classes(labels: torch.Tensor, what: str, fix: str) -> None:
    """A probe learns to tell classes apart: `what` (the images `labels` belong to) needs two."""
    classes = labels.unique()
    if len(classes) < 2:
        which = f"class {int(classes[0])}" if len(classes) else "no images"
        raise UserError(f"{what} hold {which} only; a probe needs labels of at least two classes there: {fix}")


def class_indices(labels: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """Labels as 0..C-1 (the sorted label values of every split), and C."""
    values = torch.cat(list(labels.values())).unique()  # (C,) sorted
    return {k: torch.searchsorted(values, v) for k, v in labels.items()}, len(values)


# ---- the report -----------------------------------------------------------------------------------
def run_probes(
    model: MaskedPatchViT,
    cfg: Config,
    data: LabelledSplits,
    split: str,
    layer: int | Sequence[int] | None = None,
    k: int = 20,
    seed: int = 0,
    pool: str = DEFAULT_POOL,
    grid: int | None = None,
    progress: bool = False,
) -> dict:
    """The probe report of `model` on `split` (val or test): linear and k-NN accuracy of the model's
    features, the random-weights and raw-pixel floors, and the majority class. `layer`, `pool` and
    `grid` choose the features (see `extract_features`); the random weights get the same ones. With
    `progress`, two phases report on stderr (progress.py): the features, in images, and the fits."""
    labels = require_labels(data, cfg)
    check_layer(layer, cfg.model.depth)
    layers = as_layers(layer)
    grid = check_pool(pool, grid, cfg)
    check_k(k, len(labels["train"]))
    check_classes(labels["train"], "the train split's images", "label the images with their real classes")
    labels, num_classes = class_indices(labels)
    device = next(model.parameters()).device
    labels = {s: labels[s].to(device) for s in ("train", "val", split)}
    images = {s: data.images[s] for s in labels}
    p = cfg.data.patch_size
    untrained = random_model(cfg, seed, device)
    with Progress(2 * sum(map(len, images.values())), "probe features", "img", enabled=progress) as bar:
        features = {
            "model": {s: extract_features(model, x, p, layers, grid, bar) for s, x in images.items()},
            "random_weights": {s: extract_features(untrained, x, p, layers, grid, bar) for s, x in images.items()},
            "raw_pixels": {s: pixel_features(x.to(device)) for s, x in images.items()},
        }
    with Progress(len(features) * FITS_PER_PROBE, "probe fits", "fits", enabled=progress) as bar:
        results = {name: probe_features(f, labels, split, k, num_classes, bar) for name, f in features.items()}
    feature_dim = features["model"]["train"].shape[1]
    majority = torch.bincount(labels["train"], minlength=num_classes).argmax()
    results["majority"] = {"acc": accuracy(torch.full_like(labels[split], int(majority)), labels[split])}
    return {
        "split": split,
        "seed": seed,
        "layer": layers[0] if len(layers) == 1 else list(layers),  # None, K, or [K1, K2, ...]
        "pool": pool,
        "grid": grid,
        "k": k,
        "features": feature_name(layers, grid, cfg.data.image_size // cfg.data.patch_size),
        "feature_dim": feature_dim,
        "classes": num_classes,
        "images": {s: len(images[s]) for s in ("train", "val", split)},
        "results": results,
    }


def format_report(report: dict) -> str:
    """The probe report as a plain-text table: one row per feature kind, linear and k-NN side by side."""
    n, r, split = report["images"], report["results"], report["split"]
    caveat = "; scored on the split L2 was chosen on, so a little optimistic" if split == "val" else ""
    subset = f", at most {report['per_class']:,} of each class" if report.get("per_class") else ""
    lines = [
        f"probe of {report.get('checkpoint', 'the model')} on {split} ({n[split]:,} images{subset}); "
        f"fitted on train ({n['train']:,}), L2 chosen on val ({n['val']:,}); {report['classes']} classes; "
        f"seed {report['seed']}{caveat}",
        f"features: {report['features']} ({report['feature_dim']}-d)",
        "",
        f"  {'':18}{'linear':>8}{'k-NN (k=' + str(report['k']) + ')':>14}",
    ]
    labels = {"model": "model", "random_weights": "random weights", "raw_pixels": "raw pixels"}
    for name, label in labels.items():
        lines.append(f"  {label:18}{r[name]['linear_acc']:8.4f}{r[name]['knn_acc']:14.4f}")
    acc = r["majority"]["acc"]
    lines.append(f"  {'majority class':18}{acc:8.4f}{acc:14.4f}")
    lines += ["", "linear probe L2 chosen on val: " + ", ".join(f"{labels[k]} {r[k]['l2']:g}" for k in labels)]
    return "\n".join(lines)


# ---- online ---------------------------------------------------------------------------------------
class OnlineProbe:
    """The k-NN and linear accuracy on val of the model being trained, from its current features.

    Fitted on the first `train.probe_train_images` train images (k = 20, or all of them if fewer),
    the linear probe with L2 strength ONLINE_L2, on the features of the default pooling (the 4 x 4
    grid of token means, fewer cells on a smaller patch grid); scored on the validation's images
    (`train.eval_images` of val, spread evenly over it). Runs in fp32 under no_grad, consumes no
    random numbers, and leaves the model in the mode it found it, so it does not change training.
    """

    def __init__(self, cfg: Config, data: LabelledSplits, device: torch.device):
        labels = require_labels(data, cfg)
        n = cfg.train.probe_train_images
        check_classes(labels["train"][:n], f"the first {n:,} train images", "raise train.probe_train_images")
        val = validation_images(data.images["val"], cfg)  # the validation's images, and their labels alike
        val_labels = validation_images(labels["val"], cfg)
        indexed, self.num_classes = class_indices({"train": labels["train"][:n], "val": val_labels})
        self.labels = {s: y.to(device) for s, y in indexed.items()}
        self.images = {"train": data.images["train"][:n].to(device), "val": val.to(device)}
        self.k = min(20, len(self.images["train"]))
        self.patch_size = cfg.data.patch_size
        self.grid = check_pool(DEFAULT_POOL, None, cfg)

    def __call__(self, model: MaskedPatchViT) -> dict[str, float]:
        """{"probe/knn_acc", "probe/linear_acc"} of `model` now (host syncs: call at validation points)."""
        f = {s: extract_features(model, x, self.patch_size, grid=self.grid) for s, x in self.images.items()}
        y_train, y_val = self.labels["train"], self.labels["val"]
        knn = knn_predict(f["train"], y_train, f["val"], self.k, self.num_classes)
        train, val = standardise(f["train"], f["val"])
        linear = linear_predict(val, *fit_linear(train, y_train, self.num_classes, ONLINE_L2, ONLINE_ITERS))
        return {"probe/knn_acc": accuracy(knn, y_val), "probe/linear_acc": accuracy(linear, y_val)}


def online_probe(cfg: Config, data: LabelledSplits, device: torch.device) -> OnlineProbe | None:
    """The online probe when `train.probe_every` asks for one and the data has labels; without
    labels, one warning line and None."""
    if not cfg.train.probe_every:
        return None
    if data.labels is None:
        from vitmask.errors import warn

        warn(f"train.probe_every is set but the online probe is off: the data has no labels ({data.no_labels})")
        return None
    return OnlineProbe(cfg, data, device)
