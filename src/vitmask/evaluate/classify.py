"""Scoring a fine-tuned classifier on a labelled split (`vitmask eval` of a classifier): accuracy,
per-class accuracy beside the majority class, the confusion matrix and its picture.

The confusion matrix counts, for every true class (a row) and predicted class (a column), the
images of the split with that pair; per-class accuracy is a row's diagonal over the row's total
(recall). The picture draws one square cell per pair, coloured from white (no image of the row)
to dark blue (every image of the row) by the row's share, `confusion_colour`; with room, each
cell shows its count and the axes the class names (rows: true, columns: predicted).

Class names may hold anything a folder name can (`shown_name`): the picture and the text report
show each on one line, its control characters (a line break, a tab, a right-to-left override) and
the undecodable bytes of a file name as visible escapes (\\n, \\u202e, \\xff), an empty name as
'', a long one cut to fit with an ellipsis; the JSON report keeps every name whole.

Shapes: n images, L classes.
"""

import unicodedata
from dataclasses import dataclass

import torch

WHITE = (255, 255, 255)
BLUE = (8, 48, 107)  # a row's whole share
MAX_SIDE = 720  # pixels the cells take along a side, at most (cells shrink to fit, down to MIN_CELL)
MIN_CELL, MAX_CELL = 4, 40
NAMED_CELL = 12  # cells at least this wide get class names on the axes
COUNTED_CELL = 24  # cells at least this wide show their count
NAME_MARGIN = 96  # pixels left of the rows and above the columns for the names
PLAIN_MARGIN = 4
MAX_SHOWN = 64  # characters of a class name the picture measures at most (its margin shows fewer)
TABLE_NAME = 19  # characters of a class name in the text report's table
HIDDEN = {"Cc", "Cf", "Cs", "Co", "Zl", "Zp"}  # control, format, surrogate, private use, line/paragraph breaks


def shown_name(name: str, limit: int = MAX_SHOWN) -> str:
    """A class name as one line to draw or print: each control or format character (a line break, a
    tab, a right-to-left override, ...) as its escape (\\n, \\t, \\u202e), each undecodable byte of a
    file name (a lone surrogate U+DC80..U+DCFF) as \\xNN, an empty name as ''; at most `limit`
    characters, a longer one cut with "..."."""
    parts, length = [], 0
    for c in name[: limit + 1]:  # a name of a million characters is not walked whole
        if "\udc80" <= c <= "\udcff":
            c = f"\\x{ord(c) - 0xDC00:02x}"
        elif unicodedata.category(c) in HIDDEN:
            c = c.encode("unicode_escape", "backslashreplace").decode("ascii")
        parts.append(c)
        length += len(c)
        if length > limit:
            break
    text = "".join(parts)
    if len(text) > limit or len(name) > limit:
        text = text[: max(limit - 3, 0)] + "..."
    return text or "''"


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """pred, target (n,) class indices -> (L, L) int64 counts: rows true, columns predicted."""
    flat = target.long() * num_classes + pred.long()  # (n,)
    return torch.bincount(flat, minlength=num_classes * num_classes).view(num_classes, num_classes).cpu()


def classifier_report(confusion: torch.Tensor, names: list[str], labels: list[int], majority: int) -> dict:
    """Accuracy, per-class accuracy and counts from a confusion matrix; `majority` is the train split's
    most common class (its accuracy: always predicting it)."""
    total = int(confusion.sum())
    per_row = confusion.sum(1)  # (L,)
    correct = confusion.diagonal()  # (L,)
    per_class = [
        {
            "index": i,
            "label": labels[i],
            "name": names[i],
            "images": int(per_row[i]),
            "correct": int(correct[i]),
            "accuracy": int(correct[i]) / int(per_row[i]) if int(per_row[i]) else float("nan"),
        }
        for i in range(len(names))
    ]
    return {
        "images": total,
        "accuracy": int(correct.sum()) / total if total else float("nan"),
        "majority_class": names[majority],
        "majority_acc": int(per_row[majority]) / total if total else float("nan"),
        "per_class": per_class,
        "confusion": confusion.tolist(),
    }


def format_classifier_report(report: dict) -> str:
    """The classifier's eval report as plain text: the accuracy, then a row per class."""
    lines = [
        f"classifier {report['checkpoint']} ({report['weights']} weights) on {report['split']} "
        f"({report['images']:,} images, {len(report['per_class'])} classes)",
        f"accuracy {report['accuracy']:.4f}  (majority class {shown_name(report['majority_class'])}: "
        f"{report['majority_acc']:.4f})",
        "",
        f"  {'class':<20}{'images':>8}{'correct':>9}{'accuracy':>10}",
    ]
    for row in report["per_class"]:
        acc = "-" if row["images"] == 0 else f"{row['accuracy']:.4f}"
        lines.append(f"  {shown_name(row['name'], TABLE_NAME):<20}{row['images']:>8,}{row['correct']:>9,}{acc:>10}")
    if report.get("confusion_png"):
        lines += ["", f"wrote the confusion matrix to {report['confusion_png']} (rows: true class, columns: predicted)"]
    return "\n".join(lines)


# ---- the picture ----------------------------------------------------------------------------------
def confusion_colour(share: float) -> tuple[int, int, int]:
    """The colour of a cell holding `share` (0..1) of its row: white at 0, BLUE at 1, linear between."""
    return tuple(round(w - share * (w - b)) for w, b in zip(WHITE, BLUE, strict=True))


@dataclass
class ConfusionLayout:
    """Where the cells of a confusion picture lie: cell (i, j) spans x in [left + j c, left + (j + 1) c)
    and y in [top + i c, top + (i + 1) c)."""

    cell: int
    left: int
    top: int
    classes: int

    def box(self, i: int, j: int) -> tuple[int, int, int, int]:
        """(x0, y0, x1, y1) of cell (true i, predicted j), x1 and y1 exclusive."""
        x0, y0 = self.left + j * self.cell, self.top + i * self.cell
        return x0, y0, x0 + self.cell, y0 + self.cell

    @property
    def size(self) -> tuple[int, int]:
        side = self.classes * self.cell
        return self.left + side + PLAIN_MARGIN, self.top + side + PLAIN_MARGIN


def confusion_layout(num_classes: int) -> ConfusionLayout:
    cell = max(MIN_CELL, min(MAX_CELL, MAX_SIDE // num_classes))
    margin = NAME_MARGIN if cell >= NAMED_CELL else PLAIN_MARGIN
    return ConfusionLayout(cell, margin, margin, num_classes)


def confusion_image(confusion: torch.Tensor, names: list[str]):
    """(L, L) counts -> a PIL RGB image of the matrix (see the module docstring)."""
    from PIL import Image, ImageDraw, ImageFont

    layout = confusion_layout(len(names))
    image = Image.new("RGB", layout.size, WHITE)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    counts = confusion.tolist()
    for i, row in enumerate(counts):
        total = sum(row)
        for j, count in enumerate(row):
            share = count / total if total else 0.0
            x0, y0, x1, y1 = layout.box(i, j)
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=confusion_colour(share))
            if layout.cell >= COUNTED_CELL and count:
                ink = WHITE if share > 0.5 else (0, 0, 0)
                draw.text(((x0 + x1) / 2, (y0 + y1) / 2), str(count), fill=ink, font=font, anchor="mm")
    if layout.cell >= NAMED_CELL:
        width = NAME_MARGIN - 8
        for k, name in enumerate(names):
            text = fit_text(draw, shown_name(name), font, width)
            x0, y0, _, y1 = layout.box(k, 0)
            draw.text((layout.left - 4, (y0 + y1) / 2), text, fill=(0, 0, 0), font=font, anchor="rm")
            column = Image.new("RGB", (width, layout.cell), WHITE)  # the column's name, turned upright
            ImageDraw.Draw(column).text((0, layout.cell / 2), text, fill=(0, 0, 0), font=font, anchor="lm")
            turned = column.rotate(90, expand=True)
            x0, _, x1, _ = layout.box(0, k)
            image.paste(turned, (x0, layout.top - 4 - turned.height))
    return image


def fit_text(draw, text: str, font, width: int) -> str:
    """`text`, cut (with an ellipsis) to fit `width` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."
