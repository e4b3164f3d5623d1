"""Exact negative log-likelihoods (NLLs) of fixed orders, and of mixtures of them.

A masked-patch model gives p(x_i | visible) for any visible set, so each order sigma of the N patches
defines a proper distribution p_sigma(x) = prod_{t=1..N} p(x_sigma(t) | x_sigma(<t)), whose NLL is
computed exactly: N conditionals, no sampling. A uniform mixture of K such chains is a proper
distribution too, with

    -log p_mix(x) = -log (1/K) sum_k p_sigma_k(x) = -logsumexp_k(log p_sigma_k(x)) + log K,

and min_k(-log p_sigma_k) <= -log p_mix <= min(mean_k(-log p_sigma_k), min_k(-log p_sigma_k) + log K).
The bound of `likelihood.py` is the expectation of -log p_sigma(x) over uniformly random orders.

The orders. A fixed order is one of ORDERS on the g x g grid of patches (patch i = row * g + col):
`raster` (rows top to bottom, each left to right), `column` (columns left to right, each top to
bottom), their reverses, `spiral-in` (clockwise from the top-left corner to the centre) and
`spiral-out` (its reverse: the centre first). `auto` picks the one with the lowest mean NLL on
the first AUTO_IMAGES validation images. The K orders of the mixture are the chosen order mapped
by the first K of the grid's 8 symmetries, SYMMETRIES, in that sequence: raster becomes its
reverse, then column-major and its reverse, then rows and columns started from the other two
corners. Each is as local as the chosen
order (the next patch borders the visible ones in the same way), none needs a seed, and the first
K are the most different from one another.

The batching. A forward pass holds rows (step t, image, chain): the image with the patches
sigma(<t) visible, scoring sigma(t). Rows run step by step over a group of images and all K chains,
so one pass holds one step of several images and chains, or several steps when those are fewer than
a pass's rows; a pass has as many rows as the bound's (`likelihood.rows_per_pass`). The single-stack
model takes rows of any hidden count in one call and computes only the scored token in its last
block (ids = sigma(t)); an encoder-decoder model needs one hidden count per call, so a pass makes one
call per step it holds, with ids = sigma(t..N), the hidden patches, sigma(t) first. Each forward
pass is a stop point (signals.check_stop) and a tick of one `progress.Progress` (an ETA on stderr).

Shapes: n images, K chains (orders), N patches, P pixels per patch, C classes, R rows of a pass.
"""

import math
import time

import torch

from vitmask.data.patches import patches_to_classes, patchify
from vitmask.errors import UserError
from vitmask.evaluate.likelihood import rows_per_pass
from vitmask.progress import Progress
from vitmask.signals import check_stop

ORDERS = ("raster", "raster-reverse", "column", "column-reverse", "spiral-in", "spiral-out")
AUTO = "auto"  # --nll-order auto: the order of ORDERS with the lowest NLL on validation images
SYMMETRIES = ("identity", "rot180", "transpose", "anti-transpose", "mirror", "flip", "rot90", "rot270")
MAX_ORDERS = len(SYMMETRIES)  # the grid's 8 symmetries
MIXTURE_SIZES = (1, 2, 4, 8)  # the mixtures reported beside the K of the run: the first k chains
AUTO_IMAGES = 100  # validation images --nll-order auto scores each candidate on
DEFAULT_ORDER = "raster"


def check_exact_args(orders: int, order: str | None, images: int = 0) -> None:
    """Refuse an --nll-orders, --nll-order or --nll-exact-images the exact NLLs cannot take, with the fix."""
    if images < 0:
        raise UserError(f"--nll-exact-images must be at least 0 (0: every image of the split), got {images}")
    if not 0 <= orders <= MAX_ORDERS:
        raise UserError(
            f"--nll-orders must be between 0 (the bound only) and {MAX_ORDERS} (the grid's symmetries), got {orders}"
        )
    if order is None:
        return
    if order not in (*ORDERS, AUTO):
        raise UserError(f"--nll-order must be one of {', '.join((*ORDERS, AUTO))}, got '{order}'")
    if orders == 0:
        raise UserError(
            "--nll-order picks the order of the exact NLLs, and --nll-orders 0 asks for none; leave out one of the two"
        )


# ---- orders ------------------------------------------------------------------------------------------
def spiral(grid: int) -> list[int]:
    """The patches of a grid x grid grid clockwise from the top-left corner, ring by ring, to the centre."""
    top, left, bottom, right = 0, 0, grid - 1, grid - 1
    out = []
    while top <= bottom and left <= right:
        out += [top * grid + c for c in range(left, right + 1)]  # along the top, left to right
        out += [r * grid + right for r in range(top + 1, bottom + 1)]  # down the right side
        if top < bottom:
            out += [bottom * grid + c for c in range(right - 1, left - 1, -1)]  # along the bottom, right to left
        if left < right:
            out += [r * grid + left for r in range(bottom - 1, top, -1)]  # up the left side
        top, left, bottom, right = top + 1, left + 1, bottom - 1, right - 1
    return out


def named_order(name: str, grid: int) -> torch.Tensor:
    """The order `name` (one of ORDERS) of the grid x grid patches: (N,) patch indices, first revealed first."""
    raster = torch.arange(grid * grid)
    column = raster.view(grid, grid).t().flatten()
    orders = {
        "raster": raster,
        "raster-reverse": raster.flip(0),
        "column": column,
        "column-reverse": column.flip(0),
        "spiral-in": torch.tensor(spiral(grid)),
        "spiral-out": torch.tensor(spiral(grid)).flip(0),
    }
    return orders[name]


def grid_symmetry(name: str, grid: int) -> torch.Tensor:
    """(N,) the image of each patch (row r, column c) under the symmetry `name` of the grid (SYMMETRIES)."""
    r, c = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")  # (g, g) each
    last = grid - 1
    rows, cols = {
        "identity": (r, c),
        "rot180": (last - r, last - c),
        "transpose": (c, r),
        "anti-transpose": (last - c, last - r),
        "mirror": (r, last - c),  # left-right
        "flip": (last - r, c),  # top-bottom
        "rot90": (c, last - r),  # a quarter turn clockwise
        "rot270": (last - c, r),
    }[name]
    return (rows * grid + cols).flatten()  # (N,)


def symmetric_orders(order: torch.Tensor, grid: int, k: int) -> torch.Tensor:
    """(k, N): `order` (N,) mapped by each of the first k SYMMETRIES; row 0 is `order` itself."""
    return torch.stack([grid_symmetry(s, grid)[order] for s in SYMMETRIES[:k]])  # (k, N)


# ---- the chains -------------------------------------------------------------------------------------
@torch.inference_mode()
def chain_nll(
    model: torch.nn.Module,
    images: torch.Tensor,
    patch_size: int,
    orders: torch.Tensor,
    batch_size: int = 256,
    progress: bool = False,
    desc: str = "exact nll",
) -> torch.Tensor:
    """-log p_sigma(x) of each image under each order: images (n, H, W) 0/1 on the model's device,
    orders (K, N) permutations of the patches -> (n, K) float64 nats on the CPU.

    Step t (0-based) of order sigma shows the patches sigma[:t] and adds -log p(x_sigma[t] | them);
    N steps per image and order, batched as the module docstring says.
    """
    n, (k, num_patches) = len(images), orders.shape
    device = images.device
    orders = orders.to(device)
    steps_of = torch.arange(num_patches, device=device).expand(k, -1)  # (K, N)
    rank = torch.empty_like(orders).scatter_(1, orders, steps_of)  # (K, N) the step that reveals each patch
    pix = patchify(images, patch_size)  # (n, N, P)
    truth = patches_to_classes(pix)  # (n, N)
    pix = pix.float()
    rows = rows_per_pass(num_patches, 2 ** (patch_size**2), batch_size)
    group = max(1, rows // k)  # images whose K chains at one step fill at most one pass
    decoder = getattr(model, "decoder", None) is not None
    passes = sum(math.ceil(num_patches * min(group, n - s) * k / rows) for s in range(0, n, group))
    out = torch.empty(n, k, dtype=torch.float64)
    bar = Progress(passes, desc, "passes", enabled=progress)  # one tick per forward pass, with an ETA
    for start in range(0, n, group):
        per_step = min(group, n - start) * k  # rows of one step of this group
        total = num_patches * per_step
        step_nll = torch.empty(total, device=device)  # (N * b * K,) row r: step r // per_step
        for r0 in range(0, total, rows):
            check_stop()
            r1 = min(r0 + rows, total)
            r = torch.arange(r0, r1, device=device)  # (R,)
            t, j = r // per_step, r % per_step  # (R,) step; image and chain within the group
            image, chain = start + j // k, j % k  # (R,)
            target = orders[chain, t]  # (R,) sigma(t)
            hidden = rank[chain] >= t.unsqueeze(1)  # (R, N): sigma(t..N) hidden
            x = pix[image]  # (R, N, P)
            if not decoder:
                logits = model(x, hidden, target.unsqueeze(1))[:, 0]  # (R, C)
            else:  # one hidden count per call: one call per step in this pass
                parts = []
                for step in range(r0 // per_step, (r1 - 1) // per_step + 1):
                    a, b = max(r0, step * per_step) - r0, min(r1, (step + 1) * per_step) - r0
                    ids = orders[chain[a:b], step:]  # (b - a, N - step) the hidden patches, sigma(t) first
                    parts.append(model(x[a:b], hidden[a:b], ids)[:, 0])  # (b - a, C)
                logits = torch.cat(parts)  # (R, C)
            logp = logits.float().log_softmax(-1)  # (R, C)
            step_nll[r0:r1] = -logp.gather(1, truth[image, target].unsqueeze(1)).squeeze(1)
            bar.update(1)
        out[start : start + per_step // k] = step_nll.view(num_patches, -1, k).double().sum(0).cpu()  # (b, K)
    bar.close()
    return out


def order_nll(model: torch.nn.Module, images: torch.Tensor, patch_size: int, order: torch.Tensor) -> torch.Tensor:
    """-log p_sigma(x) for the order `order` (N,) (a permutation of the patches): (n,) float64 nats."""
    return chain_nll(model, images, patch_size, order.view(1, -1))[:, 0]


def mixture_nll(chains: torch.Tensor) -> torch.Tensor:
    """chains (n, K) -log p_sigma_k(x) -> (n,) -log of the uniform mixture, (1/K) sum_k p_sigma_k(x)."""
    return math.log(chains.shape[1]) - torch.logsumexp(-chains, dim=1)  # (n,)


def choose_order(
    model: torch.nn.Module, images: torch.Tensor, patch_size: int, progress: bool = False
) -> tuple[str, dict[str, float]]:
    """The order of ORDERS with the lowest mean -log p_sigma on `images` (ties: the first listed),
    and each candidate's mean NLL in nats."""
    grid = images.shape[-1] // patch_size
    candidates = torch.stack([named_order(name, grid) for name in ORDERS])  # (6, N)
    means = chain_nll(model, images, patch_size, candidates, progress=progress, desc="nll order").mean(0)  # (6,)
    scores = {name: float(v) for name, v in zip(ORDERS, means, strict=True)}
    return ORDERS[int(means.argmin())], scores


# ---- the report -------------------------------------------------------------------------------------
def exact_nll_report(
    model: torch.nn.Module,
    images: torch.Tensor,
    patch_size: int,
    orders: int = MAX_ORDERS,
    order: str | None = None,
    choose_on: torch.Tensor | None = None,
    progress: bool = False,
) -> dict:
    """The fixed-order NLL and the K-order mixture's on `images` (n, H, W), plain numbers (JSON-able).

    `order` one of ORDERS (default raster) or auto: chosen on `choose_on` (validation images). The
    fixed order's seconds are its chain's; the mixture's, all K chains' (the fixed one's included).
    """
    check_exact_args(orders, order)
    if orders == 0:
        raise ValueError("exact_nll_report needs at least one order")
    order = order or DEFAULT_ORDER
    grid = images.shape[-1] // patch_size
    pixels = images.shape[-1] * images.shape[-2]
    to_bpp = 1 / (pixels * math.log(2))
    chosen = None
    if order == AUTO:
        if choose_on is None or len(choose_on) == 0:
            raise UserError(
                "--nll-order auto chooses the order on the val split, and it holds no image; "
                f"name an order instead: {', '.join(ORDERS)}"
            )
        began = time.perf_counter()
        order, scores = choose_order(model, choose_on, patch_size, progress)
        seconds = time.perf_counter() - began
        chosen = {"split": "val", "images": len(choose_on), "seconds": seconds, "candidates": scores}
    sequence = symmetric_orders(named_order(order, grid), grid, orders)  # (K, N)
    began = time.perf_counter()
    first = chain_nll(model, images, patch_size, sequence[:1], progress=progress, desc=f"exact nll, {order}")
    fixed_seconds = time.perf_counter() - began
    rest = torch.zeros(len(images), 0, dtype=torch.float64)
    if orders > 1:
        desc = f"exact nll, {orders - 1} more orders"
        rest = chain_nll(model, images, patch_size, sequence[1:], progress=progress, desc=desc)
    mixture_seconds = time.perf_counter() - began
    chains = torch.cat([first, rest], 1)  # (n, K)
    n = len(images)

    def summary(per_image: torch.Tensor) -> dict:
        nats = float(per_image.mean())
        se = float(per_image.std() / math.sqrt(n)) if n > 1 else float("nan")
        return {"nats": nats, "bits_per_pixel": nats * to_bpp, "se_images": se}

    sizes = sorted({k for k in MIXTURE_SIZES if k <= orders} | {orders})
    mixture = mixture_nll(chains)
    return {
        "order": order,
        "images": n,
        "chosen_on": chosen,  # None: the order was named, not chosen
        "orders": orders,
        "fixed": {**summary(chains[:, 0]), "seconds": fixed_seconds, "per_image": chains[:, 0].tolist()},
        "mixture": {**summary(mixture), "seconds": mixture_seconds, "per_image": mixture.tolist()},
        "mixture_by_orders": [{"orders": k, **summary(mixture_nll(chains[:, :k]))} for k in sizes],
        "chains": [
            {"symmetry": s, "order": sequence[i].tolist(), **summary(chains[:, i]), "per_image": chains[:, i].tolist()}
            for i, s in enumerate(SYMMETRIES[:orders])
        ],
    }
