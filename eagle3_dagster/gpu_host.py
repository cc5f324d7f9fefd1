"""Run commands on the GPU host (this machine or one reached over SSH) with an explicit interpreter.

Owns: building the shell command for either transport (environment variables go
on the command line, since ssh forwards none), one-shot commands, long-running
processes in their own process group with a pid file on the host so they can
always be stopped (`HostProcess`), file writes, small stdlib programs of this
package run by the host's interpreter (`program_argv`) and preflight
(interpreter, SGLang and its patch state, GPUs, free disk; the probe is
`eagle3_dagster.host_probe`). The SGLang server's lifecycle is
`eagle3_dagster.sglang.server`'s. It never imports SGLang or Dagster; the
resource in resources/gpu_host.py wraps it.

SSH uses the system `ssh` binary with BatchMode (never a password prompt).
Every long-running command is started as `setsid bash -c 'echo $$ ... > pidfile;
exec ...'`, so its pid is its process group on the host, and stopping it is
`kill -TERM -- -pgid` there, then KILL after a grace period. A server left by a
worker that died without cleanup is found through the same pid file and stopped
before the next one starts.

A pid file outlives its process (a kill -9 of the watchdog, a reboot) and pids
are reused, so a pid file alone never names a process to signal. It records the
group id, the leader's start time (field 22 of /proc/pid/stat) and a launch
nonce that is also in the group's environment (`EAGLE3_LAUNCH_NONCE`); a group
is signalled only when one of its processes carries that nonce and the leader,
if alive, has that start time. A pid file that names anything else is removed,
and the stranger is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

from eagle3_dagster import host_probe, sglang_releases
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.sglang_releases import other_sglang_release

# Runs the command as its own process group (pid file = group id) and a watchdog beside it that
# waits for EOF on stdin, i.e. for the launching worker to go away, then stops the group: TERM,
# then KILL after a grace period. The child's own stdin is /dev/null.
# (Background jobs of a non-interactive shell get /dev/null as stdin, hence the explicit fd 3.)
# The script's own stderr goes once both are started: bash reports a job a signal killed on it, with the job's
# whole command line (every environment variable of the launch) as the run's log would then show.
WATCHDOG = """\
exec 3<&0
setsid -w env {nonce_env} bash -c {inner} </dev/null 3<&- & child=$!
( cat <&3 >/dev/null; {owned} && pg=$OWNED_PG && kill -TERM -- -$pg && \
  sleep 20 && {owned} && kill -KILL -- -$pg ) >/dev/null 2>&1 & watchdog=$!
exec 3<&- 2>/dev/null
wait $child; rc=$?
kill $watchdog 2>/dev/null
exit $rc"""

NONCE_VAR = "EAGLE3_LAUNCH_NONCE"

# A local group starts with the default handling of the signals that stop it. Ignored signals are inherited
# through fork and exec, and a Dagster worker may ignore SIGTERM: Dagster maps SIGTERM to SIGINT's handler
# (`setup_interrupt_handlers`, around every in-process execution), which is SIG_IGN in a process started in
# the background of a non-interactive shell. Bash cannot undo it (a signal ignored on entry stays ignored),
# and subprocess restores only SIGPIPE and SIGXFSZ, hence this exec trampoline. (An ssh host's shell starts
# from sshd's defaults.)
_DEFAULT_SIGNALS = (
    "import os, signal, sys\n"
    "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])"
)

# Written by the group leader before it execs the command: "pgid starttime nonce" (the nonce is in its
# environment already, so in every process of the group). The start time is read with builtins after the
# comm field, which may hold spaces: field 22 of /proc/pid/stat is the 20th after it.
_WRITE_PIDFILE = (
    "read -r _s < /proc/$$/stat; set -- ${{_s##*) }}; "
    'echo "$$ ${{20}} {nonce}" > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; '
)

# Exit 0 (and OWNED_PG set) when the pid file names a live process group this project started: a live member
# of the group carries the recorded nonce in its environment (the leader first), and the leader, if alive,
# has the recorded start time (pid + start time name one process, whatever reused the pid since). A start
# time alone is no proof: a pid file can name a live stranger with its real one.
_OWNED = (
    '( read -r pg st nonce _ < {pidfile} 2>/dev/null && [ -n "$nonce" ] || exit 1; '
    "if read -r s < /proc/$pg/stat 2>/dev/null; then set -- ${{s##*) }}; "
    '[ "$3" = "$pg" ] && [ "${{20}}" = "$st" ] || exit 1; fi; '
    "for p in /proc/$pg /proc/[0-9]*; do read -r s < $p/stat 2>/dev/null || continue; set -- ${{s##*) }}; "
    '[ "$3" = "$pg" ] || continue; '
    "tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -qxF \"{var}=$nonce\" && exit 0; done; exit 1 )"
)


def _owned(pidfile: str) -> str:
    """A shell condition: the pid file names a live group this project started; sets OWNED_PG."""
    q = shlex.quote(pidfile)
    return f"{{ {_OWNED.format(pidfile=q, var=NONCE_VAR)} && read -r OWNED_PG _ < {q}; }}"


class PreflightError(RuntimeError):
    """The host cannot run the step; the message names what is missing."""


def program_argv(python: str, program: ModuleType, *args: object) -> list[str]:
    """`python -c <source of program> args...`: one of this package's standard-library programs (`host_probe`,
    `sglang.health`, `sglang.location`) run by another interpreter (the host's, or the one `eagle3 patch` is
    given). The source is sent rather than run with `-m`: the probe must run where this project is not
    installed (that is one of the things it reports), and a host with another copy of it installed still
    runs the worker's version."""
    if program.__file__ is None:
        raise ValueError(f"{program.__name__} has no source file to send")
    return [python, "-c", Path(program.__file__).read_text(), *map(str, args)]


def shell_script(argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None) -> str:
    """`cd cwd && exec env K=V ... argv` with everything quoted for a POSIX shell."""
    parts = ["exec", "env", *(f"{k}={v}" for k, v in (env or {}).items()), *argv]
    body = " ".join(shlex.quote(p) for p in parts)
    return f"mkdir -p {shlex.quote(cwd)} && cd {shlex.quote(cwd)} && {body}" if cwd else body


class GpuHost:
    def __init__(self, spec: HostConfig) -> None:
        # A local host's default interpreter (`python`) is this process's, not the first `python` on PATH.
        local_default = spec.transport == "local" and spec.python == "python"
        self.spec = spec.model_copy(update={"python": sys.executable}) if local_default else spec

    def wrap(self, script: str) -> list[str]:
        """The local argv that runs a shell script on the host."""
        if self.spec.transport == "local":
            return ["bash", "-c", script]
        # `--` ends the options: a target that begins with "-" (e.g. -oProxyCommand=...) is a host name, never an option
        assert self.spec.ssh_target is not None  # HostConfig requires it for transport 'ssh'
        return ["ssh", "-o", "BatchMode=yes", *self.spec.ssh_options, "--", self.spec.ssh_target, script]

    def command(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
        return self.wrap(shell_script(argv, env, self.spec.workdir))

    def run(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 120.0, check: bool = True
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(self.command(argv, env), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{self.where()}: {shlex.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"
            )
        return proc

    def write_file(self, path: str, data: bytes, timeout: float = 300.0) -> None:
        """Write `data` to `path` (relative paths: under the workdir) on the host, atomically, through stdin."""
        target = shlex.quote(path)
        script = (
            f"mkdir -p {shlex.quote(self.spec.workdir)} && cd {shlex.quote(self.spec.workdir)} && "
            f'mkdir -p "$(dirname {target})" && cat > {target}.tmp && mv {target}.tmp {target}'
        )
        proc = subprocess.run(self.wrap(script), input=data, capture_output=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{self.where()}: writing {path} failed: {proc.stderr.decode(errors='replace')[-2000:]}")

    def where(self) -> str:
        return "localhost" if self.spec.transport == "local" else str(self.spec.ssh_target)

    @property
    def name(self) -> str:
        return self.spec.label

    def is_this_process(self, python: str) -> bool:
        """True when a command for this host would run here with `python` (the same interpreter, no ssh)."""
        return self.spec.transport == "local" and self.spec.python == python

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None,
        name: str,
        *,
        cwd: str | None = None,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    ) -> "HostProcess":
        """Start a long-running command in its own process group, recorded in `{workdir}/{name}.pid`."""
        pidfile = f"{name}.pid"
        self.stop_stale(name)
        nonce = uuid.uuid4().hex
        inner = _WRITE_PIDFILE.format(nonce=nonce, pidfile=shlex.quote(pidfile)) + shell_script(argv, env, cwd)
        script = (
            f"mkdir -p {shlex.quote(self.spec.workdir)} && cd {shlex.quote(self.spec.workdir)} && "
            + WATCHDOG.format(inner=shlex.quote(inner), owned=_owned(pidfile), nonce_env=f"{NONCE_VAR}={nonce}")
        )
        # The worker keeps the write end of stdin and never writes: when it dies (even by SIGKILL) the
        # watchdog on the host reads EOF and stops the process group, so no GPU job outlives its run.
        argv = self.wrap(script)
        if self.spec.transport == "local":
            argv = [sys.executable, "-c", _DEFAULT_SIGNALS, *argv]
        proc = subprocess.Popen(
            argv, stdout=stdout, stderr=stderr, stdin=subprocess.PIPE, text=True, bufsize=1, start_new_session=True
        )
        return HostProcess(self, proc, pidfile)

    def signal_group(self, pidfile: str, sig: str, *, remove: bool = False) -> None:
        """Signal the group the pid file names, only when this project started it (`_owned`)."""
        script = (
            f"cd {shlex.quote(self.spec.workdir)} 2>/dev/null && [ -f {shlex.quote(pidfile)} ] && "
            f"{_owned(pidfile)} && kill -{sig} -- -$OWNED_PG 2>/dev/null"
            + (f"; rm -f {shlex.quote(pidfile)}" if remove else "")
            + "; true"
        )
        subprocess.run(self.wrap(script), capture_output=True, timeout=60)

    def group_alive(self, pidfile: str) -> bool:
        """True while the group the pid file names is alive and is one this project started."""
        script = (
            f"cd {shlex.quote(self.spec.workdir)} 2>/dev/null && [ -f {shlex.quote(pidfile)} ] && {_owned(pidfile)}"
        )
        return subprocess.run(self.wrap(script), capture_output=True, timeout=60).returncode == 0

    def stop_stale(self, name: str) -> None:
        """Stop a process group left behind by a worker that died before it could clean up; a pid file
        that names no group of ours (its process ended, or the pid now belongs to a stranger) is removed."""
        pidfile = f"{name}.pid"
        if not self.group_alive(pidfile):
            script = f"cd {shlex.quote(self.spec.workdir)} 2>/dev/null && rm -f {shlex.quote(pidfile)}; true"
            subprocess.run(self.wrap(script), capture_output=True, timeout=60)
            return
        self.signal_group(pidfile, "TERM")
        for _ in range(100):
            if not self.group_alive(pidfile):
                break
            time.sleep(0.1)
        self.signal_group(pidfile, "KILL")

    def preflight(
        self,
        output_dir: str,
        *,
        min_free_bytes: int = 0,
        min_gpus: int = 0,
        require_sglang: bool = True,
        require_patch: bool = False,
        sglang_version: str | None = None,
        timeout: float = 180.0,
    ) -> dict:
        """Check the host in seconds; returns the report or raises PreflightError naming the problem.

        `sglang_version` (the profile's `gpu_host.sglang_version`): another installed release is refused."""
        try:
            proc = self.run(program_argv(self.spec.python, host_probe, output_dir), timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise PreflightError(
                f"{self.where()}: interpreter {self.spec.python} did not answer in {timeout:.0f}s"
            ) from None
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            err = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            raise PreflightError(f"{self.where()}: interpreter {self.spec.python} does not run: {err}")
        report = json.loads(lines[-1])
        report["host"] = self.where()
        py = f"{self.where()}: interpreter {self.spec.python}"
        if require_sglang and report["sglang_error"]:
            raise PreflightError(f"{py} has no sglang: {report['sglang_error']}")
        if (why := other_sglang_release(report, sglang_version)) is not None:
            raise PreflightError(f"{py} {why}")
        if report.get("sglang_version") and report.get("deepseek_v2_sha256"):
            try:
                release = sglang_releases.release(report["sglang_version"])
                report["patch_state"] = release.file_state(report["deepseek_v2_sha256"])
            except sglang_releases.UnsupportedRelease as e:
                report["patch_state"] = f"unsupported: {e}"
        if require_patch:
            if report.get("patch_state") != "patched":
                raise PreflightError(
                    f"{py}: sglang {report.get('sglang_version')} is not patched for hidden-state "
                    f"dumps ({report.get('patch_state')}); run `eagle3 patch apply --python {self.spec.python}`"
                )
            if not report["eagle3_dagster"]:
                raise PreflightError(
                    f"{py} cannot import eagle3_dagster, which the patched SGLang calls; "
                    "install this project there (pip install -e '.[gpu]')"
                )
        if report["gpu_count"] < min_gpus:
            raise PreflightError(
                f"{self.where()}: {report['gpu_count']} GPUs visible, {min_gpus} needed "
                f"({report['gpu_error'] or 'torch.cuda.device_count()'})"
            )
        if report["free_bytes"] < min_free_bytes:
            raise PreflightError(
                f"{self.where()}: {report['free_bytes'] / 2**30:.1f} GiB free at {output_dir}, "
                f"{min_free_bytes / 2**30:.1f} GiB needed"
            )
        return report


class HostProcess:
    """A process group on the host; `stop()` is safe to call any number of times."""

    def __init__(self, host: GpuHost, proc: subprocess.Popen, pidfile: str) -> None:
        self.host, self.proc, self.pidfile = host, proc, pidfile

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float = 20.0) -> None:
        self.host.signal_group(self.pidfile, "TERM")
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.host.group_alive(self.pidfile):
            time.sleep(0.2)
        self.host.signal_group(self.pidfile, "KILL", remove=True)
        with contextlib.suppress(ProcessLookupError):  # the local side: bash or ssh and anything it left
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.release()

    def release(self) -> None:
        """Close the watchdog's stdin once the process has ended, so the watchdog ends too."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
