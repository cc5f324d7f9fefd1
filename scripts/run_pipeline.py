"""Materialize the whole graph for one profile through the Dagster instance in $DAGSTER_HOME, as the UI does.

Each stage's job is submitted to the instance through the code location of workspace.yaml, as the
launchpad submits it (Dagster's GraphQL client against the webserver; the daemon takes the queued run and
the code server starts its run worker), in graph order: the target, each dataset partition, the corpus,
the shard partitions (registered as the sensor registers them), the drafter and the report. So the runs
show on the UI's Jobs and Overview pages, linked to their job. When `scripts/ui.sh` serves this instance,
the runs go through it; otherwise `dagster dev` is started for the duration (its output in
$DAGSTER_HOME/pipeline_dagster_dev.log). Running it again re-materializes (stages resume where their engine
can). It ends with a summary: each stage's seconds and the headline figures, beside the expected ranges
of docs/demo_figures.yaml.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import dagster as dg  # noqa: E402  (the checkout and scripts/ are put on sys.path above)

import dagster_dev  # noqa: E402  (the checkout and scripts/ are put on sys.path above)
import demo_summary  # noqa: E402  (the checkout and scripts/ are put on sys.path above)
from assets import automation  # noqa: E402  (the checkout and scripts/ are put on sys.path above)
from assets._common import PROFILE_TAG  # noqa: E402  (the checkout and scripts/ are put on sys.path above)
from eagle3_dagster.config import load_profile  # noqa: E402  (the checkout and scripts/ are put on sys.path above)
from eagle3_dagster.ports import free_port  # noqa: E402  (the checkout and scripts/ are put on sys.path above)

PARTITION_TAG = "dagster/partition"
DONE = {"SUCCESS", "FAILURE", "CANCELED"}
UI_URL_FILE = dagster_dev.UI_URL_FILE
READY_S = 300  # dagster dev loads the code location in ~10 s here; a loaded machine takes longer
LOGS = """
query Logs($runId: ID!, $after: String) {
  logsForRun(runId: $runId, afterCursor: $after) {
    __typename
    ... on EventConnection { cursor events { __typename
      ... on MessageEvent { message level }
      ... on ErrorEvent { error { message causes { message } } } } }
  }
}"""
LOCATIONS = "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus } } } }"
JOB_TAGS = "{ repositoriesOrError { ... on RepositoryConnection { nodes { pipelines { tags { key value } } } } } }"


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


class Launchpad:
    """What the UI's launchpad does, over the webserver's GraphQL API: submit a job's run, follow it."""

    def __init__(self, url: str) -> None:
        from dagster_graphql import DagsterGraphQLClient

        parsed = urlparse(url)
        self.url = url.rstrip("/")
        self.client = DagsterGraphQLClient(
            parsed.hostname or "127.0.0.1", port_number=parsed.port, use_https=parsed.scheme == "https", timeout=60
        )
        self._cursors: dict[str, str | None] = {}
        self.interrupted: list[int] = []  # stop signals received (dagster_dev.stop_signals)
        self.startup_s: float | None = None  # seconds the dagster dev started for it took to load the code location

    def query(self, text: str, variables: dict | None = None) -> dict:
        import requests

        response = requests.post(f"{self.url}/graphql", json={"query": text, "variables": variables or {}}, timeout=60)
        response.raise_for_status()
        body = response.json()
        if body.get("errors"):
            raise RuntimeError(f"GraphQL errors: {body['errors']}")
        return body["data"]

    def loaded(self) -> bool:
        try:
            entries = self.query(LOCATIONS)["workspaceOrError"].get("locationEntries", [])
        except Exception:  # not answering yet
            return False
        return bool(entries) and all(e["loadStatus"] == "LOADED" for e in entries)

    def served_profiles(self) -> set[str]:
        """The profiles the served code location's jobs run (their eagle3/profile tag)."""
        nodes = self.query(JOB_TAGS)["repositoriesOrError"].get("nodes", [])
        return {t["value"] for n in nodes for job in n["pipelines"] for t in job["tags"] if t["key"] == PROFILE_TAG}

    def submit(self, job_name: str, partition_key: str | None) -> str:
        return self.client.submit_job_execution(
            job_name, tags={PARTITION_TAG: partition_key} if partition_key else None
        )

    def status(self, run_id: str) -> str:
        return self.client.get_run_status(run_id).value

    def new_log_lines(self, run_id: str) -> list[str]:
        """The run's log messages (context.log, the engine's progress) and its errors (a step's, or the run's
        when its worker could not start) since the last call."""
        found = self.query(LOGS, {"runId": run_id, "after": self._cursors.get(run_id)})["logsForRun"]
        if found["__typename"] != "EventConnection":
            return []
        self._cursors[run_id] = found["cursor"]
        lines = []
        for event in found["events"]:
            error = event.get("error")
            if event["__typename"] == "LogMessageEvent" and event.get("level") != "DEBUG":
                lines.append(event["message"])
            elif error or event.get("level") == "ERROR":
                lines.append(event["message"])  # then the error and what caused it
                causes = (error or {}).get("causes") or []
                lines.extend(e["message"].strip() for e in [error, *causes] if e)
        return lines

    def terminate(self, run_ids: list[str], wait_s: float = 60) -> None:
        """Terminate the runs not done yet, as the UI's Terminate button does, and wait until they are."""
        left = [r for r in run_ids if self.status(r) not in DONE]
        for run_id in left:
            self.client.terminate_run(run_id)
        deadline = time.monotonic() + wait_s
        while left and time.monotonic() < deadline:
            time.sleep(1)
            left = [r for r in left if self.status(r) not in DONE]


def running_ui(home: Path) -> str | None:
    """The URL scripts/ui.sh serves this instance at, if it does (dagster_dev.py writes it while serving)."""
    path = home / UI_URL_FILE
    if not path.exists():
        return None
    url = path.read_text().strip()
    return url if Launchpad(url).loaded() else None


@contextmanager
def launchpad_for(home: Path, profile_arg: str, profile_name: str) -> Iterator[Launchpad]:
    """The running UI's, or one of a `dagster dev` started here for the profile and stopped after; stop
    signals (SIGINT, SIGTERM, SIGHUP) land in its `interrupted`."""
    with dagster_dev.stop_signals() as received:
        url = running_ui(home)
        if url is not None:
            served = Launchpad(url).served_profiles()
            if served != {profile_name}:
                raise SystemExit(
                    f"the UI at {url} serves this instance with profile {', '.join(sorted(served))}, "
                    f"not {profile_name}: stop scripts/ui.sh or start it with EAGLE3_PROFILE={profile_arg}"
                )
            print(f"submitting through the UI at {url} (scripts/ui.sh)", flush=True)
            pad = Launchpad(url)
            pad.interrupted = received
            yield pad
            return
        port = free_port()
        env = {**os.environ, "EAGLE3_PROFILE": profile_arg}
        t = time.monotonic()
        with open(home / "pipeline_dagster_dev.log", "ab") as log:
            proc = dagster_dev.start("127.0.0.1", port, env=env, log=log)
            try:
                pad = Launchpad(f"http://127.0.0.1:{port}")
                pad.interrupted = received
                deadline = time.monotonic() + READY_S
                while not pad.loaded():
                    if proc.poll() is not None or received or time.monotonic() > deadline:
                        raise SystemExit(f"dagster dev did not load the code location (see {log.name})")
                    time.sleep(0.5)
                pad.startup_s = time.monotonic() - t
                print(
                    f"dagster dev on http://127.0.0.1:{port}, code location loaded in {pad.startup_s:.1f}s", flush=True
                )
                yield pad
            finally:
                dagster_dev.stop(proc, interrupted=received)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default=os.environ.get("EAGLE3_PROFILE", "demo"))
    parser.add_argument("--until", help="stop after this stage: a job name without `_job` (default: the last)")
    parser.add_argument(
        "--from",
        dest="start",
        help="start at this stage (the earlier ones must have been materialized; default: the first)",
    )
    parser.add_argument(
        "--setup-s", type=float, help="seconds the set-up before took (scripts/demo.sh), for the summary"
    )
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
    home = Path(os.environ["DAGSTER_HOME"])
    t0 = time.monotonic()
    seconds: dict[str, float] = {}
    if args.setup_s is not None:
        seconds["set-up"] = args.setup_s
    with launchpad_for(home, args.profile, profile.profile) as pad:
        if pad.startup_s is not None:
            seconds["dagster dev"] = pad.startup_s
        for job_name, specs in order[first : last + 1]:
            partitions = next((s.partitions_def for s in specs if s.partitions_def is not None), None)
            keys: list[str | None] = [None]
            if partitions is not None:
                keys = list(
                    instance.get_dynamic_partitions(partitions.name)
                    if isinstance(partitions, dg.DynamicPartitionsDefinition)
                    else partitions.get_partition_keys()
                )
            t = time.monotonic()
            if not run_stage(pad, job_name, keys):
                return 130 if pad.interrupted else 1
            seconds[job_name.removesuffix("_job")] = time.monotonic() - t
            register_shards(defs, instance)  # what the sensor would do once merged_train is materialized
    print(f"pipeline finished in {time.monotonic() - t0:.0f}s; open the UI with scripts/ui.sh", flush=True)
    assets = [spec.key.to_user_string() for _, specs in order[first : last + 1] for spec in specs]
    print(demo_summary.summary(profile.profile, seconds, demo_summary.latest_metadata(instance, assets)), flush=True)
    return 0


def run_stage(pad: Launchpad, job_name: str, keys: list[str | None]) -> bool:
    """Submit one run per partition key (the queue runs them as the pools allow), follow them in order,
    print their log; on a failure, terminate the others. True when every run succeeded."""
    received = pad.interrupted
    t = time.monotonic()
    runs = [(key, pad.submit(job_name, key)) for key in keys]
    for i, (key, run_id) in enumerate(runs):
        label = f"{job_name}[{key}]" if key else job_name
        print(f"==> {label} (run {run_id})", flush=True)
        while (status := pad.status(run_id)) not in DONE and not received:
            for line in pad.new_log_lines(run_id):
                print(f"    {line}", flush=True)
            time.sleep(1)
        for line in pad.new_log_lines(run_id):
            print(f"    {line}", flush=True)
        if received or status != "SUCCESS":
            pad.terminate([r for _, r in runs[i:]])
            why = "interrupted" if received else status
            print(f"{why}: {label} (run {run_id}); see the run in the UI (scripts/ui.sh)", flush=True)
            return False
        print(f"    ok in {time.monotonic() - t:.1f}s", flush=True)
        t = time.monotonic()
    return True


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
