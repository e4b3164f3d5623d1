"""The `vitmask` command line: parse, call the library, render results and errors.

Bad input (a `UserError`, or a usage error from the parser, or no command at all) ends in one
line on stderr and exit code 2. Training stopped by SIGINT or SIGTERM says where its checkpoint is
and exits 130 or 143; a signal at any other moment (start-up, data loading, evaluation) ends in one
line and the same codes, after the clean-up of `finally` blocks (`errors.Stopped`). A closed
stdout (`vitmask eval | head -1`, `--help` too) ends quietly with exit code 141, what a shell
reports for a writer stopped by SIGPIPE; a path the file system refuses in a way no check
foresaw (too long, a symlink loop, an I/O error) ends in one line naming it. A training callback
that raised (`callbacks.CallbackError`, after its checkpoint was written) ends in its one line and
exit code 1. Anything else is a bug and keeps its traceback.

`--config` repeats: the files compose in order, a later file's keys winning key by key, then `--set`
(config.load_config); `vitmask config` prints the result.

Parsing, `--help` and `--version` never import torch (seconds): the modules that do are imported
when a command runs (`_library_first`, `_ImportedOnFirstUse`).
"""

import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import os
import re
import signal
import sys
import tempfile
import threading
from importlib import metadata
from pathlib import Path

import typer
from typer.core import TyperGroup

try:  # typer >= 0.20 vendors click and raises its own UsageError; older releases raise click's
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - depends on the installed typer
    from click.exceptions import UsageError

import vitmask
from vitmask import outputs
from vitmask.config import dump_config
from vitmask.errors import Stopped, UserError
from vitmask.outputs import reason
from vitmask.signals import Interrupted, early_stop
from vitmask.train.callbacks import CallbackError


class CannotStart(Exception):
    """torch, or its compiler, cannot be imported for want of a writable temporary directory (the
    compiler's caches find one at import): a full disk, a read-only /tmp. Nothing has been read or
    written yet."""


class _ImportedOnFirstUse:
    """A module imported on its first attribute access (`verbs.train`), so that parsing and `--help`,
    which never reach a command's body, do not import torch (seconds) through it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


verbs = _ImportedOnFirstUse("vitmask.cli.verbs")
training = _ImportedOnFirstUse("vitmask.train.run")  # what `vitmask.train` and `vitmask.finetune` run too


def _library_first(callback):
    """`callback` (a command) importing the library first: `vitmask.cli.verbs`, and with it torch, then
    finding the temporary directory that torch's compiler looks for when it is imported (training
    compiles, and sizing a model on the meta device imports it too). Without a writable one the command
    stops there in one line (`CannotStart`), whichever module it would import first; with one, Python
    keeps it (tempfile.tempdir), and the compiler's import later finds it. The compiler itself is not
    imported here (over a CPU-second): a command that never compiles or sizes a model on the meta
    device does without it. Parsing and `--help` run no command, so they never import torch."""

    @functools.wraps(callback)
    def run(*args, **kwargs):
        try:
            importlib.import_module("vitmask.cli.verbs")
            tempfile.gettempdir()
        except OSError as e:
            raise CannotStart(
                f"{reason(e)} while importing torch (it needs a writable temporary directory); free disk space, "
                "or set TMPDIR to a writable folder with room, and run again"
            ) from None
        return callback(*args, **kwargs)

    return run


def version_lines() -> list[str]:
    """vitmask's version and the installed torch's, without importing torch: its build's own version
    (torch/version.py's `__version__`, with the local tag, as `torch.__version__` says: 2.14.1+cu130),
    else its package metadata's (which may leave the tag out)."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return [f"vitmask {vitmask.__version__}", "torch not installed"]
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        with contextlib.suppress(OSError):
            found = re.search(
                r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", (Path(folder) / "version.py").read_text(), re.M
            )
            torch_version = found.group(1) if found else torch_version
            break
    return [f"vitmask {vitmask.__version__}", f"torch {torch_version}"]


def _print_version(value: bool) -> None:
    if value:
        print("\n".join(version_lines()))
        raise typer.Exit()


def as_paragraphs(text: str | None) -> str | None:
    """A docstring as help text: its paragraphs (split at blank lines) each on one line, so the help
    wraps them at the terminal's width rather than where the source's lines happen to end."""
    if text is None:
        return None
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(text).split("\n\n") if p.strip())


WITHOUT_LIBRARY = {"models"}  # commands that need no torch: `vitmask models` reads shipped.json files


class ParagraphHelpGroup(TyperGroup):
    """The `vitmask` group: every command's help (and the group's own) as paragraphs (`as_paragraphs`),
    the commands listed in the order they are defined (TyperGroup's), each importing the library first
    (`_library_first`) but those of WITHOUT_LIBRARY."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.help = as_paragraphs(self.help)
        for name, command in self.commands.items():
            command.help = as_paragraphs(command.help)
            if name not in WITHOUT_LIBRARY:
                command.callback = _library_first(command.callback)


app = typer.Typer(
    cls=ParagraphHelpGroup,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train and evaluate masked-patch vision transformers on binary images.",
)


@app.callback()
def _group(
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_print_version,
        help="Print vitmask's version and the installed torch's, and exit.",
    ),
) -> None:
    pass


ConfigOpt = typer.Option(
    [],
    "--config",
    "-c",
    help="YAML config file, e.g. configs/default.yaml; repeat it to compose files: a later file's keys win over an "
    "earlier's, key by key, then --set.",
)


def configs(paths: list[Path]) -> Path | list[Path] | None:
    """The --config files as the library takes them: None for none, the path for one, the list for several."""
    return None if not paths else paths[0] if len(paths) == 1 else list(paths)


SetOpt = typer.Option([], "--set", help="Override a config key, e.g. --set train.lr=3e-4 (repeatable; applied last).")
DeviceOpt = typer.Option("auto", "--device", help="auto | cpu | cuda (auto picks cuda when available).")
ForceOpt = typer.Option(
    False,
    "--force-preprocessing",
    help="Keep a --set data.fit, data.threshold or data.invert that contradicts how the images were made binary "
    "(a pack's header, or the pretrained model's config on the same images), and record it; refused without it.",
)
ApplyForceOpt = typer.Option(
    False,
    "--force-preprocessing",
    help="Apply --invert/--no-invert and --threshold where they contradict how the model's training images were "
    "made binary (its data.invert and data.threshold); refused without it.",
)
InvertOpt = typer.Option(
    None,
    "--invert/--no-invert",
    help="Swap foreground and background after the threshold, or not: the model's data.invert (the default) must "
    "agree unless --force-preprocessing.",
)
ThresholdOpt = typer.Option(
    None,
    "--threshold",
    help="A pixel is foreground where its gray level >= THRESHOLD * 255, in [0, 1]: the model's data.threshold "
    "(the default) must agree unless --force-preprocessing.",
)
OrderOpt = typer.Option(
    "confidence",
    "--order",
    help="Which patches a round keeps: confidence (the most probable first, MaskGIT) | random (random order).",
)
TEMPERATURE_HELP = "0: each patch's most likely class; T > 0: a draw from softmax(logits / T)."
WeightsOpt = typer.Option(
    None,
    "--weights",
    help="ema | raw: a checkpoint's EMA weights (the default when it has them) or its trained weights.",
)


def model_arg(flag: str):
    """The parser of a model option (`--checkpoint`, `--init`, `--classifier`): the text as typed, checked
    before it becomes a Path (which would read `./mnist` and `mnist/` as `mnist`): a path that is not
    there and ends in a shipped model's name is refused in one line (pretrained.check_model_arg)."""

    def parse(text: str) -> Path:
        from vitmask.pretrained import check_model_arg

        check_model_arg(text, flag)
        return Path(text)

    return parse


def model_option(flag: str) -> dict:
    """typer.Option's arguments of a model option: its parser (`model_arg`), shown as PATH."""
    return {"parser": model_arg(flag), "metavar": "PATH"}


CHECKPOINT_HELP = (
    "A .pt checkpoint written by vitmask train, an export dir written by vitmask export, or the name of a model "
    "shipped with vitmask (vitmask models lists them; a file or folder of that name wins)."
)
ChoiceOpt = typer.Option(
    0.0,
    "--choice-temperature",
    help="confidence order: Gumbel noise on the ranking, annealed to 0 by the last round (MaskGIT: 4.5; 0 = none).",
)


@app.command()
def train(
    config: list[Path] = ConfigOpt,
    overrides: list[str] = SetOpt,
    run_dir: Path = typer.Option(None, "--run-dir", help="Where the run writes; default runs/<config name>."),
    resume: str = typer.Option(
        None,
        "--resume",
        help="A checkpoint to continue from, or 'auto': the run dir's newest checkpoint, or a fresh start if none.",
    ),
    init: Path = typer.Option(
        None,
        "--init",
        **model_option("--init"),
        help="Start a new run (step 0, fresh optimizer and schedule) from these weights: a full export dir "
        "written by vitmask export, a .pt checkpoint, or a shipped model's name (vitmask models). The config's "
        "model must be the same. Not with --resume.",
    ),
    init_weights: str = typer.Option(
        None,
        "--init-weights",
        help="ema | raw: a checkpoint's EMA weights (the default when it has them) or its trained weights.",
    ),
    device: str = DeviceOpt,
    force_preprocessing: bool = ForceOpt,
) -> None:
    """Train a model; checkpoints, config.yaml and TensorBoard events go to the run dir.

    Under torchrun (`torchrun --nproc_per_node=N -m vitmask train ...`) it trains data-parallel.
    SIGINT/SIGTERM finish the current step, write a checkpoint and exit 130/143.
    """
    result = training.train(
        configs(config),
        overrides,
        run_dir,
        device=device,
        resume=resume,
        init=None if init is None else str(init),  # checked as typed (model_arg): a str reads as it did there
        init_weights=init_weights,
        force_preprocessing=force_preprocessing,
    )
    if os.environ.get("RANK", "0") != "0":
        return
    print(f"done: {result.run_dir}/last.pt  val acc {result.final_metrics.get('val/acc', float('nan')):.4f}")
    print(f"evaluate it with: vitmask eval --checkpoint {result.run_dir}/last.pt --split test")


@app.command("eval")
def eval_(
    checkpoint: Path = typer.Option(..., "--checkpoint", help=CHECKPOINT_HELP, **model_option("--checkpoint")),
    split: str = typer.Option(
        "val", "--split", help="val | test | train: the split scored (the baselines are fitted on train)."
    ),
    mask_ratio: list[float] = typer.Option(
        [], "--mask-ratio", help="Share of patches masked (repeatable, e.g. 0.25 0.5 0.75); default the config's."
    ),
    seed: int = typer.Option(
        0, "--seed", help="Seed of the evaluation masks and --nll draws: the same seed gives the same numbers."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the same numbers as one JSON object."),
    strategy: str = typer.Option(
        None, "--strategy", help="random | block: the masks at each --mask-ratio; default the config's (mixed: random)."
    ),
    centre_box: bool = typer.Option(
        False,
        "--centre-box",
        help="Also score the centre box: the central square of patches, half the grid's side (one more where "
        "that could not sit exactly in the middle).",
    ),
    nll: bool = typer.Option(
        False,
        "--nll",
        help="Also report an upper bound on each image's negative log-likelihood (nats per image, bits per pixel), "
        "the exact NLL of a fixed order and of a mixture of orders, beside a per-pixel Bernoulli fitted on the "
        "train split and 1 bit per pixel.",
    ),
    nll_strata: int = typer.Option(16, "--nll-strata", help="--nll: strata of the hidden-patch count."),
    nll_samples: int = typer.Option(
        2, "--nll-samples", help="--nll: draws per stratum and image (at least 2, for the standard error)."
    ),
    nll_orders: int = typer.Option(
        8,
        "--nll-orders",
        help="--nll: exact NLLs of K orders, 0 to 8 (0: the bound only): the --nll-order alone, and the mixture "
        "of it and its images under the grid's symmetries. K x N forward passes an image (the bound: strata x "
        "samples).",
    ),
    nll_exact_images: int = typer.Option(
        100,
        "--nll-exact-images",
        help="--nll: the exact NLLs on the first N images of --split (0: every image), the bound reported on the "
        "same images beside them; they cost K x N forward passes an image, the bound about 32.",
    ),
    nll_order: str = typer.Option(
        None,
        "--nll-order",
        help="--nll: the fixed order, raster (default) | raster-reverse | column | column-reverse | spiral-in | "
        "spiral-out, or auto: the one of these with the lowest exact NLL on 100 val images.",
    ),
    device: str = DeviceOpt,
    weights: str = WeightsOpt,
    confusion: Path = typer.Option(
        None,
        "--confusion",
        help="A fine-tuned classifier: also write its confusion matrix as this PNG (rows: true, columns: predicted).",
    ),
) -> None:
    """Score a checkpoint on masked patches beside three baselines on the same masks: the majority
    class, the per-position majority and an 8-neighbour lookup table learned from the train split.
    With --nll, also an upper bound on each image's negative log-likelihood, and the exact NLLs of a
    fixed order of the patches and of a mixture of orders. A fine-tuned classifier
    (vitmask finetune) is scored on the labels: accuracy, per-class accuracy, the confusion matrix."""
    from vitmask.evaluate.classify import format_classifier_report
    from vitmask.evaluate.likelihood import format_nll
    from vitmask.evaluate.scores import format_report

    report = verbs.evaluate_checkpoint(
        checkpoint,
        split,
        mask_ratio,
        device,
        seed,
        strategy,
        centre_box,
        nll,
        nll_strata,
        nll_samples,
        weights,
        confusion,
        nll_orders,
        nll_order,
        nll_exact_images,
    )
    if as_json:
        print(json.dumps(report))
        return
    if report.get("task") == "classifier":
        print(format_classifier_report(report))
        return
    print(format_report(report))
    if "nll" in report:
        print("\n" + format_nll(report["nll"]))


@app.command()
def probe(
    checkpoint: Path = typer.Option(..., "--checkpoint", help=CHECKPOINT_HELP, **model_option("--checkpoint")),
    split: str = typer.Option("test", "--split", help="val | test: where the probes are scored."),
    layer: list[int] = typer.Option(
        [],
        "--layer",
        help="Features from block K's output (1..depth; 0: the embedded patches); default the final normalised "
        "tokens. Repeat it (--layer 2 --layer 4) to concatenate several blocks' features.",
    ),
    pool: str = typer.Option(
        "grid",
        "--pool",
        help="grid | mean: the mean of each cell of a --grid, concatenated (the default), or of all tokens.",
    ),
    grid: int = typer.Option(
        None, "--grid", help="--pool grid: G cells a side, 1 to the patches a side (default 4): G*G*D features."
    ),
    k: int = typer.Option(20, "--k", help="Neighbours that vote in the k-NN probe."),
    seed: int = typer.Option(
        0, "--seed", help="Seed of the random-weights floor: the same seed gives the same numbers."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the same numbers as one JSON object."),
    device: str = DeviceOpt,
    weights: str = WeightsOpt,
    per_class: int = typer.Option(
        0,
        "--per-class",
        help="Probe at most K images of each class of each split, a seeded choice (0: every image); "
        "how a pack of any size is probed.",
    ),
) -> None:
    """Linear and k-NN probes on the labels: fitted on train, scored on --split, beside raw pixels,
    random weights and the majority class."""
    from vitmask.evaluate.probe import format_report

    layers = layer[0] if len(layer) == 1 else (layer or None)
    report = verbs.probe_checkpoint(checkpoint, split, layers, k, seed, device, pool, grid, weights, per_class)
    print(json.dumps(report) if as_json else format_report(report))


@app.command()
def reconstruct(
    checkpoint: Path = typer.Option(..., "--checkpoint", help=CHECKPOINT_HELP, **model_option("--checkpoint")),
    out: Path = typer.Option(..., "--out", help="The PNG to write, e.g. recon.png."),
    n: int = typer.Option(16, "--n", help="Images in the grid (one column each)."),
    mask_ratio: float = typer.Option(None, "--mask-ratio", help="Share of patches masked; default the config's."),
    split: str = typer.Option("test", "--split", help="train | val | test"),
    seed: int = typer.Option(0, "--seed", help="Seed of the masks."),
    device: str = DeviceOpt,
    weights: str = WeightsOpt,
) -> None:
    """Write a PNG grid: original, masked input, prediction (visible patches kept), errors in colour
    (red: a missing pixel, orange: a spurious one, blue tint: masked). TensorBoard shows the same."""
    print(f"wrote {verbs.reconstruct(checkpoint, out, n, mask_ratio, split, seed, device, weights)}")


@app.command()
def inpaint(
    checkpoint: Path = typer.Option(..., "--checkpoint", help=CHECKPOINT_HELP, **model_option("--checkpoint")),
    image: Path = typer.Option(..., "--image", help="Your image (PNG, JPEG, BMP); preprocessed as in training."),
    box: list[str] = typer.Option(
        [],
        "--box",
        help="x0,y0,x1,y1 in pixels of the preprocessed (image_size x image_size) image; x1, y1 exclusive. "
        "Every patch the box touches is filled (repeatable).",
    ),
    mask: Path = typer.Option(
        None, "--mask", help="A mask image the size of --image; patches under its white pixels are filled."
    ),
    out: Path = typer.Option(..., "--out", help="The PNG to write: the preprocessed image with the fill."),
    iterative: bool = typer.Option(
        False, "--iterative", help="Fill the most confident patches first and re-predict the rest (MaskGIT-style)."
    ),
    steps: int = typer.Option(8, "--steps", help="Rounds of --iterative filling."),
    temperature: float = typer.Option(0.0, "--temperature", help=TEMPERATURE_HELP),
    seed: int = typer.Option(0, "--seed", help="Seed of the draws (temperature, random order, choice noise)."),
    samples: int = typer.Option(
        1, "--samples", help="Completions to draw; more than 1 writes a grid: the input, then each completion."
    ),
    order: str = OrderOpt,
    choice_temperature: float = ChoiceOpt,
    device: str = DeviceOpt,
    weights: str = WeightsOpt,
    invert: bool = InvertOpt,
    threshold: float = ThresholdOpt,
    force_preprocessing: bool = ApplyForceOpt,
) -> None:
    """Fill part of your own image: with the model's most likely patches (--temperature 0), or with
    patches drawn from its predictions, one or several (--samples) completions. One warning line when
    the image's foreground share is far from its training images'."""
    r = verbs.inpaint(
        checkpoint,
        image,
        box,
        mask,
        out,
        iterative,
        steps,
        device,
        temperature,
        seed,
        samples,
        order,
        choice_temperature,
        weights,
        invert,
        threshold,
        force_preprocessing,
    )
    size = r["image_size"]
    what = f"{size}x{size}" if r["samples"] == 1 else f"the input and {r['samples']} completions"
    print(f"filled {r['filled_patches']} of {r['patches']} patches; wrote {r['out']} ({what})")


@app.command()
def sample(
    checkpoint: Path = typer.Option(..., "--checkpoint", help=CHECKPOINT_HELP, **model_option("--checkpoint")),
    out: Path = typer.Option(..., "--out", help="The PNG grid to write, e.g. samples.png."),
    n: int = typer.Option(64, "--n", help="Images to generate."),
    steps: int = typer.Option(64, "--steps", help="Rounds of decoding (at most one per patch: N is exact sampling)."),
    temperature: float = typer.Option(1.0, "--temperature", help=TEMPERATURE_HELP),
    seed: int = typer.Option(0, "--seed", help="Seed of the draws: the same seed gives the same images."),
    order: str = typer.Option(
        "random",
        "--order",
        help="Which patches a round keeps: random (the any-order sampler the model was trained as; the default"
        " here) | confidence (the most probable first, MaskGIT).",
    ),
    choice_temperature: float = ChoiceOpt,
    device: str = DeviceOpt,
    weights: str = WeightsOpt,
) -> None:
    """Generate new images: start from a canvas with every patch masked and decode it over --steps
    rounds (MaskGIT's cosine schedule), keeping patches in random order by default; write one PNG grid."""
    r = verbs.sample(checkpoint, out, n, steps, temperature, seed, device, order, choice_temperature, weights)
    print(f"wrote {r['out']}: {r['n']} images of {r['image_size']}x{r['image_size']}")


@app.command("count-params")
def count_params(
    config: list[Path] = ConfigOpt,
    checkpoint: Path = typer.Option(
        None,
        "--checkpoint",
        help="Count the model of a checkpoint (or an export dir, or a shipped model's name).",
        **model_option("--checkpoint"),
    ),
    overrides: list[str] = SetOpt,
) -> None:
    """Print one row per parameter tensor, then the total (with a decoder, the encoder's and the decoder's first)."""
    from vitmask.model.params import format_table

    print(format_table(verbs.count_params(configs(config), checkpoint, overrides)))


@app.command("config")
def config_cmd(config: list[Path] = ConfigOpt, overrides: list[str] = SetOpt) -> None:
    """Print the resolved config as YAML: the --config files composed in order (a later file's keys win, key
    by key), then the --set overrides; every key, defaults included. What vitmask train would train with."""
    print(dump_config(verbs.resolve_config(configs(config), overrides)), end="")


@app.command()
def preview(
    config: list[Path] = ConfigOpt,
    overrides: list[str] = SetOpt,
    out: Path = typer.Option(Path("preview.png"), "--out", help="The PNG grid to write."),
    count: int = typer.Option(16, "--count", help="Training images in the grid."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sample and its masks."),
    force_preprocessing: bool = ForceOpt,
) -> None:
    """Write a PNG grid of sample images with their masks, and print the dataset's statistics."""
    print(verbs.preview(configs(config), overrides, out, count, seed, force_preprocessing))
    print(f"wrote {out}")


@app.command()
def export(
    checkpoint: Path = typer.Option(..., "--checkpoint", help=CHECKPOINT_HELP, **model_option("--checkpoint")),
    out: Path = typer.Option(..., "--out", help="The export dir to write: a new or empty folder."),
    weights: str = WeightsOpt,
    encoder_only: bool = typer.Option(
        False, "--encoder-only", help="Drop the decoder (where there is one) and the head: the encoder alone."
    ),
    onnx: bool = typer.Option(
        False,
        "--onnx",
        help="Also write model.onnx (needs the onnx extra, which make train and make test install; in a venv "
        "of your own: pip install -e '.\\[onnx]' in the checkout).",
    ),
) -> None:
    """Write the model as model.safetensors, config.json and a README.md model card (and model.onnx),
    which vitmask.load_pretrained(DIR) and every verb's --checkpoint read back. A fine-tuned classifier
    (vitmask finetune's checkpoint) exports with its classes: vitmask.load_classifier, predict and eval read it."""
    r = verbs.export(checkpoint, out, weights, encoder_only, onnx)
    part = "the classifier" if r.get("classifier") else "the encoder" if r["encoder_only"] else "the whole model"
    print(f"wrote {r['out']}: {', '.join(r['files'])} ({part}, {r['weights']} weights)")


@app.command()
def finetune(
    checkpoint: Path = typer.Option(
        None,
        "--checkpoint",
        **model_option("--checkpoint"),
        help="The pretrained model: a .pt checkpoint, an export dir or a shipped model's name such as mnist "
        "(EMA weights if present).",
    ),
    config: list[Path] = ConfigOpt,
    overrides: list[str] = SetOpt,
    run_dir: Path = typer.Option(None, "--run-dir", help="Where the run writes; default runs/<config name>-finetune."),
    resume: str = typer.Option(
        None, "--resume", help="A fine-tuning checkpoint to continue, or 'auto': the run dir's newest, if any."
    ),
    weights: str = WeightsOpt,
    baselines: bool = typer.Option(
        True,
        "--baselines/--no-baselines",
        help="Also train the same classifier from scratch at the same budget and run the linear probe.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the final numbers as one JSON object."),
    device: str = DeviceOpt,
    force_preprocessing: bool = ForceOpt,
) -> None:
    """Train a classifier on the labels end to end: the checkpoint's encoder, a new head, pooled as
    finetune.pool says; then its test accuracy beside the from-scratch and linear-probe baselines.
    How the images were made binary (data.image_size, fit, threshold, invert) comes from the pack's
    header, or from the pretrained model on the same raw images, over the --config file's values;
    the classifier records it, and vitmask predict applies it to raw images."""
    r = training.finetune(
        None if checkpoint is None else str(checkpoint),  # checked as typed (model_arg)
        configs(config),
        overrides,
        run_dir,
        device=device,
        resume=resume,
        weights=weights,
        baselines=baselines,
        force_preprocessing=force_preprocessing,
    ).report()
    if as_json:
        print(json.dumps(r))
        return
    print(f"test accuracy on {r['test_images']:,} images after {r['steps']} steps ({r['run_dir']}):")
    print(f"  fine-tuned      {r['finetuned']:.4f}")
    if "from_scratch" in r:
        print(f"  from scratch    {r['from_scratch']:.4f}  (the same classifier from a random init, same budget)")
    if "linear_probe" in r:
        print(f"  linear probe    {r['linear_probe']:.4f}  (of {r['checkpoint']}, the same pooling)")


@app.command()
def predict(
    checkpoint: Path = typer.Option(
        ...,
        "--checkpoint",
        **model_option("--checkpoint"),
        help="A fine-tuned classifier: vitmask finetune's .pt checkpoint, its export dir, or a shipped "
        "classifier's name (mnist-classifier).",
    ),
    input_path: Path = typer.Option(
        ...,
        "--input",
        help="An image file (PNG, JPEG, BMP), a folder of them (recursively), an .npz archive or a pack dir "
        "(vitmask pack).",
    ),
    out: Path = typer.Option(..., "--out", help="The file to write, new: .csv or .json, one record per image."),
    top_k: int = typer.Option(1, "--top-k", help="Classes per image, likeliest first (1 to the classifier's count)."),
    batch_size: int = typer.Option(256, "--batch-size", help="Images read and classified at a time."),
    split: str = typer.Option(None, "--split", help="A pack dir: train | val | test only (default: all its images)."),
    npz_key: str = typer.Option("images", "--npz-key", help="An .npz archive: the key of its image array."),
    weights: str = WeightsOpt,
    device: str = DeviceOpt,
    fit: str = typer.Option(
        None,
        "--fit",
        help="pad | center_crop | resize | none: how images of another size than the model's are fitted to it, "
        "instead of the model's data.fit; each record then names it (not for a pack dir).",
    ),
    invert: bool = InvertOpt,
    threshold: float = ThresholdOpt,
    force_preprocessing: bool = ApplyForceOpt,
) -> None:
    """Classify images with a fine-tuned classifier: each image's top-k classes (by name where the
    labels have names) and their probabilities, through the preprocessing it was trained with. One
    warning line when the images' foreground share is far from its training images'."""
    from vitmask.cli.predict import predict as predict_verb

    r = predict_verb(
        checkpoint,
        input_path,
        out,
        top_k,
        batch_size,
        weights,
        device,
        split,
        npz_key,
        fit=fit,
        invert=invert,
        threshold=threshold,
        force_preprocessing=force_preprocessing,
    )
    images = f"{r['images']:,} image{'' if r['images'] == 1 else 's'}"
    fitted = f", images of another size fitted by {r['fit']}" if r["fit"] else ""
    print(f"wrote {r['out']}: {images}, the top {r['top_k']} of {r['classes']} classes each{fitted}")


@app.command()
def sweep(
    config: list[Path] = ConfigOpt,
    overrides: list[str] = SetOpt,
    space: Path = typer.Option(
        None,
        "--space",
        help="The search space: a YAML file mapping config keys to distributions, e.g. "
        "train.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true} (docs/sweeps.md).",
    ),
    trials: int = typer.Option(
        None,
        "--trials",
        help="Finished trials (complete or pruned) the study is to have in all, whichever workers ran them: a "
        "rerun runs only what is missing.",
    ),
    storage: str = typer.Option(
        ..., "--storage", help="The study's database: sqlite:///runs/sweep.db, or postgresql://user:pass@host/db."
    ),
    study: str = typer.Option(..., "--study", help="The study's name in the storage: a new one, or one to go on with."),
    out: Path = typer.Option(
        None,
        "--out",
        help="Where the trials' run dirs go (<out>/trial-0003), and --report's sweep.png and best.yaml; "
        "default runs/<study>.",
    ),
    metric: str = typer.Option(
        None,
        "--metric",
        help="The validation metric optimised, as logged: val/loss (default), val/acc, val_ema/loss...",
    ),
    direction: str = typer.Option(
        None, "--direction", help="minimize | maximize; default: maximize for an accuracy, minimize otherwise."
    ),
    pruner: str = typer.Option(
        "median",
        "--pruner",
        help="median | halving | none: what stops a trial at a validation (Optuna's MedianPruner, "
        "SuccessiveHalvingPruner, NopPruner).",
    ),
    device: str = DeviceOpt,
    heartbeat: int = typer.Option(
        60,
        "--heartbeat",
        help="Seconds between a running trial's heartbeats: a trial unheard of for twice this is failed and run "
        "again by another worker.",
    ),
    report: bool = typer.Option(
        False, "--report", help="Run nothing: print the best trials, write sweep.png and best.yaml in --out."
    ),
    top: int = typer.Option(10, "--top", help="--report: the finished trials shown, best first."),
) -> None:
    """Search config keys with Optuna: trials of a study kept in a database, each a normal run in
    <out>/trial-NNNN, each validation reported and the run stopped cleanly when the pruner prunes it.
    Several workers (processes, machines) share one study; a rerun after a kill goes on where it
    stopped. With --report: the best trials as a table, the history and parameter importances as a
    PNG, and the best trial's config as best.yaml. Needs the sweep extra (optuna, matplotlib)."""
    from vitmask.cli.sweep import sweep as sweep_verb

    sweep_verb(
        config=configs(config),
        sets=overrides,
        space=space,
        trials=trials,
        storage=storage,
        study=study,
        out=out,
        metric=metric,
        direction=direction,
        pruner=pruner,
        device=device,
        heartbeat=heartbeat,
        report=report,
        top=top,
    )


@app.command()
def pack(
    config: list[Path] = ConfigOpt,
    overrides: list[str] = SetOpt,
    out: Path = typer.Option(None, "--out", help="The packed dataset directory to write (docs/corpora.md)."),
    verify: Path = typer.Option(
        None,
        "--verify",
        help="Check the packed dataset DIR whole instead: every file and row against its checksum.",
    ),
    no_labels: bool = typer.Option(
        False,
        "--no-labels",
        help="Pack the images without labels (classes: null): where the source's labels cannot be used "
        "(refused without it), or are not wanted.",
    ),
) -> None:
    """Pack the configured source into a bit-packed, memory-mapped dataset (train it with data.source=packed),
    or check one with --verify DIR."""
    if verify is not None:
        if out is not None or config or overrides:
            raise UserError("pack --verify DIR checks a pack and takes no --out, --config or --set; run them apart")
        if no_labels:
            raise UserError("pack --no-labels is for writing a pack (--out DIR), not for --verify; run them apart")
        from vitmask.data.packed import verify_packed

        done = verify_packed(verify)
        if done["blocks"]:
            print(
                f"{verify}: whole: {done['count']:,} images; the header, the indices, the labels and the rows "
                f"({done['blocks']:,} blocks and their SHA-256) match their checksums"
            )
        else:
            print(f"{verify}: the rows of its {done['count']:,} images match the header's SHA-256 (its only checksum)")
        return
    if out is None:
        raise UserError("pack needs --out DIR (the pack to write), or --verify DIR (a pack to check)")
    header = verbs.pack(configs(config), overrides, out, labels=not no_labels)
    splits = ", ".join(f"{k} {v['count']:,}" for k, v in header["splits"].items())
    print(f"wrote {out}: {header['count']:,} images {header['height']}x{header['width']} ({splits})")


def _stop(signum, frame):
    raise Stopped(signum)


@contextlib.contextmanager
def _signals_raise_stopped():
    """SIGINT and SIGTERM raise `Stopped` (the training loop installs its own handler meanwhile)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():  # in the `vitmask` process the command is over: ignore (see entry.py)
            signal.signal(s, signal.SIG_IGN if h is early_stop else h)


def _flush_stdout() -> None:
    """Flush what the command printed now, so a full disk or closed pipe behind stdout is one line
    here rather than a message from the interpreter's shut-down."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        outputs.mute_stdout()
        raise UserError(f"cannot write the output to stdout: {reason(e)}") from None


def _check_std_streams() -> None:
    """Refuse to start with stdout closed (`vitmask eval ... >&-`), where Python has no sys.stdout.

    File descriptors 1 and 2, where closed, are first pointed at /dev/null, so that no file this
    command opens (a checkpoint's temp file) takes their number and receives what is printed."""
    closed = [fd for fd, stream in ((1, sys.stdout), (2, sys.stderr)) if stream is None]
    for fd in closed:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        raise UserError(
            "stdout is closed, so nothing this command prints could be read; run it with stdout open, "
            "or send it to a file or to /dev/null (> out.txt, > /dev/null)"
        )


def _run_app(args: list[str]):
    """The parser and the command. A write to a closed stdout inside them (a command's print, `--help`)
    is a `BrokenPipeError` here, as it is in `_flush_stdout`, not the parser's own answer to it (exit 1)."""
    try:
        return app(args=args, prog_name="vitmask", standalone_mode=False)
    except SystemExit as e:
        if isinstance(e.__context__, BrokenPipeError):  # click: `except OSError (EPIPE): sys.exit(1)`
            raise e.__context__ from None
        raise


def _say(line: str) -> None:
    """One line on stderr. A stderr that cannot take it (a full disk, its reader gone) is pointed at
    /dev/null instead, so the exit code still says what happened (2, 130, ...) rather than 1 from a
    failed print, and the interpreter's last flush at exit fails quietly."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    for stream in (sys.stdout, sys.stderr):  # a path with undecodable bytes must not crash a print
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")
    try:
        with _signals_raise_stopped():
            _check_std_streams()
            if not args:
                names = ", ".join(c.name or c.callback.__name__ for c in app.registered_commands)
                raise UsageError(f"no command given; use one of {names}")
            rv = _run_app(args)
            _flush_stdout()
    except UsageError as e:
        cmd = e.ctx.command_path if e.ctx is not None else "vitmask"
        message = e.format_message().strip() or "bad usage"
        _say(f"{cmd}: error: {' '.join(message.split())} (see '{cmd} --help')")
        sys.exit(2)
    except CannotStart as e:
        _say(f"vitmask: cannot start: {e}")
        sys.exit(2)
    except UserError as e:
        _say(f"vitmask: error: {' '.join(str(e).split())}")
        sys.exit(2)
    except CallbackError as e:  # a training callback raised; its run stopped after writing a checkpoint
        _say(f"vitmask: error: {' '.join(str(e).split())}")
        sys.exit(1)
    except Interrupted as e:  # SIGINT / SIGTERM during training, after its checkpoint was written
        _say(f"vitmask: {e}")
        sys.exit(e.code)
    except (Stopped, KeyboardInterrupt) as e:  # a signal outside the training loop
        stop = e if isinstance(e, Stopped) else Stopped(signal.SIGINT)
        _say(f"vitmask: stopped by {stop.name} before it finished; no partial output was left")
        sys.exit(stop.code)
    except BrokenPipeError:  # stdout closed by the reader: nothing more to say to it
        outputs.mute_stdout()
        sys.exit(128 + signal.SIGPIPE)
    except (RuntimeError, MemoryError) as e:  # an allocation no estimate foresaw (a size asked for on the command line)
        from vitmask.runtime.memory import is_out_of_memory, out_of_memory  # imports torch: only this path needs it

        if not is_out_of_memory(e):
            raise
        _say(f"vitmask: error: {out_of_memory(e, None, ' '.join(args[:1]) or 'vitmask')}")
        sys.exit(2)
    except OSError as e:  # the file system refused a path no check above foresaw (too long, a loop, I/O error)
        what = f"{e.filename}: " if e.filename else ""
        _say(f"vitmask: error: {what}{reason(e)}; check the path and the file system")
        sys.exit(2)
    sys.exit(rv if isinstance(rv, int) else 0)


# ---- vitmask models: the models shipped inside vitmask (vitmask/pretrained) -------------------------------------
@app.command()
def models(
    as_json: bool = typer.Option(False, "--json", help="Print the same records as one JSON list."),
) -> None:
    """List the models shipped inside vitmask: each one's task, recipe, data, size on disk and its figures on
    its own test split. Pass a name wherever a checkpoint goes (--checkpoint mnist, train --init mnist,
    vitmask.load_pretrained("mnist")); a file or folder of the same name wins."""
    from vitmask.pretrained import format_listing, listing

    rows = listing()
    print(json.dumps(rows) if as_json else format_listing(rows))


@app.command()
def demo(
    checkpoint: Path = typer.Option(
        None,
        "--checkpoint",
        **model_option("--checkpoint"),
        help="The masked-patch model the page fills and samples with: a .pt checkpoint, an export dir or a "
        "shipped model's name (default: the shipped model mnist).",
    ),
    classifier: Path = typer.Option(
        None,
        "--classifier",
        **model_option("--classifier"),
        help="A fine-tuned classifier for the page's classify panel: vitmask finetune's checkpoint, its export "
        "or a shipped classifier's name (default: mnist-classifier beside the shipped model; none with --checkpoint).",
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="The address to listen on: 127.0.0.1 (this machine only), 0.0.0.0 (every address)."
    ),
    port: int = typer.Option(8000, "--port", help="The port to listen on (0: any free port)."),
    device: str = DeviceOpt,
    weights: str = WeightsOpt,
) -> None:
    """Serve a web page to play with a model: draw, pick or upload an image, hide patches and fill them
    (step by step), sample new images, classify them. It prints the address to open and runs until
    Ctrl-C (exit 130) or SIGTERM (143).

    The page's numbers are the CLI's: its fill is vitmask inpaint's for the same image, mask, options and
    seed, its samples vitmask sample's, its top-k vitmask predict's. Needs the demo extra (starlette, uvicorn)."""
    from vitmask.demo import require_demo_extra

    require_demo_extra()
    from vitmask.demo.serve import serve

    try:
        serve(checkpoint, classifier, host, port, device, weights)
    except Stopped as e:
        _say(f"vitmask demo: stopped by {e.name}")
        raise SystemExit(e.code) from None
