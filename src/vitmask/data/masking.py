"""Which patches are hidden, and what the model sees in their place.

Convention (as in MAE's `random_masking`): a boolean mask of shape (B, N) with True = masked,
plus the indices of the masked patches, (B, M). Every image in a batch hides exactly
M = round(ratio * N) patches (Python's round), clamped to [1, N - 1], so every shape is static
and the loss needs no boolean indexing.

Strategies (`mask.strategy`): `random` draws the M patches uniformly; `block` (BEiT) covers
rectangles of patches until M are covered, then keeps exactly M; `mixed` draws both for every image
with the same M and keeps the block mask for a share `mask.block_share` of the images. All are
batched tensor ops. Evaluation also has `centre`: the central square of half the grid's side, the
same for every image.

Training draws M once per batch from the ratio schedule (`mask.ratio_schedule`): `fixed` (always
`mask.ratio`), `uniform` (uniform over the counts `mask.ratio_range` allows, all of 1..N - 1 by
default) or `cosine` (MaskGIT: ratio = cos(pi/2 * u), u ~ U(0, 1), restricted to the range).

Shapes: B batch, N = g * g patches on a g x g grid, M masked patches per image.
"""

import math

import torch

from vitmask.config import MaskConfig


def num_masked(num_patches: int, ratio: float) -> int:
    """Patches hidden per image: round(ratio * N), at least 1 and at most N - 1."""
    return min(max(round(ratio * num_patches), 1), num_patches - 1)


def draw_num_masked(cfg: MaskConfig, num_patches: int, generator: torch.Generator) -> int:
    """M for one training batch from the ratio schedule, drawn on the CPU `generator` (no device sync).

    fixed: num_masked(N, ratio). uniform: uniform over num_masked(N, lo) .. num_masked(N, hi).
    cosine: ratio = cos(pi/2 * u) with u uniform on [2/pi acos(hi), 2/pi acos(lo)], so the ratio has
    MaskGIT's density restricted to [lo, hi]; then M = num_masked(N, ratio). [lo, hi] is
    mask.ratio_range, or (0, 1) when it is null; M is always clamped to [1, N - 1].
    """
    if cfg.ratio_schedule == "fixed":
        return num_masked(num_patches, cfg.ratio)
    lo, hi = cfg.ratio_range or (0.0, 1.0)
    if cfg.ratio_schedule == "uniform":
        first, last = num_masked(num_patches, lo), num_masked(num_patches, hi)
        return int(torch.randint(first, last + 1, (1,), generator=generator))
    u_lo, u_hi = 2 / math.pi * math.acos(hi), 2 / math.pi * math.acos(lo)
    u = u_lo + float(torch.rand((), generator=generator)) * (u_hi - u_lo)
    return num_masked(num_patches, math.cos(math.pi / 2 * u))


def centre_box_mask(grid: int) -> torch.Tensor:
    """(N,) bool: the central square of patches, grid // 2 on a side, one more where that could not sit
    exactly in the middle (grid - side odd). The 8x8 middle of a 16x16 grid, and of a 14x14 one: on
    28x28 MNIST the same 16x16 pixels as on the digits padded to 32x32."""
    side = grid // 2
    side += (grid - side) % 2
    top = (grid - side) // 2
    box = torch.zeros(grid, grid, dtype=torch.bool)
    box[top : top + side, top : top + side] = True
    return box.flatten()


def random_mask(
    batch: int,
    num_patches: int,
    num_mask: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hide `num_mask` uniformly chosen patches per image.

    Returns ids (B, M) int64, the masked patch indices, and mask (B, N) bool, True = masked.
    """
    noise = torch.rand(batch, num_patches, generator=generator, device=device)  # (B, N)
    ids = noise.argsort(dim=1)[:, :num_mask]  # (B, M)
    mask = torch.zeros(batch, num_patches, dtype=torch.bool, device=device)  # (B, N)
    mask.scatter_(1, ids, True)
    return ids, mask


def mask_to_ids(mask: torch.Tensor) -> torch.Tensor:
    """(B, N) bool with the same count M in every row -> (B, M) int64 indices, ascending."""
    m = int(mask[0].sum())
    # a stable sort puts the True positions first, in index order
    return mask.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :m]  # (B, M)


def visible_ids(mask: torch.Tensor, num_masked: int) -> torch.Tensor:
    """mask (B, N) bool, True = masked, exactly `num_masked` per row -> (B, N - M) visible indices, ascending.

    A stable sort of (not masked) puts the visible positions first, in index order; the count comes
    from the caller (ids.shape[1]), so there is no host sync.
    """
    n = mask.shape[1]
    return (~mask).to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, : n - num_masked]  # (B, V)


def apply_fill(patches: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    """(B, N, P) float pixels, (B, N) mask -> (B, N, P) with masked patches set to `fill`."""
    return patches.masked_fill(mask.unsqueeze(-1), fill)


def block_mask(
    batch: int,
    grid: int,
    num_mask: int,
    min_patches: int = 16,
    aspect: tuple[float, float] = (0.3, 3.3),
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    rounds: int = 0,
    stop_when_covered: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hide exactly `num_mask` patches per image in rectangles of patches, as in BEiT.

    Each round draws one rectangle per image, for every image at once: an area between
    `min_patches` and the count still missing, a height/width ratio log-uniform in `aspect`, and a
    uniform position on the grid. A patch is ranked by the round that first covered it, and within
    that round by its distance from the rectangle's centre; the first `num_mask` in that order are
    masked. So every earlier rectangle is kept whole, the one that overshoots is trimmed to the
    patches nearest its centre, and if the rounds cover too few, the rest is taken from patches
    next to the rectangles (most covered neighbours first, ties at random).
    `rounds` = 0 picks ceil(M / min_patches) + 4 (at most 32): more rounds barely change the masks.
    Once every image has M patches covered the later rounds change nothing, and `stop_when_covered`
    (default: on a CPU, where reading that back costs no device sync) skips them: the same masks,
    in fewer small ops (about half the rounds).

    Returns ids (B, M) int64 and mask (B, N) bool, True = masked, like `random_mask`.
    """
    n = grid * grid
    if rounds <= 0:
        rounds = min(math.ceil(num_mask / min(min_patches, num_mask)) + 4, 32)
    rand = lambda *shape: torch.rand(*shape, generator=generator, device=device)  # noqa: E731
    coord = torch.arange(grid, device=device, dtype=torch.float32)
    rows, cols = coord.view(1, grid, 1), coord.view(1, 1, grid)  # (1, g, 1), (1, 1, g)
    log_lo, log_hi = math.log(aspect[0]), math.log(aspect[1])
    key = torch.zeros(batch, grid, grid, device=device)  # (B, g, g) rank: round + distance in [0, 1)
    covered = torch.zeros(batch, grid, grid, dtype=torch.bool, device=device)  # (B, g, g)
    if stop_when_covered is None:
        stop_when_covered = torch.device(device).type == "cpu"
    for r in range(rounds):
        missing = (num_mask - covered.sum((1, 2))).clamp_min(0).float()  # (B,)
        if stop_when_covered and not missing.any():
            break
        lo = torch.clamp(missing, max=float(min_patches))
        area = lo + rand(batch) * (missing - lo)  # (B,) uniform in [min(missing, min_patches), missing]
        ratio = torch.exp(log_lo + rand(batch) * (log_hi - log_lo))  # (B,) height / width
        h = (area * ratio).sqrt().round().clamp(1, grid)  # (B,)
        w = (area / ratio).sqrt().round().clamp(1, grid)  # (B,)
        top = (rand(batch) * (grid - h + 1)).floor().view(-1, 1, 1)  # (B, 1, 1)
        left = (rand(batch) * (grid - w + 1)).floor().view(-1, 1, 1)
        h, w = h.view(-1, 1, 1), w.view(-1, 1, 1)
        rect = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)  # (B, g, g)
        new = rect & ~covered & (missing > 0).view(-1, 1, 1)  # (B, g, g)
        dist = torch.hypot(rows - (top + (h - 1) / 2), cols - (left + (w - 1) / 2))  # (B, g, g)
        key = torch.where(new, r + dist / (dist.amax((1, 2), keepdim=True) + 1), key)
        covered |= new
    # patches no rectangle covered rank last, those with more covered 4-neighbours first, so a
    # shortfall grows the rectangles' edges instead of scattering single patches
    c = torch.nn.functional.pad(covered.float(), (1, 1, 1, 1))  # (B, g + 2, g + 2)
    near = c[:, :-2, 1:-1] + c[:, 2:, 1:-1] + c[:, 1:-1, :-2] + c[:, 1:-1, 2:]  # (B, g, g) in 0..4
    key = torch.where(covered, key, rounds + (4 - near + rand(batch, grid, grid)) / 5)
    ids = key.view(batch, n).argsort(dim=1, stable=True)[:, :num_mask]  # (B, M); ties (equal distances) by index
    mask = torch.zeros(batch, n, dtype=torch.bool, device=device)  # (B, N)
    mask.scatter_(1, ids, True)
    return ids, mask


def mixed_mask(
    cfg: MaskConfig,
    batch: int,
    grid: int,
    num_mask: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image, a block mask with probability `cfg.block_share`, else a random one; both hide M.

    Both kinds are drawn for every image and the rows are selected with torch.where, so the batch
    holds both kinds (about block_share of it blocks) with no per-image Python and static shapes.
    On a CPU a batch where no image drew a block skips building them (most batches at a small
    share: (1 - share)^B of them); on a device that check would be a sync, so blocks are always built.
    """
    use_block = torch.rand(batch, 1, generator=generator, device=device) < cfg.block_share  # (B, 1)
    rand_ids, rand = random_mask(batch, grid * grid, num_mask, generator, device)
    if torch.device(device).type == "cpu" and not use_block.any():
        return rand_ids, rand
    block_ids, block = block_mask(batch, grid, num_mask, cfg.block_min_patches, cfg.block_aspect, generator, device)
    return torch.where(use_block, block_ids, rand_ids), torch.where(use_block, block, rand)  # (B, M), (B, N)


def draw_mask(
    cfg: MaskConfig,
    batch: int,
    grid: int,
    num_mask: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    strategy: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of `strategy` (default the configured one): ids (B, M) int64 and mask (B, N) bool, True = masked.

    `centre` ignores `num_mask`: every image hides the centre box (`centre_box_mask`).
    """
    strategy = strategy or cfg.strategy
    if strategy == "centre":
        mask = centre_box_mask(grid).to(device).expand(batch, -1).clone()  # (B, N)
        return mask_to_ids(mask), mask
    if strategy == "mixed":
        return mixed_mask(cfg, batch, grid, num_mask, generator, device)
    if strategy == "block":
        return block_mask(batch, grid, num_mask, cfg.block_min_patches, cfg.block_aspect, generator, device)
    return random_mask(batch, grid * grid, num_mask, generator, device)
