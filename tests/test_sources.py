"""Every source read from tiny files the test writes itself (PNGs, idx, npz, a torchvision root),
the real MNIST test set through the idx source, split determinism, and every bad input."""

import gzip
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import MNIST_DIR, TINY, assert_user_error
from vitmask.cli.commands import main
from vitmask.config import DataConfig, config_from_dict
from vitmask.data.batches import load_splits
from vitmask.data.preprocess import binarize_list, to_gray_uint8
from vitmask.data.sources import split_fractions
from vitmask.errors import UserError


def cfg_for(source: str, path, **data):
    return config_from_dict({**TINY, "data": {**TINY["data"], "source": source, "path": str(path), **data}})


def run_inproc(capsys, *args):
    """The CLI's main() in this process (no interpreter start-up): exit code, stdout, stderr."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=e.value.code, stdout=out.out, stderr=out.err)


def preview_args(tmp_path, source, path, *sets):
    """`preview` of the given source, with extra --set overrides, writing tmp_path/p.png."""
    args = ["preview", "--out", tmp_path / "p.png"]
    for s in (f"data.source={source}", f"data.path={path}", *sets):
        args += ["--set", s]
    return args


@pytest.fixture
def tiny_cfg_file(tmp_path):
    from tests.conftest import write_config

    return write_config(tmp_path / "tiny.yaml")


def write_idx(path: Path, images: np.ndarray) -> None:
    """MNIST idx format: magic 0x00000803 (ubyte, 3 dims), the dims big-endian, then the pixels."""
    raw = struct.pack(">IIII", 0x803, *images.shape) + images.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def write_labels(path: Path, n: int) -> None:
    path.write_bytes(struct.pack(">II", 0x801, n) + bytes(n))


def numbered_images(n: int, side: int = 4) -> np.ndarray:
    """(n, side, side) uint8 0/255 images whose pixels spell out their index in binary: all distinct."""
    bits = (np.arange(n)[:, None] >> np.arange(side * side)[None, ::-1]) & 1
    return (bits * 255).astype(np.uint8).reshape(n, side, side)


# ---- idx ------------------------------------------------------------------------------------------
def test_idx_gz_and_plain_files_with_their_own_train_test_split(tmp_path):
    train, test = numbered_images(40), numbered_images(60)[40:]
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", train)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", test)
    s = load_splits(cfg_for("idx", tmp_path, image_size=4, fit="none"))
    assert (len(s["train"]), len(s["val"]), len(s["test"])) == (36, 4, 20)  # val: 10% of train
    assert torch.equal(s["test"], torch.from_numpy(test // 255))  # the source's own test split, in order
    pool = {tuple(x.flatten().tolist()) for x in torch.from_numpy(train // 255)}
    assert {tuple(x.flatten().tolist()) for x in torch.cat([s["train"], s["val"]])} == pool


@pytest.mark.parametrize("test_name", ["test-images-idx3-ubyte", "emnist-digits-test-images-idx3-ubyte.gz"])
def test_idx_files_named_test_are_the_test_split(tmp_path, test_name):
    write_idx(tmp_path / "emnist-digits-train-images-idx3-ubyte", numbered_images(20))
    write_idx(tmp_path / test_name, numbered_images(26)[20:])
    s = load_splits(cfg_for("idx", tmp_path, image_size=4, fit="none"))
    assert torch.equal(s["test"], torch.from_numpy(numbered_images(26)[20:] // 255))
    assert len(s["train"]) + len(s["val"]) == 20


@pytest.mark.skipif(not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file(), reason="needs ../shared/data/mnist")
def test_real_mnist_test_set_through_idx_is_split_8000_1000_1000_and_binarized():
    s = load_splits(config_from_dict({"data": {"source": "idx", "path": str(MNIST_DIR)}}))
    assert {k: tuple(v.shape) for k, v in s.items()} == {
        "train": (8000, 32, 32),
        "val": (1000, 32, 32),
        "test": (1000, 32, 32),
    }
    assert all(v.dtype == torch.uint8 and set(v.unique().tolist()) == {0, 1} for v in s.values())
    # independent reference: the raw file's pixels >= 128 (threshold 0.5); padding adds only zeros
    with gzip.open(MNIST_DIR / "t10k-images-idx3-ubyte.gz") as f:
        raw = np.frombuffer(f.read(), dtype=np.uint8, offset=16)
    assert sum(int(v.sum()) for v in s.values()) == int((raw >= 128).sum())
    assert s["train"][:, :2].sum() == 0 and s["train"][:, :, -2:].sum() == 0  # the 2-pixel pad border


# ---- folder ---------------------------------------------------------------------------------------
def test_folder_reads_png_jpeg_bmp_of_mixed_sizes_recursively(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    square = np.zeros((8, 8), np.uint8)
    square[2:6, 2:6] = 255
    for i in range(8):
        Image.fromarray(np.roll(square, i, axis=1)).save(tmp_path / "a" / f"s{i}.png")
    Image.fromarray(np.full((6, 10, 3), 255, np.uint8)).save(tmp_path / "a" / "b" / "white.bmp")  # RGB, 6x10
    Image.fromarray(np.zeros((12, 12), np.uint8)).save(tmp_path / "black.jpg")
    s = load_splits(cfg_for("folder", tmp_path, image_size=8, patch_size=2))
    images = torch.cat(list(s.values()))
    assert images.shape == (10, 8, 8) and images.dtype == torch.uint8
    # white 6x10 padded/cropped to 8x8: rows 1..6 white; black jpg: empty; the squares: 16 pixels each
    assert sorted(int(x.sum()) for x in images) == [0] + [16] * 8 + [48]


def test_folder_with_train_and_test_subfolders_keeps_that_split(tmp_path):
    for split, n in (("train", 10), ("test", 3)):
        (tmp_path / split).mkdir()
        for i in range(n):
            Image.fromarray(numbered_images(16)[i + (split == "test") * 10]).save(tmp_path / split / f"{i}.png")
    s = load_splits(cfg_for("folder", tmp_path, image_size=4, fit="none"))
    assert (len(s["train"]), len(s["val"]), len(s["test"])) == (9, 1, 3)
    assert torch.equal(s["test"], torch.from_numpy(numbered_images(16)[10:13] // 255))


def test_folder_with_a_val_subfolder_keeps_all_three(tmp_path):
    for split, first, n in (("train", 0, 6), ("val", 6, 2), ("test", 8, 3)):
        (tmp_path / split).mkdir()
        for i in range(n):
            Image.fromarray(numbered_images(16)[first + i]).save(tmp_path / split / f"{i}.png")
    s = load_splits(cfg_for("folder", tmp_path, image_size=4, fit="none"))
    for split, first, n in (("train", 0, 6), ("val", 6, 2), ("test", 8, 3)):  # as given, in file order
        assert torch.equal(s[split], torch.from_numpy(numbered_images(16)[first : first + n] // 255)), split


def test_corrupt_files_are_skipped_and_counted_or_fail_when_asked(tmp_path, capsys, tiny_cfg_file):
    for i in range(6):
        Image.fromarray(numbered_images(8)[i]).save(tmp_path / f"{i}.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "empty.jpg").write_bytes(b"")
    s = load_splits(cfg_for("folder", tmp_path, image_size=4, fit="none", val_fraction=0.2, test_fraction=0.2))
    assert sum(len(v) for v in s.values()) == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skipped 2 of 8 image files" in err[0]
    res = run_inproc(capsys, *preview_args(tmp_path, "folder", tmp_path, "data.bad_files=fail"), "-c", tiny_cfg_file)
    assert_user_error(res, "not a readable image", "data.bad_files=skip")
    assert not (tmp_path / "p.png").exists()


# ---- npz ------------------------------------------------------------------------------------------
def test_npz_array_of_01_ints_floats_and_rgb(tmp_path):
    imgs = numbered_images(30) // 255  # 0/1 uint8
    np.savez(
        tmp_path / "d.npz", images=imgs, floats=imgs.astype(np.float32), rgb=np.repeat(imgs[..., None] * 255, 3, -1)
    )
    for key in ("images", "floats", "rgb"):
        s = load_splits(cfg_for("npz", tmp_path / "d.npz", npz_key=key, image_size=4, fit="none"))
        got = {tuple(x.flatten().tolist()) for x in torch.cat(list(s.values()))}
        assert got == {tuple(x.flatten().tolist()) for x in imgs}, key


def test_to_gray_uint8_matches_pil_luma_and_rejects_out_of_range():
    rgb = np.random.default_rng(0).integers(0, 256, (2, 5, 7, 3), dtype=np.uint8)
    ref = np.stack([np.asarray(Image.fromarray(x).convert("L")) for x in rgb])  # PIL's own conversion
    assert np.abs(to_gray_uint8(rgb, "x").numpy().astype(int) - ref).max() <= 1
    assert to_gray_uint8(np.array([[[True, False]]]), "x").tolist() == [[[255, 0]]]
    with pytest.raises(UserError, match="floats in"):
        to_gray_uint8(np.full((1, 2, 2), 3.0), "x")
    with pytest.raises(UserError, match=r"shape \(2, 2\)"):
        to_gray_uint8(np.zeros((2, 2)), "x")


def test_binarize_list_keeps_order_across_sizes():
    cfg = DataConfig(image_size=4, fit="pad")
    imgs = [
        torch.full((2, 2), 255, dtype=torch.uint8),
        torch.zeros(4, 4, dtype=torch.uint8),
        torch.full((2, 2), 0, dtype=torch.uint8),
    ]
    out = binarize_list(imgs, cfg)
    assert out.shape == (3, 4, 4) and [int(x.sum()) for x in out] == [4, 0, 0]


# ---- splits ---------------------------------------------------------------------------------------
def test_same_seed_same_split_other_seed_other_split(tmp_path):
    np.savez(tmp_path / "d.npz", images=numbered_images(100))
    a, b = (load_splits(cfg_for("npz", tmp_path / "d.npz", image_size=4, fit="none")) for _ in range(2))
    c = load_splits(
        config_from_dict(
            {
                **TINY,
                "seed": 1,
                "data": {"source": "npz", "path": str(tmp_path / "d.npz"), "image_size": 4, "fit": "none"},
            }
        )
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["test"], c["test"])
    assert [len(a[k]) for k in ("train", "val", "test")] == [80, 10, 10]
    flat = [{tuple(x.flatten().tolist()) for x in a[k]} for k in a]
    assert len(flat[0] | flat[1] | flat[2]) == 100  # disjoint, and nothing lost
    assert [len(x) for x in split_fractions(10, (0.1, 0.25), 3)] == [1, 2, 7]


def test_split_seed_keeps_the_split_while_seed_changes(tmp_path):
    np.savez(tmp_path / "d.npz", images=numbered_images(100))

    def splits(**top):
        data = {"source": "npz", "path": str(tmp_path / "d.npz"), "image_size": 4, "fit": "none"}
        data |= top.pop("data", {})
        return load_splits(config_from_dict({**TINY, **top, "data": data}))

    seed0 = splits(seed=0)
    pinned = splits(seed=1, data={"split_seed": 0})  # another training seed, the same images in each split
    assert all(torch.equal(seed0[k], pinned[k]) for k in seed0)
    moved = splits(seed=0, data={"split_seed": 1})  # the split follows split_seed, not seed
    assert torch.equal(moved["test"], splits(seed=1)["test"]) and not torch.equal(moved["test"], seed0["test"])


def test_split_sizes_round_each_fraction():
    # round(f * n) for each fraction, at least 1: 1.6 -> 2, 2.7 -> 3, 0.04 -> 1; the rest trains
    assert [len(x) for x in split_fractions(10, (0.16, 0.27), 0)] == [2, 3, 5]
    assert [len(x) for x in split_fractions(10, (0.004, 0.35), 0)] == [1, 4, 5]  # 3.5 rounds to the even 4
    parts = split_fractions(10, (0.16, 0.27), 0)
    assert sorted(torch.cat(parts).tolist()) == list(range(10))  # disjoint, nothing lost


def test_val_and_test_fractions_that_differ_give_their_own_split_sizes(tmp_path):
    # 100 images without a split of their own: test = round(0.3 * 100), val = round(0.1 * 100), train the rest
    images = numbered_images(100)
    np.savez(tmp_path / "d.npz", images=images)
    s = load_splits(cfg_for("npz", tmp_path / "d.npz", image_size=4, fit="none", test_fraction=0.3, val_fraction=0.1))
    assert {k: len(v) for k, v in s.items()} == {"train": 60, "val": 10, "test": 30}
    as_sets = {k: {tuple(x.flatten().tolist()) for x in v} for k, v in s.items()}
    assert set.union(*as_sets.values()) == {tuple(x.flatten().tolist()) for x in images // 255}  # disjoint, all kept
    # a source with its own test split: val = round(0.25 * 40) of train; data.test_fraction plays no part
    write_idx(tmp_path / "train-images-idx3-ubyte", numbered_images(40))
    write_idx(tmp_path / "t10k-images-idx3-ubyte", numbered_images(50)[40:])
    own = load_splits(cfg_for("idx", tmp_path, image_size=4, fit="none", test_fraction=0.3, val_fraction=0.25))
    assert {k: len(v) for k, v in own.items()} == {"train": 30, "val": 10, "test": 10}


# ---- torchvision (never downloads) ----------------------------------------------------------------
def test_torchvision_mnist_and_emnist_from_files_on_disk(tmp_path):
    for name in ("MNIST", "FashionMNIST", "KMNIST"):  # the same idx files under <root>/<name>/raw
        raw = tmp_path / name / "raw"
        raw.mkdir(parents=True)
        for prefix, n in (("train", 20), ("t10k", 5)):
            write_idx(raw / f"{prefix}-images-idx3-ubyte", numbered_images(n, 4))
            write_labels(raw / f"{prefix}-labels-idx1-ubyte", n)
        s = load_splits(cfg_for("torchvision", tmp_path, name=name, image_size=4, fit="none"))
        assert [len(s[k]) for k in ("train", "val", "test")] == [18, 2, 5], name
        assert torch.equal(s["test"], torch.from_numpy(numbered_images(5) // 255)), name
    raw = tmp_path / "EMNIST" / "raw"
    raw.mkdir(parents=True)
    for part, n in (("train", 20), ("test", 5)):
        write_idx(raw / f"emnist-letters-{part}-images-idx3-ubyte", numbered_images(n, 4))
        write_labels(raw / f"emnist-letters-{part}-labels-idx1-ubyte", n)
    s = load_splits(cfg_for("torchvision", tmp_path, name="EMNIST", emnist_split="letters", image_size=4, fit="none"))
    assert torch.equal(s["test"], torch.from_numpy(numbered_images(5) // 255).transpose(1, 2))  # stored transposed


# ---- bad input: one line, exit 2 ------------------------------------------------------------------
@pytest.mark.parametrize(
    "case,needles",
    [
        ("missing", ("does not exist", "data.path")),
        ("empty", ("no PNG, JPEG or BMP files",)),
        ("unreadable", ("none of the 2 image files", "could be read")),
        ("npz_key", ("has no array 'imgs'", "did you mean 'images'", "data.npz_key")),
        ("too_small", ("data.fit is none", "set data.fit")),
        ("tv_name", ("data.name must be one of", "FashionMNIST")),
        ("tv_no_download", ("not found under", "data.download=true")),
        ("idx_corrupt", ("not a readable idx image file",)),
        ("too_few", ("only 2 images", "data.val_fraction")),
    ],
)
def test_bad_data_input_is_one_line_and_exit_2(case, needles, tmp_path, capsys, tiny_cfg_file):
    d = tmp_path / "d"
    d.mkdir()
    sets: tuple = ()
    source, path = "folder", d
    if case == "missing":
        path = tmp_path / "nope"
    elif case == "unreadable":
        (d / "a.png").write_text("x")
        (d / "b.bmp").write_bytes(b"BM")
    elif case == "npz_key":
        np.savez(d / "x.npz", images=np.zeros((4, 4, 4), np.uint8))
        source, path, sets = "npz", d / "x.npz", ("data.npz_key=imgs",)
    elif case == "too_small":
        np.savez(d / "x.npz", images=np.zeros((9, 8, 8), np.uint8))
        source, path, sets = "npz", d / "x.npz", ("data.fit=none",)
    elif case == "tv_name":
        source, sets = "torchvision", ("data.name=MNSIT",)
    elif case == "tv_no_download":
        source, sets = "torchvision", ("data.download=false",)
    elif case == "idx_corrupt":
        (d / "t10k-images-idx3-ubyte.gz").write_bytes(b"not gzip")
        source = "idx"
    elif case == "too_few":
        for i in range(2):
            Image.fromarray(numbered_images(2)[i]).save(d / f"{i}.png")
    res = run_inproc(capsys, *preview_args(tmp_path, source, path, *sets), "-c", tiny_cfg_file)
    assert_user_error(res, *needles)
    assert not (tmp_path / "p.png").exists()
