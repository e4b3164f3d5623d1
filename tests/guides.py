"""The harness that runs the guides: every `vitmask` command and Python example of README.md and the
guide pages, in the page's order, as written (tests/test_guides.py runs it; docs/contributing.md is
the short note for writers of pages).

How a page runs
- Sybil parses the page's fenced blocks. ```bash blocks run line by line; ```python blocks run in
  one namespace per page; both in the page's order. Other fences (text, yaml, console output) are
  read, not run.
- Each page runs in a working directory of its own, holding links to the checkout's `configs/`,
  `docs/` and `scripts/` (so commands read them as in a clone) and the small data below; whatever
  the commands write (runs/, export/, pictures) stays there.
- A line of a bash block whose first word is `vitmask` (or `python -m vitmask`) runs through the
  CLI's `main()` in this process (no interpreter start-up per command), with its exit code checked;
  any other line runs in `bash -e -o pipefail -c LINE` with the venv's `python` and `vitmask` first
  on PATH. A line ending in a backslash continues on the next; `#` comments are dropped. Every
  command must exit 0.

The five substitutions, and the only ones
1. Data, by path: the working directory's `data/mnist` is what torchvision's download leaves
   (`MNIST/raw/`, each idx file plain and gzipped), holding a small slice of MNIST: TRAIN_IMAGES
   train and TEST_IMAGES test images (more where a page reads more: PAGE_TEST_IMAGES), cut from the
   MNIST test set in ../shared/data/mnist (synthetic strokes where that is missing). Commands name
   the same paths as in a user's clone after the download, and run as written on less data.
2. Training length: `vitmask train` and `vitmask finetune` get SHORT appended, a few steps of a
   small batch without compilation. Appended last, these keys win over the page's own `--set`s of the same key.
3. Likelihood length: `vitmask eval ... --nll` gets EXACT_NLL appended, the exact NLLs on 1 image in 2
   orders, the raster one and its mixture with one more (each costs K x N forward passes an image; the
   page's command runs 8 orders on its default 100 images).
4. Sampling length: `vitmask sample` gets SAMPLE_ROUNDS appended, 16 rounds of decoding (the page's
   commands decode one patch a round: 196 rounds of the whole model for MNIST).
5. Training from Python: `vitmask.train(...)` and `vitmask.finetune(...)` called in a python block get
   SHORT appended to their `overrides`, as the commands of 2 get it (`short_python_training`).

Blocks that are not run carry `<!-- skip: next "why" -->` on the line before the fence (an HTML
comment, which the rendered page does not show); each page may have at most MAX_SKIPS. A step that
needs a verb this build lacks is skipped only while it lacks it:
`<!-- skip: next if(missing("predict"), "needs vitmask predict") -->`.
"""

import contextlib
import gzip
import io
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from sybil import Sybil
from sybil.evaluators.python import PythonEvaluator
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parents[1]
MNIST_DIR = ROOT.parent / "shared" / "data" / "mnist"
LINKED = ("configs", "docs", "scripts")  # checkout folders a page's commands read
TRAIN_IMAGES, TEST_IMAGES = 150, 150
PAGE_TEST_IMAGES = {"docs/own-data.md": 300}  # its Python writes the first 300 test digits as PNG files
MAX_SKIPS = 4

# appended to every `vitmask train` and `vitmask finetune`: a few small steps, no compilation
SHORT = (
    "data.batch_size=16",
    "train.max_steps=2",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "train.log_every=1",
    "train.compile=false",
)
SHORTENED_VERBS = ("train", "finetune")
EXACT_NLL = ("--nll-exact-images", "1", "--nll-orders", "2")  # appended to `vitmask eval ... --nll`
SAMPLE_ROUNDS = ("--steps", "16")  # appended to `vitmask sample`


# ---- the working directory -------------------------------------------------------------------------
def mnist_slice(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, 28, 28) uint8 digits and their labels: the first n images of the MNIST test set where it is
    on disk, else synthetic strokes labelled by their index mod 10."""
    images_gz, labels_gz = MNIST_DIR / "t10k-images-idx3-ubyte.gz", MNIST_DIR / "t10k-labels-idx1-ubyte.gz"
    if images_gz.is_file() and labels_gz.is_file():
        with gzip.open(images_gz) as f:
            images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)[:n]
        with gzip.open(labels_gz) as f:
            labels = np.frombuffer(f.read(), np.uint8, offset=8)[:n]
        return images.copy(), labels.copy()
    rng = np.random.default_rng(0)
    images = np.zeros((n, 28, 28), np.uint8)
    for i in range(n):  # a bar per class: its angle tells the label
        label, centre = i % 10, rng.uniform(10, 18, 2)
        angle = np.pi * label / 10
        for t in np.linspace(-8, 8, 40):
            y, x = (centre + t * np.array([np.sin(angle), np.cos(angle)])).astype(int)
            images[i, max(0, y - 1) : y + 1, max(0, x - 1) : x + 1] = 255
    return images, (np.arange(n) % 10).astype(np.uint8)


def write_idx(path: Path, array: np.ndarray) -> None:
    """An idx file (MNIST's format: magic, big-endian dims, the bytes), and its .gz beside it."""
    magic = 0x803 if array.ndim == 3 else 0x801
    raw = np.array([magic, *array.shape], ">u4").tobytes() + array.astype(np.uint8).tobytes()
    path.write_bytes(raw)
    path.with_name(path.name + ".gz").write_bytes(gzip.compress(raw, mtime=0))


def make_workdir(path: Path, test_images: int = TEST_IMAGES) -> Path:
    """A working directory for a page: links to LINKED, and data/mnist as torchvision leaves it, with
    `test_images` test and TRAIN_IMAGES train images."""
    path.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        (path / name).symlink_to(ROOT / name, target_is_directory=True)
    raw = path / "data" / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images, labels = mnist_slice(test_images + TRAIN_IMAGES)
    write_idx(raw / "t10k-images-idx3-ubyte", images[:test_images])
    write_idx(raw / "t10k-labels-idx1-ubyte", labels[:test_images])
    write_idx(raw / "train-images-idx3-ubyte", images[test_images:])
    write_idx(raw / "train-labels-idx1-ubyte", labels[test_images:])
    return path


# ---- bash blocks ---------------------------------------------------------------------------------
def logical_lines(block: str) -> list[str]:
    """The block's commands: lines joined where one ends in a backslash, blank and comment lines dropped."""
    lines, pending = [], ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.strip() and not line.lstrip().startswith("#"):
            lines.append(line.strip())
    if pending.strip():
        lines.append(pending.strip())
    return lines


def vitmask_args(line: str) -> list[str] | None:
    """The arguments of a `vitmask ...` or `python -m vitmask ...` line (comments dropped), plus SHORT
    for a training verb, EXACT_NLL for `eval --nll` and SAMPLE_ROUNDS for `sample`; None for any other
    line (or one that pipes, chains or redirects)."""
    words = shlex.split(line, comments=True)
    if words[:1] == ["vitmask"]:
        args = words[1:]
    elif words[:3] == ["python", "-m", "vitmask"]:
        args = words[3:]
    else:
        return None
    if any(w in ("|", "&&", "||", ";", ">", ">>", "2>") for w in args):
        return None
    if args[:1] and args[0] in SHORTENED_VERBS:
        args += [a for key in SHORT for a in ("--set", key)]
    if args[:1] == ["eval"] and "--nll" in args:
        args += list(EXACT_NLL)
    if args[:1] == ["sample"]:
        args += list(SAMPLE_ROUNDS)
    return args


def run_vitmask(args: list[str]) -> tuple[int, str, str]:
    """`vitmask ARGS` through the CLI's main() in this process: exit code, stdout, stderr."""
    from vitmask.cli import commands

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            commands.main(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def run_shell(line: str) -> tuple[int, str, str]:
    """Any other line, in bash, in the current directory, with this interpreter's bin/ first on PATH."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    res = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", line], env=env, capture_output=True, text=True, timeout=300
    )
    return res.returncode, res.stdout, res.stderr


class CommandFailed(AssertionError):
    pass


def evaluate_bash(example) -> None:
    """Sybil's evaluator for a bash block: each command in turn; the first that fails stops the page."""
    ran = example.namespace.setdefault("_commands", [])
    seconds = example.namespace.setdefault("_seconds", [])
    for line in logical_lines(example.parsed):
        args = vitmask_args(line)
        start = time.perf_counter()
        code, out, err = run_vitmask(args) if args is not None else run_shell(line)
        seconds.append(time.perf_counter() - start)
        ran.append(line if args is None else "vitmask " + shlex.join(args))
        print(f"{seconds[-1]:6.1f} s  exit {code}  {ran[-1]}", file=sys.__stdout__)
        if code != 0:
            raise CommandFailed(
                f"{example.path}, line {example.line}: `{ran[-1]}` exited {code}\n"
                f"--- stdout (end)\n{out[-3000:]}\n--- stderr (end)\n{err[-3000:]}"
            )


# ---- python blocks -------------------------------------------------------------------------------
@contextlib.contextmanager
def short_python_training():
    """Substitution 5: within it, `vitmask.train` and `vitmask.finetune` (train/run.py's `train` and
    `finetune`, which both names call) run with SHORT after the `overrides` they are given."""
    from vitmask.train import run

    real = {"train": run.train, "finetune": run.finetune}

    def shortened(function, position: int):
        def call(*args, **kwargs):
            if len(args) > position:
                args = (*args[:position], [*args[position], *SHORT], *args[position + 1 :])
            else:
                kwargs["overrides"] = [*kwargs.get("overrides", ()), *SHORT]
            return function(*args, **kwargs)

        return call

    run.train, run.finetune = shortened(real["train"], 1), shortened(real["finetune"], 2)
    try:
        yield
    finally:
        run.train, run.finetune = real["train"], real["finetune"]


# ---- pages -------------------------------------------------------------------------------------
def missing(verb: str) -> bool:
    """True while the CLI has no command `verb` (for conditional skips)."""
    import typer

    from vitmask.cli import commands

    return verb not in typer.main.get_command(commands.app).commands


def parse(page: Path):
    """The page as a Sybil document: its bash and python blocks and skip marks, in order."""
    sybil = Sybil(
        parsers=[
            CodeBlockParser(language="bash", evaluator=evaluate_bash),
            PythonCodeBlockParser(),
            SkipParser(),
        ]
    )
    document = sybil.parse(page)
    document.namespace["missing"] = missing
    return document


def skip_marks(page: Path) -> list[str]:
    """The page's skip marks, as written."""
    return [line.strip() for line in page.read_text().splitlines() if line.strip().startswith("<!-- skip:")]


def run_page(page: Path) -> dict:
    """Run every block of `page` in order in the current directory. Returns what ran and what was
    skipped: {"commands": [...], "seconds": [...], "python": n, "skipped": [(line, reason), ...]}."""
    from unittest import SkipTest

    document = parse(page)
    python_blocks, skipped = 0, []
    environ = dict(os.environ)  # a page's Python may set variables (MLFLOW_TRACKING_URI): they end with it
    try:
        for example in document:
            try:
                with short_python_training():
                    example.evaluate()
            except SkipTest as e:
                skipped.append((example.line, str(e)))
                continue
            python_blocks += isinstance(example.region.evaluator, PythonEvaluator)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    ns = document.namespace
    return {"commands": ns.get("_commands", []), "seconds": ns.get("_seconds", []), "python": python_blocks,
            "skipped": skipped}  # fmt: skip
