"""A bounded, seeded subset per class: the choice against counts made by hand, and probe and finetune
on a pack reading it (the images they report are the subset's, counted from the pack's labels)."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from tests.conftest import assert_user_error, train_tiny, write_config
from vitmask.data.packed import open_packed
from vitmask.data.per_class import per_class_positions

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


def test_at_most_k_of_each_class_in_split_order_and_seeded():
    counts = {0: 5, 1: 2, 2: 10, 7: 1}
    labels = torch.tensor([c for c, n in counts.items() for _ in range(n)])[torch.randperm(18)]
    pos = per_class_positions(labels, 3, seed=4)
    assert pos.tolist() == sorted(set(pos.tolist()))  # ascending, each once
    assert Counter(labels[pos].tolist()) == {0: 3, 1: 2, 2: 3, 7: 1}
    assert torch.equal(pos, per_class_positions(labels, 3, seed=4))
    draws = {tuple(per_class_positions(labels, 3, seed=s).tolist()) for s in range(8)}
    assert len(draws) > 1  # the seed picks which
    assert per_class_positions(labels, 10, seed=0).tolist() == list(range(18))  # K over every count: all of them
    # every image of a class is as likely: over many seeds each of class 2's ten images is picked about 3/10 of the time
    tens = torch.tensor([2] * 10)
    picks = Counter(i for s in range(2000) for i in per_class_positions(tens, 3, seed=s).tolist())
    assert all(abs(picks[i] / 2000 - 0.3) < 0.05 for i in range(10)), picks


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory):
    """A pack of the tiny shapes, and 10 steps of the tiny model trained on it."""
    from vitmask.cli import commands

    root = tmp_path_factory.mktemp("packed")
    pack = root / "pack"
    with pytest.raises(SystemExit) as done:
        commands.main(["pack", "--config", str(write_config(root / "t.yaml")), "--out", str(pack)])
    assert done.value.code == 0
    train = {"max_steps": 10, "eval_every": 10, "checkpoint_every": 10}
    ckpt = train_tiny(root, {"data": {"source": "packed", "path": str(pack)}, "train": train})
    return pack, ckpt


def subset_counts(pack, split: str, k: int) -> int:
    labels = np.asarray(open_packed(pack).split_labels(split))
    return sum(min(n, k) for n in Counter(labels.tolist()).values())


def test_probe_and_finetune_read_k_images_of_each_class_of_a_pack(run_cli, packed_run, tmp_path, monkeypatch):
    pack, ckpt = packed_run
    res = run_cli("probe", "--checkpoint", ckpt, "--per-class", "6", "--k", "3", "--json", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["images"] == {s: subset_counts(pack, s, 6) for s in ("train", "val", "test")}
    assert report["per_class"] == 6

    config = write_config(tmp_path / "ft.yaml", {"data": {"source": "packed", "path": str(pack)}})
    args = ["finetune", "--checkpoint", ckpt, "--config", config, "--run-dir", tmp_path / "ft", "--device", "cpu"]
    steps = ["--set", "train.max_steps=2", "--set", "train.eval_every=2", "--set", "train.checkpoint_every=2"]
    res = run_cli(*args, *steps, "--set", "finetune.per_class=5", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.splitlines()[-1])
    assert report["test_images"] == subset_counts(pack, "test", 5) and "linear_probe" in report
    scored = run_cli("eval", "--checkpoint", tmp_path / "ft" / "last.pt", "--split", "test", "--json")
    assert json.loads(scored.stdout)["images"] == report["test_images"]  # eval reads the same subset

    # a pack too large to unpack whole: one line that names the flag
    import vitmask.runtime.memory as memory

    real = memory.available_bytes
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10_000 if device.type == "cpu" else real(device))
    res = run_cli("probe", "--checkpoint", ckpt, "--k", "3", "--device", "cpu")
    assert_user_error(res, "--per-class")


def test_finetune_refuses_a_linear_probe_baseline_it_cannot_unpack_before_it_trains(
    run_cli, packed_run, tmp_path, monkeypatch
):
    """A pack too large to unpack for the linear-probe baseline: refused in one line before the first step
    (no checkpoint, the run dir made for it removed), not after the whole fine-tuning; --no-baselines trains."""
    import vitmask.data.per_class as per_class
    from vitmask.errors import UserError

    pack, ckpt = packed_run

    def too_large(need, what, fix):  # the memory check of unpacking alone says no (training's checks pass)
        raise UserError(f"{what} need more memory than is free; {fix}")

    monkeypatch.setattr(per_class, "check_bytes", too_large)
    config = write_config(tmp_path / "ft.yaml", {"data": {"source": "packed", "path": str(pack)}})
    args = ["finetune", "--checkpoint", ckpt, "--config", config, "--run-dir", tmp_path / "ft", "--device", "cpu"]
    steps = ["--set", "train.max_steps=2", "--set", "train.eval_every=2", "--set", "train.checkpoint_every=2"]
    assert_user_error(run_cli(*args, *steps), "finetune.per_class", "--no-baselines")
    assert not (tmp_path / "ft").exists()
    res = run_cli(*args, *steps, "--no-baselines")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "ft" / "last.pt").is_file()


def test_the_subset_follows_the_split_seed_not_the_training_seed():
    """Runs of other training seeds on one split (data.split_seed) read the same images; another split
    seed reads others; without data.split_seed, `seed` is the split's seed."""
    from vitmask.config import config_from_dict
    from vitmask.data.batches import LabelledSplits
    from vitmask.data.per_class import take_per_class

    generator = torch.Generator().manual_seed(0)
    sizes = {"train": 60, "val": 30, "test": 30}
    labels = {s: torch.randint(0, 3, (n,), generator=generator) for s, n in sizes.items()}
    images = {s: torch.arange(n) for s, n in sizes.items()}  # each image is its own position
    data = LabelledSplits(images, labels)

    def chosen(seed: int, split_seed: int | None) -> dict[str, list[int]]:
        cfg = config_from_dict({"seed": seed, "data": {"split_seed": split_seed}})
        return {s: x.tolist() for s, x in take_per_class(data, 4, cfg).images.items()}

    base = chosen(seed=1, split_seed=5)
    assert all(Counter(labels[s][base[s]].tolist()) == {0: 4, 1: 4, 2: 4} for s in sizes)
    assert chosen(seed=2, split_seed=5) == base  # another training seed, the same split seed
    assert chosen(seed=5, split_seed=None) == base  # the split seed in effect is `seed`
    assert chosen(seed=1, split_seed=6) != base
