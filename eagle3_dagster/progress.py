"""The one progress contract every long stage follows.

A stage is handed a line sink (`Progress`: the run log under Dagster, stdout on the
command line) and reports through a `ProgressMeter` on it, so every progress line
reads `label: done/total unit (pct), rate unit/s, ETA h:mm:ss`, at most one line
every few seconds (the first and the last always). Engine loops (extraction, the
torchrun worker, the benchmark) take it from here, not from the stages.
"""

from __future__ import annotations

import time
from typing import Callable

Progress = Callable[[str], None]
PROGRESS_EVERY_S = 5.0


def no_progress(_: str) -> None:
    pass


class ProgressMeter:
    """`meter(done, total)` → a throttled progress line on `sink` with rate and ETA.

    Callable as `(done, total)` so engine loops that count work (extraction's token count,
    an export's sample count) take it where they take a counter callback. `done` is cumulative.
    """

    def __init__(
        self,
        sink: Progress,
        label: str,
        unit: str,
        total: int | None = None,
        *,
        initial: int = 0,
        every_s: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sink, self.label, self.unit, self.total = sink, label, unit, total
        self.every_s, self.clock = every_s, clock
        self.started = clock()
        self.last_emit: float | None = None
        self.initial = self.done = initial  # work done before this process started (a resume) is not in the rate

    def __call__(self, done: int, total: int | None = None, note: str = "") -> None:
        self.update(done, total, note=note)

    def update(self, done: int, total: int | None = None, *, note: str = "", force: bool = False) -> None:
        self.done = done
        if total is not None:
            self.total = total
        now = self.clock()
        finished = self.total is not None and done >= self.total
        if force or finished or self.last_emit is None or now - self.last_emit >= self.every_s:
            self.last_emit = now
            self.sink(self.line(now, note))

    def line(self, now: float | None = None, note: str = "") -> str:
        elapsed = max((self.clock() if now is None else now) - self.started, 1e-9)
        rate = (self.done - self.initial) / elapsed
        if self.total:
            pct = 100.0 * self.done / self.total
            text = f"{self.label}: {self.done:,}/{self.total:,} {self.unit} ({pct:.1f}%)"
        else:
            text = f"{self.label}: {self.done:,} {self.unit}"
        text += f", {_rate(rate)} {self.unit}/s"
        if self.total:
            eta = (self.total - self.done) / rate if rate > 0 else None
            text += f", ETA {format_duration(eta)}"
        return text + (f", {note}" if note else "")


def _rate(rate: float) -> str:
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
