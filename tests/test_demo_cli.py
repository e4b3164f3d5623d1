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
import time
import urllib.request
from pathlib import Path

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


def exchange(port: int, request: bytes, hang_up: bool = False) -> bytes:
    """Send `request` as it is to 127.0.0.1:port; the answer's head and as much of its body as its
    Content-Length says (none when `hang_up`): a loaded machine may send the two in separate packets."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(request)
        if hang_up:
            return b""
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
            head, sep, body = answer.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head) if sep else None
            if sep and (length is None or len(body) >= int(length.group(1))):
                break
        return answer


def test_bad_requests_get_their_answers_and_leave_the_servers_output_as_it_was(models):
    """Malformed requests, a client gone mid-body, a query of odd digits, a Host of another name, a page of
    another origin and more requests at once than the server answers: each is answered (or its client is
    gone), the server serves on, and its output holds the address and the stop alone: no traceback, no
    warning per request."""
    proc, line, url = start_demo("--checkpoint", models[1], "--port", 0, "--device", "cpu")
    port = int(url.rsplit(":", 1)[1].strip("/"))
    ok = b"Host: 127.0.0.1:%d\r\n" % port
    try:
        assert exchange(port, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400 ")  # uvicorn's own answer
        broken = b"GET /api/info HTTP/1.1\r\n" + ok + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"
        assert exchange(port, broken).startswith(b"HTTP/1.1 400 ")  # uvicorn answers it while the app does too
        exchange(port, b"POST /api/upload HTTP/1.1\r\n" + ok + b"Content-Length: 1000\r\n\r\nabc", hang_up=True)
        digits = exchange(port, b"GET /api/examples?start=%C2%B2 HTTP/1.1\r\n" + ok + b"\r\n")
        assert digits.startswith(b"HTTP/1.1 400 ") and b"must be an integer" in digits
        rebound = exchange(port, b"GET /api/info HTTP/1.1\r\nHost: rebound.example:%d\r\n\r\n" % port)
        assert rebound.startswith(b"HTTP/1.1 400 ") and b"not the host 'rebound.example'" in rebound
        other = b"POST /api/sample HTTP/1.1\r\n" + ok + b"Origin: null\r\nContent-Length: 2\r\n\r\n{}"
        assert exchange(port, other).startswith(b"HTTP/1.1 403 ")
        waiting = []  # requests waiting for their bodies, past the number the server answers at once (64)
        for _ in range(70):
            conn = socket.create_connection(("127.0.0.1", port), timeout=30)
            conn.sendall(b"POST /api/fill HTTP/1.1\r\n" + ok + b"Content-Length: 10\r\n\r\n")
            waiting.append(conn)
        try:
            busy = exchange(port, b"GET /api/info HTTP/1.1\r\n" + ok + b"\r\n")
            assert busy.startswith(b"HTTP/1.1 503 ") and b"answering 64 requests at once" in busy
        finally:
            for conn in waiting:
                conn.close()
        for _ in range(100):  # serving on, once the server has seen those clients go
            if exchange(port, b"GET /api/info HTTP/1.1\r\n" + ok + b"\r\n").startswith(b"HTTP/1.1 200 "):
                break
            time.sleep(0.1)
        assert '"image_size":16' in fetch(url + "api/info")
    finally:
        stop = stopped_by(proc, signal.SIGINT)
    assert stop == (130, "", "vitmask demo: stopped by SIGINT\n")


def test_checkpoint_mnist_offers_the_shipped_examples_not_those_of_a_folder_mnist_here(
    run_cli_in_process, monkeypatch, tmp_path
):
    """`--checkpoint mnist`, where no folder `mnist` is, serves the shipped model; the test images it offers
    are the shipped model's examples.npz, not those of a folder `mnist` made in the working directory while
    it serves (the images are read on first use). With no flags and such a folder there from the start,
    the shipped model's too."""
    np = pytest.importorskip("numpy")
    import vitmask.demo.serve
    from vitmask.pretrained import SHIPPED

    with np.load(SHIPPED["mnist"].folder / "examples.npz") as archive:
        shipped = archive["images"]
    decoy = np.ones((3, 28, 28), np.uint8)  # test images of the model's size, not the shipped ones
    opened, open_models = [], vitmask.demo.serve.open_models

    def open_and_keep(*args, **kwargs):
        opened.append(open_models(*args, **kwargs))
        return opened[-1]

    def a_folder_mnist_appears(self, sockets=None):  # while it serves
        Path("mnist").mkdir(exist_ok=True)
        np.savez(Path("mnist") / "examples.npz", images=decoy)

    monkeypatch.setattr(vitmask.demo.serve, "open_models", open_and_keep)
    monkeypatch.setattr(vitmask.demo.serve.DemoServer, "run", a_folder_mnist_appears)
    monkeypatch.chdir(tmp_path)
    for args in (["--checkpoint", "mnist"], []):  # the second with ./mnist there from the start
        res = run_cli_in_process("demo", *args, "--port", "0", "--device", "cpu")
        assert res.returncode == 0, res.stderr
        images, where = opened[-1].examples.images()
        assert np.array_equal(images.numpy(), shipped) and str(tmp_path) not in where
    assert (tmp_path / "mnist" / "examples.npz").is_file() and len(opened) == 2


def test_a_signal_before_the_servers_loop_runs_leaves_no_coroutine_unrun(monkeypatch):
    """A stop between the address line and uvicorn's own signal handlers: the signal's Stopped is raised
    after `run` made uvicorn's `serve` coroutine and before a loop ran it. That coroutine is closed, so
    no 'coroutine ... was never awaited' warning follows the stop line."""
    import gc
    import threading
    import warnings

    import uvicorn
    import uvicorn.server

    from vitmask.demo.serve import DemoServer
    from vitmask.errors import Stopped

    def the_signal_arrives(main, **kwargs):
        raise Stopped(signal.SIGINT)

    monkeypatch.setattr(uvicorn.server, "asyncio_run", the_signal_arrives)
    server = DemoServer(uvicorn.Config(app=None), threading.Event())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Stopped):
            server.run(sockets=[])
        del server
        gc.collect()
    assert [str(w.message) for w in caught] == []


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
    "host, names",
    [
        ("127.0.0.1", {"localhost", "127.0.0.1", "[::1]"}),
        ("localhost", {"localhost", "127.0.0.1", "[::1]"}),
        ("::1", {"localhost", "127.0.0.1", "[::1]"}),
        ("127.0.0.2", {"localhost", "127.0.0.1", "[::1]", "127.0.0.2"}),
        ("::ffff:127.0.0.1", {"localhost", "127.0.0.1", "[::1]", "[::ffff:127.0.0.1]"}),  # loopback too, as IPv6
        ("0.0.0.0", None),  # every address: the names others reach it by are not the server's to know
    ],
)
def test_a_server_on_this_machine_only_answers_for_its_own_names(host, names):
    from vitmask.demo.serve import listen, local_hosts

    try:
        sock = listen(host, 0)
    except UserError as e:
        pytest.skip(f"this machine cannot listen on {host}: {e}")
    with sock:
        assert local_hosts(sock, host) == (None if names is None else frozenset(names))


def test_the_server_raises_its_limit_on_open_files_to_hold_its_connections():
    """A soft limit below what MAX_CONNECTIONS need (macOS starts at 256) is raised, within the hard limit."""
    resource = pytest.importorskip("resource")
    from vitmask.demo.serve import allow_open_files

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 300:
        pytest.skip(f"this machine's hard limit on open files is {hard}")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))
        allow_open_files(300)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (300, hard)
        allow_open_files(250)  # a limit that is higher already stays
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (300, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


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
