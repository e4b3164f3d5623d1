"""Which patches are hidden, and what the model sees in their place.

Convention (as in MAE's `random_masking`): a boolean mask of shape (B, N) with True = masked,
plus the indices of the masked patches, (B, M). Every image in a batch hides exactly
M = round(ratio * N) patches (Python's round), clamped to [1, N - 1], so every shape is static
and the loss needs no boolean indexing.

Strategies (`mask.strategy`): `random` draws the M patches uniformly; `block` (BEiT) covers
rectangles of patches until M are covered, then keeps exactly M; `mixed` keeps a block mask for a
share `mask.block_share` of the images and a random one for the rest, with the same M. All are
batched tensor ops, a fixed number of them whatever the batch and grid (block masks:
`BLOCK_PASSES` passes of `BLOCK_ROUNDS` rectangles per image at once). Evaluation also has
`centre`: the central square of half the grid's side, the same for every image.

Training draws M once per batch from the ratio schedule (`mask.ratio_schedule`): `fixed` (always
`mask.ratio`), `uniform` (uniform over the counts `mask.ratio_range` allows, all of 1..N - 1 by
default) or `cosine` (MaskGIT: ratio = cos(pi/2 * u), u ~ U(0, 1), restricted to the range).

How the model reads a masked image (the fill, the indices of hidden and visible patches) is the
model's: model/masked_input.py. The count M is `vitmask.sizes.num_masked`.

Shapes: B batch, N = g * g patches on a g x g grid, M masked patches per image.
"""

import math

import torch

from vitmask.config import MaskConfig
from vitmask.sizes import num_masked


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


# `block_mask` draws BLOCK_PASSES passes of BLOCK_ROUNDS rectangles per image, each pass from the count
# the earlier ones left uncovered: 6 x 4 keeps the masks' statistics within a few percent of drawing the
# rectangles one at a time (tests/test_masking.py), in a fixed number of ops
BLOCK_ROUNDS = 4
BLOCK_PASSES = 6


def block_mask(
    batch: int,
    grid: int,
    num_mask: int,
    min_patches: int = 16,
    aspect: tuple[float, float] = (0.3, 3.3),
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    rounds: int = BLOCK_ROUNDS,
    passes: int = BLOCK_PASSES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hide exactly `num_mask` patches per image in rectangles of patches, as in BEiT.

    BEiT draws rectangles one after another: an area between `min_patches` and the count still
    missing, a height/width ratio log-uniform in `aspect`, a uniform position, until M are covered.
    Here `passes` passes each draw `rounds` rectangles per image at once (`block_areas`: the areas
    follow BEiT's recurrence with overlaps between one pass's rectangles not yet subtracted, and the
    next pass draws from the count then truly missing). A patch is ranked by the pass and round of
    the first rectangle that covered it, and within that round by its distance from the rectangle's
    centre; the first `num_mask` in that order are masked. So earlier rectangles are kept whole, the
    one that overshoots is trimmed to the patches nearest its centre, and if the passes cover too
    few, the rest is taken from patches next to the rectangles (most covered neighbours first, ties
    at random). Every op is batched: no Python loop over images, and `passes` (a constant) over rounds.

    Returns ids (B, M) int64 and mask (B, N) bool, True = masked, like `random_mask`.
    """
    n = grid * grid
    rand = lambda *shape: torch.rand(*shape, generator=generator, device=device)  # noqa: E731
    coord = 2 * torch.arange(grid, device=device, dtype=torch.float32)  # (g,) 2 x, in half patches
    log_lo, log_hi = math.log(aspect[0]), math.log(aspect[1])
    # a rank is an integer, exact in float32: (pass * (R + 1) + round) * span + the squared distance
    # from the rectangle's centre in half patches (below span); `outside` or more where none covers
    span = 2 * (2 * grid) ** 2
    outside = 2.0 ** (span * passes * (rounds + 1)).bit_length()
    order = span * torch.arange(rounds, device=device, dtype=torch.float32)  # (R,) the rounds of a pass
    later = torch.ones(rounds, rounds, dtype=torch.bool, device=device).triu()  # (R, R) for `block_areas`
    draws = rand(passes, batch, rounds, 4)  # (passes, B, R, 4): area, aspect, row and column of each rectangle
    key = torch.full((batch, grid, grid), outside, device=device)  # (B, g, g) rank: pass, round, distance
    for step, u in enumerate(draws):  # u (B, R, 4)
        missing = (num_mask - (key < outside).sum((1, 2))).clamp_min(0).float()  # (B,)
        area, active = block_areas(missing, min_patches, u[..., 0], later)  # 2 x (B, R)
        root = torch.exp((log_lo + u[..., 1] * (log_hi - log_lo)) / 2)  # (B, R) sqrt(height / width)
        sides = (area.sqrt().unsqueeze(-1) * torch.stack([root, 1 / root], -1)).round().clamp(1, grid)  # (B, R, 2) h, w
        start = (u[..., 2:] * (grid - sides + 1)).floor()  # (B, R, 2) top, left
        # per axis, (2 x - (2 start + side - 1))^2 plus `outside` where x is not in the rectangle
        lo, side = 2 * start.unsqueeze(-1), 2 * sides.unsqueeze(-1)  # (B, R, 2, 1) in half patches
        off = (coord < lo) | (coord >= lo + side)  # (B, R, 2, g)
        axis = (coord - (lo + side / 2 - 1)) ** 2 + outside * off  # (B, R, 2, g)
        first = (order + step * (rounds + 1) * span + outside * ~active).unsqueeze(-1)  # (B, R, 1)
        rect_key = ((axis[:, :, 0] + first).unsqueeze(-1) + axis[:, :, 1].unsqueeze(-2)).amin(1)  # (B, g, g)
        key = torch.minimum(key, rect_key)  # a patch keeps the rank of the first rectangle that covered it
    covered = key < outside  # (B, g, g)
    # patches no rectangle covered rank last, those with more covered 4-neighbours first, so a
    # shortfall grows the rectangles' edges instead of scattering single patches
    c = torch.nn.functional.pad(covered.float(), (1, 1, 1, 1))  # (B, g + 2, g + 2)
    near = c[:, :-2, 1:-1] + c[:, 2:, 1:-1] + c[:, 1:-1, :-2] + c[:, 1:-1, 2:]  # (B, g, g) in 0..4
    key = torch.where(covered, key, outside * (1 + (4 - near + rand(batch, grid, grid)) / 5))  # (B, g, g)
    ids = key.view(batch, n).topk(num_mask, dim=1, largest=False, sorted=False).indices  # (B, M) the M lowest ranks
    mask = torch.zeros(batch, n, dtype=torch.bool, device=device)  # (B, N)
    mask.scatter_(1, ids, True)
    return ids, mask


def block_areas(
    missing: torch.Tensor, min_patches: int, u: torch.Tensor, later: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """BEiT's areas for R rectangles in a row, all at once: missing (B,) patches to cover, u (B, R)
    uniform, later (R, R) bool, True where s >= r -> area (B, R) and active (B, R) bool (a rectangle
    is drawn).

    Round r draws area_r = p + u_r (m_r - p) while m_r >= p (p = min_patches), then the rest,
    area = m_r, and nothing after, with m_0 = missing and m_{r+1} = m_r - area_r (overlaps not
    subtracted). While m_s >= p, m_{r+1} = (1 - u_r)(m_r - p), so with E_r = sum_{s<r} log(1 - u_s):
    m_r = exp(E_r) m_0 - p sum_{s<r} exp(E_r - E_s), a sum over a (R, R) triangle.
    """
    log_v = torch.log1p(-u)  # (B, R) log(1 - u_r); u < 1
    e = torch.cumsum(log_v, 1) - log_v  # (B, R) E_r, exclusive
    decay = (e.unsqueeze(2) - e.unsqueeze(1)).masked_fill(later, -math.inf).exp()  # (B, R, R) exp(E_r - E_s)
    m = e.exp() * missing.unsqueeze(1) - min_patches * decay.sum(2)  # (B, R) m_r
    first_kind = (m >= min_patches).int().cumprod(1)  # (B, R) 1 while every round so far had m_s >= p
    exact = torch.nn.functional.pad(first_kind[:, :-1], (1, 0), value=1).bool()  # (B, R) m_r follows the formula
    area = torch.where(first_kind.bool(), min_patches + u * (m - min_patches), m)  # (B, R)
    return area.clamp_min(1), exact & (m >= 0.5)  # a rectangle where half a patch or more is missing


def mixed_mask(
    cfg: MaskConfig,
    batch: int,
    grid: int,
    num_mask: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image, a block mask with probability `cfg.block_share`, else a random one; both hide M.

    On a device, both kinds are drawn for every image and the rows are selected with torch.where:
    no per-image Python, static shapes, no sync. On a CPU, where counting the block rows costs no
    sync, blocks are built for those rows alone (about block_share of the batch) and copied in.
    """
    use_block = torch.rand(batch, 1, generator=generator, device=device) < cfg.block_share  # (B, 1)
    rand_ids, rand = random_mask(batch, grid * grid, num_mask, generator, device)
    if torch.device(device).type == "cpu":
        rows = use_block.squeeze(1).nonzero().squeeze(1)  # (k,) the images that hide blocks
        if len(rows) == 0:
            return rand_ids, rand
        block_ids, block = block_mask(
            len(rows), grid, num_mask, cfg.block_min_patches, cfg.block_aspect, generator, device
        )  # (k, M), (k, N)
        return rand_ids.index_copy(0, rows, block_ids), rand.index_copy(0, rows, block)  # (B, M), (B, N)
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
        box = centre_box_mask(grid)  # (N,) on the CPU: its indices cost no device sync
        ids = box.nonzero().squeeze(1).to(device)  # (M,) ascending
        return ids.expand(batch, -1).clone(), box.to(device).expand(batch, -1).clone()  # (B, M), (B, N)
    if strategy == "mixed":
        return mixed_mask(cfg, batch, grid, num_mask, generator, device)
    if strategy == "block":
        return block_mask(batch, grid, num_mask, cfg.block_min_patches, cfg.block_aspect, generator, device)
    return random_mask(batch, grid * grid, num_mask, generator, device)
