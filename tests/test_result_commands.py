"""Every command published beside a figure runs as written with the current scripts and CLI: each command
of docs/results.md, docs/benchmarks.md and README.md's Results section (its tables, its code blocks,
and the commands quoted in its prose) is parsed by the parser that would run it, and nothing is run.

- `vitmask VERB ...` (also `python -m vitmask`, and after torchrun's `-m vitmask`): the typer app's
  click command for VERB parses the arguments (`make_context`, which does not invoke it);
- `python scripts/NAME.py ...`: the script runs as `__main__` with argparse's `parse_args` replaced by
  one that parses and then stops the script, so a script's own parser (whatever builds it) is the
  judge and no work starts;
- `make TARGET ARGS="..."`: TARGET must be a Makefile target, and ARGS go to the program its recipe
  runs; `bash scripts/X.sh ...`: the script must exist.

A command elided with `...` may leave out required options (and one that starts with `...` continues
the program of the command before it on the page), but every option it names must exist. Where the
parsed command names a config (`--config`, or the script's default) and `--set`s, the config is
loaded with them, so a renamed config key fails too. A removed or renamed flag or key fails here."""

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer

from tests.conftest import ROOT
from vitmask.cli import commands
from vitmask.config import load_config

PAGES = ("docs/results.md", "docs/benchmarks.md", "README.md#Results")
FENCE = re.compile(r"^\s*(```|~~~)")
PROGRAM = re.compile(
    r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:vitmask(?:\s|$)|python3? |torchrun |make |bash scripts/|\.\.\. )"
)
MAKE_PROGRAMS = {  # what each Makefile target runs, before its ARGS
    "bench": ["python", "scripts/benchmark.py", "--config", "configs/bench.yaml"],
    "speedrun": ["python", "scripts/speedrun.py", "--config", "configs/mnist.yaml"],
    "train": ["vitmask", "train", "--config", "configs/default.yaml", "--resume", "auto"],
}


@dataclass
class Command:
    page: str
    line: int
    text: str
    inline: bool = False  # quoted in prose or a table, not a code block


def page_text(page: str) -> tuple[str, str]:
    """(name, text) of a page, or of one `## ` section of it with `page#Section`."""
    name, _, section = page.partition("#")
    text = (ROOT / name).read_text()
    if section:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        text = "\n" * text[:start].count("\n") + text[start : end if end > 0 else None]  # keep line numbers
    return page, text


def commands_of(page: str) -> list[Command]:
    """The commands of a page in order: each logical line of a code block (fenced or indented) and each
    inline code span of its prose and tables that starts with a program."""
    name, text = page_text(page)
    found: list[Command] = []
    lines = text.splitlines()
    fenced, pending, pending_at = False, "", 0
    prose: list[tuple[int, str]] = []
    for number, line in enumerate(lines, start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        code = fenced or bool(pending) or (line.startswith("    ") and not line.lstrip().startswith(("-", "|", "*")))
        if code:
            stripped = line.strip()
            if pending:
                pending += " " + stripped
            elif PROGRAM.match(stripped):
                pending, pending_at = stripped, number
            if pending and pending.endswith("\\"):
                pending = pending[:-1].rstrip()
                continue
            if pending:
                found.append(Command(name, pending_at, pending.split(" # ")[0].strip()))
                pending = ""
        else:
            prose.append((number, line))
    # inline spans: a paragraph (or a table row) is joined, so a span may cross a line break
    paragraph: list[tuple[int, str]] = []
    for number, line in [*prose, (len(lines) + 1, "")]:
        if line.strip() and not line.lstrip().startswith("|"):
            paragraph.append((number, line))
            continue
        for at, joined in ([(paragraph[0][0], " ".join(t for _, t in paragraph))] if paragraph else []) + (
            [(number, line)] if line.strip() else []
        ):
            for span in re.findall(r"`([^`]+)`", joined):
                if PROGRAM.match(span.strip()):
                    found.append(Command(name, at, " ".join(span.split()), inline=True))
        paragraph = []
    return sorted(found, key=lambda c: c.line)


class Parsed(Exception):
    """Raised by the patched `parse_args` once the script's arguments are parsed."""

    def __init__(self, namespace):
        self.namespace = namespace


def parse_script(script: Path, args: list[str], elided: bool) -> dict:
    """The arguments of `script` as its own argparse parser reads them, without running the script."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        if elided:  # required options may be left out of an elided command
            for action in self._actions:
                action.required = False
        raise Parsed(original(self, args, namespace))

    argv, environ, stderr = sys.argv, dict(os.environ), io.StringIO()  # a script may set variables as it loads
    sys.argv = [str(script), *args]
    argparse.ArgumentParser.parse_args = parse_and_stop
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(script), run_name="__main__")
    except Parsed as done:
        return vars(done.namespace)
    except SystemExit as e:
        why = (stderr.getvalue().strip().splitlines() or ["exit without a message"])[-1]
        raise AssertionError(f"{script.name} refuses {shlex.join(args)}: {why}") from e
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)
    raise AssertionError(f"{script.name} ran to the end without parsing its arguments")


def parse_vitmask(args: list[str], elided: bool) -> dict:
    """The options of `vitmask ARGS` as the CLI's click command reads them, without invoking it."""
    group = typer.main.get_command(commands.app)
    if args in (["--help"], ["--version"]):  # the group's own options
        return {}
    assert args and args[0] in group.commands, f"vitmask has no verb {args[:1]}"
    command = group.commands[args[0]]
    if args[1:] == ["--help"]:  # a verb's help: the verb exists, which is all it needs
        return {}
    try:
        ctx = command.make_context(args[0], list(args[1:]), resilient_parsing=elided)
    except Exception as e:  # click's usage errors
        raise AssertionError(f"vitmask {args[0]} refuses {shlex.join(args[1:])}: {e}") from e
    params = dict(ctx.params)
    if elided:  # resilient parsing keeps going past an unknown option: name them
        known = {o for p in command.params for o in p.opts + p.secondary_opts}
        unknown = [a.split("=")[0] for a in args[1:] if a.startswith("--") and a.split("=")[0] not in known]
        assert not unknown, f"vitmask {args[0]} has no option {unknown}"
    return params


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def parse(command: Command, previous: list[str] | None) -> tuple[list[str], dict]:
    """(the program's words, the parsed options) of one command; AssertionError when it would not run."""
    words = shlex.split(command.text)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # an environment prefix
        words = words[1:]
    # elided with "...", or a mention in prose of a verb or script with nothing but its flags
    # (`vitmask pack --verify`): options may be left out, but those named must exist
    program = 3 if words[:2] in (["python", "-m"], ["python3", "-m"]) else 2
    elided = "..." in words or (command.inline and all(w.startswith("-") for w in words[program:]))
    if words[0] == "...":
        assert previous, f"{command.text} continues no command"
        words = [*previous, *words[1:]]
    words = [w for w in words if w != "..."]
    if words[0] == "torchrun":
        assert "-m" in words and words[words.index("-m") + 1] == "vitmask", command.text
        words = ["vitmask", *words[words.index("-m") + 2 :]]
    if words[0] == "make":
        target = words[1]
        assert target in makefile_targets(), f"the Makefile has no target {target}"
        extra = [w.split("=", 1)[1] for w in words[2:] if w.startswith("ARGS=")]
        for assignment in words[2:]:  # make VAR=value: a variable the Makefile reads
            name = assignment.split("=", 1)[0]
            assert re.search(rf"\$\({name}\)", (ROOT / "Makefile").read_text()), f"the Makefile reads no {name}"
        if target not in MAKE_PROGRAMS:
            assert not extra, f"make {target} passes no ARGS"
            return words[:2], {}
        words = [*MAKE_PROGRAMS[target], *(shlex.split(extra[0]) if extra else [])]
    if words[0] == "bash":
        assert (ROOT / words[1]).is_file(), f"no script {words[1]}"
        return words[:2], {}
    if words[:3] in (["python", "-m", "vitmask"], ["python3", "-m", "vitmask"]):
        words = ["vitmask", *words[3:]]
    if words[0] == "vitmask":
        return words[:2], parse_vitmask(words[1:], elided)
    if words[0] in ("python", "python3") and words[1] == "-c":  # the interpreter alone (a benchmark's reference)
        assert len(words) == 3, f"python -c takes one program: {words}"
        return words[:2], {}
    assert words[0] in ("python", "python3") and words[1].startswith("scripts/"), f"not a known program: {words}"
    script = ROOT / words[1]
    assert script.is_file(), f"no script {words[1]}"
    return words[:2], parse_script(script, words[2:], elided)


def check_config_keys(options: dict) -> None:
    """Load the command's config with its --sets: an unknown or renamed key is refused."""
    config = options.get("config")
    files = list(config) if isinstance(config, (list, tuple)) else [config] if config else []  # --config repeats
    sets = options.get("set") or options.get("overrides") or []
    if files and sets and not any(str(f).endswith(".pt") for f in files):
        load_config([ROOT / f for f in files], list(sets))


def all_commands() -> list[Command]:
    return [c for page in PAGES for c in commands_of(page)]


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: f"{c.page}:{c.line}")
def test_each_published_command_parses_with_the_current_parser_and_config_keys(command, monkeypatch):
    monkeypatch.chdir(ROOT)
    page = [c for c in all_commands() if c.page == command.page]
    before = [c for c in page if c.line < command.line or (c.line == command.line and c is not command)]
    previous = None
    for earlier in reversed(before):  # the program of the closest full command before it
        words = shlex.split(earlier.text)
        if words and words[0] != "...":
            previous = parse(earlier, None)[0]
            break
    _, options = parse(command, previous)
    check_config_keys(options)


def test_the_pages_hold_the_commands_of_their_tables_code_blocks_and_prose():
    """The extraction finds commands of every kind the pages hold (so a parse of nothing cannot pass)."""
    texts = [c.text for c in all_commands()]
    assert any(t.startswith("python scripts/compute_scaling.py") for t in texts)  # in a caption
    assert any(t.startswith("vitmask eval --checkpoint runs/mnist/last.pt --split test") for t in texts)  # a table
    assert any(t.startswith("make bench ARGS=") for t in texts)  # a fenced block
    assert any(t.startswith("python scripts/bench_corpus.py --n 50000000") for t in texts)  # an indented block
    assert any(t.startswith("OMP_NUM_THREADS=1 torchrun") for t in texts)  # an ablation row
    assert len(texts) >= 30


def test_a_removed_flag_an_unknown_verb_and_a_renamed_key_are_refused():
    """The checks on commands written here: each one that would not run is refused."""
    bad = [
        "python scripts/compute_scaling.py --config configs/mnist-gpu.yaml --in-process --out a --save-dir b",
        "python scripts/compute_scaling.py --config configs/mnist-gpu.yaml",  # --out and --save-dir required
        "vitmask eval --checkpoint x.pt --no-such-flag",
        "vitmask eval ... --no-such-flag",  # elided: required options may be left out, unknown ones not
        "vitmask no-such-verb --config c.yaml",
        "make no-such-target",
        'make bench ARGS="--no-such-flag"',
        "python scripts/no_such_script.py",
        "vitmask no-such-verb --help",  # a verb's help: the verb must exist
        "vitmask --no-such-flag",
        "python -c",  # the interpreter's reference row: one program
    ]
    for text in bad:
        with pytest.raises(AssertionError):
            parse(Command("page", 1, text), None)
    with pytest.raises(Exception, match="muon_dtyp"):
        options = parse(
            Command("page", 1, "vitmask train --config configs/mnist.yaml --set train.muon_dtyp=bf16"), None
        )
        check_config_keys(options[1])
    good = [
        "vitmask eval ... --mask-ratio 0.5",
        "vitmask --help",
        "vitmask train --help",
        'python -c "import torch"',
        "python scripts/compute_scaling.py --config configs/mnist-gpu.yaml --out a --save-dir b --multipliers 1,4",
        "OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m vitmask train ...",
        'make bench ARGS="--steps 10 --vs autocast=bf16"',
    ]
    for text in good:
        parse(Command("page", 1, text), None)
    assert parse(Command("page", 2, "... --steps 3"), ["python", "scripts/benchmark.py"])[1]["steps"] == 3


def test_the_gpu_scaling_table_names_the_settings_of_its_run():
    """The GPU compute-scaling table of results.md was measured eager, with configs/mnist-gpu.yaml as it
    ships (bf16 autocast, Newton-Schulz in fp32) at lr 0.005: its command must give exactly those."""
    page = (ROOT / "docs" / "results.md").read_text()
    section = page[page.index("### On one GPU: eager scaling, and the compiled step's fault") :]
    command = next(c for c in commands_of("docs/results.md") if c.text.startswith("python scripts/compute_scaling.py"))
    assert command.text.replace(" ", "") in " ".join(section.split()).replace(" ", "")
    _, options = parse(command, None)
    cfg = load_config(ROOT / options["config"], options["set"])
    assert options["device"] == "cuda"
    assert cfg.train.compile is False
    assert (cfg.train.precision, cfg.train.muon_dtype, cfg.train.lr) == ("bf16", "fp32", 0.005)
