"""Likelihood: an upper bound on each image's negative log-likelihood (NLL), and the baselines beside it.

The bound. A masked-patch model gives p(x_i | visible) for any visible set, so every order sigma of
the N patches defines a distribution p_sigma(x) = prod_t p(x_sigma(t) | x_sigma(<t)), and the
model's distribution is their mixture over uniformly random orders (an any-order autoregressive
model: Hoogeboom et al. 2021, "Autoregressive Diffusion Models"). By Jensen,

    -log p(x) <= E_sigma[-log p_sigma(x)] = sum_{t=1..N} E_sigma[-log p(x_sigma(t) | x_sigma(<t))].

At step t, t - 1 patches are visible and m = N - t + 1 are hidden; sigma(t) is uniform among the m
hidden ones, so the step's term is E_{|M|=m}[(1/m) sum_{i in M} -log p(x_i | x outside M)]: the
mean over the hidden patches, divided by the hidden count m (not by N - t). Summing over t is
summing over m = 1..N:

    -log p(x) <= sum_{m=1..N} L_m(x) = N * E_{m ~ U{1..N}} L_m(x),   L_m(x) = E_{|M|=m}[mean_{i in M} -log p(x_i | .)].

It is tight when the model's conditionals are those of one joint distribution.

The estimate. {1..N} is cut into S strata of consecutive m (sizes differing by at most one); per
image and stratum, K draws of m (uniform in the stratum) and of a hidden set of that size (uniform)
give K values of the masked mean; the estimate is sum_s |s| * (their mean), unbiased for the bound.
Its Monte Carlo standard error comes from the spread of the K draws within each stratum. All
draws come from a CPU generator seeded by `seed`: the same seed gives the same masks on any device.

Units. Nats per image, and bits per pixel = nats / (S^2 ln 2) over every pixel of the image as the
model sees it: image_size x image_size after `data.fit`, padding included (a 28x28 MNIST digit
padded to 32x32 counts 1,024 pixels).

Baselines on the same images: independent per-pixel Bernoulli with per-position probabilities
fitted on the train split with add-one smoothing, p_j = (ones_j + 1) / (n + 2), so no log 0; and
one bit per pixel (S^2 ln 2 nats).

Exact forms: `enumerated_bound` (every hidden set; small N only), which equals the mean over all N!
orders of the exact NLL of one order, -log p_sigma(x) (`exact_nll.py`: one order, a mixture of
orders, and the report beside this bound's, which `format_nll` renders).

Every forward pass of the estimator and of the exact forms is a stop point (signals.check_stop).

Shapes: n images, B rows of a forward pass, H = W = S side, N patches, P pixels per patch,
C classes, S strata, K draws per stratum.
"""

import itertools
import math
import time

import torch

from vitmask.data.patches import patches_to_classes, patchify
from vitmask.errors import UserError
from vitmask.model.vit import predict_every_patch
from vitmask.progress import track
from vitmask.signals import check_stop

MAX_CLASSES = 2**16  # the bound needs the model's softmax over every patch class: 4x4 patches at most
MAX_ENUMERATED_PATCHES = 16  # enumerated_bound draws 2^N - 1 hidden sets per image
MAX_NLL_DRAWS = 2**16  # strata x samples per image: one image's draws go through the model together
LOGIT_BUDGET = 2**24  # logits (rows x N x C) per forward pass of the estimator: 64 MiB in float32


def check_nll_args(num_patches: int, num_classes: int, strata: int, samples: int) -> None:
    """Refuse what the estimator cannot do, with the fix."""
    if num_classes > MAX_CLASSES:
        raise UserError(
            f"--nll needs the model's probability of every patch class, and {num_classes:,} classes "
            f"(patches of {num_classes.bit_length() - 1} pixels) are more than {MAX_CLASSES:,}; "
            "use a checkpoint with patches of at most 16 pixels (4x4)"
        )
    if not 1 <= strata <= num_patches:
        raise UserError(f"--nll-strata must be between 1 and the {num_patches} patches per image, got {strata}")
    if samples < 2:
        raise UserError(
            f"--nll-samples must be at least 2 (the standard error needs two draws per stratum), got {samples}"
        )
    if strata * samples > MAX_NLL_DRAWS:
        raise UserError(
            f"--nll-strata x --nll-samples ({strata} x {samples}) must be at most {MAX_NLL_DRAWS:,} draws per image "
            "(one image's draws go through the model at once); the standard error falls only as 1/sqrt(draws): "
            f"pass --nll-samples {max(2, MAX_NLL_DRAWS // strata)} or fewer"
        )


def rows_per_pass(num_patches: int, num_classes: int, batch_size: int) -> int:
    """Rows (images with a mask) of one forward pass: `batch_size`, fewer where their N x C logits
    would pass LOGIT_BUDGET (large C)."""
    return min(batch_size, max(1, LOGIT_BUDGET // (num_patches * num_classes)))


def strata_edges(num_patches: int, strata: int) -> list[int]:
    """S + 1 edges e_0 = 0 < ... < e_S = N: stratum s holds the hidden counts e_s + 1 .. e_{s+1}."""
    return [round(i * num_patches / strata) for i in range(strata + 1)]


@torch.inference_mode()
def masked_nll(model: torch.nn.Module, patches: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """patches (B, N, P) 0/1, mask (B, N) with at least one True per row -> (B,) mean over the
    hidden patches of -log p(x_i | visible), in nats (float64)."""
    truth = patches_to_classes(patches)  # (B, N)
    logp = predict_every_patch(model, patches.float(), mask).float().log_softmax(-1)  # (B, N, C)
    nll = -logp.gather(-1, truth.unsqueeze(-1)).squeeze(-1).double()  # (B, N)
    return (nll * mask).sum(1) / mask.sum(1)  # (B,)


def nll_bound(
    model: torch.nn.Module,
    images: torch.Tensor,
    patch_size: int,
    strata: int = 16,
    samples: int = 2,
    seed: int = 0,
    batch_size: int = 256,
    progress: bool = False,
) -> dict:
    """The stratified estimate of each image's NLL bound (module docstring), on the model's device.

    images (n, H, W) 0/1 on the device. Returns per_image (n,) float64 nats, the MC variance of
    each image's estimate (n,), the stratum edges and the mean masked NLL per stratum (S,).
    """
    n, size = len(images), images.shape[-1]
    num_patches = (size // patch_size) ** 2
    edges = strata_edges(num_patches, strata)
    lo = torch.tensor(edges[:-1])  # (S,)
    width = torch.tensor(edges[1:]) - lo  # (S,) stratum sizes
    rows = rows_per_pass(num_patches, 2 ** (patch_size**2), batch_size)
    per_image = max(1, rows // (strata * samples))  # images per forward pass
    gen = torch.Generator().manual_seed(seed)
    values = []
    bar = track(range(0, n, per_image), "eval --nll", "batch", enabled=progress)  # progress.py: a bar or lines
    for start in bar:
        check_stop()
        chunk = images[start : start + per_image]  # (b, H, W)
        b = len(chunk)
        u = torch.rand(b, strata, samples, generator=gen, dtype=torch.float64)  # (b, S, K)
        offset = (u * width.view(1, -1, 1)).long().clamp(max=width.view(1, -1, 1) - 1)  # (b, S, K) uniform
        m = (lo.view(1, -1, 1) + 1 + offset).flatten()  # (R,) R = b*S*K hidden counts, each in its stratum
        rank = torch.rand(len(m), num_patches, generator=gen).argsort(1).argsort(1)  # (R, N) uniform order
        mask = (rank < m.unsqueeze(1)).to(images.device)  # (R, N): m uniformly chosen patches hidden
        pix = patchify(chunk, patch_size).repeat_interleave(strata * samples, dim=0)  # (R, N, P)
        values.append(masked_nll(model, pix, mask).cpu().view(b, strata, samples))
    ell = torch.cat(values)  # (n, S, K)
    w = width.double()
    estimate = (ell.mean(2) * w).sum(1)  # (n,)
    variance = (ell.var(2) * w**2).sum(1) / samples  # (n,) MC variance of each image's estimate
    return {"per_image": estimate, "variance": variance, "edges": edges, "stratum_nll": ell.mean((0, 2))}


@torch.inference_mode()
def enumerated_bound(model: torch.nn.Module, images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """The bound sum_m L_m(x) with every hidden set enumerated (no sampling): (n,) float64 nats.

    For small N only (2^N - 1 hidden sets per image); it equals the mean of `exact_nll.order_nll` over all orders.
    """
    n_patches = (images.shape[-1] // patch_size) ** 2
    if n_patches > MAX_ENUMERATED_PATCHES:
        raise UserError(f"enumerating every hidden set needs at most {MAX_ENUMERATED_PATCHES} patches, got {n_patches}")
    sets = torch.tensor(
        list(itertools.product([False, True], repeat=n_patches))[1:], device=images.device
    )  # (2^N-1, N)
    sizes = sets.sum(1)  # (2^N-1,) hidden count m of each set
    per_size = torch.bincount(sizes, minlength=n_patches + 1).double()  # (N+1,) C(N, m)
    pix = patchify(images, patch_size)  # (n, N, P)
    out = []
    for x in pix:
        check_stop()
        ell = masked_nll(model, x.expand(len(sets), -1, -1), sets)  # (2^N-1,)
        out.append((ell / per_size[sizes]).sum())  # sum over m of the mean over sets of size m
    return torch.stack(out)


def bernoulli_nll(train: torch.Tensor, images: torch.Tensor, smoothing: float = 1.0) -> torch.Tensor:
    """-log p(x) in nats of each of `images` (n, H, W) under independent per-pixel Bernoulli
    distributions fitted on `train` (t, H, W): p_j = (ones_j + smoothing) / (t + 2 * smoothing)."""
    ones = train.double().sum(0)  # (H, W)
    p = (ones + smoothing) / (len(train) + 2 * smoothing)  # (H, W)
    x = images.double()  # (n, H, W)
    return -(x * p.log() + (1 - x) * (1 - p).log()).sum((1, 2))  # (n,)


def nll_report(
    model: torch.nn.Module,
    train: torch.Tensor,
    images: torch.Tensor,
    patch_size: int,
    strata: int = 16,
    samples: int = 2,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """The bound on `images` with its standard errors, beside the two baselines; plain numbers (JSON-able)."""
    num_patches = (images.shape[-1] // patch_size) ** 2
    check_nll_args(num_patches, 2 ** (patch_size**2), strata, samples)
    began = time.perf_counter()
    est = nll_bound(model, images, patch_size, strata, samples, seed, progress=progress)
    seconds = time.perf_counter() - began
    n = len(images)
    pixels = images.shape[-1] * images.shape[-2]
    per_image = est["per_image"]
    to_bpp = 1 / (pixels * math.log(2))
    bern = bernoulli_nll(train.to(images.device), images).cpu()
    edges = est["edges"]
    return {
        "images": n,
        "pixels": pixels,
        "strata": strata,
        "samples": samples,
        "seed": seed,
        "nats": float(per_image.mean()),
        "bits_per_pixel": float(per_image.mean()) * to_bpp,
        "se_mc": float(est["variance"].sum().sqrt()) / n,  # Monte Carlo s.e. of the mean over these images
        "se_images": float(per_image.std() / math.sqrt(n)) if n > 1 else float("nan"),
        "seconds": seconds,
        "per_image": per_image.tolist(),
        "by_stratum": [
            {"m_from": edges[s] + 1, "m_to": edges[s + 1], "nll": float(v)} for s, v in enumerate(est["stratum_nll"])
        ],
        "baselines": {
            "bernoulli": {"nats": float(bern.mean()), "bits_per_pixel": float(bern.mean()) * to_bpp},
            "one_bit": {"nats": pixels * math.log(2), "bits_per_pixel": 1.0},
        },
    }


def format_nll(r: dict) -> str:
    """The NLL report as plain text: the bound, and the exact NLLs (`exact_nll.exact_nll_report`) under "exact"."""
    side = math.isqrt(r["pixels"])
    exact = r.get("exact")
    w = 36

    def row(label: str, nats: float, bpp: float, seconds: float | None = None, note: str = "") -> str:
        time_cell = f"{seconds:10.1f}" if seconds is not None else " " * 10
        return f"  {label:{w}}{nats:12.2f}{bpp:12.4f}{time_cell}" + (f"   {note}" if note else "")

    title = f"NLL upper bound, any order: {r['images']:,} images, {r['strata']} strata of the hidden count x "
    title += f"{r['samples']} draws, seed {r['seed']}"
    mixed = bool(exact) and exact["orders"] > 1  # one order: its mixture is itself, not shown twice
    if exact:
        title += f"; exact NLL of the {exact['order']} order"
        title += f" and of a mixture of {exact['orders']}" if mixed else ""
        subset = exact.get("images", r["images"]) < r["images"]
        title += f", on the first {exact['images']:,} images" if subset else ""
    lines = [
        title,
        f"(nats per image; bits per pixel over all {side}x{side} = {r['pixels']:,} pixels of the fitted image, "
        "padding included)",
        f"  {'':{w}}{'nats/image':>12}{'bits/pixel':>12}{'seconds':>10}",
        row(
            "model (upper bound)",
            r["nats"],
            r["bits_per_pixel"],
            r.get("seconds"),
            f"s.e. {r['se_mc']:.2f} (Monte Carlo), {r['se_images']:.2f} (between images)",
        ),
    ]
    if exact:
        fixed, mix = exact["fixed"], exact["mixture"]
        se = "s.e. {:.2f} (between images)"
        if exact.get("images", r["images"]) < r["images"]:  # the bound on the images the exact NLLs are of
            label = f"model (upper bound), first {exact['images']:,}"
            same = exact["bound_same_images"]
            lines.append(row(label, same, same / (r["pixels"] * math.log(2)), note="the images of the exact rows"))
        lines.append(
            row(f"model (exact), order {exact['order']}", fixed["nats"], fixed["bits_per_pixel"], fixed["seconds"],
                se.format(fixed["se_images"]))
        )  # fmt: skip
        if mixed:
            lines.append(
                row(f"model (exact), mixture of {exact['orders']} orders", mix["nats"], mix["bits_per_pixel"],
                    mix["seconds"], se.format(mix["se_images"]))
            )  # fmt: skip
    bern = r["baselines"]["bernoulli"]
    lines += [
        row("per-position Bernoulli (train)", bern["nats"], bern["bits_per_pixel"]),
        row("1 bit per pixel", r["baselines"]["one_bit"]["nats"], 1.0),
        "  upper bound: mean -log p(x_i | visible) of a hidden patch, by hidden count m (nats):",
    ]
    cells = [f"m {s['m_from']}-{s['m_to']}: {s['nll']:.3f}" for s in r["by_stratum"]]
    lines += ["    " + ", ".join(cells[i : i + 6]) for i in range(0, len(cells), 6)]
    if not exact:
        return "\n".join(lines)
    if mixed:
        lines.append(
            f"  exact: the {exact['orders']} orders of the mixture, {exact['order']} mapped by the grid's symmetries; "
            "each alone (nats):"
        )
        cells = [f"{c['symmetry']} {c['nats']:.2f}" for c in exact["chains"]]
        lines += ["    " + ", ".join(cells[i : i + 4]) for i in range(0, len(cells), 4)]
        lines.append("  exact: the mixture of the first k orders (nats; its gain over the order alone):")
        fixed = exact["fixed"]["nats"]
        cells = [f"k={m['orders']} {m['nats']:.2f} ({m['nats'] - fixed:+.2f})" for m in exact["mixture_by_orders"]]
        lines.append("    " + ", ".join(cells))
    chosen = exact.get("chosen_on")
    if chosen:
        lines.append(
            f"  exact: order {exact['order']} chosen by its mean exact NLL on the first {chosen['images']:,} "
            f"{chosen['split']} images ({chosen['seconds']:.1f} s), among (nats):"
        )
        cells = [f"{name} {v:.2f}" for name, v in chosen["candidates"].items()]
        lines += ["    " + ", ".join(cells[i : i + 3]) for i in range(0, len(cells), 3)]
    return "\n".join(lines)
