"""Production's target_model is observed on the GPU host: its data version is the model's identity,
so swapping the checkpoint gives a new data version (and marks everything downstream stale)."""

from __future__ import annotations

import json
import shutil
import sys

import dagster as dg

from assets import target_model
from eagle3_dagster.config import load_profile
from eagle3_dagster.target import target_identity
from resources.gpu_host import GpuHostResource, HostEntry
from resources.profile import ProfileResource


def _observe(model_dir, tmp_path, instance):
    profile = load_profile("micro", overrides={"target": {"kind": "external", "path": str(model_dir)}})
    asset = target_model.for_profile(profile)
    host = GpuHostResource(hosts=[HostEntry(python=sys.executable, workdir=str(tmp_path / "host"))])
    # observed as a job selecting it observes it (Dagster's public API for what dagster._core's observe() does)
    defs = dg.Definitions(
        assets=[asset],
        resources={"gpu_host": host, "profile": ProfileResource.of(profile)},
        jobs=[dg.define_asset_job("observe_target", selection=[asset.key])],
    )
    result = defs.resolve_job_def("observe_target").execute_in_process(instance=instance)
    assert result.success
    (event,) = [e for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"]
    return event.event_specific_data.asset_observation


def test_observation_reports_the_model_identity_and_a_new_checkpoint_changes_it(tmp_path, micro_target):
    copy = tmp_path / "model"
    shutil.copytree(micro_target, copy)
    with dg.instance_for_test() as instance:
        first = _observe(copy, tmp_path, instance)
        assert first.tags["dagster/data_version"] == target_identity(copy)
        assert first.metadata["num_layers"].value == 4 and first.metadata["hidden_size"].value == 64
        config = json.loads((copy / "config.json").read_text())
        config["rope_theta"] = config.get("rope_theta", 10000.0) * 2  # a different checkpoint's config
        (copy / "config.json").write_text(json.dumps(config))
        second = _observe(copy, tmp_path, instance)
        assert second.tags["dagster/data_version"] != first.tags["dagster/data_version"]
