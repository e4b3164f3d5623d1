"""`--help` wraps each paragraph of a command's docstring at the terminal's width: on a terminal wide
enough for a whole paragraph, every paragraph is one line, in `vitmask --help`'s command list and in
each verb's own help, so no line ends in the middle of a sentence where the source's line ended."""

import inspect
import re

import pytest
import typer

from tests.conftest import run_main
from vitmask.cli import commands

WIDE = "1000"  # columns: wider than any paragraph


def verbs() -> dict[str, str]:
    """Each registered verb and its docstring, as written in the source."""
    group = typer.main.get_command(commands.app)
    return {name: inspect.getdoc(cmd.callback) for name, cmd in group.commands.items()}


def paragraphs(doc: str) -> list[str]:
    """The docstring's paragraphs (blank-line separated), each with its lines joined by one space."""
    return [re.sub(r"\s+", " ", p).strip() for p in doc.split("\n\n") if p.strip()]


def help_lines(capsys, monkeypatch, *args) -> list[str]:
    """The lines of `vitmask ARGS --help` on a WIDE terminal, box-drawing borders and padding removed."""
    monkeypatch.setenv("COLUMNS", WIDE)
    monkeypatch.delenv("TERMINAL_WIDTH", raising=False)
    code, out, _ = run_main(capsys, *args, "--help")
    assert code == 0
    return [line.strip(" │╭╮╰╯─") for line in out.splitlines()]


def test_some_docstrings_span_several_source_lines():
    """The check below means something only if docstrings are written over several lines."""
    assert sum("\n" in p for doc in verbs().values() for p in doc.split("\n\n")) >= 5


def test_the_command_list_gives_each_verbs_first_paragraph_on_one_line(capsys, monkeypatch):
    lines = help_lines(capsys, monkeypatch)
    for name, doc in verbs().items():
        first = paragraphs(doc)[0]
        rows = [line for line in lines if re.match(rf"{re.escape(name)}\s", line)]
        assert len(rows) == 1, (name, rows)
        assert rows[0][len(name) :].strip() == first, name


@pytest.mark.parametrize("verb", sorted(verbs()))
def test_each_verbs_help_gives_every_paragraph_on_one_line(capsys, monkeypatch, verb):
    lines = help_lines(capsys, monkeypatch, verb)
    for paragraph in paragraphs(verbs()[verb]):
        assert any(line.strip() == paragraph for line in lines), (verb, paragraph)
