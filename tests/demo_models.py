"""What the demo's tests share: tiny stand-in models (a masked-patch model trained for a few steps on
16x16 shapes by conftest.train_tiny and exported as `vitmask export` does, and a classifier fine-tuned
from it on the shapes' labels as `vitmask finetune` does, a few steps, no baselines, exported too), and
`vitmask demo` started in a process of its own."""

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from tests.conftest import ROOT, TINY, train_tiny, write_config

STARTS_WITHIN = 120  # seconds to wait for the address line (a busy 2-core machine imports torch slowly)

SIZE = TINY["data"]["image_size"]  # 16: the tiny models' images are 16x16, 2x2 patches: 64 of them
SHAPES = ["rectangle", "ellipse", "line", "triangle"]  # the classifier's classes


def tiny_models(root: Path) -> tuple[Path, Path, Path]:
    """(the masked-patch model's last.pt, its export dir, the classifier's export dir), made under `root`."""
    from vitmask.cli import verbs
    from vitmask.train.run import finetune

    (root / "masked").mkdir(parents=True, exist_ok=True)
    ckpt = train_tiny(root / "masked", {"train": {"ema_decay": 0.9}})
    export = root / "masked-export"
    verbs.export(ckpt, export)
    train = {**TINY["train"], "max_steps": 6, "eval_every": 6, "checkpoint_every": 6}
    config = write_config(root / "finetune.yaml", {"train": train, "name": "tiny"})
    finetune(ckpt, config, [], root / "classifier", device="cpu", baselines=False)
    classifier = root / "classifier-export"
    verbs.export(root / "classifier" / "last.pt", classifier)
    return ckpt, export, classifier


def start_demo(*args, cwd: Path = ROOT) -> tuple[subprocess.Popen, str, str]:
    """`vitmask demo ARGS` in its own process, in `cwd`: (the process, its first stdout line, the address in it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitmask", "demo", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )
    watchdog = threading.Timer(STARTS_WITHIN, proc.kill)
    watchdog.start()
    try:
        line = proc.stdout.readline()
    finally:
        watchdog.cancel()
    found = re.search(r"http://\S+/", line)
    if found is None:
        proc.kill()
        raise AssertionError(f"no address printed: {line!r} {proc.communicate()[1]!r}")
    return proc, line, found.group(0).removesuffix(";")
