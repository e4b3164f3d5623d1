"""Make the docs pictures and numbers from a checkpoint and its config's image source.

    python scripts/make_docs_images.py --checkpoint runs/mnist/best.pt [--out-dir docs]

Writes to --out-dir:
- reconstruct.png: `vitmask reconstruct` on the first --n images of --split;
- inpaint_input.png, inpaint_filled.png: one image of --split as a user's file, and what
  `vitmask inpaint --box` (the centre box) makes of it through the user's path;
- inpaint.png: the centre box filled one-shot, iteratively and iteratively sampled (temperature
  --temperature) on --n images (rows: original, masked, then each fill and its errors);
- samples.png: `vitmask sample` of --samples images from a fully masked canvas;
- results.md, below its MARKER line (the hand-written part above it is kept; a results.md without
  the marker is written anew): the eval tables (model and baselines at each ratio with random masks
  and the centre box; block masks at each ratio), the NLL bound beside its baselines, one-shot vs
  iterative vs sampled filling accuracy on --images images at each ratio and for the centre box,
  and a summary of the headline numbers (the NLL bound, scattered r=0.5, the centre box).
"""

import argparse
import sys
from pathlib import Path

import torch

from vitmask.cli import verbs
from vitmask.data.batches import eval_batches, load_splits
from vitmask.data.masking import centre_box_mask
from vitmask.evaluate.likelihood import format_nll
from vitmask.evaluate.pictures import reconstruction_grid, save_binary_image, save_grid
from vitmask.evaluate.scores import format_report
from vitmask.generate.inpaint import fill_accuracy
from vitmask.generate.sampling import DecodeOptions, decode_masked
from vitmask.runtime.process import resolve_device
from vitmask.store.checkpoint import load_model

MARKER = "<!-- make_docs_images.py writes everything below this line -->"


def merge_generated(old: str | None, generated: str) -> str:
    """results.md: the text of `old` up to and including its MARKER line, then `generated`; without
    an old page or a marker in it, a new page: a title, the marker, then `generated`."""
    if old is not None and MARKER in old:
        return old[: old.index(MARKER) + len(MARKER)] + "\n\n" + generated
    return f"# Results\n\n{MARKER}\n\n" + generated


def centre_box(grid: int, patch_size: int) -> tuple[int, int, int, int]:
    """The pixels of masking.centre_box_mask (the central square of patches), as x0, y0, x1, y1."""
    rows = centre_box_mask(grid).view(grid, grid).any(1).nonzero().flatten()  # the box's rows (= its columns)
    lo, hi = int(rows[0]) * patch_size, (int(rows[-1]) + 1) * patch_size
    return lo, lo, hi, hi


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--out-dir", type=Path, default=Path("docs"))
    ap.add_argument("--split", default="test")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--n", type=int, default=12, help="images in the pictures")
    ap.add_argument("--images", type=int, default=1000, help="images in the one-shot vs iterative comparison")
    ap.add_argument("--steps", type=int, default=8, help="rounds of iterative filling")
    ap.add_argument("--temperature", type=float, default=1.0, help="of the sampled fills and of samples.png")
    ap.add_argument("--samples", type=int, default=64, help="images in samples.png")
    ap.add_argument("--sample-steps", type=int, default=256, help="rounds of decoding for samples.png (random order)")
    ap.add_argument("--nll-strata", type=int, default=16)
    ap.add_argument("--nll-samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args(argv)
    out = a.out_dir
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(a.device)

    report = verbs.evaluate_checkpoint(
        a.checkpoint, a.split, a.ratios, a.device, a.seed, "random", True, True, a.nll_strata, a.nll_samples
    )
    table, nll_text = format_report(report), format_nll(report["nll"])
    print(table + "\n\n" + nll_text)
    block_table = format_report(verbs.evaluate_checkpoint(a.checkpoint, a.split, a.ratios, a.device, a.seed, "block"))
    print(block_table)
    verbs.reconstruct(a.checkpoint, out / "reconstruct.png", a.n, None, a.split, a.seed, a.device)
    verbs.sample(
        a.checkpoint, out / "samples.png", a.samples, a.sample_steps, a.temperature, a.seed, a.device, "random"
    )

    model, cfg, _ = load_model(a.checkpoint, device)
    d = cfg.data
    images = load_splits(cfg)[a.split][: max(a.images, a.n)].to(device)  # (n, S, S)
    box = centre_box(d.grid, d.patch_size)
    box_mask = centre_box_mask(d.grid).to(device)  # (N,)

    # the user's path: a PNG file in, preprocessing, a box, a PNG out
    user_image = images[0] if not d.invert else 1 - images[0]
    save_binary_image(user_image, out / "inpaint_input.png")
    box_arg = ",".join(map(str, box))
    verbs.inpaint(a.checkpoint, out / "inpaint_input.png", [box_arg], None, out / "inpaint_filled.png", True,
                   a.steps, a.device)  # fmt: skip

    shown = images[: a.n]
    mask = box_mask.expand(len(shown), -1)  # (n, N)
    sampled = DecodeOptions(a.steps, a.temperature)
    draw = lambda: torch.Generator(device=device).manual_seed(a.seed)  # noqa: E731 - the same draws every time
    preds = [decode_masked(model, shown, mask, d.patch_size, DecodeOptions(steps)) for steps in (1, a.steps)]
    preds.append(decode_masked(model, shown, mask, d.patch_size, sampled, draw()))
    save_grid(reconstruction_grid(shown, mask, preds, d.patch_size), out / "inpaint.png", scale=4)

    rows, nonempty = [], {}
    cases = [
        (f"random, ratio {r:g}", next(eval_batches(images, cfg, r, a.seed, len(images), "random")).mask)
        for r in a.ratios
    ]
    cases.append((f"centre box {box_arg}", box_mask.expand(len(images), -1)))
    for name, mask in cases:
        one = fill_accuracy(model, images, mask, d.patch_size, 1)
        it = fill_accuracy(model, images, mask, d.patch_size, a.steps)
        smp = fill_accuracy(model, images, mask, d.patch_size, options=sampled, generator=draw())
        nonempty[name] = (one["acc_nonempty"], it["acc_nonempty"])
        rows.append(
            f"| {name} | {one['acc']:.4f} | {it['acc']:.4f} | {smp['acc']:.4f} | {one['acc_nonempty']:.4f} | "
            f"{it['acc_nonempty']:.4f} | {smp['acc_nonempty']:.4f} |"
        )
        print(rows[-1])
    summary = summary_rows(report, nonempty[f"centre box {box_arg}"])
    sample_cmd = (
        f"`vitmask sample --checkpoint CKPT --n {a.samples} --steps {a.sample_steps} --temperature {a.temperature:g} "
        f"--seed {a.seed} --order random --out samples.png`"
    )

    cmd = " ".join(["python scripts/make_docs_images.py", *sys.argv[1:]]) if argv is None else "make_docs_images.main"
    text = (
        f"""Generated by `{cmd}` from `{a.checkpoint}` (data source `{d.source}`, {d.image_size}x{d.image_size} images,
{d.patch_size}x{d.patch_size} patches). Rerun it on another checkpoint to refresh this part and the pictures.

## Eval: the model beside three baselines, on the same masks

```
{table}
```

The baselines: the majority class of the train split; the majority class at each patch position;
a lookup table from the 8-neighbour context of a masked patch (each neighbour's class, or masked, or
outside the image) to its most frequent class in the train split under masks of the same ratio,
backing off to the 4-neighbour table and then the per-position majority for unseen contexts.

## Large holes: block masks at each ratio

```
{block_table}
```

## Likelihood

`vitmask eval --checkpoint CKPT --split {a.split} --nll --nll-strata {a.nll_strata} --nll-samples {a.nll_samples}`:

```
{nll_text}
```

## Summary

| | this checkpoint |
|---|---|
{summary}

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
    results = out / "results.md"
    results.write_text(merge_generated(results.read_text() if results.exists() else None, text))
    print(f"wrote {out}/results.md and the pictures")


def summary_rows(report: dict, centre_nonempty: tuple[float, float]) -> str:
    """The summary's rows: the NLL bound, scattered r=0.5, the centre box."""
    nll = report["nll"]
    rows = [
        f"| NLL bound, nats per image (bits per pixel) | {nll['nats']:.2f} ({nll['bits_per_pixel']:.4f}) "
        f"+- {nll['se_mc']:.2f} |",
        f"| per-position Bernoulli, nats per image | {nll['baselines']['bernoulli']['nats']:.2f} |",
    ]
    for r in report["results"]:
        if r["strategy"] == "random" and r["mask_ratio"] == 0.5:
            rows.append(f"| random r=0.5: acc, acc non-empty | {r['acc']:.4f}, {r['acc_nonempty']:.4f} |")
        if r["strategy"] == "centre":
            rows.append(f"| centre box: masked NLL (nats per patch) | {r['loss']:.4f} |")
    rows.append(
        f"| centre box: acc non-empty, one-shot / iterative | {centre_nonempty[0]:.4f} / {centre_nonempty[1]:.4f} |"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
