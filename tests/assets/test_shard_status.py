"""What is current per hidden_states shard reaches the UI: the `shards_current` check, reported by a sensor.

Materializations are recorded as Dagster records them in a run (the code-version and
input-data-version tags that its staleness rule reads); a failed shard comes from a real
failed run of an asset with the same key. The sensor is the micro code location's own.
"""

from __future__ import annotations

import dagster as dg
import pytest

from assets.automation import shard_keys
from assets.partitions import HIDDEN_STATE_SHARDS
from assets.shard_status import SHARDS_CURRENT, STATUS_SENSOR
from definitions import build_definitions
from eagle3_dagster.config import load_profile

INPUTS = {"merged_train": "m1", "extraction_plan": "p1", "target_model": "t1"}


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        yield inst


def upstream(instance, **versions: str) -> None:
    for asset, version in versions.items():
        instance.report_runless_asset_event(dg.AssetMaterialization(asset, tags={"dagster/data_version": version}))


def code_version(profile) -> str:
    """hidden_states' code version in the profile's built graph."""
    return (
        build_definitions(profile)
        .resolve_assets_def("hidden_states")
        .code_versions_by_key[dg.AssetKey("hidden_states")]
    )


def shard(instance, key: str, profile, inputs: dict[str, str] = INPUTS) -> None:
    tags = {
        "dagster/code_version": code_version(profile),
        "dagster/data_version": f"sha-{key}",
        **{f"dagster/input_data_version/{k}": v for k, v in inputs.items()},
    }
    instance.report_runless_asset_event(dg.AssetMaterialization("hidden_states", partition=key, tags=tags))


def failed_run(instance, key: str) -> None:
    @dg.asset(name="hidden_states", partitions_def=HIDDEN_STATE_SHARDS)
    def broken():
        raise RuntimeError("host died")

    dg.materialize([broken], instance=instance, partition_key=key, raise_on_error=False)


def tick(profile, instance, cursor=None):
    repo = build_definitions(profile).get_repository_def()
    ctx = dg.build_sensor_context(instance=instance, cursor=cursor, repository_def=repo)
    return repo.get_sensor_def(STATUS_SENSOR).evaluate_tick(ctx)


def verdict(result) -> tuple[dg.AssetCheckEvaluation, dict[str, tuple[str, str]]]:
    [evaluation] = result.asset_events
    assert isinstance(evaluation, dg.AssetCheckEvaluation)
    assert evaluation.asset_check_key == dg.AssetCheckKey(dg.AssetKey("hidden_states"), SHARDS_CURRENT)
    rows = {r.data["shard"]: (r.data["status"], r.data["cause"]) for r in evaluation.metadata["not_current"].records}
    return evaluation, rows


def test_no_registered_shard_fails_the_check_instead_of_reading_as_done(instance):
    evaluation, rows = verdict(tick(load_profile("micro"), instance))
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR
    assert "no shard" in evaluation.description and "merged_train" in evaluation.description
    assert rows == {} and evaluation.metadata["num_shards"].value == 0


def test_each_shard_not_current_is_listed_with_its_status_and_cause(instance):
    profile = load_profile("micro")
    instance.add_dynamic_partitions(HIDDEN_STATE_SHARDS.name, shard_keys(4))
    upstream(instance, **INPUTS)
    shard(instance, "shard-00000", profile)
    shard(instance, "shard-00001", profile, inputs={**INPUTS, "merged_train": "m0"})
    failed_run(instance, "shard-00002")
    evaluation, rows = verdict(tick(profile, instance))
    assert rows == {
        "shard-00001": ("stale", "merged_train has a new data version"),
        "shard-00002": ("failed", "its latest run failed"),
        "shard-00003": ("missing", "never materialized"),
    }
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR
    counts = {
        k: evaluation.metadata[k].value for k in ("num_shards", "num_current", "num_stale", "num_missing", "num_failed")
    }
    assert counts == {"num_shards": 4, "num_current": 1, "num_stale": 1, "num_missing": 1, "num_failed": 1}
    assert evaluation.description.startswith("3 of 4 shards are not current")


def test_a_settings_edit_makes_every_shard_stale_a_warning_naming_the_code_version(instance):
    profile = load_profile("micro")
    instance.add_dynamic_partitions(HIDDEN_STATE_SHARDS.name, shard_keys(2))
    upstream(instance, **INPUTS)
    for key in shard_keys(2):
        shard(instance, key, profile)
    first = tick(profile, instance)
    assert verdict(first)[0].passed and verdict(first)[0].description == "all 2 shards are current"
    assert tick(profile, instance, cursor=first.cursor).asset_events == []  # nothing changed: nothing reported

    edited = load_profile("micro", overrides={"hidden": {"dtype": "bfloat16"}})
    evaluation, rows = verdict(tick(edited, instance, cursor=first.cursor))
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.WARN
    old, new = code_version(profile), code_version(edited)
    assert rows == {k: ("stale", f"code version {old} → {new}: a setting it reads changed") for k in shard_keys(2)}


def test_a_new_materialization_of_a_current_shard_is_reported_again(instance):
    """The UI shows a check result only while it is newer than the asset's latest materialization."""
    profile = load_profile("micro")
    instance.add_dynamic_partitions(HIDDEN_STATE_SHARDS.name, shard_keys(1))
    upstream(instance, **INPUTS)
    shard(instance, "shard-00000", profile)
    first = tick(profile, instance)
    shard(instance, "shard-00000", profile)  # forced again: same verdict, newer materialization
    assert verdict(tick(profile, instance, cursor=first.cursor))[0].passed


def test_the_check_executed_from_the_asset_page_gives_the_sensors_verdict(instance):
    profile = load_profile("micro")
    instance.add_dynamic_partitions(HIDDEN_STATE_SHARDS.name, shard_keys(2))
    upstream(instance, **INPUTS)
    shard(instance, "shard-00000", profile)
    defs = build_definitions(profile)
    job = defs.resolve_implicit_global_asset_job_def()
    key = dg.AssetCheckKey(dg.AssetKey("hidden_states"), SHARDS_CURRENT)
    result = job.get_subset(asset_check_selection={key}, asset_selection=set()).execute_in_process(instance=instance)
    [evaluation] = result.get_asset_check_evaluations()
    _, sensor_rows = verdict(tick(profile, instance))
    assert (
        {r.data["shard"]: (r.data["status"], r.data["cause"]) for r in evaluation.metadata["not_current"].records}
        == sensor_rows
        == {"shard-00001": ("missing", "never materialized")}
    )


def test_shard_runs_do_not_carry_the_whole_asset_check():
    defs = build_definitions(load_profile("micro"))
    checks = {k.name for k in defs.resolve_job_def("extract_job").asset_layer.asset_graph.asset_check_keys}
    assert SHARDS_CURRENT not in checks and {"bytes_match_plan", "manifest_checksums"} <= checks
