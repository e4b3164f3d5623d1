"""What each CLI command does, as plain functions: run dirs, resuming, evaluating a checkpoint,
reconstructions and inpainting.

The CLI only parses arguments and renders results and errors; everything here is callable from
Python and raises `UserError` for bad input.
"""

from pathlib import Path

import torch

from vitmask import distributed
from vitmask.checkpoint import checkpoint_config, latest_checkpoint, load_checkpoint, load_model, remove_stale_temps
from vitmask.config import Config, config_from_dict, dump_config, load_config
from vitmask.data import SPLITS, eval_batches, load_labelled_splits, load_splits
from vitmask.errors import UserError
from vitmask.evaluate import evaluate_split
from vitmask.inpaint import boxes_to_mask, check_patch_mask, fill, mask_image_to_pixels, parse_box, pixels_to_patches
from vitmask.metrics_log import TensorBoardLogger
from vitmask.model import build_model
from vitmask.params import ParamRow, param_rows
from vitmask.preprocess import binarize_images, load_image_file
from vitmask.probe import online_probe, run_probes
from vitmask.render import paste_predictions, reconstruction_grid, save_binary_image, save_grid
from vitmask.runtime import resolve_device
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


def evaluate_checkpoint(
    path: Path, split: str, ratios: list[float] | float | None, device_name: str, seed: int = 0
) -> dict:
    """The eval report of a checkpoint: the model and the baselines at each mask ratio (default: the
    config's), on `split`, with masks drawn from `seed`."""
    _check_split(split)
    ratios = [ratios] if isinstance(ratios, (int, float)) else list(ratios or [])
    for r in ratios:
        check_ratio(r)
    device = resolve_device(device_name)
    model, cfg, _ = load_model(path, device)
    splits = load_splits(cfg)
    images = splits[split].to(device)
    results = evaluate_split(
        model, cfg, splits["train"].to(device), images, ratios or [cfg.mask.ratio], seed, progress=True
    )
    return {
        "checkpoint": str(path),
        "split": split,
        "seed": seed,
        "images": len(images),
        "patch_size": cfg.data.patch_size,
        "results": results,
    }


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
) -> dict:
    """Fill the patches of a user's image under the boxes and/or mask image; write the filled image."""
    if not boxes and mask_path is None:
        raise UserError("nothing to fill; pass --box x0,y0,x1,y1 (repeatable) or --mask mask.png")
    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
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
    mask = mask.unsqueeze(0).to(device)  # (1, N)
    picture = picture.to(device)
    classes = fill(model, picture, mask, d.patch_size, steps if iterative else 1)  # (1, N)
    filled = paste_predictions(picture, mask, classes, d.patch_size)[0]  # (S, S)
    save_binary_image(filled, out)
    return {"out": str(out), "filled_patches": int(mask.sum()), "patches": mask.numel(), "image_size": d.image_size}


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
