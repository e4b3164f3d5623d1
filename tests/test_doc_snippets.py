"""Every Python example of README.md and docs/ works pasted alone: no block uses a name (an import, a
variable) that only an earlier block of its page defines. The guides' harness runs a page's blocks
in one namespace, in order, so it cannot see that; ruff's undefined-name check (F821) on each block
as a file of its own does."""

import re
import subprocess
import sys

from tests.conftest import ROOT

FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, int, str]]:
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for m in FENCE.finditer(text):
            found.append((page.relative_to(ROOT).as_posix(), text[: m.start()].count("\n") + 2, m.group(1)))
    return found


def undefined_names(tmp_path, snippets: list[tuple[str, int, str]]) -> list[str]:
    files = []
    for i, (_, _, code) in enumerate(snippets):
        files.append(tmp_path / f"block_{i:03d}.py")
        files[-1].write_text(code)
    res = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "F821",
         "--output-format", "concise", *map(str, files)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    wrong = []
    for line in res.stdout.splitlines():
        m = re.match(r".*block_(\d+)\.py:(\d+):\d+: F821 (.*)", line)
        if m:
            page, start, _ = snippets[int(m.group(1))]
            wrong.append(f"{page}:{start + int(m.group(2)) - 1}: {m.group(3)}")
    return wrong


def test_every_python_example_runs_pasted_alone(tmp_path):
    snippets = blocks()
    assert len(snippets) > 10  # the pages hold examples
    assert undefined_names(tmp_path, snippets) == []


def test_a_block_that_leans_on_an_earlier_one_is_named(tmp_path):
    snippets = [("docs/x.md", 10, "from pathlib import Path\n"), ("docs/x.md", 20, "import numpy as np\nPath('a')\n")]
    assert undefined_names(tmp_path, snippets) == ["docs/x.md:21: Undefined name `Path`"]
