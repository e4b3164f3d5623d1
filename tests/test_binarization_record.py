"""How images were made binary is recorded and followed (data/binarization.py): a pack's header wins
over a config file's data keys in one note line, a contradicting `--set` is refused in one line unless
`--force-preprocessing`, a classifier records what the pack said (and its training images' foreground
share), and predict, inpaint and the Python API apply it to raw files, refusing a contradicting
`--invert` / `--threshold` unless forced. Images that look inverted, or far from the training images,
are warned about in one line.

The images are drawn by hand, dark ink on white paper: 16x16, each holding exactly 64 black pixels (a
16x4 bar, a 4x16 bar or an 8x8 block) on 192 white ones. Made binary with data.invert, every image is
64/256 = 25% foreground; without it, 192/256 = 75%. Those counts are the expectations below.
"""

import csv
import json

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import vitmask
from tests.conftest import assert_user_error, write_config
from tests.guides import run_vitmask
from vitmask.data.processor import ImageProcessor
from vitmask.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

SHORT = ["train.max_steps=2", "train.eval_every=2", "train.checkpoint_every=2", "train.log_every=1"]
INK = {
    "flat": (slice(6, 10), slice(0, 16)),
    "tall": (slice(0, 16), slice(6, 10)),
    "block": (slice(4, 12), slice(4, 12)),
}
PER_CLASS = 8


def draw(kind: str, shift: int) -> np.ndarray:
    """A 16x16 gray image: white paper (255), 64 black pixels (0) in the shape of `kind`, rolled by `shift`."""
    image = np.full((16, 16), 255, np.uint8)
    image[INK[kind]] = 0
    return np.roll(image, shift, axis=1 if kind == "tall" else 0 if kind == "flat" else (0, 1))


def write_images(root, per_class: int = PER_CLASS) -> None:
    for kind in INK:
        (root / kind).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(draw(kind, i - per_class // 2)).save(root / kind / f"{i:02d}.png")


def sets(*keys: str) -> list[str]:
    return [a for key in keys for a in ("--set", key)]


def data_keys(run_dir) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())["data"]


def lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The drawings (dark on white), a config file that says nothing of how to make them binary (the
    defaults: fit pad, threshold 0.5, no invert), the pack of them made with fit center_crop and invert,
    a masked-patch model trained on the pack, and a classifier fine-tuned on it."""
    root = tmp_path_factory.mktemp("record")
    write_images(root / "drawings")
    plain = write_config(root / "plain.yaml", {"data": {"source": "folder", "path": str(root / "drawings")}})
    pack = root / "drawings.packed"
    code, _, err = run_vitmask(
        ["pack", "--config", str(plain), "--out", str(pack), *sets("data.fit=center_crop", "data.invert=true")]
    )
    assert code == 0, err
    packed = sets("data.source=packed", f"data.path={pack}")
    code, _, err = run_vitmask(
        ["train", "--config", str(plain), "--run-dir", str(root / "pre"), *packed, *sets(*SHORT)]
    )
    assert code == 0, err
    code, _, err = run_vitmask(
        ["finetune", "--checkpoint", str(root / "pre" / "last.pt"), "--config", str(plain), "--no-baselines",
         "--run-dir", str(root / "cls"), *packed, *sets(*SHORT)]
    )  # fmt: skip
    assert code == 0, err
    return {"root": root, "plain": plain, "pack": pack, "packed": packed, "pre": root / "pre" / "last.pt",
            "cls": root / "cls" / "last.pt"}  # fmt: skip


# ---- the pack's header over the config file ----------------------------------------------------------------
def test_the_pack_header_wins_over_the_config_file_in_one_note_line(made, run_cli_in_process, tmp_path):
    header = json.loads((made["pack"] / "header.json").read_text())
    assert (header["fit"], header["invert"], header["threshold"], header["height"]) == ("center_crop", True, 0.5, 16)
    res = run_cli_in_process(
        "train", "--config", made["plain"], "--run-dir", tmp_path / "run", *made["packed"], *sets(*SHORT)
    )
    assert res.returncode == 0, res.stderr
    assert lines(res.stderr) == [
        f"vitmask: note: data.fit=center_crop, data.invert=true from the pack's header ({made['pack']}), "
        f"over {made['plain']}"
    ]
    data = data_keys(tmp_path / "run")
    assert (data["fit"], data["invert"], data["threshold"], data["image_size"]) == ("center_crop", True, 0.5, 16)


def test_a_set_that_agrees_with_the_pack_passes_and_one_that_contradicts_it_is_refused(
    made, run_cli_in_process, tmp_path
):
    res = run_cli_in_process(
        "train", "--config", made["plain"], "--run-dir", tmp_path / "agrees", *made["packed"],
        *sets(*SHORT, "data.invert=true", "data.fit=center_crop"),
    )  # fmt: skip
    assert res.returncode == 0 and lines(res.stderr) == [], res.stderr
    for verb, extra in (("train", []), ("finetune", ["--checkpoint", made["pre"], "--no-baselines"])):
        run = tmp_path / f"{verb}-refused"
        res = run_cli_in_process(
            verb,
            "--config",
            made["plain"],
            "--run-dir",
            run,
            *extra,
            *made["packed"],
            *sets(*SHORT, "data.invert=false"),
        )
        assert_user_error(
            res,
            "--set data.invert=false",
            "data.invert=true",
            f"the pack's header ({made['pack']})",
            "--force-preprocessing",
        )
        assert not run.exists()
    res = run_cli_in_process(
        "train",
        "--config",
        made["plain"],
        "--run-dir",
        tmp_path / "t",
        *made["packed"],
        *sets(*SHORT, "data.threshold=0.3"),
    )
    assert_user_error(res, "--set data.threshold=0.3", "data.threshold=0.5", "--force-preprocessing")


def test_forced_the_command_line_value_is_kept_recorded_and_said_in_one_warning(made, run_cli_in_process, tmp_path):
    res = run_cli_in_process(
        "train", "--config", made["plain"], "--run-dir", tmp_path / "run", "--force-preprocessing", *made["packed"],
        *sets(*SHORT, "data.invert=false"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    note, warning = lines(res.stderr)
    assert note == f"vitmask: note: data.fit=center_crop from the pack's header ({made['pack']}), over {made['plain']}"
    assert warning.startswith("vitmask: warning: data.invert=false from --set, over the pack's header")
    assert "(data.invert=true), as --force-preprocessing asks" in warning
    assert (data_keys(tmp_path / "run")["invert"], data_keys(tmp_path / "run")["fit"]) == (False, "center_crop")


def test_the_image_size_of_a_pack_is_never_forced(made, run_cli_in_process, tmp_path):
    res = run_cli_in_process(
        "train", "--config", made["plain"], "--run-dir", tmp_path / "run", "--force-preprocessing", *made["packed"],
        *sets(*SHORT, "data.image_size=32"),
    )  # fmt: skip
    assert_user_error(res, "--set data.image_size=32", "data.image_size=16", "the images are 16x16")
    assert not (tmp_path / "run").exists()


def test_preview_of_a_pack_follows_its_header_and_refuses_a_contradicting_set(made, run_cli_in_process, tmp_path):
    res = run_cli_in_process("preview", "--config", made["plain"], "--out", tmp_path / "p.png", *made["packed"])
    assert res.returncode == 0, res.stderr
    assert lines(res.stderr) == [
        f"vitmask: note: data.fit=center_crop, data.invert=true from the pack's header ({made['pack']}), "
        f"over {made['plain']}"
    ]
    res = run_cli_in_process(
        "preview", "--config", made["plain"], "--out", tmp_path / "q.png", *made["packed"], *sets("data.invert=false")
    )
    assert_user_error(res, "--set data.invert=false", "data.invert=true")
    assert not (tmp_path / "q.png").exists()


def test_train_init_on_the_same_raw_images_follows_the_weights_and_on_other_images_the_config(
    made, run_cli_in_process, tmp_path
):
    folder = sets(f"data.path={made['root'] / 'drawings'}")
    res = run_cli_in_process(
        "train", "--config", made["plain"], "--run-dir", tmp_path / "a", *folder, *sets(*SHORT, "data.invert=true")
    )
    assert res.returncode == 0, res.stderr
    res = run_cli_in_process(
        "train", "--config", made["plain"], "--run-dir", tmp_path / "b", "--init", tmp_path / "a" / "last.pt",
        *folder, *sets(*SHORT),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    note = (
        f"vitmask: note: data.invert=true from the weights of --init {tmp_path / 'a' / 'last.pt'}, over {made['plain']}"
    )
    assert note in lines(res.stderr)
    assert data_keys(tmp_path / "b")["invert"] is True
    res = run_cli_in_process(
        "train", "--config", made["plain"], "--run-dir", tmp_path / "c", "--init", tmp_path / "a" / "last.pt",
        *folder, *sets(*SHORT, "data.invert=false"),
    )  # fmt: skip
    assert_user_error(res, "--set data.invert=false", "data.invert=true", "--force-preprocessing")
    other = tmp_path / "other"
    write_images(other, 4)
    res = run_cli_in_process(
        "train", "--config", made["plain"], "--run-dir", tmp_path / "d", "--init", tmp_path / "a" / "last.pt",
        *sets(f"data.path={other}", *SHORT, "data.invert=true"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert not any("note" in ln for ln in lines(res.stderr))  # other images: the config says how


# ---- what the classifier records, and predict on raw files ----------------------------------------------------
def test_the_classifier_and_its_export_record_the_pack_and_its_training_share(made, tmp_path):
    state = torch.load(made["cls"], weights_only=False)
    d = state["config"]["data"]
    assert (d["fit"], d["invert"], d["threshold"], d["image_size"]) == ("center_crop", True, 0.5, 16)
    assert state["foreground_share"] == 64 / 256  # every image: 64 ink pixels of 256
    out = tmp_path / "export"
    code, _, err = run_vitmask(["export", "--checkpoint", str(made["cls"]), "--out", str(out)])
    assert code == 0, err
    meta = json.loads((out / "config.json").read_text())
    assert (meta["data"]["fit"], meta["data"]["invert"], meta["data"]["threshold"]) == ("center_crop", True, 0.5)
    assert meta["training"]["foreground_share"] == 0.25
    processor = ImageProcessor.from_pretrained(out)
    assert (processor.fit, processor.invert) == ("center_crop", True)
    pixels = processor(str(made["root"] / "drawings" / "block" / "04.png")).pixels[0]
    want = torch.zeros(16, 16, dtype=torch.uint8)
    want[4:12, 4:12] = 1  # the black block is the ink
    assert torch.equal(pixels, want)
    assert vitmask.load_classifier(out).trained_foreground_share == 0.25


def test_a_damaged_foreground_share_in_an_export_is_refused(made, tmp_path, run_cli_in_process):
    out = tmp_path / "export"
    code, _, err = run_vitmask(["export", "--checkpoint", str(made["cls"]), "--out", str(out)])
    assert code == 0, err
    meta = json.loads((out / "config.json").read_text())
    meta["training"]["foreground_share"] = 1.5
    (out / "config.json").write_text(json.dumps(meta))
    res = run_cli_in_process(
        "predict", "--checkpoint", out, "--input", made["root"] / "drawings", "--out", tmp_path / "p.csv"
    )
    assert_user_error(res, "training.foreground_share", "a number in [0, 1]")
    assert not (tmp_path / "p.csv").exists()


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_predict_applies_the_record_to_raw_files_and_refuses_a_contradicting_invert_or_threshold(
    made, run_cli_in_process, tmp_path
):
    drawings = made["root"] / "drawings"
    res = run_cli_in_process("predict", "--checkpoint", made["cls"], "--input", drawings, "--out", tmp_path / "a.csv")
    assert res.returncode == 0 and lines(res.stderr) == [], res.stderr  # 25% ink, as trained: no warning
    assert len(read_csv(tmp_path / "a.csv")) == 3 * PER_CLASS
    for flags, needles in (
        (["--no-invert"], ["--no-invert", "data.invert true", "--force-preprocessing"]),
        (["--threshold", "0.3"], ["--threshold 0.3", "data.threshold 0.5", "--force-preprocessing"]),
    ):
        res = run_cli_in_process(
            "predict", "--checkpoint", made["cls"], "--input", drawings, "--out", tmp_path / "r.csv", *flags
        )
        assert_user_error(res, *needles)
        assert not (tmp_path / "r.csv").exists()
    res = run_cli_in_process(
        "predict", "--checkpoint", made["cls"], "--input", drawings, "--out", tmp_path / "b.csv", "--invert"
    )
    assert res.returncode == 0 and lines(res.stderr) == [], res.stderr  # agrees with the record
    assert {row["invert"] for row in read_csv(tmp_path / "b.csv")} == {"true"}
    res = run_cli_in_process(
        "predict", "--checkpoint", made["cls"], "--input", drawings, "--out", tmp_path / "c.csv", "--no-invert",
        "--force-preprocessing",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    (warning,) = lines(res.stderr)  # 75% foreground against 25%: one line for the whole input
    assert warning.startswith(f"vitmask: warning: the {3 * PER_CLASS} images are 75% foreground (1-pixels)")
    assert "where its training images were 25%" in warning and "--invert/--no-invert" in warning
    assert {row["invert"] for row in read_csv(tmp_path / "c.csv")} == {"false"}
    res = run_cli_in_process(
        "predict", "--checkpoint", made["cls"], "--input", made["pack"], "--out", tmp_path / "d.csv", "--invert"
    )
    assert_user_error(res, "--invert/--no-invert", "leave --invert/--no-invert out")


def test_inpaint_refuses_a_contradicting_invert_or_threshold_unless_forced(made, run_cli_in_process, tmp_path):
    image = made["root"] / "drawings" / "flat" / "00.png"
    box = ["--box", "0,0,8,8"]
    res = run_cli_in_process(
        "inpaint", "--checkpoint", made["pre"], "--image", image, "--out", tmp_path / "a.png", *box
    )
    assert res.returncode == 0, res.stderr
    for flags, needles in (
        (["--no-invert"], ["--no-invert", "data.invert true"]),
        (["--threshold", "0.9"], ["--threshold 0.9"]),
    ):
        res = run_cli_in_process(
            "inpaint", "--checkpoint", made["pre"], "--image", image, "--out", tmp_path / "r.png", *box, *flags
        )
        assert_user_error(res, *needles, "--force-preprocessing")
        assert not (tmp_path / "r.png").exists()
    res = run_cli_in_process(
        "inpaint", "--checkpoint", made["pre"], "--image", image, "--out", tmp_path / "b.png", *box, "--no-invert",
        "--force-preprocessing",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    filled = np.asarray(Image.open(tmp_path / "b.png").convert("L")) > 127  # white = foreground
    paper = draw("flat", -PER_CLASS // 2) == 255  # not inverted: the white paper is foreground
    assert (filled[8:] == paper[8:]).all() and (filled[:8, 8:] == paper[:8, 8:]).all()  # outside the box: as given


def test_the_python_api_takes_invert_and_threshold_and_refuses_contradictions(made, capsys):
    classifier = vitmask.load_classifier(made["cls"])
    files = sorted(str(p) for p in (made["root"] / "drawings").rglob("*.png"))
    top = classifier.predict(files)
    assert (top.fit, top.invert, top.threshold) == ("center_crop", True, 0.5)
    capsys.readouterr()
    with pytest.raises(UserError, match=r"invert=False contradicts .* data.invert true; .* force_preprocessing=True"):
        classifier.predict(files, invert=False)
    with pytest.raises(UserError, match=r"threshold=0.7 contradicts .* data.threshold 0.5"):
        classifier.probabilities(files, threshold=0.7)
    with pytest.raises(UserError, match="invert must be True, False or None"):
        classifier.predict(files, invert="no")
    with pytest.raises(UserError, match=r"threshold must be a number in \[0, 1\]"):
        classifier.predict(files, threshold=2, force_preprocessing=True)
    with pytest.raises(UserError, match="force_preprocessing must be True or False"):
        classifier.predict(files, force_preprocessing="yes")
    assert capsys.readouterr().err == ""
    top = classifier.predict(files, invert=False, force_preprocessing=True)
    assert top.invert is False
    (warning,) = lines(capsys.readouterr().err)  # once for the call
    assert "the 24 images are 75% foreground" in warning
    processor = ImageProcessor(16, 2, 0.5, True, "center_crop")
    paper = draw("block", 0)
    assert torch.equal(processor(paper).pixels[0], torch.from_numpy(paper == 0).to(torch.uint8))
    with pytest.raises(UserError, match="invert=False contradicts"):
        processor(paper, invert=False)
    forced = processor(paper, invert=False, threshold=0.25, force_preprocessing=True).pixels[0]
    assert torch.equal(forced, torch.from_numpy(paper >= 64).to(torch.uint8))  # 0.25 * 255 = 63.75
    masked = vitmask.load_masked_model(made["pre"])
    with pytest.raises(UserError, match="invert=False contradicts"):
        masked.features(paper, invert=False)


# ---- images that look inverted ------------------------------------------------------------------------------
def test_pack_preview_and_train_warn_when_the_images_look_inverted(made, run_cli_in_process, tmp_path):
    plain = made["plain"]
    res = run_cli_in_process("pack", "--config", plain, "--out", tmp_path / "p.packed")
    assert res.returncode == 0, res.stderr
    (warning,) = lines(res.stderr)
    assert warning.startswith("vitmask: warning: the packed images are 75% foreground (1-pixels) after binarisation")
    assert warning.endswith("pack the source again with --set data.invert=true")
    res = run_cli_in_process("preview", "--config", plain, "--out", tmp_path / "p.png")
    assert res.returncode == 0, res.stderr
    (warning,) = lines(res.stderr)
    assert warning.startswith("vitmask: warning: the training images are 75% foreground")
    assert warning.endswith("set data.invert=true")
    res = run_cli_in_process("train", "--config", plain, "--run-dir", tmp_path / "run", *sets(*SHORT))
    assert res.returncode == 0, res.stderr
    (warning,) = lines(res.stderr)
    assert (
        warning.startswith("vitmask: warning: the training images are 75% foreground") and "data.invert=true" in warning
    )
    for verb, out in (("pack", tmp_path / "q.packed"), ("preview", tmp_path / "q.png")):
        res = run_cli_in_process(verb, "--config", plain, "--out", out, *sets("data.invert=true"))
        assert res.returncode == 0 and lines(res.stderr) == [], res.stderr  # 25% foreground: silent


def test_the_shares_the_warnings_compare_are_the_hand_counts():
    from vitmask.data.binarization import foreground_share

    raw = np.stack([draw(kind, 1) for kind in INK])  # (3, 16, 16): 64 black pixels each
    assert foreground_share(torch.from_numpy(raw < 128).to(torch.uint8)) == 0.25
    assert foreground_share(torch.from_numpy(raw >= 128).to(torch.uint8)) == 0.75
