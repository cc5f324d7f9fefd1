"""A pid file never names a process to signal by itself: only a process group this project started (its
leader's start time, or the launch nonce in its environment) is stopped. Real processes on this machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_dagster.gpu_host import GpuHost
from eagle3_dagster.host_config import HostConfig


def _stranger() -> subprocess.Popen:
    """An unrelated process group, as a pid reused after a kill -9 would be: TERM is recorded, not obeyed."""
    return subprocess.Popen(
        ["bash", "-c", "trap 'echo TERM; exit 0' TERM; while true; do sleep 0.05; done"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def host(tmp_path):
    return GpuHost(HostConfig(workdir=str(tmp_path / "work")))


@pytest.mark.parametrize(
    "content",
    [
        "{pid}\n",  # the format before launch nonces
        "{pid} 12345 0123456789abcdef\n",  # a start time and nonce that are not the stranger's
    ],
)
def test_a_stale_pid_file_naming_a_stranger_is_removed_and_the_stranger_never_signalled(host, tmp_path, content):
    stranger = _stranger()
    try:
        work = Path(host.spec.workdir)
        work.mkdir(parents=True)
        (work / "sglang-30000.pid").write_text(content.format(pid=stranger.pid))
        proc = host.spawn(["true"], None, "sglang-30000")
        proc.proc.wait(timeout=30)
        proc.stop(grace_s=1)
        time.sleep(0.3)
        assert stranger.poll() is None, f"the stranger was signalled: {stranger.stdout.read()!r}"
    finally:
        os.killpg(stranger.pid, signal.SIGKILL)
        stranger.wait()


def test_a_group_this_project_started_is_still_stopped_through_its_pid_file(host, tmp_path):
    first = host.spawn(["sleep", "300"], None, "job")
    pidfile = Path(host.spec.workdir) / "job.pid"
    deadline = time.monotonic() + 30
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    pgid, start_time, nonce = pidfile.read_text().split()
    assert len(nonce) == 32 and start_time == Path(f"/proc/{pgid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    assert host.group_alive("job.pid")
    # the worker that launched it is gone without cleaning up; the next launch finds and stops the group
    second = host.spawn(["true"], None, "job")
    assert not _alive(int(pgid)) or Path(f"/proc/{pgid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    second.proc.wait(timeout=30)
    second.stop(grace_s=1)
    first.stop(grace_s=1)


def test_a_worker_ignoring_sigterm_still_stops_its_host_process_at_the_first_signal(host):
    """Ignored signals are inherited through fork and exec, and a Dagster worker may ignore SIGTERM: Dagster
    maps SIGTERM to SIGINT's handler (`setup_interrupt_handlers`, called around every in-process execution),
    which is SIG_IGN in a process started in the background of a non-interactive shell. A group launched
    from there ignored the TERM of `stop()`, which then waited out its whole grace and killed it."""
    program = "import time\nprint('up', flush=True)\ntime.sleep(300)"
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        proc = host.spawn([sys.executable, "-c", program], None, "ignores-term")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert proc.proc.stdout.readline().strip() == "up"
    started = time.monotonic()
    proc.stop(grace_s=15)
    took = time.monotonic() - started
    assert proc.proc.returncode == 128 + signal.SIGTERM, f"ended with {proc.proc.returncode}, not by TERM"
    assert took < 10, f"stop() took {took:.1f} s: the group ignored TERM until the grace ran out"
