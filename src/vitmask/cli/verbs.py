"""What each CLI command does, as plain functions: run dirs, resuming, evaluating a checkpoint,
reconstructions, inpainting and sampling.

The CLI only parses arguments and renders results and errors; everything here is callable from
Python and raises `UserError` for bad input.
"""

import dataclasses
import math
from pathlib import Path

import torch

from vitmask.config import Config, check_seed, config_from_dict, load_config
from vitmask.data.batches import SPLITS, eval_batches, load_labelled_splits, load_splits
from vitmask.data.binarization import Asked, follow_pack, pixels_share, tell, warn_if_far
from vitmask.data.masking import centre_box_mask
from vitmask.data.packed import PackedImages, spread
from vitmask.data.per_class import take_per_class, unpacked_splits
from vitmask.data.preprocess import binarize_images, load_image_file
from vitmask.data.processor import ImageProcessor, ProcessedImages
from vitmask.errors import UserError, warn
from vitmask.evaluate.classify import classifier_report, confusion_image, confusion_matrix
from vitmask.evaluate.exact_nll import AUTO, AUTO_IMAGES, check_exact_args, exact_nll_report
from vitmask.evaluate.likelihood import check_nll_args, nll_report
from vitmask.evaluate.pictures import image_grid, reconstruction_grid, save_binary_image, save_grid
from vitmask.evaluate.probe import require_labels, run_probes
from vitmask.evaluate.scores import evaluate_split
from vitmask.generate.inpaint import (
    boxes_to_mask,
    fill_image,
    inpaint_options,
    mask_image_to_pixels,
    parse_box,
    pixels_to_patches,
)
from vitmask.generate.sampling import DecodeOptions, sample_from_seed
from vitmask.inference.classifier import BATCH, ImageClassifier
from vitmask.inference.open import open_model
from vitmask.model.memory_estimate import check_fits, check_model_fits
from vitmask.model.params import ParamRow, param_rows
from vitmask.model.vit import build_model
from vitmask.outputs import (
    check_not_a_link_loop,
    check_out_file,
    file_id,
    reason,
    write_atomically,
)
from vitmask.pretrained import check_data, resolve_model_path
from vitmask.progress import Progress
from vitmask.runtime.process import resolve_device
from vitmask.store import classifier as classifiers
from vitmask.store import export as exports
from vitmask.store.export import load_model
from vitmask.store.model_files import open_model_files
from vitmask.train import run
from vitmask.train.run import load_data, run_plan  # noqa: F401  (run_plan: what tests and scripts call here)

MAX_GRID_IMAGES = 256  # images in one reconstruct or preview PNG: beyond, the grid alone takes gigabytes


def resolve_config(config: Path | list[Path] | None, overrides: list[str], state: dict | None = None) -> Config:
    if config is not None:
        return load_config(config, overrides)
    if state is not None:
        return config_from_dict(state["config"], overrides)
    raise UserError("no config given; pass --config PATH (for example configs/default.yaml)")


def train(
    config: Path | list[Path] | None,
    overrides: list[str],
    run_dir: Path | None,
    resume: str | None,
    device_name: str,
    init: Path | None = None,
    init_weights: str | None = None,
    force_preprocessing: bool = False,
) -> tuple[Path, dict[str, float]]:
    """`vitmask train` (train/run.py `train`, which the command runs) as the run dir and the final
    validation's metrics by their plain names (loss, acc, ...)."""
    result = run.train(
        config,
        overrides,
        run_dir,
        device=device_name,
        resume=resume,
        init=init,
        init_weights=init_weights,
        force_preprocessing=force_preprocessing,
    )
    return result.run_dir, {k.removeprefix("val/"): v for k, v in result.final_metrics.items() if k.startswith("val/")}


def check_grid_count(value: int, flag: str, what: str) -> None:
    """A count of images in one PNG grid: 1 to MAX_GRID_IMAGES (beyond, the grid alone takes gigabytes)."""
    if not 1 <= value <= MAX_GRID_IMAGES:
        raise UserError(
            f"{flag} must be at least 1 and at most {MAX_GRID_IMAGES} ({what} in one PNG grid), got {value}"
        )


def check_ratio(ratio: float) -> None:
    if not 0.0 < ratio < 1.0:
        raise UserError(f"--mask-ratio must be strictly between 0 and 1, got {ratio}")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"unknown split '{split}'; use one of {', '.join(SPLITS)}")


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
    weights: str | None = None,
    confusion: Path | None = None,
    nll_orders: int = 8,
    nll_order: str | None = None,
    nll_exact_images: int = 100,
) -> dict:
    """The eval report of a checkpoint: the model and the baselines at each mask ratio (default: the
    config's), on `split`, with masks of `strategy` (default the config's, mixed read as random)
    drawn from `seed`; with `centre_box`, also the centre box; with `nll`, the likelihood bound
    and its baselines (likelihood.nll_report) under "nll", and with `nll_orders` K > 0 the exact
    NLLs of the fixed order `nll_order` (default raster; auto: chosen on the val split) and of the
    mixture of K orders (exact_nll.exact_nll_report) under "nll" / "exact", on the first
    `nll_exact_images` images of the split (0: all), beside the bound on the same images. `path` is a .pt
    checkpoint or an export dir; `weights` ema | raw picks a checkpoint's weights (default: the
    EMA's when it has them). A fine-tuned classifier gets `evaluate_classifier`'s report instead
    (`confusion`: its PNG)."""
    _check_split(split)
    if nll_order is not None and not nll:
        raise UserError("--nll-order picks the order of --nll's exact NLLs; add --nll, or leave --nll-order out")
    check_exact_args(nll_orders, nll_order, nll_exact_images)  # a bad value is refused with --nll or without
    ratios = [ratios] if isinstance(ratios, (int, float)) else list(ratios or [])
    if classifiers.is_classifier(path):
        masked_only = {
            "--mask-ratio": bool(ratios),
            "--strategy": strategy is not None,
            "--centre-box": centre_box,
            "--nll": nll,
        }
        for flag, given in masked_only.items():
            if given:
                raise UserError(
                    f"{flag} scores a masked-patch model, and {path} is a fine-tuned classifier, which eval scores "
                    f"by its accuracy on the labels; leave {flag} out"
                )
        return evaluate_classifier(path, split, device_name, weights, confusion)
    if confusion is not None:
        open_model_files(path)  # what is not a model at all (missing, empty, text, a folder without one) says so first
        raise UserError(
            f"--confusion draws a fine-tuned classifier's confusion matrix, and {path} is a masked-patch model; "
            "leave --confusion out, or pass a classifier (vitmask finetune's checkpoint or its export)"
        )
    for r in ratios:
        check_ratio(r)
    if strategy is not None and strategy not in EVAL_STRATEGIES:
        raise UserError(f"--strategy must be one of {', '.join(EVAL_STRATEGIES)}, got '{strategy}'")
    model, cfg, device, _ = open_model(path, device_name, seed, weights)
    data = cfg.data
    if nll:
        check_nll_args(data.num_patches, data.num_classes, nll_strata, nll_samples)
    box = centre_box_mask(data.grid)
    if centre_box and not box.any():
        raise UserError(f"--centre-box needs at least 2x2 patches; this model's grid is {data.grid}x{data.grid}")
    splits = load_data(cfg, device)
    images = splits[split].to(device)
    train = baseline_images(splits["train"]).to(device)
    if nll and isinstance(images, PackedImages):  # the Bernoulli baseline reads the images whole
        images = images.unpacked()
    results = evaluate_split(
        model, cfg, train, images, ratios or [cfg.mask.ratio], seed, progress=True, strategy=strategy
    )
    if centre_box:
        share = int(box.sum()) / data.num_patches
        results += evaluate_split(model, cfg, train, images, [share], seed, progress=True, strategy="centre")
    report = {
        "checkpoint": str(path),
        "split": split,
        "seed": seed,
        "images": len(images),
        "patch_size": data.patch_size,
        "results": results,
    }
    if nll:
        report["nll"] = nll_report(model, train, images, data.patch_size, nll_strata, nll_samples, seed, progress=True)
    if nll and nll_orders:
        choose_on = splits["val"][:AUTO_IMAGES].to(device) if nll_order == AUTO else None
        exact_images = images[:nll_exact_images] if nll_exact_images else images
        report["nll"]["exact"] = exact_nll_report(
            model, exact_images, data.patch_size, nll_orders, nll_order, choose_on, progress=True
        )
        bound = report["nll"]["per_image"][: len(exact_images)]  # the bound on the same images
        report["nll"]["exact"]["bound_same_images"] = sum(bound) / len(bound)
    return report


def evaluate_classifier(
    path: Path, split: str, device_name: str, weights: str | None = None, confusion: Path | None = None
) -> dict:
    """The eval report of a fine-tuned classifier (evaluate/classify.py) on `split` (val or test) of the
    data it was fine-tuned on: accuracy, per-class accuracy, the majority class and the confusion
    matrix; with `confusion`, its picture as a PNG. Logits as `vitmask.load_classifier` computes them."""
    if split not in ("val", "test"):
        raise UserError(f"unknown split '{split}' for a classifier; use val or test (it was fine-tuned on train)")
    replaces = None
    if confusion is not None:
        check_out_file(confusion, "--confusion", inputs=(path,))
        replaces = file_id(confusion)  # the file given, if any: the only one the picture may replace
    device = resolve_device(device_name)
    classifier = ImageClassifier(classifiers.load_classifier_model(path, device, weights))
    cfg, classes = classifier.config, classifier.classes
    check_data(path, cfg.data.source, cfg.data.path)
    if confusion is not None:
        check_out_file(confusion, "--confusion", **data_inputs(cfg))
    data = load_data(cfg, device, load_labelled_splits)
    require_labels(data, cfg)
    data = take_per_class(data, cfg.finetune.per_class, cfg)  # the images fine-tuning read (finetune.per_class)
    labels = data.labels
    target = class_targets(labels[split], classes.values, split)  # (n,)
    train = class_targets(labels["train"], classes.values, "train")
    images, p = data.images[split], cfg.data.patch_size
    logits = []
    with Progress(len(images), f"eval {split}", "img") as bar:
        for chunk in images.split(BATCH):  # (b, S, S) 0/1, a packed split unpacked a batch at a time
            logits.append(classifier.logits(ProcessedImages(chunk, p)))  # (b, L)
            bar.update(len(chunk))
    pred = torch.cat(logits).argmax(1) if logits else torch.zeros(0, dtype=torch.long)
    counts = confusion_matrix(pred, target, len(classes))  # (L, L)
    majority = int(torch.bincount(train, minlength=len(classes)).argmax())
    report = {"checkpoint": str(path), "task": "classifier", "split": split, "weights": classifier.weights}
    report.update(classifier_report(counts, classes.names, classes.values, majority))
    report["confusion_png"] = None
    if confusion is not None:
        picture = confusion_image(counts, classes.names)
        write_atomically(confusion, lambda f: picture.save(f, format="PNG"), "--confusion", replaces=replaces)
        report["confusion_png"] = str(confusion)
    return report


def class_targets(labels: torch.Tensor, values: list[int], split: str) -> torch.Tensor:
    """A split's label values (n,) -> the classifier's class indices (n,); a value it was not trained on
    is one line."""
    known = torch.tensor(values, dtype=torch.long)
    order = known.argsort()
    at = torch.searchsorted(known[order], labels).clamp(max=len(known) - 1)  # (n,)
    found = known[order][at] == labels
    if not bool(found.all()):
        value = int(labels[~found][0])
        raise UserError(
            f"the {split} split holds images labelled {value}, a class the classifier was not fine-tuned on "
            f"(its classes: {', '.join(map(str, values[:20]))}{' ...' if len(values) > 20 else ''}); score it on "
            "the data it was fine-tuned on"
        )
    return order[at]


BASELINE_TRAIN_IMAGES = 1 << 20  # packed train splits: the baselines are fitted on this many, spread over it


def baseline_images(train):
    """What the baselines are fitted on: an in-memory train split whole; a packed one's 2^20 images
    spread over it (all of them when fewer), unpacked."""
    if not isinstance(train, PackedImages):
        return train
    return spread(train, BASELINE_TRAIN_IMAGES).unpacked()


def reconstruct(
    path: Path,
    out: Path,
    n: int,
    ratio: float | None,
    split: str,
    seed: int,
    device_name: str,
    weights: str | None = None,
) -> Path:
    """Write the reconstruction grid (the picture TensorBoard shows) of the first `n` images of `split`."""
    _check_split(split)
    if ratio is not None:
        check_ratio(ratio)
    check_grid_count(n, "--n", "images")
    check_out_file(out, inputs=(path,))
    replaces = file_id(out)  # the file given, if any: the only one the grid may replace
    model, cfg, device, _ = open_model(path, device_name, seed, weights)
    check_out_file(out, **data_inputs(cfg))
    images = load_data(cfg, device)[split][:n].to(device)
    ratio = cfg.mask.ratio if ratio is None else ratio
    batch = next(eval_batches(images, cfg, ratio, seed, len(images)))
    with torch.inference_mode():
        pred = model(batch.patches, batch.mask).argmax(-1)  # (n, N)
    grid = reconstruction_grid(images, batch.mask, pred, cfg.data.patch_size)
    write_atomically(out, lambda f: save_grid(grid, f, scale=4), "--out", replaces=replaces)
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
    weights: str | None = None,
    invert: bool | None = None,
    threshold: float | None = None,
    force_preprocessing: bool = False,
) -> dict:
    """Fill the patches of a user's image under the boxes and/or mask image; write the filled image,
    or with `samples` K > 1 a grid of the input (the hole grey) and K completions drawn from `seed`.
    The image is made binary as the model's training images were; `invert` and `threshold`, where
    given, must agree with its data keys unless `force_preprocessing` (ImageProcessor.with_preprocessing).
    One warning line when the binary image's foreground share is far from the training images'."""
    if not boxes and mask_path is None:
        raise UserError("nothing to fill; pass --box x0,y0,x1,y1 (repeatable) or --mask mask.png")
    options = inpaint_options(iterative, steps, temperature, order, choice_temperature)
    check_grid_count(samples, "--samples", "completions")
    if samples > 1 and options.deterministic:
        raise UserError(
            f"--samples {samples} at --temperature 0 would give {samples} identical completions; "
            "pass --temperature 1 (or --order random, or --choice-temperature 4.5)"
        )
    check_not_a_link_loop(image, "--image")
    if mask_path is not None:
        check_not_a_link_loop(mask_path, "--mask")
    check_out_file(out, inputs=(image, mask_path, path))
    replaces = file_id(out)  # the file given, if any: the only one the result may replace
    model, cfg, _, trained_share = open_model(path, device_name, seed, weights, loads_data=False)
    chosen = ImageProcessor.from_config(cfg).with_preprocessing(None, invert, threshold, force_preprocessing, cli=True)
    data = dataclasses.replace(cfg.data, invert=chosen.invert, threshold=chosen.threshold)
    gray = load_image_file(image)  # (h, w) uint8
    picture = binarize_images(gray.unsqueeze(0), data)  # (1, S, S) the training preprocessing
    warn_if_far(pixels_share(picture), 1, trained_share, chosen, "--invert/--no-invert and --threshold")
    pix = boxes_to_mask([parse_box(b, data.image_size) for b in boxes], data.image_size)  # (S, S)
    if mask_path is not None:
        pix |= mask_image_to_pixels(load_image_file(mask_path), tuple(gray.shape), data)
    mask = pixels_to_patches(pix, data.patch_size)  # (N,)
    filled = fill_image(model, picture[0], mask, data.patch_size, options, seed, samples)  # (K, S, S)
    if samples == 1:
        write_atomically(out, lambda f: save_binary_image(filled[0], f), "--out", replaces=replaces)
    else:  # the input with its hole grey, then the completions
        tiles = torch.cat([picture.to(filled.device), filled])  # (K + 1, S, S)
        hole = torch.cat([mask.unsqueeze(0), torch.zeros(samples, len(mask), dtype=torch.bool)])  # (K + 1, N)
        grid = image_grid(tiles, min(samples + 1, 8), hole, data.patch_size)  # the hole grey on the input only
        write_atomically(out, lambda f: save_grid(grid, f, scale=4), "--out", replaces=replaces)
    return {
        "out": str(out),
        "filled_patches": int(mask.sum()),
        "patches": len(mask),
        "image_size": data.image_size,
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
    order: str = "random",
    choice_temperature: float = 0.0,
    weights: str | None = None,
) -> dict:
    """Generate `n` images from a fully masked canvas (sampling.sample_images); write them as one PNG grid."""
    check_grid_count(n, "--n", "images")
    options = DecodeOptions(steps, temperature, order, choice_temperature)  # checks every value
    check_out_file(out, inputs=(path,))
    replaces = file_id(out)  # the file given, if any: the only one the grid may replace
    model, cfg, device, _ = open_model(path, device_name, seed, weights, loads_data=False)
    data = cfg.data
    images = sample_from_seed(
        model, n, data.image_size, data.patch_size, options, seed, device, progress=True
    )  # (n, S, S)
    grid = image_grid(images, math.ceil(math.sqrt(n)))
    write_atomically(out, lambda f: save_grid(grid, f, scale=3), "--out", replaces=replaces)
    return {"out": str(out), "n": n, "image_size": data.image_size, "steps": steps, "temperature": temperature}


def count_params(config: Path | None, checkpoint: Path | None, overrides: list[str]) -> list[ParamRow]:
    """One row per parameter tensor (name, shape, count, the seed's name) of the model a config, or a
    checkpoint's config, describes, `overrides` applied."""
    if (config is None) == (checkpoint is None):
        raise UserError("count-params needs exactly one of --config PATH or --checkpoint PATH")
    if checkpoint is None:
        cfg = load_config(config, overrides)
        check_model_fits(cfg)
        return param_rows(build_model(cfg))
    checkpoint = resolve_model_path(checkpoint)  # a shipped model's name: its folder
    check_model_fits(exports.model_config(checkpoint, []))
    model, _, _ = load_model(checkpoint, "cpu", need_head=False)  # the weights must be the model its config describes
    if not overrides:
        return param_rows(model)
    cfg = exports.model_config(checkpoint, overrides)
    check_model_fits(cfg)
    model = build_model(cfg)
    if exports.is_export_dir(checkpoint):
        if exports.read_export_config(Path(checkpoint))["encoder_only"]:
            exports.drop_prediction_head(model)
    return param_rows(model)


def data_inputs(cfg: Config) -> dict[str, tuple[Path, ...]]:
    """What a config's data source reads, as `check_out_file`'s `inputs` (a file: npz) and
    `input_folders` (a folder whose files are the dataset: folder, idx, torchvision)."""
    data = cfg.data
    if data.source == "shapes":
        return {"inputs": (), "input_folders": ()}
    if data.source == "npz" or Path(data.path).is_file():
        return {"inputs": (Path(data.path),), "input_folders": ()}
    return {"inputs": (), "input_folders": (Path(data.path),)}


def preview(
    config: Path | list[Path] | None,
    overrides: list[str],
    out: Path,
    count: int,
    seed: int,
    force_preprocessing: bool = False,
) -> str:
    """Write the preview grid of the configured data to `out`; return the statistics as text. A pack
    is previewed with the binarization its header records (data/binarization.py `follow_pack`)."""
    from vitmask.data.preview import format_stats, write_preview

    cfg, said = follow_pack(resolve_config(config, overrides), Asked.of(config, overrides, force_preprocessing))
    if count < 1:
        raise UserError(f"--count must be at least 1 (images in the PNG grid), got {count}")
    if count > MAX_GRID_IMAGES:
        warn(
            f"--count {count} is more than one PNG grid holds ({MAX_GRID_IMAGES} images; beyond, the grid alone "
            f"takes gigabytes); showing {MAX_GRID_IMAGES}"
        )
        count = MAX_GRID_IMAGES
    check_seed(seed, "--seed")
    inputs = data_inputs(cfg)
    check_out_file(
        out,
        inputs=(*inputs["inputs"], *(config if isinstance(config, list) else [config])),
        input_folders=inputs["input_folders"],
    )
    replaces = file_id(out)  # the file given, if any: the only one the preview may replace
    check_fits(cfg, torch.device("cpu"), training=False, what="loading the data of", params=0)  # no model built
    stats = write_preview(load_splits(cfg), cfg, out, count, seed, replaces)
    tell(said)
    return format_stats(stats, cfg)


def probe_checkpoint(
    path: Path,
    split: str,
    layer: int | list[int] | None,
    k: int,
    seed: int,
    device_name: str,
    pool: str = "grid",
    grid: int | None = None,
    weights: str | None = None,
    per_class: int = 0,
) -> dict:
    """The probe report of a checkpoint (probe.py): linear and k-NN accuracy on `split` of its
    features (`layer`, `pool`, `grid`: see `run_probes`), of random weights and of raw pixels, and
    the majority class. With `per_class` K, on at most K images of each class of each split
    (data/per_class.py): how a pack of any size is probed."""
    if split not in ("val", "test"):
        raise UserError(f"unknown split '{split}' for probe; use val or test (the probes are fitted on train)")
    if per_class < 0:
        raise UserError(f"--per-class must be at least 0 (0: every image), got {per_class}")
    model, cfg, device, _ = open_model(path, device_name, seed, weights, need_head=False)
    data = load_data(cfg, device, load_labelled_splits)
    require_labels(data, cfg)
    data = unpacked_splits(take_per_class(data, per_class, cfg), "pass --per-class K to probe K images of each class")
    report = run_probes(model, cfg, data, split, layer, k, seed, pool, grid, progress=True)
    return {"checkpoint": str(path), "per_class": per_class or None, **report}


def export(path: Path, out: Path, weights: str | None = None, encoder_only: bool = False, onnx: bool = False) -> dict:
    """Write a checkpoint's model (or an export dir's) as an export dir (store/export.py; a fine-tuned
    classifier's: store/classifier.py)."""
    if classifiers.is_classifier(path):
        return classifiers.export_classifier(path, out, weights, encoder_only, onnx)
    return exports.export(path, out, weights, encoder_only, onnx)


def pack(config: Path | None, overrides: list[str], out: Path, labels: bool = True) -> dict:
    """Pack the configured source into the directory `out` (data/pack.py; `labels` False: without
    labels); return its header."""
    from vitmask.data.pack import pack as pack_source

    cfg = resolve_config(config, overrides)
    try:
        return pack_source(cfg, out, labels=labels)
    except OSError as e:
        where = f" under data.path {cfg.data.path}" if cfg.data.source != "shapes" else ""
        raise UserError(f"cannot read the {cfg.data.source} data{where} ({reason(e)}); check data.path") from None
