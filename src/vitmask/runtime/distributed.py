"""Data-parallel training under torchrun: process group, device per rank, and small collectives.

`torchrun --nproc_per_node=N -m vitmask train ...` starts N processes with RANK, LOCAL_RANK and
WORLD_SIZE set. Each joins one process group (nccl on CUDA, gloo on CPU), trains a
DistributedDataParallel copy of the model on its shard of every global batch, and only rank 0 logs
and writes. Without torchrun the world is one process and every helper here is a no-op.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vitmask.errors import UserError


@dataclass(frozen=True)
class World:
    rank: int = 0  # this process's index among all processes
    local_rank: int = 0  # its index on this machine (its GPU)
    size: int = 1  # processes in the run

    @property
    def main(self) -> bool:
        """Rank 0: the one process that logs and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init(device: torch.device) -> tuple[World, torch.device]:
    """Join the process group when started by torchrun; returns the world and this rank's device."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(), device
    world = World(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), size)
    if device.type == "cuda":
        if torch.cuda.device_count() <= world.local_rank:
            raise UserError(
                f"torchrun started {size} processes per node but torch sees {torch.cuda.device_count()} GPU(s); "
                "use --nproc_per_node at most the GPU count"
            )
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        cuda = device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    _cpu_group()  # collective: every rank creates it now, in the same order
    return world, device


def data_parallel(model: torch.nn.Module, device: torch.device, world: World):
    """`model` in DistributedDataParallel when the world has several processes, else None."""
    if not world.distributed:
        return None
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def check_batch(global_batch: int, accum_steps: int, world: World) -> None:
    if global_batch % (world.size * accum_steps):
        raise UserError(
            f"data.batch_size ({global_batch}) must be divisible by processes x train.accum_steps "
            f"({world.size} x {accum_steps}); change the batch size, accum_steps or --nproc_per_node"
        )


def all_max(t: torch.Tensor, world: World) -> torch.Tensor:
    """Elementwise max of `t` over ranks, in place (a no-op in a world of one)."""
    if world.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    """Elementwise sum of `t` over ranks, in place (a no-op in a world of one)."""
    if world.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(flag: bool, world: World) -> bool:
    """True when `flag` is true on any rank (a CPU collective: no GPU sync on the gloo group)."""
    if not world.distributed:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group())
    return bool(t[0])


_CPU_GROUP = None


def _cpu_group():
    """A gloo group beside the main one, so host-side flags never touch a CUDA stream."""
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    return _CPU_GROUP


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
