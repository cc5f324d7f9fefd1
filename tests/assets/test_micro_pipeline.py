"""The README's demo command, end to end through Dagster, at micro size.

Reads the session's micro run (`micro_run`, tests/micro_run.py): `scripts/run_pipeline.py` (what
`scripts/demo.sh` runs) in a subprocess against a fresh instance whose `dagster.yaml` is the checked-in
production one (dagster_home/dagster.yaml with its storage in PostgreSQL), with the micro profile
pointed at a temp folder. The tests read the instance the way the UI does: every asset materialized,
every shard partition present, the checks passed and the figures within their bounds. The tests that
edit shards or add runs work on a private copy of it on a SQLite instance (dagster_home/dagster.yaml).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import dagster as dg
import pytest

from tests.micro_run import MICRO_ASSETS as ASSETS
from tests.micro_run import ROOT, MicroRun, private_copy

pytestmark = [
    pytest.mark.slow,  # the demo pipeline end to end in a subprocess
    pytest.mark.xdist_group("micro_run"),
]  # one worker builds the session's micro run (tests/conftest.py)


@pytest.fixture(scope="module")
def edited_run(micro_run, tmp_path_factory) -> MicroRun:
    """A copy of the session's micro run for the tests that edit shards and add runs (in file order)."""
    copy = private_copy(micro_run, tmp_path_factory.mktemp("micro_run_copy"))
    assert copy.proc.returncode == 0, copy.output()
    return copy


def test_demo_command_materializes_every_asset_through_dagster(micro_run: MicroRun) -> None:
    with micro_run.instance() as instance:
        for name in ASSETS:
            assert instance.get_latest_materialization_event(dg.AssetKey(name)) is not None, name
        shards = instance.get_dynamic_partitions("hidden_state_shards")
        assert len(shards) >= 2
        done = instance.get_materialized_partitions(dg.AssetKey("hidden_states"))
        assert done == set(shards)
        runs = instance.get_runs()
        assert runs and all(r.tags.get("eagle3/profile") == "micro" for r in runs)


def test_checks_pass_and_figures_are_within_bounds(micro_run: MicroRun) -> None:
    with micro_run.instance() as instance:

        def meta(name: str) -> dict:
            event = instance.get_latest_materialization_event(dg.AssetKey(name))
            return {k: getattr(v, "value", v) for k, v in event.asset_materialization.metadata.items()}

        for check in [
            ("extraction_plan", "fits_on_disk"),
            ("hidden_states", "bytes_match_plan"),
            ("hidden_states", "manifest_checksums"),
            ("drafter_checkpoint", "export_matches_sglang"),
        ]:
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
        # >= 1.0 would hold for any drafter (the bonus token): the trained one must beat its untrained twin
        assert bench["acceptance_length"] > bench["untrained_acceptance_length"]


def test_retried_extraction_resumes_from_the_manifest(edited_run: MicroRun, tmp_path) -> None:
    """A run that died after writing shard-00000 but before recording shard-00001 is retried:
    the recorded shard is skipped, untouched; the unrecorded one is redone, byte for byte."""
    from definitions import build_definitions
    from eagle3_dagster.config import load_profile_file

    profile = load_profile_file(edited_run.profile)
    version_dir = next((Path(profile.hidden.root)).glob("hs-*"))
    first, second = version_dir / "shard-00000.safetensors", version_dir / "shard-00001.safetensors"
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (first, second)}
    (version_dir / "shard-00001.manifest.json").unlink()  # the crash: renamed, never recorded
    defs = build_definitions(profile)
    with edited_run.instance() as instance:
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


def test_torchrun_streams_per_step_metrics_into_the_run_log_through_pipes(micro_run: MicroRun) -> None:
    with micro_run.instance() as instance:
        (run,) = [r for r in instance.get_runs() if r.job_name == "train_job"]
        messages = [e.user_message for e in instance.all_logs(run.run_id)]
    assert any("opened dagster pipes" in m for m in messages)
    steps = [m for m in messages if m.startswith("train: ")]
    assert steps and PROGRESS.match(steps[-1]) and "loss" in steps[-1] and "acc_0" in steps[-1]


# The progress contract (eagle3_dagster.stages.ProgressMeter): label: done/total unit (pct), rate unit/s, ETA
PROGRESS = re.compile(r"^(\S+): ([\d,]+)/([\d,]+) (\w+) \((\d+\.\d)%\), ([\d.,]+) \4/s, ETA \d+:\d\d:\d\d")


def test_long_stages_log_progress_by_the_contract(micro_run: MicroRun) -> None:
    with micro_run.instance() as instance:
        for job, unit in [
            ("target_job", "steps"),
            ("data_job", "conversations"),
            ("extract_job", "tokens"),
            ("train_job", "steps"),
        ]:
            runs = [r for r in instance.get_runs() if r.job_name == job and r.status == dg.DagsterRunStatus.SUCCESS]
            assert runs, job
            measured = 0
            for run in runs:
                messages = [e.user_message for e in instance.all_logs(run.run_id) if e.user_message]
                assert not [m for m in messages if re.fullmatch(r"[\d\s]+", m)], f"{job}: bare numbers in the log"
                lines = [m for m in messages if PROGRESS.match(m) and PROGRESS.match(m).group(4) == unit]
                if not lines:  # a shard already complete in the manifest is skipped, and says so
                    assert any(m.endswith("complete in the manifest, skipped") for m in messages), messages[:20]
                    continue
                done, total = (int(PROGRESS.match(lines[-1]).group(i).replace(",", "")) for i in (2, 3))
                assert done == total, lines[-1]
                measured += 1
            assert measured, f"{job}: no run reported progress"


def test_a_drafter_is_audited_from_its_materialization_alone(micro_run: MicroRun) -> None:
    """From drafter_checkpoint's materialization, follow each link to the event that produced it."""
    with micro_run.instance() as instance:

        def latest(asset: str, partition: str | None = None):
            records = instance.fetch_materializations(
                dg.AssetRecordsFilter(
                    asset_key=dg.AssetKey(asset), asset_partitions=[partition] if partition else None
                ),
                limit=1,
            ).records
            return records[0].asset_materialization

        drafter = latest("drafter_checkpoint")
        meta = {k: getattr(v, "value", v) for k, v in drafter.metadata.items()}
        assert meta["target_identity"] == latest("target_model").tags["dagster/data_version"]
        assert meta["merged_train_sha256"] == latest("merged_train").tags["dagster/data_version"]
        shards = {r.data["shard"]: r.data["sha256"] for r in drafter.metadata["shards"].records}
        assert set(shards) == instance.get_materialized_partitions(dg.AssetKey("hidden_states"))
        assert len(set(shards.values())) == len(shards), "every shard has its own data version"
        for key, sha in shards.items():
            shard = latest("hidden_states", key)
            assert shard.tags["dagster/data_version"] == sha
            assert shard.metadata["version"].value == meta["hidden_version"]
        # the commit the code ran at: HEAD then, an ancestor of HEAD now (commits may land during the test)
        assert re.fullmatch(r"[0-9a-f]{40}", meta["git_sha"]), meta["git_sha"]
        ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", meta["git_sha"], "HEAD"], cwd=ROOT)
        assert ancestor.returncode == 0, meta["git_sha"]
        assert meta["packages"]["dagster"] == dg.__version__ and "torch" in meta["packages"]
        assert meta["code_version"] == drafter.tags["dagster/code_version"]
        assert meta["settings"]["train"]["lr"] == 0.003 and "data.max_seq_len" in meta["settings"]
        weights = Path(meta["export_dir"]) / "model.safetensors"
        assert drafter.tags["dagster/data_version"] == hashlib.sha256(weights.read_bytes()).hexdigest()


def test_a_shard_run_is_refused_when_the_plan_was_evaluated_for_another_root(edited_run: MicroRun, tmp_path) -> None:
    """The disk check belongs to the plan it guards: after hidden.root moves (to a small disk, say),
    the latest fits_on_disk verdict is about the old root and must not let a shard run write the new one."""
    from definitions import build_definitions
    from eagle3_dagster.config import load_profile_file

    moved = load_profile_file(edited_run.profile, overrides={"hidden": {"root": str(tmp_path / "small")}})
    defs = build_definitions(moved)
    with edited_run.instance() as instance:
        result = defs.resolve_job_def("extract_job").execute_in_process(
            instance=instance, partition_key="shard-00000", raise_on_error=False
        )
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = failure.step_failure_data.error.message + str(failure.step_failure_data.user_failure_data)
    assert "plan mismatch" in message and str(tmp_path / "small") in message
    assert not (tmp_path / "small").exists() or not any((tmp_path / "small").rglob("*.safetensors"))


def test_a_shard_failing_its_checksum_never_passes_as_extracted(edited_run: MicroRun) -> None:
    """A flipped byte (same size) in a finished shard: the shard run either re-extracts it or fails on the
    blocking manifest check; it never succeeds with bytes that do not match the manifest."""
    from definitions import build_definitions
    from eagle3_dagster.config import load_profile_file
    from eagle3_dagster.hidden.shards import load_manifest, verify_shard

    profile = load_profile_file(edited_run.profile)
    version_dir = next(Path(profile.hidden.root).glob("hs-*"))
    path = version_dir / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with edited_run.instance() as instance:
        result = (
            build_definitions(profile)
            .resolve_job_def("extract_job")
            .execute_in_process(instance=instance, partition_key="shard-00001", raise_on_error=False)
        )
    checks = {c.check_name: c.passed for c in result.get_asset_check_evaluations()}
    if result.success:
        verify_shard(path, load_manifest(version_dir)["shard-00001"])
        assert checks["manifest_checksums"]
    else:
        assert checks["manifest_checksums"] is False
