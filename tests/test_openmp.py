"""runtime/openmp.py: the CLI's process sets OpenMP's spin count before torch is imported, unless the
user chose a wait setting. (What it buys is measured by scripts/bench_shared_cpu.py, not here.)"""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, write_config
from vitmask.runtime.openmp import SPIN_COUNT, USER_SETTINGS, share_cpus_fairly

# the GOMP_SPINCOUNT the process holds at the moment it first imports torch, then the CLI as usual
PROBE = """
import builtins, os, sys
real = builtins.__import__
def watch(name, *args, **kwargs):
    if name == "torch" and "torch" not in sys.modules:
        print("spin at torch import:", os.environ.get("GOMP_SPINCOUNT"), flush=True)
        builtins.__import__ = real
    return real(name, *args, **kwargs)
builtins.__import__ = watch
from vitmask.cli.entry import main
sys.argv = ["vitmask", *sys.argv[1:]]
main()
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    return {**env, "PYTHONPATH": str(ROOT / "src"), **extra}


@pytest.mark.parametrize(
    ("user", "seen"),
    [({}, SPIN_COUNT), ({"OMP_WAIT_POLICY": "active"}, "None"), ({"GOMP_SPINCOUNT": "77"}, "77")],
    ids=["unset", "wait-policy-chosen", "spin-count-chosen"],
)
def test_the_cli_sets_the_spin_count_before_torch_is_imported(tmp_path, user, seen):
    config = write_config(tmp_path / "c.yaml")
    res = subprocess.run(
        [sys.executable, "-c", PROBE, "config", "--config", str(config)],
        capture_output=True, text=True, env=clean_env(**user), timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == f"spin at torch import: {seen}"


def test_share_cpus_fairly_leaves_a_users_wait_settings_alone():
    env = {}
    assert share_cpus_fairly(env) and env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    for key in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME"):
        env = {key: "x"}
        assert not share_cpus_fairly(env) and env == {key: "x"}
