"""The docs' references to the code exist: every module docs/architecture.md names is a file of
src/vitmask and every module there is named, with the functions it says a module holds; every test
docs/promises.md names is a test function of that file, and every module a promise is kept by exists;
every package's docstring names each of its modules."""

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vitmask"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PROMISES = ROOT / "docs" / "promises.md"

MODULE = re.compile(r"`((?:\w+/)*\w+\.py)`")  # `cli/verbs.py`, `config.py`
MODULE_WITH_NAMES = re.compile(r"`((?:\w+/)*\w+\.py)` \(([^)]*)\)")  # `store/rundir.py` (`resolve`, `RunDir`)
TEST_REF = re.compile(r"(tests/\w+\.py)(?:::(\w+))?")


def modules() -> list[str]:
    """Every module of the package but the packages' own __init__.py, as a path under src/vitmask."""
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def top_level_names(file: Path) -> set[str]:
    """The names a module defines or imports at its top level."""
    names = set()
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                names |= {e.id for e in elts if isinstance(e, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def methods(file: Path) -> set[str]:
    """The methods of a module's classes."""
    tree = ast.parse(file.read_text())
    return {n.name for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body if isinstance(n, ast.FunctionDef)}


@functools.cache  # hundreds of references name the same few files: each is parsed once
def functions_of_tests(file: Path) -> frozenset[str]:
    return frozenset(n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef))


def where(path: str) -> Path | None:
    """A module path as the docs write it: under src/vitmask, or from the repository's root."""
    for base in (PACKAGE, ROOT):
        if (base / path).is_file():
            return base / path
    return None


def test_every_module_architecture_names_exists():
    named = set(MODULE.findall(ARCHITECTURE.read_text()))
    bare = {p.name for p in PACKAGE.rglob("*.py")}
    missing = [m for m in sorted(named) if where(m) is None and not ("/" not in m and m in bare)]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_architecture_names_every_module_of_the_package():
    text = ARCHITECTURE.read_text()
    unnamed = [m for m in modules() if f"`{m}`" not in text]
    assert not unnamed, f"docs/architecture.md does not name these modules of src/vitmask: {unnamed}"


def test_architecture_names_every_package():
    text = ARCHITECTURE.read_text()
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    unnamed = [p for p in packages if f"`{p}/`" not in text]
    assert not unnamed, f"docs/architecture.md's package table has no row for: {unnamed}"


def test_the_names_architecture_gives_a_module_are_defined_there():
    wrong = []
    for path, inside in MODULE_WITH_NAMES.findall(ARCHITECTURE.read_text()):
        file = where(path)
        assert file is not None, path
        defined = top_level_names(file) | methods(file)
        wrong += [f"{path}: {name}" for name in re.findall(r"`(\w+)`", inside) if name not in defined]
    assert not wrong, f"docs/architecture.md gives modules names they do not define: {wrong}"


def test_every_test_promises_names_is_a_test_of_its_file():
    refs = TEST_REF.findall(PROMISES.read_text())
    assert len(refs) > 100  # the page maps its promises to tests
    wrong = []
    for file, name in refs:
        path = ROOT / file
        if not path.is_file():
            wrong.append(file)
        elif name and name not in functions_of_tests(path):
            wrong.append(f"{file}::{name}")
    assert not wrong, f"docs/promises.md names tests that do not exist: {sorted(set(wrong))}"


def test_every_module_a_promise_is_kept_by_exists_with_the_names_it_gives():
    kept = [line for line in PROMISES.read_text().splitlines() if line.startswith("Kept by ")]
    assert kept
    missing = []
    for line in kept:
        for token in re.findall(r"`([\w/.*-]+)`", line):
            if token.endswith("/"):
                found = (PACKAGE / token).is_dir()
            elif "*" in token:
                found = bool(list(ROOT.glob(token)))
            elif token.endswith(".py") or token == "Makefile":
                found = where(token) is not None
            else:
                continue  # a name inside a module, checked below
            missing += [] if found else [token]
        for path, inside in MODULE_WITH_NAMES.findall(line):
            file = where(path)
            defined = top_level_names(file) | methods(file) if file else set()
            missing += [f"{path}: {name}" for name in re.findall(r"`(\w+)`", inside) if name not in defined]
    assert not missing, f"docs/promises.md says promises are kept by modules or names that do not exist: {missing}"


@pytest.mark.parametrize("package", sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
def test_each_packages_docstring_names_its_modules(package):
    folder = PACKAGE / package
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    unnamed = [p.name for p in sorted(folder.glob("*.py")) if p.name != "__init__.py" and p.name not in doc]
    assert not unnamed, f"src/vitmask/{package}/__init__.py's docstring does not name: {unnamed}"


COMMAND = re.compile(r"vitmask ([a-z-]+)([^`\n]*)")  # `vitmask VERB` and the rest of its line, up to a backtick


def test_every_option_a_page_gives_a_verb_is_one_of_its_options():
    """Every `vitmask VERB ... --flag` written in README.md, docs/, configs/ and the code's docstrings
    names an option VERB has (the guides' commands run in tests/test_guides.py; the reference pages'
    and the docstrings' are read here)."""
    import typer

    from vitmask.cli.commands import app

    group = typer.main.get_command(app)
    options = {
        name: {"--help"} | {o for p in command.params for o in (*p.opts, *getattr(p, "secondary_opts", []))}
        for name, command in group.commands.items()
    }
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "configs").glob("*.yaml")]
    files += [*PACKAGE.rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
    checked, wrong = 0, set()
    for file in files:
        text = file.read_text().replace("\\\n", " ")
        for verb, words in COMMAND.findall(text):
            if verb not in options:
                continue
            command = []
            for word in words.split():  # the command's words: up to a table's column bar or a sentence's end
                if word == "|" or word.endswith((".", ",", ":")) and not word.endswith("..."):
                    break
                command.append(word)
            flags = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", " ".join(command))
            checked += bool(flags)
            wrong |= {f"{file.relative_to(ROOT)}: vitmask {verb} {f}" for f in flags if f not in options[verb]}
    assert checked > 100
    assert not wrong, f"options that their verb does not have: {sorted(wrong)}"


def test_every_test_a_page_or_docstring_names_is_a_test_of_its_file():
    """`tests/test_x.py::test_name` written anywhere in README.md, docs/, src/ or scripts/ names a
    test function of that file, and `tests/test_x.py` a file that exists."""
    files = [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *PACKAGE.rglob("*.py"),
        *(ROOT / "scripts").glob("*.py"),
    ]
    wrong = set()
    for file in files:
        for test_file, name in TEST_REF.findall(file.read_text()):
            path = ROOT / test_file
            if not path.is_file() or name and name not in functions_of_tests(path):
                wrong.add(f"{file.relative_to(ROOT)}: {test_file}{'::' + name if name else ''}")
    assert not wrong, f"names of tests that do not exist: {sorted(wrong)}"
