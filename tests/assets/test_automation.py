"""The shard automation, evaluated in-process against a real (temporary) Dagster instance.

The sensor keeps the `hidden_states` partitions equal to the shards of the
latest `merged_train`; the backfill schedule asks only for the shards that are
missing since that `merged_train`, never for one with a run in flight, and at
most `hidden.backfill_batch` of them per tick. Materializations are reported as
runless events, exactly what the daemon would read from the event log.
"""

from __future__ import annotations

import datetime as dt

import dagster as dg
import pytest
from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin

from assets.automation import missing_shards
from definitions import build_definitions
from eagle3_dagster.config import load_profile

SHARDS = "hidden_state_shards"
SENSOR = "register_shard_partitions"
SCHEDULE = "hidden_states_backfill"
TICK = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.timezone.utc)
BATCH = 2


@pytest.fixture(scope="module")
def defs() -> dg.Definitions:
    # A batch smaller than the partial sets below, so the bound is visible.
    return build_definitions(load_profile("micro", overrides={"hidden": {"backfill_batch": BATCH}}))


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


def add_extract_run(instance: dg.DagsterInstance, key: str, status: dg.DagsterRunStatus, job: str = "extract_job"):
    """A run record as the queued run coordinator stores it (a queued run must name where its job lives)."""
    origin = RemoteJobOrigin(
        repository_origin=RemoteRepositoryOrigin(RegisteredCodeLocationOrigin("eagle3_dagster"), "__repository__"),
        job_name=job,
    )
    instance.add_run(dg.DagsterRun(job_name=job, status=status, tags={"dagster/partition": key},
                                   remote_job_origin=origin))


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


def schedule_tick(defs: dg.Definitions, instance: dg.DagsterInstance, when: dt.datetime = TICK):
    repo = defs.get_repository_def()
    schedule = repo.get_schedule_def(SCHEDULE)
    ctx = dg.build_schedule_context(instance=instance, scheduled_execution_time=when, repository_def=repo)
    return schedule.evaluate_tick(ctx)


def requested(result) -> list[str]:
    return [r.partition_key for r in result.run_requests]


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


def test_schedule_requests_only_missing_shards_not_in_flight(defs, instance):
    # shard 0 was extracted for a previous merged_train: stale, so missing again.
    instance.add_dynamic_partitions(SHARDS, [shard(i) for i in range(7)])
    report_extracted(instance, shard(0))
    report_merged_train(instance, 7)
    report_extracted(instance, shard(1), shard(5))
    add_extract_run(instance, shard(2), dg.DagsterRunStatus.QUEUED)
    add_extract_run(instance, shard(3), dg.DagsterRunStatus.STARTED)
    add_extract_run(instance, shard(4), dg.DagsterRunStatus.FAILURE)  # failed: missing again
    add_extract_run(instance, shard(6), dg.DagsterRunStatus.QUEUED, job="train_job")  # not an extraction

    assert missing_shards(instance) == [shard(0), shard(4), shard(6)]
    # The tick asks for the first `backfill_batch` of them, in shard order.
    assert requested(schedule_tick(defs, instance)) == [shard(0), shard(4)]


def test_schedule_tick_is_bounded_by_backfill_batch_and_tags_the_profile(defs, instance):
    report_merged_train(instance, 5)
    instance.add_dynamic_partitions(SHARDS, [shard(i) for i in range(5)])
    result = schedule_tick(defs, instance)
    assert requested(result) == [shard(0), shard(1)]
    assert all(r.tags["eagle3/profile"] == "micro" for r in result.run_requests)
    later = schedule_tick(defs, instance, TICK + dt.timedelta(minutes=10))
    # No run was launched between the ticks, so the same shards come back, under new run keys
    # (a run key repeated across ticks would be deduplicated by the daemon and never rerun).
    assert requested(later) == requested(result)
    assert {r.run_key for r in later.run_requests}.isdisjoint(r.run_key for r in result.run_requests)


def test_schedule_skips_when_every_shard_is_extracted_or_in_flight(defs, instance):
    instance.add_dynamic_partitions(SHARDS, [shard(i) for i in range(3)])
    report_merged_train(instance, 3)
    report_extracted(instance, shard(0), shard(2))
    add_extract_run(instance, shard(1), dg.DagsterRunStatus.STARTING)
    result = schedule_tick(defs, instance)
    assert result.run_requests == []
    assert "in flight" in result.skip_message


def test_schedule_skips_before_any_shard_is_registered(defs, instance):
    result = schedule_tick(defs, instance)
    assert result.run_requests == []
    assert result.skip_message


def test_sensor_then_schedule_take_a_new_merged_train_from_scratch(defs, instance):
    report_merged_train(instance, 3)
    first = sensor_tick(defs, instance)
    report_extracted(instance, shard(0), shard(1), shard(2))
    assert schedule_tick(defs, instance).run_requests == []
    # A re-merge invalidates every shard; the sensor resizes, the schedule asks again.
    report_merged_train(instance, 4)
    sensor_tick(defs, instance, cursor=first.cursor)
    assert requested(schedule_tick(defs, instance)) == [shard(0), shard(1)]
