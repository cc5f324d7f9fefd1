"""The shard automation, evaluated in-process against a real (temporary) Dagster instance.

The sensor keeps the `hidden_states` partitions equal to the shards of the
latest `merged_train`. Declarative automation on `hidden_states` asks, at each
tick of `hidden.backfill_cron`, for shards that are missing, failed or older
than merged_train, never for one that any run (extract_job, the asset page's
`__ASSET_JOB`, a backfill) targets, never before extraction_plan's blocking
disk check passed, and at most `hidden.backfill_batch` of them. Upstream events
are reported as runless events and runs are created in the instance, exactly
what the daemon would read.
"""

from __future__ import annotations

import datetime as dt

import dagster as dg
import pytest

# Private: a queued run needs its job's origin; dg has none, DagsterGraphQLClient needs a webserver and a code server.
from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin

from definitions import build_definitions
from eagle3_dagster.config import load_profile

SHARDS = "hidden_state_shards"
SENSOR = "register_shard_partitions"
HIDDEN = dg.AssetKey("hidden_states")
BATCH = 2


@pytest.fixture(scope="module")
def defs() -> dg.Definitions:
    # A batch smaller than the sets below, so the bound is visible.
    return build_definitions(
        load_profile("micro", overrides={"hidden": {"backfill_batch": BATCH, "backfill_cron": "*/10 * * * *"}})
    )


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        yield inst


def shard(i: int) -> str:
    return f"shard-{i:05d}"


def report_merged_train(instance: dg.DagsterInstance, num_shards: int | None) -> None:
    metadata = {} if num_shards is None else {"num_shards": num_shards}
    instance.report_runless_asset_event(dg.AssetMaterialization("merged_train", metadata=metadata))


def report_extracted(instance: dg.DagsterInstance, *keys: str) -> None:
    for key in keys:
        instance.report_runless_asset_event(dg.AssetMaterialization("hidden_states", partition=key))


def report_upstream(instance: dg.DagsterInstance, num_shards: int, fits: bool = True) -> None:
    """merged_train with its shards registered, the target, and a plan whose disk check passed (or not)."""
    instance.add_dynamic_partitions(SHARDS, [shard(i) for i in range(num_shards)])
    report_merged_train(instance, num_shards)
    for asset in ["target_model", "extraction_plan"]:
        instance.report_runless_asset_event(dg.AssetMaterialization(asset))
    instance.report_runless_asset_event(
        dg.AssetCheckEvaluation(
            asset_key=dg.AssetKey("extraction_plan"),
            check_name="fits_on_disk",
            passed=fits,
            severity=dg.AssetCheckSeverity.ERROR,
        )
    )


def add_run(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    key: str,
    job: str,
    status: dg.DagsterRunStatus = dg.DagsterRunStatus.QUEUED,
) -> dg.DagsterRun:
    """A run of `job` targeting shard `key`, created as the webserver or a sensor creates it (its planned
    materialization recorded); a queued run must name where its job lives."""
    job_def = defs.resolve_implicit_global_asset_job_def() if job == "__ASSET_JOB" else defs.resolve_job_def(job)
    origin = RemoteJobOrigin(
        repository_origin=RemoteRepositoryOrigin(RegisteredCodeLocationOrigin("eagle3_dagster"), "__repository__"),
        job_name=job,
    )
    run = instance.create_run_for_job(
        job_def=job_def,
        asset_selection=frozenset({HIDDEN}),
        tags={"dagster/partition": key},
        status=dg.DagsterRunStatus.QUEUED if status == dg.DagsterRunStatus.QUEUED else dg.DagsterRunStatus.NOT_STARTED,
        remote_job_origin=origin,
    )
    if status == dg.DagsterRunStatus.FAILURE:
        instance.report_run_failed(run)
    return run


class Ticks:
    """Successive automation evaluations; the first only starts the clock (a cron tick must pass)."""

    def __init__(self, defs: dg.Definitions, instance: dg.DagsterInstance) -> None:
        self.defs, self.instance = defs, instance
        self.now = dt.datetime.now(dt.timezone.utc)
        self.cursor = dg.evaluate_automation_conditions(defs, instance, evaluation_time=self.now).cursor

    def next(self) -> list[str]:
        self.now += dt.timedelta(minutes=10)
        result = dg.evaluate_automation_conditions(
            self.defs, self.instance, evaluation_time=self.now, cursor=self.cursor
        )
        self.cursor = result.cursor
        return sorted(result.get_requested_partitions(HIDDEN))


def sensor_tick(defs: dg.Definitions, instance: dg.DagsterInstance, cursor: str | None = None):
    """One sensor evaluation; its partition requests are applied as the daemon applies them."""
    repo = defs.get_repository_def()
    sensor = repo.get_sensor_def(SENSOR)
    ctx = dg.build_sensor_context(instance=instance, cursor=cursor, repository_def=repo)
    result = sensor.evaluate_tick(ctx)
    for req in result.dynamic_partitions_requests:
        if isinstance(req, dg.AddDynamicPartitionsRequest):
            instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        else:
            for key in req.partition_keys:
                instance.delete_dynamic_partition(req.partitions_def_name, key)
    return result


def test_sensor_registers_one_partition_per_shard_of_merged_train(defs, instance):
    report_merged_train(instance, 5)
    sensor_tick(defs, instance)
    assert instance.get_dynamic_partitions(SHARDS) == [shard(i) for i in range(5)]


def test_sensor_deletes_partitions_beyond_a_smaller_merged_train(defs, instance):
    report_merged_train(instance, 5)
    first = sensor_tick(defs, instance)
    report_merged_train(instance, 3)
    second = sensor_tick(defs, instance, cursor=first.cursor)
    assert [type(r) for r in second.dynamic_partitions_requests] == [dg.DeleteDynamicPartitionsRequest]
    assert instance.get_dynamic_partitions(SHARDS) == [shard(i) for i in range(3)]


def test_sensor_adds_only_the_new_shards_when_merged_train_grows(defs, instance):
    report_merged_train(instance, 2)
    first = sensor_tick(defs, instance)
    report_merged_train(instance, 4)
    second = sensor_tick(defs, instance, cursor=first.cursor)
    [add] = second.dynamic_partitions_requests
    assert list(add.partition_keys) == [shard(2), shard(3)]
    assert instance.get_dynamic_partitions(SHARDS) == [shard(i) for i in range(4)]


def test_sensor_skips_a_merged_train_without_num_shards_and_keeps_partitions(defs, instance):
    instance.add_dynamic_partitions(SHARDS, [shard(0), shard(1)])
    report_merged_train(instance, None)
    result = sensor_tick(defs, instance)
    assert "num_shards" in (result.skip_message or "")
    assert result.dynamic_partitions_requests == []
    assert instance.get_dynamic_partitions(SHARDS) == [shard(0), shard(1)]


def test_sensor_does_nothing_until_merged_train_materializes_again(defs, instance):
    report_merged_train(instance, 3)
    first = sensor_tick(defs, instance)
    again = sensor_tick(defs, instance, cursor=first.cursor)
    assert again.dynamic_partitions_requests == []
    assert again.run_requests == []


def test_automation_requests_missing_shards_in_key_order_at_most_a_batch_per_tick(defs, instance):
    report_upstream(instance, 5)
    ticks = Ticks(defs, instance)
    assert ticks.next() == [shard(0), shard(1)]


def test_a_shard_targeted_by_any_run_in_flight_is_not_requested(defs, instance):
    report_upstream(instance, 5)
    add_run(defs, instance, shard(0), "__ASSET_JOB")  # launched from the asset page
    add_run(defs, instance, shard(1), "extract_job")
    ticks = Ticks(defs, instance)
    assert ticks.next() == [shard(2), shard(3)]


def test_a_failed_shard_is_requested_again_and_an_extracted_one_is_not(defs, instance):
    report_upstream(instance, 3)
    report_extracted(instance, shard(0))
    add_run(defs, instance, shard(1), "extract_job", dg.DagsterRunStatus.FAILURE)
    report_extracted(instance, shard(2))
    ticks = Ticks(defs, instance)
    assert ticks.next() == [shard(1)]


def test_nothing_is_requested_while_the_plan_says_it_does_not_fit(defs, instance):
    report_upstream(instance, 3, fits=False)
    ticks = Ticks(defs, instance)
    assert ticks.next() == []


def test_a_new_merged_train_makes_extracted_shards_due_again(defs, instance):
    report_upstream(instance, 2)
    report_extracted(instance, shard(0), shard(1))
    ticks = Ticks(defs, instance)
    assert ticks.next() == []
    report_merged_train(instance, 2)  # a re-merge: every shard was built from the old corpus
    assert ticks.next() == [shard(0), shard(1)]


def test_automation_runs_carry_the_profile_and_the_runtime_limit(defs):
    sensor = defs.resolve_sensor_def("hidden_states_automation")
    assert sensor.run_tags == {"eagle3/profile": "micro", "dagster/max_runtime": "21600"}


def test_an_external_target_is_observed_by_the_automation_before_any_shard_is_requested():
    """Production's target is an observable source: until it is observed it is missing to the automation, and no
    shard is ever requested (the production rehearsal's shards waited forever). The automation sensor observes it
    when it never was, then requests the shards at the next tick."""
    defs = build_definitions(
        load_profile("production", overrides={"hidden": {"backfill_batch": BATCH, "backfill_cron": "*/10 * * * *"}})
    )
    target = dg.AssetKey("target_model")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(SHARDS, [shard(i) for i in range(3)])
        report_merged_train(instance, 3)
        instance.report_runless_asset_event(dg.AssetMaterialization("extraction_plan"))
        instance.report_runless_asset_event(
            dg.AssetCheckEvaluation(
                asset_key=dg.AssetKey("extraction_plan"),
                check_name="fits_on_disk",
                passed=True,
                severity=dg.AssetCheckSeverity.ERROR,
            )
        )
        ticks = Ticks(defs, instance)
        result = dg.evaluate_automation_conditions(defs, instance, evaluation_time=ticks.now, cursor=ticks.cursor)
        assert result.get_num_requested(target) == 1  # never observed: observed at once
        assert result.get_requested_partitions(HIDDEN) == set()
        instance.report_runless_asset_event(dg.AssetObservation(target, tags={"dagster/data_version": "abc"}))
        assert ticks.next() == [shard(0), shard(1)]
