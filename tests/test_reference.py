"""The reference pages are generated from the code (scripts/gen_reference.py): the committed pages are
what it writes; a stale page fails `--check`, named, with a diff; a new verb, option or config key
appears with no change to the script, as does a new public name of the Python API with its signature
and docstring; the output depends on nothing but the code; and the claims the pages once got wrong
are right."""

import dataclasses
import enum
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import typer

import vitmask
from tests.conftest import ROOT
from vitmask.cli import commands
from vitmask.config import load_config
from vitmask.train import run as run_module


def load_script():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


gen = load_script()


def docs_copy(tmp_path):
    """A copy of the repository's three reference pages in tmp_path/docs."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("cli.md", "configuration.md", "python.md"):
        shutil.copy(ROOT / "docs" / name, docs / name)
    return docs


def test_the_committed_pages_are_what_the_code_generates(capsys):
    assert gen.main(["--check"]) == 0, capsys.readouterr().out


def test_a_stale_page_fails_the_check_naming_it_with_a_diff(tmp_path, capsys):
    docs = docs_copy(tmp_path)
    page = docs / "configuration.md"
    text = page.read_text()
    assert text.count("| `train.lr` | number | `0.001` |") == 1
    page.write_text(text.replace("| `train.lr` | number | `0.001` |", "| `train.lr` | number | `0.01` |"))
    before = {p.name: p.read_bytes() for p in docs.iterdir()}
    assert gen.main(["--check", "--docs", str(docs)]) == 1
    out = capsys.readouterr().out
    assert f"{page} is stale" in out and f"{docs / 'cli.md'} is stale" not in out
    assert "-| `train.lr` | number | `0.01` |" in out and "+| `train.lr` | number | `0.001` |" in out
    assert {p.name: p.read_bytes() for p in docs.iterdir()} == before  # --check writes nothing
    assert gen.main(["--docs", str(docs)]) == 0  # without --check: rewritten ...
    assert page.read_text() == text and gen.main(["--check", "--docs", str(docs)]) == 0  # ... as committed


def test_only_the_text_between_the_markers_is_rewritten_and_a_page_without_them_is_refused(tmp_path):
    docs = docs_copy(tmp_path)
    page = docs / "cli.md"
    framing = "# Hand-written\n\nKept as it is.\n\n"
    page.write_text(f"{framing}{gen.BEGIN}\nstale text\n{gen.END}\n\nAfter, kept too.\n")
    gen.main(["--docs", str(docs)])
    text = page.read_text()
    assert text.startswith(f"{framing}{gen.BEGIN}\n\n## Synopsis\n") and text.endswith(
        f"\n{gen.END}\n\nAfter, kept too.\n"
    )
    assert "stale text" not in text
    page.write_text("# No markers\n")
    with pytest.raises(SystemExit, match="BEGIN"):
        gen.main(["--docs", str(docs)])
    assert page.read_text() == "# No markers\n"


class Fit(str, enum.Enum):
    pad = "pad"
    resize = "resize"


def app_with_a_new_verb() -> typer.Typer:
    """The CLI's own verbs and group option, plus a verb defined here."""
    app = typer.Typer(cls=commands.ParagraphHelpGroup, add_completion=False, help=commands.app.info.help)
    app.registered_commands = list(commands.app.registered_commands)
    app.registered_callback = commands.app.registered_callback

    @app.command("made-up")
    def made_up(
        fit: Fit = typer.Option(Fit.pad, "--fit", help="How images are fitted: pad | resize."),
        size: int = typer.Option(..., "--size", help="Pixels <a side>."),
        verbose: bool = typer.Option(True, "--verbose/--quiet", help="Say more."),
    ) -> None:
        """A verb added after the script was written.

        Its second paragraph."""

    return app


@pytest.mark.parametrize("check", [["--check"], []])
def test_a_docs_folder_without_the_pages_is_one_line(tmp_path, check):
    with pytest.raises(SystemExit, match=r"docs/cli\.md is not there; pass --docs the folder that holds cli\.md"):
        gen.main([*check, "--docs", str(tmp_path / "docs")])
    assert list(tmp_path.iterdir()) == []


def test_a_new_verb_and_its_options_appear_with_no_change_to_the_script():
    page = gen.cli_reference(app_with_a_new_verb())
    assert "vitmask made-up [--fit pad] --size INTEGER [--verbose | --quiet]\n" in page
    section = page.split("## `vitmask made-up`\n", 1)[1]
    assert section.startswith("\nA verb added after the script was written.\n\nIts second paragraph.\n")
    assert "| `--fit` | one of `pad`, `resize` | `pad` | How images are fitted: pad \\| resize. |" in section
    assert "| `--size` | integer | required | Pixels &lt;a side&gt;. |" in section
    assert "| `--verbose`, `--quiet` | flag | `--verbose` | Say more. |" in section
    assert all(f"## `vitmask {name}`\n" in page for name in typer.main.get_command(commands.app).commands)


def test_the_cli_page_lists_each_verbs_options_with_their_defaults_from_the_parser():
    """Every verb's table holds a row per option of the parser, with the parser's default (a hand list of a few)."""
    page = (ROOT / "docs" / "cli.md").read_text()
    group = typer.main.get_command(commands.app)
    for name, command in group.commands.items():
        section = page.split(f"## `vitmask {name}`\n", 1)[1].split("\n## ", 1)[0]
        rows = [line for line in section.splitlines() if line.startswith("| `-")]
        options = [p for p in command.params if "--help" not in p.opts]
        assert len(rows) == len(options), name
    eval_section = page.split("## `vitmask eval`\n", 1)[1].split("\n## ", 1)[0]
    for row in (
        "| `--split` | text | `val` |",
        "| `--nll-strata` | integer | `16` |",
        "| `--checkpoint` | path | required |",
    ):
        assert row in eval_section, row


@dataclasses.dataclass(frozen=True)
class MadeUpSection:
    mode: typing.Literal["fast", "exact"] = "fast"
    """How it runs: fast or exact (docs/training.md#resume)."""
    limit: int | None = None
    """At most this many; null: no limit."""


def test_a_config_key_gets_its_choices_default_and_docstring():
    docs = {
        "mode": "How it runs: fast or exact (docs/training.md#resume).",
        "limit": "At most this many; null: no limit.",
    }
    rows = gen.key_rows(MadeUpSection, "made.", docs, {"made.mode": "fast", "made.limit": None})
    assert rows[2:] == [
        "| `made.mode` | `fast` or `exact` | `fast` | How it runs: fast or exact "
        "([training.md](training.md#resume)). |",
        "| `made.limit` | integer or `null` | `null` | At most this many; null: no limit. |",
    ]


def test_the_docstrings_are_read_from_under_each_field(tmp_path):
    source = tmp_path / "module.py"
    source.write_text(
        "class A:\n    x: int = 1\n    '''The x.'''\n    y: int = 2  # a comment only\n"
        "    z: str = 'z'\n    '''The z.'''\n"
    )
    assert gen.attribute_docstrings(source) == {"A": {"x": "The x.", "z": "The z."}}


def test_a_config_key_without_a_docstring_is_refused_naming_it():
    with pytest.raises(SystemExit, match=r"made\.limit has no docstring"):
        gen.key_rows(MadeUpSection, "made.", {"mode": "How it runs."}, {"made.mode": "fast", "made.limit": None})


def test_the_output_depends_on_nothing_but_the_code():
    """The check run in fresh interpreters with another terminal width, no terminal type and another
    working directory still finds the committed pages current."""
    for env_change, cwd in (
        ({"COLUMNS": "20", "LINES": "5"}, ROOT),
        ({"TERM": "dumb", "COLUMNS": "400"}, ROOT / "src"),
    ):
        env = {**os.environ, **env_change}
        env.pop("PYTHONPATH", None)  # the script puts its own checkout's src first
        res = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "gen_reference.py"), "--check"],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stdout + res.stderr


def test_markdown_markup_in_help_is_shown_as_written():
    assert gen.markdown_text("a | b <c> G*G `x*y|z` '.\\[onnx]'") == "a \\| b &lt;c&gt; G\\*G `x*y|z` '.[onnx]'"


# ---- docs/python.md -------------------------------------------------------------------------------------


def generated_part(page: str) -> str:
    """The text between a page's markers, as merged() writes it."""
    return page.split(gen.BEGIN + "\n\n", 1)[1].split("\n" + gen.END, 1)[0]


def section(page: str, title: str) -> str:
    """The section of `### `title`` up to the next section of its level or above."""
    return page.split(f"\n### `{title}`\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]


def test_the_python_reference_in_the_page_is_what_the_docstrings_generate():
    page = (ROOT / "docs" / "python.md").read_text()
    assert page.index("\n## Training from Python\n") < page.index("\n## Reference\n") < page.index(gen.BEGIN)
    assert generated_part(page) == gen.python_reference()
    for name in vitmask.__all__:  # every public name has its section ...
        assert f"\n### `vitmask.{name}`\n" in page, name
    loader = section(page, "vitmask.load_classifier")  # ... with its signature's parameters and its docstring
    for parameter in inspect.signature(vitmask.load_classifier).parameters:
        assert f"    {parameter}: " in loader, parameter
    assert "A fine-tuning checkpoint or a classifier's export dir as an `ImageClassifier`" in loader
    training = section(page, "vitmask.train")  # the function the callable package runs, not the package's doc
    assert "    *,\n    callbacks: Iterable = (),\n    device: str | torch.device = 'auto'," in training
    assert "Train a masked-patch model; return its `TrainResult`" in training and "trainer and its step" not in training
    result = section(page, "vitmask.train.result.TrainResult")
    fields = [f.name for f in dataclasses.fields(vitmask.train.result.TrainResult)]
    assert [row.split(" | ")[0].strip("|` ") for row in result.splitlines() if row.startswith("| `")] == fields
    assert "| `best_step` | `int \\| None` | The step of that validation. |" in result
    assert "\n#### `ImageProcessor.with_fit`\n" in page and "\n#### `ImageProcessor.__call__`\n" in page
    assert " at 0x" not in page


def test_a_docstring_change_fails_the_check_naming_python_md(tmp_path, capsys, monkeypatch):
    docs = docs_copy(tmp_path)
    gen.main(["--docs", str(docs)])  # the copy as the code generates it now
    capsys.readouterr()
    page = docs / "python.md"
    before = {p.name: p.read_bytes() for p in docs.iterdir()}
    monkeypatch.setattr(run_module.train, "__doc__", "Train, as a changed docstring says.\n\n    A second paragraph.")
    assert gen.main(["--check", "--docs", str(docs)]) == 1
    out = capsys.readouterr().out
    assert f"{page} is stale" in out
    assert f"{docs / 'cli.md'} is stale" not in out and f"{docs / 'configuration.md'} is stale" not in out
    assert "+Train, as a changed docstring says." in out and "-Train a masked-patch model;" in out
    assert out.splitlines()[-1].startswith("gen_reference: python.md differ from the code")
    assert {p.name: p.read_bytes() for p in docs.iterdir()} == before  # --check writes nothing
    assert gen.main(["--docs", str(docs)]) == 0
    text = page.read_text()
    assert "Train, as a changed docstring says.\n\nA second paragraph.\n" in section(text, "vitmask.train")
    assert text.split(gen.BEGIN)[0] == before["python.md"].decode().split(gen.BEGIN)[0]  # the prose kept
    assert gen.main(["--check", "--docs", str(docs)]) == 0


class Made:
    """A class of a made-up package.

    Its second paragraph, with a list:
    - one `a|b` item,
      on two lines;
    - another.

    An example:

        made = Made(2)
        made.scaled(3)"""

    def __init__(self, size: int, *, name: str | None = None):
        self.size, self.name = size, name

    def scaled(self, factor: float = 1.0, /, unit: "Made | None" = None) -> "Made":
        """This one scaled <by> factor."""
        return self

    @classmethod
    def of(cls, sizes: Sequence[int]) -> list["Made"]:
        """One Made a size."""
        return [cls(s) for s in sizes]

    def _private(self) -> None:
        pass


def fit(paths: Sequence[str | os.PathLike] = (), on: torch.device | str = "cpu", **kw) -> Path:
    """Fit everything (docs/python.md#images)."""


def made_up_package(**extra) -> types.ModuleType:
    package = types.ModuleType("madeup", "The made-up API:\n\n- `madeup.__version__`: the version it is;\n- other.")
    package.__all__ = ["fit", "Made", "__version__", *extra]
    package.fit, package.Made, package.__version__ = fit, Made, "1.2.3"
    for name, value in extra.items():
        setattr(package, name, value)
    return package


def test_a_new_public_name_appears_with_its_signature_and_docstring():
    page = gen.python_reference(made_up_package(), more=())
    assert page == (
        "### `madeup.fit`\n\n```text\n"
        "fit(paths: Sequence[str | os.PathLike] = (), on: torch.device | str = 'cpu', **kw) -> "
        "pathlib.Path\n```\n\n"
        "Fit everything ([python.md](python.md#images)).\n\n"
        "### `madeup.Made`\n\n```text\nMade(size: int, *, name: str | None = None)\n```\n\n"
        "A class of a made-up package.\n\n"
        "Its second paragraph, with a list:\n\n"
        "- one `a|b` item, on two lines;\n- another.\n\n"
        "An example:\n\n```text\nmade = Made(2)\nmade.scaled(3)\n```\n\n"
        "#### `Made.scaled`\n\n```text\nscaled(factor: float = 1.0, /, unit: Made | None = None) -> Made\n```\n\n"
        "This one scaled &lt;by&gt; factor.\n\n"
        "#### `Made.of`\n\n```text\n@classmethod\nof(sizes: Sequence[int]) -> list[Made]\n```\n\n"
        "One Made a size.\n\n"
        "### `madeup.__version__`\n\n```text\n__version__: str\n```\n\nThe version it is.\n"
    )


def test_a_long_signature_is_one_parameter_a_line():
    def long_one(first_argument: str = "a" * 40, second_argument: str = "b" * 40, *, third: int = 3) -> None:
        """Long."""

    assert gen.signature_text("long_one", long_one) == (
        f"long_one(\n    first_argument: str = '{'a' * 40}',\n    second_argument: str = '{'b' * 40}',\n"
        "    *,\n    third: int = 3,\n) -> None"
    )


def test_a_default_with_a_memory_address_a_method_without_a_docstring_and_an_unlisted_value_are_refused():
    def with_object(marker=object()) -> None:
        """Takes a marker."""

    with pytest.raises(SystemExit, match=r"the default of madeup\.with_object's marker is written <object object at "):
        gen.python_reference(made_up_package(with_object=with_object), more=())

    class Undocumented(Made):
        def extra(self) -> None:
            pass

    Undocumented.__doc__ = "A subclass."
    with pytest.raises(SystemExit, match=r"Undocumented\.extra has no docstring"):
        gen.python_reference(made_up_package(Undocumented=Undocumented), more=())
    with pytest.raises(SystemExit, match=r"madeup\.LIMIT is no function or class .* '- `madeup\.LIMIT`: what it is'"):
        gen.python_reference(made_up_package(LIMIT=4), more=())


@dataclasses.dataclass(frozen=True)
class MadeUpResult(MadeUpSection):
    score: float = 0.0
    """How well it went."""
    seen: int = 0


def test_a_result_is_shown_by_its_own_fields_and_a_field_without_a_docstring_is_refused():
    with pytest.raises(SystemExit, match=r"the field MadeUpResult\.seen has no docstring"):
        gen.class_section("madeup.MadeUpResult", MadeUpResult, "fields")
    rows = gen.field_rows(MadeUpSection)
    assert rows[2:] == [
        "| `mode` | `Literal['fast', 'exact']` | How it runs: fast or exact ([training.md](training.md#resume)). |",
        "| `limit` | `int \\| None` | At most this many; null: no limit. |",
    ]


# ---- claims the pages once got wrong ---------------------------------------------------------------------


def test_the_run_name_default_is_the_config_files_name(tmp_path):
    (tmp_path / "my-run.yaml").write_text("seed: 1\n")
    assert load_config(tmp_path / "my-run.yaml").name == "my-run"  # what the page must say
    page = (ROOT / "docs" / "configuration.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `name` |"))
    assert row.split(" | ")[2] == "the config file's name, without its extension"


def test_idx_data_path_is_a_folder_or_one_file():
    page = (ROOT / "docs" / "configuration.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `data.path` |"))
    assert "idx: a folder of idx image files, or one such file" in row


def test_confusion_has_no_default_file():
    page = (ROOT / "docs" / "cli.md").read_text()
    assert "confusion.png" not in page
    assert "| `--confusion` | path | none |" in page


def test_the_parent_folder_rule_is_stated_once():
    page = (ROOT / "docs" / "cli.md").read_text()
    assert page.count("makes the folders") == 1 and "mkdir -p" not in page
    rule = page[: page.index(gen.BEGIN)]
    assert (
        "makes the folders\n  above it that do not exist yet, and removes the ones it made when the write fails" in rule
    )
