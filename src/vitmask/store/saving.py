"""When and where a run writes its checkpoints (the file format and atomic writes: checkpoint.py).

Every `train.checkpoint_every` steps and at the last step: `step_<step>.pt`, with `last.pt` pointing
at it and only the newest `train.keep_last` step files kept. Whenever validation improves on the
best loss so far: `best.pt`. Under torchrun only rank 0 writes, and every rank waits for the write.
Without a run dir nothing is written.

The state is passed as a function (the trainer's `state_dict`), so ranks that do not write never
build it. A save has no stop point: a stop signal during one lets it finish, since it is the
checkpoint the stop needs, and the trainer then stops without writing another (signals.py).
"""

from collections.abc import Callable
from pathlib import Path

from vitmask.config import TrainConfig
from vitmask.runtime import distributed
from vitmask.runtime.distributed import World
from vitmask.store.checkpoint import save_checkpoint, write_run_checkpoint


class Checkpointer:
    def __init__(self, run_dir: Path | None, t: TrainConfig, world: World):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.every, self.max_steps, self.keep_last = t.checkpoint_every, t.max_steps, t.keep_last
        self.world = world

    @property
    def last(self) -> Path | None:
        """The run's newest checkpoint, last.pt."""
        return self.run_dir / "last.pt" if self.run_dir is not None else None

    def due(self, step: int) -> bool:
        """Whether a checkpoint is written after `step`: on the cadence, and at the last step."""
        return self.run_dir is not None and (step % self.every == 0 or step == self.max_steps)

    def save(self, state: Callable[[], dict]) -> Path:
        """Write step_<step>.pt and last.pt (rank 0), rotate old step files, wait for every rank."""
        if self.world.main:
            write_run_checkpoint(state(), self.run_dir, self.keep_last)
        distributed.barrier(self.world)
        return self.last

    def save_best(self, state: Callable[[], dict]) -> None:
        """Write best.pt (rank 0, with a run dir)."""
        if self.run_dir is not None and self.world.main:
            save_checkpoint(state(), self.run_dir / "best.pt")
