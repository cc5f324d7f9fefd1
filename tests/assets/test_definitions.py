"""The code location: it loads for every profile, and the graph is the one the README draws."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from definitions import build_definitions
from eagle3_dagster.config import CONFIG_DIR, load_profile

ROOT = Path(__file__).resolve().parents[2]

# asset → the assets it depends on (the README's graph)
GRAPH = {
    "target_model": set(),
    "raw_responses": {"target_model"},
    "tokenized_dataset": {"raw_responses", "target_model"},
    "merged_train": {"tokenized_dataset"},
    "vocab_mapping": {"merged_train", "target_model"},
    "extraction_plan": {"merged_train", "target_model"},
    "hidden_states": {"merged_train", "extraction_plan", "target_model"},
    # the plan names the shards of the version it trains on (an input whose content it does not hash)
    "drafter_checkpoint": {"hidden_states", "extraction_plan", "vocab_mapping", "target_model"},
    "benchmark_report": {"drafter_checkpoint", "target_model"},
}


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_definitions_load_for_every_profile(name: str) -> None:
    defs = build_definitions(load_profile(name))
    graph = defs.resolve_asset_graph()
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} == set(GRAPH)
    for asset, deps in GRAPH.items():
        parents = {k.to_user_string() for k in graph.get(dg.AssetKey(asset)).parent_keys}
        assert parents == deps, asset
    for job in ["data_job", "corpus_job", "extract_job", "train_job", "cleanup_hidden_states"]:
        defs.resolve_job_def(job)
    for sensor in ["register_shard_partitions", "hidden_states_automation", "changed_settings"]:
        assert defs.resolve_sensor_def(sensor)


def test_production_target_is_observed_and_demo_target_is_built() -> None:
    prod = build_definitions(load_profile("production")).resolve_asset_graph()
    demo = build_definitions(load_profile("demo")).resolve_asset_graph()
    assert prod.get(dg.AssetKey("target_model")).is_observable
    assert demo.get(dg.AssetKey("target_model")).is_materializable


def test_gpu_assets_share_the_gpu_host_pool() -> None:
    # Code versions are tested for what they invalidate (below): a missing one would invalidate nothing.
    graph = build_definitions(load_profile("micro")).resolve_asset_graph()
    for name in ["hidden_states", "drafter_checkpoint", "benchmark_report"]:
        assert graph.get(dg.AssetKey(name)).pools == {"gpu_host"}, name


def test_hidden_state_shards_are_dynamic_partitions_and_datasets_static() -> None:
    profile = load_profile("production")
    graph = build_definitions(profile).resolve_asset_graph()
    shards = graph.get(dg.AssetKey("hidden_states")).partitions_def
    assert isinstance(shards, dg.DynamicPartitionsDefinition) and shards.name == "hidden_state_shards"
    datasets = graph.get(dg.AssetKey("raw_responses")).partitions_def
    assert datasets.get_partition_keys() == profile.dataset_names


@pytest.mark.slow  # the dagster CLI in a subprocess
def test_dagster_cli_validates_the_workspace() -> None:
    out = subprocess.run(
        [str(Path(sys.executable).with_name("dagster")), "definitions", "validate", "-w", "workspace.yaml"],
        cwd=ROOT,
        env=os.environ | {"EAGLE3_PROFILE": "micro"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Validation successful" in out.stdout + out.stderr


def code_versions(**overrides) -> dict[str, str]:
    graph = build_definitions(load_profile("micro", overrides=overrides)).resolve_asset_graph()
    return {name: graph.get(dg.AssetKey(name)).code_version for name in GRAPH}


def invalidated(**overrides) -> set[str]:
    base, changed = code_versions(), code_versions(**overrides)
    return {name for name in GRAPH if base[name] != changed[name]}


def test_an_edit_invalidates_every_asset_built_from_what_it_changes_and_only_those() -> None:
    # Dagster does not pass staleness from a stale parent to its children, so each code version carries
    # the settings of everything upstream whose content the asset reads.
    everything_but_the_target = set(GRAPH) - {"target_model"}
    assert invalidated(data={"max_seq_len": 256}) == everything_but_the_target
    assert invalidated(data={"draft_vocab_size": 128}) == {"vocab_mapping", "drafter_checkpoint", "benchmark_report"}
    assert invalidated(hidden={"batch_tokens": 2048}) == {
        "extraction_plan",
        "hidden_states",
        "drafter_checkpoint",
        "benchmark_report",
    }
    # The plan's estimate is not in the shards: only the plan is invalidated.
    assert invalidated(hidden={"throughput_tokens_per_s": 1.0}) == {"extraction_plan"}
    assert invalidated(train={"lr": 0.01}) == {"drafter_checkpoint", "benchmark_report"}
    assert invalidated(hidden={"backfill_cron": "*/5 * * * *", "max_runtime_s": 600}) == set()
    # the release the export is written for is the drafter's content; where and how long it runs is not
    assert invalidated(gpu_host={"sglang_version": "0.5.12"}) == {"drafter_checkpoint", "benchmark_report"}
    assert invalidated(gpu_host={"lease_wait_s": 5.0}, generation={"concurrency": 2}) == set()


def test_each_code_version_hashes_what_its_stage_is_given_and_nothing_it_only_runs_with() -> None:
    """The settings an asset's code version hashes are derived from the settings object its stage is given:
    its content is hashed; a setting the stage only runs with (`runs_with=`) is hashed only where an input's
    stage reads it as content."""
    from assets.settings import SETTINGS_KEY, code_version
    from eagle3_dagster.stages.bench import BenchSettings
    from eagle3_dagster.stages.data import MergeSettings, RegenerateSettings, TokenizeSettings, VocabSettings
    from eagle3_dagster.stages.hidden import ExtractSettings, PlanSettings
    from eagle3_dagster.stages.target import ExternalTargetSettings, TinyTargetSettings
    from eagle3_dagster.stages.train import TrainSettings

    stages = {
        "raw_responses": RegenerateSettings,
        "tokenized_dataset": TokenizeSettings,
        "merged_train": MergeSettings,
        "vocab_mapping": VocabSettings,
        "extraction_plan": PlanSettings,
        "hidden_states": ExtractSettings,
        "drafter_checkpoint": TrainSettings,
        "benchmark_report": BenchSettings,
    }
    for name, target in [("micro", TinyTargetSettings), ("production", ExternalTargetSettings)]:
        profile = load_profile(name)
        defs = build_definitions(profile)
        hashed = {a: defs.resolve_asset_graph().get(dg.AssetKey(a)).code_version for a in GRAPH}
        settings = {
            s.key.to_user_string(): s.metadata[SETTINGS_KEY].data
            for s in defs.resolve_all_asset_specs()
            if SETTINGS_KEY in s.metadata
        }
        for asset, kind in {**stages, "target_model": target}.items():
            given = kind.from_profile(profile)
            assert given.content().items() <= settings[asset].items(), (name, asset)
        for asset in set(GRAPH) - {"target_model"} if name == "production" else GRAPH:
            assert hashed[asset] == code_version(settings[asset]), (name, asset)
    micro = {
        s.key.to_user_string(): s.metadata[SETTINGS_KEY].data
        for s in build_definitions(load_profile("micro")).resolve_all_asset_specs()
    }
    assert "generation.concurrency" not in micro["raw_responses"]  # pacing, declared runs_with
    assert "data.bad_fraction_threshold" not in micro["raw_responses"]  # a refusal before anything is paid
    assert "data.bad_fraction_threshold" in micro["tokenized_dataset"]  # its verdict certifies the partition


def test_the_pipeline_runs_the_jobs_in_the_graphs_order() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import run_pipeline

    micro = [name for name, _ in run_pipeline.stages(build_definitions(load_profile("micro")))]
    assert micro == ["target_job", "data_job", "corpus_job", "extract_job", "train_job"]
    production = [name for name, _ in run_pipeline.stages(build_definitions(load_profile("production")))]
    assert production == micro[1:]  # an external target is observed: no job builds it
    assert run_pipeline.toposorted({"c": ["b"], "b": ["a"], "a": []}) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="cycle: a → b → a"):
        run_pipeline.toposorted({"a": ["b"], "b": ["a"]})
