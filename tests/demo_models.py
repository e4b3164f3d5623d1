"""Tiny stand-in models for the demo's tests: a masked-patch model trained for a few steps on 16x16
shapes (conftest.train_tiny) and exported as `vitmask export` does, and a classifier fine-tuned from it
on the shapes' labels as `vitmask finetune` does (a few steps, no baselines), exported too."""

from pathlib import Path

from tests.conftest import TINY, train_tiny, write_config

SIZE = TINY["data"]["image_size"]  # 16: the tiny models' images are 16x16, 2x2 patches: 64 of them
SHAPES = ["rectangle", "ellipse", "line", "triangle"]  # the classifier's classes


def tiny_models(root: Path) -> tuple[Path, Path, Path]:
    """(the masked-patch model's last.pt, its export dir, the classifier's export dir), made under `root`."""
    from vitmask.cli import verbs
    from vitmask.cli.finetune import finetune

    (root / "masked").mkdir(parents=True, exist_ok=True)
    ckpt = train_tiny(root / "masked", {"train": {"ema_decay": 0.9}})
    export = root / "masked-export"
    verbs.export(ckpt, export)
    train = {**TINY["train"], "max_steps": 6, "eval_every": 6, "checkpoint_every": 6}
    config = write_config(root / "finetune.yaml", {"train": train, "name": "tiny"})
    finetune(ckpt, config, [], root / "classifier", None, "cpu", baselines=False)
    classifier = root / "classifier-export"
    verbs.export(root / "classifier" / "last.pt", classifier)
    return ckpt, export, classifier
