"""Running the demo: the socket on --host and --port, the models, uvicorn, and the stop.

The socket is bound before the models are opened, so a port in use (or a host that is not this
machine's) is one line at once. The address to open is printed as soon as the server listens.
Uvicorn runs the app on that socket with its access log off and its own log at errors only (a
refused connection or a malformed request says nothing): the output holds the address, the user's
stop, and nothing per request. Listening on a loopback address (127.0.0.1, ::1, localhost), the app
answers requests for this machine's own names only (`local_hosts`, app.HostsOnly).

SIGINT (Ctrl-C) or SIGTERM sets uvicorn's exit and ends any computation under way at its next round
(app.ServerStopping); once uvicorn has shut down it raises the signal again, which the CLI's handler
turns into `errors.Stopped`: exit 130 or 143, as every other verb.
"""

import asyncio
import contextlib
import errno
import ipaddress
import socket
import threading
from pathlib import Path

import h11
import uvicorn

from vitmask.demo.app import make_app
from vitmask.demo.models import open_models
from vitmask.errors import UserError
from vitmask.outputs import reason

GRACE_SECONDS = 3  # how long a stop waits for requests under way to finish


class DemoServer(uvicorn.Server):
    """Uvicorn's server, whose stop also ends the model computations under way (`stopping`)."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event):
        super().__init__(config)
        self.stopping = stopping

    def handle_exit(self, sig, frame) -> None:
        self.stopping.set()
        super().handle_exit(sig, frame)

    def serve(self, sockets=None):
        """Uvicorn's `serve` coroutine, kept so that `run` can close it."""
        self.serving = super().serve(sockets=sockets)
        return self.serving

    def run(self, sockets=None) -> None:
        self.serving = None
        try:
            super().run(sockets=sockets)
        finally:
            if self.serving is not None:  # a signal before the loop started it: closed, so no warning that it never ran
                self.serving.close()


class AnswerAtMostOnce:
    """The app as uvicorn runs it. Uvicorn answers a request it finds malformed on its own (400: a
    broken chunked body) and closes the connection, while the app may still be answering it; that
    answer is dropped here, where h11 would refuse it with a traceback in the output, and the app's
    call ends once the connection is closed, so uvicorn does not log it as an answer left unfinished."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        answered = False

        async def send_unless_answered(message) -> None:
            nonlocal answered
            if answered:
                return
            try:
                await send(message)
            except h11.LocalProtocolError:  # the connection has had uvicorn's answer and is closing
                answered = True

        await self.app(scope, receive, send_unless_answered)
        if answered:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(disconnected(receive), GRACE_SECONDS)


async def disconnected(receive) -> None:
    """Return once the client's connection is closed (the rest of its body read and dropped)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (port 0: any free one); every failure is one line."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be 0 to 65535 (0: any free port), got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as e:
        why = e.strerror if isinstance(e, socket.gaierror) else "not a valid host name"
        raise UserError(
            f"--host {host!r} is not an address to listen on ({why}); pass an IP address of this machine, "
            "127.0.0.1 (this machine only) or 0.0.0.0 (every address)"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart right after a stop may reuse the port
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(
                f"port {port} on {host} is in use (another program listens there); pass --port with a free one, "
                "or --port 0 for any free port"
            ) from None
        if e.errno == errno.EACCES:
            raise UserError(
                f"cannot listen on port {port} (permission denied: ports below 1024 need root); pass --port 8000 "
                "or another above 1023"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise UserError(
                f"--host {host} is not an address of this machine; pass one of its addresses, 127.0.0.1 or 0.0.0.0"
            ) from None
        raise UserError(f"cannot listen on {host} port {port} ({reason(e)})") from None
    return sock


def local_hosts(sock: socket.socket, host: str) -> frozenset[str] | None:
    """The names a request's Host header may give a server listening on `sock` (--host `host`): for a
    loopback address, this machine's names for itself (localhost, 127.0.0.1, [::1], the address and
    --host as given); None (any name) for an address other machines reach, whose names it cannot know."""
    address = sock.getsockname()[0].split("%")[0]
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    if not (mapped or ip).is_loopback:
        return None
    given = host.lower().rstrip(".")
    names = {"localhost", "127.0.0.1", "[::1]", address if ip.version == 4 else f"[{address}]"}
    return frozenset(names | {f"[{given}]" if ":" in given else given})


def page_url(sock: socket.socket) -> str:
    """The address to open: the socket's own; a wildcard host (0.0.0.0, ::) read as this machine, 127.0.0.1."""
    host, port = sock.getsockname()[:2]
    ip = ipaddress.ip_address(host.split("%")[0])
    if ip.is_unspecified:
        return f"http://127.0.0.1:{port}/" if ip.version == 4 else f"http://[::1]:{port}/"
    return f"http://{host}:{port}/" if ip.version == 4 else f"http://[{host}]:{port}/"


def serve(
    checkpoint: Path | None,
    classifier: Path | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    device_name: str = "auto",
    weights: str | None = None,
) -> None:
    """Serve the demo until a signal stops it (see the module docstring)."""
    sock = listen(host, port)
    try:
        models = open_models(checkpoint, classifier, device_name, weights)
        stopping = threading.Event()
        config = uvicorn.Config(
            AnswerAtMostOnce(make_app(models, stopping, local_hosts(sock, host))),
            log_level="error",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=GRACE_SECONDS,
            limit_concurrency=64,
            server_header=False,
        )
        served = models.name + (f" and the classifier {models.classifier_name}" if models.classifier else "")
        wildcard = ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_unspecified
        everywhere = " (listening on every address of this machine)" if wildcard else ""
        print(
            f"vitmask demo: serving {served} at {page_url(sock)}{everywhere}; open it in a browser, Ctrl-C stops it",
            flush=True,
        )
        DemoServer(config, stopping).run(sockets=[sock])
    finally:
        sock.close()
