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



def stages(defs: dg.Definitions) -> list[tuple[str, list[dg.AssetSpec]]]:
    """The code location's jobs (`automation.JOBS`) with the specs of what each materializes, in graph order:
    a job runs after every job materializing an asset it depends on."""
    specs = {spec.key.to_user_string(): spec for spec in defs.resolve_all_asset_specs()}
    order = toposorted({key: [d.asset_key.to_user_string() for d in spec.deps] for key, spec in specs.items()})
    defined = {job.name for job in defs.jobs}  # target_job only for a tiny target
    jobs = [(name, [specs[a] for a in assets]) for name, (assets, _) in automation.JOBS.items() if name in defined]
    return sorted(jobs, key=lambda job: min(order.index(s.key.to_user_string()) for s in job[1]))


def toposorted(parents: dict[str, list[str]]) -> list[str]:
    done: list[str] = []

    def visit(key: str, path: tuple[str, ...]) -> None:
        if key in done:
            return
        if key in path:
            raise ValueError(f"the asset graph has a cycle: {' → '.join((*path, key))}")
        for parent in sorted(parents.get(key, ())):
            visit(parent, (*path, key))
        done.append(key)

    for key in sorted(parents):
        visit(key, ())
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default=os.environ.get("EAGLE3_PROFILE", "demo"))
    parser.add_argument("--until", help="stop after this stage: a job name without `_job` (default: the last)")
    parser.add_argument("--from", dest="start",
                        help="start at this stage (the earlier ones must have been materialized; default: the first)")
    args = parser.parse_args(argv)

    from definitions import build_definitions

    profile = load_profile(args.profile)
    defs = build_definitions(profile)
    order = stages(defs)
    names = [name.removesuffix("_job") for name, _ in order]
    for given in (args.start, args.until):
        if given is not None and given not in names:
            parser.error(f"no stage {given!r} in profile {profile.profile!r}; its stages, in order: {', '.join(names)}")
    first = names.index(args.start) if args.start else 0
    last = names.index(args.until) if args.until else len(names) - 1
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

    for job_name, specs in order[first:last + 1]:
        partitions = next((s.partitions_def for s in specs if s.partitions_def is not None), None)
        if partitions is None:
            run(job_name)
        else:
            keys = instance.get_dynamic_partitions(partitions.name) if isinstance(
                partitions, dg.DynamicPartitionsDefinition) else partitions.get_partition_keys()
            for key in keys:
                run(job_name, key)
        register_shards(defs, instance)  # what the sensor would do once merged_train is materialized
    print(f"pipeline finished in {time.monotonic() - t0:.0f}s; open the UI with scripts/ui.sh", flush=True)
    return 0


def register_shards(defs: dg.Definitions, instance: dg.DagsterInstance) -> None:
    """Apply the sensor's requests now instead of waiting for the daemon's next tick."""
    sensor = defs.resolve_sensor_def("register_shard_partitions")
    event = instance.get_latest_materialization_event(dg.AssetKey("merged_train"))
    if event is None:
        return
    num = event.asset_materialization.metadata["num_shards"].value
    result = automation.shard_partition_requests(instance, int(num))
    if not result.dynamic_partitions_requests:
        return  # registered already
    for request in result.dynamic_partitions_requests or []:
        if isinstance(request, dg.AddDynamicPartitionsRequest):
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        elif isinstance(request, dg.DeleteDynamicPartitionsRequest):
            for key in request.partition_keys:
                instance.delete_dynamic_partition(request.partitions_def_name, key)
    print(f"    {sensor.name}: {num} shard partitions registered", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
