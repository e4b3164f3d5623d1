"""What each CLI command does, as plain functions: run dirs, resuming, evaluating a checkpoint,
reconstructions, inpainting and sampling.

The CLI only parses arguments and renders results and errors; everything here is callable from
Python and raises `UserError` for bad input.
"""

import dataclasses
import math
from pathlib import Path

import torch

from vitmask import distributed
from vitmask.checkpoint import checkpoint_config, latest_checkpoint, load_checkpoint, load_model, remove_stale_temps
from vitmask.config import Config, config_from_dict, dump_config, load_config
from vitmask.data import SPLITS, eval_batches, load_labelled_splits, load_splits
from vitmask.errors import UserError
from vitmask.evaluate import evaluate_split
from vitmask.inpaint import boxes_to_mask, check_patch_mask, mask_image_to_pixels, parse_box, pixels_to_patches
from vitmask.likelihood import check_nll_args, nll_report
from vitmask.masking import centre_box_mask
from vitmask.metrics_log import TensorBoardLogger
from vitmask.model import build_model
from vitmask.params import ParamRow, param_rows
from vitmask.preprocess import binarize_images, load_image_file
from vitmask.probe import online_probe, run_probes
from vitmask.render import image_grid, paste_predictions, reconstruction_grid, save_binary_image, save_grid
from vitmask.runtime import resolve_device
from vitmask.sampling import DecodeOptions, decode_masked, sample_images
from vitmask.train import Trainer


def resolve_config(config: Path | None, overrides: list[str], state: dict | None = None) -> Config:
    if config is not None:
        return load_config(config, overrides)
    if state is not None:
        return config_from_dict(state["config"], overrides)
    raise UserError("no config given; pass --config PATH (for example configs/default.yaml)")


def _prepare_run_dir(run_dir: Path, may_exist: bool) -> None:
    if not may_exist and run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(
            f"run dir {run_dir} already exists and is not empty; continue it with --resume auto, "
            "or start a new run with --run-dir DIR"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"run dir {run_dir} is not writable ({e.strerror}); pass a writable --run-dir") from None


def train(
    config: Path | None,
    overrides: list[str],
    run_dir: Path | None,
    resume: str | None,
    device_name: str,
) -> tuple[Path, dict[str, float]]:
    """Start or continue a run. Returns the run dir and the final validation metrics.

    `resume` is a checkpoint path, or "auto": the newest checkpoint in the run dir, or a fresh start
    when it has none. Under torchrun every rank trains; only rank 0 writes the run dir.
    """
    world, device = distributed.init(resolve_device(device_name))
    try:
        state = None
        if resume is not None and resume != "auto":
            state = load_checkpoint(resume)
            run_dir = run_dir or Path(resume).parent
        if resume == "auto" and run_dir is not None and (latest := latest_checkpoint(run_dir)) is not None:
            state = load_checkpoint(latest)
        cfg = resolve_config(config, overrides, state)
        if run_dir is None:  # --resume auto with a config: the config names the run dir
            run_dir = Path("runs") / cfg.name
            if resume == "auto" and (latest := latest_checkpoint(run_dir)) is not None:
                state = load_checkpoint(latest)
        if world.main:
            _prepare_run_dir(run_dir, may_exist=state is not None or resume == "auto")
            remove_stale_temps(run_dir)
        data = load_labelled_splits(cfg)
        probe = online_probe(cfg, data, device) if world.main else None
        logger = TensorBoardLogger(run_dir) if world.main else None
        trainer = Trainer(cfg, data.images, device, logger=logger, world=world, probe=probe)
        if state is not None:
            trainer.load_state_dict(state)
            if world.main:
                print(f"resuming {run_dir} from step {trainer.step}")
        if world.main:
            (run_dir / "config.yaml").write_text(dump_config(cfg))
        try:
            val = trainer.fit(run_dir)
        finally:
            trainer.close()
        return run_dir, val
    finally:
        distributed.shutdown()


def check_ratio(ratio: float) -> None:
    if not 0.0 < ratio < 1.0:
        raise UserError(f"--mask-ratio must be strictly between 0 and 1, got {ratio}")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"unknown split '{split}'; use one of {', '.join(SPLITS)}")


def _check_out(out: Path) -> None:
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {out} must end in .png; pass a PNG path such as recon.png")
    if not out.parent.is_dir():
        raise UserError(f"the folder of --out {out} does not exist; create {out.parent} or pick another --out")


EVAL_STRATEGIES = ("random", "block")


def evaluate_checkpoint(
    path: Path,
    split: str,
    ratios: list[float] | float | None,
    device_name: str,
    seed: int = 0,
    strategy: str | None = None,
    centre_box: bool = False,
    nll: bool = False,
    nll_strata: int = 16,
    nll_samples: int = 2,
) -> dict:
    """The eval report of a checkpoint: the model and the baselines at each mask ratio (default: the
    config's), on `split`, with masks of `strategy` (default the config's, mixed read as random)
    drawn from `seed`; with `centre_box`, also the centre box; with `nll`, the likelihood bound
    and its baselines (likelihood.nll_report) under "nll"."""
    _check_split(split)
    ratios = [ratios] if isinstance(ratios, (int, float)) else list(ratios or [])
    for r in ratios:
        check_ratio(r)
    if strategy is not None and strategy not in EVAL_STRATEGIES:
        raise UserError(f"--strategy must be one of {', '.join(EVAL_STRATEGIES)}, got '{strategy}'")
    device = resolve_device(device_name)
    model, cfg, _ = load_model(path, device)
    d = cfg.data
    if nll:
        check_nll_args(d.num_patches, d.num_classes, nll_strata, nll_samples)
    box = centre_box_mask(d.grid)
    if centre_box and not box.any():
        raise UserError(f"--centre-box needs at least 2x2 patches; this model's grid is {d.grid}x{d.grid}")
    splits = load_splits(cfg)
    images = splits[split].to(device)
    train = splits["train"].to(device)
    results = evaluate_split(
        model, cfg, train, images, ratios or [cfg.mask.ratio], seed, progress=True, strategy=strategy
    )
    if centre_box:
        share = int(box.sum()) / d.num_patches
        results += evaluate_split(model, cfg, train, images, [share], seed, progress=True, strategy="centre")
    report = {
        "checkpoint": str(path),
        "split": split,
        "seed": seed,
        "images": len(images),
        "patch_size": d.patch_size,
        "results": results,
    }
    if nll:
        report["nll"] = nll_report(model, train, images, d.patch_size, nll_strata, nll_samples, seed, progress=True)
    return report


def reconstruct(path: Path, out: Path, n: int, ratio: float | None, split: str, seed: int, device_name: str) -> Path:
    """Write the reconstruction grid (the picture TensorBoard shows) of the first `n` images of `split`."""
    _check_split(split)
    if ratio is not None:
        check_ratio(ratio)
    if n < 1:
        raise UserError(f"--n must be at least 1, got {n}")
    _check_out(out)
    device = resolve_device(device_name)
    model, cfg, _ = load_model(path, device)
    images = load_splits(cfg)[split][:n].to(device)
    ratio = cfg.mask.ratio if ratio is None else ratio
    batch = next(eval_batches(images, cfg, ratio, seed, len(images)))
    with torch.inference_mode():
        pred = model(batch.patches, batch.mask).argmax(-1)  # (n, N)
    save_grid(reconstruction_grid(images, batch.mask, pred, cfg.data.patch_size), out, scale=4)
    return out


def inpaint(
    path: Path,
    image: Path,
    boxes: list[str],
    mask_path: Path | None,
    out: Path,
    iterative: bool,
    steps: int,
    device_name: str,
    temperature: float = 0.0,
    seed: int = 0,
    samples: int = 1,
    order: str = "confidence",
    choice_temperature: float = 0.0,
) -> dict:
    """Fill the patches of a user's image under the boxes and/or mask image; write the filled image,
    or with `samples` K > 1 a grid of the input (the hole grey) and K completions drawn from `seed`."""
    if not boxes and mask_path is None:
        raise UserError("nothing to fill; pass --box x0,y0,x1,y1 (repeatable) or --mask mask.png")
    options = DecodeOptions(steps, temperature, order, choice_temperature)  # checks every value
    if not iterative:
        options = dataclasses.replace(options, steps=1)
    if samples < 1:
        raise UserError(f"--samples must be at least 1, got {samples}")
    if samples > 1 and options.deterministic:
        raise UserError(
            f"--samples {samples} at --temperature 0 would give {samples} identical completions; "
            "pass --temperature 1 (or --order random, or --choice-temperature 4.5)"
        )
    _check_out(out)
    device = resolve_device(device_name)
    model, cfg, _ = load_model(path, device)
    d = cfg.data
    gray = load_image_file(image)  # (h, w) uint8
    picture = binarize_images(gray.unsqueeze(0), d)  # (1, S, S) the training preprocessing
    pix = boxes_to_mask([parse_box(b, d.image_size) for b in boxes], d.image_size)  # (S, S)
    if mask_path is not None:
        pix |= mask_image_to_pixels(load_image_file(mask_path), tuple(gray.shape), d)
    mask = pixels_to_patches(pix, d.patch_size)  # (N,)
    check_patch_mask(mask)
    mask = mask.unsqueeze(0).to(device).expand(samples, -1)  # (K, N)
    picture = picture.to(device).expand(samples, -1, -1)  # (K, S, S)
    generator = torch.Generator(device=device).manual_seed(seed)
    classes = decode_masked(model, picture, mask, d.patch_size, options, generator)  # (K, N)
    filled = paste_predictions(picture, mask, classes, d.patch_size)  # (K, S, S)
    if samples == 1:
        save_binary_image(filled[0], out)
    else:  # the input with its hole grey, then the completions
        tiles = torch.cat([picture[:1], filled])  # (K + 1, S, S)
        hole = torch.cat([mask[:1], torch.zeros_like(mask)])  # (K + 1, N): grey only on the input
        save_grid(image_grid(tiles, min(samples + 1, 8), hole, d.patch_size), out, scale=4)
    return {
        "out": str(out),
        "filled_patches": int(mask[0].sum()),
        "patches": mask.shape[1],
        "image_size": d.image_size,
        "samples": samples,
    }


def sample(
    path: Path,
    out: Path,
    n: int,
    steps: int,
    temperature: float,
    seed: int,
    device_name: str,
    order: str = "confidence",
    choice_temperature: float = 0.0,
) -> dict:
    """Generate `n` images from a fully masked canvas (sampling.sample_images); write them as one PNG grid."""
    if n < 1:
        raise UserError(f"--n must be at least 1, got {n}")
    options = DecodeOptions(steps, temperature, order, choice_temperature)  # checks every value
    _check_out(out)
    device = resolve_device(device_name)
    model, cfg, _ = load_model(path, device)
    d = cfg.data
    generator = torch.Generator(device=device).manual_seed(seed)
    images = sample_images(model, n, d.image_size, d.patch_size, options, generator, device)  # (n, S, S)
    save_grid(image_grid(images, math.ceil(math.sqrt(n))), out, scale=3)
    return {"out": str(out), "n": n, "image_size": d.image_size, "steps": steps, "temperature": temperature}


def count_params(config: Path | None, checkpoint: Path | None, overrides: list[str]) -> list[ParamRow]:
    """One row per parameter tensor (name, shape, count, the seed's name) of the model a config, or a
    checkpoint's config, describes, `overrides` applied."""
    if (config is None) == (checkpoint is None):
        raise UserError("count-params needs exactly one of --config PATH or --checkpoint PATH")
    cfg = checkpoint_config(checkpoint, overrides) if checkpoint is not None else load_config(config, overrides)
    return param_rows(build_model(cfg))


def preview(config: Path | None, overrides: list[str], out: Path, count: int, seed: int) -> str:
    """Write the preview grid of the configured data to `out`; return the statistics as text."""
    from vitmask.preview import format_stats, write_preview

    cfg = resolve_config(config, overrides)
    stats = write_preview(load_splits(cfg), cfg, out, count, seed)
    return format_stats(stats, cfg)


def probe_checkpoint(path: Path, split: str, layer: int | None, k: int, seed: int, device_name: str) -> dict:
    """The probe report of a checkpoint (probe.py): linear and k-NN accuracy on `split` of its
    features, of random weights and of raw pixels, and the majority class."""
    if split not in ("val", "test"):
        raise UserError(f"unknown split '{split}' for probe; use val or test (the probes are fitted on train)")
    device = resolve_device(device_name)
    model, cfg, _ = load_model(path, device)
    report = run_probes(model, cfg, load_labelled_splits(cfg), split, layer, k, seed)
    return {"checkpoint": str(path), **report}
