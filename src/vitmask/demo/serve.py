"""Running the demo: the socket on --host and --port, the models, uvicorn, and the stop.

The socket is bound before the models are opened, so a port in use (or a host that is not this
machine's) is one line at once. The address to open is printed as soon as the server listens.
Uvicorn runs the app on that socket with its access log off: the output holds the address, the
user's stop, and nothing per request. SIGINT (Ctrl-C) or SIGTERM sets uvicorn's exit and ends any
computation under way at its next round (app.ServerStopping); once uvicorn has shut down it raises
the signal again, which the CLI's handler turns into `errors.Stopped`: exit 130 or 143, as every
other verb.
"""

import errno
import ipaddress
import socket
import threading
from pathlib import Path

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
            make_app(models, stopping),
            log_level="warning",
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
