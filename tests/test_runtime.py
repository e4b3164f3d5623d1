"""process.keep_freed_memory: glibc keeps freed blocks, so repeated large allocations stop
page-faulting; a user's own allocator settings are left alone. Each case runs in a fresh process,
since the setting is process-wide."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

# allocate and free a 64 MB tensor 20 times; print the minor page faults of the last 10 rounds
# (glibc settles on reusing the block within about 6 rounds)
PROBE = textwrap.dedent(
    """
    import resource, sys, torch
    from vitmask.runtime.process import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "tuned" else False
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.ones(16 * 2**20).sum()  # 64 MB of float32, freed at once
    before = faults()
    for _ in range(10):
        torch.ones(16 * 2**20).sum()
    print(applied, faults() - before)
    """
)


def probe(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    full_env = {**clean, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **env}
    res = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=full_env, timeout=120)
    assert res.returncode == 0, res.stderr
    applied, faults = res.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_memory_is_reused_without_page_faults():
    applied, tuned = probe("tuned")
    assert applied == "True"
    _, default = probe("default")
    # default glibc maps and unmaps each 64 MB block: ~16k faults a round; tuned, the heap is reused
    assert default > 10 * 10_000
    assert tuned < default / 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
@pytest.mark.parametrize("env", [{"MALLOC_ARENA_MAX": "2"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}])
def test_a_users_allocator_setting_is_left_alone(env):
    applied, _ = probe("tuned", **env)
    assert applied == "False"


def test_bf16_on_a_cpu_that_emulates_it_warns_once(monkeypatch, capsys):
    import torch

    from vitmask.runtime import process

    cpu = torch.device("cpu")
    monkeypatch.setattr(process, "cpu_bf16_slowdown", lambda: 95.0)  # an AVX2-only host: bf16 emulated
    process.check_precision("bf16", cpu)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "95x slower than fp32" in lines[0] and "--set train.precision=fp32" in lines[0]
    process.check_precision("fp32", cpu)  # fp32 asked for: nothing to say
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(process, "cpu_bf16_slowdown", lambda: 0.5)  # AVX512_BF16 or AMX: bf16 the faster
    process.check_precision("bf16", cpu)
    assert capsys.readouterr().err == ""
