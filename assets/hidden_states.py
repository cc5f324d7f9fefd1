"""`extraction_plan` and `hidden_states[shard]`: the multi-day GPU stage, made resumable.

The plan predicts the exact bytes and the hours, and its blocking check stops
extraction that would not fit on the disk. Each shard is one partition, so a
70-hour extraction is a series of partition runs that the backfill schedule
keeps feeding; the engine's manifest makes a retried run resume, and a check
compares the bytes written with the plan's prediction.
"""


import dagster as dg

from assets._common import GPU_POOL, code_version, layout, materialize_result, progress_logger, tag_run
from assets.partitions import HIDDEN_STATE_SHARDS
from eagle3_dagster.config import Profile

GROUP = "hidden_states"
FITS_CHECK = "fits_on_disk"
BYTES_CHECK = "bytes_match_plan"
MANIFEST_CHECK = "manifest_checksums"


def build(profile: Profile) -> list:
    @dg.asset(
        name="extraction_plan",
        group_name=GROUP,
        deps=["merged_train", "target_model"],
        code_version=code_version(profile, "hidden"),
        required_resource_keys={"gpu_host"},
        check_specs=[dg.AssetCheckSpec(FITS_CHECK, asset="extraction_plan", blocking=True,
                                       description="the shards fit in the free space where they go")],
        description="Exact bytes and estimated hours of extraction for the current merged_train, free space "
        "where the shards go, and every superseded hidden-state version with its size.",
    )
    def extraction_plan(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        from eagle3_dagster.stages.hidden import plan_stage

        tag_run(context, profile)
        free = context.resources.gpu_host.free_bytes(str(layout(profile).hidden_root))
        report, fits, message = plan_stage(profile, layout(profile), free_bytes=free)
        check = dg.AssetCheckResult(
            check_name=FITS_CHECK,
            passed=fits,
            severity=dg.AssetCheckSeverity.ERROR,
            description=message,
            metadata={"message": message},
        )
        return materialize_result(report, check_results=[check])

    @dg.asset(
        name="hidden_states",
        group_name=GROUP,
        partitions_def=HIDDEN_STATE_SHARDS,
        deps=["merged_train", "extraction_plan", "target_model"],
        code_version=code_version(profile, "hidden", "gpu_host"),
        pool=GPU_POOL,
        kinds={"safetensors"},
        required_resource_keys={"gpu_host"},
        check_specs=[
            dg.AssetCheckSpec(BYTES_CHECK, asset="hidden_states",
                              description="bytes written equal the plan's prediction for these shards"),
            dg.AssetCheckSpec(MANIFEST_CHECK, asset="hidden_states",
                              description="every written shard matches its manifest checksum"),
        ],
        description=f"Aux + last hidden states for each sample of merged_train, one partition per shard "
        f"({profile.hidden.backend} backend). Resumes from the manifest when retried.",
    )
    def hidden_states(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        from eagle3_dagster.stages.hidden import extract_stage

        tag_run(context, profile)
        _require_plan_fits(context)
        keys = list(context.partition_keys)
        report, checks = extract_stage(
            profile, layout(profile), keys, gpu_host=context.resources.gpu_host.host(), progress=progress_logger(context)
        )
        results = [
            dg.AssetCheckResult(check_name=name, passed=passed, metadata={"detail": detail})
            for name, (passed, detail) in checks.items()
        ]
        return materialize_result(report, check_results=results)

    @dg.op(
        name="cleanup_superseded_hidden_states",
        required_resource_keys={"gpu_host"},
        description="Delete hidden-state versions other than the current one. Dry run unless dry_run=false.",
    )
    def cleanup_op(context: dg.OpExecutionContext, config: CleanupConfig) -> None:
        from eagle3_dagster.stages.hidden import cleanup_stage

        tag_run(context, profile)
        report = cleanup_stage(profile, layout(profile), dry_run=config.dry_run, log=context.log.info)
        context.log_event(
            dg.AssetObservation(asset_key="extraction_plan", metadata=report.metadata | {"dry_run": config.dry_run})
        )

    @dg.job(name="cleanup_hidden_states", tags={"eagle3/profile": profile.profile})
    def cleanup_job():
        cleanup_op()

    return [extraction_plan, hidden_states, cleanup_job]


class CleanupConfig(dg.Config):
    dry_run: bool = True


def _require_plan_fits(context: dg.AssetExecutionContext) -> None:
    """Partition runs are separate from the plan's run, so the blocking check is re-read here."""
    record = context.instance.get_latest_asset_check_evaluation_record(
        dg.AssetCheckKey(dg.AssetKey("extraction_plan"), FITS_CHECK)
    )
    if record is None or record.status.value != "FAILED":
        return
    evaluation = record.event.asset_check_evaluation if record.event else None
    detail = (evaluation.description if evaluation else None) or ""
    raise dg.Failure(
        description=f"extraction_plan's {FITS_CHECK} check failed: {detail} "
        "Free space (job cleanup_hidden_states) and materialize extraction_plan again."
    )
