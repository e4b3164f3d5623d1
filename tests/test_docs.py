"""The docs against the code: docs/configuration.md lists every config key, docs/cli.md every verb
with every option, and scripts/make_docs_images.py rewrites only the generated parts of
docs/results.md and README.md."""

import importlib.util
import re

import pytest
import torch
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


@pytest.fixture(scope="module")
def docs_built(tmp_path_factory):
    """The script run once, end to end, on a tiny checkpoint with an EMA (no training, no fine-tuning),
    over a README and a results.md with hand-written text around their generated blocks."""
    import torch

    tmp_path = tmp_path_factory.mktemp("docs-built")
    script = load_script()
    (tmp_path / "run").mkdir()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        checkpoint = train_tiny(tmp_path / "run", {"train": {"ema_decay": 0.9}})
        docs = tmp_path / "docs"
        docs.mkdir()
        start, end = script.HEADLINE_START, script.HEADLINE_END
        readme = tmp_path / "README.md"
        readme.write_text(f"# vitmask\n\nintro\n\n{start}\nSTALE\n{end}\n\nafter\n")
        results = docs / "results.md"
        results.write_text(
            f"# Results\n\nhand-written\n\n{start}\nSTALE\n{end}\n\nablations\n\n{script.MARKER}\n\nSTALE\n"
        )
        script.main(
            ["--checkpoint", str(checkpoint), "--skip-finetune", "--out-dir", str(docs), "--readme", str(readme),
             "--n", "4", "--images", "16", "--ratios", "0.5", "--device", "cpu", "--samples", "4",
             "--sample-steps", "8", "--nll-strata", "2"]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return {"root": tmp_path, "checkpoint": checkpoint, "docs": docs, "readme": readme, "results": results,
            "script": script}  # fmt: skip


def test_make_docs_images_on_a_checkpoint_writes_the_headline_tables_and_pictures(docs_built):
    """The README's and results.md's text outside the generated blocks is kept, the headline names the
    NLL bound the generated likelihood table prints, and the pictures are written."""
    script, readme, docs = docs_built["script"], docs_built["readme"], docs_built["docs"]
    start, end = script.HEADLINE_START, script.HEADLINE_END
    text = readme.read_text()
    assert text.startswith(f"# vitmask\n\nintro\n\n{start}\n") and text.endswith(f"\n{end}\n\nafter\n")
    rows = [line for line in text.splitlines() if line.startswith("| configs/")]
    assert [r.split(" | ")[1] for r in rows] == [
        "NLL bound, nats per image (bits per pixel)",
        "scattered r=0.5: acc, non-empty acc",
        "centre 16x16 box: non-empty acc, one-shot",
        "linear probe, 4x4 grid of token means",
    ]
    page = docs_built["results"].read_text()
    assert (
        page.startswith(f"# Results\n\nhand-written\n\n{start}\n") and f"{end}\n\nablations\n\n{script.MARKER}" in page
    )
    assert "| configs/mnist.yaml, raw weights |" in page and "STALE" not in page
    nll_printed = re.search(r"model \(upper bound\)\s+([\d.]+)", page).group(1)
    assert f"**{nll_printed}**" in rows[0]
    for picture in ("reconstruct.png", "samples.png", "inpaint.png", "inpaint_input.png", "inpaint_filled.png"):
        assert (docs / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", picture


def test_make_docs_images_writes_the_pictures_and_numbers(docs_built):
    """The pictures open as images, the README's new headline passes the lint of the real README (dates
    only in table rows), results.md names each evaluation once, and the example input is the
    preprocessed image itself."""
    from PIL import Image

    from vitmask.data.batches import load_splits
    from vitmask.data.preprocess import binarize_images, load_image_file
    from vitmask.store.checkpoint import load_model

    out, readme = docs_built["docs"], docs_built["readme"]
    for name in ("reconstruct.png", "inpaint.png", "inpaint_input.png", "inpaint_filled.png", "samples.png"):
        assert Image.open(out / name).size[0] > 0
    spec = importlib.util.spec_from_file_location("check_history", ROOT / "scripts" / "check_history.py")
    check_history = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_history)
    headline = readme.read_text()
    assert "\nSTALE\n" not in headline and "| recipe | metric | value |" in headline and "Measured on " in headline
    assert check_history.hits_in(docs_built["root"], readme) == []
    text = (out / "results.md").read_text()
    assert "8-neighbour table" in text and "| centre box 4,4,12,12 |" in text
    assert text.count("| random, ratio 0.5 |") == 1
    assert "NLL upper bound" in text and "mask ratio 0.5, block masks" in text
    # preprocessing the example input again changes nothing
    cfg = load_model(docs_built["checkpoint"]).config
    again = binarize_images(load_image_file(out / "inpaint_input.png").unsqueeze(0), cfg.data)[0]
    assert torch.equal(again, load_splits(cfg)["test"][0])


def test_the_printed_command_names_data_and_checkpoint_as_dir_and_ckpt_not_this_machines_paths():
    public = load_script().public_args
    assert public(["--checkpoint", "/work/x/last.pt", "--data=/srv/mnist", "--skip-finetune", "--n", "4"]) == [
        "--checkpoint", "CKPT", "--data DIR", "--skip-finetune", "--n", "4",
    ]  # fmt: skip
