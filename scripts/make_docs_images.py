"""Every published MNIST figure, table and picture, from one checkpoint, by one command.

    python scripts/make_docs_images.py                       # trains configs/mnist.yaml first (about 9 min)
    python scripts/make_docs_images.py --checkpoint CKPT     # or scores a checkpoint already trained

Without --checkpoint it trains configs/mnist.yaml on the split of the published figures (MNIST's
test-set file as an idx source, --data; split 8,000/1,000/1,000) into --run-dir with `--resume auto`
(so a second call continues or reuses the run), then scores RUN_DIR/last.pt. With the checkpoint:

- eval: the EMA weights (the raw ones where the checkpoint has EMA) at each --ratios with random
  masks and the centre box, the NLL bound; block masks at each ratio;
- probe: the linear and k-NN probes, grid of token means (the default) and the mean of all tokens;
- finetune (unless --skip-finetune): configs/finetune-mnist.yaml on the same data, in a temporary
  run dir, with its from-scratch and linear-probe baselines;
- the pictures in --out-dir: reconstruct.png; inpaint_input.png and inpaint_filled.png (one test
  image as a user's file through `vitmask inpaint --box`, the centre box); inpaint.png (the centre
  box filled one-shot, iteratively and iteratively sampled on --n images); samples.png.

Then it writes, each between its markers (the rest of each page is kept):
- README.md (--readme) and results.md (in --out-dir): the headline table between HEADLINE_START
  and HEADLINE_END (results.md's also has the raw weights and the k-NN probe), with the machine,
  torch version and date;
- results.md below MARKER: the eval tables, the NLL bound, the probes, one-shot vs iterative vs
  sampled filling accuracy on --images images, and the pictures.
"""

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from vitmask.cli import verbs
from vitmask.data.batches import eval_batches, load_splits
from vitmask.data.masking import centre_box_mask
from vitmask.evaluate.likelihood import format_nll
from vitmask.evaluate.pictures import reconstruction_grid, save_binary_image, save_grid
from vitmask.evaluate.probe import format_report as format_probe
from vitmask.evaluate.scores import format_report
from vitmask.generate.inpaint import fill_accuracy
from vitmask.generate.sampling import DecodeOptions, decode_masked
from vitmask.runtime.process import resolve_device
from vitmask.store.checkpoint import load_checkpoint, load_model

MARKER = "<!-- make_docs_images.py writes everything below this line -->"
HEADLINE_START = "<!-- headline: written by scripts/make_docs_images.py -->"
HEADLINE_END = "<!-- end of headline -->"
TRAIN_CONFIG, FINETUNE_CONFIG = "configs/mnist.yaml", "configs/finetune-mnist.yaml"
PUBLISHED_DATA = "data/mnist/MNIST/raw/t10k-images-idx3-ubyte"  # MNIST's test set, split 8,000/1,000/1,000


def merge_generated(old: str | None, generated: str) -> str:
    """results.md: the text of `old` up to and including its MARKER line, then `generated`; without
    an old page or a marker in it, a new page: a title, the marker, then `generated`."""
    if old is not None and MARKER in old:
        return old[: old.index(MARKER) + len(MARKER)] + "\n\n" + generated
    return f"# Results\n\n{MARKER}\n\n" + generated


def replace_headline(page: str, block: str) -> str:
    """`page` with the text between its HEADLINE_START and HEADLINE_END lines replaced by `block`;
    a page without both markers is refused (nothing is written)."""
    if HEADLINE_START not in page or HEADLINE_END not in page:
        raise SystemExit(f"no {HEADLINE_START} ... {HEADLINE_END} block in the page; add the two markers")
    head, rest = page.split(HEADLINE_START, 1)
    return head + HEADLINE_START + "\n" + block.rstrip("\n") + "\n" + HEADLINE_END + rest.split(HEADLINE_END, 1)[1]


def centre_box(grid: int, patch_size: int) -> tuple[int, int, int, int]:
    """The pixels of masking.centre_box_mask (the central square of patches), as x0, y0, x1, y1."""
    rows = centre_box_mask(grid).view(grid, grid).any(1).nonzero().flatten()  # the box's rows (= its columns)
    lo, hi = int(rows[0]) * patch_size, (int(rows[-1]) + 1) * patch_size
    return lo, lo, hi, hi


def machine(device: torch.device) -> str:
    """The device in words, and torch's version: what a figure was measured on."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = next(
            (line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
            platform.processor() or "CPU",
        )
        name = f"{name}, {torch.get_num_threads()} threads"
    return f"{name}, torch {torch.__version__}"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def result_at(report: dict, strategy: str, ratio: float | None = None) -> dict:
    """The eval result of `strategy` (random, block, centre) at `ratio` in a report."""
    for r in report["results"]:
        if r["strategy"] == strategy and (ratio is None or abs(r["mask_ratio"] - ratio) < 1e-9):
            return r
    raise KeyError((strategy, ratio))


def headline_rows(ema: dict, raw: dict | None, probe: dict, finetune: dict | None, date: str, full: bool) -> str:
    """The headline table (markdown): NLL bound, scattered r=0.5, the centre box, the linear probe and
    the fine-tuning, each beside its floor on the same images and with its command. `full` (results.md)
    adds the k-NN probe and a row of the raw weights."""
    ck = "runs/mnist/last.pt"
    nll, half, box = ema["nll"], result_at(ema, "random", 0.5), result_at(ema, "centre")
    nb = lambda r: r["baselines"]["neighbour"]  # noqa: E731
    pr = probe["results"]
    knn = f" / {pr['model']['knn_acc']:.3f} k-NN" if full else ""
    pooled = f"{probe['grid']}x{probe['grid']} grid of token means" if probe["grid"] else "mean of the tokens"
    rows = [
        "| recipe | metric | value | floor on the same images | command | date |",
        "|---|---|---:|---:|---|---|",
        f"| configs/mnist.yaml | NLL bound, nats per image (bits per pixel) | **{nll['nats']:.2f}** "
        f"({nll['bits_per_pixel']:.4f}) | per-position Bernoulli {nll['baselines']['bernoulli']['nats']:.2f} | "
        f"`vitmask eval --checkpoint {ck} --split test --nll` | {date} |",
        f"| configs/mnist.yaml | scattered r=0.5: acc, non-empty acc | {half['acc']:.4f}, "
        f"**{half['acc_nonempty']:.4f}** | 8-neighbour table {nb(half)['acc']:.4f}, {nb(half)['acc_nonempty']:.4f} | "
        f"`vitmask eval ... --mask-ratio 0.5` | {date} |",
        f"| configs/mnist.yaml | centre 16x16 box: non-empty acc, one-shot | **{box['acc_nonempty']:.4f}** | "
        f"8-neighbour table {nb(box)['acc_nonempty']:.4f} | `vitmask eval ... --centre-box` | {date} |",
        f"| configs/mnist.yaml | linear probe{', k-NN' if full else ''}, {pooled} | "
        f"**{pr['model']['linear_acc']:.3f}**{knn} | raw pixels {pr['raw_pixels']['linear_acc']:.3f} | "
        f"`vitmask probe --checkpoint {ck} --split test` | {date} |",
    ]
    if full and raw is not None:
        rh, rb = result_at(raw, "random", 0.5), result_at(raw, "centre")
        rows.append(
            f"| configs/mnist.yaml, raw weights | NLL bound; r=0.5 non-empty; centre box non-empty | "
            f"{raw['nll']['nats']:.2f}; {rh['acc_nonempty']:.4f}; {rb['acc_nonempty']:.4f} | | "
            f"the same with `--weights raw` | {date} |"
        )
    if finetune is not None:
        rows.append(
            f"| configs/finetune-mnist.yaml | test accuracy, fine-tuned (from scratch at the same budget) | "
            f"**{finetune['finetuned']:.3f}** ({finetune['from_scratch']:.3f}) | linear probe "
            f"{finetune['linear_probe']:.3f} | `vitmask finetune --checkpoint {ck} --config {FINETUNE_CONFIG} ...` "
            f"| {date} |"
        )
    return "\n".join(rows)


def vitmask(*args: str) -> str:
    """`python -m vitmask ARGS` in a process of its own, its output shown as it runs; returns stdout."""
    print("$ vitmask " + " ".join(args), flush=True)
    res = subprocess.run([sys.executable, "-m", "vitmask", *args], stdout=subprocess.PIPE, text=True, check=False)
    print(res.stdout, end="", flush=True)
    if res.returncode != 0:
        raise SystemExit(f"vitmask {args[0]} exited {res.returncode}; nothing was written to the docs")
    return res.stdout


def public_args(args: list[str]) -> list[str]:
    """The command line as the docs print it: this machine's paths become DIR and CKPT."""
    names = {"--data": "DIR", "--checkpoint": "CKPT"}
    out = []
    for i, arg in enumerate(args):
        flag, eq, _ = arg.partition("=")
        if eq and flag in names:
            out.append(f"{flag} {names[flag]}")
        elif i and args[i - 1] in names:
            out.append(names[args[i - 1]])
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, help="score this checkpoint instead of training one")
    ap.add_argument("--data", default=PUBLISHED_DATA, help="the idx source of the published split")
    ap.add_argument("--run-dir", type=Path, default=Path("runs/mnist"), help="where the MNIST recipe trains")
    ap.add_argument("--skip-finetune", action="store_true", help="leave the fine-tuning row out")
    ap.add_argument("--out-dir", type=Path, default=Path("docs"))
    ap.add_argument("--readme", type=Path, default=Path("README.md"))
    ap.add_argument("--split", default="test")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--n", type=int, default=12, help="images in the pictures")
    ap.add_argument("--images", type=int, default=1000, help="images in the one-shot vs iterative comparison")
    ap.add_argument("--steps", type=int, default=8, help="rounds of iterative filling")
    ap.add_argument("--temperature", type=float, default=1.0, help="of the sampled fills and of samples.png")
    ap.add_argument("--samples", type=int, default=64, help="images in samples.png")
    ap.add_argument("--sample-steps", type=int, default=196, help="rounds of decoding for samples.png (random order)")
    ap.add_argument("--nll-strata", type=int, default=16)
    ap.add_argument("--nll-samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args(argv)
    out = a.out_dir
    results_page, readme = out / "results.md", a.readme
    for page in (results_page, readme):  # refuse before hours of work, not after
        if page.exists():
            replace_headline(page.read_text(), "")
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(a.device)
    date = datetime.date.today().isoformat()

    checkpoint = a.checkpoint
    if checkpoint is None:
        vitmask("train", "--config", TRAIN_CONFIG, "--set", "data.source=idx", "--set", f"data.path={a.data}",
                "--run-dir", str(a.run_dir), "--resume", "auto")  # fmt: skip
        checkpoint = a.run_dir / "last.pt"
    has_ema = load_checkpoint(checkpoint).get("ema") is not None

    report = verbs.evaluate_checkpoint(
        checkpoint, a.split, a.ratios, a.device, a.seed, "random", True, True, a.nll_strata, a.nll_samples
    )
    table, nll_text = format_report(report), format_nll(report["nll"])
    print(table + "\n\n" + nll_text)
    raw = None
    if has_ema:
        raw = verbs.evaluate_checkpoint(  # the bound only: the exact NLLs are the EMA weights'
            checkpoint,
            a.split,
            [0.5],
            a.device,
            a.seed,
            "random",
            True,
            True,
            a.nll_strata,
            a.nll_samples,
            "raw",
            nll_orders=0,
        )
    block_table = format_report(verbs.evaluate_checkpoint(checkpoint, a.split, a.ratios, a.device, a.seed, "block"))
    print(block_table)
    probe = verbs.probe_checkpoint(checkpoint, a.split, None, 20, a.seed, a.device, "grid", None)
    probe_mean = verbs.probe_checkpoint(checkpoint, a.split, None, 20, a.seed, a.device, "mean", None)
    probe_text = format_probe(probe) + "\n\n" + format_probe(probe_mean)
    print(probe_text)
    finetune = None
    if not a.skip_finetune:  # in a run dir of its own, removed after: only its figures are kept
        with tempfile.TemporaryDirectory(prefix="make-docs-finetune-") as tmp:
            args = ["--set", "data.source=idx", "--set", f"data.path={a.data}", "--run-dir", f"{tmp}/run", "--json"]
            printed = vitmask("finetune", "--checkpoint", str(checkpoint), "--config", FINETUNE_CONFIG, *args)
            finetune = json.loads(printed.strip().splitlines()[-1])

    verbs.reconstruct(checkpoint, out / "reconstruct.png", a.n, None, a.split, a.seed, a.device)
    verbs.sample(checkpoint, out / "samples.png", a.samples, a.sample_steps, a.temperature, a.seed, a.device, "random")

    model, cfg, _ = load_model(checkpoint, device)
    d = cfg.data
    images = load_splits(cfg)[a.split][: max(a.images, a.n)].to(device)  # (n, S, S)
    box = centre_box(d.grid, d.patch_size)
    box_mask = centre_box_mask(d.grid).to(device)  # (N,)

    # the user's path: a PNG file in, preprocessing, a box, a PNG out
    user_image = images[0] if not d.invert else 1 - images[0]
    save_binary_image(user_image, out / "inpaint_input.png")
    box_arg = ",".join(map(str, box))
    verbs.inpaint(checkpoint, out / "inpaint_input.png", [box_arg], None, out / "inpaint_filled.png", True,
                   a.steps, a.device)  # fmt: skip

    shown = images[: a.n]
    mask = box_mask.expand(len(shown), -1)  # (n, N)
    sampled = DecodeOptions(a.steps, a.temperature)
    draw = lambda: torch.Generator(device=device).manual_seed(a.seed)  # noqa: E731 - the same draws every time
    preds = [decode_masked(model, shown, mask, d.patch_size, DecodeOptions(steps)) for steps in (1, a.steps)]
    preds.append(decode_masked(model, shown, mask, d.patch_size, sampled, draw()))
    save_grid(reconstruction_grid(shown, mask, preds, d.patch_size), out / "inpaint.png", scale=4)

    rows = []
    cases = [
        (f"random, ratio {r:g}", next(eval_batches(images, cfg, r, a.seed, len(images), "random")).mask)
        for r in a.ratios
    ]
    cases.append((f"centre box {box_arg}", box_mask.expand(len(images), -1)))
    for name, mask in cases:
        one = fill_accuracy(model, images, mask, d.patch_size, 1)
        it = fill_accuracy(model, images, mask, d.patch_size, a.steps)
        smp = fill_accuracy(model, images, mask, d.patch_size, options=sampled, generator=draw())
        rows.append(
            f"| {name} | {one['acc']:.4f} | {it['acc']:.4f} | {smp['acc']:.4f} | {one['acc_nonempty']:.4f} | "
            f"{it['acc_nonempty']:.4f} | {smp['acc_nonempty']:.4f} |"
        )
        print(rows[-1])
    sample_cmd = (
        f"`vitmask sample --checkpoint CKPT --n {a.samples} --steps {a.sample_steps} --temperature {a.temperature:g} "
        f"--seed {a.seed} --order random --out samples.png`"
    )
    where = machine(device)
    weights = "EMA weights" if has_ema else "weights"
    cmd = "make_docs_images.main"
    if argv is None:
        cmd = " ".join(["python scripts/make_docs_images.py", *public_args(sys.argv[1:])])
    legend = "DIR: a folder with MNIST's test-set idx files" + (
        "; CKPT: a `runs/mnist/last.pt` of configs/mnist.yaml on them" if a.checkpoint else ""
    )
    legend = f" ({legend})" if argv is None else ""
    measured = (
        f"on {where}, by `{cmd}`{legend}: the {weights} of `{'CKPT' if a.checkpoint else checkpoint}` "
        f"(data source `{d.source}`, {d.image_size}x{d.image_size} images), scored on its {report['images']:,} "
        f"{a.split} images."
    )
    caption = f"Measured {date} {measured}"
    text = (
        f"""The tables and pictures below are of the headline checkpoint: {caption}

## Eval: the model beside three baselines, on the same masks

```text
{table}
```

The baselines: the majority class of the train split; the majority class at each patch position;
a lookup table from the 8-neighbour context of a masked patch (each neighbour's class, or masked, or
outside the image) to its most frequent class in the train split under masks of the same ratio,
backing off to the 4-neighbour table and then the per-position majority for unseen contexts.

## Large holes: block masks at each ratio

```text
{block_table}
```

## Likelihood

`vitmask eval --checkpoint CKPT --split {a.split} --nll --nll-strata {a.nll_strata} --nll-samples {a.nll_samples}`
(the exact NLLs on its first 100 images: `--nll-orders 8 --nll-exact-images 100`, the defaults):

```text
{nll_text}
```

## Probes

`vitmask probe --checkpoint CKPT --split {a.split}` (the 4x4 grid of token means, the default), then
the same with `--pool mean`:

```text
{probe_text}
```

## Samples

{sample_cmd}:

![samples](samples.png)

## Reconstructions

![reconstructions](reconstruct.png)

Rows: original, masked input (grey), prediction with the visible patches kept, errors (red: a
missing pixel, orange: a spurious one; masked patches tinted blue).

## Inpainting: one-shot vs iterative vs sampled

`vitmask inpaint --checkpoint CKPT --image inpaint_input.png --box {box_arg} --iterative --out inpaint_filled.png`:

![input](inpaint_input.png) -> ![filled](inpaint_filled.png)

The centre box on {len(shown)} {a.split} images; rows: original, masked, one-shot fill, its errors,
iterative fill ({a.steps} rounds), its errors, iterative sampled fill ({a.steps} rounds, temperature
{a.temperature:g}), its errors:

![inpainting](inpaint.png)

Accuracy on the filled patches of the first {len(images)} {a.split} images (seed {a.seed}; a sampled
fill is one draw, so it scores below the most likely fill by design):

| mask | one-shot acc | iterative acc | sampled acc | one-shot, non-empty | iterative, non-empty | sampled, non-empty |
|---|---|---|---|---|---|---|
"""
        + "\n".join(rows)
        + "\n"
    )
    page = results_page.read_text() if results_page.exists() else None
    page = merge_generated(page, text)
    if HEADLINE_START in page:
        page = replace_headline(page, caption + "\n\n" + headline_rows(report, raw, probe, finetune, date, True))
    results_page.write_text(page)
    if readme.exists():
        # README.md: the date in the table's rows only (a date is data there, not in its prose)
        block = f"Measured {measured}\n\n" + headline_rows(report, raw, probe, finetune, date, False)
        readme.write_text(replace_headline(readme.read_text(), block))
    print(f"wrote {results_page}, the headline of {readme} and the pictures in {out}")


if __name__ == "__main__":
    main()
