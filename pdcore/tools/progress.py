"""Live progress for the command-line runs (``demo``, ``chaos``): requests done / failed, bytes, rate.

Two faces, one set of calls:

- on a terminal, with ``rich`` installed (the ``cli`` extra), a ``rich.progress.Progress`` bar
  that moves during set-up (a pulsing bar while ranks start) and during the run;
- otherwise (stdout redirected to a file or a CI log, or no ``rich``) plain lines: one when
  set-up starts, one when the ranks are ready, one every ``every`` seconds while the run goes,
  and one at the end, so a log stays readable and still shows that something moves.

The runner calls ``starting`` once, ``ranks_ready`` as ranks report, ``running`` when the last
rank is ready, ``update`` as often as it likes (it is cheap: plain lines are rate-limited), and
``close`` at the end (or uses the object as a context manager). Nothing here reads a clock the
caller cannot replace: ``clock`` defaults to ``time.monotonic``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["RunProgress", "rich_available"]


def rich_available() -> bool:
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        return False
    return True


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _rate(nbytes: float, seconds: float) -> str:
    return f"{_size(nbytes / seconds)}/s" if seconds > 0 else "-"


class RunProgress:
    """Progress of one run. ``mode``: ``"auto"`` (rich on a terminal, else plain), ``"rich"``
    (plain if rich is not installed), ``"plain"`` or ``"none"``; ``unit`` names what is counted."""

    def __init__(
        self,
        name: str,
        *,
        mode: str = "auto",
        every: float = 5.0,
        stream: TextIO | None = None,
        unit: str = "requests",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in ("auto", "rich", "plain", "none"):
            raise ValueError(f"RunProgress mode must be auto, rich, plain or none, got {mode!r}")
        if not every > 0:
            raise ValueError(f"RunProgress every must be positive, got {every!r}")
        self._stream = stream if stream is not None else sys.stdout
        if mode == "auto":
            mode = "rich" if getattr(self._stream, "isatty", lambda: False)() else "plain"
        if mode == "rich" and not rich_available():
            mode = "plain"  # rich is the optional ``cli`` extra
        self.mode = mode
        self.name = name
        self.unit = unit
        self.every = every
        self._clock = clock
        self._t_setup = clock()
        self._t_run: float | None = None
        self._next_line = 0.0
        self._total: int | None = None
        self._done = self._failed = self._bytes = 0
        self._ready = (0, 0)
        self._closed = False
        self._bar: Any = None  # rich.progress.Progress
        self._task: Any = None

    # -- the runner's calls

    def starting(self, what: str, expected: int) -> None:
        """Set-up begins: ``what`` says what starts (``"4 ranks (prefill tp 2, decode tp 2)"``)."""
        self._t_setup = self._clock()
        self._ready = (0, expected)
        if self.mode == "plain":
            self._line(f"{self.name}: starting {what}...")
            self._next_line = self._t_setup + self.every
        elif self.mode == "rich":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[extra]}"),
                TimeElapsedColumn(),
                console=Console(file=self._stream),
                refresh_per_second=4,
            )
            self._bar.start()
            self._task = self._bar.add_task(f"starting {what}", total=None, extra="")

    def ranks_ready(self, ready: int, expected: int) -> None:
        """During set-up: ``ready`` of ``expected`` ranks reported ready."""
        self._ready = (ready, expected)
        if self.mode == "rich" and self._t_run is None:
            self._bar.update(self._task, extra=f"{ready}/{expected} ranks ready")
        elif self.mode == "plain" and self._t_run is None and self._due():
            self._line(f"{self.name}: still starting: {ready}/{expected} ranks ready after {self._since(self._t_setup)}")

    def running(self, total: int | None) -> None:
        """Every rank is ready: the run (and its rate) starts now; ``total``: what will be counted (None: open)."""
        now = self._clock()
        self._t_run = now
        self._total = total
        ready, expected = self._ready
        if self.mode == "plain":
            of = f"{total} {self.unit}" if total is not None else self.unit
            self._line(f"{self.name}: {expected} ranks ready in {now - self._t_setup:.1f} s; running {of}")
            self._next_line = now + self.every
        elif self.mode == "rich":
            self._bar.reset(self._task, total=total, description=self.unit, extra=self._extra())

    def update(self, done: int, failed: int, nbytes: int) -> None:
        """``done`` counts every ended request (``failed`` of them failed); ``nbytes`` moved so far."""
        self._done, self._failed, self._bytes = done, failed, nbytes
        if self._t_run is None:
            return
        if self.mode == "rich":
            self._bar.update(self._task, completed=done, extra=self._extra())
        elif self.mode == "plain" and self._due():
            self._line(self._summary())

    def close(self) -> None:
        """The run ended (or never started): a last line in plain mode; the bar stops in rich mode."""
        if self._closed:
            return
        self._closed = True
        if self.mode == "rich" and self._bar is not None:
            if self._t_run is not None:
                self._bar.update(self._task, completed=self._done, extra=self._extra())
            self._bar.stop()
        elif self.mode == "plain" and self._t_run is not None:
            self._line(self._summary())

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers

    def _due(self) -> bool:
        now = self._clock()
        if now < self._next_line:
            return False
        self._next_line = now + self.every
        return True

    def _since(self, t: float) -> str:
        return f"{self._clock() - t:.1f} s"

    def _extra(self) -> str:
        seconds = self._clock() - self._t_run if self._t_run is not None else 0.0
        return f"{self._failed} failed  {_size(self._bytes)}  {_rate(self._bytes, seconds)}"

    def _summary(self) -> str:
        of = f"/{self._total}" if self._total is not None else ""
        seconds = self._clock() - (self._t_run or self._clock())
        return (f"{self.name}: {self._done}{of} {self.unit} done, {self._failed} failed, {_size(self._bytes)}, "
                f"{_rate(self._bytes, seconds)}, {seconds:.1f} s")

    def _line(self, text: str) -> None:
        print(text, file=self._stream, flush=True)
