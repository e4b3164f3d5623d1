"""The docs against the code: docs/configuration.md lists every config key, and
scripts/make_docs_images.py rewrites only the generated part of docs/results.md."""

import importlib.util

from tests.conftest import ROOT
from vitmask.config import valid_keys


def load_script():
    spec = importlib.util.spec_from_file_location("make_docs_images", ROOT / "scripts" / "make_docs_images.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_configuration_page_lists_every_key():
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = [key for key in valid_keys() if f"| `{key}` |" not in page]
    assert missing == []


def test_results_page_keeps_its_hand_written_part_and_replaces_the_generated_one():
    script = load_script()
    old = f"# Results\n\nThe shipped recipes: a table.\n\n{script.MARKER}\n\nold numbers\n"
    new = script.merge_generated(old, "## Eval\n\nnew numbers\n")
    assert new == f"# Results\n\nThe shipped recipes: a table.\n\n{script.MARKER}\n\n## Eval\n\nnew numbers\n"
    # no page yet, or one without the marker: a new page with a title and the marker
    fresh = f"# Results\n\n{script.MARKER}\n\n## Eval\n"
    assert script.merge_generated(None, "## Eval\n") == fresh
    assert script.merge_generated("# Results\n\nanything\n", "## Eval\n") == fresh


def test_the_shipped_results_page_has_the_marker():
    assert load_script().MARKER in (ROOT / "docs" / "results.md").read_text()
