"""Run commands on the GPU host (this machine or one reached over SSH) with an explicit interpreter.

Owns: building the shell command for either transport (environment variables go
on the command line, since ssh forwards none), one-shot commands, long-running
processes in their own process group with a pid file on the host so they can
always be stopped (`HostProcess`), preflight (interpreter, SGLang and its patch
state, GPUs, free disk) and the SGLang server's lifecycle (`sglang_server`).
It never imports SGLang or Dagster; the resource in resources/gpu_host.py wraps it.

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
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.sglang import patch as sglang_patch

LogFn = Callable[[str], None]

# Runs the command as its own process group (pid file = group id) and a watchdog beside it that
# waits for EOF on stdin, i.e. for the launching worker to go away, then stops the group: TERM,
# then KILL after a grace period. The child's own stdin is /dev/null.
# (Background jobs of a non-interactive shell get /dev/null as stdin, hence the explicit fd 3.)
WATCHDOG = """\
exec 3<&0
setsid -w env {nonce_env} bash -c {inner} </dev/null 3<&- & child=$!
( cat <&3 >/dev/null; {owned} && pg=$OWNED_PG && kill -TERM -- -$pg && \
  sleep 20 && {owned} && kill -KILL -- -$pg ) >/dev/null 2>&1 & watchdog=$!
exec 3<&-
wait $child; rc=$?
kill $watchdog 2>/dev/null
exit $rc"""

NONCE_VAR = "EAGLE3_LAUNCH_NONCE"

# Written by the group leader before it execs the command: "pgid starttime nonce" (the nonce is in its
# environment already, so in every process of the group). The start time is read with builtins after the
# comm field, which may hold spaces: field 22 of /proc/pid/stat is the 20th after it.
_WRITE_PIDFILE = ('read -r _s < /proc/$$/stat; set -- ${{_s##*) }}; '
                  'echo "$$ ${{20}} {nonce}" > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; ')

# Exit 0 (and OWNED_PG set) when the pid file names a live process group this project started: its leader
# is alive with the recorded start time (pid + start time name one process, whatever reused the pid since),
# or, the leader gone, a member of the group carries the recorded nonce in its environment.
_OWNED = ("( read -r pg st nonce _ < {pidfile} 2>/dev/null && [ -n \"$nonce\" ] || exit 1; "
          "if read -r s < /proc/$pg/stat 2>/dev/null; then set -- ${{s##*) }}; "
          "[ \"$3\" = \"$pg\" ] && [ \"${{20}}\" = \"$st\" ]; exit $?; fi; "
          "for p in /proc/[0-9]*; do read -r s < $p/stat 2>/dev/null || continue; set -- ${{s##*) }}; "
          "[ \"$3\" = \"$pg\" ] || continue; "
          "tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -qxF \"{var}=$nonce\" && exit 0; done; exit 1 )")


def _owned(pidfile: str) -> str:
    """A shell condition: the pid file names a live group this project started; sets OWNED_PG."""
    q = shlex.quote(pidfile)
    return f"{{ {_OWNED.format(pidfile=q, var=NONCE_VAR)} && read -r OWNED_PG _ < {q}; }}"

# Run by the host's interpreter: one JSON line describing what a step will need.
PROBE = r"""
import hashlib, importlib.util, json, os, shutil, subprocess, sys
out = {"python": sys.executable, "python_version": sys.version.split()[0], "sglang_version": None,
       "sglang_error": None, "deepseek_v2_sha256": None, "gpu_count": 0, "gpu_error": None,
       "eagle3_dagster": importlib.util.find_spec("eagle3_dagster") is not None}
try:  # the release that is imported: sglang.__version__ (sglang/version.py), else the installed metadata
    import sglang
    from importlib.metadata import version
    out["sglang_version"] = getattr(sglang, "__version__", None) or version("sglang")
    f = os.path.join(os.path.dirname(sglang.__file__), "srt", "models", "deepseek_v2.py")
    if os.path.exists(f):
        out["deepseek_v2_sha256"] = hashlib.sha256(open(f, "rb").read()).hexdigest()
except Exception as e:
    out["sglang_error"] = f"{type(e).__name__}: {e}"
try:  # nvidia-smi answers in a second; importing torch takes several
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    out["gpu_count"] = sum(1 for line in smi.stdout.splitlines() if line.startswith("GPU "))
except Exception as e:
    try:
        import torch
        out["gpu_count"] = torch.cuda.device_count()
    except Exception as e2:
        out["gpu_error"] = f"no nvidia-smi ({e}) and no torch ({e2})"
path = os.path.abspath(sys.argv[1])
while not os.path.exists(path):
    path = os.path.dirname(path)
out["disk_path"] = path
out["free_bytes"] = shutil.disk_usage(path).free
print(json.dumps(out))
"""

# Run by the host's interpreter: exit 0 when something accepts TCP connections on 127.0.0.1:PORT, else 1.
PORT_ANSWERS = r"""
import socket, sys
with socket.socket() as s:
    s.settimeout(5)
    sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
"""

# Run by the host's interpreter: poll /health_generate until 200 (503 while SGLang loads), then check that
# the server answering is the one launched with --served-model-name NAME. /model_info has the field
# `served_model_name` from 0.5.18 on; /v1/models lists it as `data[].id` in every release 0.5.10-0.5.23.
# Exit 0: ours and healthy; 1: not healthy in time; 2: another server answers on the port.
WAIT_HEALTHY = r"""
import json, sys, time, urllib.error, urllib.request
url, deadline, name = sys.argv[1], time.monotonic() + float(sys.argv[2]), sys.argv[3]
def get(path):
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read() or b"null")
def served_names():
    try:
        info = get("/model_info")
        if isinstance(info, dict) and "served_model_name" in info:
            return [info["served_model_name"]]
    except (urllib.error.HTTPError, ValueError):
        pass
    try:
        models = get("/v1/models")
        return [m.get("id") for m in models.get("data", [])]
    except (urllib.error.HTTPError, ValueError, AttributeError) as e:
        return [f"<no model list: {e!r}>"]
last = ""
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(url + "/health_generate", timeout=30) as r:
            healthy = r.status == 200
    except urllib.error.HTTPError as e:
        healthy, last = False, f"HTTP {e.code}"
    except Exception as e:
        healthy, last = False, repr(e)
    if healthy:
        names = served_names()
        if name in names:
            sys.exit(0)
        print(f"the server answering at {url} serves {names}, not {name!r}, the name this run launched it with")
        sys.exit(2)
    time.sleep(1)
print(last)
sys.exit(1)
"""


class PreflightError(RuntimeError):
    """The host cannot run the step; the message names what is missing."""


class ServerError(RuntimeError):
    """The SGLang server did not become healthy; the message carries its last log lines."""


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
        return ["ssh", "-o", "BatchMode=yes", *self.spec.ssh_options, "--", self.spec.ssh_target, script]

    def command(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
        return self.wrap(shell_script(argv, env, self.spec.workdir))

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 120.0,
            check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(self.command(argv, env), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{self.where()}: {shlex.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        return proc

    def write_file(self, path: str, data: bytes, timeout: float = 300.0) -> None:
        """Write `data` to `path` (relative paths: under the workdir) on the host, atomically, through stdin."""
        target = shlex.quote(path)
        script = (f"mkdir -p {shlex.quote(self.spec.workdir)} && cd {shlex.quote(self.spec.workdir)} && "
                  f"mkdir -p \"$(dirname {target})\" && cat > {target}.tmp && mv {target}.tmp {target}")
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

    def spawn(self, argv: Sequence[str], env: Mapping[str, str] | None, name: str, *, cwd: str | None = None,
              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) -> "HostProcess":
        """Start a long-running command in its own process group, recorded in `{workdir}/{name}.pid`."""
        pidfile = f"{name}.pid"
        self.stop_stale(name)
        nonce = uuid.uuid4().hex
        inner = _WRITE_PIDFILE.format(nonce=nonce, pidfile=shlex.quote(pidfile)) + shell_script(argv, env, cwd)
        script = f"mkdir -p {shlex.quote(self.spec.workdir)} && cd {shlex.quote(self.spec.workdir)} && " \
                 + WATCHDOG.format(inner=shlex.quote(inner), owned=_owned(pidfile), nonce_env=f"{NONCE_VAR}={nonce}")
        # The worker keeps the write end of stdin and never writes: when it dies (even by SIGKILL) the
        # watchdog on the host reads EOF and stops the process group, so no GPU job outlives its run.
        proc = subprocess.Popen(self.wrap(script), stdout=stdout, stderr=stderr, stdin=subprocess.PIPE,
                                text=True, bufsize=1, start_new_session=True)
        return HostProcess(self, proc, pidfile)

    def signal_group(self, pidfile: str, sig: str, *, remove: bool = False) -> None:
        """Signal the group the pid file names, only when this project started it (`_owned`)."""
        script = (f"cd {shlex.quote(self.spec.workdir)} 2>/dev/null && [ -f {shlex.quote(pidfile)} ] && "
                  f"{_owned(pidfile)} && kill -{sig} -- -$OWNED_PG 2>/dev/null"
                  + (f"; rm -f {shlex.quote(pidfile)}" if remove else "") + "; true")
        subprocess.run(self.wrap(script), capture_output=True, timeout=60)

    def group_alive(self, pidfile: str) -> bool:
        """True while the group the pid file names is alive and is one this project started."""
        script = (f"cd {shlex.quote(self.spec.workdir)} 2>/dev/null && [ -f {shlex.quote(pidfile)} ] && "
                  f"{_owned(pidfile)}")
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

    def preflight(self, output_dir: str, *, min_free_bytes: int = 0, min_gpus: int = 0,
                  require_sglang: bool = True, require_patch: bool = False, sglang_version: str | None = None,
                  timeout: float = 180.0) -> dict:
        """Check the host in seconds; returns the report or raises PreflightError naming the problem.

        `sglang_version` (the profile's `gpu_host.sglang_version`): another installed release is refused."""
        try:
            proc = self.run([self.spec.python, "-c", PROBE, output_dir], timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise PreflightError(f"{self.where()}: interpreter {self.spec.python} did not answer in {timeout:.0f}s") from None
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
                release = sglang_patch.release_for(report["sglang_version"])
                report["patch_state"] = (
                    "patched" if report["deepseek_v2_sha256"] == release.patched_sha256
                    else "unpatched" if report["deepseek_v2_sha256"] == release.pristine_sha256
                    else "modified-unknown")
            except sglang_patch.PatchError as e:
                report["patch_state"] = f"unsupported: {e}"
        if require_patch:
            if report.get("patch_state") != "patched":
                raise PreflightError(f"{py}: sglang {report.get('sglang_version')} is not patched for hidden-state "
                                     f"dumps ({report.get('patch_state')}); run `eagle3 patch apply --python {self.spec.python}`")
            if not report["eagle3_dagster"]:
                raise PreflightError(f"{py} cannot import eagle3_dagster, which the patched SGLang calls; "
                                     "install this project there (pip install -e '.[gpu]')")
        if report["gpu_count"] < min_gpus:
            raise PreflightError(f"{self.where()}: {report['gpu_count']} GPUs visible, {min_gpus} needed "
                                 f"({report['gpu_error'] or 'torch.cuda.device_count()'})")
        if report["free_bytes"] < min_free_bytes:
            raise PreflightError(f"{self.where()}: {report['free_bytes'] / 2**30:.1f} GiB free at {output_dir}, "
                                 f"{min_free_bytes / 2**30:.1f} GiB needed")
        return report


def other_sglang_release(report: dict, expected: str | None) -> str | None:
    """Why a host whose preflight `report` this is cannot run a step for `expected`, or None.

    The export writes its aux ids for `gpu_host.sglang_version`, and releases read them differently
    (DeepSeek: `always_plus_one` up to 0.5.12, `plus_one_if_first_is_one` from 0.5.13): a host on
    another release would extract, or serve, a set that is not the one the export names."""
    installed = report.get("sglang_version")
    if expected is None or installed is None or installed == expected:
        return None
    return (f"has SGLang {installed} installed, but gpu_host.sglang_version is {expected}: the drafter's aux ids "
            f"are written for {expected}, and another release may read them as other layers; install SGLang "
            f"{expected} there or set gpu_host.sglang_version to {installed}")


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


# Server options under which the dump would store something other than SGLang's own EAGLE-3 capture,
# or a prefill would skip rows (prefix tokens served from a cache have no hidden states; a mixed batch
# is not a plain EXTEND forward, which is all the hook dumps).
EXTRACTION_REFUSED_OPTIONS = {
    "--enable-flashinfer-allreduce-fusion": "layer outputs stay per-rank partial sums",
    "--enable-two-batch-overlap": "layers past the first dense ones skip the capture",
    "--enforce-piecewise-cuda-graph": "the prefill forward is replayed from a CUDA graph, without the hook",
    "--enable-dp-attention": "rows are scattered across ranks",
    "--enable-hierarchical-cache": "a prefix cache: cached prompt tokens are not recomputed and have no states",
    "--enable-hicache": "a prefix cache: cached prompt tokens are not recomputed and have no states",
    "--enable-session-radix-cache": "a prefix cache: cached prompt tokens are not recomputed and have no states",
    "--radix-cache-backend": "a prefix cache: cached prompt tokens are not recomputed and have no states",
    "--enable-lmcache": "a prefix cache: cached prompt tokens are not recomputed and have no states",
    "--enable-mixed-chunk": "decode rows join prefill chunks, a MIXED forward the dump does not capture",
    "--disaggregation-mode": "prefill/decode disaggregation moves prefixes between servers",
}
# SGLang's own way to turn the prefix cache back off is the only one the extraction accepts.
REQUIRED_EXTRACTION_OPTIONS = ("--disable-radix-cache",)


def refused_extraction_option(args: Sequence[str]) -> str | None:
    """Why an extraction server cannot run with these options (naming the first bad one), or None."""
    for arg in args:
        option = arg.split("=")[0]
        if option in EXTRACTION_REFUSED_OPTIONS:
            return (f"hidden-state extraction cannot run with {option}: {EXTRACTION_REFUSED_OPTIONS[option]}; "
                    "remove it from the server options")
    return None


@dataclass(frozen=True)
class ServerSpec:
    model_path: str
    port: int = 30000
    tp_size: int = 1
    dump_dir: str | None = None  # set: extraction mode (SGLANG_HS_DUMP_DIR); None: serving
    dump_layers: tuple[int, ...] = ()  # canonical ids
    context_length: int | None = None  # serving: --context-length (the profile's target.serving_context)
    extra_args: tuple[str, ...] = ()
    launcher: tuple[str, ...] | None = None  # default: (python, -m, sglang.launch_server); tests use a stand-in
    env: Mapping[str, str] = field(default_factory=dict)
    health_timeout_s: float = 1800.0
    trust_remote_code: bool = False  # the profile's target.trust_remote_code; off unless it says so
    sglang_version: str | None = None  # the host's release: its own options (patches/sglang/releases.json)

    def argv(self, python: str, served_model_name: str | None = None) -> list[str]:
        args = [*(self.launcher or (python, "-m", "sglang.launch_server")), "--model-path", self.model_path,
                "--tp-size", str(self.tp_size), "--host", "127.0.0.1", "--port", str(self.port)]
        if served_model_name is not None:
            args += ["--served-model-name", served_model_name]
        if self.trust_remote_code:
            args.append("--trust-remote-code")
        if self.context_length is not None:
            args += ["--context-length", str(self.context_length)]
        if self.dump_dir is not None:
            args += self._extraction_args()
        elif self.sglang_version is not None:  # serving: no fused all-reduce (releases.json serving_args)
            args += sglang_patch.release_for(self.sglang_version).serving_args
        return [*args, *self.extra_args]

    def _extraction_args(self) -> list[str]:
        """Every token computed (no prefix cache), whole prompts per forward, the hook run on every forward
        (no CUDA graphs, piecewise prefill graphs included) and on all-reduced states (no fused all-reduce)."""
        if (why := refused_extraction_option(self.extra_args)) is not None:
            raise ValueError(why)
        if self.sglang_version is None:
            args = ["--disable-radix-cache", "--chunked-prefill-size", "-1", "--disable-cuda-graph",
                    "--skip-server-warmup"]
        else:
            args = list(sglang_patch.release_for(self.sglang_version).extraction_args)
        missing = [a for a in REQUIRED_EXTRACTION_OPTIONS if a not in args]
        if missing:  # a releases.json row without it would serve cached prefixes with no states
            raise ValueError(f"hidden-state extraction on sglang {self.sglang_version} would run without {missing}: "
                             "a cached prefix has no hidden states")
        return args

    def environment(self) -> dict[str, str]:
        env = dict(self.env)
        if server_option(self.extra_args, "--device") == "cpu":
            env.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's is_cpu() reads it besides --device cpu
        if self.dump_dir is not None:
            if len(self.dump_layers) == 0:
                raise ValueError("extraction server needs dump_layers (canonical aux ids)")
            env["SGLANG_HS_DUMP_DIR"] = self.dump_dir
            env["SGLANG_HS_DUMP_LAYERS"] = ",".join(map(str, self.dump_layers))
        return env


def server_option(args: Sequence[str], option: str) -> str | None:
    """The last value given for `option` (`--opt v` or `--opt=v`), as argparse would read it."""
    value = None
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
    return value


class LogTail:
    """A process's log: every line appended to a file, the last `keep` kept for an error message."""

    def __init__(self, path, keep: int = 200, echo: LogFn | None = None) -> None:
        from pathlib import Path

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self.lines: deque[str] = deque(maxlen=keep)
        self._echo = echo
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)
            self._file.write(line + "\n")
        if self._echo is not None:
            self._echo(line)

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class RunningServer:
    base_url: str  # as seen from the host itself
    process: HostProcess
    served_model_name: str  # the nonce it was launched with; the health wait checked that it answers with it


@contextlib.contextmanager
def sglang_server(host: GpuHost, spec: ServerSpec, on_log: LogFn = print) -> Iterator[RunningServer]:
    """Start the server, stream its log to `on_log`, wait until it is healthy and is the one we started.

    A server left by a dead worker of this project is stopped through its pid file; anything else
    already answering on the port is refused before launching, and the server that turns healthy
    must answer with the unique `--served-model-name` it was launched with. Its process group is
    always stopped on leaving.
    """
    name = f"sglang-{spec.port}"
    host.stop_stale(name)
    if host.run([host.spec.python, "-c", PORT_ANSWERS, str(spec.port)], check=False).returncode == 0:
        raise ServerError(f"{host.where()}: something already answers on 127.0.0.1:{spec.port} and it is not a "
                          f"server this project started (none is recorded in {host.spec.workdir}/{name}.pid); "
                          f"stop it or set hidden.sglang_port to a free port")
    served_model_name = f"eagle3-{uuid.uuid4().hex[:16]}"
    proc = host.spawn(spec.argv(host.spec.python, served_model_name), spec.environment(), name)
    tail: deque[str] = deque(maxlen=40)

    def pump() -> None:
        for line in proc.proc.stdout:
            tail.append(line.rstrip("\n"))
            on_log(line.rstrip("\n"))

    reader = threading.Thread(target=pump, name="sglang-log", daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{spec.port}"
    try:
        _wait_healthy(host, proc, url, spec.health_timeout_s, tail, served_model_name)
        yield RunningServer(base_url=url, process=proc, served_model_name=served_model_name)
    finally:
        proc.stop()
        reader.join(timeout=5)


def _wait_healthy(host: GpuHost, proc: HostProcess, url: str, timeout_s: float, tail: deque[str],
                  served_model_name: str) -> None:
    waiter = subprocess.Popen(
        host.command([host.spec.python, "-c", WAIT_HEALTHY, url, str(timeout_s), served_model_name]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        while waiter.poll() is None:
            if proc.poll() is not None:
                raise ServerError(f"SGLang server exited with {proc.poll()} before it was healthy:\n" + "\n".join(tail))
            time.sleep(0.2)
        said = waiter.stdout.read().strip()[-300:]
        if waiter.returncode == 2:
            raise ServerError(f"{host.where()}: refusing a server that is not ours: {said}")
        if waiter.returncode != 0:
            raise ServerError(f"SGLang server not healthy at {url}/health_generate within {timeout_s:.0f}s "
                              f"({said}); last log lines:\n" + "\n".join(tail))
    finally:
        if waiter.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(waiter.pid, signal.SIGKILL)
            waiter.wait()
