"""The production instance (deploy/postgres/dagster.yaml) against a real PostgreSQL server.

The session's micro run (`micro_run`, tests/micro_run.py) is `scripts/run_pipeline.py` with DAGSTER_HOME
holding a copy of the checked-in production config and a PostgreSQL server of the test's own
(tests/postgres_server.py: initdb into a temp folder, pg_ctl on a free loopback port). The tests read
PostgreSQL itself: the runs, the materializations and the shard partitions are rows there, and nothing
fell back to SQLite. The pool limits the scripts set (`dagster instance concurrency set`) live in the
same store, and a code server, a webserver and a daemon started as docs/deployment.md says run two GPU
runs submitted through the webserver's GraphQL (dagster_graphql's client) one at a time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster_graphql import DagsterGraphQLClient, DagsterGraphQLClientError, ReloadRepositoryLocationStatus

from tests.micro_run import MicroRun
from tests.sshd_server import free_port

pytestmark = [
    pytest.mark.slow,  # a PostgreSQL server, the micro pipeline on it, a code server, a webserver and a daemon
    pytest.mark.xdist_group("micro_run"),
]  # one worker builds the session's micro run (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
LOCATION = "eagle3_dagster"  # deploy/postgres/workspace.yaml's code location


def test_runs_materializations_and_partitions_are_rows_in_postgres(postgres, micro_run: MicroRun) -> None:
    home, env, proc = micro_run.home, micro_run.env, micro_run.proc
    with micro_run.instance() as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
        runs = instance.get_runs()
        assert runs and all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs), [r.status for r in runs]
        shards = set(instance.get_dynamic_partitions("hidden_state_shards"))
        assert len(shards) >= 2
        assert instance.get_materialized_partitions(dg.AssetKey("hidden_states")) == shards
        run_ids = {r.run_id for r in runs}
    # What the instance API said, read back from PostgreSQL itself.
    with postgres.connect(user="postgres", dbname="eagle3") as conn, conn.cursor() as cur:
        cur.execute("SELECT run_id, status FROM runs")
        rows = dict(cur.fetchall())
        assert set(rows) == run_ids and set(rows.values()) == {"SUCCESS"}
        cur.execute("SELECT DISTINCT asset_key FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'")
        materialized = {row[0] for row in cur.fetchall()}
        for name in [
            "target_model",
            "raw_responses",
            "tokenized_dataset",
            "merged_train",
            "vocab_mapping",
            "extraction_plan",
            "hidden_states",
        ]:
            assert f'["{name}"]' in materialized, name
        cur.execute(
            "SELECT DISTINCT partition FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'"
            " AND asset_key = '[\"hidden_states\"]'"
        )
        assert {row[0] for row in cur.fetchall()} == shards
        cur.execute("SELECT partition FROM dynamic_partitions WHERE partitions_def_name = 'hidden_state_shards'")
        assert {row[0] for row in cur.fetchall()} == shards
        cur.execute("SELECT count(*) FROM asset_check_executions WHERE execution_status = 'SUCCEEDED'")
        assert cur.fetchone()[0] >= 1 + len(shards)  # fits_on_disk + the checks of every shard
        cur.execute("SELECT to_regclass('instigators'), to_regclass('job_ticks')")  # schedule storage's tables
        assert all(cur.fetchone())
    # No SQLite fallback beside the config (runs.db, history/, schedules/ would be there).
    assert not list(home.rglob("*.db")), sorted(p.name for p in home.rglob("*.db"))
    secret = env["DAGSTER_PG_PASSWORD"]
    assert secret not in proc.stdout + proc.stderr
    assert not [p for p in home.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@contextmanager
def process_group(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """A Dagster process in its own session, output to `log`; SIGTERM to the group on exit."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_until(what: str, ready, timeout_s: float, logs: list[Path]):
    deadline = time.monotonic() + timeout_s
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s\n{tails}")
        time.sleep(0.5)


def location_loads(client: DagsterGraphQLClient) -> bool:
    """The webserver is up and loads the code location from the code server, i.e. definitions.py has loaded."""
    try:
        return client.reload_repository_location(LOCATION).status == ReloadRepositoryLocationStatus.SUCCESS
    except DagsterGraphQLClientError:  # the webserver is not listening yet
        return False


def test_code_server_and_daemon_run_queued_gpu_runs_one_at_a_time(postgres, micro_run: MicroRun, tmp_path) -> None:
    """docs/deployment.md's production processes: the pool limits set as scripts/ui.sh sets them land in Postgres;
    `dagster code-server start`, `dagster-webserver` and `dagster-daemon run` with deploy/postgres/workspace.yaml
    (pointed at the test's port) then take two shard runs submitted together through the webserver's GraphQL (both
    complete in the manifest, so each is short): the instance queues both, and both succeed, one after the other,
    the daemon's queue holding the second on the gpu_host limit."""
    env = micro_run.env
    bin_dir = Path(sys.executable).parent
    # What scripts/ui.sh sets on the local instance: the profile's pool limits, and raw_responses 1.
    implied = subprocess.run(
        [str(bin_dir / "eagle3"), "pool-limits"], env=env, check=True, capture_output=True, text=True, timeout=300
    ).stdout.split("\n")
    for pool, limit in [line.split() for line in implied if line.strip()] + [["raw_responses", "1"]]:
        subprocess.run(
            [str(bin_dir / "dagster"), "instance", "concurrency", "set", pool, limit],
            env=env,
            check=True,
            capture_output=True,
            timeout=300,
        )
    with postgres.connect(user="postgres", dbname="eagle3") as conn, conn.cursor() as cur:
        cur.execute('SELECT concurrency_key, "limit" FROM concurrency_limits')
        assert dict(cur.fetchall()) == {"gpu_host": 1, "raw_responses": 1}  # the micro profile has one GPU host
    port, web_port = free_port(), free_port()
    workspace = yaml.safe_load((ROOT / "deploy" / "postgres" / "workspace.yaml").read_text())
    workspace["load_from"][0]["grpc_server"].update(host="127.0.0.1", port=port)
    (tmp_path / "workspace.yaml").write_text(yaml.safe_dump(workspace))
    logs = [tmp_path / "code_server.log", tmp_path / "webserver.log", tmp_path / "daemon.log"]
    code_server = [
        str(bin_dir / "dagster"),
        "code-server",
        "start",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-f",
        "definitions.py",
        "-d",
        str(ROOT),
        "--location-name",
        LOCATION,
    ]
    webserver = [str(bin_dir / "dagster-webserver"), "-h", "127.0.0.1", "-p", str(web_port)]
    webserver += ["-w", str(tmp_path / "workspace.yaml")]
    client = DagsterGraphQLClient("127.0.0.1", port_number=web_port)
    with process_group(code_server, env, logs[0]), process_group(webserver, env, logs[1]):
        wait_until("the webserver loading the code location", lambda: location_loads(client), 300, logs)
        run_ids = [
            client.submit_job_execution(
                "extract_job",
                repository_location_name=LOCATION,
                repository_name="__repository__",
                tags={"dagster/partition": key},
            )
            for key in ["shard-00000", "shard-00001"]
        ]
        with micro_run.instance() as instance:
            queued = [instance.get_run_by_id(run_id) for run_id in run_ids]
            assert [r.status for r in queued] == [dg.DagsterRunStatus.QUEUED] * 2  # the daemon is not up yet
            assert [r.tags["dagster/partition"] for r in queued] == ["shard-00000", "shard-00001"]
            with process_group(
                [str(bin_dir / "dagster-daemon"), "run", "-w", str(tmp_path / "workspace.yaml")], env, logs[2]
            ):

                def finished():
                    records = [instance.get_run_record_by_id(run_id) for run_id in run_ids]
                    return records if all(r.dagster_run.is_finished for r in records) else None

                records = wait_until("both queued runs", finished, 600, logs)
    assert [r.dagster_run.status for r in records] == [dg.DagsterRunStatus.SUCCESS] * 2, logs[2].read_text()[-3000:]
    first, second = sorted(records, key=lambda r: r.start_time)
    assert first.end_time <= second.start_time, f"gpu_host let two runs overlap: {first.end_time} > {second.start_time}"
