"""`dagster dev` (webserver, daemon, code server) as one process group that stops on SIGINT or SIGTERM.

`scripts/ui.sh` serves the UI with it; `scripts/run_pipeline.py` starts one to submit the demo's runs
through the code location, as the launchpad does. `dagster dev` shuts its services down on SIGINT, and on
SIGTERM through the same handler; but a process a non-interactive shell starts in the background
(`scripts/ui.sh &`, nohup, a service manager) inherits SIGINT ignored, and Python then ignores SIGTERM too;
and a second signal during its shutdown interrupts the shutdown, leaving webserver, daemon and code servers
running. So `dagster dev` runs here in a session of its own with SIGINT restored: the first SIGINT, SIGTERM
or SIGHUP asks it to stop, and whatever of its process group (run workers included) is left after
`GRACE_S`, or at a second signal, is killed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
GRPC_TIMEOUT_S = 300
GRACE_S = 30  # dagster dev stops its services in ~5 s on this 2-core machine
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Written in $DAGSTER_HOME while scripts/ui.sh serves that instance: scripts/run_pipeline.py submits through it.
UI_URL_FILE = "ui_url"


def start(
    host: str,
    port: int,
    workspace: Path = ROOT / "workspace.yaml",
    env: dict[str, str] | None = None,
    log: IO[bytes] | None = None,
) -> subprocess.Popen:
    """`dagster dev` on `host:port` in a new session (its own process group), SIGINT at its default.

    Dagster's calls to the code server time out after 60 s by default; on a 2-core machine busy with a
    stage, the daemon's call that starts a queued run's worker took longer, and the daemon failed the run
    ("User code server request timed out"). DAGSTER_GRPC_TIMEOUT_SECONDS (Dagster's own setting) raises it
    unless the environment sets it."""
    env = {"DAGSTER_GRPC_TIMEOUT_SECONDS": str(GRPC_TIMEOUT_S), **(os.environ if env is None else env)}
    dagster = Path(sys.executable).with_name("dagster")
    cmd = [str(dagster), "dev", "-w", str(workspace), "-h", host, "-p", str(port)]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT if log else None,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # SIGINT to dagster dev when the process that started it dies, even by SIGKILL (a timeout's kill of
    # scripts/run_pipeline.py left dagster dev and its code servers running): Linux's parent-death signal.
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGINT))


def stop(proc: subprocess.Popen, grace_s: float = GRACE_S, interrupted: list | None = None) -> None:
    """SIGINT to `dagster dev`, which stops its webserver, daemon and code servers; SIGKILL to what is left
    of its process group after `grace_s`, or as soon as `interrupted` (a list a signal handler appends to)
    grows."""
    before = len(interrupted) if interrupted is not None else 0
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            if interrupted is not None and len(interrupted) > before:
                break
            time.sleep(0.2)
    kill_group(proc.pid)
    proc.wait()


def kill_group(pgid: int, wait_s: float = 10) -> None:
    """SIGKILL every process left in group `pgid` and wait (up to `wait_s`) until none is."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)


@contextmanager
def stop_signals() -> Iterator[list[int]]:
    """SIGINT, SIGTERM and SIGHUP appended to the yielded list instead of their default action."""
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signo, _frame: received.append(signo)) for s in STOP_SIGNALS}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def serve(host: str, port: int, workspace: Path) -> int:
    """`dagster dev` in the foreground until it exits or a stop signal arrives; while it runs, its URL is in
    $DAGSTER_HOME/ui_url."""
    home = os.environ.get("DAGSTER_HOME")
    url_file = Path(home) / UI_URL_FILE if home else None
    with stop_signals() as received:
        proc = start(host, port, workspace)
        try:
            if url_file is not None:
                url_file.write_text(f"http://{host}:{port}\n")
            while proc.poll() is None and not received:
                time.sleep(0.2)
        finally:
            if url_file is not None:
                url_file.unlink(missing_ok=True)
            stop(proc, interrupted=received)
    return 0 if received else proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3000)
    parser.add_argument("--workspace", type=Path, default=ROOT / "workspace.yaml")
    args = parser.parse_args(argv)
    return serve(args.host, args.port, args.workspace)


if __name__ == "__main__":
    raise SystemExit(main())
