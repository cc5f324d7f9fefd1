"""The SGLang server's lifecycle on the GPU host: its command line, start, health wait, log and stop.

Owns: `ServerSpec` (extraction or serving mode: the release's options from patches/sglang/releases.json,
the dump environment, refusing the options `sglang_releases` says an extraction cannot run with), `sglang_server` (refuse a port someone else
holds, or another live run's server on it, launch in its own process group, stream the log, wait for `/health_generate` and for the unique
`--served-model-name` it was launched with, fail at once when it could not bind its port, always stop it; with `--trust-remote-code`, refuse a target whose
code is not `reviewed_code`) and `LogTail` (the log file and its last lines
for an error message). The health checks themselves run beside the server (`sglang.health`).
Transport, process groups and pid files are `eagle3_dagster.gpu_host`'s; SGLang is never imported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_dagster import target_code
from eagle3_dagster.sglang_releases import refused_extraction_option
from eagle3_dagster.gpu_host import GpuHost, HostProcess, program_argv
from eagle3_dagster.sglang import claim, health
from eagle3_dagster.sglang import patch as sglang_patch

LogFn = Callable[[str], None]


class ServerError(RuntimeError):
    """The SGLang server did not become healthy; the message carries its last log lines."""


# SGLang's own way to turn the prefix cache back off is the only one the extraction accepts.
REQUIRED_EXTRACTION_OPTIONS = ("--disable-radix-cache",)


def server_option(args: Sequence[str], option: str) -> str | None:
    """The last value given for `option` (`--opt v` or `--opt=v`), as argparse would read it."""
    value = None
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
    return value


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
    reviewed_code: Mapping[str, str] | None = None  # the profile's target.reviewed_code: checked on the host first
    sglang_version: str | None = None  # the host's release: its own options (patches/sglang/releases.json)

    def argv(self, python: str, served_model_name: str | None = None) -> list[str]:
        args = [
            *(self.launcher or (python, "-m", "sglang.launch_server")),
            "--model-path",
            self.model_path,
            "--tp-size",
            str(self.tp_size),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
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
            args = [
                "--disable-radix-cache",
                "--chunked-prefill-size",
                "-1",
                "--disable-cuda-graph",
                "--skip-server-warmup",
            ]
        else:
            args = list(sglang_patch.release_for(self.sglang_version).extraction_args)
        missing = [a for a in REQUIRED_EXTRACTION_OPTIONS if a not in args]
        if missing:  # a releases.json row without it would serve cached prefixes with no states
            raise ValueError(
                f"hidden-state extraction on sglang {self.sglang_version} would run without {missing}: "
                "a cached prefix has no hidden states"
            )
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


class LogTail:
    """A process's log: every line appended to a file, the last `keep` kept for an error message."""

    def __init__(self, path, keep: int = 200, echo: LogFn | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # closed by close()
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

    A server left by a dead worker of this project is stopped through its pid file, but one of a live run that
    holds the host's lease is refused, naming the run (`claim`); anything else
    already answering on the port is refused before launching, and the server that turns healthy
    must answer with the unique `--served-model-name` it was launched with. Its process group is
    always stopped on leaving.
    """
    name = f"sglang-{spec.port}"
    check_reviewed_code(host, spec)
    claim.refuse_if_leased_elsewhere(host, name)  # a live server of a run holding the host is never stopped
    host.stop_stale(name)
    if host.run(program_argv(host.spec.python, health, "port", spec.port), check=False).returncode == 0:
        raise ServerError(
            f"{host.where()}: something already answers on 127.0.0.1:{spec.port} and it is not a "
            f"server this project started (none is recorded in {host.spec.workdir}/{name}.pid); "
            f"stop it or set hidden.sglang_port to a free port"
        )
    served_model_name = f"eagle3-{uuid.uuid4().hex[:16]}"
    claim.record_launch(host, name)
    proc = host.spawn(spec.argv(host.spec.python, served_model_name), spec.environment(), name)
    tail: deque[str] = deque(maxlen=40)
    port_taken: list[str] = []  # uvicorn's line when its bind of spec.port failed

    def pump() -> None:
        assert proc.proc.stdout is not None  # spawned with stdout=PIPE
        for line in proc.proc.stdout:
            tail.append(line.rstrip("\n"))
            on_log(line.rstrip("\n"))
            if not port_taken and port_bind_failed(line, spec.port):
                port_taken.append(line.strip())

    reader = threading.Thread(target=pump, name="sglang-log", daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{spec.port}"
    try:
        _wait_healthy(host, proc, url, spec.health_timeout_s, tail, served_model_name, port_taken)
        yield RunningServer(base_url=url, process=proc, served_model_name=served_model_name)
    finally:
        proc.stop(grace_s=0 if port_taken else 20)  # bound to nothing, it cannot stop before its warm-up gives up
        claim.forget(host, name)
        reader.join(timeout=5)


def check_reviewed_code(host: GpuHost, spec: ServerSpec) -> None:
    """With `--trust-remote-code` and `reviewed_code` set, the target folder's code files, hashed on the host
    where SGLang will import them (`target_code`, run by the host's interpreter), must be the reviewed ones;
    else UnreviewedCodeError naming each file and both hashes, before anything is started or stopped."""
    if not spec.trust_remote_code or spec.reviewed_code is None:
        return
    proc = host.run(
        program_argv(host.spec.python, target_code, "check", spec.model_path, json.dumps(dict(spec.reviewed_code))),
        check=False,
    )
    if proc.returncode != 0:
        said = proc.stderr.strip()[-4000:] or f"exit {proc.returncode}"
        raise target_code.UnreviewedCodeError(f"{host.where()}: {said}")


def port_bind_failed(line: str, port: int) -> bool:
    """Whether a server log line is uvicorn's refusal to listen on `port` (EADDRINUSE, as asyncio and uvloop
    word it: "[Errno 98] error while attempting to bind on address ('127.0.0.1', P): address already in use")."""
    lowered = line.lower()
    return "address already in use" in lowered and f", {port})" in lowered


def _wait_healthy(
    host: GpuHost,
    proc: HostProcess,
    url: str,
    timeout_s: float,
    tail: deque[str],
    served_model_name: str,
    port_taken: Sequence[str],
) -> None:
    """Until the waiter beside the server finds it healthy and ours. Fails at once when the server exits or
    when its HTTP server could not bind the port: SGLang's uvicorn then runs its shutdown, which joins the
    warm-up thread, and that thread polls the port (now another process's) 120 times with a 5 s timeout
    before SGLang kills itself, 12 minutes of a server that can never answer."""
    waiter = subprocess.Popen(
        host.command(program_argv(host.spec.python, health, "wait", url, timeout_s, served_model_name)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        while waiter.poll() is None:
            if proc.poll() is not None:
                raise ServerError(f"SGLang server exited with {proc.poll()} before it was healthy:\n" + "\n".join(tail))
            if port_taken:
                raise ServerError(
                    f"{host.where()}: SGLang could not listen on {url}: another process took the port after it "
                    f"was found free ({port_taken[0]}); set hidden.sglang_port (or gpu_host.hosts[i].sglang_port) to "
                    "a port nothing else uses"
                )
            time.sleep(0.2)
        said = (waiter.stdout.read() if waiter.stdout else "").strip()[-300:]
        if waiter.returncode == 2:
            raise ServerError(f"{host.where()}: refusing a server that is not ours: {said}")
        if waiter.returncode != 0:
            raise ServerError(
                f"SGLang server not healthy at {url}/health_generate within {timeout_s:.0f}s "
                f"({said}); last log lines:\n" + "\n".join(tail)
            )
    finally:
        if waiter.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(waiter.pid, signal.SIGKILL)
            waiter.wait()
