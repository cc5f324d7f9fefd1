"""Stage entry points: one function per asset, taking the validated profile and explicit paths.

These are the seam between orchestration and the engine. Each picks the engine
pieces a profile asks for (which backend, which source), runs them and returns a
`StageReport` the asset layer turns into Dagster metadata. They never import
Dagster, so the same stages run from the `eagle3` command line and in tests.

Progress lines follow `eagle3_dagster.progress` (re-exported here for the stages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_dagster.progress import PROGRESS_EVERY_S, Progress, ProgressMeter, format_duration, no_progress

__all__ = ["PROGRESS_EVERY_S", "Progress", "ProgressMeter", "StageReport", "format_duration", "no_progress"]


@dataclass
class StageReport:
    metadata: dict[str, Any] = field(default_factory=dict)  # plain values, dicts/lists (json), Paths
    images: dict[str, Path] = field(default_factory=dict)  # PNG files shown in the UI
    markdown: dict[str, str] = field(default_factory=dict)
    # name → (values, what the x axis is): drawn as an inline sparkline on the asset page, where the
    # PNGs in `images` sit behind "Show Markdown" (Dagster renders markdown inline below 1,000 characters)
    series: dict[str, tuple[list[float], str]] = field(default_factory=dict)
    data_version: str | None = None


