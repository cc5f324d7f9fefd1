"""A real PostgreSQL server (Debian `postgresql`) on a loopback port, for the production instance's tests.

`initdb` into a temp folder and `pg_ctl` on a free port, as an unprivileged user when run as root, since
postgres refuses root; a role and a database for Dagster with a random password. The `DAGSTER_PG_*`
variables deploy/postgres/dagster.yaml reads are in `Server.env`.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.sshd_server import free_port

SERVER_USER = "nobody"  # postgres refuses to run as root


def postgres_bin(name: str) -> str:
    """`initdb`/`pg_ctl` from PATH, else from Debian's versioned folder (not on PATH there)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if not candidates:
        pytest.fail(f"{name} not found on PATH or in /usr/lib/postgresql/*/bin: scripts/test.sh installs postgresql")
    return candidates[-1]


@dataclass(frozen=True)
class Server:
    port: int
    socket_dir: Path
    env: dict[str, str]  # the DAGSTER_PG_* variables deploy/postgres/dagster.yaml reads

    def connect(self, user: str = "postgres", dbname: str = "postgres"):
        import psycopg2  # the [postgres] extra

        return psycopg2.connect(host=str(self.socket_dir), port=self.port, user=user, dbname=dbname)


@contextmanager
def start_postgres() -> Iterator[Server]:
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

    def as_server(*argv: str) -> None:
        proc = subprocess.run(prefix + list(argv), capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            server_log = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-3000:]}\n{server_log}")

    port = free_port()
    as_server(
        postgres_bin("initdb"),
        "-D",
        str(data),
        "-U",
        "postgres",
        "--auth-local=trust",
        "--auth-host=scram-sha-256",
        "-E",
        "UTF8",
        "--locale=C",
    )
    options = f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={sock} -c fsync=off"
    as_server(
        postgres_bin("pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "start"
    )  # -w: until it accepts connections
    password = secrets.token_urlsafe(24)
    server = Server(
        port,
        sock,
        {
            "DAGSTER_PG_HOST": "127.0.0.1",
            "DAGSTER_PG_PORT": str(port),
            "DAGSTER_PG_USER": "eagle3",
            "DAGSTER_PG_PASSWORD": password,
            "DAGSTER_PG_DB": "eagle3",
        },
    )
    try:
        conn = server.connect()
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE ROLE eagle3 LOGIN PASSWORD %s", (password,))
            cur.execute("CREATE DATABASE eagle3 OWNER eagle3")
        conn.close()
        yield server
    finally:
        subprocess.run(
            prefix + [postgres_bin("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
            capture_output=True,
            timeout=120,
        )
        shutil.rmtree(base, ignore_errors=True)
