"""How images were made binary: the record a pack or a model keeps, which later steps follow, and
the checks of the foreground share that catch images made binary the wrong way round.

The record is four data keys: data.image_size (the side), data.fit, data.threshold and data.invert.
A pack's header holds the values it was packed with (pack.py); a model's config holds the values
it was trained with, and its export's config.json `data` entry the same.

Which record a run follows, when it starts (a resumed run keeps its checkpoint's config):

- data.source packed (`vitmask train`, `finetune`, `preview`): the pack's header (`follow_pack`);
- otherwise `vitmask finetune` and `vitmask train --init` on the very data the pretrained model
  was trained on (the same source and path; the same dataset or archive key where those apply):
  the pretrained model's config (`follow_pretrained`). On other data there is no record: the
  config says how that data is made binary.

Key by key (`follow`): a value the record agrees with passes; a value of the config file (or its
default) that the record contradicts gives way to the record's, and one line on stderr says what was
taken from where (`vitmask: note: data.fit=resize, data.invert=true from the pack's header (PATH),
over configs/finetune-mnist.yaml`, printed once the run starts, so that a refusal stays one line); a
value set on the command line (`--set`) that the record contradicts is refused in one line naming
both values, unless the run passes `--force-preprocessing` (`force_preprocessing=True` in Python):
then the command line's value is kept, and recorded, with one warning line. data.image_size is never
forced: a pack's images have its side, and weights fit the size they were trained on. The model
records the values it ends with, and `vitmask predict`, `vitmask inpaint` and the Python API's
processors apply them to raw image files.

Foreground share: the share of 1-pixels of binary images. Ink is foreground, so a share over
INVERTED_SHARE (0.5) means images that look inverted, dark ink on a light background made binary
without data.invert; `vitmask preview`, `pack` and `train` (and `finetune`) say so in one warning
line naming the fix (`warn_if_inverted`). A fine-tuned classifier records the share of its
training images (`foreground_share`, over at most SHARE_SAMPLE of them), and `vitmask predict`
and the Python API warn once per call when the images given are far from it (`far_from`): more
than FAR_ABSOLUTE (0.25) apart, or, for at least RATIO_MIN_IMAGES (16) images, more than
FAR_RATIO (3) times as much or under a third of it. Measured at threshold 0.5: MNIST's test
images are 0.134 foreground on the whole (one image 0.024 to 0.329, 16 consecutive ones 0.076 to
0.230), so no MNIST image sets it off against a model trained on MNIST; dark-on-white drawings
made binary without data.invert are 0.85 to 0.95 foreground.
"""

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vitmask.config import Config, DataConfig, override_keys
from vitmask.data import packed
from vitmask.errors import UserError, note, warn

RECORD_KEYS = ("image_size", "fit", "threshold", "invert")  # data keys, in the order lines name them
NEVER_FORCED = ("image_size",)
FORCE_FLAG = "--force-preprocessing"
INVERTED_SHARE = 0.5  # a foreground share above this looks inverted
FAR_ABSOLUTE = 0.25  # images this far from the trained share (absolute) are far
FAR_RATIO = 3.0  # ... or, RATIO_MIN_IMAGES images or more, this many times more or less
RATIO_MIN_IMAGES = 16
SHARE_SAMPLE = 4096  # images the share of a split is measured on, spread evenly over it
SHARE_CHUNK = 1 << 12  # images summed at a time


@dataclasses.dataclass(frozen=True)
class Asked:
    """What a run was asked for: the keys the command line set (`--set`), what else its config
    came from (the config file's path, named in the note), and whether it forces its values."""

    set_keys: dict[str, Any]
    over: str
    force: bool = False

    @classmethod
    def of(cls, config, overrides: Sequence[str], force: bool = False) -> "Asked":
        """`config`: the config file's path (or a list of them, each merged over the one before), or None."""
        files = [config] if isinstance(config, (str, Path)) else list(config or [])
        over = ", ".join(map(str, files)) if files else "the config"
        return cls(override_keys(overrides), over, bool(force))


def value_text(value: Any) -> str:
    """A config value as `--set` takes it: true / false, numbers and names as they are."""
    return str(value).lower() if isinstance(value, bool) else str(value)


Said = tuple[tuple[str, str], ...]  # lines to print once the run is accepted: ("note" | "warning", text)


def tell(said: Said) -> None:
    """Print the lines `follow` left to say (errors.note, errors.warn), once nothing more can refuse the run."""
    for kind, text in said:
        (note if kind == "note" else warn)(text)


def follow(cfg: Config, record: dict[str, Any], where: str, asked: Asked) -> tuple[Config, Said]:
    """`cfg` with the record's values of RECORD_KEYS where the config file's contradict them, and the
    lines to say so (one note; one warning for values forced); a contradicting `--set` refused. The
    lines are printed by `tell` when the run starts, so that a refusal after this stays one line."""
    taken: dict[str, Any] = {}
    forced: list[str] = []
    for key in RECORD_KEYS:
        if key not in record:
            continue
        want, have = record[key], getattr(cfg.data, key)
        if want == have:
            continue
        name = f"data.{key}"
        if name not in asked.set_keys:
            taken[key] = want
            continue
        if key in NEVER_FORCED:
            raise UserError(
                f"--set {name}={value_text(have)} contradicts {where}, which records {name}={value_text(want)}: "
                f"the images are {want}x{want}; leave --set {name} out"
            )
        if not asked.force:
            raise UserError(
                f"--set {name}={value_text(have)} contradicts {where}, which records {name}={value_text(want)} (how "
                f"its images were made binary); leave --set {name} out, or pass {FORCE_FLAG} to record "
                f"{name}={value_text(have)} anyway"
            )
        forced.append(key)
    said: list[tuple[str, str]] = []
    if taken:
        values = ", ".join(f"data.{k}={value_text(v)}" for k, v in taken.items())
        said.append(("note", f"{values} from {where}, over {asked.over}"))
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **taken))
    if forced:
        mine = ", ".join(f"data.{k}={value_text(getattr(cfg.data, k))}" for k in forced)
        theirs = ", ".join(f"data.{k}={value_text(record[k])}" for k in forced)
        said.append(
            (
                "warning",
                f"{mine} from --set, over {where} ({theirs}), as {FORCE_FLAG} asks: the model records {mine}, and "
                "predict and inpaint apply it to raw images",
            )
        )
    return cfg, tuple(said)


def follow_pack(cfg: Config, asked: Asked) -> tuple[Config, Said]:
    """`cfg` following its pack's header (`follow`), where data.source is packed."""
    if cfg.data.source != "packed":
        return cfg, ()
    return follow(cfg, packed.binarization(cfg.data.path), f"the pack's header ({cfg.data.path})", asked)


def same_data(a: DataConfig, b: DataConfig) -> bool:
    """Whether two data sections read the same raw images: the same source (not shapes, which are
    drawn binary, nor packed, which `follow_pack` follows) at the same path, and the same dataset
    (torchvision), archive key (npz) or images per class (npy)."""
    if a.source != b.source or a.source in ("shapes", "packed"):
        return False
    if a.source == "torchvision" and (a.name, a.emnist_split) != (b.name, b.emnist_split):
        return False
    if a.source == "npz" and a.npz_key != b.npz_key:
        return False
    if a.source == "npy" and a.max_per_class != b.max_per_class:
        return False
    return os.path.realpath(a.path) == os.path.realpath(b.path)


def follow_pretrained(cfg: Config, pretrained: Config, where: str, asked: Asked) -> tuple[Config, Said]:
    """`cfg` following the config of the model it starts from (`follow`), where both read the same
    raw images (`same_data`); `where` names the model (`the pretrained model (PATH)`)."""
    if not same_data(cfg.data, pretrained.data):
        return cfg, ()
    return follow(cfg, {k: getattr(pretrained.data, k) for k in RECORD_KEYS}, where, asked)


# ---- the foreground share -----------------------------------------------------------------------------
def foreground_share(images, limit: int = SHARE_SAMPLE) -> float:
    """The share of 1-pixels of `images` (n, H, W) 0/1 (a tensor or a packed split), over at most
    `limit` of them spread evenly (packed.spread); NaN for no images."""
    images = packed.spread(images, limit)
    if len(images) == 0:
        return float("nan")
    ones = sum(int(images[s : s + SHARE_CHUNK].sum(dtype=torch.int64)) for s in range(0, len(images), SHARE_CHUNK))
    n, h, w = images.shape
    return ones / (n * h * w)


def looks_inverted(share: float) -> bool:
    return share > INVERTED_SHARE  # NaN: no


def warn_if_inverted(share: float, data: DataConfig, what: str, repack: bool = False) -> None:
    """One warning line when `what` (the images, plural) look inverted: more than half foreground.
    `repack`: they come from a pack, made binary when it was packed."""
    if not looks_inverted(share):
        return
    flip = f"data.invert={value_text(not data.invert)}"
    fix = f"pack the source again with --set {flip}" if repack else f"set {flip}"
    warn(
        f"{what} are {share:.0%} foreground (1-pixels) after binarisation (data.threshold {data.threshold}, "
        f"data.invert {value_text(data.invert)}), where ink is foreground: they look inverted (dark ink on a "
        f"light background); {fix}"
    )


def far_from(share: float, trained: float, images: int) -> bool:
    """Whether images of foreground share `share` (`images` of them) are far from a model's
    training images (`trained`): more than FAR_ABSOLUTE apart, or, for RATIO_MIN_IMAGES images or
    more, over FAR_RATIO times as much or under 1 / FAR_RATIO of it."""
    if abs(share - trained) > FAR_ABSOLUTE:
        return True
    if images >= RATIO_MIN_IMAGES and trained > 0:
        return share > FAR_RATIO * trained or share < trained / FAR_RATIO
    return False


def pixels_share(pixels: torch.Tensor) -> float:
    """The share of 1-pixels of binary images (B, S, S); NaN for none."""
    return float(pixels.sum(dtype=torch.int64)) / pixels.numel() if pixels.numel() else float("nan")


def warn_if_far(share: float, n: int, trained: float | None, processor, flags: str) -> None:
    """One warning line when `n` binary images of foreground share `share` are far from the training
    images' `trained` (`far_from`; None: the model records none). `processor` is the preprocessing
    they went through (an ImageProcessor), `flags` how to choose another."""
    if trained is None or n == 0 or not far_from(share, trained, n):
        return
    them, they = ("them", "they are") if n != 1 else ("it", "it is")
    warn(
        f"the {n} image{'s are' if n != 1 else ' is'} {share:.0%} foreground (1-pixels) after the model's "
        f"preprocessing (fit {processor.fit}, threshold {processor.threshold}, invert "
        f"{value_text(processor.invert)}), where its training images were {trained:.0%}: its predictions on {them} "
        f"are likely wrong; check {they} drawn as its training data (ink and background the same way round), "
        f"or choose the preprocessing with {flags}"
    )
