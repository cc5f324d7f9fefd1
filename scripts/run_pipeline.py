"""Materialize the whole graph for one profile through the Dagster instance in $DAGSTER_HOME.

Runs the same jobs the UI runs, in graph order: the target, each dataset
partition, the corpus, the shard partitions (registered by evaluating the real
sensor), the drafter and the report. Every run is recorded in the instance, so
`scripts/ui.sh` afterwards shows what was done; running it again re-materializes
(stages resume where their engine can).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dagster as dg  # noqa: E402

from assets import automation  # noqa: E402
from eagle3_dagster.config import load_profile  # noqa: E402

STAGES = ["target", "data", "corpus", "extract", "train"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default=os.environ.get("EAGLE3_PROFILE", "demo"))
    parser.add_argument("--until", choices=STAGES, default="train", help="stop after this stage")
    parser.add_argument("--from", dest="start", choices=STAGES, default=STAGES[0],
                        help="start at this stage (the earlier ones must have been materialized)")
    args = parser.parse_args(argv)

    from definitions import build_definitions

    profile = load_profile(args.profile)
    defs = build_definitions(profile)
    instance = dg.DagsterInstance.get()
    t0 = time.monotonic()

    def run(job_name: str, partition_key: str | None = None) -> None:
        t = time.monotonic()
        label = f"{job_name}[{partition_key}]" if partition_key else job_name
        print(f"==> {label}", flush=True)
        result = defs.resolve_job_def(job_name).execute_in_process(
            instance=instance, partition_key=partition_key, raise_on_error=False
        )
        if not result.success:
            print(f"FAILED: {label} (run {result.run_id}); see the run in the UI (scripts/ui.sh)", flush=True)
            raise SystemExit(1)
        print(f"    ok in {time.monotonic() - t:.1f}s (run {result.run_id})", flush=True)

    for stage in STAGES[STAGES.index(args.start):]:
        if stage == "target" and profile.target.kind == "tiny":
            run("target_job")
        elif stage == "data":
            for name in profile.dataset_names:
                run("data_job", name)
        elif stage == "corpus":
            run("corpus_job")
            register_shards(defs, instance)
        elif stage == "extract":
            for key in instance.get_dynamic_partitions("hidden_state_shards"):
                run("extract_job", key)
        elif stage == "train":
            run("train_job")
        if stage == args.until:
            break
    print(f"pipeline finished in {time.monotonic() - t0:.0f}s; open the UI with scripts/ui.sh", flush=True)
    return 0


def register_shards(defs: dg.Definitions, instance: dg.DagsterInstance) -> None:
    """Apply the sensor's requests now instead of waiting for the daemon's next tick."""
    sensor = defs.resolve_sensor_def("register_shard_partitions")
    event = instance.get_latest_materialization_event(dg.AssetKey("merged_train"))
    num = event.asset_materialization.metadata["num_shards"].value
    result = automation.shard_partition_requests(instance, int(num))
    for request in result.dynamic_partitions_requests or []:
        if isinstance(request, dg.AddDynamicPartitionsRequest):
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        elif isinstance(request, dg.DeleteDynamicPartitionsRequest):
            for key in request.partition_keys:
                instance.delete_dynamic_partition(request.partitions_def_name, key)
    print(f"    {sensor.name}: {num} shard partitions registered", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
