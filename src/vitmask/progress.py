"""Progress of a long phase, reported the same way by every verb: how much is done of how much, and
when it will be done.

`Progress(total, desc, unit)` (or `track(iterable, ...)` around a loop) reports on stderr:

- on a terminal: a tqdm bar, `desc: 40%|####      | 400/1000 [00:12<00:18, 33.1img/s]` (done/total,
  elapsed<ETA, rate), redrawn in place and cleared when the phase ends;
- anywhere else (a log file, a pipe, CI): one plain line every `LINE_SECONDS` (30 s) while the phase
  runs, `desc: 400/1,000 img (40%), 00:12 elapsed, ETA 00:18, 33.1 img/s`, and nothing for a phase
  that ends sooner, so a short run's log and a script's stderr stay clean;
- with `enabled=False` (a library call left quiet, a rank other than 0): nothing.

`note(line)` writes one line on stderr without tearing a bar: the trainer's line when
`train.compile` starts compiling the step, and the one saying how long it took.

A leaf: the standard library and tqdm only.
"""

import sys
from collections.abc import Iterable, Iterator
from time import monotonic
from typing import TextIO, TypeVar

from tqdm import tqdm

LINE_SECONDS = 30.0  # not on a terminal: a line this often while a phase runs

T = TypeVar("T")


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def clock(seconds: float) -> str:
    """Seconds as tqdm writes them: 05:07, or 1:02:03 past an hour."""
    return tqdm.format_interval(seconds)


class Progress:
    """A phase of `total` `unit`s: `update(n)` as they are done, `close()` (or a `with` block) at the end."""

    def __init__(self, total: int, desc: str, unit: str = "it", enabled: bool = True, unit_scale: bool = False):
        self.total, self.desc, self.unit, self.unit_scale = int(total), desc, unit, unit_scale
        self.done = 0
        self.started = self.last_line = monotonic()
        self.stream = sys.stderr
        self.bar = None  # the terminal's tqdm bar
        self.lines = enabled and not is_terminal(self.stream)  # plain lines, every LINE_SECONDS
        if enabled and not self.lines:
            self.bar = tqdm(
                total=self.total, desc=desc, unit=unit, unit_scale=unit_scale, leave=False, file=self.stream
            )

    def update(self, n: int = 1) -> None:
        """`n` more units done."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.lines:
            now = monotonic()
            if now - self.last_line >= LINE_SECONDS:
                self.last_line = now
                self._write(self.line(now))

    def line(self, now: float | None = None) -> str:
        """The plain line: done/total, the share, the time so far, the ETA at the rate so far, the rate."""
        elapsed = (monotonic() if now is None else now) - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = clock(round((self.total - self.done) * elapsed / self.done)) if rate > 0 else "?"  # at the rate so far
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return (
            f"{self.desc}: {self._count(self.done)}/{self._count(self.total)} {self.unit}{share}, "
            f"{clock(elapsed)} elapsed, ETA {eta}, {self._count(rate, rate=True)} {self.unit}/s"
        )

    def _count(self, n: float, rate: bool = False) -> str:
        if self.unit_scale:
            return tqdm.format_sizeof(n)
        if rate:  # three digits, as 0.028, 16.7 or 4,052
            return f"{n:,.0f}" if n >= 100 else f"{n:.3g}"
        return f"{int(n):,}"

    def _write(self, line: str) -> None:
        try:
            print(line, file=self.stream, flush=True)
        except (OSError, ValueError):  # stderr gone (a closed pipe): say nothing more
            self.lines = False

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.lines = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def track(
    items: Iterable[T], desc: str, unit: str = "it", total: int | None = None, enabled: bool = True
) -> Iterator[T]:
    """`items`, reported as a Progress of `total` (default len(items)) units, one per item."""
    progress = Progress(len(items) if total is None else total, desc, unit, enabled)  # type: ignore[arg-type]
    try:
        for item in items:
            yield item
            progress.update()
    finally:
        progress.close()


def note(line: str) -> None:
    """One line on stderr, above any bar being drawn."""
    try:
        tqdm.write(line, file=sys.stderr)
    except (OSError, ValueError):
        pass
