"""scripts/check_imports.py on small trees written here: a tree whose packages import in the allowed
directions passes with exit code 0; each planted violation (model importing data, data importing
model, the store importing evaluation, an upward import, a cycle, a leaf importing a leaf, a module
other than vitmask.__main__ importing the command line) is one line naming the two modules, and exit
code 1. The repository's own tree passes."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "check_imports.py"


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60, check=False
    )


# module -> its source: a tree laid out as src/vitmask is, every import in an allowed direction
CLEAN = {
    "vitmask/__init__.py": "",
    "vitmask/errors.py": "",
    "vitmask/sizes.py": "def num_masked(n, r):\n    return round(n * r)\n",
    "vitmask/data/__init__.py": "",
    "vitmask/data/masking.py": "from vitmask.sizes import num_masked\n",
    "vitmask/model/__init__.py": "",
    "vitmask/model/pooling.py": "def feature_name():\n    return 'mean'\n",
    "vitmask/model/vit.py": "from vitmask.sizes import num_masked\nfrom vitmask.model import pooling\n",
    "vitmask/evaluate/__init__.py": "",
    "vitmask/evaluate/probe.py": "from vitmask.data import masking\nfrom vitmask.model.pooling import feature_name\n",
    "vitmask/store/__init__.py": "",
    "vitmask/store/classifier.py": "from vitmask.model.pooling import feature_name\n",
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_tree_that_imports_in_the_allowed_directions_passes(tmp_path):
    res = check(write_tree(tmp_path, CLEAN))
    assert res.returncode == 0, res.stdout
    # imports, by hand: masking 1 (sizes); vit 3 (sizes, the model package, pooling); probe 3 (the data
    # package, masking, pooling); store.classifier 1 (pooling)
    assert res.stdout.splitlines() == ["check_imports: 12 modules, 8 imports, 0 failures"]


@pytest.mark.parametrize(
    "module,source,line",
    [
        (
            "vitmask/model/vit.py",
            "from vitmask.data.masking import num_masked\n",
            "independence: vitmask.model.vit imports vitmask.data.masking; what model/ and data/ both need "
            "lives in a leaf (vitmask/sizes.py)",
        ),
        (
            "vitmask/data/masking.py",
            "def fill():\n    import vitmask.model.vit  # deferred: still an import\n",
            "independence: vitmask.data.masking imports vitmask.model.vit; what model/ and data/ both need "
            "lives in a leaf (vitmask/sizes.py)",
        ),
        (
            "vitmask/store/classifier.py",
            "from vitmask.evaluate.probe import feature_name\n",
            "independence: vitmask.store.classifier imports vitmask.evaluate.probe; the store depends on no "
            "evaluation; move what it needs below it (e.g. model/pooling.py)",
        ),
        (
            "vitmask/model/vit.py",
            "import vitmask.evaluate.probe\n",
            "layering: vitmask.model.vit imports vitmask.evaluate.probe, a package above its own layer",
        ),
        (
            "vitmask/sizes.py",
            "from vitmask import errors, progress\n",
            "layering: the leaf vitmask.sizes imports vitmask.progress; leaves import only the standard library "
            "and errors",
        ),
    ],
)
def test_each_planted_violation_is_one_line_and_exit_1(tmp_path, module, source, line):
    files = {**CLEAN, "vitmask/progress.py": "", module: source}
    res = check(write_tree(tmp_path, files))
    assert res.returncode == 1, res.stdout
    *failures, summary = res.stdout.splitlines()
    assert failures == [line]
    assert summary.endswith(", 1 failures")


# the command line on top of CLEAN, imported by its own modules and by vitmask.__main__ only
CLI = {
    "vitmask/cli/__init__.py": "",
    "vitmask/cli/verbs.py": "from vitmask.model.pooling import feature_name\n",
    "vitmask/cli/entry.py": "from vitmask.cli import verbs\n",
    "vitmask/__main__.py": "from vitmask.cli.entry import main\n",
    "vitmask/demo/__init__.py": "",
    "vitmask/demo/models.py": "from vitmask.model.pooling import feature_name\n",
    "vitmask/inference/__init__.py": "",
    "vitmask/inference/open.py": "from vitmask.store import classifier\n",
}
CLI_LINE = (
    "cli: {} imports vitmask.cli.verbs; nothing imports vitmask.cli but vitmask.__main__, so move what both "
    "need below them (e.g. into inference/)"
)


def test_the_command_line_imported_by_main_and_by_itself_passes(tmp_path):
    res = check(write_tree(tmp_path, {**CLEAN, **CLI}))
    assert res.returncode == 0, res.stdout
    assert res.stdout.splitlines()[-1].endswith(" 0 failures")


@pytest.mark.parametrize(
    "module,source",
    [
        ("vitmask/demo/models.py", "from vitmask.cli.verbs import feature_name\n"),  # a layer below cli
        ("vitmask/inference/open.py", "def open_model():\n    import vitmask.cli.verbs  # deferred: still an import\n"),
        ("vitmask/__init__.py", "from vitmask.cli.verbs import main\n"),  # the public face, above cli in LAYERS
    ],
)
def test_importing_the_command_line_from_anywhere_but_main_is_one_line_and_exit_1(tmp_path, module, source):
    res = check(write_tree(tmp_path, {**CLEAN, **CLI, module: source}))
    assert res.returncode == 1, res.stdout
    *failures, summary = res.stdout.splitlines()
    importer = module.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    assert failures == [CLI_LINE.format(importer)]
    assert summary.endswith(", 1 failures")


def test_a_cycle_is_reported_once_with_its_modules(tmp_path):
    files = {**CLEAN, "vitmask/model/pooling.py": "from vitmask.model import vit\n"}  # vit imports pooling
    res = check(write_tree(tmp_path, files))
    assert res.returncode == 1
    assert res.stdout.splitlines()[0] == "import cycle: vitmask.model.pooling <-> vitmask.model.vit"


def test_the_repository_passes():
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stdout
    assert res.stdout.splitlines()[-1].endswith(" 0 failures")
