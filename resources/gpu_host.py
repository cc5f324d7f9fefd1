"""The `gpu_host` Dagster resource: the engine's GpuHost plus a Pipes launcher that works over SSH.

Dagster Pipes has no SSH client, and ssh forwards no environment, so
`run_pipes` puts the Pipes bootstrap variables on the command line of the
remote command (`env DAGSTER_PIPES_CONTEXT=... DAGSTER_PIPES_MESSAGES=...`),
asks the child's `dagster-pipes` to write its messages to stderr, and reads
them back line by line: JSON Pipes messages go to the session's handler
(structured logs, materializations, checks), every other line to the run's
compute log. The command runs in its own process group on the host (pid file in
the workdir); interruption, failure or a dying worker's next run stop it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import dagster as dg
from dagster._core.errors import DagsterPipesExecutionError  # what PipesSubprocessClient raises (1.13)
from dagster._core.pipes.utils import extract_message_or_forward_to_file  # no public equivalent (1.13)
from pydantic import Field

from eagle3_dagster.gpu_host import GpuHost, HostSpec


class _StderrMessageReader(dg.PipesMessageReader):
    """Tells the child to write messages to stderr; `run_pipes` feeds them to the handler."""

    @contextmanager
    def read_messages(self, handler: dg.PipesMessageHandler) -> Iterator[dict]:
        yield {"stdio": "stderr"}

    def no_messages_debug_text(self) -> str:
        return "The remote process wrote no Pipes messages to stderr; is dagster-pipes installed on the GPU host?"


class GpuHostResource(dg.ConfigurableResource):
    """Where GPU work runs: this machine or an SSH target, always with an explicit interpreter."""

    transport: str = Field("local", description="local or ssh")
    ssh_target: str | None = Field(None, description="user@host for transport=ssh")
    ssh_options: list[str] = Field(default_factory=list, description="extra ssh arguments, e.g. ['-p', '2222']")
    python: str = Field("python", description="the interpreter on the host (SGLang's environment)")
    workdir: str = Field(".eagle3/gpu_host", description="working folder on the host (pid files, logs)")

    @classmethod
    def from_profile(cls, profile) -> "GpuHostResource":
        g = profile.gpu_host
        return cls(transport=g.transport, ssh_target=g.ssh_target, ssh_options=list(g.ssh_options),
                   python=g.python if g.transport == "ssh" or g.python != "python" else sys.executable,
                   workdir=g.workdir)

    def check_output(self, argv: Sequence[str], timeout_s: float = 120.0) -> str:
        return self.host().run(list(argv), timeout=timeout_s).stdout

    def host(self) -> GpuHost:
        return GpuHost(HostSpec(self.transport, self.python, self.workdir, self.ssh_target, tuple(self.ssh_options)))

    def free_bytes(self, path: str) -> int:
        return int(self.host().preflight(path, require_sglang=False)["free_bytes"])

    def run_pipes(
        self,
        *,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        extras: Mapping | None = None,
        name: str = "pipes",
    ) -> dg.PipesClientCompletedInvocation:
        """Run `command` on the host inside a Pipes session; non-zero exit raises DagsterPipesExecutionError."""
        host = self.host()
        with dg.open_pipes_session(
            context=context, context_injector=dg.PipesEnvContextInjector(),
            message_reader=_StderrMessageReader(), extras=dict(extras or {}),
        ) as session:
            full_env = {**(env or {}), **session.get_bootstrap_env_vars()}
            proc = host.spawn(list(command), full_env, name, cwd=cwd, stdout=None, stderr=subprocess.PIPE)
            forward = threading.Thread(target=_pump, args=(proc.proc.stderr, session), daemon=True)
            forward.start()
            try:
                returncode = proc.proc.wait()
                forward.join()
            except BaseException:  # interruption (SIGINT/SIGTERM from Dagster) or a failure here
                context.log.info(f"[pipes] stopping process group {name} on {host.where()}")
                proc.stop(grace_s=20)
                raise
            finally:
                host.signal_group(proc.pidfile, "KILL", remove=True)
                proc.release()
            if returncode != 0:
                raise DagsterPipesExecutionError(
                    f"{' '.join(command)} on {host.where()} failed with exit code {returncode}"
                )
        return dg.PipesClientCompletedInvocation(session)


def _pump(stream, session: dg.PipesSession) -> None:
    for line in stream:
        extract_message_or_forward_to_file(session.message_handler, line.rstrip("\n"), sys.stderr)
