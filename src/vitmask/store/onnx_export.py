"""`vitmask export --onnx`: the model as `model.onnx`, through `torch.onnx.export(..., dynamo=True)`.

The graph is the forward pass in eval mode: no dropout, no random draw. A full model takes
`patches` (B, N, P) float 0/1 pixels and `mask` (B, N) bool (True = hidden) and gives `logits`
(B, N, C), the model's prediction for every patch; an encoder-only export takes `patches` and gives
`tokens` (B, N, D), the final normalised tokens. A fine-tuned classifier (model/classifier.py) takes
`images` (B, S, S) float 0/1 pixels, the binary images its processor gives (data/processor.py), cuts
them into patches in the graph and gives `logits` (B, L), one per class. B is dynamic. The onnx
packages are an optional extra (`make train` and `make test` install it; `pip install -e '.[onnx]'`
in a checkout): onnx, onnxscript (what torch's exporter needs) and onnxruntime (to run and check
the file).
"""

import importlib.util
import warnings
from pathlib import Path

import torch
from torch import nn

from vitmask.config import Config
from vitmask.data.patches import patchify
from vitmask.errors import UserError

ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")


def missing_onnx_packages() -> list[str]:
    found = []
    for name in ONNX_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            found.append(name)
    return found


def require_onnx() -> None:
    """One line naming the missing packages when the onnx extra is not installed."""
    missing = missing_onnx_packages()
    if missing:
        raise UserError(
            f"--onnx needs the onnx extra, and {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
            "installed; run: pip install -e '.[onnx]' in the checkout (make train and make test install it), "
            "or leave --onnx out"
        )


class PatchLogits(nn.Module):
    """patches (B, N, P), mask (B, N) -> logits (B, N, C) of every patch."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, patches: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(patches, mask)  # (B, N, C)


class EncoderTokens(nn.Module):
    """patches (B, N, P) -> the encoder's final normalised tokens (B, N, D)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.model.forward_encoder(patches)  # (B, N, D)


def example_inputs(cfg: Config, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Example patches (B, N, P) and a mask (B, N) hiding every other patch, for tracing."""
    d = cfg.data
    patches = (torch.arange(batch * d.num_patches * d.patch_dim).reshape(batch, d.num_patches, -1) % 3 == 0).float()
    mask = (torch.arange(d.num_patches) % 2 == 0).expand(batch, -1).clone()  # (B, N)
    return patches, mask


def export_onnx(model: nn.Module, cfg: Config, path: Path) -> Path:
    """Write `model` (eval mode, on the CPU) as an ONNX graph to `path`."""
    require_onnx()
    if getattr(model, "decoder", None) is not None:
        raise UserError(
            f"--onnx exports models without a decoder (model.decoder none) and encoder-only exports; this model "
            f"has model.decoder={cfg.model.decoder}: add --encoder-only, or leave --onnx out"
        )
    model = model.eval().to("cpu")
    patches, mask = example_inputs(cfg)
    batch = torch.export.Dim("batch", min=1)
    if model.head is None:
        wrapper, args, names, out = EncoderTokens(model), (patches,), ["patches"], ["tokens"]
        shapes = {"patches": {0: batch}}
    else:
        wrapper, args, names, out = PatchLogits(model), (patches, mask), ["patches", "mask"], ["logits"]
        shapes = {"patches": {0: batch}, "mask": {0: batch}}
    wrapper.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on axis names and its own deprecations
        program = torch.onnx.export(
            wrapper, args, dynamo=True, input_names=names, output_names=out, dynamic_shapes=shapes, verbose=False
        )
    program.save(str(path))
    return path


class ImageLogits(nn.Module):
    """images (B, S, S) float 0/1 pixels -> a classifier's logits (B, L): patchify, then the classifier."""

    def __init__(self, classifier: nn.Module, patch_size: int):
        super().__init__()
        self.classifier = classifier
        self.patch_size = patch_size

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(patchify(images, self.patch_size))  # (B, N, P) -> (B, L)


def example_images(cfg: Config, batch: int = 2) -> torch.Tensor:
    """Example binary images (B, S, S), for tracing."""
    s = cfg.data.image_size
    return (torch.arange(batch * s * s).reshape(batch, s, s) % 3 == 0).float()


def export_classifier_onnx(classifier: nn.Module, cfg: Config, path: Path) -> Path:
    """Write a fine-tuned classifier (eval mode, on the CPU) as an ONNX graph to `path`: images in, logits out."""
    require_onnx()
    wrapper = ImageLogits(classifier.eval().to("cpu"), cfg.data.patch_size).eval()
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on axis names and its own deprecations
        program = torch.onnx.export(
            wrapper,
            (example_images(cfg),),
            dynamo=True,
            input_names=["images"],
            output_names=["logits"],
            dynamic_shapes={"images": {0: batch}},
            verbose=False,
        )
    program.save(str(path))
    return path
