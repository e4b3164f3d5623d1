"""A step's images, gathered one step ahead in a background thread.

`StepImages` gives the images of batch s of the training stream (this rank's shard of stream
positions s * B .. s * B + B - 1, in an `EpochOrder`). For a packed split read from its memory map
it can prefetch: when batch s is taken, a background thread starts gathering the packed rows of
batch s + 1 (the order's indices and NumPy's take from the memory map, into pinned memory for a
CUDA device), so that host work overlaps the device's step; batch s + 1 then only copies them to
the device (non-blocking) and unpacks them there.

A prefetched value is keyed by everything it is a function of (the order object and the step) and
used only when exactly that key is asked for; a seek, a resume or another seed asks for another key
and the pending value is dropped. So the batches are the same with prefetch on or off, and the
sampler's state stays the step.

Shapes: b images of this rank, R row bytes, H, W image side.
"""

from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from vitmask.data.packed import PackedImages


class Prefetcher:
    """Holds at most one pending call of `load` in one background thread.

    `get(key, ahead)` returns load(key), taken from the pending call when that was load(key) and
    computed here otherwise, then starts load(ahead). `load` must be a pure function of its key
    and safe to run beside itself (a dropped call may still be running).
    """

    def __init__(self, load: Callable[[Any], Any]):
        self.load = load
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitmask-prefetch")
        self._pending: tuple[Hashable, Future] | None = None

    def get(self, key: Hashable, ahead: Hashable) -> Any:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == key:
            value = pending[1].result()  # re-raises the background call's error here
        else:
            if pending is not None:
                pending[1].cancel()  # a running call finishes on its own; its value is never read
            value = self.load(key)
        self._pending = (ahead, self._pool.submit(self.load, ahead))
        return value

    def close(self) -> None:
        """Drop the pending call and stop the thread (waits for a running call: one batch's gather)."""
        self._pending = None
        self._pool.shutdown(wait=True, cancel_futures=True)


class StepImages:
    """The images of batch s of the stream, this rank's shard, on the split's device.

    `images` is an in-memory (n, H, W) tensor or a `PackedImages`. `prefetch`: None (default) turns
    it on for a packed split gathered from its memory map for a CUDA device; True turns it on for
    any split gathered from a memory map (the CPU too); anything else gathers in the calling thread.
    """

    def __init__(self, images, global_batch: int, shard: slice, prefetch: bool | None = None):
        self.images, self.global_batch, self.shard = images, global_batch, shard
        mapped = isinstance(images, PackedImages) and images.mapped
        if prefetch is None:
            prefetch = mapped and images.device.type == "cuda"
        self.prefetcher = Prefetcher(self._rows) if prefetch and mapped else None

    def indices(self, order, step: int) -> torch.Tensor:
        """(b,) int64 split indices of this rank's images of batch `step`, on the CPU."""
        return order.indices(step * self.global_batch, self.global_batch)[self.shard]  # (b,)

    def _rows(self, key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, step) -> its (b,) indices and (b, R) packed rows on the CPU (pinned for CUDA)."""
        idx = self.indices(*key)
        return idx, self.images.gather(idx)

    def __call__(self, order, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `step` of `order`: (b,) int64 split indices on the CPU, (b, H, W) uint8 images on the
        device; with prefetch, batch step + 1's rows start gathering in the background."""
        if self.prefetcher is not None:
            idx, rows = self.prefetcher.get((order, step), (order, step + 1))
            return idx, self.images.unpack(rows)  # (b, H, W)
        idx = self.indices(order, step)
        packed = isinstance(self.images, PackedImages)
        return idx, self.images[idx if packed else idx.to(self.images.device)]  # (b, H, W)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
