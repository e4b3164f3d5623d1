"""Opening a masked-patch model by name or path, as every verb that reads one does: `open_model`.

`vitmask eval`, `probe`, `reconstruct`, `inpaint` and `sample` (cli/verbs.py) open their
`--checkpoint` with it, and vitmask demo's server (demo/models.py) opens its model the same way, so
a name or path means the same to each. It sits here, below both the command line and the demo.
"""

from pathlib import Path
from typing import NamedTuple

import torch

from vitmask.config import Config, check_seed
from vitmask.model.memory_estimate import check_fits
from vitmask.model.vit import MaskedPatchViT
from vitmask.pretrained import check_data
from vitmask.runtime.process import resolve_device
from vitmask.store.export import load_model


class OpenedModel(NamedTuple):
    model: MaskedPatchViT  # in eval mode, on `device`
    config: Config
    device: torch.device
    foreground_share: float | None  # of its training images (ModelFiles.foreground_share); None: not recorded


def open_model(
    path: Path, device_name: str, seed: int, weights: str | None = None, loads_data: bool = True, need_head: bool = True
) -> OpenedModel:
    """What every verb that reads a model does first: check its `--seed`, resolve the device and load
    the model from a .pt checkpoint, an export dir or a shipped model's name (export.load_model: every
    check of the files; `weights` ema | raw, default the EMA's where there are any; `need_head`: refuse
    an encoder-only export). A verb that `loads_data` (eval, probe, reconstruct) also refuses a config
    whose data and evaluation cannot fit in memory, and a shipped model whose data is missing (one line
    saying where to get it). Returns an OpenedModel: the model in eval mode, its config, the device and
    the foreground share of its training images."""
    check_seed(seed, "--seed")
    device = resolve_device(device_name)
    model, cfg, record = load_model(path, device, weights, need_head=need_head)
    if loads_data:
        check_data(path, cfg.data.source, cfg.data.path)
        check_fits(cfg, device, training=False, params=sum(p.numel() for p in model.parameters()))
    return OpenedModel(model, cfg, device, record["foreground_share"])
