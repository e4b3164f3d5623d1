"""Memory on the device: how much is free (`available_bytes`), refusing early to hold what cannot fit
(`check_bytes`, `check_images_fit`), and turning an allocation failure into one line
(`is_out_of_memory`, `out_of_memory`). What a config needs is estimated in model/memory_estimate.py.
"""

import os
import re

import torch

from vitmask.errors import UserError

GiB = 2**30


def gib(n: float) -> str:
    g = n / GiB
    return f"{g:,.1f} GiB" if g < 1e6 else f"{g:.1e} GiB"


def available_bytes(device: torch.device) -> int | None:
    """Memory free for this process on `device`: CUDA's free memory; on CPU the smaller of the
    kernel's MemAvailable and the cgroup's limit minus its use. None where it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit) as f, open(usage) as g:
                cap = f.read().strip()
                if cap.isdigit() and int(cap) < 2**60:
                    found.append(int(cap) - int(g.read().strip()))
        except (OSError, ValueError):
            pass
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            pass
    return max(min(found), 0) if found else None


def check_bytes(need: int, what: str, fix: str) -> None:
    """Refuse (one line) to hold `need` bytes in CPU memory when they are not free."""
    free = available_bytes(torch.device("cpu"))
    if free is not None and need > free:
        raise UserError(f"{what} need about {gib(need)} of memory, but only {gib(free)} is free; {fix}")


def check_images_fit(count: int, image_size: int) -> None:
    """Refuse to binarize `count` images to image_size x image_size when that cannot fit (about 8
    bytes a pixel: the fitted uint8 copy, a float compare, the splits); for sources whose image
    count is known only once read."""
    need = count * image_size * image_size * 8
    check_bytes(need, f"{count:,} images of {image_size}x{image_size}", "lower data.image_size")


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is an allocation failure: CUDA's OutOfMemoryError, or the CPU allocator's."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def out_of_memory(e: BaseException, device: torch.device | None, doing: str) -> UserError:
    """The one-line UserError for an allocation failure met while `doing` something (a training
    step, loading data, or a command whose options asked for too much)."""
    asked = re.search(r"allocate (\d+) bytes", str(e))
    size = f" (one allocation of {gib(int(asked.group(1)))})" if asked else ""
    where = f" on {device.type}" if device is not None else ""
    return UserError(
        f"out of memory{where} while {doing}{size}; ask for less (a smaller batch, image size, model, or count "
        "of samples or images)"
    )
