"""Build the models shipped inside vitmask (src/vitmask/pretrained/), every one, by one command.

    python scripts/build_pretrained.py --data DIR            # the full recipes: tens of minutes on 2 CPU cores
    python scripts/build_pretrained.py --data DIR --quick    # a few steps each: stand-ins with the real models' shapes
    make pretrained PRETRAINED_DATA=DIR                      # the full build

DIR holds MNIST's test-set idx files (t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte, plain or
gzipped; torchvision's download leaves them in data/mnist/MNIST/raw). In a work folder (--work, by
default a temporary one) holding a copy of configs/ and the data where the README's tour has it
(data/mnist/MNIST/raw/t10k-images-idx3-ubyte, so each model's config.json records that path), it runs
these commands, in this process through the functions the CLI calls (cli/verbs.py, train/run.py):

    vitmask train --config configs/mnist.yaml --set data.source=idx --set data.path=MNIST --run-dir runs/mnist
    vitmask export --checkpoint runs/mnist/last.pt --weights ema --out mnist
    vitmask finetune --checkpoint mnist --config configs/finetune-mnist.yaml --set data.source=idx \
        --set data.path=MNIST --run-dir runs/mnist-classifier --no-baselines
    vitmask export --checkpoint runs/mnist-classifier/last.pt --out mnist-classifier
    vitmask train --config configs/default.yaml --run-dir runs/shapes
    vitmask export --checkpoint runs/shapes/last.pt --out shapes

(MNIST: the path above; `--checkpoint mnist` reads the folder just exported, which wins over the
shipped model of that name.) Then it scores each export on its own test split (`vitmask eval
--checkpoint NAME --split test`: r=0.5, the centre box, the NLL bound and the exact NLLs on the first
--exact-images test images for mnist, r=0.5 for shapes, the accuracy of the classifier), writes
each folder's examples.npz (masked-patch models: the first EXAMPLES images of the test split),
shipped.json (the build's record: commands, host, time, data and licence, figures) and README.md
(that record, then the card vitmask export wrote), and last replaces the folders of --out one by one.

--quick adds QUICK's keys to each run (fewer steps, no compilation; the configs' models unchanged),
and the cards say so. --set KEY=VALUE (repeatable) goes to every training and fine-tuning run after
them (a test builds everything tiny with it).
"""

import argparse
import datetime
import gzip
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the checkout's vitmask, also when it is not installed

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vitmask  # noqa: E402
from vitmask.cli import verbs  # noqa: E402
from vitmask.config import Config  # noqa: E402
from vitmask.data.batches import load_labelled_splits  # noqa: E402
from vitmask.data.class_names import class_names  # noqa: E402
from vitmask.data.sources import split_plan  # noqa: E402
from vitmask.pretrained import CLASSIFIER, EXAMPLES_FILE, METADATA_FILE, MNIST_PATH, SHIPPED  # noqa: E402
from vitmask.store.export import CARD_FILE, load_model  # noqa: E402
from vitmask.train import run  # noqa: E402

MNIST_FILES = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MNIST_DATA = ("--set", "data.source=idx", "--set", f"data.path={MNIST_PATH}")
EXAMPLES = 48  # images of each masked-patch model's test split in examples.npz
EVAL_SEED = 0
QUICK = {  # a short build: the recipes' models and data, a few steps, no compilation
    "mnist": ["train.max_steps=200", "train.eval_every=100", "train.checkpoint_every=100", "train.log_every=50",
              "train.warmup_steps=20", "train.eval_images=1000", "train.compile=false"],
    "mnist-classifier": ["train.max_steps=100", "train.eval_every=50", "train.checkpoint_every=50",
                         "train.log_every=25", "train.warmup_steps=10", "finetune.freeze_steps=10",
                         "train.compile=false"],
    "shapes": ["train.max_steps=80", "train.eval_every=40", "train.checkpoint_every=40", "train.log_every=20",
               "train.warmup_steps=20", "train.compile=false"],
}  # fmt: skip
MNIST_LICENCE = (
    "MNIST, by Yann LeCun (Courant Institute, NYU), Corinna Cortes (Google Labs, New York) and Christopher J.C. "
    "Burges (Microsoft Research, Redmond), is copyright Yann LeCun and Corinna Cortes, a derivative work of NIST's "
    "datasets, made available under the terms of the Creative Commons Attribution-Share Alike 3.0 licence "
    "(CC BY-SA 3.0)"
)
SHAPES_LICENCE = (
    "drawn by vitmask's own generator (src/vitmask/data/shapes.py): no outside data, no third-party licence"
)
# the card's Licence section: the weights' licence, and the data's in a few words (its full notice: the Data section)
WEIGHTS_LICENCE = "the MIT licence, as vitmask's code (vitmask's `LICENSE` file)"
MNIST_DATA_LICENCE = "MNIST, under the Creative Commons Attribution-Share Alike 3.0 licence (CC BY-SA 3.0)"
SHAPES_DATA_LICENCE = (
    "synthetic shapes vitmask draws itself (`src/vitmask/data/shapes.py`), under no third-party licence"
)


# ---- the data and the host ----------------------------------------------------------------------------
def place_mnist(data: Path, work: Path) -> None:
    """MNIST's test-set idx files from `data` (plain or gzipped) to work/MNIST_PATH's folder, plain."""
    raw = work / Path(MNIST_PATH).parent
    raw.mkdir(parents=True, exist_ok=True)
    for name in MNIST_FILES:
        plain, packed = data / name, data / f"{name}.gz"
        if plain.is_file():
            shutil.copyfile(plain, raw / name)
        elif packed.is_file():
            with gzip.open(packed, "rb") as src, open(raw / name, "wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            raise SystemExit(
                f"--data {data} holds no {name} (nor {name}.gz): pass the folder of MNIST's test-set files"
            )


def cpu_name() -> str:
    """lscpu's model name (/proc/cpuinfo's where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, timeout=30).stdout
        lines = out.splitlines()
    except (OSError, subprocess.SubprocessError):
        try:
            lines = Path("/proc/cpuinfo").read_text().splitlines()
        except OSError:
            lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip().lower() == "model name":
            return value.strip()
    return platform.processor() or "unknown CPU"


def host() -> dict:
    return {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "vitmask": vitmask.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def command_line(args: tuple[str, ...]) -> str:
    return " ".join(shlex.quote(a) for a in args)


# ---- the steps ------------------------------------------------------------------------------------------
def train(name: str, config: str, data: tuple[str, ...], extra: list[str], device: str) -> tuple[list[str], float]:
    """`vitmask train` of `config` into runs/NAME; returns its command and its wall time in seconds."""
    sets = [*data, *(x for key in extra for x in ("--set", key))]
    args = ("vitmask", "train", "--config", config, *sets, "--run-dir", f"runs/{name}")
    print(f"$ {command_line(args)}", flush=True)
    overrides = [sets[i + 1] for i in range(0, len(sets), 2)]
    start = time.perf_counter()
    verbs.train(Path(config), overrides, Path(f"runs/{name}"), None, device)
    return [command_line(args)], time.perf_counter() - start


def finetune(name: str, config: str, pretrained: str, extra: list[str], device: str) -> tuple[list[str], float]:
    sets = [*MNIST_DATA, *(x for key in extra for x in ("--set", key))]
    args = ("vitmask", "finetune", "--checkpoint", pretrained, "--config", config, *sets,
            "--run-dir", f"runs/{name}", "--no-baselines")  # fmt: skip
    print(f"$ {command_line(args)}", flush=True)
    overrides = [sets[i + 1] for i in range(0, len(sets), 2)]
    start = time.perf_counter()
    run.finetune(pretrained, config, overrides, f"runs/{name}", device=device, baselines=False)
    return [command_line(args)], time.perf_counter() - start


def export(name: str, weights: str | None) -> str:
    args = ("vitmask", "export", "--checkpoint", f"runs/{name}/last.pt", *(("--weights", weights) if weights else ()),
            "--out", name)  # fmt: skip
    print(f"$ {command_line(args)}", flush=True)
    verbs.export(Path(f"runs/{name}/last.pt"), Path(name), weights)
    return command_line(args)


def score(name: str, device: str, exact_images: int = 100) -> tuple[str, dict]:
    """`vitmask eval` of the export NAME on its test split -> (the command, shipped.json's metrics). For
    mnist, also the exact NLLs (raster, and the mixture of 8 orders) on its first `exact_images` images."""
    folder = Path(name)
    if SHIPPED[name].task == CLASSIFIER:
        args = ("vitmask", "eval", "--checkpoint", name, "--split", "test")
        print(f"$ {command_line(args)}", flush=True)
        r = verbs.evaluate_checkpoint(folder, "test", [], device, EVAL_SEED)
        return command_line(args), {"split": "test", "images": r["images"], "accuracy": r["accuracy"]}
    full = name == "mnist"  # the centre box and the NLL bound and exact NLLs too
    args = ("vitmask", "eval", "--checkpoint", name, "--split", "test", "--mask-ratio", "0.5",
            *(("--centre-box", "--nll", "--nll-exact-images", str(exact_images)) if full else ()))  # fmt: skip
    print(f"$ {command_line(args)}", flush=True)
    r = verbs.evaluate_checkpoint(
        folder, "test", [0.5], device, EVAL_SEED, None, full, full, nll_exact_images=exact_images
    )
    half = r["results"][0]
    metrics = {"split": "test", "images": r["images"], "seed": EVAL_SEED}
    metrics.update({"acc_r0.5": half["acc"], "acc_nonempty_r0.5": half["acc_nonempty"]})
    if full:
        box = next(x for x in r["results"] if x["strategy"] == "centre")
        metrics["acc_nonempty_centre_box"] = box["acc_nonempty"]
        metrics["acc_centre_box"] = box["acc"]
        metrics["nll_bound_nats"] = r["nll"]["nats"]
        metrics["nll_bound_bits_per_pixel"] = r["nll"]["bits_per_pixel"]
        metrics["nll_bound_se_images"] = r["nll"]["se_images"]
        exact = r["nll"]["exact"]
        metrics["nll_exact_images"] = exact["images"]
        metrics["nll_bound_same_images_nats"] = exact["bound_same_images"]
        metrics["nll_exact_raster_nats"] = exact["fixed"]["nats"]
        metrics["nll_exact_mixture_nats"] = exact["mixture"]["nats"]
    return command_line(args), metrics


def split_counts(cfg: Config) -> tuple[dict, object]:
    """The images of each split of a model's data (as it loads them), and the splits."""
    data = load_labelled_splits(cfg)
    return {k: len(v) for k, v in data.images.items()}, data


def write_examples(name: str, cfg: Config, data) -> dict:
    """examples.npz: the first EXAMPLES images of the test split, binary as the model sees them."""
    test = data.images["test"][:EXAMPLES]  # (K, S, S) uint8 0/1
    arrays = {"images": test.numpy().astype(np.uint8), "split_index": np.arange(len(test), dtype=np.int64)}
    record = {"file": EXAMPLES_FILE, "count": len(test), "split": "test", "split_index": [0, len(test) - 1]}
    if data.labels is not None:
        arrays["labels"] = data.labels["test"][: len(test)].numpy().astype(np.int64)
        values = sorted(set(data.labels["train"].tolist()) | set(data.labels["test"].tolist()))
        arrays["label_names"] = np.array(class_names(cfg.data, values), dtype=str)  # the name of each label value
    if cfg.data.source == "idx":  # the positions in MNIST's t10k file of the test split's first images
        plan = split_plan({"all": sum(len(v) for v in data.images.values())}, cfg.data, cfg.split_seed)
        arrays["source_index"] = plan["test"][1][: len(test)].numpy().astype(np.int64)
        record["source_index"] = arrays["source_index"].tolist()
    np.savez_compressed(Path(name) / EXAMPLES_FILE, **arrays)
    return record


# ---- the record and the card ----------------------------------------------------------------------------
def data_record(name: str, cfg: Config, counts: dict) -> dict:
    d = cfg.data
    if d.source == "shapes":
        summary = f"vitmask's built-in shapes, {counts['train']:,} train images"
        learned = (
            f"the {counts['train']:,} images of its train split: data.num_train={d.num_train} shapes drawn from seed "
            f"{cfg.split_seed} after the {counts['test']:,} test and {counts['val']:,} val images, repeats dropped"
        )
        return {"summary": summary, "source": "shapes", "licence": SHAPES_LICENCE, "learned_from": learned, **counts}
    total = sum(counts.values())
    summary = f"MNIST test set (t10k), its {counts['train']:,}-image train split"
    learned = (
        f"the {counts['train']:,} train-split images of MNIST's {total:,} test-set images (t10k-images-idx3-ubyte), "
        f"split {counts['train']:,} / {counts['val']:,} / {counts['test']:,} (train / val / test) by data.split_seed "
        f"{cfg.split_seed}"
    )
    if SHIPPED[name].task == CLASSIFIER:
        learned += ", with their labels; its encoder is the shipped mnist model's, pretrained on the same images"
    return {
        "summary": summary,
        "source": d.source,
        "path": d.path,
        "licence": MNIST_LICENCE,
        "learned_from": learned,
        **counts,
    }


def figures_rows(metrics: dict) -> list[str]:
    labels = {
        "acc_r0.5": "scattered masks at r=0.5: accuracy",
        "acc_nonempty_r0.5": "scattered masks at r=0.5: non-empty accuracy",
        "acc_nonempty_centre_box": "centre box: non-empty accuracy (one-shot)",
        "nll_bound_nats": "NLL upper bound, nats per image",
        "nll_bound_bits_per_pixel": "NLL upper bound, bits per pixel",
        "nll_bound_same_images_nats": "NLL upper bound on the first {n} images, nats per image",
        "nll_exact_raster_nats": "exact NLL, raster order, on the first {n} images, nats per image",
        "nll_exact_mixture_nats": "exact NLL, mixture of 8 orders, on the first {n} images, nats per image",
        "accuracy": "test accuracy",
    }
    rows = ["| metric | value |", "|---|---:|"]
    for key, label in labels.items():
        if key in metrics:
            label = label.format(n=metrics.get("nll_exact_images"))
            value = f"{metrics[key]:.2f}" if key.endswith("_nats") else f"{metrics[key]:.4f}"
            rows.append(f"| {label} | {value} |")
    return rows


def card(name: str, record: dict, export_card: str) -> str:
    """README.md: what the model is, the licences of its weights and of its data, how it was built, the data
    and its licence notice, exactly which images it learned from, its figures on its own test split; then
    the card vitmask export wrote."""
    model, d, h = SHIPPED[name], record["data"], record["host"]
    loader = "load_classifier" if model.task == CLASSIFIER else "load_pretrained"
    verb = (
        f"vitmask predict --checkpoint {name} --input images/ --out predictions.csv"
        if model.task == CLASSIFIER
        else f"vitmask sample --checkpoint {name} --out samples.png"
    )
    lines = [f"# {name}: {model.what}", ""]
    if record["quick"]:
        lines += [
            f"**A quick build** (`--quick`: {record['steps']} training steps instead of the recipe's "
            f"{record['recipe_steps']}, no compilation): a stand-in with the recipe's model and data, far from its "
            "figures; the full build (`make pretrained`) replaces it.",
            "",
        ]
    lines += [
        f"Shipped inside vitmask as `{name}`: every verb that takes `--checkpoint` takes the name (`{verb}`), and "
        f'so does `vitmask.{loader}("{name}")`. A file or folder called `{name}` in the working directory wins '
        "over the name. `vitmask models` lists the shipped models.",
        "",
        "## Licence",
        "",
        f"The weights: {WEIGHTS_LICENCE}. The data it learned from: "
        f"{SHAPES_DATA_LICENCE if d['source'] == 'shapes' else MNIST_DATA_LICENCE} (see Data below).",
        "",
        "## How it was built",
        "",
        f"By `{record['command']}`, which ran in a work folder holding `configs/`"
        + (f" and MNIST's test set at `{d['path']}`:" if d["source"] != "shapes" else ":"),
        "",
        "```bash",
        *record["commands"],
        record["eval_command"],
        "```",
        "",
        f"Trained from `{model.recipe}` in {record['training_seconds'] / 60:.1f} minutes ({record['steps']} steps) on "
        f"{h['cpu']}, {h['threads']} thread{'' if h['threads'] == 1 else 's'}, torch {h['torch']}, vitmask "
        f"{h['vitmask']}, on {h['date']}.",
        "",
        "## Data",
        "",
        f"{d['licence'][0].upper()}{d['licence'][1:]}.",
        "",
        f"It learned from exactly these images: {d['learned_from']}.",
        "",
    ]
    if d["source"] != "shapes":
        lines += [
            f"**It learned from {d['train']:,} of the {d['train'] + d['val'] + d['test']:,} images of MNIST's test "
            f"set: do not score it on MNIST's test set. Its figures below are on its own test split, {d['test']:,} "
            f"images of that set it never trained on (`vitmask eval --checkpoint {name} --split test`).**",
            "",
        ]
    m = record["metrics"]
    lines += [
        "## Figures on its own test split",
        "",
        f"On its {m['images']:,} test images (`{record['eval_command']}`; `{METADATA_FILE}` holds the same numbers):",
        "",
        *figures_rows(m),
        "",
    ]
    if "examples" in record:
        e = record["examples"]
        which = f"the first {e['count']} images of its test split (positions 0 to {e['count'] - 1})"
        if "source_index" in e:
            which += f", images {', '.join(map(str, e['source_index']))} of `t10k-images-idx3-ubyte` (counted from 0)"
        lines += [
            "## Example images",
            "",
            f"`{EXAMPLES_FILE}` holds {which}, binary as the model sees them: `images` ({e['count']}, S, S) uint8 0/1, "
            "`labels` and `label_names`, `split_index`"
            + (", `source_index` (in the idx file)." if "source_index" in e else "."),
            "",
        ]
    body = export_card.split("\n", 1)[1].lstrip("\n") if export_card.startswith("# ") else export_card
    lines += ["## The export's card", "", body.replace("\n## ", "\n### ")]
    return "\n".join(lines).rstrip("\n") + "\n"


def build(a: argparse.Namespace, work: Path) -> list[str]:
    """Every model into work/NAME (export, examples, record, card); returns their names."""
    for name in ("configs",):
        shutil.copytree(ROOT / name, work / name)
    place_mnist(a.data, work)
    os.chdir(work)
    user = list(a.set or [])
    quick = {k: QUICK[k] if a.quick else [] for k in QUICK}
    records = {}

    commands, seconds = train("mnist", "configs/mnist.yaml", MNIST_DATA, quick["mnist"] + user, a.device)
    commands.append(export("mnist", "ema"))
    records["mnist"] = {"commands": commands, "training_seconds": seconds}

    commands, seconds = finetune(
        "mnist-classifier", "configs/finetune-mnist.yaml", "mnist", quick["mnist-classifier"] + user, a.device
    )
    commands.append(export("mnist-classifier", None))
    records["mnist-classifier"] = {"commands": commands, "training_seconds": seconds}

    commands, seconds = train("shapes", "configs/default.yaml", (), quick["shapes"] + user, a.device)
    commands.append(export("shapes", None))
    records["shapes"] = {"commands": commands, "training_seconds": seconds}

    recipe_steps = {name: _recipe_steps(SHIPPED[name].recipe) for name in records}
    argv = ["python", "scripts/build_pretrained.py", "--data", "DIR"]
    argv += ["--quick"] if a.quick else []
    argv += ["--exact-images", str(a.exact_images)] if a.exact_images != 100 else []
    argv += [x for key in user for x in ("--set", key)]
    machine = host()
    for name, record in records.items():
        eval_command, metrics = score(name, a.device, a.exact_images)
        cfg = _config_of(name)
        counts, data = split_counts(cfg)
        record.update(
            {
                "name": name,
                "task": SHIPPED[name].task,
                "recipe": SHIPPED[name].recipe,
                "quick": bool(a.quick),
                "command": command_line(tuple(argv)),
                "eval_command": eval_command,
                "steps": cfg.train.max_steps,
                "recipe_steps": recipe_steps[name],
                "data": data_record(name, cfg, counts),
                "host": machine,
                "metrics": metrics,
            }
        )
        if SHIPPED[name].task != CLASSIFIER:
            record["examples"] = write_examples(name, cfg, data)
        (Path(name) / METADATA_FILE).write_text(json.dumps(record, indent=2) + "\n")
        export_card = (Path(name) / CARD_FILE).read_text()
        (Path(name) / CARD_FILE).write_text(card(name, record, export_card))
    return list(records)


def _recipe_steps(recipe: str) -> int:
    from vitmask.config import load_config

    return load_config(Path(recipe)).train.max_steps


def _config_of(name: str) -> Config:
    if SHIPPED[name].task == CLASSIFIER:
        from vitmask.store.classifier import load_classifier_model

        return load_classifier_model(Path(name)).config
    return load_model(Path(name)).config


def install(names: list[str], work: Path, out: Path) -> None:
    """Replace each folder out/NAME by work/NAME (through a copy beside it, renamed into place)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        tmp, target = out / f".{name}.new", out / name
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(work / name, tmp)
        for file in tmp.iterdir():
            file.chmod(0o644)  # safetensors writes its file for its owner only; installed files are for everyone
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
        print(f"wrote {target} ({size / 1e6:.2f} MB)", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="a folder with MNIST's t10k-* idx files (plain or .gz)")
    ap.add_argument("--out", type=Path, default=ROOT / "src" / "vitmask" / "pretrained", help="where the folders go")
    ap.add_argument("--work", type=Path, help="the work folder (new or empty; default: a temporary one, removed)")
    ap.add_argument("--quick", action="store_true", help="a few steps each, no compilation: stand-ins")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="a config key for every run (repeatable)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--exact-images", type=int, default=100, help="mnist: the test images of its exact NLLs")
    a = ap.parse_args(argv)
    a.data, a.out = a.data.resolve(), a.out.resolve()
    if a.work is not None:
        a.work = a.work.resolve()
        if a.work.exists() and any(a.work.iterdir()):
            raise SystemExit(f"--work {a.work} holds files; pass a new or empty folder")
        a.work.mkdir(parents=True, exist_ok=True)
    here = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="vitmask-pretrained-") as tmp:
        work = a.work or Path(tmp)
        try:
            names = build(a, work)
        finally:
            os.chdir(here)
        install(names, work, a.out)


if __name__ == "__main__":
    main()
