"""Check that every relative link in README.md and docs/*.md resolves, and that docs/README.md, the
index of the docs, links every page of docs/.

A link is a Markdown link or image, `[text](target)` or `![alt](target)`. Links with a scheme
(`https:`, `mailto:`) are skipped. For the others the file part must exist, relative to the page
that links it, and a `#anchor` must name a heading of the target page (GitHub's slugs: lower case,
punctuation dropped, spaces to hyphens). Each broken link is printed as `path:line: target (why)`,
each page of docs/ that docs/README.md does not link as `docs/PAGE.md: not linked from
docs/README.md (...)`.

Usage: python scripts/check_links.py [ROOT]   (ROOT: the repository, by default this script's).
Exit code 1 on any broken link or unlinked page, 0 otherwise. `make lint` runs it.
"""

import re
import sys
from pathlib import Path

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (`_` and `-` kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def lines_outside_code(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of every line of `path` outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def anchors_of(path: Path) -> set[str]:
    """The anchors of a Markdown page's headings (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in lines_outside_code(path):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            anchors.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return anchors


def broken_links(root: Path, page: Path) -> list[str]:
    """The `path:line: target (why)` lines of the links of `page` that do not resolve."""
    rel = page.relative_to(root).as_posix()
    out = []
    for number, line in lines_outside_code(page):
        for target in LINK.findall(line):
            if SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                out.append(f"{rel}:{number}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
                out.append(f"{rel}:{number}: {target} (no heading with that anchor)")
    return out


def unlinked_pages(root: Path) -> list[str]:
    """The `docs/PAGE.md: not linked ...` lines of the pages of docs/ that docs/README.md does not link."""
    index = root / "docs" / "README.md"
    if not index.is_file():
        return []
    linked = {
        (index.parent / target.partition("#")[0]).resolve()
        for _, line in lines_outside_code(index)
        for target in LINK.findall(line)
        if not SCHEME.match(target) and target.partition("#")[0]
    }
    return [
        f"{page.relative_to(root).as_posix()}: not linked from docs/README.md (add it to the section of its kind)"
        for page in sorted((root / "docs").glob("*.md"))
        if page != index and page.resolve() not in linked
    ]


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve() if len(argv) > 1 else Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    broken = [line for page in pages if page.is_file() for line in broken_links(root, page)]
    broken += unlinked_pages(root)
    for line in broken:
        print(line)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
