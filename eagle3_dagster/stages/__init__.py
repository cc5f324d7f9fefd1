"""Stage entry points: one function per asset, taking its settings (`stages.settings`) and explicit paths.

These are the seam between orchestration and the engine. Each takes the settings it
reads as one typed dataclass built from the profile (`XSettings.from_profile`), whose
content is what its asset's code version hashes; it picks the engine pieces those
settings ask for (which backend, which source), runs them and returns a
`StageReport` the asset layer turns into Dagster metadata. They never import
Dagster, so the same stages run from the `eagle3` command line and in tests.

Progress lines follow `eagle3_dagster.progress` (re-exported here for the stages).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from eagle3_dagster.progress import PROGRESS_EVERY_S, Progress, ProgressMeter, format_duration, no_progress

__all__ = [
    "PROGRESS_EVERY_S",
    "Progress",
    "ProgressMeter",
    "StageReport",
    "StageSettings",
    "TargetFiles",
    "format_duration",
    "group",
    "no_progress",
    "setting",
]


@dataclass
class StageReport:
    metadata: dict[str, Any] = field(default_factory=dict)  # plain values, dicts/lists (json), Paths
    images: dict[str, Path] = field(default_factory=dict)  # PNG files shown in the UI
    markdown: dict[str, str] = field(default_factory=dict)
    # name → (values, what the x axis is): drawn as an inline sparkline on the asset page, where the
    # PNGs in `images` sit behind "Show Markdown" (Dagster renders markdown inline below 1,000 characters)
    series: dict[str, tuple[list[float], str]] = field(default_factory=dict)
    data_version: str | None = None


# What a stage is given from the profile: one frozen dataclass per stage, each field naming its setting.
#
# A stage takes its settings as a typed argument (torchtitan hands each builder its section; here a section is
# cut to what the stage reads, so that an edit to a setting it does not read invalidates nothing). Each field
# says which profile setting it is read from (`setting("data.max_seq_len")`): that field, beside the schema in
# `config.py`, is the one place a setting is declared for a stage. `from_profile` builds the dataclass, and the
# Dagster layer hashes `content()` into the asset's code version, so what a code version covers is derived from
# what the stage is given, never listed a second time by hand.
#
# A field that does not change what the stage writes (where it runs, how fast, how much it may spend, a
# refusal) is declared with `runs_with=` and the reason; it is left out of `content()`, so editing it
# invalidates nothing. A stage that comes to read a setting it is not given fails where it reads it (an
# `AttributeError` naming the field, and the type checker's error before that), in every test that runs it.

_PATH = "eagle3/setting"
_RUNS_WITH = "eagle3/runs_with"

S = TypeVar("S", bound="StageSettings")


def setting(path: str, *, runs_with: str | None = None) -> Any:
    """A field read from the profile at `path` (dotted); `runs_with`: why it does not change the stage's output."""
    return dataclasses.field(metadata={_PATH: path, _RUNS_WITH: runs_with})


def group(*, runs_with: str | None = None) -> Any:
    """A field that is itself a `StageSettings` (settings several stages are given together, `TargetFiles`)."""
    return dataclasses.field(metadata={_RUNS_WITH: runs_with})


@dataclasses.dataclass(frozen=True)
class StageSettings:
    """Base of every stage's settings: built from a profile, hashed by what it holds."""

    @classmethod
    def from_profile(cls: type[S], profile: Any) -> S:
        hints = typing.get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if isinstance(kind, type) and issubclass(kind, StageSettings):
                values[f.name] = kind.from_profile(profile)
            else:
                values[f.name] = _read(profile, f.metadata[_PATH])
        return cls(**values)

    def content(self) -> dict[str, Any]:
        """Setting path → value (JSON) of every field that changes what the stage writes: what the code version
        of the stage's asset hashes."""
        return dict(self._values(content_only=True))

    def settings(self) -> dict[str, Any]:
        """Setting path → value (JSON) of every field, those the stage only runs with included."""
        return dict(self._values(content_only=False))

    def _values(self, *, content_only: bool):
        for f in dataclasses.fields(self):
            if content_only and f.metadata.get(_RUNS_WITH):
                continue
            value = getattr(self, f.name)
            if isinstance(value, StageSettings):
                yield from value._values(content_only=content_only)
            else:
                yield f.metadata[_PATH], _json(value)


@dataclasses.dataclass(frozen=True)
class TargetFiles(StageSettings):
    """Where the target's files are, and whether its own code may run, and which: every stage that loads the
    target is given these. They do not change what a stage writes: the target's identity reaches a stage as
    target_model's data version, and a target whose files or code are not those allowed is refused, never
    loaded in their place."""

    kind: str = setting("target.kind")
    path: str | None = setting("target.path")
    trust_remote_code: bool = setting("target.trust_remote_code")
    reviewed_code: dict[str, str] | None = setting("target.reviewed_code")

    def model_dir(self, layout: Any) -> Path:
        """The target's folder: built under the run root (tiny) or the configured one (external)."""
        return layout.target_dir if self.kind == "tiny" else Path(str(self.path))


TARGET_FILES_RUN_WITH = "where the target's files are and which code may run; its identity is target_model's"


def _read(profile: Any, path: str) -> Any:
    value = profile
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _json(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [v.model_dump(mode="json") if hasattr(v, "model_dump") else v for v in value]
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value
