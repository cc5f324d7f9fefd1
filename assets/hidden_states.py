"""`hidden_states[shard]`: the multi-day GPU stage, made resumable.

Each shard is one partition, so a 70-hour extraction is a series of partition runs that declarative
automation keeps requesting (assets/automation.py); the engine's manifest makes a retried run resume. A shard
run reads the plan extraction_plan wrote (an input) and refuses one that does not fit or was made for another
merged_train. Per shard, two blocking checks (bytes as planned, checksums as in the manifest) keep a bad shard
from reaching training, and the shard's data version is its manifest checksum.
"""

import hashlib
import json

import dagster as dg
from pydantic import Field

from assets._common import GPU_POOL, layout, materialize_result, progress_logger, run_tags, silenced_warnings, tag_run
from assets.automation import shard_automation_condition
from assets.extraction_plan import plan_path_of, refuse_stale_plan, refuse_unfit_plan
from assets.partitions import HIDDEN_STATE_SHARDS
from assets.settings import gating_inputs, with_stage_settings
from eagle3_dagster.config import Profile
from eagle3_dagster.stages.hidden import ExtractSettings
from resources.gpu_host import GpuHostResource
from resources.profile import ProfileResource
from resources.upstream import UPSTREAM, Materialized

GROUP = "hidden_states"
BYTES_CHECK = "bytes_match_plan"
MANIFEST_CHECK = "manifest_checksums"


class HiddenStatesConfig(dg.Config):
    """The launchpad's switches for a shard run (automation's runs take the defaults)."""

    force: bool = Field(
        default=False,
        description="Extract the selected shards again even when their manifest says they are complete (a "
        "suspect host, a changed backend). Each new shard is written to a temporary file and renamed over the "
        "old one; its manifest entry is removed first and written again last, so no reader sees a half-written "
        "shard as complete. The metadata key `forced` records it.",
    )


# Partitioned checks (Preview in 1.13): each verdict belongs to its shard, and blocks only that shard.
with silenced_warnings(dg.PreviewWarning, "Specifying a partitions_def on an AssetCheckSpec"):
    SHARD_CHECKS = [
        dg.AssetCheckSpec(
            BYTES_CHECK,
            asset="hidden_states",
            blocking=True,
            partitions_def=HIDDEN_STATE_SHARDS,
            description="bytes written equal the plan's prediction for this shard",
        ),
        dg.AssetCheckSpec(
            MANIFEST_CHECK,
            asset="hidden_states",
            blocking=True,
            partitions_def=HIDDEN_STATE_SHARDS,
            description="the shard's bytes match its manifest checksum",
        ),
    ]


@dg.asset(
    group_name=GROUP,
    partitions_def=HIDDEN_STATE_SHARDS,
    ins={
        "plan": dg.AssetIn("extraction_plan", input_manager_key=UPSTREAM),
        "merged_train": dg.AssetIn("merged_train", input_manager_key=UPSTREAM),
    },
    deps=["target_model"],
    pool=GPU_POOL,
    kinds={"safetensors"},
    check_specs=SHARD_CHECKS,
    metadata=gating_inputs(
        extraction_plan="the shards' content is merged_train's and their own settings; the plan "
        "names them and its disk verdict must pass, its hours are not in them"
    ),
)
def hidden_states(
    context: dg.AssetExecutionContext,
    config: HiddenStatesConfig,
    profile: ProfileResource,
    gpu_host: GpuHostResource,
    plan: Materialized,
    merged_train: Materialized,
) -> dg.MaterializeResult:
    from eagle3_dagster.hidden.shards import load_manifest
    from eagle3_dagster.stages.hidden import extract_stage, extraction_preflight, free_space_location

    loaded = profile.get()
    settings = ExtractSettings.from_profile(loaded)
    tag_run(context, loaded, "hidden_states")
    plan_path = plan_path_of(plan)
    refuse_unfit_plan(plan, str(layout(loaded).hidden_root))
    refuse_stale_plan(plan, merged_train)
    keys = list(context.partition_keys)
    reports: list[dict] = []  # the leased host's preflight, handed on so it is not probed twice

    def preflight(host) -> None:
        reports.append(extraction_preflight(settings, host, free_space_location(layout(loaded))))

    with gpu_host.lease(context, preflight=preflight, shards=keys) as host:
        report, checks = extract_stage(
            settings,
            plan_path,
            keys,
            gpu_host=host,
            host_report=reports[-1],
            force=config.force,
            progress=progress_logger(context),
        )
    report.metadata["gpu_host"] = host.name
    results = [
        dg.AssetCheckResult(
            check_name=name,
            passed=passed,
            severity=dg.AssetCheckSeverity.ERROR,
            description=detail,
            metadata=_check_numbers(name, detail, report.metadata),
        )
        for name, (passed, detail) in checks.items()
    ]
    manifest = load_manifest(report.metadata["version_dir"])
    sums = {k: manifest[k]["sha256"] for k in keys if k in manifest}
    report.metadata["shard_sha256"] = sums
    # One partition per run (no backfill policy): the data version is that shard's checksum.
    version = (
        sums[keys[0]]
        if len(keys) == 1 and keys[0] in sums
        else hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()
    )
    return materialize_result(context, report, data_version=version, check_results=results)


def for_profile(profile: Profile) -> dg.AssetsDefinition:
    """The profile's automation (how many shards per tick, how often) and run tags, and its backend named."""
    hidden = profile.hidden
    asset = with_stage_settings(
        hidden_states,
        ExtractSettings.from_profile(profile),
        automation_condition=shard_automation_condition(hidden.backfill_batch, hidden.backfill_cron),
        description=f"Aux + last hidden states for each sample of merged_train, one partition per shard "
        f"({hidden.backend} backend). Resumes from the manifest when retried: a shard complete in its "
        f"manifest is skipped unless the run config sets `force: true`, which extracts the selected shards again "
        f"and replaces each whole (metadata `forced`). Requested by automation "
        f"when missing or failed, at most {hidden.backfill_batch} per tick of {hidden.backfill_cron}. "
        "Which shards are stale, missing or failed: the check `partitions_current` and its table `not_current` "
        "(Dagster's partition views show no staleness).",
    )
    tags = dg.MetadataValue.json(run_tags(profile, "hidden_states"))
    return asset.map_asset_specs(lambda spec: spec.replace_attributes(metadata={**spec.metadata, "run_tags": tags}))


def _check_numbers(name: str, detail: str, meta: dict) -> dict:
    out: dict = {"shards": ", ".join(meta.get("shards", []))}
    if name == BYTES_CHECK:
        out["bytes_written"] = meta.get("bytes_written")
    return {k: v for k, v in out.items() if v is not None}
