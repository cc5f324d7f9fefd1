"""A pid file that names a live process with its real start time still names no group of ours unless a live
member of that group carries the launch nonce in its environment (`EAGLE3_LAUNCH_NONCE`, read from
/proc/PID/environ). Before, a live leader with the recorded start time was taken as ours whatever its
environment, so such a pid file got a stranger SIGTERMed. Real processes on this machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from eagle3_dagster.gpu_host import NONCE_VAR, GpuHost
from eagle3_dagster.host_config import HostConfig

NONCE = "0123456789abcdef0123456789abcdef"
LOOP = "trap 'echo TERM; exit 0' TERM; while true; do sleep 0.05; done"


def _start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _stranger(env_nonce: str | None = None, argv_nonce: bool = False) -> subprocess.Popen:
    """A process group of someone else's: TERM is recorded, not obeyed. `env_nonce`: the launch variable in its
    environment with this value; `argv_nonce`: the nonce on its command line instead."""
    env = {k: v for k, v in os.environ.items() if k != NONCE_VAR}
    if env_nonce is not None:
        env[NONCE_VAR] = env_nonce
    script = LOOP + (f" # {NONCE_VAR}={NONCE}" if argv_nonce else "")
    proc = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True, env=env)
    deadline = time.monotonic() + 10
    while not Path(f"/proc/{proc.pid}/stat").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # past bash's exec: the environment and start time are the stranger's own
    return proc


def _end(stranger: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(stranger.pid, signal.SIGKILL)
    stranger.wait()


@pytest.fixture
def host(tmp_path):
    host = GpuHost(HostConfig(workdir=str(tmp_path / "work")))
    Path(host.spec.workdir).mkdir(parents=True)
    return host


def _record(host: GpuHost, name: str, pid: int, start_time: str, nonce: str = NONCE) -> Path:
    pidfile = Path(host.spec.workdir) / f"{name}.pid"
    pidfile.write_text(f"{pid} {start_time} {nonce}\n")
    return pidfile


def _stop_and_check_left_alone(host: GpuHost, stranger: subprocess.Popen, pidfile: Path) -> None:
    try:
        host.stop_stale(pidfile.stem)
        host.signal_group(pidfile.name, "KILL", remove=True)  # what HostProcess.stop() ends with
        time.sleep(0.3)
        assert stranger.poll() is None, f"the stranger was signalled: {stranger.stdout.read()!r}"
        assert not pidfile.exists()
    finally:
        _end(stranger)


@pytest.mark.parametrize(
    "case",
    [
        "no nonce in its environment",
        "another nonce in its environment",
        "the nonce as a prefix of its variable",  # EAGLE3_LAUNCH_NONCE=<nonce>x: a whole-line match only
        "the nonce on its command line, not in its environment",
    ],
)
def test_a_pid_file_naming_a_live_stranger_with_its_real_start_time_leaves_the_stranger_alone(host, case):
    stranger = _stranger(
        env_nonce={
            "another nonce in its environment": "f" * 32,
            "the nonce as a prefix of its variable": NONCE + "x",
        }.get(case),
        argv_nonce=case.endswith("not in its environment"),
    )
    pidfile = _record(host, "sglang-30000", stranger.pid, _start_time(stranger.pid))
    _stop_and_check_left_alone(host, stranger, pidfile)


def test_the_nonce_in_a_process_outside_the_named_group_does_not_make_the_group_ours(host):
    stranger = _stranger()
    carrier = subprocess.Popen(["sleep", "60"], start_new_session=True, env={**os.environ, NONCE_VAR: NONCE})
    try:
        pidfile = _record(host, "job", stranger.pid, _start_time(stranger.pid))
        _stop_and_check_left_alone(host, stranger, pidfile)
        assert carrier.poll() is None
    finally:
        carrier.kill()
        carrier.wait()


def test_a_live_stranger_is_left_alone_by_a_launch_through_its_pid_file(host):
    """The whole path of a launch: `spawn` stops what its pid file names first."""
    stranger = _stranger()
    try:
        _record(host, "sglang-30000", stranger.pid, _start_time(stranger.pid))
        proc = host.spawn(["true"], None, "sglang-30000")
        proc.proc.wait(timeout=30)
        proc.stop(grace_s=1)
        time.sleep(0.3)
        assert stranger.poll() is None, f"the stranger was signalled: {stranger.stdout.read()!r}"
    finally:
        _end(stranger)


def test_a_group_this_project_started_is_still_ours_with_its_leader_alive(host):
    proc = host.spawn(["sleep", "300"], None, "job")
    pidfile = Path(host.spec.workdir) / "job.pid"
    deadline = time.monotonic() + 30
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    pgid, _, nonce = pidfile.read_text().split()
    time.sleep(0.2)  # the leader has exec'd `sleep`: its own environment carries the nonce
    assert f"{NONCE_VAR}={nonce}".encode() in Path(f"/proc/{pgid}/environ").read_bytes().split(b"\0")
    assert host.group_alive("job.pid")
    proc.stop(grace_s=1)
    assert not host.group_alive("job.pid")
