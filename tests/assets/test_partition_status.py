"""What is current per partition reaches the UI: the `partitions_current` check of each partitioned asset
(the shards of hidden_states, the datasets of raw_responses and tokenized_dataset), reported by one sensor.

Materializations are recorded as Dagster records them in a run (the code-version and
input-data-version tags that its staleness rule reads); a failed shard comes from a real
failed run of an asset with the same key. The sensor is the micro code location's own.
"""

from __future__ import annotations

import dagster as dg
import pytest

from assets.automation import shard_keys
from assets.partitions import HIDDEN_STATE_SHARDS, dataset_partitions
from assets.partition_status import CHECK, STATUS_SENSOR
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


def code_version(profile, asset: str = "hidden_states") -> str:
    """The asset's code version in the profile's built graph."""
    return build_definitions(profile).resolve_assets_def(asset).code_versions_by_key[dg.AssetKey(asset)]


def shard(instance, key: str, profile, inputs: dict[str, str] = INPUTS, asset: str = "hidden_states") -> None:
    """A materialization of one partition as a run records it: the code version and each input's data version."""
    tags = {
        "dagster/code_version": code_version(profile, asset),
        "dagster/data_version": f"sha-{asset}-{key}",
        **{f"dagster/input_data_version/{k}": v for k, v in inputs.items()},
    }
    instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition=key, tags=tags))


def failed_run(instance, key: str) -> None:
    @dg.asset(name="hidden_states", partitions_def=HIDDEN_STATE_SHARDS)
    def broken():
        raise RuntimeError("host died")

    dg.materialize([broken], instance=instance, partition_key=key, raise_on_error=False)


def tick(profile, instance, cursor=None):
    repo = build_definitions(profile).get_repository_def()
    ctx = dg.build_sensor_context(instance=instance, cursor=cursor, repository_def=repo)
    return repo.get_sensor_def(STATUS_SENSOR).evaluate_tick(ctx)


def verdict(result, asset: str = "hidden_states") -> tuple[dg.AssetCheckEvaluation, dict[str, tuple[str, str]]]:
    """The asset's verdict among those the tick reported."""
    [evaluation] = [e for e in result.asset_events if e.asset_key == dg.AssetKey(asset)]
    assert isinstance(evaluation, dg.AssetCheckEvaluation)
    assert evaluation.asset_check_key == dg.AssetCheckKey(dg.AssetKey(asset), CHECK)
    return evaluation, rows_of(evaluation)


def rows_of(evaluation) -> dict[str, tuple[str, str]]:
    return {
        r.data["partition"]: (r.data["status"], r.data["cause"]) for r in evaluation.metadata["not_current"].records
    }


def test_no_registered_shard_fails_the_check_instead_of_reading_as_done(instance):
    evaluation, rows = verdict(tick(load_profile("micro"), instance))
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR
    assert "no shard" in evaluation.description and "merged_train" in evaluation.description
    assert rows == {} and evaluation.metadata["num_partitions"].value == 0


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
        k: evaluation.metadata[k].value
        for k in ("num_partitions", "num_current", "num_stale", "num_missing", "num_failed")
    }
    legend = evaluation.metadata["metadata_legend"].value
    assert all(f"| `{k}` |" in legend for k in evaluation.metadata if k != "metadata_legend")
    assert counts == {"num_partitions": 4, "num_current": 1, "num_stale": 1, "num_missing": 1, "num_failed": 1}
    assert evaluation.description.startswith("3 of 4 shards are not current")


def test_a_settings_edit_makes_every_shard_stale_a_warning_naming_the_code_version(instance):
    profile = load_profile("micro")
    instance.add_dynamic_partitions(HIDDEN_STATE_SHARDS.name, shard_keys(2))
    upstream(instance, **INPUTS)
    for key in shard_keys(2):
        shard(instance, key, profile)
    first = tick(profile, instance)
    assert verdict(first)[0].passed and verdict(first)[0].description == "all 2 shards are current"
    assert [e.asset_key for e in tick(profile, instance, cursor=first.cursor).asset_events] == []  # nothing changed

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
    key = dg.AssetCheckKey(dg.AssetKey("hidden_states"), CHECK)
    result = job.get_subset(asset_check_selection={key}, asset_selection=set()).execute_in_process(instance=instance)
    [evaluation] = result.get_asset_check_evaluations()
    _, sensor_rows = verdict(tick(profile, instance))
    assert rows_of(evaluation) == sensor_rows == {"shard-00001": ("missing", "never materialized")}


def test_partition_runs_do_not_carry_the_whole_asset_check():
    defs = build_definitions(load_profile("micro"))
    checks = {k.name for k in defs.resolve_job_def("extract_job").asset_layer.asset_graph.asset_check_keys}
    assert CHECK not in checks and {"bytes_match_plan", "manifest_checksums"} <= checks
    assert defs.resolve_job_def("data_job").asset_layer.asset_graph.asset_check_keys == set()


# micro's one dataset and a second, so that a partition's verdict is seen beside another's
TWO_DATASETS = {
    "datasets": [
        {"name": name, "source": "sharegpt", "regenerate": True, "max_conversations": 64, "max_turns": 1}
        for name in ("sharegpt", "sharegpt_long")
    ]
}
DATASETS = ["sharegpt", "sharegpt_long"]
TARGET = {"target_model": "t1"}


def two_datasets(**overrides) -> object:
    return load_profile("micro", overrides={**TWO_DATASETS, **overrides})


def datasets(instance, profile, names: list[str] = DATASETS, raw_version: str = "r1", tokenize: bool = True) -> None:
    """raw_responses, then tokenized_dataset from it, materialized by Dagster for each dataset in `names`, with the
    profile's code versions and the data version `raw_version` for raw_responses (so Dagster records the tags of a
    partitioned input as it does in a run: its input_event_pointer and its own input data version)."""
    partitions = dataset_partitions(profile)

    @dg.asset(
        name="raw_responses",
        partitions_def=partitions,
        deps=["target_model"],
        code_version=code_version(profile, "raw_responses"),
    )
    def raw_responses() -> dg.MaterializeResult:
        return dg.MaterializeResult(data_version=dg.DataVersion(raw_version))

    @dg.asset(
        name="tokenized_dataset",
        partitions_def=partitions,
        deps=[raw_responses, "target_model"],
        code_version=code_version(profile, "tokenized_dataset"),
    )
    def tokenized_dataset(context) -> dg.MaterializeResult:  # unannotated: this module's annotations are strings
        return dg.MaterializeResult(data_version=dg.DataVersion(f"tok-{context.partition_key}"))

    upstream(instance, **TARGET)
    for name in names:
        dg.materialize(
            [raw_responses, tokenized_dataset] if tokenize else [raw_responses],
            instance=instance,
            partition_key=name,
            selection=None,
        )


def test_every_partitioned_asset_has_the_check_and_the_sensor_reports_each():
    profile = two_datasets()
    defs = build_definitions(profile)
    partitioned = {a.key.to_user_string() for a in defs.resolve_all_asset_specs() if a.partitions_def is not None}
    assert partitioned == {"raw_responses", "tokenized_dataset", "hidden_states"}
    checks = {key for c in defs.asset_checks for key in c.check_keys if key.name == CHECK}
    assert checks == {dg.AssetCheckKey(dg.AssetKey(a), CHECK) for a in partitioned}
    with dg.instance_for_test() as instance:
        datasets(instance, profile)
        result = tick(profile, instance)
        assert {e.asset_key.to_user_string() for e in result.asset_events} == partitioned
        for asset in ("raw_responses", "tokenized_dataset"):
            evaluation, rows = verdict(result, asset)
            assert evaluation.passed and rows == {}
            assert evaluation.description == f"all {len(DATASETS)} datasets are current"


def test_a_setting_edit_marks_every_dataset_stale_and_the_revert_clears_it(instance):
    """data.max_seq_len: raw_responses regenerates only the turns that fit it, so both dataset assets read it."""
    profile = two_datasets()
    datasets(instance, profile)
    first = tick(profile, instance)
    edited = two_datasets(data={**profile.data.model_dump(), "max_seq_len": profile.data.max_seq_len + 16})
    after_edit = tick(edited, instance, cursor=first.cursor)
    for asset in ("raw_responses", "tokenized_dataset"):
        evaluation, rows = verdict(after_edit, asset)
        old, new = code_version(profile, asset), code_version(edited, asset)
        assert old != new and not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.WARN
        assert rows == {d: ("stale", f"code version {old} → {new}: a setting it reads changed") for d in DATASETS}
        assert evaluation.description.startswith(f"{len(DATASETS)} of {len(DATASETS)} datasets are not current")
    reverted = tick(profile, instance, cursor=after_edit.cursor)
    for asset in ("raw_responses", "tokenized_dataset"):
        assert verdict(reverted, asset)[0].passed  # cleared: the same verdict as before the edit


def test_a_regenerated_dataset_makes_only_its_own_tokenized_partition_stale(instance):
    """An input partitioned as the asset is compared partition by partition, as Dagster does."""
    profile = two_datasets()
    first, other = DATASETS
    datasets(instance, profile)
    assert verdict(tick(profile, instance), "tokenized_dataset")[0].passed
    datasets(instance, profile, names=[first], raw_version="r1", tokenize=False)  # again, same answers
    assert verdict(tick(profile, instance), "tokenized_dataset")[0].passed
    datasets(instance, profile, names=[first], raw_version="r2", tokenize=False)  # new answers
    evaluation, rows = verdict(tick(profile, instance), "tokenized_dataset")
    assert rows == {first: ("stale", "raw_responses has a new data version")}
    assert other not in rows and not evaluation.passed
