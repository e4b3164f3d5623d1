"""The training order: every epoch a seeded permutation of the train split (no index of its size),
the sampler's state the step, exact resume across epoch boundaries, the same batches with the next
one prefetched in a background thread, and the same global batches on any number of processes (2
gloo processes killed, resumed as 1, against an unbroken run)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, TINY, run_cli, write_config
from tests.test_distributed import losses
from vitmask.config import config_from_dict
from vitmask.data.batches import BatchSampler, EpochOrder
from vitmask.data.pack import pack
from vitmask.data.packed import FORMAT, open_packed, pack_rows
from vitmask.data.patches import unpatchify
from vitmask.train.finetune import LabelledBatchSampler

pytestmark = pytest.mark.usefixtures("one_thread")
BITS = 12  # images carry their own index in their first 12 pixels


def numbered_images(n: int) -> torch.Tensor:
    """(n, 16, 16) uint8: image i holds i in binary in its first BITS pixels (most significant first)."""
    images = torch.zeros(n, 16, 16, dtype=torch.uint8)
    bits = (torch.arange(n).unsqueeze(1) >> torch.arange(BITS - 1, -1, -1)) & 1  # (n, BITS)
    images[:, 0, :BITS] = bits.to(torch.uint8)
    return images


def batch_indices(batch) -> list[int]:
    """The indices of a batch's images, read back from their pixels."""
    images = unpatchify(batch.patches, 2)  # (B, 16, 16)
    weights = 2 ** torch.arange(BITS - 1, -1, -1)
    return (images[:, 0, :BITS].long() * weights).sum(1).tolist()


def cfg(seed=0, batch=32):
    return config_from_dict({**TINY, "seed": seed, "data": {**TINY["data"], "batch_size": batch}})


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4099])
def test_every_epoch_is_a_permutation_of_the_split(n):
    order = EpochOrder(n, seed=7)
    for epoch in range(3):
        assert sorted(order(epoch, torch.arange(n)).tolist()) == list(range(n))
    if n >= 64:
        a, b = order(0, torch.arange(n)), order(1, torch.arange(n))
        assert not torch.equal(a, b)  # each epoch its own order
        assert not torch.equal(a, EpochOrder(n, seed=8)(0, torch.arange(n)))  # each seed its own
        assert not torch.equal(a, torch.arange(n))  # shuffled


def test_the_stream_runs_on_from_one_epoch_into_the_next():
    n = 100
    order = EpochOrder(n, seed=3)
    first, second = order(0, torch.arange(n)), order(1, torch.arange(n))
    assert order.indices(n - 3, 6).tolist() == first[-3:].tolist() + second[:3].tolist()
    assert order.indices(5 * n + 7, 2).tolist() == order(5, torch.tensor([7, 8])).tolist()


@pytest.mark.parametrize("block", [7, 64, 1 << 16])
def test_indices_read_from_cached_blocks_equal_the_permutation_at_each_position(block, monkeypatch):
    monkeypatch.setattr(EpochOrder, "BLOCK", block)  # small blocks: batches straddle blocks and epochs
    n = 150
    order = EpochOrder(n, seed=11)
    want = torch.cat([EpochOrder(n, seed=11)(e, torch.arange(n)) for e in range(4)])  # (4n,) uncached
    for start, count in [(0, 32), (140, 32), (7, 7), (6, 9), (290, 300), (3, 1), (0, 4 * n)]:
        assert order.indices(start, count).tolist() == want[start : start + count].tolist()
    assert order.indices(0, 5).tolist() == order.indices(0, 5).tolist()  # a cached block gives the same again


def test_batches_cover_each_image_once_per_epoch():
    sampler = BatchSampler(numbered_images(96), cfg())  # 3 batches an epoch
    epochs = [sum((batch_indices(sampler.sample()) for _ in range(3)), []) for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(96))
    assert epochs[0] != epochs[1]
    assert sampler.state_dict() == {"seed": 1, "epoch": 2, "position": 0, "step": 6}


def test_a_sampler_resumed_from_its_state_draws_the_same_batches_across_an_epoch_boundary():
    images = numbered_images(80)  # 2.5 batches an epoch: batch 2 spans epochs 0 and 1
    unbroken = BatchSampler(images, cfg())
    want = [unbroken.sample() for _ in range(6)]
    first = BatchSampler(images, cfg())
    first.sample()
    state = first.state_dict()
    assert state == {"seed": 1, "epoch": 0, "position": 32, "step": 1}
    resumed = BatchSampler(images, cfg(seed=5))  # another run's seed: the state brings its own
    resumed.load_state_dict(state)
    for w in want[1:]:
        b = resumed.sample()
        assert torch.equal(b.patches, w.patches) and torch.equal(b.mask, w.mask) and torch.equal(b.ids, w.ids)
    epoch0 = batch_indices(want[0]) + batch_indices(want[1]) + batch_indices(want[2])[:16]
    epoch1 = batch_indices(want[2])[16:] + batch_indices(want[3]) + batch_indices(want[4])
    assert sorted(epoch0) == sorted(epoch1) == list(range(80))  # the boundary batch ends one, starts the next


def test_ranks_take_their_slices_of_the_same_global_batch():
    images = numbered_images(96)
    whole = BatchSampler(images, cfg())
    ranks = [BatchSampler(images, cfg(), rank=r, world=2) for r in range(2)]
    for _ in range(4):
        w = whole.sample()
        parts = [r.sample() for r in ranks]
        assert batch_indices(w) == batch_indices(parts[0]) + batch_indices(parts[1])
        assert torch.equal(w.mask, torch.cat([p.mask for p in parts]))


def numbered_pack(root: Path, n: int):
    """The train split of a packed directory holding numbered_images(n), read through its memory map."""
    root.mkdir()
    np.save(root / "rows.npy", pack_rows(numbered_images(n)))  # (n, 32)
    splits = {"train": {"count": n, "start": 0}, **{k: {"count": 0, "start": n} for k in ("val", "test")}}
    header = {"format": FORMAT, "count": n, "height": 16, "width": 16, "classes": None, "splits": splits}
    (root / "header.json").write_text(json.dumps(header))
    return open_packed(root).split("train")


def same_batch(a, b) -> bool:
    return torch.equal(a.patches, b.patches) and torch.equal(a.mask, b.mask) and torch.equal(a.ids, b.ids)


def test_prefetched_batches_equal_the_batches_gathered_in_step_across_epochs_and_a_resume(tmp_path):
    images = numbered_pack(tmp_path / "p", 80)  # 2.5 batches an epoch: batch 2 spans epochs 0 and 1
    plain = BatchSampler(images, cfg(), prefetch=False)
    want = [plain.sample() for _ in range(8)]
    assert plain.step_images.prefetcher is None and BatchSampler(images, cfg()).step_images.prefetcher is None  # CPU
    assert [batch_indices(w) for w in want] == [plain.order.indices(s * 32, 32).tolist() for s in range(8)]
    ahead = BatchSampler(images, cfg(), prefetch=True)
    resumed = BatchSampler(images, cfg(seed=5), prefetch=True)  # another run's seed: the state brings its own
    try:
        prefetcher = ahead.step_images.prefetcher
        loads = []
        load = prefetcher.load
        prefetcher.load = lambda key: loads.append(key[1]) or load(key)
        got = [ahead.sample() for _ in range(3)]
        assert sorted(loads)[:3] == [0, 1, 2] and len(set(loads)) == len(loads)  # each gathered once (3: pending)
        state = ahead.state_dict()  # batch 3 is being gathered in the background
        resumed.sample()  # and this one prefetches batch 1 of its own (other) order
        resumed.load_state_dict(state)
        got += [resumed.sample() for _ in range(5)]
        for s, (g, w) in enumerate(zip(got, want, strict=True)):
            assert same_batch(g, w), s
        for step in (1, 6, 2, 3):  # seeks back and forth: a batch prefetched for another step is never used
            ahead.seek(step)
            assert same_batch(ahead.sample(), want[step]), step
        ahead.load_state_dict({"seed": 9, "step": 4})  # the pending batch 4 was of seed 1's order
        other = BatchSampler(images, cfg(), prefetch=False)
        other.load_state_dict({"seed": 9, "step": 4})
        assert same_batch(ahead.sample(), other.sample())
    finally:
        ahead.close()
        resumed.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned memory and a non-blocking copy")
def test_on_cuda_batches_from_the_memory_map_are_prefetched_through_pinned_memory(tmp_path):
    images = numbered_pack(tmp_path / "p", 80).to("cuda")
    ahead = BatchSampler(images, cfg())  # the default for a memory map and a CUDA device: prefetch
    plain = BatchSampler(images, cfg(), prefetch=False)
    try:
        assert ahead.step_images.prefetcher is not None and images.gather(torch.arange(4)).is_pinned()
        for step in range(6):
            assert same_batch(ahead.sample(), plain.sample()), step
    finally:
        ahead.close()


def test_prefetched_labelled_batches_equal_the_batches_gathered_in_step(tmp_path):
    images = numbered_pack(tmp_path / "p", 80)
    labels = torch.arange(80) % 7
    plain = LabelledBatchSampler(images, labels, cfg(), prefetch=False)
    ahead = LabelledBatchSampler(images, labels, cfg(), prefetch=True)
    try:
        for _ in range(6):
            a, b = plain.sample(), ahead.sample()
            assert torch.equal(a.patches, b.patches) and torch.equal(a.labels, b.labels)
            assert (a.labels == torch.tensor(batch_indices(a)) % 7).all()  # each label its image's
    finally:
        ahead.close()


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_a_two_process_run_killed_and_resumed_as_one_process_sees_the_same_batches(tmp_path):
    pack(config_from_dict({**TINY, "data": {**TINY["data"], "num_train": 80}}), tmp_path / "p", progress=False)
    c = write_config(
        tmp_path / "c.yaml",
        {
            "data": {"source": "packed", "path": str(tmp_path / "p")},  # 2.5 batches an epoch
            "train": {"max_steps": 8, "log_every": 1, "eval_every": 100, "checkpoint_every": 2, "keep_last": 1000},
        },
    )
    one, two = tmp_path / "one", tmp_path / "two"
    res = run_cli("train", "--config", c, "--run-dir", one, "--device", "cpu")
    assert res.returncode == 0, res.stderr

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "vitmask"]
    args = ["train", "--config", c, "--run-dir", two, "--device", "cpu", "--set", "train.max_steps=10000"]
    proc = subprocess.Popen([*cmd, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (two / "step_0000004.pt").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
    finally:  # torchrun starts each worker in a session of its own: kill the workers, then torchrun
        for pid in [*children(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    assert (two / "step_0000004.pt").exists()
    for later in [*two.glob("events.out.tfevents.*"), two / "last.pt", *two.glob("step_*.pt")]:
        if later.name != "step_0000004.pt":  # as if killed right after step 4; the resumed run's losses only
            later.unlink()
    res = run_cli("train", "--run-dir", two, "--resume", "auto", "--device", "cpu", "--set", "train.max_steps=8")
    assert res.returncode == 0, res.stderr
    resumed = losses(two)
    assert [s for s, _ in resumed] == list(range(5, 9))
    want = dict(losses(one))
    for step, loss in resumed:  # DDP sums the halves in another order: equal up to float rounding
        assert abs(loss - want[step]) <= 1e-4, (step, loss, want[step])
