"""vitmask demo in a real browser: headless Chromium (Debian's /usr/bin/chromium) driven by Playwright.

`vitmask demo` runs in its own process on a free port, serving the tiny stand-in models. The test draws
a stroke with the mouse, classifies it, masks a box, fills it step by step, reads the result back from
the page's canvas, saves the page's image, mask and result, and runs the command the page shows on the
saved files: the CLI's output is the page's, pixel for pixel (and its top-k the page's bars). Then it
samples, picks a test image and uploads a file that is not an image; another test picks a file over
the upload limit, which the page refuses without sending it. It also checks the page asks nothing of
any server but its own. A second test serves the shipped models as the README opens the demo:
a test digit, its centre filled and classified, the CLI's numbers again; its screenshot goes to
docs/demo.png when VITMASK_WRITE_DOCS_IMAGES=1 asks for it, else to a temporary folder.

Without Playwright or Chromium the test skips, saying which is missing, except under VITMASK_CI=1 (CI),
where it fails.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import ROOT
from tests.demo_models import SIZE, start_demo, tiny_models

CHROMIUM = Path(shutil.which("chromium") or "/usr/bin/chromium")
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000


def missing_browser() -> str | None:
    """Why the test cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (the dev extra: pip install -e '.[dev]')"
    for name in ("starlette", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            return f"{name} is not installed (the demo extra: pip install -e '.[demo]')"
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
    return None


def require_browser() -> None:
    """Skip, saying what is missing; under VITMASK_CI=1 (CI), fail instead."""
    why = missing_browser()
    if why is None:
        return
    if os.environ.get("VITMASK_CI") == "1":
        pytest.fail(f"{why}; under VITMASK_CI=1 the browser test must run", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser_ready():
    require_browser()


@pytest.fixture(scope="module")
def models(browser_ready, tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("demo-models"))


@pytest.fixture(scope="module")
def server(models):
    names = ("--checkpoint", models[1].name, "--classifier", models[2].name)  # as the page and its commands show them
    proc, _, url = start_demo(*names, "--port", 0, "--device", "cpu", cwd=models[1].parent)
    yield url
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=60)
    except Exception:
        proc.kill()
        raise
    assert proc.returncode == 130


@pytest.fixture
def page(server):
    yield from open_page(server)


def open_page(server: str):
    """A fresh headless Chromium on the demo at `server`, ready (its script loaded, the models named)."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="vitmask-chromium-") as profile, sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile,  # a fresh --user-data-dir
            executable_path=str(CHROMIUM),
            headless=True,
            args=LAUNCH_ARGS,
            viewport={"width": 1180, "height": 900},
            accept_downloads=True,
        )
        context.set_default_timeout(TIMEOUT_MS)
        page = context.new_page()
        page.elsewhere, page.errors = [], []  # requests to anywhere but the demo; script errors
        page.on("request", lambda r: r.url.startswith((server, "data:", "blob:")) or page.elsewhere.append(r.url))
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        page.clock.install()  # the page's timers on a clock the test can run ahead (wait_for_last_round)
        page.goto(server)
        page.wait_for_selector("body[data-ready='1']")
        yield page
        context.close()


# ---- driving the page ---------------------------------------------------------------------------------------
def at(page, canvas: str, x: int, y: int, size: int = SIZE) -> tuple[float, float]:
    """The screen point at the centre of pixel (x, y) of a canvas drawn size x size."""
    box = page.locator(canvas).bounding_box()
    return box["x"] + (x + 0.5) * box["width"] / size, box["y"] + (y + 0.5) * box["height"] / size


def drag(page, tool: str, points: list[tuple[int, int]], size: int = SIZE) -> None:
    page.check(f"input[name=tool][value={tool}]")
    page.mouse.move(*at(page, "#image-canvas", *points[0], size))
    page.mouse.down()
    for p in points[1:]:
        page.mouse.move(*at(page, "#image-canvas", *p, size), steps=4)
    page.mouse.up()


def shown_colours(page, canvas: str, size: int = SIZE) -> np.ndarray:
    """The colour a canvas shows at the centre of each pixel's cell, read back from it: (S, S, 3) uint8 RGB."""
    values = page.evaluate(
        """([id, S]) => {
            const c = document.querySelector(id), g = c.getContext("2d"), k = c.width / S, out = [];
            for (let y = 0; y < S; y++) for (let x = 0; x < S; x++) {
                const d = g.getImageData(Math.floor((x + 0.5) * k), Math.floor((y + 0.5) * k), 1, 1).data;
                out.push(d[0], d[1], d[2]);
            }
            return out;
        }""",
        [canvas, size],
    )
    return np.array(values, dtype=np.uint8).reshape(size, size, 3)


def shown_pixels(page, canvas: str, size: int = SIZE) -> np.ndarray:
    """What a canvas shows, read back from it: (S, S), 1 where the centre of a pixel's cell is white."""
    return (shown_colours(page, canvas, size) > 200).all(-1).astype(np.uint8)


def save(page, button: str, path: Path) -> Path:
    with page.expect_download() as download:
        page.click(button)
    download.value.save_as(path)
    return path


def binary(path: Path) -> np.ndarray:
    return (np.array(Image.open(path).convert("L")) >= 128).astype(np.uint8)


def run_shown_command(run_cli, page, element: str, files: dict[str, Path]) -> None:
    """Run the command the page shows, its file names replaced by `files`' paths; it must succeed."""
    words = shlex.split(page.text_content(element))
    assert words[0] == "vitmask"
    args = [str(files.get(w, w)) for w in words[1:]]  # the models' names too: the server ran in their folder
    res = run_cli(*args)
    assert res.returncode == 0, (args, res.stderr)


def wait_for_message(page, text: str) -> None:
    """Until the page's message line says `text` (it says what it is doing until the answer is in)."""
    page.wait_for_function("(text) => document.getElementById('message').textContent === text", arg=text)


def bars(page) -> int:
    """How many classify bars the page shows."""
    return page.locator("#top li").count()


def wait_for_last_round(page, rounds: int) -> None:
    """Until the animation shows the last of `rounds` rounds (a function: the page's policy forbids eval). The
    page's clock runs ahead a frame interval at a time (at most 600 ms, demo.js's play), so its interval timer
    draws every round in order without the test waiting out the animation's seconds."""
    last = "(last) => document.getElementById('round-text').textContent.startsWith(`round ${last} of ${last}:`)"
    for _ in range(rounds + 2):
        if page.evaluate(last, rounds):
            return
        page.clock.run_for(600)
    page.wait_for_function(last, arg=rounds)


# ---- the test ---------------------------------------------------------------------------------------------------
def test_a_person_draws_masks_fills_samples_and_classifies_and_the_numbers_are_the_clis(
    page, models, run_cli_in_process, tmp_path
):
    run_cli = run_cli_in_process
    # a digit-like stroke with the pen (2 pixels wide), then a short one with the eraser
    drag(page, "pen", [(5, 2), (9, 2), (10, 5), (6, 9), (5, 13), (11, 13)])
    drag(page, "eraser", [(9, 2), (9, 2)])
    image = binary(save(page, "#save-image", tmp_path / "image.png"))
    assert image[13, 5] == image[13, 11] == image[5, 10] == 1 and image[8, 14] == 0  # the stroke, and not elsewhere
    assert image[2, 9] == 0 and image[2, 5] == 1  # the eraser took the pen's pixel back
    assert (shown_pixels(page, "#image-canvas") == image).all()  # what the canvas shows is what was saved

    # classify it: the bars are vitmask predict's top-k on the saved image
    page.fill("#top-k", "3")
    page.click("#classify")
    page.wait_for_selector("#top li")
    bars = page.eval_on_selector_all("#top li", "els => els.map(e => [e.dataset.name, Number(e.dataset.probability)])")
    files = {"image.png": tmp_path / "image.png", "top.json": tmp_path / "top.json", models[2].name: models[2]}
    run_shown_command(run_cli, page, "#classify-command", files)
    record = json.loads((tmp_path / "top.json").read_text())[0]
    assert [b[0] for b in bars] == record["classes"] and [b[1] for b in bars] == record["probabilities"]

    # mask a box, fill it iteratively with a seed; the animation ends on the fill
    drag(page, "box", [(4, 5), (11, 10)])
    mask = binary(save(page, "#save-mask", tmp_path / "mask.png"))
    expected_mask = np.zeros((SIZE, SIZE), np.uint8)
    expected_mask[5:11, 4:12] = 1  # both corners included
    assert (mask == expected_mask).all()
    page.check("#fill-iterative")
    for field, value in (("#fill-steps", "4"), ("#fill-temperature", "1"), ("#fill-seed", "7")):
        page.fill(field, value)
    page.select_option("#fill-order", "random")
    page.click("#fill")
    wait_for_last_round(page, 4)
    assert not page.is_checked("#heat")  # the confidence tint is off: the result shows white on black
    shown = shown_pixels(page, "#result-canvas")
    saved = binary(save(page, "#save-result", tmp_path / "page-filled.png"))
    files = {"image.png": tmp_path / "image.png", "mask.png": tmp_path / "mask.png", "filled.png": tmp_path / "cli.png"}
    run_shown_command(run_cli, page, "#command", {**files, models[1].name: models[1]})
    cli = binary(tmp_path / "cli.png")
    assert (shown == cli).all() and (saved == cli).all()
    filled = np.zeros((SIZE, SIZE), bool)
    filled[4:12, 4:12] = True  # the 2x2 patches the box touches: pixel rows 5-10 lie in patch rows 2-5
    assert (cli[~filled] == image[~filled]).all()  # outside them, the image as drawn

    # step back through the rounds: before the first, the box is grey (neither black nor white)
    page.fill("#round", "0")
    page.dispatch_event("#round", "input")
    assert (shown_pixels(page, "#result-canvas")[filled] == 0).all()

    # sample from a blank canvas with a seed: vitmask sample's image
    for field, value in (("#sample-steps", "8"), ("#sample-temperature", "1"), ("#sample-seed", "4")):
        page.fill(field, value)
    page.click("#sample")
    wait_for_last_round(page, 8)
    shown = shown_pixels(page, "#result-canvas")
    run_shown_command(run_cli, page, "#command", {"sample.png": tmp_path / "sample.png", models[1].name: models[1]})
    assert (shown == binary(tmp_path / "sample.png")[::3, ::3]).all()  # one image, drawn 3x by vitmask sample

    # pick a test image; upload a file that is not an image: a message on the page, the image kept
    page.click("#examples button >> nth=2")
    picked = shown_pixels(page, "#image-canvas")
    assert picked.any() and not (picked == image).all()
    (tmp_path / "notes.png").write_text("not an image")
    page.set_input_files("#upload", str(tmp_path / "notes.png"))
    page.wait_for_selector("#message.error")
    assert "the upload is not a readable image" in page.text_content("#message")
    assert (shown_pixels(page, "#image-canvas") == picked).all()

    # a model's name as the shown commands quote it for the shell
    for name in ("runs/my model/last.pt", "it's", "plain-name_1.pt"):
        assert shlex.split(page.evaluate("(name) => shellWord(name)", name)) == [name]

    assert page.errors == [] and page.elsewhere == []


def test_the_bars_go_when_the_image_or_the_result_changes_and_the_tint_is_off_until_ticked(page, tmp_path):
    """The classify bars describe the image they were computed for: any other image on the canvas, or a new fill
    or sample beside them, takes them away. The confidence tint over the result is off until its box is ticked."""
    assert not page.is_checked("#heat") and page.get_attribute("#result-canvas", "data-tint") == "off"
    page.fill("#top-k", "3")

    def classify() -> None:
        assert bars(page) == 0
        page.click("#classify")
        page.wait_for_selector("#top li")
        assert bars(page) == 3 and page.text_content("#classify-command").startswith("vitmask predict")

    def gone() -> bool:
        return bars(page) == 0 and page.text_content("#classify-command") == ""

    page.click("#examples button >> nth=0")
    classify()
    image = shown_pixels(page, "#image-canvas")
    y, x = map(int, np.argwhere(image == 0)[0])
    drag(page, "pen", [(x, y), (x, y)])  # drawing: a black pixel made white
    assert gone()
    classify()
    y, x = map(int, np.argwhere(shown_pixels(page, "#image-canvas") == 1)[0])
    drag(page, "eraser", [(x, y), (x, y)])
    assert gone()
    classify()
    drag(page, "box", [(0, 0), (7, 7)])  # a mask is not the image: the classifier reads the image alone
    assert bars(page) == 3
    page.click("#examples button >> nth=1")  # another test image
    assert gone()
    classify()
    upload = np.zeros((SIZE, SIZE), np.uint8)
    upload[:, : SIZE // 4] = 255  # a quarter white: near the training shapes' share, so no note beside it
    Image.fromarray(upload).save(tmp_path / "quarter.png")
    page.set_input_files("#upload", str(tmp_path / "quarter.png"))
    wait_for_message(page, "quarter.png read")
    assert gone() and (shown_pixels(page, "#image-canvas") == (upload > 0)).all()
    drag(page, "box", [(0, 0), (7, 7)])  # the upload cleared the mask: hide the top-left 4x4 patches again
    classify()
    page.click("#fill")  # one shot: every hidden patch in one round
    wait_for_message(page, "filled 16 of 64 patches in 1 round")
    assert gone()

    # the result, untinted: white on black, every pixel; ticked: each filled patch tinted by its probability
    filled = np.zeros((SIZE, SIZE), bool)
    filled[:8, :8] = True
    plain = shown_colours(page, "#result-canvas")
    grey = (plain[..., 0] == plain[..., 1]) & (plain[..., 1] == plain[..., 2])
    assert grey.all() and set(np.unique(plain).tolist()) <= {0, 255}
    page.check("#heat")
    assert page.get_attribute("#result-canvas", "data-tint") == "on"
    tinted = shown_colours(page, "#result-canvas")
    coloured = (tinted[..., 0] != tinted[..., 1]) | (tinted[..., 1] != tinted[..., 2])  # a hue over the pixel
    assert coloured[filled].all() and (tinted[~filled] == plain[~filled]).all()
    page.uncheck("#heat")
    assert page.get_attribute("#result-canvas", "data-tint") == "off"
    assert (shown_colours(page, "#result-canvas") == plain).all()

    classify()
    page.click("#sample")  # a new result beside the bars
    page.wait_for_function("() => document.getElementById('message').textContent.startsWith('sampled')")
    assert gone()
    wait_for_last_round(page, 64)
    sampled = shown_pixels(page, "#result-canvas")
    assert not (sampled == (upload > 0)).all()
    classify()
    page.click("#use-result")  # the sample is now the image
    assert gone() and (shown_pixels(page, "#image-canvas") == sampled).all()
    classify()
    page.click("#undo")  # back to the upload and its mask (blue over the top-left patches)
    assert gone() and (shown_pixels(page, "#image-canvas")[~filled] == (upload > 0)[~filled]).all()
    classify()
    page.click("#clear-image")
    assert gone()

    # an answer that comes back after the image changed is not shown beside the new image
    held = []
    page.route("**/api/classify", lambda route: held.append(route))  # held until the image has changed
    page.click("#examples button >> nth=2")
    page.click("#classify")
    page.wait_for_function("() => document.getElementById('message').textContent.startsWith('classifying')")
    while not held:
        page.wait_for_timeout(20)
    drag(page, "pen" if shown_pixels(page, "#image-canvas")[0, 0] == 0 else "eraser", [(0, 0), (0, 0)])
    held[0].continue_()
    wait_for_message(page, "the image or the result changed while the image was being classified; classify it again")
    assert gone()
    assert page.errors == [] and page.elsewhere == []


def test_the_round_text_counts_the_rounds_that_ran(page):
    """A row hiding M patches runs min(steps, M) rounds, each fixing a patch: the slider and its text count those."""
    samples = [
        ("64", "sampled a new image in 64 rounds"),
        ("100", "sampled a new image in 64 rounds (steps 100: one round a patch at most)"),
    ]
    for steps, message in samples:
        page.fill("#sample-steps", steps)
        page.click("#sample")
        wait_for_message(page, message)
        assert page.get_attribute("#round", "max") == "64"  # 64 patches, one a round
        wait_for_last_round(page, 64)
        assert page.text_content("#round-text") == "round 64 of 64: 1 patch fixed"
    drag(page, "box", [(4, 4), (11, 11)])  # the 4x4 patches of rows and columns 2-5: 16 hidden
    page.check("#fill-iterative")
    for steps, rounds, note in (("40", 16, " (steps 40: one round a patch at most)"), ("16", 16, ""), ("5", 5, "")):
        page.fill("#fill-steps", steps)
        page.click("#fill")
        wait_for_message(page, f"filled 16 of 64 patches in {rounds} rounds{note}")
        page.fill("#round", "0")
        page.dispatch_event("#round", "input")  # stops the animation
        assert page.get_attribute("#round", "max") == str(rounds)
        fixed = []
        for f in range(1, rounds + 1):
            page.fill("#round", str(f))
            page.dispatch_event("#round", "input")
            words = page.text_content("#round-text").split()  # round F of T: K patch(es) fixed
            assert words[:4] == ["round", str(f), "of", f"{rounds}:"]
            fixed.append(int(words[4]))
        assert min(fixed) >= 1 and sum(fixed) == 16, fixed
        if rounds == 16:
            assert fixed == [1] * 16
    assert page.errors == [] and page.elsewhere == []


def test_an_image_over_the_upload_limit_gets_the_pages_message_and_is_not_sent(page, tmp_path):
    """The page checks an upload's size before it sends it, and says so in the server's words for it."""
    big = tmp_path / "big.png"
    with open(big, "wb") as f:
        f.truncate((8 << 20) + 1)  # one byte over the limit (the server's /api/info says 8 MiB)
    page.click("#examples button >> nth=0")
    before = shown_pixels(page, "#image-canvas")
    sent = []
    page.on("request", lambda r: "/api/upload" in r.url and sent.append(r.url))
    page.set_input_files("#upload", str(big))
    page.wait_for_selector("#message.error")
    expected = "the image is over 8 MiB, the largest upload the demo reads; choose a smaller one"
    assert page.text_content("#message") == expected and sent == []
    assert (shown_pixels(page, "#image-canvas") == before).all()  # the canvas kept
    assert page.errors == [] and page.elsewhere == []


@pytest.fixture(scope="module")
def shipped_server(browser_ready, tmp_path_factory):
    """`vitmask demo` with no model flags, in an empty folder: the shipped mnist and mnist-classifier."""
    proc, _, url = start_demo("--port", 0, "--device", "cpu", cwd=tmp_path_factory.mktemp("empty"))
    yield url
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130


def test_the_shipped_models_fill_and_classify_a_test_digit_as_the_cli_does(
    shipped_server, run_cli_in_process, tmp_path
):
    """The page as the README opens it: pick the first test digit of the shipped mnist, hide its centre, fill it
    round by round, classify the filled digit. The fill is vitmask inpaint's on the saved files, the bars vitmask
    predict's; the screenshot of this page is docs/demo.png (written there when VITMASK_WRITE_DOCS_IMAGES=1)."""
    run_cli, size = run_cli_in_process, 28
    page = next(pages := open_page(shipped_server))
    try:
        page.click("#examples button >> nth=0")
        image = binary(save(page, "#save-image", tmp_path / "image.png"))
        assert image.shape == (size, size) and image.any()
        drag(page, "box", [(8, 8), (19, 19)], size)  # the centre 12x12 pixels: the middle 6x6 patches
        mask = binary(save(page, "#save-mask", tmp_path / "mask.png"))
        want = np.zeros((size, size), np.uint8)
        want[8:20, 8:20] = 1
        assert (mask == want).all()
        page.check("#fill-iterative")
        page.fill("#fill-steps", "8")
        page.click("#fill")
        wait_for_last_round(page, 8)
        page.click("#use-result")  # classify the filled digit
        page.fill("#top-k", "3")
        page.click("#classify")
        page.wait_for_selector("#top li")
        page.check("#heat")  # the picture shows the confidence of each filled patch
        shot = (ROOT / "docs" if os.environ.get("VITMASK_WRITE_DOCS_IMAGES") == "1" else tmp_path) / "demo.png"
        page.screenshot(path=str(shot), full_page=True)
        files = {
            "image.png": tmp_path / "image.png",
            "mask.png": tmp_path / "mask.png",
            "filled.png": tmp_path / "cli.png",
        }
        run_shown_command(run_cli, page, "#command", files)
        page.uncheck("#heat")
        assert (shown_pixels(page, "#result-canvas", size) == binary(tmp_path / "cli.png")).all()
        filled = binary(save(page, "#save-image", tmp_path / "filled-image.png"))  # the result, now the image
        assert (filled == binary(tmp_path / "cli.png")).all()
        bars = page.eval_on_selector_all(
            "#top li", "els => els.map(e => [e.dataset.name, Number(e.dataset.probability)])"
        )
        run_shown_command(
            run_cli,
            page,
            "#classify-command",
            {"image.png": tmp_path / "filled-image.png", "top.json": tmp_path / "top.json"},
        )
        record = json.loads((tmp_path / "top.json").read_text())[0]
        assert [b[0] for b in bars] == record["classes"] and [b[1] for b in bars] == record["probabilities"]
        assert len(bars) == 3 and page.errors == [] and page.elsewhere == []
    finally:
        pages.close()


def test_without_chromium_the_test_skips_saying_so_and_fails_under_ci(monkeypatch, tmp_path):
    import tests.test_demo_browser as this

    monkeypatch.setattr(this, "CHROMIUM", tmp_path / "no-chromium")
    monkeypatch.delenv("VITMASK_CI", raising=False)
    if missing_browser() != f"no Chromium at {tmp_path / 'no-chromium'} (Debian: apt-get install chromium)":
        pytest.skip(f"another part is missing here: {missing_browser()}")
    with pytest.raises(pytest.skip.Exception, match="no Chromium at"):
        require_browser()
    monkeypatch.setenv("VITMASK_CI", "1")
    with pytest.raises(pytest.fail.Exception, match="no Chromium at .*under VITMASK_CI=1 the browser test must run"):
        require_browser()
    monkeypatch.setitem(sys.modules, "playwright.sync_api", None)
    with pytest.raises(pytest.fail.Exception, match="Playwright is not installed"):
        require_browser()


def test_ci_fails_in_one_line_when_it_cannot_install_chromium(tmp_path):
    """.ci/run on a machine without Chromium, where apt-get fails: exit 1, one line saying so, nothing run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    (bin_dir / "apt-get").write_text("#!/bin/sh\necho 'E: Unable to locate package chromium' >&2\nexit 100\n")
    (bin_dir / "apt-get").chmod(0o755)
    (bin_dir / "make").write_text("#!/bin/sh\necho ran make\n")
    (bin_dir / "make").chmod(0o755)
    res = subprocess.run(
        [shutil.which("bash"), str(ROOT / ".ci" / "run")],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1 and "ran make" not in res.stdout
    assert res.stderr.splitlines()[-1].startswith(".ci/run: cannot install Debian's chromium")
    assert "Unable to locate package chromium" in res.stderr  # apt-get's own reason is kept
