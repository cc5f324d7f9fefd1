"""The README's demo command, end to end through Dagster, at micro size.

Runs `scripts/run_pipeline.py` (what `scripts/demo.sh` runs) in a subprocess
against a fresh instance whose `dagster.yaml` is the checked-in one, with the
micro profile pointed at a temp folder, then reads the instance the way the UI
does: every asset materialized, every shard partition present, the checks
passed and the figures within their bounds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ASSETS = [
    "target_model",
    "raw_responses",
    "tokenized_dataset",
    "merged_train",
    "vocab_mapping",
    "extraction_plan",
    "hidden_states",
    "drafter_checkpoint",
    "benchmark_report",
]


def micro_profile_in(tmp: Path) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "micro.yaml").read_text())
    raw["run_root"] = str(tmp / "run")
    raw["hidden"]["root"] = str(tmp / "run" / "hidden_states")
    path = tmp / "micro.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("micro_pipeline")
    home = tmp / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    env = os.environ | {
        "DAGSTER_HOME": str(home),
        "EAGLE3_PROFILE": str(micro_profile_in(tmp)),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_pipeline.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
    )
    return home, proc


def test_demo_command_materializes_every_asset_through_dagster(pipeline_run) -> None:
    home, proc = pipeline_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for name in ASSETS:
            assert instance.get_latest_materialization_event(dg.AssetKey(name)) is not None, name
        shards = instance.get_dynamic_partitions("hidden_state_shards")
        assert len(shards) >= 2
        done = instance.get_materialized_partitions(dg.AssetKey("hidden_states"))
        assert done == set(shards)
        runs = instance.get_runs()
        assert runs and all(r.tags.get("eagle3/profile") == "micro" for r in runs)


def test_checks_pass_and_figures_are_within_bounds(pipeline_run) -> None:
    home, proc = pipeline_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    with dg.DagsterInstance.from_config(str(home)) as instance:

        def meta(name: str) -> dict:
            event = instance.get_latest_materialization_event(dg.AssetKey(name))
            return {k: getattr(v, "value", v) for k, v in event.asset_materialization.metadata.items()}

        for check in [("extraction_plan", "fits_on_disk"), ("hidden_states", "bytes_match_plan"),
                      ("hidden_states", "manifest_checksums"), ("drafter_checkpoint", "export_matches_sglang")]:
            record = instance.get_latest_asset_check_evaluation_record(
                dg.AssetCheckKey(dg.AssetKey(check[0]), check[1])
            )
            assert record is not None and record.status.value == "SUCCEEDED", check

        target = meta("target_model")
        assert target["tokens_seen"] >= 40_000
        assert target["final_loss"] < 6.0
        merged = meta("merged_train")
        assert merged["num_records"] >= 5 and merged["num_shards"] >= 2
        bench = meta("benchmark_report")
        assert bench["acceptance_length"] >= 1.0


def test_retried_extraction_resumes_from_the_manifest(pipeline_run, tmp_path) -> None:
    """A run that died after writing shard-00000 but before recording shard-00001 is retried:
    the recorded shard is skipped, untouched; the unrecorded one is redone, byte for byte."""
    home, proc = pipeline_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    env_profile = home.parent / "micro.yaml"
    from definitions import build_definitions
    from eagle3_dagster.config import load_profile_file

    profile = load_profile_file(env_profile)
    version_dir = next((Path(profile.hidden.root)).glob("hs-*"))
    first, second = version_dir / "shard-00000.safetensors", version_dir / "shard-00001.safetensors"
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (first, second)}
    (version_dir / "shard-00001.manifest.json").unlink()  # the crash: renamed, never recorded
    defs = build_definitions(profile)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for key in ["shard-00000", "shard-00001"]:
            result = defs.resolve_job_def("extract_job").execute_in_process(instance=instance, partition_key=key)
            assert result.success
            meta = result.asset_materializations_for_node("hidden_states")[0].metadata
            assert meta["resumed_shards"].value == (1 if key == "shard-00000" else 0)
            checks = {c.check_name: c.passed for c in result.get_asset_check_evaluations()}
            assert checks == {"bytes_match_plan": True, "manifest_checksums": True}
    assert first.stat().st_mtime_ns == before[first][0]
    assert second.read_bytes() == before[second][1]
    assert (version_dir / "shard-00001.manifest.json").exists()


def test_torchrun_streams_per_step_metrics_into_the_run_log_through_pipes(pipeline_run) -> None:
    home, proc = pipeline_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    with dg.DagsterInstance.from_config(str(home)) as instance:
        (run,) = [r for r in instance.get_runs() if r.job_name == "train_job"]
        messages = [e.user_message for e in instance.all_logs(run.run_id)]
    assert any("opened dagster pipes" in m for m in messages)
    steps = [m for m in messages if m.startswith("step ")]
    assert steps and "loss" in steps[-1] and "acc_0" in steps[-1]
