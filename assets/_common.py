"""What every asset module shares: run tags, progress forwarding, metadata (tables, pictures, rounding).

Assets stay thin: they read config and partitions, call one engine function and
turn its report into Dagster metadata. The helpers here are the glue that would
otherwise be repeated in each module.
"""

import base64
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg

from eagle3_dagster.config import Profile
from eagle3_dagster.contracts import ArtifactLayout
from eagle3_dagster.host_lease import GPU_POOL  # noqa: F401  (one slot per GPU host: `eagle3 pool-limits`)
from eagle3_dagster.stages import StageReport

# Who answers for these assets (Dagster shows owners in the catalog and on each asset page): put your team here.
OWNERS = ["team:eagle3"]
PROFILE_TAG = "eagle3/profile"
MAX_RUNTIME_TAG = "dagster/max_runtime"
# Every run executes its steps one after another in the run worker itself. Each job's steps form a chain (data:
# raw_responses -> tokenized_dataset; corpus; train -> report; a shard is one step), so Dagster's default, a
# spawned process per step, runs nothing in parallel and costs each step a Python start, Dagster's import and
# a load of this code location (~1.5 s of wall and more of CPU before any work; ~3 s per shard run measured
# on the two-host test). A GPU step's child is stopped with the process that launched it either way
# (`eagle3_dagster.gpu_host`: its watchdog reads EOF when that process dies; tests/e2e/test_pool_and_crash.py).
EXECUTOR = dg.in_process_executor


def run_tags(profile: Profile, asset: str | None = None) -> dict[str, str]:
    """The run tags an asset needs whichever way its run is launched (job, automation, UI, backfill)."""
    tags = {PROFILE_TAG: profile.profile}
    if asset == "hidden_states":
        tags[MAX_RUNTIME_TAG] = str(profile.hidden.max_runtime_s)
    return tags


def tag_run(
    context: dg.AssetExecutionContext | dg.OpExecutionContext, profile: Profile, asset: str | None = None
) -> None:
    """Put the asset's run tags on the run itself at its first step.

    Jobs and the automation sensor tag their runs when they are created; a run launched from an asset
    page or a backfill is the implicit `__ASSET_JOB`, which Dagster 1.13 gives no run tags, so the
    asset adds them here. Run monitoring re-reads `dagster/max_runtime` from the run record every
    poll, so the limit holds from the run's start. A tag the run already carries is kept.
    """
    missing = {k: v for k, v in run_tags(profile, asset).items() if k not in context.run.tags}
    if not missing:
        return
    context.instance.add_run_tags(context.run_id, missing)


@contextmanager
def silenced_warnings(category: type[Warning], *messages: str) -> Iterator[None]:
    """Silence the Beta/Preview warnings of a Dagster feature this project relies on, where they are raised.

    Dagster prints each at every load of the code location (twice under `dagster dev`); the feature is
    chosen knowingly, and the reason is beside each use. Any other warning still shows.
    """
    with warnings.catch_warnings():
        for message in messages:  # each the start of one warning's text
            warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        yield


def layout(profile: Profile) -> ArtifactLayout:
    return ArtifactLayout.from_profile(profile)


def progress_logger(context) -> Callable[[str], None]:
    """Engine progress lines → the run log. Throttling is the engine's (`ProgressMeter`), not the sink's."""
    return context.log.info


def png_markdown(png: bytes | Path, alt: str) -> str:
    """A picture inside Markdown metadata: Dagster has no image metadata type, a data URI renders."""
    data = png.read_bytes() if isinstance(png, Path) else png
    return f"![{alt}](data:image/png;base64,{base64.b64encode(data).decode()})"


def table(rows: list[Mapping[str, Any]], descriptions: Mapping[str, str] | None = None) -> dg.MetadataValue:
    """Rows → a Dagster table with a schema (numbers stay numbers, rounded), which the UI renders as a grid."""
    descriptions = descriptions or {}
    columns = list(dict.fromkeys(c for r in rows for c in r))
    schema = dg.TableSchema(
        columns=[
            dg.TableColumn(c, _column_type([r.get(c) for r in rows]), description=descriptions.get(c)) for c in columns
        ]
    )
    # Dagster requires every record to have every column; a missing value is None (shown empty).
    records = [dg.TableRecord({c: _cell(r.get(c)) for c in columns}) for r in rows]
    return dg.MetadataValue.table(records, schema=schema)


def _column_type(values: list[Any]) -> str:
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return "bool"
    if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return "int"
    if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return "float"
    return "string"


def _cell(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, float):
        return round_value(v)
    if isinstance(v, (str, int, bool)):
        return v
    return str(v)


def round_value(v: float) -> float:
    """Four significant digits below 1000 (a loss 4.3199), one decimal above (12345.7 tokens/s)."""
    if v != v or v in (float("inf"), float("-inf")):
        return v
    return round(v, 1) if abs(v) >= 1000 else float(f"{v:.4g}")


def rounded(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Metadata from elsewhere (a Pipes child) with its floats rounded like the stages' own."""
    out: dict[str, Any] = {}
    for k, v in meta.items():
        value = v.value if isinstance(v, dg.FloatMetadataValue) else v
        out[k] = dg.MetadataValue.float(round_value(value)) if isinstance(value, float) else v
    return out


def report_metadata(report: StageReport) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for k, v in report.metadata.items():
        if isinstance(v, dg.MetadataValue):  # already typed (some are tuples underneath)
            meta[k] = v
        elif isinstance(v, Path):
            meta[k] = dg.MetadataValue.path(str(v))
        elif isinstance(v, list) and v and all(isinstance(r, Mapping) for r in v):
            meta[k] = table(v)
        elif isinstance(v, (dict, list, tuple)):
            meta[k] = dg.MetadataValue.json(v)
        elif v is None:
            meta[k] = dg.MetadataValue.null()
        elif isinstance(v, float):
            meta[k] = dg.MetadataValue.float(round_value(v))
        else:
            meta[k] = v
    for k, text in report.markdown.items():
        meta[k] = dg.MetadataValue.md(text)
    for k, (values, x_axis) in report.series.items():
        if values:
            meta[k] = dg.MetadataValue.md(sparkline(values, x_axis))
    for k, png in report.images.items():
        if Path(png).exists():
            meta[k] = dg.MetadataValue.md(png_markdown(Path(png), k))
    return meta


SPARK_LEVELS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], x_axis: str, width: int = 48) -> str:
    """A series as one line of block characters between its first and last value, short enough (< 1,000
    characters) for Dagster's asset page to render inline; longer series are averaged into `width` buckets."""
    n = len(values)
    buckets = (
        [values[i * n // width : (i + 1) * n // width] for i in range(width)] if n > width else [[v] for v in values]
    )
    means = [sum(b) / len(b) for b in buckets if b]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    line = "".join(SPARK_LEVELS[min(len(SPARK_LEVELS) - 1, int((v - lo) / span * len(SPARK_LEVELS)))] for v in means)
    return (
        f"`{round_value(values[0])}` {line} `{round_value(values[-1])}` — {n:,} points by {x_axis}, "
        f"min {round_value(min(values))}, max {round_value(max(values))}"
    )


def materialize_result(
    context: dg.AssetExecutionContext, report: StageReport, *, data_version: str | None = None, **kwargs: Any
) -> dg.MaterializeResult:
    """The stage's report as metadata, the settings it was built with, and a data version from its content."""
    from assets.metadata_legend import LEGEND_KEY, legend
    from assets.settings import recorded_settings

    asset = context.asset_key.to_user_string()
    version = data_version or report.data_version
    if version is None:
        raise ValueError(
            f"{asset}: the stage reported no content version; every asset's data version must come from its content"
        )
    metadata = {**report_metadata(report), **recorded_settings(context)}
    metadata[LEGEND_KEY] = legend(asset, metadata)
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(version), **kwargs)


def file_version(path: Path) -> str:
    """A file's content version: its sha256 (the data version Dagster records and compares)."""
    from eagle3_dagster.io import sha256_file

    return sha256_file(path)
