"""vitmask demo's server through Starlette's TestClient: every endpoint, each bad input, two clients at
once, and its numbers against the CLI's.

The tiny stand-in models (tests/demo_models.py) are a masked-patch model on 16x16 shapes, exported,
and a classifier fine-tuned from it on the shapes' labels. Expectations are independent of the server:
`vitmask inpaint`, `vitmask sample` and `vitmask predict` run on the same image, mask, options and seed
(their PNG and JSON outputs read back pixel by pixel), images binarized by hand (>= 128), the shapes
generator's own test split, and the CLI's option defaults read from its parser.
"""

import contextlib
import dataclasses
import io
import json
import re
import shutil
import socket
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from PIL import Image

from tests.conftest import train_tiny
from tests.demo_models import SHAPES, SIZE, tiny_models

pytest.importorskip("starlette", reason="the demo extra (starlette) is not installed")
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the dev extra)")

with warnings.catch_warnings():  # Starlette 1.10 prefers httpx2; httpx (the pinned dev extra) works the same
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient` is deprecated")
    from starlette.testclient import TestClient  # noqa: E402

from vitmask.data.batches import load_splits  # noqa: E402
from vitmask.demo.app import MAX_UPLOAD_BYTES, MAX_UPLOAD_SIDE, make_app  # noqa: E402
from vitmask.demo.models import Examples, open_models  # noqa: E402
from vitmask.errors import UserError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
N = (SIZE // 2) ** 2  # 64 patches


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(masked-patch checkpoint, its export dir, the classifier's export dir)."""
    return tiny_models(tmp_path_factory.mktemp("demo-models"))


@pytest.fixture(scope="module")
def served(models):
    return open_models(models[1], models[2], "cpu")


@pytest.fixture(scope="module")
def client(served):
    return TestClient(make_app(served))


# ---- helpers -----------------------------------------------------------------------------------------------
def bits(a) -> str:
    return "".join("1" if v else "0" for v in np.asarray(a).flatten())


def from_bits(s: str, side: int = SIZE) -> np.ndarray:
    return (np.frombuffer(s.encode(), dtype=np.uint8) - ord("0")).reshape(side, side)


def png_bytes(array: np.ndarray) -> bytes:
    """A PNG of the array: uint8 (H, W) as L, (H, W, 4) as RGBA; uint16 (H, W) as 16-bit gray (I;16)."""
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def read_binary_png(path) -> np.ndarray:
    """A PNG the CLI wrote (white = 1) as 0/1 pixels, by hand."""
    return (np.array(Image.open(path).convert("L")) >= 128).astype(np.uint8)


def a_digit_like_gray_image() -> np.ndarray:
    """A 16x16 gray image: a thick ring and a bar, with gray levels on both sides of 128."""
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    ring = np.abs(np.hypot(y - 7.5, x - 6.5) - 4.5) < 1.3
    gray = np.where(ring, 230, 20).astype(np.uint8)
    gray[11:14, 9:15] = 140  # just above the threshold
    gray[2:4, 11:15] = 120  # just below it
    return gray


def post_ok(client, path, **payload) -> dict:
    res = client.post(path, json=payload)
    assert res.status_code == 200, res.text
    return res.json()


def assert_refused(res, status: int, *needles: str) -> None:
    """An answer {"error": one line} with `status`, naming every needle."""
    assert res.status_code == status, (res.status_code, res.text)
    message = res.json()["error"]
    assert "\n" not in message and "Traceback" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def cli_defaults(verb: str) -> dict:
    """The option defaults of `vitmask VERB`, read from the parser (independent of the server)."""
    from vitmask.cli import commands

    command = typer.main.get_command(commands.app).commands[verb]
    return {p.name: p.default for p in command.params}


# ---- the page and what it learns of the models ------------------------------------------------------------
def test_the_page_and_its_script_are_served_and_load_nothing_from_elsewhere(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<canvas id="image-canvas"' in page.text and '<script src="/demo.js"' in page.text
    script = client.get("/demo.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    for text in (page.text, script.text):  # no CDN, no font service, no absolute URL at all
        assert "http://" not in text and "https://" not in text and "//cdn" not in text
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "connect-src 'self'" in policy
    assert client.get("/nothing-here").status_code == 404
    assert client.post("/").status_code == 405


def test_info_names_the_models_and_the_clis_defaults(client, models):
    info = client.get("/api/info").json()
    assert info["model"] == {"name": str(models[1]), "image_size": 16, "patch_size": 2, "patches": N, "fit": "pad"}
    assert info["classifier"]["name"] == str(models[2]) and info["classifier"]["classes"] == SHAPES
    inpaint, sample = cli_defaults("inpaint"), cli_defaults("sample")
    for key in ("iterative", "steps", "temperature", "seed", "order", "choice_temperature"):
        assert info["fill"][key] == inpaint[key], key
    for key in ("steps", "temperature", "seed", "order", "choice_temperature"):
        assert info["sample"][key] == sample[key], key
    assert info["limits"] == {"upload_bytes": MAX_UPLOAD_BYTES, "upload_side": MAX_UPLOAD_SIDE}


# ---- test images ---------------------------------------------------------------------------------------------
def test_the_test_images_of_a_users_checkpoint_are_its_configs_test_split(client, served):
    expected = load_splits(served.config)["test"]  # (64, 16, 16): the shapes generator's own split
    first = client.get("/api/examples", params={"start": 0, "count": 5}).json()
    assert first["total"] == len(expected)
    assert [from_bits(b).tolist() for b in first["images"]] == expected[:5].tolist()
    last = client.get("/api/examples", params={"start": len(expected) - 2, "count": 10}).json()
    assert [from_bits(b).tolist() for b in last["images"]] == expected[-2:].tolist()


def test_examples_npz_in_a_model_folder_is_what_the_picker_offers(models, tmp_path):
    folder = tmp_path / "with-examples"
    shutil.copytree(models[1], folder)
    images = (np.random.default_rng(0).random((7, SIZE, SIZE)) < 0.4).astype(np.uint8)
    np.savez(folder / "examples.npz", images=images)
    client = TestClient(make_app(open_models(folder, None, "cpu")))
    answer = client.get("/api/examples", params={"count": 100}).json()
    assert answer["total"] == 7 and [from_bits(b).tolist() for b in answer["images"]] == images.tolist()


@pytest.mark.parametrize(
    "content, needle",
    [
        ({"images": np.zeros((3, 8, 8), np.uint8)}, "(n, 16, 16) uint8 0/1"),
        ({"images": np.full((3, 16, 16), 255, np.uint8)}, "(n, 16, 16) uint8 0/1"),
        ({"pictures": np.zeros((3, 16, 16), np.uint8)}, "no array 'images'"),
        (None, "not a readable .npz"),
    ],
)
def test_a_bad_examples_npz_hides_the_picker_and_says_why(models, tmp_path, content, needle):
    folder = tmp_path / "bad-examples"
    shutil.copytree(models[1], folder)
    if content is None:
        (folder / "examples.npz").write_bytes(b"not a zip archive")
    else:
        np.savez(folder / "examples.npz", **content)
    answer = TestClient(make_app(open_models(folder, None, "cpu"))).get("/api/examples").json()
    assert answer["total"] == 0 and answer["images"] == [] and needle in answer["why"]


def test_unreadable_data_hides_the_picker_and_nothing_is_downloaded(served, tmp_path):
    """A config reading torchvision's MNIST with data.download true, from an empty folder: no download."""
    empty = tmp_path / "no-mnist"
    empty.mkdir()
    data = dataclasses.replace(served.config.data, source="torchvision", name="MNIST", path=str(empty), download=True)
    images, why = Examples(tmp_path / "not-a-folder.pt", dataclasses.replace(served.config, data=data)).images()
    assert images is None and "data.download is false" in why
    assert list(empty.rglob("*")) == []
    data = dataclasses.replace(served.config.data, source="idx", path=str(tmp_path / "missing"))
    images, why = Examples(tmp_path / "x.pt", dataclasses.replace(served.config, data=data)).images()
    assert images is None and str(tmp_path / "missing") in why


@pytest.mark.parametrize(
    "query", ["start=-1", "start=x", "count=0", "count=101", "count=1e3", "start=%C2%B2", "count=%D9%A1"]
)  # the last two: '²' and the Arabic-Indic digit one, digits to str.isdigit that int() refuses or reads as 1
def test_bad_example_queries_are_refused(client, query):
    assert_refused(client.get(f"/api/examples?{query}"), 400, "must be an integer")


# ---- uploads ------------------------------------------------------------------------------------------------
def test_an_upload_is_binarized_as_inpaint_reads_its_image(client):
    gray = a_digit_like_gray_image()
    answer = post_upload(client, png_bytes(gray))
    assert from_bits(answer["pixels"]).tolist() == (gray >= 128).astype(np.uint8).tolist()
    assert answer["note"] == ""
    wide = np.zeros((12, 20), np.uint8)  # 20 wide, 12 high: pad crops 2 columns each side, pads 2 rows each side
    wide[:, 2] = 255
    wide[:, 3] = 255
    wide[5, :] = 200
    answer = post_upload(client, png_bytes(wide))
    expected = np.zeros((SIZE, SIZE), np.uint8)
    expected[2:14, :] = wide[:, 2:18] >= 128
    assert from_bits(answer["pixels"]).tolist() == expected.tolist()
    assert "fitted 20x12 to 16x16 (data.fit pad)" in answer["note"]


def test_an_upload_far_from_the_training_images_says_so_in_its_note(client, served):
    """The warning vitmask inpaint gives, on the page: the model records the share of 1-pixels of its
    training shapes, and an image drawn the other way round (white paper, dark ink) is far from it."""
    trained = served.foreground_share
    gray = a_digit_like_gray_image()
    assert abs((gray >= 128).mean() - trained) <= 0.25  # drawn as the training images are: no note
    assert post_upload(client, png_bytes(gray))["note"] == ""
    inverted = 255 - gray
    share = (inverted >= 128).mean()  # counted here: the paper is foreground
    assert share - trained > 0.25
    note = post_upload(client, png_bytes(inverted))["note"]
    assert note.startswith(f"{share:.0%} of it is foreground (white) after the model's preprocessing, where its")
    assert f"training images were {trained:.0%}: fills of it are likely wrong" in note


def test_an_upload_of_an_odd_but_readable_mode_reads_its_levels(client):
    """16-bit gray: level v is v * 255 / 65535; 40000 -> 156 (foreground), 30000 -> 117 (background)."""
    levels = np.full((SIZE, SIZE), 30000, np.uint16)
    levels[4:9, 3:12] = 40000
    answer = post_upload(client, png_bytes(levels))
    assert from_bits(answer["pixels"]).tolist() == (levels == 40000).astype(np.uint8).tolist()


def post_upload(client, body: bytes) -> dict:
    res = client.post("/api/upload", content=body)
    assert res.status_code == 200, res.text
    return res.json()


def transparent_png() -> bytes:
    rgba = np.zeros((SIZE, SIZE, 4), np.uint8)
    rgba[..., 3] = 255
    rgba[0, 0, 3] = 0
    return png_bytes(rgba)


def png_of_size(width: int, height: int) -> bytes:
    """A black PNG of width x height pixels: a few hundred bytes, even at 4,097 pixels a side."""
    return png_bytes(np.zeros((height, width), np.uint8))


def padded_to(body: bytes, size: int) -> bytes:
    """`body` with zero bytes after it, `size` bytes in all: a PNG still (its decoder stops at its end)."""
    return body + b"\0" * (size - len(body))


TOO_LARGE = "the image is over 8 MiB, the largest upload the demo reads; choose a smaller one"  # demo.js says it too


@pytest.mark.parametrize(
    "body, status, needles",
    [
        (b"", 400, ["empty"]),
        (b"this is not an image", 400, ["the upload is not a readable image", "PNG, JPEG or BMP"]),
        (png_bytes(np.zeros((SIZE, SIZE), np.uint8))[:40], 400, ["the upload is not a readable image"]),
        (transparent_png(), 400, ["the upload has transparent pixels"]),
        (png_of_size(MAX_UPLOAD_SIDE + 1, 8), 400, [f"{MAX_UPLOAD_SIDE + 1}x8 pixels", f"up to {MAX_UPLOAD_SIDE} "]),
        (png_of_size(8, MAX_UPLOAD_SIDE + 1), 400, [f"8x{MAX_UPLOAD_SIDE + 1} pixels", f"up to {MAX_UPLOAD_SIDE} "]),
        (padded_to(png_of_size(SIZE, SIZE), MAX_UPLOAD_BYTES + 1), 413, [TOO_LARGE]),
    ],
    ids=["empty", "not-an-image", "truncated", "transparent", "too-wide", "too-tall", "too-many-bytes"],
)
def test_a_bad_upload_is_one_line_and_names_no_temporary_file(client, body, status, needles):
    res = client.post("/api/upload", content=body)
    assert_refused(res, status, *needles)
    assert "/tmp" not in res.json()["error"] and "vitmask-demo-" not in res.json()["error"]


def test_an_upload_at_each_limit_is_read(client):
    """The limits' other side: MAX_UPLOAD_SIDE pixels wide, or high, and MAX_UPLOAD_BYTES bytes are read."""
    for width, height in ((MAX_UPLOAD_SIDE, 8), (8, MAX_UPLOAD_SIDE)):
        answer = post_upload(client, png_of_size(width, height))
        assert answer["pixels"] == "0" * SIZE * SIZE and f"fitted {width}x{height} to 16x16" in answer["note"]
    assert post_upload(client, padded_to(png_of_size(SIZE, SIZE), MAX_UPLOAD_BYTES))["pixels"] == "0" * SIZE * SIZE


def test_a_wrong_size_upload_is_refused_where_the_model_fits_none(served):
    fit_none = dataclasses.replace(served.config, data=dataclasses.replace(served.config.data, fit="none"))
    client = TestClient(make_app(dataclasses.replace(served, config=fit_none)))
    assert post_upload(client, png_bytes(np.zeros((SIZE, SIZE), np.uint8)))["note"] == ""
    for width, height in ((12, 20), (20, SIZE), (SIZE, 20), (SIZE, 12)):  # each side wrong alone, and both
        res = client.post("/api/upload", content=png_of_size(width, height))
        assert_refused(res, 400, f"the upload is {width} pixels wide and {height} high", "reads 16x16 images only")
        assert "resize the image" in res.json()["error"]
        assert "set data.fit" not in res.json()["error"]  # a setting the page has no way to change


def test_an_upload_of_a_format_pillow_hands_to_another_program_is_refused_before_it_is_decoded(client, monkeypatch):
    """EPS: Pillow opens it, then runs Ghostscript on its PostScript to decode it; an upload never gets there."""
    from PIL import EpsImagePlugin

    ran = []
    monkeypatch.setattr(EpsImagePlugin, "has_ghostscript", lambda: True)
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *args, **kwargs: ran.append(args))
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nshowpage\n"
    assert_refused(client.post("/api/upload", content=eps), 400, "the upload is a EPS file", "convert it to PNG")
    assert ran == []
    for fmt in ("JPEG", "BMP", "GIF", "TIFF", "WEBP", "PPM", "TGA"):  # formats decoded in this process still read
        buf = io.BytesIO()
        Image.fromarray(np.zeros((SIZE, SIZE), np.uint8)).save(buf, format=fmt)
        assert post_upload(client, buf.getvalue())["pixels"] == "0" * SIZE * SIZE, fmt


def test_an_upload_declaring_too_many_bytes_is_refused_whatever_its_body(client):
    res = client.post("/api/upload", content=b"x" * 10, headers={"content-length": str(MAX_UPLOAD_BYTES + 1)})
    assert_refused(res, 413, TOO_LARGE)
    res = client.post("/api/upload", content=b"x" * 10, headers={"content-length": "ten"})
    assert_refused(res, 400, "Content-Length header 'ten' is not a byte count")


def test_a_content_length_of_digits_other_than_0_to_9_is_refused(served):
    """'²' (Latin-1 0xB2), a digit to str.isdigit that int() refuses, sent as the header's raw byte."""
    sent = call_asgi(make_app(served), "/api/upload", [(b"content-length", b"\xb2")], [b"x"])
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error"] == "the Content-Length header '\u00b2' is not a byte count"


def test_an_upload_sent_in_chunks_is_cut_off_past_the_limit(client):
    """No Content-Length (chunked transfer): the body is counted as it arrives."""
    chunks = (b"\0" * (1 << 20) for _ in range(MAX_UPLOAD_BYTES // (1 << 20) + 2))
    assert_refused(client.post("/api/upload", content=chunks), 413, TOO_LARGE)
    chunks = (b"\0" * (1 << 20) for _ in range(MAX_UPLOAD_BYTES // (1 << 20)))  # at the limit: read
    assert_refused(client.post("/api/upload", content=chunks), 400, "the upload is not a readable image")


def test_a_body_past_what_is_read_and_dropped_is_answered_at_once_and_its_connection_closed(served):
    """A body over its limit is read to its end before the answer, but not past 64 MiB: there the answer
    comes, closing the connection, and the rest of the body is never asked for."""
    import asyncio

    def post(megabytes: int) -> tuple[list[dict], int]:
        asked, sent = [0], []

        async def receive():
            asked[0] += 1
            return {"type": "http.request", "body": b"\0" * (1 << 20), "more_body": asked[0] < megabytes}

        async def send(message):
            sent.append(message)

        asyncio.run(make_app(served)(post_scope("/api/upload", []), receive, send))
        return sent, asked[0]

    sent, asked = post(100)
    assert sent[0]["status"] == 413 and json.loads(sent[1]["body"])["error"] == TOO_LARGE
    assert (b"connection", b"close") in sent[0]["headers"] and asked == 65  # 65 MiB read: past 64
    sent, asked = post(20)  # over the limit, and all of it read
    assert sent[0]["status"] == 413 and json.loads(sent[1]["body"])["error"] == TOO_LARGE
    assert (b"connection", b"close") not in sent[0]["headers"] and asked == 20


# ---- fill, sample, classify: the CLI's numbers ---------------------------------------------------------------
FILLS = [
    ({}, []),  # the CLI's defaults: one shot, most likely classes
    (
        {"iterative": True, "steps": 4, "temperature": 1.0, "seed": 3, "order": "random"},
        ["--iterative", "--steps", "4", "--temperature", "1", "--seed", "3", "--order", "random"],
    ),
    (
        {"iterative": True, "steps": 6, "temperature": 0.7, "seed": 11, "choice_temperature": 4.5},
        ["--iterative", "--steps", "6", "--temperature", "0.7", "--seed", "11", "--choice-temperature", "4.5"],
    ),
]


@pytest.mark.parametrize("options, flags", FILLS, ids=["one-shot", "iterative-random", "iterative-maskgit"])
def test_a_fill_is_vitmask_inpaints_for_the_same_image_mask_and_seed(client, models, run_cli, tmp_path, options, flags):
    gray = a_digit_like_gray_image()
    image = tmp_path / "image.png"
    image.write_bytes(png_bytes(gray))
    pixels = post_upload(client, image.read_bytes())["pixels"]
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[5:11, 3:9] = 1  # a box, as the page's box tool paints it
    mask[1, 14] = 1  # and one brush pixel: its whole patch is filled
    Image.fromarray(mask * 255).save(tmp_path / "mask.png")
    answer = post_ok(client, "/api/fill", pixels=pixels, mask=bits(mask), **options)
    out = tmp_path / "filled.png"
    res = run_cli("inpaint", "--checkpoint", models[1], "--image", image, "--mask", tmp_path / "mask.png", "--out", out,
                  *flags)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert from_bits(answer["pixels"]).tolist() == read_binary_png(out).tolist()
    hidden = np.zeros((SIZE // 2, SIZE // 2), bool)  # the patches the mask touches, by hand
    hidden[2:6, 1:5] = True
    hidden[0, 7] = True
    assert answer["filled_patches"] == hidden.sum() == 17 and answer["patches"] == N
    filled = sorted(k for r in answer["rounds"] for k in r["patches"])
    assert filled == np.flatnonzero(hidden.flatten()).tolist()
    assert len(answer["rounds"]) == (options.get("steps", 1) if options.get("iterative") else 1)
    assert all(0 < p <= 1 for r in answer["rounds"] for p in r["probability"])


def test_a_fill_of_an_upload_of_another_size_is_inpaints_with_the_same_box(client, models, run_cli, tmp_path):
    gray = np.zeros((14, 22), np.uint8)
    gray[3:11, 5:16] = 255
    gray[6:8, 8:12] = 0
    image = tmp_path / "wide.png"
    image.write_bytes(png_bytes(gray))
    pixels = post_upload(client, image.read_bytes())["pixels"]
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[4:9, 6:12] = 1  # --box 6,4,12,9: x0,y0,x1,y1 with x1, y1 exclusive
    answer = post_ok(client, "/api/fill", pixels=pixels, mask=bits(mask), iterative=True, steps=3, temperature=1.0)
    out = tmp_path / "filled.png"
    res = run_cli("inpaint", "--checkpoint", models[1], "--image", image, "--box", "6,4,12,9", "--out", out,
                  "--iterative", "--steps", "3", "--temperature", "1")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert from_bits(answer["pixels"]).tolist() == read_binary_png(out).tolist()


def test_a_sample_is_vitmask_samples_for_the_same_seed(client, models, run_cli, tmp_path):
    answers = {}
    for seed in (5, 6):
        answers[seed] = post_ok(client, "/api/sample", steps=8, temperature=1.0, seed=seed, order="random")
        out = tmp_path / f"sample-{seed}.png"
        res = run_cli("sample", "--checkpoint", models[1], "--n", "1", "--steps", "8", "--temperature", "1",
                      "--seed", seed, "--out", out)  # fmt: skip
        assert res.returncode == 0, res.stderr
        drawn = read_binary_png(out)[::3, ::3]  # a grid of one image is the image (make_grid pads none), drawn 3x
        assert from_bits(answers[seed]["pixels"]).tolist() == drawn.tolist()
        assert sorted(k for r in answers[seed]["rounds"] for k in r["patches"]) == list(range(N))
        assert len(answers[seed]["rounds"]) == 8
    assert answers[5]["pixels"] != answers[6]["pixels"]


def test_the_rounds_answered_are_the_rounds_that_ran_each_fixing_a_patch(client):
    """The page's 'round n of T' counts the answer's rounds: min(steps, hidden patches), none empty."""
    blank = bits(np.zeros((SIZE, SIZE), np.uint8))
    for steps in (64, 100):  # at least the 64 patches: one patch a round, 64 rounds
        rounds = post_ok(client, "/api/sample", steps=steps, temperature=1.0, seed=2, order="random")["rounds"]
        assert [len(r["patches"]) for r in rounds] == [1] * N
        assert sorted(k for r in rounds for k in r["patches"]) == list(range(N))
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[4:12, 4:12] = 1  # the 4x4 patches of rows and columns 2-5: 16 hidden
    hidden = sorted(8 * r + c for r in range(2, 6) for c in range(2, 6))
    for steps, count in ((64, 16), (16, 16), (12, 12), (5, 5)):
        answer = post_ok(
            client, "/api/fill", pixels=blank, mask=bits(mask), iterative=True, steps=steps, temperature=1.0
        )
        per_round = [len(r["patches"]) for r in answer["rounds"]]
        assert len(per_round) == count and min(per_round) >= 1, (steps, per_round)
        assert sorted(k for r in answer["rounds"] for k in r["patches"]) == hidden


def test_the_top_k_is_vitmask_predicts(client, served, models, run_cli, tmp_path):
    images = load_splits(served.config)["test"][:3]
    for i, image in enumerate(images):
        answer = post_ok(client, "/api/classify", pixels=bits(image), top_k=3)
        path = tmp_path / f"image-{i}.png"
        Image.fromarray(image.numpy() * 255).save(path)
        out = tmp_path / f"top-{i}.json"
        res = run_cli("predict", "--checkpoint", models[2], "--input", path, "--out", out, "--top-k", "3")
        assert res.returncode == 0, res.stderr
        record = json.loads(out.read_text())[0]
        assert [t["name"] for t in answer["top"]] == record["classes"]
        assert [t["probability"] for t in answer["top"]] == record["probabilities"]
        assert [t["label"] for t in answer["top"]] == [SHAPES.index(n) for n in record["classes"]]


def test_without_a_classifier_the_page_has_no_classify_panel(models):
    client = TestClient(make_app(open_models(models[1], None, "cpu")))
    assert client.get("/api/info").json()["classifier"] is None
    res = client.post("/api/classify", json={"pixels": "0" * SIZE * SIZE})
    assert_refused(res, 404, "serves no classifier", "--classifier PATH")


# ---- bad requests ---------------------------------------------------------------------------------------------
def a_fill(**changes) -> dict:
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[4:8, 4:8] = 1
    return {"pixels": "0" * SIZE * SIZE, "mask": bits(mask), **changes}


BAD_FILLS = [
    ({"pixels": "01" * 10}, ["pixels must be 256 characters 0 or 1", "got 20 characters"]),
    ({"pixels": "2" * 256}, ["pixels must be 256", "others than 0 and 1"]),
    ({"pixels": 5}, ["pixels must be a string"]),
    ({"mask": "0" * 256}, ["cover no patch"]),
    ({"mask": "1" * 256}, ["cover all 64 patches"]),
    ({"steps": 0}, ["--steps must be at least 1"]),
    ({"steps": 2.5}, ["steps must be an integer"]),
    ({"steps": True}, ["steps must be an integer"]),
    ({"temperature": -1}, ["--temperature must be >= 0"]),
    ({"temperature": "hot"}, ["temperature must be a number, got str"]),
    ({"temperature": 10**400}, ["temperature is too large a number"]),
    ({"choice_temperature": -0.5}, ["--choice-temperature must be >= 0"]),
    ({"seed": 2**64}, ["seed must be an integer in"]),
    ({"seed": 10**30}, ["seed must be an integer in"]),
    ({"seed": None}, ["seed must be an integer, got null"]),
    ({"order": "sideways"}, ["--order must be one of confidence, random"]),
    ({"iterative": "yes"}, ["iterative must be true or false"]),
    ({"colour": "red"}, ["has no field 'colour'"]),
]


@pytest.mark.parametrize(
    "changes, needles", BAD_FILLS, ids=[f"{next(iter(c))}-{i}" for i, (c, _) in enumerate(BAD_FILLS)]
)  # noqa: E501
def test_a_bad_fill_request_is_one_line(client, changes, needles):
    assert_refused(client.post("/api/fill", json=a_fill(**changes)), 400, *needles)


@pytest.mark.parametrize(
    "path, body, status, needle",
    [
        ("/api/fill", b"{not json", 400, "is not JSON"),
        ("/api/fill", b"[1, 2]", 400, "must be a JSON object"),
        ("/api/fill", b'{"mask": "0"}', 400, "needs the field 'pixels'"),
        ("/api/fill", b"[" * 30000 + b"]" * 30000, 400, "is not JSON"),
        ("/api/fill", b'{"pixels": "' + b"0" * (600 << 10) + b'"}', 413, "a fill request may be at most"),
        ("/api/fill", b"\xff\xfe", 400, "is not JSON"),
        ("/api/sample", json.dumps({"temperature": float("nan")}).encode(), 400, "--temperature must be >= 0"),
        ("/api/sample", b'{"steps": 0}', 400, "--steps must be at least 1"),
        ("/api/sample", b'{"n": 4}', 400, "has no field 'n'"),
        ("/api/classify", b'{"pixels": "' + b"0" * 256 + b'", "top_k": 0}', 400, "top_k 0 is out of range"),
        ("/api/classify", b'{"pixels": "' + b"0" * 256 + b'", "top_k": 5}', 400, "the classifier has 4 classes"),
        ("/api/classify", b'{"pixels": "000"}', 400, "pixels must be 256 characters"),
    ],
)
def test_a_bad_request_body_is_one_line(client, path, body, status, needle):
    res = client.post(path, content=body, headers={"content-type": "application/json"})
    assert_refused(res, status, needle)


@pytest.mark.parametrize(
    "body, needle, echoed",
    [
        ('{"pixels": "0", "\\udcff": 1}', "has no field", "\udcff"),  # a lone surrogate as a field's name
        ('{"pixels": "0", "mask": "0", "order": "\\ud800"}', "must be 256 characters", None),
        ('{"steps": 4, "order": "\\ud800"}', "--order must be one of", "\ud800"),
    ],
)
def test_a_request_naming_text_that_is_not_utf8_gets_its_one_line(client, body, needle, echoed):
    path = "/api/sample" if body.startswith('{"steps"') else "/api/fill"
    res = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert_refused(res, 400, needle)
    assert echoed is None or echoed in res.json()["error"]


def test_a_model_path_that_is_not_utf8_is_named_in_the_info(served):
    name = "runs/model-\udcff.pt"  # a byte that is not UTF-8 in a path, as Python holds it (surrogateescape)
    client = TestClient(make_app(dataclasses.replace(served, name=name)))
    res = client.get("/api/info")
    assert res.status_code == 200 and res.json()["model"]["name"] == name
    assert res.content.isascii()


def post_scope(path: str, headers: list, host: str | None = "127.0.0.1:8000") -> dict:
    """The ASGI scope of a POST to `path` with `headers` (raw bytes) and a Host header `host` (None: none)."""
    host_header = [] if host is None else [(b"host", host.encode())]
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [*host_header, *headers], "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip


def call_asgi(
    app, path: str, headers: list, chunks: list[bytes], disconnect: bool = False, host: str | None = "127.0.0.1:8000"
) -> list[dict]:
    """POST `chunks` to `path` of the ASGI `app` directly, as a server would pass them (headers as raw
    bytes, Host `host`), then a disconnect if asked; the messages the app sent back."""
    import asyncio

    sent = []
    messages = [{"type": "http.request", "body": c, "more_body": disconnect or i + 1 < len(chunks)} for i, c in
                enumerate(chunks)] + ([{"type": "http.disconnect"}] if disconnect else [])  # fmt: skip
    messages = iter(messages)

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    asyncio.run(app(post_scope(path, headers, host), receive, send))
    return sent


def test_a_client_gone_before_its_body_ended_is_answered_and_the_server_goes_on(served):
    """A client that sends part of a body and disconnects (or whose chunked body breaks off): the app
    answers its one line to no one, raises nothing (no traceback in the server's output), and serves on."""
    app = make_app(served)
    for path in ("/api/upload", "/api/fill"):
        sent = call_asgi(app, path, [], [b"\x89PNG"], disconnect=True)
        assert sent[0]["status"] == 400, sent
        assert "ended before its body did" in json.loads(sent[1]["body"])["error"]
    assert post_ok(TestClient(app), "/api/sample", steps=2)["patches"] == N


# ---- the Host header -----------------------------------------------------------------------------------
LOCAL = frozenset({"localhost", "127.0.0.1", "[::1]"})


@pytest.mark.parametrize(
    "host, served_it",
    [
        ("127.0.0.1:8000", True),
        ("localhost:8000", True),
        ("LocalHost.:8000", True),  # names are case-blind, a final dot names the same host
        ("[::1]:8000", True),
        ("127.0.0.1", True),
        ("rebound.example:8000", False),  # a page's own name pointed at 127.0.0.1 (DNS rebinding)
        ("127.0.0.1.rebound.example", False),
        ("localhost:8000@rebound.example", False),
        ("[::1", False),
        ("", False),
    ],
)
def test_a_server_for_this_machine_answers_requests_for_its_names_only(served, host, served_it):
    client = TestClient(make_app(served, hosts=LOCAL))
    for res in (
        client.get("/", headers={"host": host}),
        client.get("/api/info", headers={"host": host}),
        client.post("/api/sample", json={"steps": 2}, headers={"host": host}),
    ):
        if served_it:
            assert res.status_code == 200, res.text
        else:
            assert_refused(res, 400, "answers for 127.0.0.1, [::1], localhost", "--host 0.0.0.0")


def test_a_json_request_at_its_limit_is_read_and_one_byte_more_is_refused(client):
    """A JSON request may hold two images of S*S characters and 64 KiB more: 66,048 bytes for 16x16."""
    limit = 2 * SIZE * SIZE + (64 << 10)
    for path in ("/api/sample", "/api/fill", "/api/classify"):
        fields = {"/api/sample": {"steps": 2}, "/api/fill": a_fill(), "/api/classify": {"pixels": "0" * SIZE * SIZE}}
        body = json.dumps(fields[path]).encode()
        at_limit = body + b" " * (limit - len(body))  # white space after the object: JSON still
        res = client.post(path, content=at_limit, headers={"content-type": "application/json"})
        assert res.status_code == 200, (path, res.text)
        res = client.post(path, content=at_limit + b" ", headers={"content-type": "application/json"})
        assert_refused(res, 413, "request may be at most")


# ---- the Origin header -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "origin, served_it",
    [
        (None, True),  # curl, a script: no Origin
        ("http://testserver", True),  # the page's own: TestClient's Host header is `testserver`
        ("http://testserver:80", True),  # the same origin, its default port written out
        ("null", False),  # a sandboxed page, a local file
        ("http://rebound.example", False),
        ("http://testserver:8000", False),  # another port of the same host: another page
        ("https://testserver", False),  # another scheme
        ("http://testserver.rebound.example", False),
        ("http://testserver/", False),  # not an origin at all
        ("", False),
    ],
)
def test_a_request_from_another_page_is_refused_and_one_without_an_origin_is_served(client, origin, served_it):
    headers = {} if origin is None else {"origin": origin}
    answers = (
        client.post("/api/sample", json={"steps": 2}, headers=headers),
        client.post("/api/classify", json={"pixels": "0" * SIZE * SIZE}, headers=headers),
        client.post("/api/upload", content=png_of_size(SIZE, SIZE), headers=headers),
        client.get("/api/info", headers=headers),
    )
    for res in answers:
        if served_it:
            assert res.status_code == 200, res.text
        else:
            assert_refused(res, 403, "answers its own page only", f"the page at '{origin}'", "open http://testserver")


def test_the_pages_own_origin_is_its_host_headers_as_the_browser_sends_it(served):
    """On 127.0.0.1:8000 the page's origin is http://127.0.0.1:8000; localhost:8000 is another page, though
    the same machine, and the Host header of the request decides which page is its own."""
    client = TestClient(make_app(served, hosts=LOCAL))
    own = {"host": "127.0.0.1:8000", "origin": "http://127.0.0.1:8000"}
    assert client.post("/api/sample", json={"steps": 2}, headers=own).status_code == 200
    assert client.post("/api/sample", json={"steps": 2}, headers={**own, "host": "[::1]:8000"}).status_code == 403
    res = client.post("/api/sample", json={"steps": 2}, headers={**own, "origin": "http://localhost:8000"})
    assert_refused(res, 403, "the page at 'http://localhost:8000'", "open http://127.0.0.1:8000 to use the demo")
    ipv6 = {"host": "[::1]:8000", "origin": "http://[::1]:8000"}
    assert client.post("/api/sample", json={"steps": 2}, headers=ipv6).status_code == 200


def test_a_request_without_a_host_header_is_served_unless_it_names_an_origin(served):
    """HTTP/1.0 needs no Host header, and no browser leaves it out: served, but not with an Origin (a page's)."""
    app = make_app(served, hosts=LOCAL)
    sent = call_asgi(app, "/api/sample", [], [b'{"steps": 2}'], host=None)
    assert sent[0]["status"] == 200 and len(json.loads(sent[1]["body"])["rounds"]) == 2
    sent = call_asgi(app, "/api/sample", [(b"origin", b"http://127.0.0.1:8000")], [b'{"steps": 2}'], host=None)
    assert sent[0]["status"] == 403 and "the address it printed" in json.loads(sent[1]["body"])["error"]


# ---- bodies that stall ---------------------------------------------------------------------------------------
def post_paced(app, path: str, chunks: list, pause: float, headers: list = ()) -> tuple[list[dict], float]:
    """POST `chunks` to the ASGI `app` with `headers`, `pause` seconds before each chunk after the first; a
    None in `chunks`: the client sends nothing more, ever. (The messages the app sent back, the seconds
    until they came.)"""
    import asyncio
    import time

    async def run() -> tuple[list[dict], float]:
        sent, start, messages = [], time.monotonic(), enumerate(chunks)

        async def receive():
            i, chunk = next(messages)
            await asyncio.sleep(3600 if chunk is None else pause if i else 0)
            return {"type": "http.request", "body": chunk, "more_body": i + 1 < len(chunks)}

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(app(post_scope(path, list(headers)), receive, send), 30)  # a test that ends
        return sent, time.monotonic() - start

    return asyncio.run(run())


def test_a_body_that_stalls_or_takes_too_long_is_answered_408_and_the_connection_closed(served, monkeypatch):
    import vitmask.demo.app as demo_app

    monkeypatch.setattr(demo_app, "BODY_STALL_SECONDS", 0.4)
    monkeypatch.setattr(demo_app, "BODY_SECONDS", 1.5)
    app = make_app(served)
    body = json.dumps({"steps": 2, "seed": 1}).encode()
    parts = [body[:5], body[5:10], body[10:]]
    sent, _ = post_paced(app, "/api/sample", parts, 0.2)  # in time: served
    assert sent[0]["status"] == 200 and len(json.loads(sent[1]["body"])["rounds"]) == 2
    for path, chunks, pause, why, within in [
        ("/api/sample", [body[:5], None], 0, "stopped arriving (nothing came for 0.4 s)", 0.4),
        ("/api/upload", [png_of_size(SIZE, SIZE)[:30], None], 0, "stopped arriving", 0.4),
        ("/api/sample", [body[i : i + 1] for i in range(len(body))], 0.3, "took over 1.5 s to arrive", 1.5),
    ]:
        sent, seconds = post_paced(app, path, chunks, pause)
        assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"], sent
        assert why in json.loads(sent[1]["body"])["error"]
        assert within <= seconds < within + 2.0, seconds
    # a request refused before its body is read (another page's): its body is waited for, in the same time
    sent, seconds = post_paced(app, "/api/sample", [body[:5], None], 0, [(b"origin", b"null")])
    assert sent[0]["status"] == 403 and (b"connection", b"close") in sent[0]["headers"], sent
    assert 0.4 <= seconds < 2.4, seconds
    sent, _ = post_paced(app, "/api/sample", parts, 0.2, [(b"origin", b"null")])  # its body in time: no close
    assert sent[0]["status"] == 403 and (b"connection", b"close") not in sent[0]["headers"], sent


# ---- a real server: uvicorn as vitmask demo runs it ----------------------------------------------------------
@contextlib.contextmanager
def real_server(served):
    """`vitmask demo`'s uvicorn server (serve.demo_server: its protocol and limits) in a thread of this
    process, on a free port of 127.0.0.1, serving `served` as the command does: (its port, the server)."""
    import asyncio

    pytest.importorskip("uvicorn", reason="the demo extra (uvicorn) is not installed")
    from vitmask.demo.serve import demo_server, listen, local_hosts

    sock = listen("127.0.0.1", 0)
    stopping = threading.Event()
    server = demo_server(make_app(served, stopping, local_hosts(sock, "127.0.0.1")), stopping)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    try:
        until(lambda: server.started)
        yield sock.getsockname()[1], server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def until(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the server did not get there in time"
        time.sleep(0.02)


def connect(port: int, head: bytes = b"") -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn.sendall(head)
    return conn


def read_answer(conn: socket.socket) -> bytes:
    """An answer's head and as much of its body as its Content-Length says."""
    answer = b""
    while chunk := conn.recv(65536):
        answer += chunk
        head, sep, body = answer.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head) if sep else None
        if sep and (length is None or len(body) >= int(length.group(1))):
            break
    return answer


def exchange(port: int, request: bytes) -> bytes:
    with connect(port, request) as conn:
        return read_answer(conn)


def closed_by_server(conn: socket.socket, seconds: float) -> bool:
    """Whether the server closes `conn` within `seconds` (sending nothing more)."""
    conn.settimeout(seconds)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def get(port: int) -> bytes:
    return b"GET /api/info HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % port


def test_200_connections_with_unfinished_heads_take_no_other_clients_turn_and_are_closed(served, monkeypatch):
    import vitmask.demo.serve as demo_serve

    monkeypatch.setattr(demo_serve, "HEAD_SECONDS", 2)
    with real_server(served) as (port, server):
        opened = time.monotonic()
        stalled = [connect(port, b"GET /api/info HTTP/1.1\r\nHost: 127.0") for _ in range(200)]
        try:
            until(lambda: len(server.server_state.connections) >= 200)
            assert exchange(port, get(port)).startswith(b"HTTP/1.1 200 ")  # served while they wait
            slow = connect(port, b"GET /api/info HTTP/1.1\r\n")
            stalled.append(slow)
            time.sleep(0.5)
            slow.sendall(get(port).split(b"\r\n", 1)[1])  # the rest of its head, in time: served
            assert read_answer(slow).startswith(b"HTTP/1.1 200 ")
            slow.sendall(b"GET /api/info HTTP/1.1\r\n")  # after its answer, a head begun and left unfinished
            assert closed_by_server(stalled[0], 10) and time.monotonic() - opened >= 2
            assert all(closed_by_server(conn, 10) for conn in stalled)
        finally:
            for conn in stalled:
                conn.close()


def test_past_its_connections_a_request_is_refused_503_until_one_closes(served, monkeypatch):
    import vitmask.demo.serve as demo_serve

    monkeypatch.setattr(demo_serve, "MAX_CONNECTIONS", 8)
    with real_server(served) as (port, server):
        idle = [connect(port) for _ in range(7)]
        try:
            until(lambda: len(server.server_state.connections) == 7)
            assert exchange(port, get(port)).startswith(b"HTTP/1.1 503 ")  # the eighth connection
            idle.pop().close()
            until(lambda: len(server.server_state.connections) == 6)
            assert exchange(port, get(port)).startswith(b"HTTP/1.1 200 ")
        finally:
            for conn in idle:
                conn.close()


def test_past_its_requests_at_once_a_request_is_refused_503_in_one_line(served, monkeypatch):
    import vitmask.demo.app as demo_app

    monkeypatch.setattr(demo_app, "MAX_REQUESTS", 3)
    with real_server(served) as (port, server):
        head = b"POST /api/sample HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: 12\r\n\r\n" % port
        waiting = [connect(port, head) for _ in range(3)]  # each answered once its body comes
        try:
            until(lambda: len(server.server_state.tasks) == 3)
            busy = exchange(port, get(port))
            assert busy.startswith(b"HTTP/1.1 503 ")
            assert json.loads(busy.partition(b"\r\n\r\n")[2])["error"] == (
                "the demo server is answering 3 requests at once, its most; send this one again in a moment"
            )
            for conn in waiting:
                conn.sendall(b'{"steps": 2}')
                assert read_answer(conn).startswith(b"HTTP/1.1 200 ")
            until(lambda: len(server.server_state.tasks) == 0)
            assert exchange(port, get(port)).startswith(b"HTTP/1.1 200 ")
        finally:
            for conn in waiting:
                conn.close()


def test_a_stalled_body_is_answered_408_and_its_connection_closed(served, monkeypatch):
    import vitmask.demo.app as demo_app

    monkeypatch.setattr(demo_app, "BODY_STALL_SECONDS", 1)
    with real_server(served) as (port, _):
        head = b"POST /api/upload HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: 100\r\n\r\n" % port
        with connect(port, head + png_of_size(SIZE, SIZE)[:10]) as conn:
            answer = read_answer(conn)
            assert answer.startswith(b"HTTP/1.1 408 ") and b"stopped arriving" in answer
            assert closed_by_server(conn, 5)


def test_an_upload_over_the_limit_is_read_before_its_413_so_the_client_reads_the_answer(served):
    """http.client sends a whole body before it reads the answer, as a browser may: an answer sent with a
    close before the body was read would reach it as a reset connection."""
    import http.client

    from vitmask.demo.app import DISCARD_BYTES

    body = padded_to(png_of_size(SIZE, SIZE), MAX_UPLOAD_BYTES + (1 << 20))
    with real_server(served) as (port, _):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", "/api/upload", body=body)
            res = conn.getresponse()
            assert res.status == 413 and json.loads(res.read())["error"] == TOO_LARGE
            conn.request("POST", "/api/upload", body=body, headers={"Origin": "http://rebound.example"})
            res = conn.getresponse()
            assert res.status == 403 and "answers its own page only" in json.loads(res.read())["error"]
            conn.request("GET", "/api/info")  # the same connection serves on
            assert conn.getresponse().status == 200
        finally:
            conn.close()
        # a body declared past what is read and dropped: the answer at once, and the connection closed
        head = b"POST /api/upload HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: %d\r\n\r\n" % (
            port,
            DISCARD_BYTES + 1,
        )
        with connect(port, head) as raw:
            answer = read_answer(raw)
            assert answer.startswith(b"HTTP/1.1 413 ") and re.search(rb"(?im)^connection: close", answer)
            assert TOO_LARGE.encode() in answer and closed_by_server(raw, 5)


def test_a_real_server_reads_heads_hosts_and_origins_as_clients_send_them(served):
    with real_server(served) as (port, _):
        host = b"Host: 127.0.0.1:%d\r\n" % port
        assert exchange(port, b"GET /api/info HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 200 ")  # no Host header
        big = b"X-Filler: " + b"x" * (8 << 10) + b"\r\n"  # an 8 KiB header: served
        assert exchange(port, b"GET /api/info HTTP/1.1\r\n" + host + big + b"\r\n").startswith(b"HTTP/1.1 200 ")
        endless = b"GET /api/info HTTP/1.1\r\n" + host + b"X-Filler: " + b"x" * (20 << 10)  # no end past 16 KiB
        assert exchange(port, endless).startswith(b"HTTP/1.1 400 ")
        sample = b"POST /api/sample HTTP/1.1\r\n" + host + b"Content-Length: 12\r\n"
        own = exchange(port, sample + b'Origin: http://127.0.0.1:%d\r\n\r\n{"steps": 2}' % port)
        assert own.startswith(b"HTTP/1.1 200 ")
        other = exchange(port, sample + b'Origin: http://127.0.0.1:%d\r\n\r\n{"steps": 2}' % (port + 1))
        assert other.startswith(b"HTTP/1.1 403 ") and b"open http://127.0.0.1:%d to use" % port in other
        assert exchange(port, sample + b'\r\n{"steps": 2}').startswith(b"HTTP/1.1 200 ")  # no Origin: curl


# ---- many pages at once -----------------------------------------------------------------------------------
def requests_of(page: int) -> list[tuple[str, dict]]:
    """A page's requests: its own image and seeds (page 0 and page 1 differ in each)."""
    rng = np.random.default_rng(page)
    image = (rng.random((SIZE, SIZE)) < 0.35).astype(np.uint8)
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[2 + page : 10 + page, 3:11] = 1
    return [
        (
            "/api/fill",
            {
                "pixels": bits(image),
                "mask": bits(mask),
                "iterative": True,
                "steps": 5,
                "temperature": 1.0,
                "seed": 10 + page,
            },
        ),  # fmt: skip
        ("/api/sample", {"steps": 6, "seed": 20 + page}),
        ("/api/classify", {"pixels": bits(image), "top_k": 2}),
        ("/api/fill", {"pixels": bits(image), "mask": bits(mask), "seed": page}),
    ]


def test_two_pages_interleaved_each_get_their_own_answers(served):
    alone = {page: [post_ok(TestClient(make_app(served)), p, **b) for p, b in requests_of(page)] for page in (0, 1)}
    assert alone[0] != alone[1]
    app = make_app(served)
    first, second = TestClient(app), TestClient(app)
    got = {0: [], 1: []}
    for (p0, b0), (p1, b1) in zip(requests_of(0), requests_of(1), strict=True):
        got[1].append(post_ok(second, p1, **b1))
        got[0].append(post_ok(first, p0, **b0))
    assert got == alone


def test_pages_requesting_at_the_same_moment_each_get_their_own_answers(served):
    app = make_app(served)
    expected = {page: [post_ok(TestClient(app), p, **b) for p, b in requests_of(page % 2)] for page in range(6)}
    got, failures, start = {}, [], threading.Barrier(6)

    def page(i: int) -> None:
        try:
            client = TestClient(app)
            start.wait()
            got[i] = [post_ok(client, p, **b) for p, b in requests_of(i % 2)]
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(repr(e))

    threads = [threading.Thread(target=page, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert failures == [] and got == expected


# ---- stopping -----------------------------------------------------------------------------------------------
class StopsTheServer(torch.nn.Module):
    """The served model, which sets the server's stop as it is first called (a signal mid-fill)."""

    def __init__(self, model: torch.nn.Module, stopping: threading.Event):
        super().__init__()
        self.model, self.stopping, self.calls = model, stopping, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        self.stopping.set()
        return self.model(*args, **kwargs)


def test_a_stopping_server_ends_a_fill_at_its_next_round(served):
    stopping = threading.Event()
    model = StopsTheServer(served.model, stopping)
    client = TestClient(make_app(dataclasses.replace(served, model=model), stopping))
    res = client.post("/api/fill", json=a_fill(iterative=True, steps=6))
    assert_refused(res, 503, "stopping")
    assert model.calls == 1  # the first round ran; the second never began
    assert_refused(client.post("/api/sample", json={}), 503, "stopping")
    assert model.calls == 1


# ---- opening the models ---------------------------------------------------------------------------------------
def test_a_classifier_of_another_image_size_is_refused(models, tmp_path):
    (tmp_path / "eight").mkdir()
    small = train_tiny(tmp_path / "eight", {"data": {"image_size": 8}, "train": {"max_steps": 2, "eval_every": 2}})
    with pytest.raises(UserError, match=r"classifies 16x16 images, and --checkpoint .* makes 8x8 ones"):
        open_models(small, models[2], "cpu")


def test_the_defaults_are_the_shipped_models_through_the_verbs_loaders(monkeypatch, served, tmp_path):
    """No --checkpoint: the folders of the shipped mnist and mnist-classifier go to open_model and the
    classifier loader; --checkpoint alone: that model, and no classifier loaded."""
    from vitmask.pretrained import resolve_model_path

    monkeypatch.chdir(tmp_path)  # no folder of those names here: the names give the package's folders
    import vitmask.demo.models as demo_models

    opened = []

    def fake_open_model(path, *args, **kwargs):
        opened.append(path)
        return served.model, served.config, served.device, None

    def fake_load_classifier(path, *args, **kwargs):
        opened.append(path)
        raise LookupError("the test stops here")

    monkeypatch.setattr(demo_models, "open_model", fake_open_model)
    monkeypatch.setattr(demo_models, "load_classifier_model", fake_load_classifier)
    with pytest.raises(LookupError):
        open_models(None, None)
    assert opened == [resolve_model_path("mnist"), resolve_model_path("mnist-classifier")]  # the package's folders
    opened.clear()
    assert open_models(Path("mine.pt"), None).classifier is None
    assert opened == [Path("mine.pt")]


def test_the_defaults_are_the_shipped_models_whatever_the_working_directory_holds_of_their_names(monkeypatch, tmp_path):
    """A folder `mnist` (MNIST's data, say) and a file `mnist-classifier` where `vitmask demo` starts: the user
    named no model, so the demo serves the shipped ones (a name the user passes still reads the path first)."""
    (tmp_path / "mnist").mkdir()
    (tmp_path / "mnist" / "t10k-images-idx3-ubyte").write_bytes(b"not a model")
    (tmp_path / "mnist-classifier").write_text("not a model")
    monkeypatch.chdir(tmp_path)
    served = open_models(None, None, "cpu")
    assert (served.name, served.classifier_name) == ("mnist", "mnist-classifier")
    assert served.config.data.image_size == 28 and served.classifier.names == [str(d) for d in range(10)]
    with pytest.raises(UserError, match="checkpoint mnist is a folder"):
        open_models(Path("mnist"), None, "cpu")


def test_the_shipped_defaults_serve_mnist_its_classifier_and_its_examples():
    """No flags: the shipped masked-patch model, the classifier fine-tuned from it, and the picker's images read
    from the examples.npz in the shipped model's own folder (the package's, not the working directory's)."""
    from vitmask.pretrained import resolve_model_path

    served = open_models(None, None, "cpu")
    assert served.name == "mnist" and served.classifier_name == "mnist-classifier"
    assert served.config.data.image_size == 28 and served.classifier is not None
    images, where = served.examples.images()
    with np.load(resolve_model_path(Path("mnist")) / "examples.npz") as archive:
        shipped = archive["images"]
    assert where.startswith("examples.npz") and torch.equal(images, torch.from_numpy(shipped))
