"""The guides are tested: README.md and every guide page run in order, as written, through the harness
in tests/guides.py (its docstring says how, and the only substitutions: a small data folder at the
same path, SHORT appended to training commands, EXACT_NLL to `eval --nll` and SAMPLE_ROUNDS to
`sample`). A doc change that breaks a command fails
here. The harness itself is checked on pages written by hand."""

import re
import textwrap

import pytest

from tests import guides
from tests.conftest import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

# README.md and the guides of docs/README.md, in order; a page another branch adds is run once it exists
GUIDES = ("README.md", "docs/mnist.md", "docs/own-data.md", "docs/gpu-guide.md", "docs/classifier.md", "docs/demo.md")
NOT_YET: set[str] = set()

# Sections of reference pages that run as the guides run (the rest of those pages is not run): (page, heading)
SECTIONS = (("docs/python.md", "## Training from Python"),)

TOUR = ["train", "eval", "probe", "sample", "inpaint", "export", "finetune"]
USE = ["eval", "predict"]  # the fine-tuned classifier, after finetune


def fences(page: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block of a page, as a reader's renderer sees them."""
    return [
        (m.group(2).strip(), textwrap.dedent(m.group(3)))
        for m in re.finditer(r"^([ \t]*(?:\d+\.[ \t]+)?)```([^\n]*)\n(.*?)^[ \t]*```[ \t]*$", page, re.M | re.S)
    ]


def written(page: str):
    """The page's path; a page of NOT_YET that does not exist skips the test."""
    path = ROOT / page
    if page in NOT_YET and not path.exists():
        pytest.skip(f"{page} is not written yet")
    return path


# Over 15 s for README.md, docs/mnist.md and docs/classifier.md (about 22 s each here): each runs every
# command of its page in order, tens of them (trainings, eval --nll, probes, fine-tunings with their
# baselines, ONNX exports), already shortened to a few steps on a slice of MNIST (tests/guides.py).
@pytest.mark.parametrize("page", GUIDES)
def test_the_guide_runs_as_written(page, tmp_path, monkeypatch):
    path = written(page)
    monkeypatch.chdir(guides.make_workdir(tmp_path / "work", guides.PAGE_TEST_IMAGES.get(page, guides.TEST_IMAGES)))
    result = guides.run_page(path)
    assert result["commands"], f"{page} ran no command"
    assert len(result["skipped"]) <= guides.MAX_SKIPS, result["skipped"]


@pytest.mark.parametrize("page,heading", SECTIONS)
def test_a_reference_section_runs_as_written(page, heading, tmp_path, monkeypatch):
    text = (ROOT / page).read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    section = tmp_path / "section.md"
    section.write_text(text[start : end if end != -1 else None])
    monkeypatch.chdir(guides.make_workdir(tmp_path / "work"))
    result = guides.run_page(section)
    assert result["python"] >= 1 and result["skipped"] == []


def test_python_training_calls_get_short_appended_to_their_overrides(monkeypatch):
    from vitmask.train import run

    calls = []
    monkeypatch.setattr(run, "train", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(run, "finetune", lambda *args, **kwargs: calls.append((args, kwargs)))
    import vitmask

    with guides.short_python_training():
        vitmask.train("c.yaml", ["seed=1"], "runs/x")
        vitmask.train("c.yaml", overrides=("seed=2",), device="cpu")
        vitmask.finetune("m.pt", "c.yaml", run_dir="runs/y")
    vitmask.train("c.yaml")
    assert calls == [
        (("c.yaml", ["seed=1", *guides.SHORT], "runs/x"), {}),
        (("c.yaml",), {"overrides": ["seed=2", *guides.SHORT], "device": "cpu"}),
        (("m.pt", "c.yaml"), {"run_dir": "runs/y", "overrides": list(guides.SHORT)}),
        (("c.yaml",), {}),  # outside, as given
    ]


def test_the_readme_tour_is_train_eval_probe_sample_inpaint_export_load_finetune_then_uses_the_classifier():
    page = (ROOT / "README.md").read_text()
    tour = page[page.index("## A tour") : page.index("\n## ", page.index("## A tour") + 1)]
    verbs, loads = [], 0
    for info, body in fences(tour):
        if info == "bash":
            for line in guides.logical_lines(body):
                args = guides.vitmask_args(line)
                if args:
                    verbs.append(args[0])
                    if args[0] == "export":
                        assert "--onnx" in args, line
        elif info == "python" and "vitmask.load_pretrained(" in body:
            loads += 1
            verbs.append("load")
        elif info == "python" and "vitmask.load_classifier(" in body:
            verbs.append("load_classifier")
    order = iter(verbs)
    # in this order, others between
    assert all(v in order for v in [*TOUR[:6], "load", TOUR[6], *USE, "load_classifier"]), verbs
    assert loads == 1


@pytest.mark.parametrize("page", GUIDES)
def test_every_command_of_a_guide_is_in_a_block_the_harness_runs(page):
    """A `vitmask` line in a ```text or unlabelled fence would be shown to readers and never run."""
    for info, body in fences(written(page).read_text()):
        if info not in ("bash", "python"):
            assert not any(line.startswith(("vitmask ", "python -m vitmask")) for line in body.splitlines()), (
                page,
                info,
                body,
            )


@pytest.mark.parametrize("page", GUIDES)
def test_skip_marks_are_few_and_say_why(page):
    marks = guides.skip_marks(written(page))
    assert len(marks) <= guides.MAX_SKIPS, marks
    assert all(re.fullmatch(r'<!-- skip: next (if\(.*\), )?"[^"]+"\)? -->', m) for m in marks), marks


def test_the_index_lists_every_guide_the_suite_runs():
    index = (ROOT / "docs" / "README.md").read_text()
    guides_section = index[index.index("## Guides") : index.index("## Reference")]
    listed = {f"docs/{m}" for m in re.findall(r"\]\(([\w-]+\.md)\)", guides_section)}
    written = {page for page in GUIDES if (ROOT / page).exists()}
    assert listed | {"README.md"} == written, listed


# ---- the harness on pages written here ---------------------------------------------------------------
def test_lines_join_at_backslashes_and_drop_comments():
    block = "# a comment\nvitmask eval --checkpoint a.pt \\\n    --split test   # scored\n\nls\n"
    assert guides.logical_lines(block) == ["vitmask eval --checkpoint a.pt      --split test   # scored", "ls"]


def test_training_verbs_get_short_appended_and_other_lines_are_not_vitmasks():
    short = [a for key in guides.SHORT for a in ("--set", key)]
    assert guides.vitmask_args("vitmask train --config c.yaml --set seed=1  # note") == [
        "train",
        "--config",
        "c.yaml",
        "--set",
        "seed=1",
        *short,
    ]
    assert guides.vitmask_args("python -m vitmask finetune --checkpoint x")[-len(short) :] == short
    assert guides.vitmask_args("vitmask eval --checkpoint x") == ["eval", "--checkpoint", "x"]
    assert guides.vitmask_args("vitmask eval --checkpoint x --nll") == ["eval", "--checkpoint", "x", "--nll",
                                                                        "--nll-exact-images", "1",
                                                                        "--nll-orders", "2"]  # fmt: skip
    sample = guides.vitmask_args("vitmask sample --checkpoint x --steps 196")
    assert sample == ["sample", "--checkpoint", "x", "--steps", "196", "--steps", "16"]  # the last --steps wins
    assert guides.vitmask_args("vitmask eval --json | head -1") is None  # a pipe: bash runs it
    assert guides.vitmask_args("torchrun -m vitmask train") is None


def test_a_failing_command_fails_the_page_and_a_skip_mark_skips_one_block(tmp_path, monkeypatch):
    monkeypatch.chdir(guides.make_workdir(tmp_path / "work"))
    page = tmp_path / "page.md"
    page.write_text(
        "Write a config:\n\n```bash\nprintf 'seed: 3\\n' > c.yaml\n```\n\n"
        '<!-- skip: next "needs a cluster" -->\n\n```bash\ntorchrun --nnodes 64 -m vitmask train\n```\n\n'
        "```bash\nvitmask config --config configs/default.yaml --set seed=4\ngrep -q 'seed: 3' c.yaml\n```\n\n"
        '```python\nimport yaml\nseed = yaml.safe_load(open("c.yaml"))["seed"]\n```\n\n'
        "```python\nassert seed == 3\n```\n"
    )
    result = guides.run_page(page)
    assert result["commands"][1:] == [
        "vitmask config --config configs/default.yaml --set seed=4",
        "grep -q 'seed: 3' c.yaml",
    ]
    assert result["python"] == 2 and [why for _, why in result["skipped"]] == ["needs a cluster"]

    page.write_text(page.read_text().replace("configs/default.yaml --set seed=4", "configs/no-such.yaml"))
    with pytest.raises(guides.CommandFailed, match="no-such.yaml` exited 2"):
        guides.run_page(page)


def test_a_conditional_skip_runs_the_block_once_the_verb_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    page = tmp_path / "page.md"
    block = '<!-- skip: next if(missing("{verb}"), "needs vitmask {verb}") -->\n\n```bash\nvitmask {verb} --help\n```\n'
    page.write_text(block.format(verb="no-such-verb"))
    assert [why for _, why in guides.run_page(page)["skipped"]] == ["needs vitmask no-such-verb"]
    page.write_text(block.format(verb="config"))
    result = guides.run_page(page)
    assert result["skipped"] == [] and result["commands"] == ["vitmask config --help"]


def test_the_data_folder_is_torchvisions_layout_with_a_slice_of_mnist(tmp_path):
    work = guides.make_workdir(tmp_path / "work")
    raw = work / "data" / "mnist" / "MNIST" / "raw"
    names = sorted(p.name for p in raw.iterdir())
    stems = ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", "train-images-idx3-ubyte", "train-labels-idx1-ubyte"]
    assert names == sorted([*stems, *(s + ".gz" for s in stems)])
    assert (raw / "t10k-images-idx3-ubyte").stat().st_size == 16 + guides.TEST_IMAGES * 784
    assert (raw / "train-images-idx3-ubyte").stat().st_size == 16 + guides.TRAIN_IMAGES * 784
    assert all((work / name).resolve() == ROOT / name for name in guides.LINKED)
