"""`scripts/ui.sh` as a user runs it, stopped as a user stops it.

ui.sh is started as a non-interactive shell starts a command in the background (`scripts/ui.sh &`, nohup, a
service manager): with SIGINT ignored, which `dagster dev` used to inherit, and then ignored SIGTERM as well.
Once the UI answers, one SIGTERM or SIGINT to ui.sh's pid must stop it and every process it started
(webserver, daemon, code servers): none may remain.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import REPO, write_profile
from tests.sshd_server import free_port

pytestmark = pytest.mark.e2e

STARTUP_S = 180
STOP_S = 60  # scripts/dagster_dev.py's grace (30 s) and the kill after it


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int) -> dict[int, str]:
    """Every live process below `pid`, by pid, with its start time (so a reused pid is not taken for it)."""
    children, found, todo = _children(), {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            started = _start_time(child)
            if started is not None:
                found[child] = started
                todo.append(child)
    return found


def _start_time(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]  # a zombie has exited


def alive(processes: dict[int, str]) -> list[str]:
    left = []
    for pid, started in processes.items():
        if _start_time(pid) == started:
            left.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:160])
    return left


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what `cmd &` in a non-interactive shell does


def ui_ready(url: str) -> bool:
    query = "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus } } } }"
    try:
        body = httpx.post(f"{url}/graphql", json={"query": query}, timeout=10).json()
    except httpx.HTTPError:
        return False
    entries = body.get("data", {}).get("workspaceOrError", {}).get("locationEntries", [])
    return any(e["name"] == "eagle3_dagster" and e["loadStatus"] == "LOADED" for e in entries)


@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_ui_sh_stops_with_every_process_it_started(signo, tmp_path) -> None:
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    profile = write_profile(tmp_path, "micro")
    port = free_port()
    env = {**os.environ, "EAGLE3_DAGSTER_HOME": str(home), "EAGLE3_PROFILE": str(profile), "PORT": str(port)}
    log_path = tmp_path / "ui.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(REPO / "scripts" / "ui.sh")],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_ignore_sigint,
        )
    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + STARTUP_S
        while not ui_ready(f"http://127.0.0.1:{port}"):
            assert proc.poll() is None, f"ui.sh exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"the UI did not answer in {STARTUP_S} s:\n" + log_path.read_text()[-3000:]
            )
            time.sleep(0.5)
        started = descendants(proc.pid)
        commands = " ".join(Path(f"/proc/{p}/cmdline").read_text() for p in started)
        assert "dagster_webserver" in commands and "dagster._daemon" in commands and "code-server" in commands

        proc.send_signal(signo)
        proc.wait(timeout=STOP_S)
        assert proc.returncode == 0, log_path.read_text()[-3000:]
        assert alive(started) == [], log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid, when in started.items():
            if _start_time(pid) == when:  # left over: not another process that took its pid since
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_ui_sh_installs_what_the_ui_needs_not_the_test_tools() -> None:
    text = (REPO / "scripts" / "ui.sh").read_text()
    assert "scripts/setup.sh pipeline" in text
    assert [line for line in text.splitlines() if "setup.sh" in line and "pipeline" not in line] == []


PARENT = """
import sys, time
sys.path.insert(0, "scripts")
import dagster_dev
proc = dagster_dev.start("127.0.0.1", int(sys.argv[1]))
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_dagster_dev_stops_when_the_process_that_started_it_is_killed(tmp_path) -> None:
    """scripts/run_pipeline.py killed outright (a timeout's SIGKILL) must not leave its dagster dev running."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), "EAGLE3_PROFILE": str(write_profile(tmp_path, "micro"))}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(port)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    started: dict[int, str] = {}
    try:
        dev = int(parent.stdout.readline())
        deadline = time.monotonic() + STARTUP_S
        while not ui_ready(f"http://127.0.0.1:{port}"):
            assert time.monotonic() < deadline, f"dagster dev did not answer in {STARTUP_S} s"
            time.sleep(0.5)
        started = {dev: _start_time(dev), **descendants(dev)}
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + STOP_S
        while alive(started) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert alive(started) == []
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid, when in started.items():
            if _start_time(pid) == when:
                os.kill(pid, signal.SIGKILL)
        parent.wait()
