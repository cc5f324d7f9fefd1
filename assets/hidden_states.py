"""`extraction_plan` and `hidden_states[shard]`: the multi-day GPU stage, made resumable.

The plan predicts the exact bytes and the hours, and its blocking check stops
extraction that would not fit on the disk. Each shard is one partition, so a
70-hour extraction is a series of partition runs that declarative automation
keeps requesting (assets/automation.py); the engine's manifest makes a retried
run resume. Per shard, two blocking checks (bytes as planned, checksums as in
the manifest) keep a bad shard from reaching training, and the shard's data
version is its manifest checksum.
"""

import hashlib
import json

import dagster as dg
from pydantic import Field

from assets._common import GPU_POOL, accepted, layout, materialize_result, progress_logger, run_tags, tag_run
from assets.automation import shard_automation_condition
from assets.partitions import HIDDEN_STATE_SHARDS
from assets.settings import gating_inputs, stage_settings_metadata
from eagle3_dagster import storage
from eagle3_dagster.config import Profile
from eagle3_dagster.contracts import PLAN_PATH_KEY
from eagle3_dagster.stages.hidden import ExtractSettings, PlanSettings, ShardSettings
from resources.upstream import UPSTREAM, Materialized, upstream_in

GROUP = "hidden_states"
FITS_CHECK = "fits_on_disk"
BYTES_CHECK = "bytes_match_plan"
MANIFEST_CHECK = "manifest_checksums"


def build(profile: Profile) -> dg.Definitions:
    plan_settings, extract_settings = PlanSettings.from_profile(profile), ExtractSettings.from_profile(profile)

    @dg.asset(
        name="extraction_plan",
        group_name=GROUP,
        deps=["merged_train", "target_model"],
        required_resource_keys={"gpu_host"},
        metadata=stage_settings_metadata(plan_settings),
        check_specs=[dg.AssetCheckSpec(FITS_CHECK, asset="extraction_plan", blocking=True,
                                       description="the shards of this hidden-state version fit in the free "
                                       "space under hidden.root")],
        description="Exact bytes and estimated hours of extraction for the current merged_train, free space "
        "where the shards go, and every superseded hidden-state version with its size.",
    )
    def extraction_plan(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        from eagle3_dagster.stages.hidden import free_space_location, plan_stage

        tag_run(context, profile)
        root = layout(profile).hidden_root
        free = context.resources.gpu_host.free_bytes(str(free_space_location(layout(profile))))
        report, fits, message = plan_stage(plan_settings, layout(profile), free_bytes=free)
        meta = report.metadata
        check = dg.AssetCheckResult(
            check_name=FITS_CHECK,
            passed=fits,
            severity=dg.AssetCheckSeverity.ERROR,
            description=message,
            # version and root say which extraction this verdict is about: a shard run checks them
            metadata={"version": meta["version"], "hidden_root": str(root), "free_bytes": meta["free_bytes"],
                      "remaining_bytes": meta["remaining_bytes"], "total_bytes": meta["total_bytes"]},
        )
        # The plan's content: what would be written where; free space is a reading, not content.
        content = {k: meta[k] for k in ("version", "num_shards", "num_samples", "num_tokens", "total_bytes")}
        content["hidden_root"] = str(root)
        version = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
        return materialize_result(context, report, data_version=version, check_results=[check])

    # Partitioned checks (Preview in 1.13): each verdict belongs to its shard, and blocks only that shard.
    with accepted(dg.PreviewWarning, "Specifying a partitions_def on an AssetCheckSpec"):
        shard_checks = [
            dg.AssetCheckSpec(BYTES_CHECK, asset="hidden_states", blocking=True, partitions_def=HIDDEN_STATE_SHARDS,
                              description="bytes written equal the plan's prediction for this shard"),
            dg.AssetCheckSpec(MANIFEST_CHECK, asset="hidden_states", blocking=True,
                              partitions_def=HIDDEN_STATE_SHARDS, description="the shard's bytes match its manifest "
                              "checksum"),
        ]

    @dg.asset(
        name="hidden_states",
        group_name=GROUP,
        partitions_def=HIDDEN_STATE_SHARDS,
        ins={"plan": dg.AssetIn("extraction_plan", input_manager_key=UPSTREAM),
             "merged_train": dg.AssetIn("merged_train", input_manager_key=UPSTREAM)},
        deps=["target_model"],
        pool=GPU_POOL,
        kinds={"safetensors"},
        required_resource_keys={"gpu_host"},
        check_specs=shard_checks,
        automation_condition=shard_automation_condition(profile.hidden.backfill_batch, profile.hidden.backfill_cron),
        metadata={"run_tags": dg.MetadataValue.json(run_tags(profile, "hidden_states")),
                  **stage_settings_metadata(extract_settings),
                  **gating_inputs(extraction_plan="the shards' content is merged_train's and their own settings; "
                                  "the plan names them and its disk verdict must pass, its hours are not in them")},
        description=f"Aux + last hidden states for each sample of merged_train, one partition per shard "
        f"({profile.hidden.backend} backend). Resumes from the manifest when retried: a shard complete in its "
        f"manifest is skipped unless the run config sets `force: true`, which extracts the selected shards again "
        f"and replaces each whole (metadata `forced`). Requested by automation "
        f"when missing or failed, at most {profile.hidden.backfill_batch} per tick of {profile.hidden.backfill_cron}. "
        "Which shards are stale, missing or failed: the check `shards_current` and its table `not_current` "
        "(Dagster's partition views show no staleness).",
    )
    def hidden_states(context: dg.AssetExecutionContext, config: HiddenStatesConfig, plan: Materialized,
                      merged_train: Materialized) -> dg.MaterializeResult:
        from eagle3_dagster.hidden.shards import load_manifest
        from eagle3_dagster.stages.hidden import extract_stage, extraction_preflight, free_space_location

        tag_run(context, profile, "hidden_states")
        plan_path = plan_path_of(plan)
        refuse_unfit_plan(plan, str(layout(profile).hidden_root))
        refuse_stale_plan(plan, merged_train)
        keys = list(context.partition_keys)
        reports: list[dict] = []  # the leased host's preflight, handed on so it is not probed twice

        def preflight(host) -> None:
            reports.append(extraction_preflight(extract_settings, host, free_space_location(layout(profile))))

        with context.resources.gpu_host.lease(context, preflight=preflight, shards=keys) as host:
            report, checks = extract_stage(extract_settings, plan_path, keys, gpu_host=host, host_report=reports[-1],
                                           force=config.force, progress=progress_logger(context))
        report.metadata["gpu_host"] = host.name
        results = [
            dg.AssetCheckResult(check_name=name, passed=passed, severity=dg.AssetCheckSeverity.ERROR,
                                description=detail, metadata=_check_numbers(name, detail, report.metadata))
            for name, (passed, detail) in checks.items()
        ]
        manifest = load_manifest(report.metadata["version_dir"])
        sums = {k: manifest[k]["sha256"] for k in keys if k in manifest}
        report.metadata["shard_sha256"] = sums
        # One partition per run (no backfill policy): the data version is that shard's checksum.
        version = sums[keys[0]] if len(keys) == 1 and keys[0] in sums else \
            hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()
        return materialize_result(context, report, data_version=version, check_results=results)

    @dg.op(
        name="cleanup_superseded_hidden_states",
        required_resource_keys={"gpu_host"},
        ins={"plan": upstream_in("extraction_plan")},
        description="Delete hidden-state versions other than the current one. Dry run unless dry_run=false.",
    )
    def cleanup_op(context: dg.OpExecutionContext, config: CleanupConfig, plan: Materialized) -> None:
        from eagle3_dagster.stages.hidden import cleanup_stage

        tag_run(context, profile)
        report = cleanup_stage(ShardSettings.from_profile(profile), layout(profile), dry_run=config.dry_run,
                               log=context.log.info, plan_path=plan_path_of(plan))
        context.log_event(
            dg.AssetObservation(asset_key="extraction_plan", metadata=report.metadata | {"dry_run": config.dry_run})
        )

    @dg.job(name="cleanup_hidden_states", tags=run_tags(profile))
    def cleanup_job():
        cleanup_op()

    return dg.Definitions(assets=[extraction_plan, hidden_states], jobs=[cleanup_job])


class HiddenStatesConfig(dg.Config):
    """The launchpad's switches for a shard run (automation's runs take the defaults)."""

    force: bool = Field(
        default=False,
        description="Extract the selected shards again even when their manifest says they are complete (a "
        "suspect host, a changed backend). Each new shard is written to a temporary file and renamed over the "
        "old one; its manifest entry is removed first and written again last, so no reader sees a half-written "
        "shard as complete. The metadata key `forced` records it.",
    )


class CleanupConfig(dg.Config):
    dry_run: bool = True


def _check_numbers(name: str, detail: str, meta: dict) -> dict:
    out: dict = {"shards": ", ".join(meta.get("shards", []))}
    if name == BYTES_CHECK:
        out["bytes_written"] = meta.get("bytes_written")
    return {k: v for k, v in out.items() if v is not None}


def plan_path_of(plan: Materialized) -> str:
    """The plan file extraction_plan's latest materialization wrote (later stages read it, never recompute it)."""
    path = plan.path(PLAN_PATH_KEY)
    if path is None:
        raise dg.Failure(description="extraction_plan has no materialization with a plan path: materialize "
                         "extraction_plan first.")
    return path


def refuse_stale_plan(plan: Materialized, merged_train: Materialized) -> None:
    """Refuse a plan made for another merged_train than the latest one (its data version is its sha256)."""
    planned, latest = plan.metadata.get("merged_train_sha256"), merged_train.data_version
    if latest is not None and planned is not None and latest != planned:
        raise dg.Failure(description=f"plan mismatch: extraction_plan was made for merged_train {planned[:12]}, "
                         f"the latest merged_train is {latest[:12]}; materialize extraction_plan again.")


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
