"""`vitmask demo` as a command: the address it prints and serves, its stop by SIGINT (130) and SIGTERM
(143), each bad start as one line (a port in use, a host not of this machine, a model of the wrong
kind, a missing extra), what --help imports, and the set-up that installs its packages.

The bad starts run in-process with the server's run replaced by a failure, so a start that should have
been refused fails the test instead of serving; the stops run `vitmask` in a real process."""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from tests.conftest import ROOT, assert_user_error
from tests.demo_models import start_demo, tiny_models
from vitmask.errors import UserError

pytest.importorskip("starlette", reason="the demo extra (starlette) is not installed")
pytest.importorskip("uvicorn", reason="the demo extra (uvicorn) is not installed")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("demo-models"))


@pytest.fixture
def refused(run_cli_in_process, monkeypatch):
    """`vitmask ARGS` in process, where serving at all fails the test (a start that should be refused)."""
    import vitmask.demo.serve

    def no_serving(self, sockets=None):
        raise AssertionError("the demo started serving")

    monkeypatch.setattr(vitmask.demo.serve.DemoServer, "run", no_serving)
    return run_cli_in_process


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as res:
        assert res.status == 200
        return res.read().decode()


def stopped_by(proc: subprocess.Popen, signum: int) -> tuple[int, str, str]:
    """Send `signum`; (exit code, the rest of stdout, stderr)."""
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def test_the_demo_prints_its_address_serves_the_page_and_ctrl_c_ends_it_with_130(models):
    proc, line, url = start_demo("--checkpoint", models[1], "--classifier", models[2], "--port", 0, "--device", "cpu")
    try:
        assert url.startswith("http://127.0.0.1:")
        assert f"serving {models[1]} and the classifier {models[2]} at {url}" in line
        assert '<canvas id="image-canvas"' in fetch(url)
        assert '"image_size":16' in fetch(url + "api/info")
    finally:
        stop = stopped_by(proc, signal.SIGINT)
    assert stop == (130, "", "vitmask demo: stopped by SIGINT\n")  # and nothing printed per request


def test_sigterm_ends_it_with_143_and_host_0000_listens_on_every_address(models):
    proc, line, url = start_demo("--checkpoint", models[0], "--host", "0.0.0.0", "--port", 0)
    try:
        assert url.startswith("http://127.0.0.1:") and "listening on every address" in line
        assert "the classifier" not in line  # --checkpoint alone: no classifier
        assert '"classifier":null' in fetch(url + "api/info")
    finally:
        stop = stopped_by(proc, signal.SIGTERM)
    assert stop == (143, "", "vitmask demo: stopped by SIGTERM\n")


def test_a_port_in_use_is_one_line_and_a_failed_start_frees_its_port(refused, models):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = refused("demo", "--checkpoint", models[1], "--port", port)
        assert_user_error(res, f"port {port} on 127.0.0.1 is in use", "--port 0")
    with socket.socket() as free:  # a start refused after binding (no such model) lets go of its port
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert_user_error(refused("demo", "--checkpoint", models[1].parent / "missing.pt", "--port", port), "missing.pt")
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--port", "70000"], ["--port must be 0 to 65535", "got 70000"]),
        (["--port", "-1"], ["--port must be 0 to 65535"]),
        (["--host", "192.0.2.1"], ["--host 192.0.2.1 is not an address of this machine"]),
        (["--host", "bad..host"], ["--host 'bad..host' is not an address to listen on"]),
        (["--device", "tpu"], ["unknown device 'tpu'"]),
        (["--weights", "best"], ["--weights"]),
    ],
)
def test_a_bad_address_or_option_is_one_line(refused, models, args, needles):
    assert_user_error(refused("demo", "--checkpoint", models[1], "--port", "0", *args), *needles)


def test_a_model_of_the_wrong_kind_is_one_line(refused, models):
    res = refused("demo", "--checkpoint", models[2], "--port", "0")  # a classifier where the masked model goes
    assert_user_error(res, f"{models[2]} holds a fine-tuned classifier", "not a masked-patch model")
    res = refused("demo", "--checkpoint", models[1], "--classifier", models[1], "--port", "0")
    assert_user_error(res, f"{models[1]} is a masked-patch model", "not a fine-tuned classifier")


def test_a_missing_demo_extra_is_one_line_with_the_install_command(refused, monkeypatch, models):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if it were not installed
    res = refused("demo", "--checkpoint", models[1])
    assert_user_error(res, "vitmask demo needs the demo extra", "uvicorn is not installed", "pip install -e '.[demo]'")


def test_help_imports_neither_starlette_nor_uvicorn():
    code = (
        "import sys\n"
        "from vitmask.cli.commands import main\n"
        "try:\n    main(['demo', '--help'])\nexcept SystemExit:\n    pass\n"
        "names = ('starlette', 'uvicorn', 'vitmask.demo.app', 'vitmask.demo.serve')\n"
        "print(sorted(m for m in names if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--checkpoint" in res.stdout and res.stdout.strip().splitlines()[-1] == "[]"


def test_the_set_up_installs_the_demo_and_its_test_packages_pinned():
    tomllib = pytest.importorskip("tomllib")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    dry = subprocess.run(
        ["make", "--no-print-directory", "-n", "install", "VENV=/nonexistent-venv"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    install = [shlex.split(c) for c in dry.stdout.splitlines() if "-c constraints.txt" in c]
    extras = re.fullmatch(r"\.\[([\w,-]*)\]", install[0][-1]).group(1).split(",")
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for e in extras for r in optional[e]}
    assert {"starlette", "uvicorn", "httpx", "playwright"} <= wanted
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)
    assert {k: pins[k] for k in ("starlette", "uvicorn", "httpx", "playwright")} == {
        "starlette": "1.10.0",
        "uvicorn": "0.54.0",
        "httpx": "0.28.1",
        "playwright": "1.65.2",
    }


@pytest.mark.parametrize(
    "host, shown",
    [
        ("127.0.0.1", "http://127.0.0.1:"),
        ("0.0.0.0", "http://127.0.0.1:"),
        ("::1", "http://[::1]:"),
        ("localhost", None),
    ],
)
def test_the_address_printed_is_one_a_browser_opens(host, shown):
    from vitmask.demo.serve import listen, page_url

    try:
        sock = listen(host, 0)
    except UserError as e:
        pytest.skip(f"this machine cannot listen on {host}: {e}")
    with sock:
        url = page_url(sock)
        port = sock.getsockname()[1]
        assert url.endswith(f":{port}/") and (shown is None or url.startswith(shown))
        address = url.removeprefix("http://").rsplit(":", 1)[0].strip("[]")
        with socket.create_connection((address, port), timeout=10):
            pass  # the socket listens at the printed address
