"""Jobs, the shard backfill schedule and the shard-registering sensor.

A 70-hour extraction is hundreds of shard partitions. The sensor keeps the
partition set equal to the shards of the latest merged_train; the schedule asks
for the shards that are missing (never materialized since that merged_train, or
failed) and not already queued or running, a bounded batch per tick, so a host
that died is simply picked up at the next tick.
"""


import dagster as dg

from assets._common import PROFILE_TAG
from assets.partitions import HIDDEN_STATE_SHARDS
from eagle3_dagster.config import Profile

SHARD_KEY_FORMAT = "shard-{:05d}"
IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def shard_keys(num_shards: int) -> list[str]:
    return [SHARD_KEY_FORMAT.format(i) for i in range(num_shards)]


def build_jobs(profile: Profile) -> dict:
    tags = {PROFILE_TAG: profile.profile}
    gpu_tags = tags | {"dagster/max_runtime": str(profile.hidden.max_runtime_s)}
    jobs = {
        "data_job": dg.define_asset_job(
            "data_job", selection=["raw_responses", "tokenized_dataset"], tags=tags,
            description="Regenerate and tokenize one dataset partition.",
        ),
        "corpus_job": dg.define_asset_job(
            "corpus_job", selection=["merged_train", "vocab_mapping", "extraction_plan"], tags=tags,
            description="Merge and shuffle, build the draft vocabulary, plan the extraction.",
        ),
        "extract_job": dg.define_asset_job(
            "extract_job", selection=["hidden_states"], tags=gpu_tags,
            description="Extract hidden states for shard partitions (one GPU run at a time: pool gpu_host).",
        ),
        "train_job": dg.define_asset_job(
            "train_job", selection=["drafter_checkpoint", "benchmark_report"], tags=tags,
            description="Train the drafter with torchrun, export it, benchmark it.",
        ),
    }
    if profile.target.kind == "tiny":
        jobs["target_job"] = dg.define_asset_job("target_job", selection=["target_model"], tags=tags)
    return jobs


def missing_shards(instance: dg.DagsterInstance) -> list[str]:
    """Shard partitions with no materialization since the latest merged_train and no run in flight."""
    keys = instance.get_dynamic_partitions(HIDDEN_STATE_SHARDS.name)
    if not keys:
        return []
    merged = instance.get_latest_materialization_event(dg.AssetKey("merged_train"))
    after = merged.timestamp if merged else None
    done: set[str] = set()
    cursor = None
    while True:
        page = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("hidden_states"), after_timestamp=after),
            limit=1000, cursor=cursor,
        )
        done.update(r.partition_key for r in page.records if r.partition_key)
        if not page.has_more:
            break
        cursor = page.cursor
    in_flight = {
        run.tags.get("dagster/partition")
        for run in instance.get_runs(dg.RunsFilter(job_name="extract_job", statuses=IN_FLIGHT))
    }
    return [k for k in keys if k not in done and k not in in_flight]


def build_schedule(profile: Profile, extract_job) -> dg.ScheduleDefinition:
    batch = profile.hidden.backfill_batch

    @dg.schedule(
        name="hidden_states_backfill",
        job=extract_job,
        cron_schedule=profile.hidden.backfill_cron,
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description=f"Every tick, request up to {batch} hidden_states shards that are missing or failed.",
    )
    def hidden_states_backfill(context: dg.ScheduleEvaluationContext):
        todo = missing_shards(context.instance)
        if not todo:
            return dg.SkipReason("every hidden_states shard is materialized or in flight")
        tick = int(context.scheduled_execution_time.timestamp()) if context.scheduled_execution_time else 0
        return [
            dg.RunRequest(run_key=f"{key}@{tick}", partition_key=key, tags={PROFILE_TAG: profile.profile})
            for key in todo[:batch]
        ]

    return hidden_states_backfill


def build_sensor(profile: Profile) -> dg.SensorDefinition:
    @dg.asset_sensor(
        name="register_shard_partitions",
        asset_key=dg.AssetKey("merged_train"),
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=15,
        description="When merged_train materializes, make the hidden_states partitions equal its shards.",
    )
    def register_shard_partitions(context: dg.SensorEvaluationContext, asset_event: dg.EventLogEntry):
        meta = asset_event.asset_materialization.metadata if asset_event.asset_materialization else {}
        num = meta.get("num_shards")
        if num is None:
            return dg.SkipReason("merged_train materialization has no num_shards metadata")
        return shard_partition_requests(context.instance, int(num.value))

    return register_shard_partitions


def shard_partition_requests(instance: dg.DagsterInstance, num_shards: int) -> dg.SensorResult:
    wanted = shard_keys(num_shards)
    existing = set(instance.get_dynamic_partitions(HIDDEN_STATE_SHARDS.name))
    add = [k for k in wanted if k not in existing]
    drop = sorted(existing - set(wanted))
    requests = []
    if add:
        requests.append(HIDDEN_STATE_SHARDS.build_add_request(add))
    if drop:
        requests.append(HIDDEN_STATE_SHARDS.build_delete_request(drop))
    return dg.SensorResult(dynamic_partitions_requests=requests)
