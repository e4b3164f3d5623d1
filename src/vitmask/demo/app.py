"""The demo's Starlette app: the page, and JSON endpoints that compute with the verbs' library code.

    GET  /                 the page (static/index.html), GET /demo.js its script
    GET  /api/info         the models: image and patch size, the classifier's classes, the limits
    GET  /api/examples     ?start=&count=: test images to pick from (models.Examples)
    POST /api/upload       an image file as the body -> its binary pixels, preprocessed as inpaint reads --image
    POST /api/fill         pixels, mask and decoding options -> the fill and each round of it
    POST /api/sample       decoding options and a seed -> a new image and each round of it
    POST /api/classify     pixels and top_k -> the classifier's top-k classes

Images travel as strings of S*S characters '0'/'1', row by row (1 = foreground), the binary pixels
the model sees; a mask the same way, 1 = hidden (every patch holding a 1 is filled, as for
`vitmask inpaint --mask`). The numbers are the CLI's: a fill is `generate.inpaint.fill_image` with
`inpaint_options` (what `vitmask inpaint` runs, defaults included), a sample
`generate.sampling.sample_from_seed` (`vitmask sample --n 1`), a classification
`ImageClassifier.top_k_of_pixels` (`vitmask predict`); an upload is read by `load_image_file` and
`binarize_images`, as inpaint reads its image.

The server keeps no state between requests: each is answered from what it carries, so any number
of pages, in any number of browsers, each keep their own. Model computations run one at a time
(a lock), in Starlette's thread pool, and so does the decoding of uploads (a lock of its own). Bad
input is an answer {"error": one line}, never a traceback; anything else is a bug and keeps its
traceback in the server's output.

What the app answers, before any endpoint reads a request (middleware, outermost first):
- `RequestsAtOnce`: at most MAX_REQUESTS requests answered at once; one more is 503.
- `HostsOnly` (a server on this machine only): a Host header naming another host is 400.
- `OwnPageOnly`: a request whose Origin header is not the page's own origin is 403, so a page of
  another site open in the same browser cannot make the server compute.
A request's body arrives within time limits (`body_chunks`: no pause over BODY_STALL_SECONDS, all of
it within BODY_SECONDS; else 408) and sizes (413 past its endpoint's limit). A request refused before
its body is read has its body read and dropped first (up to DISCARD_BYTES), so that a client still
sending it reads the answer rather than a reset connection; past those limits the answer closes the
connection. The connection limits (the request's head, how many connections) are serve.py's.
"""

import asyncio
import json
import re
import tempfile
import threading
import warnings
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vitmask.config import check_seed
from vitmask.data.binarization import far_from, pixels_share
from vitmask.data.preprocess import binarize_images, load_image_file
from vitmask.demo.models import DemoModels
from vitmask.errors import UserError
from vitmask.generate.inpaint import fill_image, inpaint_options, pixels_to_patches
from vitmask.generate.sampling import ORDERS, DecodeOptions, DecodeRound, sample_from_seed
from vitmask.inference.classifier import check_top_k

MAX_UPLOAD_BYTES = 8 << 20  # an uploaded image file
MAX_UPLOAD_SIDE = 4096  # pixels a side of an uploaded image, checked before it is decoded
# The formats an upload may be, by Pillow's names: each decoded in this process. Any other (EPS, which
# Pillow hands to Ghostscript to run, among them) is refused from its header, before it is decoded.
UPLOAD_FORMATS = ("PNG", "JPEG", "MPO", "BMP", "DIB", "GIF", "TIFF", "WEBP", "PPM", "TGA", "ICO")
BODY_STALL_SECONDS = 10  # the longest pause in a request's body
BODY_SECONDS = 60  # the longest a request's body takes to arrive, all of it (8 MiB at 1.2 Mbit/s)
DISCARD_BYTES = 64 << 20  # of a body refused before it is read, what is read and dropped before the answer
MAX_REQUESTS = 64  # requests answered at once (each holds its body, up to MAX_UPLOAD_BYTES)
JSON_SLACK = 64 << 10  # a JSON request: its images (two of S*S characters) and this much more
EXAMPLES_PAGE = 100  # test images one /api/examples answer holds at most
SECURITY_HEADERS = {
    # the page loads nothing from anywhere else: no CDN, no fonts, no requests to other hosts
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
        "connect-src 'self'; frame-ancestors 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
# The CLI's defaults: vitmask inpaint's (steps 8, temperature 0, order confidence) and vitmask sample's
# (steps 64, temperature 1, order random); seed 0 and choice temperature 0 for both.
FILL_FIELDS = {
    "pixels": (str, None),
    "mask": (str, None),
    "iterative": (bool, False),
    "steps": (int, 8),
    "temperature": (float, 0.0),
    "seed": (int, 0),
    "order": (str, "confidence"),
    "choice_temperature": (float, 0.0),
}
SAMPLE_FIELDS = {
    "steps": (int, 64),
    "temperature": (float, 1.0),
    "seed": (int, 0),
    "order": (str, "random"),
    "choice_temperature": (float, 0.0),
}
CLASSIFY_FIELDS = {"pixels": (str, None), "top_k": (int, 1)}


class BadRequest(Exception):
    """A request refused: `status` (400; 403 another page's; 404; 408 a body too slow; 413 a body over
    its limit; 503 too many at once) and one line. `close`: the answer closes the connection (the rest
    of the body was not read)."""

    def __init__(self, message: str, status: int = 400, close: bool = False):
        super().__init__(message)
        self.status, self.close = status, close


class ServerStopping(Exception):
    """The server is shutting down: a computation under way stops at its next round."""


def make_app(
    models: DemoModels, stopping: threading.Event | None = None, hosts: frozenset[str] | None = None
) -> Starlette:
    """The app serving `models`. Setting `stopping` ends the computations under way at their next round.
    `hosts`: the host names a request's Host header may give (`HostsOnly`); None: any."""
    middleware = [Middleware(RequestsAtOnce, limit=MAX_REQUESTS)]
    if hosts is not None:
        middleware.append(Middleware(HostsOnly, hosts=hosts))
    middleware.append(Middleware(OwnPageOnly))
    return Starlette(routes=DemoEndpoints(models, stopping or threading.Event()).routes(), middleware=middleware)


class RequestsAtOnce:
    """ASGI middleware: at most `limit` requests answered at once; one more is refused (503, one line),
    its body read and dropped first (`refuse`). Each request answered holds its body, so this bounds the
    memory the bodies take: `limit` times the largest (an upload)."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.running = app, limit, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.running >= self.limit:
            busy = BadRequest(
                f"the demo server is answering {self.limit} requests at once, its most; send this one again "
                "in a moment",
                503,
            )
            await refuse(busy, scope, receive, send)
            return
        self.running += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.running -= 1


class HostsOnly:
    """ASGI middleware: a request whose Host header names none of `hosts` is refused (400, one line).
    A server listening on this machine only takes the names of this machine alone, so a web page
    elsewhere cannot reach it through a DNS name of its own pointed at 127.0.0.1 (DNS rebinding) and
    read its answers. A request without a Host header (HTTP/1.0; no browser sends one) is served."""

    def __init__(self, app, hosts: frozenset[str]):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            host = host_name(dict(scope["headers"]).get(b"host"))
            if host is not None and host not in self.hosts:
                refusal = BadRequest(
                    f"this demo server listens on this machine only and answers for {', '.join(sorted(self.hosts))}, "
                    f"not the host '{host[:60]}'; open the address it printed, or start it with --host 0.0.0.0"
                )
                await refuse(refusal, scope, receive, send)
                return
        await self.app(scope, receive, send)


class OwnPageOnly:
    """ASGI middleware: a request with an Origin header other than the page's own origin (the scheme the
    server serves, and the host and port of the request's Host header, as the browser sent them) is
    refused (403, one line). A browser sends Origin with every POST, and with any request a script of
    another site makes; so a page of another site, open in the same browser, cannot make the server
    compute, even where the browser would not let it read the answer. `Origin: null` (a sandboxed page,
    a local file) is another page's. A request without an Origin header (curl, a script; a page's own
    GET) is served."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            origins = [v.decode("latin-1").strip() for k, v in scope["headers"] if k == b"origin"]
            host = next((v for k, v in scope["headers"] if k == b"host"), None)
            own = own_origin(scope.get("scheme", "http"), host)
            foreign = [o for o in origins if own is None or origin_of(o) != own]
            if foreign:
                page = "the address it printed" if own is None else origin_text(own)
                refusal = BadRequest(
                    f"this demo server answers its own page only, and this request comes from the page at "
                    f"'{foreign[0][:80]}' (its Origin header); open {page} to use the demo",
                    403,
                )
                await refuse(refusal, scope, receive, send)
                return
        await self.app(scope, receive, send)


DEFAULT_PORTS = {"http": 80, "https": 443}
ORIGIN = re.compile(r"(https?)://([^/?#@\s\[\]:]+|\[[0-9a-f:.]+\])(?::([0-9]{1,5}))?", re.IGNORECASE)


def origin_of(text: str) -> tuple[str, str, int] | None:
    """An Origin header's (scheme, host, port), lower case, the scheme's default port filled in; None for
    anything that is not a web origin (`null`, a path, ...)."""
    found = ORIGIN.fullmatch(text)
    if found is None:
        return None
    scheme = found.group(1).lower()
    return scheme, found.group(2).lower(), int(found.group(3) or DEFAULT_PORTS[scheme])


def origin_text(origin: tuple[str, str, int]) -> str:
    """An origin as a browser writes it: `http://127.0.0.1:8000`, `http://localhost` (the default port left out)."""
    scheme, host, port = origin
    return f"{scheme}://{host}" + ("" if port == DEFAULT_PORTS[scheme] else f":{port}")


def own_origin(scheme: str, host: bytes | None) -> tuple[str, str, int] | None:
    """The origin of the page this request's Host header names, as `origin_of` reads one; None without a
    Host header (no browser's request), or with one that names no host."""
    if host is None:
        return None
    return origin_of(f"{scheme}://{host.decode('latin-1').strip()}")


def host_name(header: bytes | None) -> str | None:
    """The host of a Host header, lower case, without its port or a final dot: `[::1]` for `[::1]:8000`."""
    if header is None:
        return None
    text = header.decode("latin-1").strip()
    name, _, port = text.rpartition(":") if text.rfind(":") > text.rfind("]") else (text, "", "")
    return (name if is_decimal(port) else text).lower().rstrip(".")


def page_file(name: str) -> bytes:
    return (resources.files("vitmask.demo") / "static" / name).read_bytes()


class DemoEndpoints:
    """The page and the endpoints of one server: the models it serves, the lock, the stop."""

    def __init__(self, models: DemoModels, stopping: threading.Event):
        self.models, self.stopping = models, stopping
        self.data = models.config.data
        self.size, self.patch = self.data.image_size, self.data.patch_size
        self.lock = threading.Lock()  # one model computation at a time: torch's threads serve one request
        self.decoding = threading.Lock()  # one upload decoded at a time: up to 4096x4096 pixels each
        self.page = {"index.html": page_file("index.html"), "demo.js": page_file("demo.js")}

    def routes(self) -> list[Route]:
        return [
            Route("/", self.index, methods=["GET"]),
            Route("/demo.js", self.script, methods=["GET"]),
            Route("/api/info", self.info, methods=["GET"]),
            Route("/api/examples", self.examples, methods=["GET"]),
            Route("/api/upload", self.upload, methods=["POST"]),
            Route("/api/fill", self.fill, methods=["POST"]),
            Route("/api/sample", self.sample, methods=["POST"]),
            Route("/api/classify", self.classify, methods=["POST"]),
        ]

    # ---- the page -------------------------------------------------------------------------------------
    async def index(self, request: Request) -> Response:
        return Response(self.page["index.html"], media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    async def script(self, request: Request) -> Response:
        return Response(self.page["demo.js"], media_type="text/javascript; charset=utf-8", headers=SECURITY_HEADERS)

    async def info(self, request: Request) -> Response:
        m, d = self.models, self.data
        classifier = None
        if m.classifier is not None:
            names = m.classifier.names
            classifier = {"name": m.classifier_name, "classes": names, "top_k": min(5, len(names))}
        return answer(
            {
                "model": {
                    "name": m.name,
                    "image_size": d.image_size,
                    "patch_size": d.patch_size,
                    "patches": d.num_patches,
                    "fit": d.fit,
                },
                "classifier": classifier,
                "fill": {k: v for k, (_, v) in FILL_FIELDS.items() if v is not None},
                "sample": {k: v for k, (_, v) in SAMPLE_FIELDS.items()},
                "orders": list(ORDERS),
                "limits": {"upload_bytes": MAX_UPLOAD_BYTES, "upload_side": MAX_UPLOAD_SIDE},
            }
        )

    async def examples(self, request: Request) -> Response:
        try:
            start = query_int(request, "start", 0, 0)
            count = query_int(request, "count", 24, 1, EXAMPLES_PAGE)
        except BadRequest as e:
            return failure(e)
        images, source = await run_in_threadpool(self.models.examples.images)
        if images is None:
            return answer({"total": 0, "start": 0, "images": [], "why": source})
        chunk = images[start : start + count]  # (k, S, S)
        return answer({"total": len(images), "start": start, "images": [bits(x) for x in chunk], "source": source})

    # ---- computations ---------------------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        try:
            body = await read_body(request, MAX_UPLOAD_BYTES, "an uploaded image", upload_too_large())
            if not body:
                raise BadRequest("the upload is empty; choose a PNG, JPEG or BMP file")

            def read():
                with self.decoding:
                    return self._read_upload(body)

            return answer(await run_in_threadpool(read))
        except (BadRequest, UserError) as e:
            return failure(e)

    def _read_upload(self, body: bytes) -> dict:
        """inpaint's reading of --image: load_image_file (every mode, EXIF, the checks) and binarize_images."""
        with tempfile.TemporaryDirectory(prefix="vitmask-demo-") as tmp:
            path = Path(tmp) / "upload"
            path.write_bytes(body)
            try:
                check_upload(path)
                gray = load_image_file(path)  # (h, w) uint8
                h, w = gray.shape
                if self.data.fit == "none" and (h, w) != (self.size, self.size):
                    raise UserError(
                        f"the upload is {w} pixels wide and {h} high, and this model reads {self.size}x{self.size} "
                        f"images only (its data.fit is none); resize the image to {self.size}x{self.size} first"
                    )
                picture = binarize_images(gray.unsqueeze(0), self.data)[0]  # (S, S)
            except UserError as e:
                raise UserError(str(e).replace(str(path), "the upload")) from None
        notes = []
        if (h, w) != (self.size, self.size):
            fitted = f"fitted {w}x{h} to {self.size}x{self.size} (data.fit {self.data.fit})"
            notes.append(f"{fitted}, as vitmask inpaint reads it")
        share, trained = pixels_share(picture), self.models.foreground_share
        if trained is not None and far_from(share, trained, 1):  # the warning vitmask inpaint gives
            notes.append(
                f"{share:.0%} of it is foreground (white) after the model's preprocessing, where its training images "
                f"were {trained:.0%}: fills of it are likely wrong; upload it drawn as they are (ink and background "
                "the same way round)"
            )
        return {"pixels": bits(picture), "note": "; ".join(notes)}

    async def fill(self, request: Request) -> Response:
        try:
            f = await read_fields(request, FILL_FIELDS, self.json_limit(), "fill")
            picture = parse_bits(f["pixels"], self.size, "pixels")  # (S, S)
            pix_mask = parse_bits(f["mask"], self.size, "mask").bool()  # (S, S)
            options = inpaint_options(f["iterative"], f["steps"], f["temperature"], f["order"], f["choice_temperature"])
            check_seed(f["seed"], "seed")
            mask = pixels_to_patches(pix_mask, self.patch)  # (N,)

            def run(on_round):
                return fill_image(self.models.model, picture, mask, self.patch, options, f["seed"], 1, on_round)

            filled, rounds = await run_in_threadpool(self._compute, run)
        except (BadRequest, UserError) as e:
            return failure(e)
        except ServerStopping:
            return stopping()
        return answer(
            {"pixels": bits(filled[0]), "rounds": rounds, "filled_patches": int(mask.sum()), "patches": len(mask)}
        )

    async def sample(self, request: Request) -> Response:
        try:
            f = await read_fields(request, SAMPLE_FIELDS, self.json_limit(), "sample")
            options = DecodeOptions(f["steps"], f["temperature"], f["order"], f["choice_temperature"])
            check_seed(f["seed"], "seed")
            m = self.models

            def run(on_round):
                return sample_from_seed(m.model, 1, self.size, self.patch, options, f["seed"], m.device, on_round)

            images, rounds = await run_in_threadpool(self._compute, run)
        except (BadRequest, UserError) as e:
            return failure(e)
        except ServerStopping:
            return stopping()
        return answer({"pixels": bits(images[0]), "rounds": rounds, "patches": self.data.num_patches})

    async def classify(self, request: Request) -> Response:
        classifier = self.models.classifier
        try:
            if classifier is None:
                raise BadRequest(
                    "this demo serves no classifier; start it with --classifier PATH (a fine-tuned classifier)", 404
                )
            f = await read_fields(request, CLASSIFY_FIELDS, self.json_limit(), "classify")
            picture = parse_bits(f["pixels"], self.size, "pixels")  # (S, S)
            check_top_k(f["top_k"], len(classifier.classes), "top_k")
            with_lock = self._locked(lambda: classifier.top_k_of_pixels(picture.unsqueeze(0), f["top_k"]))
            top = await run_in_threadpool(with_lock)
        except (BadRequest, UserError) as e:
            return failure(e)
        rows = zip(top.names[0], top.labels[0].tolist(), top.probabilities[0].tolist(), strict=True)
        return answer({"top": [{"name": n, "label": v, "probability": p} for n, v, p in rows]})

    # ---- helpers --------------------------------------------------------------------------------------
    def json_limit(self) -> int:
        return 2 * self.size * self.size + JSON_SLACK

    def _locked(self, work: Callable):
        def run():
            with self.lock:
                return work()

        return run

    def _compute(self, run: Callable) -> tuple[torch.Tensor, list[dict]]:
        """`run(on_round)` under the lock -> its images, and each round of its first row: the patches it
        fixed and the probability of the class each got. A stopping server ends it at its next round."""
        rounds = []

        def on_round(r: DecodeRound) -> None:
            if self.stopping.is_set():
                raise ServerStopping()
            picked = r.picked[0].nonzero().flatten()  # (k,)
            rounds.append({"patches": picked.tolist(), "probability": r.probability[0, picked].tolist()})

        with self.lock:
            if self.stopping.is_set():
                raise ServerStopping()
            images = run(on_round)
        return images.cpu(), rounds


# ---- requests and answers -------------------------------------------------------------------------------
class AsciiJSONResponse(JSONResponse):
    """JSON in ASCII: every other character as a JSON escape, so text that is not UTF-8 (a path's
    undecodable bytes, a lone surrogate sent in a request and named in its error) is still an answer."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def answer(payload: dict) -> JSONResponse:
    return AsciiJSONResponse(payload, headers={"Cache-Control": "no-store"})


def failure(e: Exception) -> JSONResponse:
    status = getattr(e, "status", 400)
    message = " ".join(str(e).split())
    headers = {"Cache-Control": "no-store"} | ({"Connection": "close"} if getattr(e, "close", False) else {})
    return AsciiJSONResponse({"error": message}, status_code=status, headers=headers)


async def refuse(e: BadRequest, scope, receive, send) -> None:
    """Answer a request refused before its body was read: the body is read and dropped first (`drain`),
    so that a client still sending it reads the answer rather than a reset connection."""
    if not await drain(scope, receive):
        e.close = True
    await failure(e)(scope, receive, send)


async def drain(scope, receive) -> bool:
    """Read a request's body to its end and drop it: whether it ended, within the body's time limits and
    DISCARD_BYTES (a Content-Length over DISCARD_BYTES is not read at all)."""
    declared = dict(scope["headers"]).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > DISCARD_BYTES:
        return False
    total = 0
    try:
        async for chunk in body_chunks(receive):
            total += len(chunk)
            if total > DISCARD_BYTES:
                return False
    except BadRequest:  # too slow
        return False
    except ClientDisconnect:  # no one to answer
        pass
    return True


def stopping() -> JSONResponse:
    return AsciiJSONResponse({"error": "the demo server is stopping; start it again to go on"}, status_code=503)


def size_text(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def upload_too_large() -> str:
    """The refusal of an upload over MAX_UPLOAD_BYTES; the page says the same before it sends one (demo.js)."""
    return f"the image is over {size_text(MAX_UPLOAD_BYTES)}, the largest upload the demo reads; choose a smaller one"


async def body_chunks(receive):
    """The chunks of a request's body as they arrive, each within BODY_STALL_SECONDS of the one before and
    all within BODY_SECONDS; else BadRequest 408 (closing the connection). A client gone: ClientDisconnect."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BODY_SECONDS
    while True:
        remaining = deadline - loop.time()
        last = remaining <= BODY_STALL_SECONDS  # this wait ends at the body's deadline
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            message = await asyncio.wait_for(receive(), min(BODY_STALL_SECONDS, remaining))
        except asyncio.TimeoutError:
            if last:
                why = f"took over {BODY_SECONDS} s to arrive; send it again on a faster connection"
            else:
                why = f"stopped arriving (nothing came for {BODY_STALL_SECONDS} s); send it again"
            raise BadRequest(f"the request's body {why}", 408, close=True) from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        if message.get("body"):
            yield message["body"]
        if not message.get("more_body", False):
            return


async def read_body(request: Request, limit: int, what: str, too_large: str | None = None) -> bytes:
    """The request's body, refused (413, `too_large` or a line naming `what`) past `limit` bytes, known
    from its Content-Length or as it arrives. The body of a refusal is read to its end and dropped before
    the answer (up to DISCARD_BYTES: past that, or a Content-Length past it, the answer closes the
    connection); a body too slow is 408 (`body_chunks`)."""
    refusal = too_large or f"{what} may be at most {size_text(limit)}; send a smaller one"
    declared = request.headers.get("content-length")
    if declared is not None and not is_decimal(declared):
        raise BadRequest(f"the Content-Length header '{declared[:40]}' is not a byte count", close=True)
    if declared is not None and int(declared) > DISCARD_BYTES:
        raise BadRequest(refusal, 413, close=True)
    over = declared is not None and int(declared) > limit
    chunks, total = [], 0
    try:
        async for chunk in body_chunks(request.receive):
            total += len(chunk)
            over = over or total > limit
            if over:
                chunks.clear()
                if total > DISCARD_BYTES:
                    raise BadRequest(refusal, 413, close=True)
            else:
                chunks.append(chunk)
    except ClientDisconnect:  # the client went away, or its chunked body broke off: no one reads the answer
        raise BadRequest(f"{what} ended before its body did; send it again") from None
    except BadRequest as e:
        if over and e.status == 408:  # a body over its limit, then too slow: the limit is the answer
            raise BadRequest(refusal, 413, close=True) from None
        raise
    if over:
        raise BadRequest(refusal, 413)
    return b"".join(chunks)


async def read_fields(request: Request, spec: dict[str, tuple[type, object]], limit: int, what: str) -> dict:
    """A JSON object body holding the fields of `spec` (name -> (type, default; None: required)), each checked."""
    body = await read_body(request, limit, f"a {what} request")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise BadRequest(f"the {what} request is not JSON; send a JSON object") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the {what} request must be a JSON object with the fields {', '.join(spec)}")
    unknown = sorted(set(data) - set(spec))
    if unknown:
        raise BadRequest(f"the {what} request has no field '{unknown[0][:40]}'; its fields: {', '.join(spec)}")
    fields = {}
    for name, (kind, default) in spec.items():
        if name not in data:
            if default is None:
                raise BadRequest(f"the {what} request needs the field '{name}'")
            fields[name] = default
            continue
        fields[name] = typed(data[name], kind, name)
    return fields


TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def typed(value, kind: type, name: str):
    """A JSON value as `kind` (an integer is a number; a bool is neither), else a BadRequest naming the field."""
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise BadRequest(f"{name} is too large a number; pass a finite one") from None
    if not ok:
        raise BadRequest(f"{name} must be {TYPE_NAMES[kind]}, got {type(value).__name__.replace('NoneType', 'null')}")
    return value


BITS = re.compile(r"[01]*")


def parse_bits(value: str, size: int, name: str) -> torch.Tensor:
    """A string of size*size characters '0'/'1' -> (size, size) uint8 0/1."""
    n = size * size
    if len(value) != n or not BITS.fullmatch(value):
        raise BadRequest(
            f"{name} must be {n} characters 0 or 1 (the {size}x{size} image, row by row), got "
            f"{len(value)} characters{'' if BITS.fullmatch(value) else ' with others than 0 and 1'}"
        )
    return (torch.frombuffer(bytearray(value.encode("ascii")), dtype=torch.uint8) - ord("0")).view(size, size)


def bits(image: torch.Tensor) -> str:
    """(S, S) 0/1 -> its S*S characters '0'/'1', row by row."""
    return (image.flatten().to(torch.uint8).cpu() + ord("0")).numpy().tobytes().decode("ascii")


def is_decimal(text: str) -> bool:
    """Digits 0-9 only: str.isdigit alone takes '²' and other digits int() refuses."""
    return text.isascii() and text.isdigit()


def query_int(request: Request, name: str, default: int, lo: int, hi: int | None = None) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    if not is_decimal(text) or len(text) > 9 or int(text) < lo or (hi is not None and int(text) > hi):
        top = f" to {hi}" if hi is not None else " or more"
        raise BadRequest(f"?{name}= must be an integer {lo}{top}, got '{text[:40]}'")
    return int(text)


def check_upload(path: Path) -> None:
    """Refuse an image of a format outside UPLOAD_FORMATS, or over MAX_UPLOAD_SIDE pixels a side, from its
    header, before any pixel is decoded."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the size is checked just below
            with Image.open(path) as im:
                w, h = im.size
                kind = im.format
    except Exception:  # not an image, or a broken one: load_image_file says so in its own words
        return
    if kind not in UPLOAD_FORMATS:
        raise UserError(
            f"the upload is a {kind} file, which the demo does not read; convert it to PNG (or JPEG, BMP, GIF, TIFF, "
            "WebP) first"
        )
    if max(w, h) > MAX_UPLOAD_SIDE:
        raise UserError(
            f"the upload is {w}x{h} pixels; the demo reads images up to {MAX_UPLOAD_SIDE} pixels a side; "
            "shrink it first"
        )
