"""drafter_checkpoint's `export_matches_sglang` is a blocking check that can fail: an export missing a weight
is materialized with the check failed, named only as `refused_export_dir`, and benchmark_report neither runs
on it in the same run nor reads it (or an older export behind it) later.

The asset runs for real around a training that has already written its run folder (the micro target's
untrained drafter, exported as training does): the gpu_host stand-in leases and launches nothing.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import dagster as dg

from tests.unit.test_stages_in_process import _finished_run, _merged_corpus


class TrainedElsewhere:
    """The gpu_host resource around a training that already ran: one host, nothing leased or launched."""

    hosts = [SimpleNamespace(name="gpu-0")]

    @contextmanager
    def lease_hosts(self, context, count, **_):
        yield []

    def run_pipes_on_hosts(self, **_):
        return SimpleNamespace(get_results=lambda: [])

    @contextmanager
    def lease(self, context, **_):
        raise AssertionError("benchmark_report leased a host to benchmark a refused export")
        yield


def test_an_export_missing_a_weight_fails_the_blocking_check_and_is_never_benchmarked(
    tmp_path, micro_target, monkeypatch
):
    import assets.drafter_checkpoint as module
    import eagle3_dagster.stages.train as train_stage
    import eagle3_dagster.train.nodes as nodes
    from definitions import build_definitions

    profile, layout = _merged_corpus(tmp_path, micro_target)
    runs = iter(
        [
            _finished_run(profile, layout, "run-good"),
            _finished_run(profile, layout, "run-bad", drop="midlayer.mlp.down_proj.weight"),
        ]
    )
    monkeypatch.setattr(train_stage, "prepare_training", lambda *a, **k: next(runs))
    monkeypatch.setattr(nodes, "node_commands", lambda *a, **k: [])
    monkeypatch.setattr(module, "plan_path_of", lambda plan: None)
    monkeypatch.setattr(module, "provenance_metadata", lambda profile, context: {})
    defs = build_definitions(profile)

    def materialize(instance, selection):
        return dg.materialize(
            list(defs.assets),
            instance=instance,
            resources={**defs.resources, "gpu_host": TrainedElsewhere()},
            selection=selection,
            raise_on_error=False,
        )

    def latest_meta(instance) -> dict:
        return instance.get_latest_materialization_event(
            dg.AssetKey("drafter_checkpoint")
        ).asset_materialization.metadata

    with dg.instance_for_test() as instance:
        good = materialize(instance, ["drafter_checkpoint"])
        assert good.success and [c.passed for c in good.get_asset_check_evaluations()] == [True]
        assert latest_meta(instance)["export_dir"].path == str(layout.drafter_dir / "run-good" / "export")

        bad = materialize(instance, ["drafter_checkpoint", "benchmark_report"])
        (check,) = bad.get_asset_check_evaluations()
        assert (check.check_name, check.passed) == ("export_matches_sglang", False)
        assert "midlayer.mlp.down_proj.weight" in check.metadata["detail"].value
        meta = latest_meta(instance)
        assert meta["refused_export_dir"].path == str(layout.drafter_dir / "run-bad" / "export")
        assert "export_dir" not in meta
        # blocking: the benchmark does not start in the run whose export failed
        assert not bad.success and "benchmark_report" not in {e.step_key for e in bad.all_events if e.is_step_start}
        assert instance.get_latest_materialization_event(dg.AssetKey("benchmark_report")) is None

        # nor later, on the refused export or the older one it replaced, and before leasing a host
        later = materialize(instance, ["benchmark_report"])
        (failure,) = [e for e in later.all_events if e.is_step_failure]
        assert (
            "failed its export_matches_sglang check and is not benchmarked"
            in failure.step_failure_data.error.to_string()
        )
