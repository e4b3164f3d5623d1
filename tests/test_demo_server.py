"""vitmask demo's server through Starlette's TestClient: every endpoint, each bad input, two clients at
once, and its numbers against the CLI's.

The tiny stand-in models (tests/demo_models.py) are a masked-patch model on 16x16 shapes, exported,
and a classifier fine-tuned from it on the shapes' labels. Expectations are independent of the server:
`vitmask inpaint`, `vitmask sample` and `vitmask predict` run on the same image, mask, options and seed
(their PNG and JSON outputs read back pixel by pixel), images binarized by hand (>= 128), the shapes
generator's own test split, and the CLI's option defaults read from its parser.
"""

import dataclasses
import io
import json
import shutil
import threading
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


def huge_png() -> bytes:
    return png_bytes(np.zeros((8, MAX_UPLOAD_SIDE + 1), np.uint8))  # a few hundred bytes, too wide


@pytest.mark.parametrize(
    "body, status, needles",
    [
        (b"", 400, ["empty"]),
        (b"this is not an image", 400, ["the upload is not a readable image", "PNG, JPEG or BMP"]),
        (png_bytes(np.zeros((SIZE, SIZE), np.uint8))[:40], 400, ["the upload is not a readable image"]),
        (transparent_png(), 400, ["the upload has transparent pixels"]),
        (huge_png(), 400, [f"{MAX_UPLOAD_SIDE + 1}x8 pixels", f"up to {MAX_UPLOAD_SIDE} pixels a side"]),
        (b"\0" * (MAX_UPLOAD_BYTES + 1), 413, ["at most 8 MiB"]),
    ],
    ids=["empty", "not-an-image", "truncated", "transparent", "huge", "too-many-bytes"],
)
def test_a_bad_upload_is_one_line_and_names_no_temporary_file(client, body, status, needles):
    res = client.post("/api/upload", content=body)
    assert_refused(res, status, *needles)
    assert "/tmp" not in res.json()["error"] and "vitmask-demo-" not in res.json()["error"]


def test_a_wrong_size_upload_is_refused_where_the_model_fits_none(served):
    fit_none = dataclasses.replace(served.config, data=dataclasses.replace(served.config.data, fit="none"))
    client = TestClient(make_app(dataclasses.replace(served, config=fit_none)))
    assert post_upload(client, png_bytes(np.zeros((SIZE, SIZE), np.uint8)))["note"] == ""
    res = client.post("/api/upload", content=png_bytes(np.zeros((20, 12), np.uint8)))  # 12 wide, 20 high
    assert_refused(res, 400, "the upload is 12 pixels wide and 20 high", "reads 16x16 images only", "resize the image")
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


def test_an_upload_declaring_too_many_bytes_is_refused_before_it_is_read(client):
    res = client.post("/api/upload", content=b"x" * 10, headers={"content-length": str(MAX_UPLOAD_BYTES + 1)})
    assert_refused(res, 413, "at most 8 MiB")
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
    assert_refused(client.post("/api/upload", content=chunks), 413, "at most 8 MiB")


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


def call_asgi(app, path: str, headers: list, chunks: list[bytes], disconnect: bool = False) -> list[dict]:
    """POST `chunks` to `path` of the ASGI `app` directly, as a server would pass them (headers as raw
    bytes), then a disconnect if asked; the messages the app sent back."""
    import asyncio

    sent = []
    messages = [{"type": "http.request", "body": c, "more_body": disconnect or i + 1 < len(chunks)} for i, c in
                enumerate(chunks)] + ([{"type": "http.disconnect"}] if disconnect else [])  # fmt: skip
    messages = iter(messages)

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1:8000"), *headers], "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
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
        return served.model, served.config, served.device

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
