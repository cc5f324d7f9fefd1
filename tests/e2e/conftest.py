"""A real Dagster deployment on loopback for the operational tests.

Each test module gets its own instance (a temporary DAGSTER_HOME holding a copy
of the project's dagster.yaml with shorter monitoring intervals, the same keys)
and one `dagster dev` process group (webserver + daemon + code server) started
from Python in a new session, so SIGINT to the group stops it cleanly.
Tests talk to it only as a user would: GraphQL over HTTP and a browser.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from dagster_graphql import DagsterGraphQLClient

from tests.sshd_server import free_port

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
TERMINAL = {"SUCCESS", "FAILURE", "CANCELED"}
# Speed only: the crash test needs a dead run's pool slot back in seconds, not minutes.
FAST_MONITORING = {"poll_interval_seconds": 2, "free_slots_after_run_end_seconds": 3}
# Speed only: the daemon takes queued runs every second instead of every 5 (Dagster's default, which the project's
# instance keeps): each queued run waited ~5 s before its run worker started, and the e2e tests queue their runs
# one after another (each shard run waits for the one before it on the gpu_host pool).
DEQUEUE_INTERVAL_S = 1
DAEMONS = {"SCHEDULER", "SENSOR", "QUEUED_RUN_COORDINATOR"}

RUN_QUERY = """
query Run($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run { runId status startTime endTime tags { key value } }
    ... on PythonError { message }
  }
}
"""


def wait_for_file(path: Path, timeout_s: float, what: str) -> dict:
    """The JSON a process under test writes (atomically) to say where it is."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {path} not written within {timeout_s} s")
        time.sleep(0.2)
    return json.loads(path.read_text())


def write_instance_yaml(home: Path, monitoring: dict[str, Any] = FAST_MONITORING) -> Path:
    """The project's instance config, with only the intervals in `monitoring` and the run queue's changed."""
    config = yaml.safe_load((REPO / "dagster_home" / "dagster.yaml").read_text())
    unknown = set(monitoring) - set(config["run_monitoring"])
    if unknown:
        raise KeyError(f"dagster_home/dagster.yaml run_monitoring has no {sorted(unknown)}")
    config["run_monitoring"].update(monitoring)
    config["run_coordinator"].setdefault("config", {})["dequeue_interval_seconds"] = DEQUEUE_INTERVAL_S
    home.mkdir(parents=True, exist_ok=True)
    path = home / "dagster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def write_profile(dest: Path, name: str = "micro", overrides: dict[str, dict[str, Any]] | None = None) -> Path:
    """The named profile with every output under `dest`, so a test never touches the checkout's .eagle3/,
    and the settings in `overrides` (section -> {setting: value}) changed."""
    config = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    for section, settings in (overrides or {}).items():
        config.setdefault(section, {}).update(settings)
    config["run_root"] = str(dest / "run")
    config.setdefault("hidden", {})["root"] = str(dest / "run" / "hidden_states")
    path = dest / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def write_workspace(dest: Path, python_file: Path, location_name: str) -> Path:
    path = dest / "workspace.yaml"
    entry = {"relative_path": str(python_file), "working_directory": str(REPO), "location_name": location_name}
    path.write_text(yaml.safe_dump({"load_from": [{"python_file": entry}]}))
    return path


class GraphQLError(RuntimeError):
    pass


@dataclass
class DagsterDeployment:
    """One running `dagster dev`: its URL, its instance folder, and the calls the tests make against it."""

    home: Path
    port: int
    location_name: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def client(self) -> DagsterGraphQLClient:
        return DagsterGraphQLClient("127.0.0.1", port_number=self.port, timeout=60)

    def graphql(self, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        response = httpx.post(f"{self.url}/graphql", json={"query": query, "variables": variables or {}}, timeout=60)
        response.raise_for_status()
        body = response.json()
        if body.get("errors"):
            raise GraphQLError(f"GraphQL errors: {body['errors']}")
        return body["data"]

    def submit(self, job_name: str, **kwargs: Any) -> str:
        return self.client.submit_job_execution(
            job_name, repository_location_name=self.location_name, repository_name="__repository__", **kwargs
        )

    def run(self, run_id: str) -> dict[str, Any]:
        result = self.graphql(RUN_QUERY, {"runId": run_id})["runOrError"]
        if result["__typename"] != "Run":
            raise GraphQLError(f"run {run_id}: {result}")
        return result

    def wait_for_run(self, run_id: str, timeout_s: float = 300, statuses: set[str] = TERMINAL) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            run = self.run(run_id)
            if run["status"] in statuses:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} still {run['status']} after {timeout_s:.0f} s\n{self.log_tail()}")
            time.sleep(0.5)

    def run_log(self, run_id: str) -> str:
        """The run's structured log messages, to put in an assertion message when a run fails."""
        query = """query Logs($runId: ID!) { logsForRun(runId: $runId) { __typename
          ... on EventConnection { events { __typename ... on MessageEvent { message } } } } }"""
        events = self.graphql(query, {"runId": run_id})["logsForRun"].get("events", [])
        return "\n".join(e.get("message", "") for e in events if e.get("message"))

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _ready(dep: DagsterDeployment) -> bool:
    query = """{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus
                   locationOrLoadError { __typename ... on PythonError { message } } } } }
                 instance { daemonHealth { allDaemonStatuses { daemonType healthy } } } }"""
    try:
        data = dep.graphql(query)
    except (httpx.HTTPError, GraphQLError):
        return False
    entries = {e["name"]: e for e in data["workspaceOrError"]["locationEntries"]}
    entry = entries.get(dep.location_name)
    if entry is None or entry["loadStatus"] != "LOADED":
        return False
    if entry["locationOrLoadError"]["__typename"] == "PythonError":
        raise RuntimeError(f"code location {dep.location_name} failed to load: {entry['locationOrLoadError']}")
    healthy = {d["daemonType"] for d in data["instance"]["daemonHealth"]["allDaemonStatuses"] if d["healthy"]}
    return DAEMONS <= healthy


def stop_process_group(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGINT is how `dagster dev` shuts down its children; SIGKILL whatever is left of the group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@contextmanager
def dagster_dev(
    workspace: Path, home: Path, location_name: str, env: dict[str, str] | None = None, startup_s: float = 120
) -> Iterator[DagsterDeployment]:
    port = free_port()
    log_path = home / "dagster_dev.log"
    full_env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }
    dagster = Path(sys.executable).with_name("dagster")
    # What scripts/ui.sh does before `dagster dev`: the pool limits the profile implies (one gpu_host slot
    # per GPU host) must exist before runs queue.
    limits = subprocess.run(
        [sys.executable, "-m", "eagle3_dagster.cli", "pool-limits"],
        env=full_env,
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for pool, limit in zip(limits[::2], limits[1::2]):
        subprocess.run(
            [str(dagster), "instance", "concurrency", "set", pool, limit],
            env=full_env,
            cwd=REPO,
            check=True,
            capture_output=True,
        )
    cmd = [str(dagster), "dev", "-w", str(workspace), "-h", "127.0.0.1", "-p", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    dep = DagsterDeployment(home=home, port=port, location_name=location_name, proc=proc, log_path=log_path)
    try:
        deadline = time.monotonic() + startup_s
        while not _ready(dep):
            if proc.poll() is not None:
                raise RuntimeError(f"dagster dev exited with {proc.returncode}:\n{dep.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"dagster dev not ready after {startup_s:.0f} s:\n{dep.log_tail()}")
            time.sleep(0.5)
        yield dep
    finally:
        stop_process_group(proc)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module")
def micro_deployment(tmp_path_factory) -> Iterator[DagsterDeployment]:
    """The project's own code location (workspace.yaml → definitions.py) on the micro profile."""
    root = tmp_path_factory.mktemp("micro_deployment")
    home = root / "dagster_home"
    write_instance_yaml(home)
    # Shards of 8 samples: the records the micro target leaves (20 here; the count differs by machine) make
    # 2-3 shards, not 5, so the UI test's backfill of 2 covers most of them and few shard runs follow it one
    # at a time (each is a run process, a driver start and the asset checks: ~15 s of CPU apiece).
    # The automation's cron ticks once a year, not every 10 minutes: the test launches every shard run itself
    # (the backfill, then one extract_job run each), and a tick between merged_train and the backfill requested
    # the same shards, whose backfill runs then found them complete and logged no progress.
    profile = write_profile(root, "micro", {"hidden": {"samples_per_shard": 8, "backfill_cron": "0 0 1 1 *"}})
    with dagster_dev(REPO / "workspace.yaml", home, "eagle3_dagster", env={"EAGLE3_PROFILE": str(profile)}) as dep:
        yield dep


@pytest.fixture(scope="module")
def fixture_deployment(tmp_path_factory) -> Iterator[DagsterDeployment]:
    """The test-only code location of fixture_defs.py (fake GPU assets in pool gpu_host)."""
    root = tmp_path_factory.mktemp("fixture_deployment")
    home = root / "dagster_home"
    write_instance_yaml(home)
    workspace = write_workspace(root, Path(__file__).with_name("fixture_defs.py"), "e2e_fixture")
    with dagster_dev(workspace, home, "e2e_fixture", env={"E2E_SCRATCH": str(root / "scratch")}) as dep:
        yield dep
