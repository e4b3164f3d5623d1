"""Shared test helpers: tiny configs, and running the real CLI in this process or in a process of its own."""

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest_plugins = ["tests.suite_budget"]  # --suite-budget SECONDS: make test fails a suite that grew slow

if os.environ.get("PYTEST_XDIST_WORKER"):  # under pytest-xdist (make test: two workers on two cores)
    # one intra-op thread per worker, set before torch is imported: two workers of two threads each
    # on two cores wait on each other's spinning threads (a probe test ran 50 s instead of 3)
    os.environ["OMP_NUM_THREADS"] = "1"

ROOT = Path(__file__).resolve().parents[1]

# The files that take longest (make test's --durations), run first: pytest-xdist hands whole files to
# its two workers in collection order (--dist loadfile), so a long file started last would leave one
# worker running it alone at the end. Longest first, the rest in their usual order.
SLOW_FILES_FIRST = (
    "test_guides.py",  # every guide page run as written: about 100 s
    "test_demo_browser.py",  # Chromium driving the demo page: about 40 s
    "test_build_pretrained.py",
    "test_wheel.py",
    "test_distributed.py",
    "test_sweep_workers.py",
    "test_own_data_dark_on_white.py",
    "test_compute_scaling.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's order is kept


MNIST_DIR = ROOT.parent / "shared" / "data" / "mnist"

TINY = {
    "seed": 0,
    "data": {"image_size": 16, "patch_size": 2, "batch_size": 32, "num_train": 512, "num_val": 64, "num_test": 64},
    "mask": {"ratio": 0.5},
    "model": {"hidden_dim": 32, "num_heads": 2, "depth": 2, "ffn_dim": 64},
    "train": {"lr": 3e-3, "max_steps": 30, "eval_every": 15, "checkpoint_every": 15, "log_every": 5},
}


def extra(module: str):
    """Import `module`, a package of one of vitmask's extras; skip the test where it is not installed,
    except under VITMASK_CI=1 (CI installs every extra the tests read), where its absence fails."""
    if os.environ.get("VITMASK_CI") == "1":
        import importlib

        try:
            return importlib.import_module(module)
        except ImportError as e:
            pytest.fail(f"{module} is not installed ({e}); under VITMASK_CI=1 its extra must be", pytrace=False)
    return pytest.importorskip(module)


def write_config(path: Path, overrides: dict | None = None) -> Path:
    """Write TINY, with nested `overrides` merged in, as YAML to `path`."""
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TINY.items()}
    for k, v in (overrides or {}).items():
        if isinstance(v, dict):
            cfg.setdefault(k, {}).update(v)
        else:
            cfg[k] = v
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def one_thread():
    """One intra-op thread: on a small shared CPU box, two threads per process mostly wait on each other.
    Modules that want it say `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def train_tiny(root: Path, overrides: dict | None = None) -> Path:
    """Train TINY (plus `overrides`) to the end in `root` (30 steps on 16x16 shapes); return its last.pt."""
    import torch

    from vitmask.config import load_config
    from vitmask.data.batches import load_splits
    from vitmask.train.trainer import Trainer

    cfg = load_config(write_config(root / "tiny.yaml", overrides))
    Trainer(cfg, load_splits(cfg), torch.device("cpu")).fit(run_dir=root, progress=False)
    return root / "last.pt"


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    return write_config(tmp_path / "tiny.yaml")


def run_in_process(call, cwd: Path | None = None, env: dict | None = None) -> tuple[int, str, str]:
    """Run `call()` as a command-line program would run: in `cwd` (the repository by default), with
    `env` added to os.environ, one intra-op thread, stdout and stderr captured, SystemExit read as its
    exit code. The environment, sys.argv, sys.path, the working directory and torch's thread count are
    restored afterwards. Returns (exit code, stdout, stderr)."""
    import torch

    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    saved_environ, saved_argv, saved_path = dict(os.environ), list(sys.argv), list(sys.path)
    saved_cwd, threads = os.getcwd(), torch.get_num_threads()
    code = 0
    try:
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        os.chdir(cwd or ROOT)
        torch.set_num_threads(1)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                call()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        torch.set_num_threads(threads)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_environ)
        sys.argv[:], sys.path[:] = saved_argv, saved_path
    texts = []
    for stream in (out, err):
        stream.flush()
        texts.append(stream.buffer.getvalue().decode("utf-8", errors="backslashreplace"))
    return code, *texts


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `vitmask ARGS` in this process and capture its output (run_in_process): what `run_cli_process`
    returns, without a process's start-up (an import of torch, about 1.8 CPU-seconds a call). Use
    `run_cli_process` where a real process is the point: signals, exit codes set by the interpreter,
    start-up, streams closed or full."""
    from vitmask.cli import commands

    code, out, err = run_in_process(lambda: commands.main([str(a) for a in args]), cwd, env)
    return subprocess.CompletedProcess(["vitmask", *map(str, args)], code, out, err)


def run_script(script: Path, *args, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python SCRIPT ARGS` in this process (run_in_process): the file executed as __main__, its
    `if __name__ == "__main__"` block and exit code included, without a process's start-up. What it sets
    in os.environ or sys.path at import is undone afterwards; the modules it imports stay imported."""
    import runpy

    def call():
        sys.argv[:] = [str(script), *map(str, args)]
        runpy.run_path(str(script), run_name="__main__")

    code, out, err = run_in_process(call, cwd, env)
    return subprocess.CompletedProcess([sys.executable, str(script), *map(str, args)], code, out, err)


def run_cli_process(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m vitmask ARGS` in a process of its own and capture its output."""
    # one thread per subprocess: on a 2-core machine, several torch processes with 2 threads each thrash
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "vitmask", *map(str, args)],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def assert_user_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit code 2, exactly one line on stderr that mentions every needle, and no traceback."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


class RecordingLogger:
    """A metrics logger (metrics_log.py's interface) that keeps every scalar it is given in `rows`."""

    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, metrics: dict, step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def log_image(self, tag, image, step) -> None:
        pass

    def log_hparams(self, hparams, metrics, step=0) -> None:
        pass

    def close(self) -> None:
        pass


def run_main(capsys, *args) -> tuple[int, str, str]:
    """`vitmask ARGS` in this process on the streams the test set (capsys's, or a pipe whose reader is
    gone), for tests of the streams themselves; exit code, stdout, stderr. Elsewhere use run_cli."""
    from vitmask.cli import commands

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        commands.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


@pytest.fixture
def run_cli_in_process():
    """`run_cli` in the test's working directory (a test may chdir to its tmp_path first)."""
    return lambda *args: run_cli(*args, cwd=Path.cwd())
