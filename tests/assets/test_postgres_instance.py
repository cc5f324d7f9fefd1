"""The production instance (deploy/postgres/dagster.yaml) against a real PostgreSQL server.

The test starts its own server (initdb into a temp folder, pg_ctl on a free loopback port; as an
unprivileged user when run as root, since postgres refuses root), runs the micro pipeline through
`scripts/run_pipeline.py` the way tests/assets/test_micro_pipeline.py does, with DAGSTER_HOME
holding a copy of the checked-in production config, then reads PostgreSQL itself: the runs,
the materializations and the shard partitions are rows there, and nothing fell back to SQLite.
The pool limits the scripts set (`dagster instance concurrency set`) live in the same store and
hold a queued GPU run back while another is in progress.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTANCE_YAML = ROOT / "deploy" / "postgres" / "dagster.yaml"
SERVER_USER = "nobody"  # postgres refuses to run as root


def postgres_bin(name: str) -> str:
    """`initdb`/`pg_ctl` from PATH, else from Debian's versioned folder (not on PATH there)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if not candidates:
        pytest.fail(f"{name} not found on PATH or in /usr/lib/postgresql/*/bin: scripts/test.sh installs postgresql")
    return candidates[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Server:
    port: int
    socket_dir: Path
    env: dict[str, str]  # the DAGSTER_PG_* variables deploy/postgres/dagster.yaml reads

    def connect(self, user: str = "postgres", dbname: str = "postgres"):
        import psycopg2  # the [postgres] extra

        return psycopg2.connect(host=str(self.socket_dir), port=self.port, user=user, dbname=dbname)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Server]:
    as_root = os.geteuid() == 0
    # Outside pytest's tmp folder: that one is private to root, and the server runs as SERVER_USER.
    base = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
    data, sock, log = base / "data", base / "sock", base / "server.log"
    sock.mkdir()
    prefix: list[str] = []
    if as_root:
        entry = pwd.getpwnam(SERVER_USER)
        for path in (base, sock):
            os.chown(path, entry.pw_uid, entry.pw_gid)
        prefix = ["runuser", "-u", SERVER_USER, "--"]
    port = free_port()
    subprocess.run(prefix + [postgres_bin("initdb"), "-D", str(data), "-U", "postgres", "--auth-local=trust",
                             "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C"],
                   check=True, capture_output=True, timeout=120)
    options = f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={sock} -c fsync=off"
    # -w: pg_ctl returns once the server accepts connections
    subprocess.run(prefix + [postgres_bin("pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "start"],
                   check=True, capture_output=True, timeout=120)
    password = secrets.token_urlsafe(24)
    server = Server(port, sock, {"DAGSTER_PG_HOST": "127.0.0.1", "DAGSTER_PG_PORT": str(port),
                                 "DAGSTER_PG_USER": "eagle3", "DAGSTER_PG_PASSWORD": password,
                                 "DAGSTER_PG_DB": "eagle3"})
    try:
        conn = server.connect()
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE ROLE eagle3 LOGIN PASSWORD %s", (password,))
            cur.execute("CREATE DATABASE eagle3 OWNER eagle3")
        conn.close()
        yield server
    finally:
        subprocess.run(prefix + [postgres_bin("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=120)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def pipeline_on_postgres(postgres, tmp_path_factory) -> tuple[Path, dict[str, str], subprocess.CompletedProcess]:
    from tests.assets.test_micro_pipeline import micro_profile_in

    tmp = tmp_path_factory.mktemp("postgres_pipeline")
    home = tmp / "dagster_home"
    home.mkdir()
    shutil.copy(INSTANCE_YAML, home / "dagster.yaml")
    env = os.environ | postgres.env | {
        "DAGSTER_HOME": str(home),
        "EAGLE3_PROFILE": str(micro_profile_in(tmp)),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    # Through extraction: every kind of record the instance keeps (runs, materializations, checks,
    # dynamic partitions) is written by then; training adds only more of the same.
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_pipeline.py"), "--until", "extract"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return home, env, proc


@contextmanager
def instance_in(home: Path, env: dict[str, str]) -> Iterator[dg.DagsterInstance]:
    """The instance of `home`, its DAGSTER_PG_* variables set only while it is opened."""
    connection = {k: v for k, v in env.items() if k.startswith("DAGSTER_PG_")}
    saved = {k: os.environ.get(k) for k in connection}
    os.environ.update(connection)
    try:
        instance = dg.DagsterInstance.from_config(str(home))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    with instance:
        yield instance


def test_runs_materializations_and_partitions_are_rows_in_postgres(postgres, pipeline_on_postgres) -> None:
    home, env, proc = pipeline_on_postgres
    with instance_in(home, env) as instance:
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
        for name in ["target_model", "raw_responses", "tokenized_dataset", "merged_train", "vocab_mapping",
                     "extraction_plan", "hidden_states"]:
            assert f'["{name}"]' in materialized, name
        cur.execute("SELECT DISTINCT partition FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'"
                    " AND asset_key = '[\"hidden_states\"]'")
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


def workspace_origin(job_name: str):
    """Where the daemon would load the job from: workspace.yaml's code location (a queued run needs one)."""
    from dagster._core.remote_origin import InProcessCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

    target = LoadableTargetOrigin(python_file=str(ROOT / "definitions.py"), working_directory=str(ROOT))
    location = InProcessCodeLocationOrigin(target, location_name="eagle3_dagster")
    return RemoteJobOrigin(RemoteRepositoryOrigin(location, "__repository__"), job_name)


def test_pool_limits_live_in_postgres_and_hold_a_second_gpu_run(postgres, pipeline_on_postgres) -> None:
    """What scripts/ui.sh sets, on this instance; then the queue daemon's own pool counter: with one
    gpu_host run in progress, a queued one is held back; once it ends, the queued one may start."""
    from dagster._core.op_concurrency_limits_counter import GlobalOpConcurrencyLimitsCounter
    from dagster._core.instance.config import PoolGranularity

    from definitions import build_definitions
    from eagle3_dagster.config import load_profile_file

    home, env, _ = pipeline_on_postgres
    cli = [str(Path(sys.executable).parent / "dagster"), "instance", "concurrency", "set"]
    for pool, limit in [("gpu_host", "1"), ("raw_responses", "1")]:
        subprocess.run(cli + [pool, limit], env=env, check=True, capture_output=True, timeout=300)
    with postgres.connect(user="postgres", dbname="eagle3") as conn, conn.cursor() as cur:
        cur.execute('SELECT concurrency_key, "limit" FROM concurrency_limits')
        assert dict(cur.fetchall()) == {"gpu_host": 1, "raw_responses": 1}

    job = build_definitions(load_profile_file(Path(env["EAGLE3_PROFILE"]))).resolve_job_def("extract_job")
    with instance_in(home, env) as instance:
        assert instance.event_log_storage.get_concurrency_info("gpu_host").slot_count == 1

        def gpu_run(status: dg.DagsterRunStatus) -> dg.DagsterRun:
            return instance.create_run_for_job(job, status=status, tags={"dagster/partition": "shard-00000"},
                                               remote_job_origin=workspace_origin(job.name))

        running, queued = gpu_run(dg.DagsterRunStatus.STARTED), gpu_run(dg.DagsterRunStatus.QUEUED)
        assert "gpu_host" in (queued.run_op_concurrency.all_pools or set())

        def blocked() -> bool:
            in_progress = instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
            counter = GlobalOpConcurrencyLimitsCounter(
                instance, [queued], in_progress, concurrency_keys=instance.event_log_storage.get_concurrency_keys(),
                pool_limits=instance.event_log_storage.get_pool_limits(), pool_granularity=PoolGranularity.RUN)
            return counter.is_blocked(queued)

        assert blocked()
        instance.report_run_canceled(running)
        assert not blocked()
