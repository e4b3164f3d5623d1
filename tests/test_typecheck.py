"""vitmask's public names are typed for its users: pyright (the dev extra; `make lint` runs it on
tests/typecheck/user_script.py) finds no error in a script of the documented API, and reports every
wrong call planted in another script, each on its line, with the rule that catches it. Both files are
checked in one run of pyright (a few seconds). The names `import vitmask` serves lazily are those its
TYPE_CHECKING block imports for type checkers, and __all__ names them all. `vitmask.train` is the
package of that name, which runs the function when called: it unwraps to it (vitmask/train/__init__.py).

pyright runs on Node.js: without `node` (or pyright) the checker tests skip, and fail under VITMASK_CI=1."""

import ast
import importlib
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import vitmask
from tests.conftest import ROOT

USER_SCRIPT = ROOT / "tests" / "typecheck" / "user_script.py"

# Each planted line ends with `# error: RULE`, the pyright rule that must report it.
PLANTED = """\
import numpy as np

import vitmask

classifier = vitmask.load_classifier(28)  # error: reportArgumentType
model = vitmask.load_masked_model("mnist", weights=0.5)  # error: reportArgumentType
images = np.zeros((2, 28, 28), dtype=np.uint8)
features = model.features(images, grid="2")  # error: reportArgumentType
top = classifier.predict(images, top_k="3")  # error: reportArgumentType
processor = vitmask.ImageProcessor(image_size="28")  # error: reportArgumentType
net = vitmask.load_pretraned("mnist")  # error: reportAttributeAccessIssue
names: list[str] = classifier.predict(images).names  # error: reportAssignmentType
version: int = vitmask.__version__  # error: reportAssignmentType
result = vitmask.train("configs/default.yaml", device=0)  # error: reportArgumentType
steps: str = vitmask.finetune("mnist", "configs/finetune.yaml").step  # error: reportAssignmentType
"""


def pyright(*files: Path) -> list[dict]:
    """pyright's diagnostics of `files`, checked against this interpreter's packages (`--outputjson`)."""
    if importlib.util.find_spec("pyright") is None or shutil.which("node") is None:
        why = "pyright is not installed (the dev extra)" if shutil.which("node") else "no node (Node.js) on PATH"
        if os.environ.get("VITMASK_CI") == "1":
            pytest.fail(f"VITMASK_CI=1: {why}")
        pytest.skip(why)
    # PYRIGHT_PYTHON_IGNORE_WARNINGS: no look-up of pyright's latest version on PyPI (offline, and quicker)
    env = {**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "pyright", "--outputjson", "--pythonpath", sys.executable, *map(str, files)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode in (0, 1), res.stdout + res.stderr  # 1: errors reported; other codes: it did not run
    return json.loads(res.stdout)["generalDiagnostics"]


@pytest.fixture(scope="module")
def diagnostics(tmp_path_factory) -> dict[str, list[dict]]:
    planted = tmp_path_factory.mktemp("typecheck") / "planted.py"
    planted.write_text(PLANTED)
    found = pyright(USER_SCRIPT, planted)
    return {
        name: [d for d in found if Path(d["file"]).resolve() == path.resolve()]
        for name, path in (("user", USER_SCRIPT), ("planted", planted))
    }


def test_a_script_of_the_documented_api_type_checks(diagnostics):
    errors = [f"{d['range']['start']['line'] + 1}: {d['message']}" for d in diagnostics["user"]]
    assert errors == []


def test_every_wrong_call_is_reported_on_its_line_by_its_rule(diagnostics):
    want = {
        (number, line.rsplit("# error: ", 1)[1])
        for number, line in enumerate(PLANTED.splitlines(), start=1)
        if "# error: " in line
    }
    got = {(d["range"]["start"]["line"] + 1, d.get("rule")) for d in diagnostics["planted"] if d["severity"] == "error"}
    assert got == want


def test_the_typed_names_are_the_lazy_names_and_all_of_them():
    """vitmask/__init__.py's TYPE_CHECKING block imports, from the module _LAZY names, each name _LAZY
    serves; __all__ is those and __version__; each resolves at run time to the object the block imports
    (`vitmask.train`: the callable package, which unwraps to it)."""
    tree = ast.parse(Path(vitmask.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    )
    typed = {a.name: node.module for node in block.body if isinstance(node, ast.ImportFrom) for a in node.names}
    assert typed == vitmask._LAZY
    assert sorted(vitmask.__all__) == sorted([*typed, "__version__"])
    for name, module in typed.items():
        assert inspect.unwrap(getattr(vitmask, name)) is getattr(importlib.import_module(module), name)
    assert vitmask.train is importlib.import_module("vitmask.train") and callable(vitmask.train)
