"""The probes against hand-made expectations: a linear probe on separable features, k-NN against a
hand-computed vote and a brute-force reference, features against the model's own forward pass
(mean-pooled, grid-pooled by a loop, several layers), the `probe` command end to end, its bad
input, and the online probe during training."""

import json
import math
import re
from collections import Counter

import numpy as np
import pytest
import torch

from tests.conftest import TINY, RecordingLogger, assert_user_error, train_tiny, write_config
from tests.test_sources import numbered_images
from vitmask.config import config_from_dict
from vitmask.data.batches import LabelledSplits, load_labelled_splits
from vitmask.data.patches import patchify
from vitmask.errors import UserError
from vitmask.evaluate import probe
from vitmask.model import pooling
from vitmask.store.checkpoint import load_checkpoint, load_model, save_checkpoint
from vitmask.train.trainer import Trainer

CPU = torch.device("cpu")


@pytest.fixture
def run_cli(run_cli_in_process):
    """This module's CLI tests run in process (conftest.run_cli_in_process)."""
    return run_cli_in_process


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 30-step tiny model on 16x16 shapes (labels: the kind of the largest shape)."""
    return train_tiny(tmp_path_factory.mktemp("ckpt"))


def knn_reference(train_x, train_y, query_x, k, temperature=0.07) -> list[int]:
    """DINO's weighted vote written out one query at a time with Python floats."""
    preds = []
    for q in query_x.tolist():
        sims = []
        for x, y in zip(train_x.tolist(), train_y.tolist(), strict=True):
            dot = sum(a * b for a, b in zip(q, x, strict=True))
            sims.append((dot / (math.hypot(*q) * math.hypot(*x)), y))
        votes = Counter()
        for sim, y in sorted(sims, key=lambda s: -s[0])[:k]:
            votes[y] += math.exp(sim / temperature)
        best = max(votes.values())
        preds.append(min(c for c, v in votes.items() if v == best))
    return preds


# ---- the probes -----------------------------------------------------------------------------------
def test_linear_probe_reaches_100_percent_on_linearly_separable_features():
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[4.0, 0, 0, 0, 0], [0, 4.0, 0, 0, 0], [0, 0, 4.0, 0, 0]])  # 3 classes in 5-D

    def sample(n):
        y = torch.arange(n) % 3
        return centres[y] + 0.5 * torch.randn(n, 5, generator=g), y  # every point within 3 sd of its centre

    (x, y), (xt, yt) = sample(90), sample(60)
    assert ((xt - centres[yt]).abs().max() < 2.0).item()  # linearly separable: the margin is at least 2
    train, test = probe.standardise(x, xt)
    w, b = probe.fit_linear(train, y, 3, l2=1e-4)
    assert probe.accuracy(probe.linear_predict(test, w, b), yt) == 1.0
    assert probe.accuracy(probe.linear_predict(train, w, b), y) == 1.0


def test_knn_is_the_similarity_weighted_vote_computed_by_hand():
    # query along x; a: cos 1 (class 1); b, c: cos 0.8 (class 0); d, e, f: cos 0 (class 2)
    train = torch.tensor([[2.0, 0], [0.8, 0.6], [0.8, -0.6], [0, 1], [0, 3], [0, -1]])
    labels = torch.tensor([1, 0, 0, 2, 2, 2])
    query = torch.tensor([[5.0, 0]])  # cosine ignores the scale
    # k=3, T=0.07: class 1 gets exp(1/0.07) = 1.6e6, class 0 gets 2 exp(0.8/0.07) = 1.8e5: class 1 wins
    assert probe.knn_predict(train, labels, query, 3, 3).tolist() == [1]
    # T=1: class 1 gets e = 2.72, class 0 gets 2 e^0.8 = 4.45: the two neighbours outvote the closest
    assert probe.knn_predict(train, labels, query, 3, 3, temperature=1.0).tolist() == [0]
    # k=6, T=1: class 2 adds 3 e^0 = 3 < 4.45: still class 0; k=1: only a votes
    assert probe.knn_predict(train, labels, query, 6, 3, temperature=1.0).tolist() == [0]
    assert probe.knn_predict(train, labels, query, 1, 3, temperature=1.0).tolist() == [1]


def test_knn_matches_a_brute_force_reference_on_random_points():
    g = torch.Generator().manual_seed(1)
    train, query = torch.randn(40, 4, generator=g), torch.randn(25, 4, generator=g)
    labels = torch.randint(0, 4, (40,), generator=g)
    got = probe.knn_predict(train, labels, query, 7, 4, chunk=8)  # several chunks of queries
    assert got.tolist() == knn_reference(train, labels, query, 7)


# ---- features -------------------------------------------------------------------------------------
def test_features_are_the_forward_pass_tokens_mean_pooled_and_the_same_batched_or_one_by_one(ckpt, monkeypatch):
    model, cfg, _ = load_model(ckpt, CPU)
    images = load_labelled_splits(cfg).images["test"][:20]  # (20, 16, 16)
    patches = patchify(images, 2).float()  # (20, 64, 4)
    seen = {}
    hooks = [model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("final", o))]
    hooks.append(model.blocks[0].register_forward_hook(lambda m, i, o: seen.__setitem__("block1", o)))
    with torch.no_grad():
        model(patches, torch.zeros(20, 64, dtype=torch.bool))  # nothing masked, every token computed
    for h in hooks:
        h.remove()
    monkeypatch.setattr(probe, "FEATURE_BATCH", 6)  # 4 batches, the last one short
    batched = probe.extract_features(model, images, 2)
    torch.testing.assert_close(batched, seen["final"].mean(1), rtol=0, atol=1e-5)
    torch.testing.assert_close(probe.extract_features(model, images, 2, layer=1), seen["block1"].mean(1))
    one_by_one = torch.cat([probe.extract_features(model, images[i : i + 1], 2) for i in range(20)])
    torch.testing.assert_close(batched, one_by_one, rtol=0, atol=1e-5)
    assert batched.shape == (20, 32) and not model.training


def test_random_weights_come_from_the_seed_and_leave_the_global_rng_alone():
    cfg = config_from_dict(TINY)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b, c = (probe.random_model(cfg, s, CPU) for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(a.embed.weight, b.embed.weight) and not torch.equal(a.embed.weight, c.embed.weight)


# ---- the command ----------------------------------------------------------------------------------
def table_rows(text: str) -> dict[str, tuple[float, float]]:
    """The rows of the probe table that end in two numbers: label -> (linear, k-NN)."""
    rows = {}
    for ln in text.splitlines():
        parts = ln.rsplit(maxsplit=2)
        if len(parts) == 3 and all(p.replace(".", "", 1).isdigit() for p in parts[1:]):
            rows[parts[0].strip()] = (float(parts[1]), float(parts[2]))
    return rows


def test_probe_prints_a_table_and_repeats_the_same_numbers_as_json(run_cli, ckpt, monkeypatch):
    monkeypatch.setattr(probe, "LBFGS_ITERS", 50)  # time: the numbers need not converge to repeat
    args = ["probe", "--checkpoint", ckpt, "--device", "cpu", "--k", "5"]
    table = run_cli(*args)
    assert table.returncode == 0, table.stderr
    assert "k-NN (k=5)" in table.stdout
    first, again = (run_cli(*args, "--json") for _ in range(2))
    assert first.returncode == 0 and first.stdout == again.stdout
    report = json.loads(first.stdout)
    assert report["images"] == {"train": 508, "val": 64, "test": 64} and report["classes"] == 4
    r = report["results"]
    assert table_rows(table.stdout) == {
        "model": (round(r["model"]["linear_acc"], 4), round(r["model"]["knn_acc"], 4)),
        "random weights": (round(r["random_weights"]["linear_acc"], 4), round(r["random_weights"]["knn_acc"], 4)),
        "raw pixels": (round(r["raw_pixels"]["linear_acc"], 4), round(r["raw_pixels"]["knn_acc"], 4)),
        "majority class": (round(r["majority"]["acc"], 4),) * 2,
    }
    # the majority floor by hand: the most frequent train label's share of the test labels
    labels = load_labelled_splits(config_from_dict(TINY)).labels
    top = Counter(labels["train"].tolist()).most_common(1)[0][0]
    assert r["majority"]["acc"] == labels["test"].tolist().count(top) / 64
    assert all(r[name]["l2"] in probe.L2_GRID for name in ("model", "random_weights", "raw_pixels"))


def test_probe_without_labels_says_how_to_provide_them(run_cli, ckpt, tmp_path):
    np.savez(tmp_path / "d.npz", images=numbered_images(100))
    state = load_checkpoint(ckpt)
    state["config"]["data"].update(source="npz", path=str(tmp_path / "d.npz"))
    save_checkpoint(state, tmp_path / "npz.pt")
    res = run_cli("probe", "--checkpoint", tmp_path / "npz.pt", "--device", "cpu")
    assert_user_error(res, "data.source=npz gives no labels", "has no array 'labels'", "data.npz_labels_key")


def test_probe_layer_out_of_range_is_one_line(run_cli, ckpt):
    res = run_cli("probe", "--checkpoint", ckpt, "--layer", "3", "--device", "cpu")  # TINY has 2 blocks
    assert_user_error(res, "--layer 3 is out of range", "1 to 2")


def test_probe_bad_k_one_class_and_split_are_user_errors(ckpt):
    model, cfg, _ = load_model(ckpt, CPU)
    data = load_labelled_splits(cfg)
    with pytest.raises(UserError, match=r"--k 509 is not possible with 508 train images; pass a k from 1 to 508"):
        probe.run_probes(model, cfg, data, "test", k=509)
    one = {k: torch.full_like(v, 3) for k, v in data.labels.items()}
    with pytest.raises(UserError, match="the train split's images hold class 3 only; a probe needs labels of at least"):
        probe.run_probes(model, cfg, LabelledSplits(data.images, one), "test")
    few = config_from_dict({**TINY, "train": {**TINY["train"], "probe_every": 5, "probe_train_images": 1}})
    with pytest.raises(UserError, match=r"the first 1 train images hold class \d only.*raise train.probe_train_images"):
        probe.online_probe(few, data, CPU)
    with pytest.raises(UserError, match="unknown split 'train' for probe; use val or test"):
        from vitmask.cli.verbs import probe_checkpoint

        probe_checkpoint(ckpt, "train", None, 20, 0, "cpu")
    assert probe.run_probes(model, cfg, data, "val", layer=0, k=508)["images"] == {"train": 508, "val": 64}


# ---- online ---------------------------------------------------------------------------------------
def test_online_probe_logs_knn_on_its_cadence_and_leaves_training_unchanged():
    cfg = config_from_dict({**TINY, "train": {**TINY["train"], "probe_every": 10, "probe_train_images": 200}})
    data = load_labelled_splits(cfg)
    log = RecordingLogger()
    with_probe = Trainer(cfg, data.images, CPU, logger=log, probe=probe.online_probe(cfg, data, CPU))
    with_probe.fit(progress=False)
    plain = Trainer(cfg, data.images, CPU)
    plain.fit(progress=False)
    for name, w in with_probe.model.state_dict().items():
        assert torch.equal(w, plain.model.state_dict()[name]), name
    probes = [(s, m) for s, m in log.rows if "probe/knn_acc" in m]
    assert [s for s, _ in probes] == [10, 20, 30] and set(probes[-1][1]) == {"probe/knn_acc", "probe/linear_acc"}
    # the last value against the brute-force vote on the final model's features (k = 20)
    feats = {  # the default pooling: the 4x4 grid's cell means
        s: probe.extract_features(plain.model, data.images[s][: 200 if s == "train" else None], 2, grid=4)
        for s in data.images
    }
    ref = knn_reference(feats["train"], data.labels["train"][:200], feats["val"], 20)
    expected = float(np.mean(np.array(ref) == data.labels["val"].numpy()))
    assert probes[-1][1]["probe/knn_acc"] == pytest.approx(expected)


def test_train_with_probe_every_prints_the_probe_or_warns_once_without_labels(run_cli, tmp_path):
    cfg = write_config(tmp_path / "tiny.yaml", {"train": {"max_steps": 10, "eval_every": 10, "probe_every": 5}})
    res = run_cli("train", "-c", cfg, "--run-dir", tmp_path / "a", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if "probe on val: k-NN acc" in ln]
    assert [ln.split()[1] for ln in lines] == ["5/10", "10/10"] and "linear acc" in lines[0]
    np.savez(tmp_path / "d.npz", images=numbered_images(100))
    res = run_cli(
        "train", "-c", cfg, "--run-dir", tmp_path / "b", "--device", "cpu", "--set", "data.source=npz",
        "--set", f"data.path={tmp_path / 'd.npz'}",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "train.probe_every is set but the online probe is off" in err[0], res.stderr
    assert "has no array 'labels'" in err[0] and "probe on val" not in res.stdout


# ---- pooling: --pool grid, several --layer --------------------------------------------------------
def cell_means_by_loop(tokens: torch.Tensor, grid: int) -> torch.Tensor:
    """The grid pooling written out: for each image and each cell (row-major), the sum of the cell's
    tokens (patch (r, c) is token r * g + c) over their count; the cells' vectors one after another.
    Cell i spans patches floor(i g / G) to ceil((i + 1) g / G) - 1 (g / G each where G divides g)."""
    n, num_tokens, d = tokens.shape
    g = math.isqrt(num_tokens)
    spans = [range(math.floor(i * g / grid), math.ceil((i + 1) * g / grid)) for i in range(grid)]
    out = torch.zeros(n, grid * grid * d, dtype=torch.float64)
    for b in range(n):
        for cell_row in range(grid):
            for cell_col in range(grid):
                total = torch.zeros(d, dtype=torch.float64)
                for r in spans[cell_row]:
                    for c in spans[cell_col]:
                        total += tokens[b, r * g + c].double()
                cell = cell_row * grid + cell_col
                out[b, cell * d : (cell + 1) * d] = total / (len(spans[cell_row]) * len(spans[cell_col]))
    return out.float()


def test_grid_pooling_is_the_mean_of_each_cell():
    # a 4x4 grid of one-feature tokens numbered 0..15 row-major, in 2x2 cells of 2x2 patches:
    #    0  1 |  2  3
    #    4  5 |  6  7      top-left (0+1+4+5)/4 = 2.5, top-right (2+3+6+7)/4 = 4.5,
    #   ------+------      bottom-left (8+9+12+13)/4 = 10.5, bottom-right 12.5
    #    8  9 | 10 11
    #   12 13 | 14 15
    tokens = torch.arange(16.0).view(1, 16, 1)
    assert probe.pool_tokens(tokens, 2).tolist() == [[2.5, 4.5, 10.5, 12.5]]
    assert probe.pool_tokens(tokens, 1).tolist() == [[7.5]] and probe.pool_tokens(tokens).tolist() == [[7.5]]
    assert probe.pool_tokens(tokens, 4).tolist() == [list(range(16))]  # one patch a cell: the tokens themselves
    g = torch.Generator().manual_seed(2)
    tokens = torch.randn(3, 36, 5, generator=g)  # a 6x6 grid, 5 features a token
    for grid in (1, 2, 3, 4, 5, 6):  # 4 and 5 do not divide 6: cells overlap
        torch.testing.assert_close(probe.pool_tokens(tokens, grid), cell_means_by_loop(tokens, grid))


def test_a_grid_that_does_not_divide_the_patches_overlaps_its_cells():
    # the 4x4 grid of tokens 0..15 in 3x3 cells: cell rows (and columns) span patches 0-1, 1-2, 2-3,
    # so each cell is a 2x2 block and its mean is 2.5 + 4 * cell row + cell column
    tokens = torch.arange(16.0).view(1, 16, 1)
    assert probe.pool_tokens(tokens, 3).tolist() == [[2.5, 3.5, 4.5, 6.5, 7.5, 8.5, 10.5, 11.5, 12.5]]
    # MNIST's 14x14 patch grid in the default 4x4 cells: patches 0-3, 3-6, 7-10, 10-13, four a side
    assert pooling.cell_sides(14, 4) == "4x4 patches each, neighbours sharing a row or column"
    assert pooling.cell_sides(8, 3) == "3 to 4 patches a side"  # 0-2, 2-5, 5-7
    assert pooling.cell_sides(16, 4) == "4x4 patches each"


def test_grid_and_layer_features_are_the_forward_pass_tokens_pooled_by_hand(ckpt, monkeypatch):
    model, cfg, _ = load_model(ckpt, CPU)
    images = load_labelled_splits(cfg).images["test"][:20]  # (20, 16, 16): an 8x8 grid of 2x2 patches
    patches = patchify(images, 2).float()  # (20, 64, 4)
    seen = {}
    hooks = [model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("final", o))]
    for k in (1, 2):
        hooks.append(model.blocks[k - 1].register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(k, o)))
    with torch.no_grad():
        model(patches, torch.zeros(20, 64, dtype=torch.bool))  # nothing masked, every token computed
    for h in hooks:
        h.remove()
    monkeypatch.setattr(probe, "FEATURE_BATCH", 6)  # 4 batches, the last one short
    grid4 = probe.extract_features(model, images, 2, grid=4)
    torch.testing.assert_close(grid4, cell_means_by_loop(seen["final"], 4), rtol=0, atol=1e-5)
    assert grid4.shape == (20, 4 * 4 * 32)
    both = probe.extract_features(model, images, 2, layer=[2, 1], grid=2)  # block 2's cells, then block 1's
    expected = torch.cat([cell_means_by_loop(seen[2], 2), cell_means_by_loop(seen[1], 2)], dim=1)
    torch.testing.assert_close(both, expected, rtol=0, atol=1e-5)
    # the mean stays what it was: the plain average of the final normalised tokens
    torch.testing.assert_close(probe.extract_features(model, images, 2), seen["final"].mean(1), rtol=0, atol=1e-5)


def test_probe_pool_grid_reports_its_features_in_the_table_and_the_json(run_cli, ckpt, monkeypatch):
    monkeypatch.setattr(probe, "LBFGS_ITERS", 30)  # time: the numbers are compared, not judged
    args = ["probe", "--checkpoint", ckpt, "--device", "cpu", "--k", "5", "--pool", "grid", "--grid", "2"]
    table = run_cli(*args, "--layer", "1", "--layer", "2")
    assert table.returncode == 0, table.stderr
    features = "means of the 2x2 grid's cells (4x4 patches each) of the output tokens of blocks 1, 2"
    assert f"features: {features}, each block's concatenated (256-d)\n" in table.stdout  # 2 blocks x 4 cells x 32
    report = json.loads(run_cli(*args, "--json").stdout)
    assert (report["pool"], report["grid"], report["layer"], report["feature_dim"]) == ("grid", 2, None, 128)
    assert report["features"] == "means of the 2x2 grid's cells (4x4 patches each) of the final normalised tokens"
    # the model row: the same probes on the final normalised tokens pooled by hand
    model, cfg, _ = load_model(ckpt, CPU)
    data = load_labelled_splits(cfg)
    final = []
    hook = model.norm.register_forward_hook(lambda m, i, o: final.append(o))
    with torch.no_grad():
        for split in ("train", "val", "test"):
            patches = patchify(data.images[split], 2).float()  # (n, 64, 4)
            model(patches, torch.zeros(patches.shape[:2], dtype=torch.bool))
    hook.remove()
    feats = {split: cell_means_by_loop(t, 2) for split, t in zip(("train", "val", "test"), final, strict=True)}
    labels, classes = probe.class_indices(data.labels)
    by_hand = probe.probe_features(feats, labels, "test", 5, classes)
    assert report["results"]["model"]["knn_acc"] == by_hand["knn_acc"]
    assert report["results"]["model"]["linear_acc"] == pytest.approx(by_hand["linear_acc"], abs=2 / 64)
    default = json.loads(run_cli("probe", "--checkpoint", ckpt, "--device", "cpu", "--k", "5", "--json").stdout)
    # the default pooling is the grid's: 4x4 cells of 2x2 patches, 16 * 32 features
    assert (default["pool"], default["grid"], default["layer"], default["feature_dim"]) == ("grid", 4, None, 512)
    assert default["features"] == "means of the 4x4 grid's cells (2x2 patches each) of the final normalised tokens"
    mean = json.loads(
        run_cli("probe", "--checkpoint", ckpt, "--device", "cpu", "--k", "5", "--pool", "mean", "--json").stdout
    )
    assert (mean["pool"], mean["grid"], mean["feature_dim"]) == ("mean", None, 32)


def test_probe_bad_grid_is_one_line(run_cli, ckpt):
    res = run_cli("probe", "--checkpoint", ckpt, "--device", "cpu", "--pool", "grid", "--grid", "9")
    assert_user_error(res, "--grid 9 is not a cell count for the 8x8 patch grid", "pass 1 (the mean) to 8")


def test_probe_pool_and_layer_mistakes_are_user_errors(ckpt):
    model, cfg, _ = load_model(ckpt, CPU)
    data = load_labelled_splits(cfg)
    cases = [
        ({"pool": "grid", "grid": 0}, "--grid 0 is not a cell count for the 8x8 patch grid (16-pixel images in 2-"),
        ({"pool": "grid", "grid": 16}, "--grid 16 is not a cell count for the 8x8 patch grid"),
        ({"pool": "max"}, "unknown --pool 'max'; use mean"),
        ({"pool": "mean", "grid": 2}, "--grid 2 needs --pool grid; add --pool grid, or leave the grid out"),
        ({"layer": [1, 3]}, "--layer 3 is out of range: the model has 2 blocks"),
        ({"layer": [2, 1, 2]}, "--layer 2 is given twice; name each layer once"),
    ]
    for kwargs, message in cases:
        with pytest.raises(UserError, match=re.escape(message)):
            probe.run_probes(model, cfg, data, "test", **kwargs)
