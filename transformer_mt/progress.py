"""Progress on stderr: tqdm's bar at a terminal, plain lines anywhere else (a file, a pipe, a CI log).

A bar redraws itself with carriage returns, which a terminal overwrites
and a file keeps: a log of `tmt prepare 2> log` would hold one endless line.
Every tmt progress display goes through `progress`, which gives tqdm's bar
only where stderr is a terminal, else a `LineProgress`: the same figures
(tqdm's own `format_meter`, without the bar) as whole lines, one every
`LINE_SECONDS` and one when the work ends. Training, which prints its own
lines there (train.log_every), disables it instead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from tqdm import tqdm

LINE_SECONDS = 30.0  # a plain progress line at most this often: a log of an hour's download keeps 120 of them


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal, where a bar can redraw itself (a closed or odd stream is not)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def progress(iterable: Iterable[Any] | None = None, **options: Any) -> tqdm | LineProgress:
    """tqdm(``iterable``, ``**options``) on stderr at a terminal, else `LineProgress` with the same options.

    ``disable=None``, tqdm's "only at a terminal", gives nothing anywhere else.
    """
    if is_terminal(sys.stderr):
        return tqdm(iterable, file=sys.stderr, **options)
    return LineProgress(iterable, **options)


class LineProgress:
    """tqdm's figures as whole lines on stderr: the calls of tqdm that tmt makes (``update``, ``set_postfix``,
    iteration, ``close``, ``with``) with tqdm's options; those about drawing (``leave``, ``dynamic_ncols``) mean
    nothing for lines.

    As tqdm's bar, nothing is printed before ``delay`` seconds; the first line
    comes `LINE_SECONDS` in, the last at ``close``, unless the work ended by an
    exception (its message is then the only line after the progress).
    """

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        total: float | None = None,
        desc: str | None = None,
        unit: str = "it",
        initial: float = 0,
        disable: bool | None = False,
        delay: float = 0.0,
        unit_scale: bool = False,
        unit_divisor: int = 1000,
        **drawing: Any,
    ) -> None:
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n = self.initial = initial
        self.disable = disable is None or disable
        self.delay, self.unit_scale, self.unit_divisor = delay, unit_scale, unit_divisor
        self.start = self.last = time.monotonic()
        self.postfix: str | None = None
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            self.total = len(iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.disable = True  # the error's line is the last word
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= LINE_SECONDS and now - self.start >= self.delay:
            self._line(now)

    def set_postfix(self, refresh: bool = True, **figures: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in figures.items())

    def close(self) -> None:
        now = time.monotonic()
        if now - self.start >= self.delay:
            self._line(now)
        self.disable = True

    def _line(self, now: float) -> None:
        if self.disable:
            return
        self.last = now
        line = tqdm.format_meter(
            self.n, self.total, now - self.start, ncols=0, prefix=self.desc or "", unit=self.unit,
            unit_scale=self.unit_scale, unit_divisor=self.unit_divisor, initial=self.initial, postfix=self.postfix,
        )  # fmt: skip
        print(line, file=sys.stderr, flush=True)


Bar = tqdm | LineProgress  # what `progress` gives: the type of a bar passed around
