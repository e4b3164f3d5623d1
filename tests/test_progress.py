"""Progress of every long phase (vitmask/progress.py): the plain line's fields against a hand count on
a fake clock, a bar on a terminal, nothing when disabled; then each phase of the verbs run here with
stderr not a terminal and a line on every update (LINE_SECONDS = 0), its totals counted by hand and
its ETA present; and the line that says when `train.compile` starts compiling and how long it took.
"""

import io
import json
import re
import time

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import TINY, train_tiny, write_config
from vitmask import progress
from vitmask.config import config_from_dict
from vitmask.data.batches import load_splits
from vitmask.progress import Progress, track
from vitmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# desc: done/total unit (share%), elapsed, ETA eta, rate unit/s
LINE = re.compile(
    r"^(?P<desc>[^:]+): (?P<done>[\d,.]+[kMG]?)/(?P<total>[\d,.]+[kMG]?) (?P<unit>\S+)(?: \((?P<share>\d+)%\))?, "
    r"(?P<elapsed>[\d:]+) elapsed, ETA (?P<eta>[\d:]+|\?), (?P<rate>[\d,.]+[kMG]?) \S+/s$"
)


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture
def every_update(monkeypatch):
    """A line on every update, as a log shows one every LINE_SECONDS."""
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)


def phase_lines(err: str, desc: str) -> list[dict]:
    """The progress lines of the phase `desc` in stderr, as dicts of their fields."""
    found = [LINE.match(line) for line in err.splitlines() if line.startswith(f"{desc}: ")]
    assert found and all(found), (desc, err)
    return [m.groupdict() for m in found]


def assert_phase(err: str, desc: str, total: str, unit: str) -> list[dict]:
    """The phase reported `total` units all through, ended at total/total, and gave an ETA on every line."""
    lines = phase_lines(err, desc)
    assert {line["total"] for line in lines} == {total}, lines
    assert {line["unit"] for line in lines} == {unit}, lines
    assert lines[-1]["done"] == total and lines[-1]["eta"] == "00:00", lines[-1]
    assert all(re.fullmatch(r"\d\d:\d\d", line["eta"]) for line in lines), lines
    return lines


# ---- the helper ---------------------------------------------------------------------------------------
def test_a_line_says_done_of_total_the_share_the_time_the_eta_and_the_rate(monkeypatch, capsys):
    now = [100.0]
    monkeypatch.setattr(progress, "monotonic", lambda: now[0])
    bar = Progress(1000, "pack", "img")  # capsys's stderr is not a terminal: plain lines
    now[0] = 110.0
    bar.update(250)  # 10 s in: under LINE_SECONDS (30), no line yet
    assert capsys.readouterr().err == ""
    now[0] = 130.0
    bar.update(250)  # 30 s: 500 of 1,000 at 500 / 30 = 16.7 img/s, so the other 500 take 30 s
    now[0] = 140.0
    bar.update(250)  # 10 s after the last line: none
    now[0] = 160.0
    bar.update(250)  # 60 s: all done
    bar.close()
    assert capsys.readouterr().err.splitlines() == [
        "pack: 500/1,000 img (50%), 00:30 elapsed, ETA 00:30, 16.7 img/s",
        "pack: 1,000/1,000 img (100%), 01:00 elapsed, ETA 00:00, 16.7 img/s",
    ]


def test_a_slow_phase_gives_its_rate_to_three_digits_and_its_eta_to_the_second(monkeypatch, capsys):
    now = [0.0]
    monkeypatch.setattr(progress, "monotonic", lambda: now[0])
    bar = Progress(18, "probe fits", "fits")
    now[0] = 250.0
    bar.update(7)  # 7 fits in 250 s: 0.028 a second; the other 11 take 11 * 250 / 7 = 392.9 s
    assert capsys.readouterr().err == "probe fits: 7/18 fits (39%), 04:10 elapsed, ETA 06:33, 0.028 fits/s\n"


def test_a_phase_shorter_than_the_line_interval_and_a_disabled_one_write_nothing(capsys, monkeypatch):
    with Progress(5, "short", "img") as bar:  # over well within LINE_SECONDS
        bar.update(5)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)  # a line on every update, were it enabled
    assert list(track(range(3), "quiet", enabled=False)) == [0, 1, 2]
    Progress(5, "off", enabled=False).update(5)
    assert capsys.readouterr().err == ""


def test_track_counts_one_unit_per_item(capsys, every_update):
    assert list(track(["a", "b", "c"], "letters", "letters")) == ["a", "b", "c"]
    lines = phase_lines(capsys.readouterr().err, "letters")
    assert [(line["done"], line["total"]) for line in lines] == [("1", "3"), ("2", "3"), ("3", "3")]


def test_track_counts_an_item_once_it_is_processed_not_when_it_is_handed_out(capsys, every_update):
    """While the loop works on an item, the count says the items before it; an item the loop leaves
    unfinished (a break, an error) is never counted."""

    def done_so_far() -> list[str]:
        return [LINE.match(line)["done"] for line in capsys.readouterr().err.splitlines() if line.startswith("w: ")]

    seen = []
    for item in track(["a", "b", "c"], "w", "items"):
        seen.append((item, done_so_far()))
    assert seen == [("a", []), ("b", ["1"]), ("c", ["2"])] and done_so_far() == ["3"]
    for item in track(["a", "b", "c"], "w", "items"):
        if item == "b":
            break  # b was handed out, and never finished
    assert done_so_far() == ["1"]


def test_on_a_terminal_it_draws_a_bar_with_the_eta(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    with Progress(40, "predict", "img") as bar:
        time.sleep(0.2)  # past tqdm's shortest redraw interval (0.1 s)
        bar.update(10)
    drawn = screen.getvalue()
    assert "predict:" in drawn and "10/40" in drawn
    assert re.search(r"\[\d\d:\d\d<(\d\d:\d\d|\?)", drawn), drawn  # tqdm's [elapsed<ETA
    assert not re.search(r"ETA|elapsed", drawn)  # the bar, not the plain line


# ---- every phase ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """4 steps of the tiny model on 16x16 shapes (512 train, 64 val, 64 test images)."""
    return train_tiny(tmp_path_factory.mktemp("pre"), {"train": {"max_steps": 4, "eval_every": 4}})


def shapes_features() -> str:
    """The images a probe of the tiny shapes model extracts features of: every image of the three
    splits (the shapes' 512 + 64 + 64, less the duplicates their generator drops), twice: the model's
    and the random weights'."""
    return f"{2 * sum(map(len, load_splits(config_from_dict(TINY)).values())):,}"


def test_pack_and_its_verify_report_their_images_and_bytes(run_cli, tmp_path, every_update):
    images = np.random.default_rng(0).integers(0, 2, (100, 16, 16), dtype=np.uint8) * 255
    np.savez(tmp_path / "d.npz", images=images)
    config = write_config(
        tmp_path / "c.yaml", {"data": {**TINY["data"], "source": "npz", "path": str(tmp_path / "d.npz")}}
    )
    res = run_cli("pack", "--config", config, "--out", tmp_path / "pack")
    assert res.returncode == 0, res.stderr
    assert_phase(res.stderr, "pack", "100", "img")
    res = run_cli("pack", "--verify", tmp_path / "pack")
    assert res.returncode == 0, res.stderr
    assert_phase(res.stderr, "verify", "3.20k", "B")  # 100 rows of 16 * 16 / 8 = 32 bytes: 3,200


def test_probe_reports_its_features_and_its_fits(run_cli, pretrained, every_update):
    res = run_cli("probe", "--checkpoint", pretrained, "--split", "test", "--json")
    assert res.returncode == 0, res.stderr
    assert_phase(res.stderr, "probe features", shapes_features(), "img")
    # model, random weights, raw pixels: 5 linear fits (one per L2 strength) and a k-NN each
    assert_phase(res.stderr, "probe fits", "18", "fits")


def test_eval_nll_reports_its_batches(run_cli, pretrained, every_update):
    args = ["eval", "--checkpoint", pretrained, "--split", "test", "--nll", "--nll-strata", "16", "--nll-samples", "2"]
    res = run_cli(*args, "--json")
    assert res.returncode == 0, res.stderr
    # 256 rows a pass (64 patches x 16 classes is far under the logit budget) = 8 images x 16 strata x 2
    # draws: 64 test images in 8 passes
    assert_phase(res.stderr, "eval --nll", "8", "batch")
    assert_phase(res.stderr, "eval @ 0.5", "1", "batch")  # the scores: 64 images, one batch of 256


def test_sample_reports_its_rounds(run_cli, pretrained, tmp_path, every_update):
    res = run_cli("sample", "--checkpoint", pretrained, "--n", "4", "--steps", "8", "--out", tmp_path / "s.png")
    assert res.returncode == 0, res.stderr
    # 64 patches in 8 rounds, floor(64 cos(pi/2 t/8)) left after round t: 62 59 53 45 35 24 12 0,
    # so every round fixes some (2 3 6 8 10 11 12 12): 8 rounds for the one batch of 4
    assert_phase(res.stderr, "sample", "8", "rounds")


def test_finetune_reports_both_baselines_and_predict_its_images(run_cli, pretrained, tmp_path, every_update):
    train = {**TINY["train"], "max_steps": 4, "eval_every": 4, "checkpoint_every": 4}
    config = write_config(tmp_path / "ft.yaml", {"train": train})
    run = tmp_path / "ft"
    res = run_cli("finetune", "--checkpoint", pretrained, "--config", config, "--run-dir", run, "--json")
    assert res.returncode == 0, res.stderr
    assert_phase(res.stderr, "baseline from scratch", "4", "steps")
    assert_phase(res.stderr, "probe features", shapes_features(), "img")
    assert_phase(res.stderr, "probe fits", "18", "fits")
    assert "step 4/4" not in res.stdout.split("baseline: the same classifier")[1]  # the baseline's own lines stay off
    assert json.loads(res.stdout.splitlines()[-1])["from_scratch"] is not None

    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(5):
        Image.fromarray(np.full((16, 16), 255 * (i % 2), dtype=np.uint8)).save(folder / f"{i}.png")
    res = run_cli("predict", "--checkpoint", run / "last.pt", "--input", folder, "--out", tmp_path / "p.csv")
    assert res.returncode == 0, res.stderr
    assert_phase(res.stderr, "predict", "5", "img")


# ---- compilation ----------------------------------------------------------------------------------------
def test_compiling_the_step_is_announced_and_timed(monkeypatch, capsys):
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda net, mode=None: real(net, backend="aot_eager"))  # quick: no kernels
    # compile_check=skip: the first step goes through train_step, the method slowed here
    sets = ["train.compile=true", "train.compile_check=skip", "train.max_steps=2", "train.eval_every=2"]
    cfg = config_from_dict(TINY, sets)
    trainer = Trainer(cfg, load_splits(cfg), torch.device("cpu"))
    step = trainer.train_step
    calls = []

    def slow_first_step(batch):  # the first step takes at least 0.5 s more, as a long compilation would
        if not calls:
            time.sleep(0.5)
        calls.append(1)
        return step(batch)

    monkeypatch.setattr(trainer, "train_step", slow_first_step)
    capsys.readouterr()
    trainer.fit(None, progress=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.compile")]
    assert lines[0] == "train.compile: compiling the training step (the first step waits for it)"
    took = re.fullmatch(r"train\.compile: compiled in (\d+\.\d) s \(the first step included\)", lines[1])
    assert took and float(took.group(1)) >= 0.5, lines
    assert len(lines) == 2 and len(calls) == 2  # once, at the first step only


def test_no_compile_line_without_compile(capsys):
    cfg = config_from_dict(TINY, ["train.max_steps=1", "train.eval_every=1"])
    capsys.readouterr()
    Trainer(cfg, load_splits(cfg), torch.device("cpu")).fit(None, progress=False)
    assert "train.compile" not in capsys.readouterr().err
