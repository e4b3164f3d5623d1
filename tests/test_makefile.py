"""The set-up commands of the README, read with `make -n` (make prints the recipe and runs nothing):
`make install` (the README's "Try it"), `make train` and `make test` create the virtualenv when it is
missing, and only then, install every package the README's tour needs (the onnx extra for `vitmask
export --onnx`, the demo extra for `vitmask demo`, sybil for the tested guides), and `make train` passes
`--resume auto`."""

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
tomllib = pytest.importorskip("tomllib")  # Python 3.11 on


def dry_run(target: str, venv: Path) -> list[str]:
    """The commands `make TARGET VENV=venv` would run, one per line."""
    # under `make test` the parent make's variables would make this one print "make[1]: Entering ..."
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    res = subprocess.run(
        ["make", "--no-print-directory", "-n", target, f"VENV={venv}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [line.strip() for line in res.stdout.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "target, last",
    [
        ("install", "{venv}/bin/python -m pip install -q --no-deps --no-build-isolation -e ."),
        ("train", "{venv}/bin/vitmask train"),
        ("test", "{venv}/bin/python -m pytest"),
    ],
)
def test_make_train_and_test_create_the_venv_only_when_it_is_missing(tmp_path, target, last):
    missing = tmp_path / "missing-venv"
    commands = dry_run(target, missing)
    assert commands[0] == f"python3 -m venv {missing}"
    assert any(c.startswith(f"{missing}/bin/python -m pip install -q -c constraints.txt -e '.[") for c in commands)
    assert commands[-1].startswith(last.format(venv=missing))

    ready = tmp_path / "ready-venv"  # a venv with its python and dependencies newer than pyproject.toml
    (ready / "bin").mkdir(parents=True)
    (ready / "bin" / "python").touch()
    (ready / ".deps-installed").touch()
    commands = dry_run(target, ready)
    assert not any("-m venv" in c or "-c constraints.txt" in c for c in commands)
    assert commands[-1].startswith(last.format(venv=ready))


def test_make_train_passes_resume_auto(tmp_path):
    train = dry_run("train", tmp_path / "venv")[-1].split()
    assert train[:2] == [f"{tmp_path}/venv/bin/vitmask", "train"]
    assert train[train.index("--config") + 1] == "configs/default.yaml"
    assert train[train.index("--resume") + 1] == "auto"


def installed_requirements(venv: Path) -> set[str]:
    """The distributions the set-up's `pip install ... -e '.[EXTRAS]'` asks for: the project's
    dependencies plus those of each extra named, as pyproject.toml lists them (names only)."""
    install = [c for c in dry_run("install", venv) if "-c constraints.txt" in c]
    assert len(install) == 1, install
    target = shlex.split(install[0])[-1]  # .[dev,onnx]
    extras = re.fullmatch(r"\.\[([\w,-]*)\]", target).group(1).split(",")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    return {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower() for req in wanted}


def test_the_set_up_installs_what_the_tour_runs(tmp_path):
    """`vitmask export --onnx` (the tour) needs onnx, onnxscript and onnxruntime, `vitmask demo` (Try it)
    starlette and uvicorn; the guides' tests need pytest and sybil. Each is pinned in constraints.txt, so
    the set-up installs the tested version."""
    wanted = installed_requirements(tmp_path / "missing-venv")
    needed = {"onnx", "onnxscript", "onnxruntime", "pytest", "sybil", "ruff", "torch", "starlette", "uvicorn"}
    assert needed <= wanted, needed - wanted
    pinned = {
        line.split("==")[0].lower() for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line
    }
    assert needed <= pinned, needed - pinned
