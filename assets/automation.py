"""Jobs, the shard automation and the shard-registering sensor.

A 70-hour extraction is hundreds of shard partitions. The sensor keeps the
partition set equal to the shards of the latest merged_train. What to extract
next is declarative automation on `hidden_states` (Dagster's own bookkeeping,
no event-log scan): a shard is requested when it is missing, its last run
failed, or merged_train / the target changed since it was built; never while a
run of any job (extract_job, the asset page, a backfill) targets it; only once
extraction_plan's blocking disk check passed; at most `hidden.backfill_batch`
per tick of `hidden.backfill_cron`, so a host that died is picked up at the next one.
An external target (production's) is an observable source, missing to the automation until it is observed:
the same sensor observes it when it never was and at each tick.
"""

from collections.abc import Sequence

import dagster as dg

from assets._common import run_tags, silenced_warnings
from assets.partitions import HIDDEN_STATE_SHARDS
from eagle3_dagster.config import Profile
from eagle3_dagster.hidden.sharding import shard_key

AUTOMATION_SENSOR = "hidden_states_automation"


def shard_keys(num_shards: int) -> list[str]:
    """The hidden_states partition keys of merged_train's `num_shards` shards: the keys its plan gives them."""
    return [shard_key(i) for i in range(num_shards)]


class FirstPartitions(dg.AutomationCondition):
    """The first `limit` partitions (in key order) of those its operand selects.

    Dagster 1.13 has no built-in bound on how many partitions one evaluation requests; without one,
    every missing shard of a new merged_train would be queued at once, hundreds of runs waiting on
    the one-slot gpu_host pool. Not serializable, so its sensor evaluates it in the code server.
    """

    def __init__(self, operand: dg.AutomationCondition, limit: int) -> None:
        self.operand, self.limit = operand, limit

    @property
    def name(self) -> str:
        return f"first_{self.limit}_partitions"

    @property
    def description(self) -> str:
        return f"At most {self.limit} partitions, in key order"

    @property
    def children(self) -> Sequence[dg.AutomationCondition]:
        return [self.operand]

    async def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        child = await context.for_child_condition(
            child_condition=self.operand, child_indices=[0], candidate_subset=context.candidate_subset
        ).evaluate_async()
        true_subset = child.true_subset
        if context.partitions_def is not None and true_subset.size > self.limit:
            keys = sorted(true_subset.expensively_compute_partition_keys())[: self.limit]
            true_subset = context.asset_graph_view.get_subset_from_partition_keys(
                context.key, context.partitions_def, set(keys)
            )
        return dg.AutomationResult(context, true_subset, child_results=[child])


def shard_automation_condition(limit: int, cron: str) -> dg.AutomationCondition:
    AC = dg.AutomationCondition
    changed_upstream = AC.any_deps_updated().since(AC.newly_requested() | AC.newly_updated())
    wanted = (AC.missing() | AC.execution_failed() | changed_upstream).with_label("missing, failed or outdated")
    ready = ~AC.any_deps_missing() & ~AC.any_deps_in_progress() & AC.all_deps_blocking_checks_passed()
    due = AC.cron_tick_passed(cron).with_label(f"tick of {cron}")
    return FirstPartitions(due & wanted & ready & ~AC.in_progress(), limit)


def target_observation_condition(cron: str) -> dg.AutomationCondition:
    """An external target is observed when it never was and at each tick of `cron`: until its first observation
    it counts as missing, and no shard is requested (`ready` above); after it, a swapped checkpoint changes its
    data version at the next tick and marks everything built from the old one stale."""
    AC = dg.AutomationCondition
    return ((AC.missing() | AC.cron_tick_passed(cron)) & ~AC.in_progress()).with_label(
        f"never observed, or a tick of {cron}"
    )


# The jobs the UI and scripts/run_pipeline.py run: what each materializes. Their order is the graph's
# (run_pipeline sorts them by it), not this table's.
JOBS: dict[str, tuple[tuple[str, ...], str]] = {
    "target_job": (("target_model",), "Build and pre-train the tiny target (tiny targets only)."),
    "data_job": (("raw_responses", "tokenized_dataset"), "Regenerate and tokenize one dataset partition."),
    "corpus_job": (
        ("merged_train", "vocab_mapping", "extraction_plan"),
        "Merge and shuffle, build the draft vocabulary, plan the extraction.",
    ),
    "extract_job": (
        ("hidden_states",),
        "Extract hidden states for shard partitions (one GPU run at a time: pool gpu_host).",
    ),
    "train_job": (
        ("drafter_checkpoint", "benchmark_report"),
        "Train the drafter with torchrun, export it, benchmark it.",
    ),
}


def build_jobs(profile: Profile, whole_asset_checks: Sequence[dg.AssetCheckKey]) -> dict:
    """`whole_asset_checks`: checks that judge every partition of an asset at once (partitions_current), which
    the jobs leave out: their verdicts are reported by their sensor, not by each partition's run."""
    jobs = {}
    for name, (assets, description) in JOBS.items():
        if name == "target_job" and profile.target.kind != "tiny":
            continue  # an external target is observed, not built
        selection = dg.AssetSelection.assets(*assets) - dg.AssetSelection.checks(*whole_asset_checks)
        tags = run_tags(profile, "hidden_states" if "hidden_states" in assets else None)
        jobs[name] = dg.define_asset_job(name, selection=selection, tags=tags, description=description)
    return jobs


def build_automation_sensor(profile: Profile) -> dg.AutomationConditionSensorDefinition:
    # use_user_code_server is Beta in 1.13, and the only way to evaluate a condition that is not serializable.
    with silenced_warnings(dg.BetaWarning, "Parameter `use_user_code_server` of initializer"):
        return _automation_sensor(profile)


def _automation_sensor(profile: Profile) -> dg.AutomationConditionSensorDefinition:
    observed = ("target_model",) if profile.target.kind != "tiny" else ()  # an external target's observation
    return dg.AutomationConditionSensorDefinition(
        AUTOMATION_SENSOR,
        target=dg.AssetSelection.assets("hidden_states", *observed),
        run_tags=run_tags(profile, "hidden_states"),
        default_status=dg.DefaultSensorStatus.RUNNING,
        use_user_code_server=True,  # FirstPartitions is evaluated in the code location
        emit_backfills=False,  # one run per shard: a failed shard fails alone and is retried alone
        description=f"At each tick of {profile.hidden.backfill_cron}, requests up to {profile.hidden.backfill_batch} "
        "hidden_states shards that are missing, failed or outdated, none already queued or running"
        + ("; observes the external target_model, at once when it never was" if observed else "")
        + ".",
    )


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
