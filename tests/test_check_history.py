"""scripts/check_history.py and scripts/check_links.py on small trees. A planted history word is
reported as `path:line: text` with exit code 1, a clean tree passes with exit code 0, and dates pass
only where they are data. A broken link or anchor is reported, links that resolve pass.

The planted words are built from pieces, so that this file does not itself hold them."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "check_history.py"


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60, check=False
    )


def clean_tree(root: Path) -> Path:
    """A tiny repository whose files speak of the product only (and use TensorBoard's own term)."""
    (root / "docs").mkdir()
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "configs").mkdir()
    (root / "README.md").write_text("# demo\n\nTrain, then look at the hparams session in TensorBoard.\n")
    (root / "docs" / "guide.md").write_text("# Guide\n\nPatches are read row-major.\n")
    (root / "configs" / "a.yaml").write_text("# a recipe\nseed: 0\n")
    (root / "src" / "pkg" / "mod.py").write_text('"""A module."""\n\nX = 1  # the seed is 0\n')
    (root / "Makefile").write_text("lint:\n\ttrue\n")
    return root


def test_a_clean_tree_passes(tmp_path):
    res = check(clean_tree(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == ""


def test_each_planted_word_is_reported_with_its_path_and_line(tmp_path):
    root = clean_tree(tmp_path)
    session = "sess" + "ion 12"
    issue = "iss" + "ue #7"
    note = "se" + "ed 004"
    (root / "docs" / "guide.md").write_text(f"# Guide\n\nPatches are read row-major.\nAs in {session}.\n")
    (root / "src" / "pkg" / "mod.py").write_text(f'"""A module."""\n\nX = 1  # see {issue}\n')
    (root / "configs" / "a.yaml").write_text(f"# the model of {note}\nseed: 0\n")
    res = check(root)
    assert res.returncode == 1
    assert res.stdout.splitlines() == [
        f"configs/a.yaml:1: # the model of {note}",
        f"docs/guide.md:4: As in {session}.",
        f"src/pkg/mod.py:3: X = 1  # see {issue}",
    ]


def test_a_lab_notebooks_phrasing_is_reported_and_plain_words_pass(tmp_path):
    root = clean_tree(tmp_path)
    planted = [
        "The batches run over the 200,000 images/s ai" + "med at.",
        "**The 0.60 tar" + "get is not met in 10 minutes.**",
        "the 20 s tar" + "get for 0.60 is missed",
        "## Corr" + "ections to the source notes",
        "Ne" + "xt steps: a larger batch.",
        "What w" + "as tried: three learning rates.",
    ]
    plain = [
        "The benchmark's target model has width 128.",  # a target as a thing, not a goal
        "The aim of the probe is a linear read-out.",
        "The next step reads the batch; the next 256 batches are one block.",
        "Each run is tried once per seed.",
    ]
    (root / "docs" / "results.md").write_text("# Results\n\n" + "\n".join(planted + plain) + "\n")
    res = check(root)
    assert res.returncode == 1
    assert res.stdout.splitlines() == [f"docs/results.md:{3 + i}: {line}" for i, line in enumerate(planted)]


def test_dates_pass_only_in_the_result_pages_and_readme_table_rows(tmp_path):
    root = clean_tree(tmp_path)
    date = "2026" + "-11-25"
    (root / "docs" / "results.md").write_text(f"| run | {date} |\nMeasured on {date}.\n")
    (root / "README.md").write_text(f"# demo\n\n| run | date |\n|---|---|\n| a | {date} |\n")
    assert check(root).returncode == 0
    (root / "README.md").write_text(f"# demo\n\nTrained on {date}.\n")
    res = check(root)
    assert res.returncode == 1
    assert res.stdout.splitlines() == [f"README.md:3: Trained on {date}."]


def test_dates_pass_in_the_contributing_pages_table_rows_only(tmp_path):
    root = clean_tree(tmp_path)
    date = "2026" + "-11-28"
    page = root / "docs" / "contributing.md"
    page.write_text(f"# suite\n\n| how | time |\n|---|---|\n| two workers ({date}) | 332 s |\n")
    assert check(root).returncode == 0
    page.write_text(f"# suite\n\nMeasured on {date}.\n")
    assert check(root).stdout.splitlines() == [f"docs/contributing.md:3: Measured on {date}."]


def test_the_script_does_not_flag_its_own_patterns():
    lines = [line for line in check(ROOT).stdout.splitlines() if line.startswith("scripts/check_history.py:")]
    assert lines == []


LINKS = ROOT / "scripts" / "check_links.py"


def test_links_that_resolve_pass_and_broken_ones_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "pic.png").write_bytes(b"")
    (tmp_path / "docs" / "guide.md").write_text(
        "# Guide\n\n## Bit order (`patches`)\n\nBack to [the top](../README.md).\n"
    )
    readme = tmp_path / "README.md"
    readme.write_text(
        "# demo\n\n![a picture](docs/pic.png) [order](docs/guide.md#bit-order-patches) [web](https://x.org/a)\n"
        "```\n[not a link](missing.md)\n```\n"
    )
    run = [sys.executable, str(LINKS), str(tmp_path)]
    res = subprocess.run(run, capture_output=True, text=True, timeout=60, check=False)
    assert (res.returncode, res.stdout) == (0, "")
    readme.write_text("# demo\n\n[gone](docs/gone.md)\n\n[order](docs/guide.md#bit-order)\n")
    res = subprocess.run(run, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 1
    assert res.stdout.splitlines() == [
        "README.md:3: docs/gone.md (no such file)",
        "README.md:5: docs/guide.md#bit-order (no heading with that anchor)",
    ]


def test_a_docs_page_the_index_does_not_link_is_reported(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for page in ("guide.md", "reference.md", "orphan.md"):
        (docs / page).write_text(f"# {page}\n")
    (docs / "README.md").write_text(
        "# Documentation\n\n| page | what |\n|---|---|\n| [guide.md](guide.md) | a guide |\n\n"
        "See [the reference](reference.md#referencemd).\n```\n[in code, not a link](orphan.md)\n```\n"
    )
    (tmp_path / "README.md").write_text("# demo\n\n[the orphan, from elsewhere](docs/orphan.md)\n")
    run = [sys.executable, str(LINKS), str(tmp_path)]
    res = subprocess.run(run, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 1
    assert res.stdout.splitlines() == [
        "docs/orphan.md: not linked from docs/README.md (add it to the section of its kind)"
    ]
    (docs / "README.md").write_text((docs / "README.md").read_text() + "\nAnd [the orphan](./orphan.md).\n")
    res = subprocess.run(run, capture_output=True, text=True, timeout=60, check=False)
    assert (res.returncode, res.stdout) == (0, "")


def test_every_page_of_docs_is_linked_from_the_index():
    res = subprocess.run(
        [sys.executable, str(LINKS), str(ROOT)], capture_output=True, text=True, timeout=60, check=False
    )
    assert "not linked from docs/README.md" not in res.stdout, res.stdout
