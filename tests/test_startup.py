"""The CLI starts without torch where it does not need it: `vitmask --help`, every verb's `--help`, a
usage error and `vitmask --version` run in a fresh interpreter and leave `torch` out of sys.modules.
A command imports the library (torch) first, so a start that cannot import it is one line. `--version` names
vitmask's version and the installed torch's."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import typer
from PIL import Image

from tests.conftest import ROOT
from vitmask.cli import commands

# Runs the CLI's main (the `vitmask` entry point) on argv, then reports on stderr's last line
# whether torch was imported, after the exit code.
PROBE = """
import json, sys
from vitmask.cli.entry import main
sys.argv = ["vitmask", *sys.argv[1:]]
try:
    main()
    code = 0
except SystemExit as e:
    code = e.code
sys.stderr.write("\\n" + json.dumps({"code": code, "torch": "torch" in sys.modules}) + "\\n")
"""


def run_probe(*args: str, script: str = PROBE) -> tuple[dict, str, list[str]]:
    """The probe in a fresh interpreter: its report (exit code, whether torch was imported), its stdout
    and the non-blank lines of its stderr before the report."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "100"}
    res = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    *err, last = [line for line in res.stderr.splitlines() if line.strip()]
    return json.loads(last), res.stdout, err


def registered_verbs() -> list[str]:
    """Every verb the app has, as the parser names them: new verbs are covered with no change here."""
    return sorted(typer.main.get_command(commands.app).commands)


def test_the_app_has_the_verbs_this_file_checks():
    """The parametrisation below is built from the app; it must find the verbs (a hand count of some)."""
    assert {"train", "eval", "probe", "export", "pack", "predict", "finetune"} <= set(registered_verbs())


def test_vitmask_models_lists_the_shipped_models_without_importing_torch():
    """The listing reads each folder's shipped.json and the sizes on disk: no command needs torch less."""
    report, out, err = run_probe("models")
    assert report == {"code": 0, "torch": False} and err == []
    assert [line.split()[0] for line in out.split("\n\n")[:3]] == ["mnist", "mnist-classifier", "shapes"]


def test_the_groups_help_does_not_import_torch():
    report, out, _ = run_probe("--help")
    assert report == {"code": 0, "torch": False}
    assert "train" in out and "--version" in out


@pytest.mark.parametrize("verb", registered_verbs())
def test_each_verbs_help_does_not_import_torch(verb):
    report, out, _ = run_probe(verb, "--help")
    assert report == {"code": 0, "torch": False}, verb
    assert f"vitmask {verb}" in out  # the usage line: it was this verb's help


def test_a_usage_error_is_one_line_without_importing_torch():
    report, _, _ = run_probe("eval", "--no-such-option")
    assert report == {"code": 2, "torch": False}


# No writable temporary directory, which torch's compiler looks for at import: Python's search for one
# (tempfile.gettempdir) offered only a folder that does not exist. tests/test_hostile.py makes the
# same happen for real (no file can be written), for one verb.
NO_TEMP_DIR = """
import tempfile
tempfile._candidate_tempdir_list = lambda: ["/no/such/folder/for/temporary/files"]
"""


@pytest.mark.parametrize(
    "args",
    [
        ("config", "--config", "configs/default.yaml"),  # torch through verbs, on first use
        ("eval", "--checkpoint", "missing.pt"),  # torch through the command's own imports, first
        ("pack",),  # a refusal of its options before it imports anything
    ],
)
def test_every_command_imports_the_library_first_so_a_start_without_a_temp_dir_is_one_line(args):
    report, _, err = run_probe(*args, script=NO_TEMP_DIR + PROBE)
    assert report["code"] == 2
    assert len(err) == 1, err
    assert err[0].startswith("vitmask: cannot start: no such file or folder while importing torch"), err
    assert "set TMPDIR to a writable folder" in err[0]


# Runs `vitmask ARGS` for each JSON list of ARGS in argv, in this one interpreter, then reports each
# exit code and whether torch's compiler (torch._dynamo, over a CPU-second to import) was imported.
COMMANDS_THEN_COMPILER = """
import json, sys
from vitmask.cli.commands import main
codes = []
for args in map(json.loads, sys.argv[1:]):
    try:
        main(args)
    except SystemExit as e:
        codes.append(e.code)
sys.stderr.write("\\n" + json.dumps({"codes": codes, "compiler": "torch._dynamo" in sys.modules}) + "\\n")
"""


def test_commands_that_compile_nothing_do_without_torchs_compiler(tmp_path):
    """sample, inpaint and reconstruct (which reads the model's data and sizes it: check_fits) on the
    shipped shapes model build no model on the meta device and compile nothing, so torch._dynamo is
    never imported."""
    import json

    image = tmp_path / "square.png"
    Image.fromarray(np.pad(np.full((16, 16), 255, np.uint8), 8)).save(image)  # 32 x 32, the model's size
    shapes = ["--checkpoint", "shapes", "--device", "cpu"]
    commands_run = [
        ["sample", *shapes, "--n", "1", "--steps", "2", "--out", str(tmp_path / "s.png")],
        ["inpaint", *shapes, "--image", str(image), "--box", "0,0,8,8", "--out", str(tmp_path / "i.png")],
        ["reconstruct", *shapes, "--n", "4", "--out", str(tmp_path / "r.png")],
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-c", COMMANDS_THEN_COMPILER, *map(json.dumps, commands_run)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    *_, last = [line for line in res.stderr.splitlines() if line.strip()]
    assert json.loads(last) == {"codes": [0, 0, 0], "compiler": False}, res.stderr[-2000:]


def test_version_prints_vitmasks_and_torchs_versions_without_importing_torch():
    import torch

    report, out, _ = run_probe("--version")
    assert report == {"code": 0, "torch": False}
    project = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert out.splitlines()[0] == f"vitmask {project}"
    # torch's own version with its build's local tag (+cu130), as torch.__version__ says, not the metadata's
    assert out.splitlines()[1] == f"torch {torch.__version__}" and len(out.splitlines()) == 2


def test_version_says_when_torch_is_not_installed():
    """torch's metadata hidden (as where it is not installed): the line says so, and the exit is 0."""
    hide = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "def version(name):\n"
        "    if name == 'torch':\n"
        "        raise m.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "m.version = version\n"
    )
    report, out, _ = run_probe("--version", script=hide + PROBE)
    assert report == {"code": 0, "torch": False}
    assert out.splitlines()[1] == "torch not installed"
