"""What every asset module shares: the profile tag, progress forwarding, picture metadata.

Assets stay thin: they read config and partitions, call one engine function and
turn its report into Dagster metadata. The helpers here are the glue that would
otherwise be repeated in each module.
"""


import base64
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import dagster as dg

from eagle3_dagster.config import Profile
from eagle3_dagster.contracts import ArtifactLayout
from eagle3_dagster.stages import StageReport

PROFILE_TAG = "eagle3/profile"
GPU_POOL = "gpu_host"
CODE_VERSION = "1"


def code_version(profile: Profile, *sections: str) -> str:
    """The code version plus a fingerprint of the config sections the asset reads: editing one of them
    marks the asset (and, through data versions, everything downstream) stale in the UI."""
    return f"{CODE_VERSION}-{profile.fingerprint(*sections)}"


def tag_run(context: dg.AssetExecutionContext | dg.OpExecutionContext, profile: Profile) -> None:
    """Put the profile on the run itself, so that runs launched from the UI carry it too."""
    try:
        if context.run.tags.get(PROFILE_TAG) != profile.profile:
            context.instance.add_run_tags(context.run_id, {PROFILE_TAG: profile.profile})
    except Exception as e:  # an ephemeral test instance may not support tags on an in-memory run
        context.log.debug(f"could not tag run with the profile: {e}")


def layout(profile: Profile) -> ArtifactLayout:
    return ArtifactLayout.from_profile(profile)


def progress_logger(context, every_s: float = 5.0) -> Callable[[str], None]:
    """Engine progress lines → the run log, at most one every `every_s` seconds (the last one always)."""
    last = [0.0]

    def log(line: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - last[0] >= every_s:
            last[0] = now
            context.log.info(line)

    return log


def png_markdown(png: bytes | Path, alt: str) -> str:
    """A picture inside Markdown metadata: Dagster has no image metadata type, a data URI renders."""
    data = png.read_bytes() if isinstance(png, Path) else png
    return f"![{alt}](data:image/png;base64,{base64.b64encode(data).decode()})"


def md_table(rows: list[Mapping[str, Any]]) -> str:
    if not rows:
        return "_(none)_"
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def path_meta(path: Path) -> dg.MetadataValue:
    return dg.MetadataValue.path(str(path))


def report_metadata(report: StageReport) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for k, v in report.metadata.items():
        if isinstance(v, Path):
            meta[k] = dg.MetadataValue.path(str(v))
        elif isinstance(v, (dict, list, tuple)):
            meta[k] = dg.MetadataValue.json(v)
        elif v is None:
            meta[k] = dg.MetadataValue.null()
        else:
            meta[k] = v
    for k, text in report.markdown.items():
        meta[k] = dg.MetadataValue.md(text)
    for k, png in report.images.items():
        if Path(png).exists():
            meta[k] = dg.MetadataValue.md(png_markdown(Path(png), k))
    return meta


def materialize_result(report: StageReport, **kwargs: Any) -> dg.MaterializeResult:
    version = dg.DataVersion(report.data_version) if report.data_version else None
    return dg.MaterializeResult(metadata=report_metadata(report), data_version=version, **kwargs)
