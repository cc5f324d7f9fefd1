"""`extraction_plan`: what extraction will write, where, and whether it fits.

The plan predicts the exact bytes and the hours, and its blocking check stops extraction that would not fit on
the disk. Its plan file is what every later stage reads (shard runs, training, cleanup): they take
extraction_plan as an input (`resources.upstream`), and `plan_path_of`, `refuse_unfit_plan` and
`refuse_stale_plan` say what they require of it.
"""

import hashlib
import json

import dagster as dg

from assets._common import layout, materialize_result, tag_run
from assets.settings import with_stage_settings
from eagle3_dagster import storage
from eagle3_dagster.config import Profile
from eagle3_dagster.contracts import PLAN_PATH_KEY
from eagle3_dagster.stages.hidden import PlanSettings
from resources.gpu_host import GpuHostResource
from resources.profile import ProfileResource
from resources.upstream import Materialized

GROUP = "hidden_states"
FITS_CHECK = "fits_on_disk"


@dg.asset(
    group_name=GROUP,
    deps=["merged_train", "target_model"],
    check_specs=[
        dg.AssetCheckSpec(
            FITS_CHECK,
            asset="extraction_plan",
            blocking=True,
            description="the shards of this hidden-state version fit in the free space under hidden.root",
        )
    ],
    description="Exact bytes and estimated hours of extraction for the current merged_train, free space "
    "where the shards go, and every superseded hidden-state version with its size.",
)
def extraction_plan(
    context: dg.AssetExecutionContext, profile: ProfileResource, gpu_host: GpuHostResource
) -> dg.MaterializeResult:
    from eagle3_dagster.stages.hidden import free_space_location, plan_stage

    loaded = profile.get()
    tag_run(context, loaded)
    root = layout(loaded).hidden_root
    free = gpu_host.free_bytes(str(free_space_location(layout(loaded))))
    report, fits, message = plan_stage(PlanSettings.from_profile(loaded), layout(loaded), free_bytes=free)
    meta = report.metadata
    check = dg.AssetCheckResult(
        check_name=FITS_CHECK,
        passed=fits,
        severity=dg.AssetCheckSeverity.ERROR,
        description=message,
        # version and root say which extraction this verdict is about
        metadata={
            "version": meta["version"],
            "hidden_root": str(root),
            "free_bytes": meta["free_bytes"],
            "remaining_bytes": meta["remaining_bytes"],
            "total_bytes": meta["total_bytes"],
        },
    )
    # The plan's content: what would be written where; free space is a reading, not content.
    content = {k: meta[k] for k in ("version", "num_shards", "num_samples", "num_tokens", "total_bytes")}
    content["hidden_root"] = str(root)
    version = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    return materialize_result(context, report, data_version=version, check_results=[check])


def for_profile(profile: Profile) -> dg.AssetsDefinition:
    return with_stage_settings(extraction_plan, PlanSettings.from_profile(profile))


def plan_path_of(plan: Materialized) -> str:
    """The plan file extraction_plan's latest materialization wrote (later stages read it, never recompute it)."""
    path = plan.path(PLAN_PATH_KEY)
    if path is None:
        raise dg.Failure(
            description="extraction_plan has no materialization with a plan path: materialize extraction_plan first."
        )
    return path


def refuse_stale_plan(plan: Materialized, merged_train: Materialized) -> None:
    """Refuse a plan made for another merged_train than the latest one (its data version is its sha256)."""
    planned, latest = plan.metadata.get("merged_train_sha256"), merged_train.data_version
    if latest is not None and planned is not None and latest != planned:
        raise dg.Failure(
            description=f"plan mismatch: extraction_plan was made for merged_train {planned[:12]}, "
            f"the latest merged_train is {latest[:12]}; materialize extraction_plan again."
        )


def refuse_unfit_plan(plan: Materialized, hidden_root: str) -> None:
    """Refuse to extract unless the plan's disk verdict passed for the root this run writes under.

    The verdict is the plan materialization's own (`fits`, what its blocking fits_on_disk check reported in
    the same step), so it is about this very plan. Automation's condition (`all_deps_blocking_checks_passed`)
    gates only the runs automation requests; a shard launched from the UI or a job meets this refusal.
    """
    meta = plan.metadata
    version, version_dir = meta.get("version"), meta.get("version_dir")
    writes = str(storage.location(hidden_root).join(str(version)))
    if version_dir is not None and str(version_dir) != writes:
        raise dg.Failure(
            description=f"plan mismatch: extraction_plan's {FITS_CHECK} was evaluated for {version_dir}, but this "
            f"run writes {writes}. Materialize extraction_plan again so the disk check covers what this run writes."
        )
    if meta.get("fits") is not True:
        raise dg.Failure(
            description=f"extraction_plan's {FITS_CHECK} check failed: {meta.get('needed_bytes')} bytes needed, "
            f"{meta.get('free_bytes')} free at {meta.get('free_at')}. Free space (job cleanup_hidden_states) and "
            "materialize extraction_plan again."
        )
