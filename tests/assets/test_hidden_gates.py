"""extraction_plan's disk gate and the cleanup job, run in-process against a real Dagster instance.

A plan whose shards do not fit in the free space fails its blocking `fits_on_disk` check, and a
shard run (from a job, the UI or a backfill) is then refused before it writes a byte. The cleanup
job lists superseded hidden-state versions in a dry run and deletes them, never the planned one,
when asked. The target is the real micro target and merged_train a real jsonl file; the only thing
replaced is the free-space reading, since a test cannot make a real disk small.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pytest
import torch

from assets.metadata_legend import undescribed
from definitions import build_definitions
from eagle3_dagster.config import load_profile
from eagle3_dagster.contracts import ArtifactLayout
from eagle3_dagster.io import write_jsonl
from resources.gpu_host import GpuHostResource
from resources.profile import ProfileResource

LENGTHS = [5, 17, 9, 30, 2, 12, 3]
CLEANUP_OP = "cleanup_superseded_hidden_states"


class SmallDiskHost(GpuHostResource):
    """The real GPU-host resource, reporting `free` bytes where the shards go."""

    free: int = 1024

    def free_bytes(self, path: str) -> int:
        return self.free


@pytest.fixture
def setup(tmp_path, micro_target):
    profile = load_profile(
        "micro", overrides={"run_root": str(tmp_path / "run"), "hidden": {"root": str(tmp_path / "hidden")}}
    )
    layout = ArtifactLayout.from_profile(profile)
    shutil.copytree(micro_target, layout.target_dir)
    g = torch.Generator().manual_seed(0)
    layout.merged_train.parent.mkdir(parents=True)
    write_jsonl(
        layout.merged_train,
        [
            {
                "id": f"sharegpt/{i}",
                "dataset": "sharegpt",
                "input_ids": torch.randint(0, 512, (n,), generator=g).tolist(),
                "loss_mask": [int(j >= n // 2) for j in range(n)],
            }
            for i, n in enumerate(LENGTHS)
        ],
    )
    defs = build_definitions(profile)
    with dg.instance_for_test() as instance:
        yield profile, layout, defs, instance


def _plan(profile, instance: dg.DagsterInstance, gpu_host: GpuHostResource) -> dg.ExecuteInProcessResult:
    """extraction_plan as the code location builds it, materialized with `gpu_host` as its resource."""
    [plan] = [
        a
        for a in build_definitions(profile).assets
        if isinstance(a, dg.AssetsDefinition) and a.key == dg.AssetKey("extraction_plan")
    ]
    return dg.materialize(
        [plan],
        instance=instance,
        raise_on_error=False,
        resources={"gpu_host": gpu_host, "profile": ProfileResource.of(profile)},
    )


def test_a_plan_larger_than_the_free_space_fails_its_blocking_check_and_no_shard_runs(setup):
    profile, layout, defs, instance = setup
    plan = _plan(profile, instance, SmallDiskHost(free=1024))
    # The failed blocking check fails the step, after the plan is recorded: it says how much space is missing.
    assert not plan.success
    [check] = plan.get_asset_check_evaluations()
    assert check.check_name == "fits_on_disk" and not check.passed
    meta = plan.asset_materializations_for_node("extraction_plan")[0].metadata
    assert meta["fits"].value is False and meta["free_bytes"].value == 1024
    assert "| `fits` | needed_bytes <= free_bytes" in meta["metadata_legend"].value
    assert not undescribed("extraction_plan", meta)
    assert meta["remaining_bytes"].value > 1024
    keys = [f"shard-{i:05d}" for i in range(meta["num_shards"].value)]
    instance.add_dynamic_partitions("hidden_state_shards", keys)
    run = defs.resolve_job_def("extract_job").execute_in_process(
        instance=instance, partition_key=keys[0], raise_on_error=False
    )
    assert not run.success
    [failure] = [e for e in run.all_events if e.event_type_value == "STEP_FAILURE"]
    message = failure.step_failure_data.error.message + str(failure.step_failure_data.user_failure_data)
    assert "fits_on_disk check failed" in message and "cleanup_hidden_states" in message
    assert not list(Path(profile.hidden.root).rglob("*.safetensors"))


def test_the_same_plan_with_room_enough_passes_and_its_shard_runs(setup):
    """The counterpart: the gate opens on a disk with space, so the refusal above is the gate's doing."""
    profile, layout, defs, instance = setup
    plan = _plan(profile, instance, SmallDiskHost(free=1 << 40))
    [check] = plan.get_asset_check_evaluations()
    assert plan.success and check.passed
    instance.add_dynamic_partitions("hidden_state_shards", ["shard-00000"])
    run = defs.resolve_job_def("extract_job").execute_in_process(instance=instance, partition_key="shard-00000")
    assert run.success
    assert len(list(Path(profile.hidden.root).rglob("shard-00000.safetensors"))) == 1


def test_cleanup_job_lists_superseded_versions_in_a_dry_run_and_deletes_only_them_when_asked(setup):
    profile, layout, defs, instance = setup
    plan = _plan(profile, instance, GpuHostResource.from_profile(profile))
    assert plan.success
    current = Path(str(plan.asset_materializations_for_node("extraction_plan")[0].metadata["version_dir"].value))
    old = Path(layout.hidden_root) / "hs-0123456789ab"
    old.mkdir(parents=True)
    (old / "shard-00000.safetensors").write_bytes(b"x" * 300)
    job = defs.resolve_job_def("cleanup_hidden_states")

    def cleanup(dry_run: bool) -> dict:
        result = job.execute_in_process(
            instance=instance, run_config={"ops": {CLEANUP_OP: {"config": {"dry_run": dry_run}}}}
        )
        assert result.success
        [observation] = result.asset_observations_for_node(CLEANUP_OP)
        assert observation.asset_key == dg.AssetKey("extraction_plan")
        return {k: v.value for k, v in observation.metadata.items()}

    default = job.execute_in_process(instance=instance)  # no config: a dry run
    assert default.success and old.exists()
    listed = cleanup(dry_run=True)
    assert listed["dry_run"] is True and listed["freed_bytes"] == 300
    assert [r["path"] for r in listed["removed"]] == [str(old)]
    assert old.exists() and current.exists()
    done = cleanup(dry_run=False)
    assert done["dry_run"] is False and [r["version"] for r in done["removed"]] == ["hs-0123456789ab"]
    assert not old.exists() and (current / "plan.json").exists()


def test_force_reextracts_a_complete_shard_and_replaces_it_whole_while_a_plain_run_skips_it(setup):
    """`force: true` in the launchpad re-extracts a shard its manifest calls complete: a new file (new inode)
    renamed over the old one, with the same bytes (extraction is deterministic); without it the shard is
    skipped and its file left untouched."""
    profile, layout, defs, instance = setup
    assert _plan(profile, instance, SmallDiskHost(free=1 << 40)).success
    instance.add_dynamic_partitions("hidden_state_shards", ["shard-00000"])
    job = defs.resolve_job_def("extract_job")

    def extract(**config) -> dict:
        run_config = {"ops": {"hidden_states": {"config": config}}} if config else None
        run = job.execute_in_process(instance=instance, partition_key="shard-00000", run_config=run_config)
        assert run.success
        [materialization] = run.asset_materializations_for_node("hidden_states")
        return {k: v.value for k, v in materialization.metadata.items()}

    first = extract()
    [shard] = Path(profile.hidden.root).rglob("shard-00000.safetensors")
    before, data = shard.stat(), shard.read_bytes()

    skipped = extract()
    assert skipped["resumed_shards"] == 1 and skipped["forced"] is False
    assert (shard.stat().st_ino, shard.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    forced = extract(force=True)
    after = shard.stat()
    assert forced["forced"] is True and forced["resumed_shards"] == 0
    assert after.st_ino != before.st_ino and after.st_mtime_ns >= before.st_mtime_ns
    assert shard.read_bytes() == data
    assert forced["shard_sha256"] == first["shard_sha256"]
    assert not list(shard.parent.glob(".*.tmp"))  # the temp was renamed into place, nothing left behind
    for meta in (first, forced):  # every key the asset page shows is described in its legend
        assert "metadata_legend" in meta and not undescribed("hidden_states", meta)
