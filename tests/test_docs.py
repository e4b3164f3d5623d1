"""The docs against the code: docs/configuration.md lists every config key, docs/cli.md every verb
with every option, and scripts/make_docs_images.py rewrites only the generated parts of
docs/results.md and README.md."""

import importlib.util
import re

import pytest
import typer

from tests.conftest import ROOT, train_tiny
from vitmask.cli import commands
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


def test_the_cli_page_gives_every_verb_with_exactly_its_options():
    page = (ROOT / "docs" / "cli.md").read_text()
    synopsis = {m.group(1): m.group(2) for m in re.finditer(r"^vitmask ([\w-]+)(.*)$", page, re.M)}
    group = typer.main.get_command(commands.app)
    assert sorted(synopsis) == sorted(group.commands)
    for name, command in group.commands.items():
        options = {o for p in command.params for o in p.opts + p.secondary_opts if o.startswith("--")} - {"--help"}
        assert set(re.findall(r"--[\w-]+", synopsis[name])) == options, name


def test_the_headline_block_is_replaced_between_its_markers_only():
    script = load_script()
    start, end = script.HEADLINE_START, script.HEADLINE_END
    page = f"# Title\n\nabove\n\n{start}\n| old | table |\n{end}\n\nbelow {start[:4]}\n"
    assert (
        script.replace_headline(page, "| new |\n")
        == f"# Title\n\nabove\n\n{start}\n| new |\n{end}\n\nbelow {start[:4]}\n"
    )
    with pytest.raises(SystemExit, match="markers"):
        script.replace_headline("# no block\n", "| new |")


def test_the_shipped_pages_have_the_headline_markers():
    for page in (ROOT / "README.md", ROOT / "docs" / "results.md"):
        text = (page).read_text()
        assert text.count(load_script().HEADLINE_START) == 1 and text.count(load_script().HEADLINE_END) == 1, page


@pytest.mark.usefixtures("one_thread")
def test_make_docs_images_on_a_checkpoint_writes_the_headline_tables_and_pictures(tmp_path):
    """The script end to end on a tiny checkpoint with an EMA (no training, no fine-tuning): the
    README's and results.md's text outside the generated blocks is kept, the headline names the NLL
    bound the generated likelihood table prints, and the pictures are written."""
    script = load_script()
    (tmp_path / "run").mkdir()
    checkpoint = train_tiny(tmp_path / "run", {"train": {"ema_decay": 0.9}})
    docs = tmp_path / "docs"
    docs.mkdir()
    start, end = script.HEADLINE_START, script.HEADLINE_END
    readme = tmp_path / "README.md"
    readme.write_text(f"# vitmask\n\nintro\n\n{start}\nSTALE\n{end}\n\nafter\n")
    results = docs / "results.md"
    results.write_text(f"# Results\n\nhand-written\n\n{start}\nSTALE\n{end}\n\nablations\n\n{script.MARKER}\n\nSTALE\n")
    script.main(
        ["--checkpoint", str(checkpoint), "--skip-finetune", "--out-dir", str(docs), "--readme", str(readme),
         "--n", "4", "--images", "16", "--samples", "4", "--sample-steps", "8", "--nll-strata", "2"]
    )  # fmt: skip
    text = readme.read_text()
    assert text.startswith(f"# vitmask\n\nintro\n\n{start}\n") and text.endswith(f"\n{end}\n\nafter\n")
    rows = [line for line in text.splitlines() if line.startswith("| configs/")]
    assert [r.split(" | ")[1] for r in rows] == [
        "NLL bound, nats per image (bits per pixel)",
        "scattered r=0.5: acc, non-empty acc",
        "centre 16x16 box: non-empty acc, one-shot",
        "linear probe, 4x4 grid of token means",
    ]
    page = results.read_text()
    assert (
        page.startswith(f"# Results\n\nhand-written\n\n{start}\n") and f"{end}\n\nablations\n\n{script.MARKER}" in page
    )
    assert "| configs/mnist.yaml, raw weights |" in page and "STALE" not in page
    nll_printed = re.search(r"model \(upper bound\)\s+([\d.]+)", page).group(1)
    assert f"**{nll_printed}**" in rows[0]
    for picture in ("reconstruct.png", "samples.png", "inpaint.png", "inpaint_input.png", "inpaint_filled.png"):
        assert (docs / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", picture


def test_the_printed_command_names_data_and_checkpoint_as_dir_and_ckpt_not_this_machines_paths():
    public = load_script().public_args
    assert public(["--checkpoint", "/work/x/last.pt", "--data=/srv/mnist", "--skip-finetune", "--n", "4"]) == [
        "--checkpoint", "CKPT", "--data DIR", "--skip-finetune", "--n", "4",
    ]  # fmt: skip
