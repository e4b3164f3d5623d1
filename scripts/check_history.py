"""Check that the product's files speak of the product: no words about how it was developed.

Scans README.md, docs/**/*.md, configs/*.yaml, src/**/*.py, tests/**/*.py, scripts/**/*.py and the
Makefile, line by line, for the patterns in PATTERNS (numbered work sessions, issue and item
numbers, references to notes outside the repository, narrative dates, phrases that only make
sense beside an earlier state of the project, and a lab notebook's phrasing: goals a figure was
measured against, the attempts made, the work still to do, fixes of another text). Every hit is
printed as `path:line: text`.

Dates are allowed where they are data: anywhere in docs/benchmarks.md, docs/results.md,
docs/gpu-guide.md and docs/sweeps.md (each measured figure carries its date) and in the table rows (lines that
start with `|`) of README.md and docs/contributing.md.

Usage: python scripts/check_history.py [ROOT]   (ROOT: the repository, by default this script's).
Exit code 1 on any hit, 0 otherwise. `make lint` runs it.

The patterns are written so that this file's own text does not match them (a character class or
an optional part sits inside each word), so the script scans itself like any other.
"""

import re
import sys
from pathlib import Path

# (name, pattern). Case-insensitive. Each comment says what the pattern catches.
PATTERNS = [
    # a numbered work session, or one spoken of by its possessive; TensorBoard's "hparams session"
    # (no number after it) is its own term and passes
    ("work-session", re.compile(r"\bsess[i]ons?\s*#?\d+|(?<!hparams )\bsess[i]on['’]s\b", re.I)),
    # an issue tracker's number: the word then a number, with or without "#"
    ("issue-number", re.compile(r"\biss[u]es?\s*#\s*\d+|\biss[u]es?\s+\d+", re.I)),
    # an item of a numbered list that is not in the repository
    ("item-number", re.compile(r"\bit[e]ms?\s+\d+", re.I)),
    # the design notes the project started from, by their number or as notes of a seed
    ("seed-note", re.compile(r"(?<![A-Za-z])se[e]d[\s_-]*0\d\d|\bse[e]d\s+notes?\b", re.I)),
    # an earlier recipe spoken of by its place in time
    ("earlier-recipe", re.compile(r"\bthe\s+rec[i]pe\s+before\b", re.I)),
    # the present day as a point in the project's history
    ("today", re.compile(r"\btod[a]y['’]s\b", re.I)),
    # the work order a file was written under
    ("current-work-order", re.compile(r"\bth[i]s\s+task\b", re.I)),
    # a time of day as a point in the project's history
    ("time-of-day", re.compile(r"\b(?:th[e]|in\s+the|th[i]s)\s+(?:morning|afternoon|evening)(?:['’]s)?\b", re.I)),
    # a lab notebook's phrasing: the goal a figure was measured against, a goal missed, fixes of
    # another text, the work still to do, the attempts made
    ("aim", re.compile(r"\baim[e]d\s+at\b", re.I)),
    (
        "goal-missed",
        re.compile(
            r"\btarg[e]ts?\b(?:[^.;]|\.\d){0,40}?\b(?:is|are|was|were)\s+(?:not\s+met|missed)\b",
            re.I,
        ),
    ),
    ("corrections", re.compile(r"\bcorr[e]ctions?\s+to\b", re.I)),
    ("next-steps", re.compile(r"\bn[e]xt\s+steps\b", re.I)),
    ("attempts", re.compile(r"\bwhat\s+w[a]s\s+tried\b", re.I)),
    # a calendar date (checked only outside the places where dates are data; see date_allowed)
    ("date", re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b")),
]

DATE_FILES = {"docs/benchmarks.md", "docs/results.md", "docs/gpu-guide.md", "docs/sweeps.md"}


def files_to_scan(root: Path) -> list[Path]:
    """Every file the check covers, sorted, as paths under `root`."""
    found = set()
    for pattern in ("README.md", "Makefile", "configs/*.yaml"):
        found.update(root.glob(pattern))
    for folder, suffix in (("docs", ".md"), ("src", ".py"), ("tests", ".py"), ("scripts", ".py")):
        found.update(p for p in (root / folder).rglob(f"*{suffix}"))
    return sorted(p for p in found if p.is_file())


TABLE_DATE_FILES = ("README.md", "docs/contributing.md")  # measured rows: the README's results, the suite's time


def date_allowed(rel: str, line: str) -> bool:
    """Dates are data in the benchmark and result pages, and in the table rows of README.md and
    docs/contributing.md (each row a measurement)."""
    return rel in DATE_FILES or (rel in TABLE_DATE_FILES and line.lstrip().startswith("|"))


def hits_in(root: Path, path: Path) -> list[str]:
    """The `path:line: text` lines of every line of `path` that matches a pattern."""
    rel = path.relative_to(root).as_posix()
    out = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        for name, pattern in PATTERNS:
            if name == "date" and date_allowed(rel, line):
                continue
            if pattern.search(line):
                out.append(f"{rel}:{number}: {line.strip()}")
                break
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve() if len(argv) > 1 else Path(__file__).resolve().parent.parent
    hits = [hit for path in files_to_scan(root) for hit in hits_in(root, path)]
    for hit in hits:
        print(hit)
    if hits:
        print(f"check_history: {len(hits)} line(s) speak of the project's history, not the product", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
