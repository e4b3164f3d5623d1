"""Running the demo: the socket on --host and --port, the models, uvicorn, and the stop.

The socket is bound before the models are opened, so a port in use (or a host that is not this
machine's) is one line at once. The address to open is printed as soon as the server listens.
Uvicorn runs the app on that socket with its access log off and its own log at errors only (a
refused connection or a malformed request says nothing): the output holds the address, the user's
stop, and nothing per request. Listening on a loopback address (127.0.0.1, ::1, localhost), the app
answers requests for this machine's own names only (`local_hosts`, app.HostsOnly).

The connection limits (the request limits are app.py's): at most MAX_CONNECTIONS connections open at
once (uvicorn's limit_concurrency: past it a request is answered 503 and its connection closed); a
request's head (its request line and headers) refused (400) once MAX_HEAD_BYTES of it arrived
unfinished (h11's limit), and complete within HEAD_SECONDS of the connection's opening or of the
answer to its previous request, else the connection is closed (`DemoProtocol`; uvicorn times only a
connection idle after an answer, for KEEP_ALIVE_SECONDS, and a byte of a head stops that timer).
So a client holding connections open without finishing their heads holds each for HEAD_SECONDS at
most, and takes no other client's turn until it holds MAX_CONNECTIONS of them at once.

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
from uvicorn.protocols.http.h11_impl import H11Protocol

from vitmask.demo.app import make_app
from vitmask.demo.models import open_models
from vitmask.errors import UserError
from vitmask.outputs import reason

GRACE_SECONDS = 3  # how long a stop waits for requests under way to finish
MAX_CONNECTIONS = 512  # connections open at once, idle ones included
HEAD_SECONDS = 10  # from a connection's opening, or its last answer, to the end of its next request's head
KEEP_ALIVE_SECONDS = 5  # how long a connection may sit idle after an answer
MAX_HEAD_BYTES = 16 << 10  # of a request's line and headers, unfinished
OWN_FILES = 256  # files the server holds open besides its connections (models, libraries, the listening socket)


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


class DemoProtocol(H11Protocol):
    """Uvicorn's HTTP/1.1 protocol (h11) with a deadline on each request's head: a connection that has not
    sent a complete request head HEAD_SECONDS after it opened, or after the answer to its previous
    request (the rest of that request's body included), is closed. While the app answers a request the
    deadline is off: the app times the request's body itself (app.body_chunks)."""

    head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.time_head()

    def handle_events(self) -> None:
        super().handle_events()
        self.time_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.time_head()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self.stop_head_timer()

    def time_head(self) -> None:
        """Start the deadline when the connection waits for a request's head, stop it when one is answered."""
        answering = self.cycle is not None and not self.cycle.response_complete
        if answering or self.transport.is_closing():
            self.stop_head_timer()
        elif self.head_timer is None:
            self.head_timer = self.loop.call_later(HEAD_SECONDS, self.head_too_slow)

    def stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def head_too_slow(self) -> None:
        self.head_timer = None
        if not self.transport.is_closing():
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()


def allow_open_files(n: int) -> None:
    """Raise this process's soft limit on open files to `n` where it is lower and the hard limit allows it
    (macOS starts processes at 256), so that MAX_CONNECTIONS connections can be open at once."""
    try:
        import resource
    except ImportError:  # no such limit to raise (Windows)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n if hard == resource.RLIM_INFINITY else min(n, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def demo_server(app, stopping: threading.Event) -> DemoServer:
    """The uvicorn server of `app` (make_app's), with the demo's limits (see the module docstring); this
    process's limit on open files raised to hold them (`allow_open_files`)."""
    allow_open_files(MAX_CONNECTIONS + OWN_FILES)
    config = uvicorn.Config(
        AnswerAtMostOnce(app),
        http=DemoProtocol,
        log_level="error",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=GRACE_SECONDS,
        limit_concurrency=MAX_CONNECTIONS,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        server_header=False,
    )
    return DemoServer(config, stopping)


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
        server = demo_server(make_app(models, stopping, local_hosts(sock, host)), stopping)
        served = models.name + (f" and the classifier {models.classifier_name}" if models.classifier else "")
        wildcard = ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_unspecified
        everywhere = " (listening on every address of this machine)" if wildcard else ""
        print(
            f"vitmask demo: serving {served} at {page_url(sock)}{everywhere}; open it in a browser, Ctrl-C stops it",
            flush=True,
        )
        server.run(sockets=[sock])
    finally:
        sock.close()
