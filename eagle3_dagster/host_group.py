"""One command on each of several GPU hosts, run as one job: torchrun on every node of a training.

Owns: starting the commands (`GpuHost.spawn`: each in its own process group with
a pid file on its host, and the watchdog that stops it when this process dies),
handing every line any host writes to a callback with that host's name, waiting
for all of them, and the first failure. When a host's command exits non-zero the
others get `SETTLE_S` to end on their own (a dead peer breaks their collectives),
then every one still running is stopped (`HostProcess.stop`) and `HostFailed`
names the host that failed. The Pipes session around the job is the Dagster
resource's (resources/gpu_host.py); the torchrun commands are train/nodes.py's.

Which host failed: the first to exit non-zero, unless a later one reports a
worker killed by a signal (torchrun's failure summary, `exitcode : -9`) and the
first does not: a rank killed on one node makes its peers fail a moment later,
and either torchrun may notice first.
"""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from eagle3_dagster.gpu_host import GpuHost, HostProcess

SETTLE_S = 3.0  # how long the other hosts may take to fail on their own once one has failed
TAIL_LINES = 20  # lines of the failed host's output kept for the error
_SIGNALLED = re.compile(r"exitcode\s*:\s*-(\d+)")  # torchrun's summary of a worker a signal killed


@dataclass(frozen=True)
class HostCommand:
    host: GpuHost
    argv: list[str]


class HostFailed(RuntimeError):
    """A host's command exited non-zero; the message names the host, its exit code and what became of the others."""

    def __init__(self, message: str, host: str, returncode: int) -> None:
        super().__init__(message)
        self.host, self.returncode = host, returncode


def pid_name(name: str, host: GpuHost) -> str:
    """The pid file's name on the host: one per host, so that hosts sharing a workdir never share one."""
    return f"{name}-{re.sub(r'[^A-Za-z0-9_.-]', '_', host.name)}"


class _Output:
    """One host's lines: each to the callback, the last few kept, and whether a worker was killed by a signal."""

    def __init__(self, host: str, on_line: Callable[[str, str], bool | None]) -> None:
        self.host, self.on_line = host, on_line
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.signal: int | None = None
        self.threads: list[threading.Thread] = []

    def follow(self, stream) -> None:
        thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _pump(self, stream) -> None:
        for line in stream:
            line = line.rstrip("\n")
            if (found := _SIGNALLED.search(line)) is not None:
                self.signal = int(found.group(1))
            if not self.on_line(self.host, line):  # a message the callback consumed is no log text
                self.tail.append(line)

    def join(self, timeout_s: float) -> None:
        for thread in self.threads:
            thread.join(timeout_s)


def run_on_hosts(
    commands: Sequence[HostCommand],
    env: Mapping[str, str] | None,
    *,
    name: str,
    on_line: Callable[[str, str], bool | None],
    cwd: str | None = None,
    log: Callable[[str], None] = print,
    grace_s: float = 20.0,
) -> None:
    """Run each command on its host and wait for all; the first failure stops the rest and raises HostFailed.

    `on_line(host_name, line)` gets every line of every host's stdout and stderr (from reader threads: it
    must be thread-safe) and returns True for a line it consumed as a message (a Pipes message), which the
    error then leaves out. Interrupted (a cancelled run), every host's command is stopped before re-raising."""
    procs: list[HostProcess] = []
    outputs = [_Output(c.host.name, on_line) for c in commands]
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    try:
        for i, command in enumerate(commands):
            proc = command.host.spawn(
                command.argv, env, pid_name(name, command.host), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            procs.append(proc)
            outputs[i].follow(proc.proc.stdout)
            outputs[i].follow(proc.proc.stderr)
            threading.Thread(target=lambda i=i, p=proc: exits.put((i, p.proc.wait())), daemon=True).start()
        failed = _wait(exits, len(procs), outputs, log)
        stopped = [outputs[i].host for i, p in enumerate(procs) if p.poll() is None]
    finally:  # a host failed, the run was interrupted or a launch failed: nothing of the job outlives it
        _stop([p for p in procs if p.poll() is None], grace_s)
        for proc in procs:
            proc.host.signal_group(proc.pidfile, "KILL", remove=True)
            proc.release()
        for output in outputs:
            output.join(10)  # every line read, the failed host's last ones included
    if failed:
        raise _failure(name, failed, outputs, stopped)


def _wait(exits: queue.Queue, count: int, outputs: list[_Output], log) -> list[tuple[int, int]]:
    """(index, exit code) of every host that failed, in the order they exited; empty when all succeeded."""
    done, failed, settle_until = 0, [], None
    while done < count:
        timeout: float | None = None if settle_until is None else max(0.0, settle_until - time.monotonic())
        try:
            i, returncode = exits.get(timeout=timeout)
        except queue.Empty:
            break
        done += 1
        log(f"{outputs[i].host}: exited {returncode}")
        if returncode != 0:
            failed.append((i, returncode))
            settle_until = settle_until or time.monotonic() + SETTLE_S
    return failed


def _stop(procs: list[HostProcess], grace_s: float) -> None:
    threads = [threading.Thread(target=p.stop, kwargs={"grace_s": grace_s}, daemon=True) for p in procs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(grace_s + 60)


def _failure(name: str, failed: list[tuple[int, int]], outputs: list[_Output], stopped: list[str]) -> HostFailed:
    first, returncode = next(((i, rc) for i, rc in failed if outputs[i].signal is not None), failed[0])
    out = outputs[first]
    what = f"{name} on host {out.host} failed with exit code {returncode}"
    if (killer := _signal_name(returncode - 128)) is not None:  # the shell reports a killed command as 128 + signal
        what += f" (killed by {killer})"
    if out.signal is not None:
        what += f" (a worker there was killed by signal {out.signal})"
    others = [f"{outputs[i].host} also failed (exit {rc})" for i, rc in failed if i != first]
    others += [f"{host} was stopped" for host in stopped]
    if others:
        what += "; " + ", ".join(others)
    tail = "\n".join(out.tail)
    return HostFailed(f"{what}. The last lines from {out.host}:\n{tail}", out.host, returncode)


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name if number > 0 else None
    except ValueError:
        return None
