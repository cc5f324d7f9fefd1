"""The `gpu_host` Dagster resource: the engine's GpuHost plus a Pipes launcher that works over SSH.

Dagster Pipes has no SSH client, and ssh forwards no environment, so
`run_pipes` puts the Pipes bootstrap variables on the command line of the
remote command (`env DAGSTER_PIPES_CONTEXT=... DAGSTER_PIPES_MESSAGES=...`),
asks the child's `dagster-pipes` to write its messages to stderr, and reads
them back line by line: JSON Pipes messages go to the session's handler
(structured logs, materializations, checks), every other line to the run's
compute log. The command runs in its own process group on the host (pid file in
the workdir); interruption, failure or a dying worker's next run stop it.

The hosts are a list (`hosts`, one element for one host); a GPU step takes one
with `lease` (engine: eagle3_dagster/host_lease.py): the first free host whose
preflight passes, held until the step ends, and named in the run tag
`eagle3/gpu_host`. `run_pipes` leases one itself unless it is handed a host.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

import dagster as dg
from dagster_pipes import PIPES_PROTOCOL_VERSION_FIELD
from pydantic import Field

from eagle3_dagster.config import HostsConfig
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.gpu_host import GpuHost

HOST_TAG = "eagle3/gpu_host"  # the run tag naming the host a GPU step leased


class _StderrMessageReader(dg.PipesMessageReader):
    """Tells the child to write messages to stderr; `run_pipes` feeds them to the handler."""

    @contextmanager
    def read_messages(self, handler: dg.PipesMessageHandler) -> Iterator[dict]:
        yield {"stdio": "stderr"}

    def no_messages_debug_text(self) -> str:
        return "The remote process wrote no Pipes messages to stderr; is dagster-pipes installed on the GPU host?"


class HostEntry(dg.Config, HostConfig):
    """One GPU host in the resource's config: the engine's HostConfig (its fields, help and checks) as
    Dagster config, so the launchpad shows and checks the same fields as the profile's `gpu_host.hosts[i]`."""


class GpuHostResource(dg.ConfigurableResource, HostsConfig):
    """Where GPU work runs: this machine or SSH targets, always with an explicit interpreter.

    The profile's `gpu_host` less what only the stages read (`sglang_version`): the hosts, of which each GPU
    step leases one (`lease`), the lease folder and how long a step waits."""

    hosts: list[HostEntry] = Field(default_factory=lambda: [HostEntry()], min_length=1,
                                   description=HostsConfig.model_fields["hosts"].description)

    @classmethod
    def from_profile(cls, profile) -> "GpuHostResource":
        g = profile.gpu_host
        return cls(hosts=[HostEntry(**h.model_dump()) for h in g.hosts],
                   **g.model_dump(include=set(HostsConfig.model_fields) - {"hosts"}))

    def all_hosts(self) -> list[GpuHost]:
        return [GpuHost(h) for h in self.hosts]

    def host(self) -> GpuHost:
        """The first host: for work that needs no GPU of its own (reading the target, free space)."""
        return self.all_hosts()[0]

    def free_bytes(self, path: str) -> int:
        return int(self.host().preflight(path, require_sglang=False)["free_bytes"])

    @contextmanager
    def lease(self, context: dg.AssetExecutionContext | dg.OpExecutionContext, *,
              preflight: Callable[[GpuHost], object] | None = None, shards: Sequence[str] = ()) -> Iterator[GpuHost]:
        """Hold one free host that passes `preflight` for the block; the run is tagged with its name.

        A host whose preflight raises is skipped (a warning names it and the reason); no usable host is a
        dg.Failure naming every host."""
        from eagle3_dagster.host_lease import GPU_POOL, NoHostError, lease_host

        hosts = self.all_hosts()
        lease_dir = self.lease_dir or str(Path(context.instance.storage_directory()) / "gpu_host_leases")
        _warn_on_pool_size(context, len(hosts))
        holder = {"run_id": context.run_id, "shards": list(shards)}
        try:
            with lease_host([(h.name, h) for h in hosts], lease_dir, holder=holder,
                            preflight=None if preflight is None else (lambda _name, h: preflight(h)),
                            log=lambda line: (context.log.warning if " skipped: " in line else context.log.info)(line),
                            wait_s=self.lease_wait_s) as lease:
                _tag(context, {HOST_TAG: lease.name})
                yield lease.host
        except NoHostError as e:
            raise dg.Failure(description=f"{e} (pool {GPU_POOL})") from None

    def run_pipes(
        self,
        *,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        extras: Mapping | None = None,
        name: str = "pipes",
        host: GpuHost | None = None,
    ) -> dg.PipesClientCompletedInvocation:
        """Run `command` on `host` (default: a host leased for the call) inside a Pipes session; non-zero exit
        raises `dg.Failure` naming the command, the host and the exit code."""
        with (nullcontext(host) if host is not None else self.lease(context)) as leased:
            return self._run_pipes(leased, context=context, command=command, env=env, cwd=cwd, extras=extras,
                                   name=name)

    def _run_pipes(self, host: GpuHost, *, context, command, env, cwd, extras, name) -> dg.PipesClientCompletedInvocation:
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
                raise dg.Failure(f"{' '.join(command)} on {host.where()} failed with exit code {returncode}")
        return dg.PipesClientCompletedInvocation(session)


def _pump(stream, session: dg.PipesSession) -> None:
    """The child's stderr: Pipes messages to the session, every other line to this process's stderr (the run's
    captured log). Dagster's own reader for this is not public API (`dagster._core.pipes.utils`)."""
    for line in stream:
        line = line.rstrip("\n")
        try:
            handled = forward_message(session.message_handler, line)
        except Exception as e:  # noqa: BLE001 - the pump must drain the pipe, or the child blocks on a full one
            sys.stderr.write(f"{line}\n[pipes] message not handled: {type(e).__name__}: {e}\n")
            continue
        if not handled:
            sys.stderr.write(line + "\n")


def forward_message(handler: dg.PipesMessageHandler, line: str) -> bool:
    """Hand `line` to `handler` when it is a Pipes message (a JSON object with the protocol's version field);
    False for any other line, which the caller keeps as log text."""
    try:
        message = json.loads(line)
    except ValueError:
        return False
    if not isinstance(message, dict) or PIPES_PROTOCOL_VERSION_FIELD not in message:
        return False
    handler.handle_message(message)
    return True


def _tag(context, tags: Mapping[str, str]) -> None:
    context.instance.add_run_tags(context.run_id, dict(tags))


def _warn_on_pool_size(context, num_hosts: int) -> None:
    """Say so when the instance's gpu_host pool limit is not the number of hosts (`eagle3 pool-limits`)."""
    from eagle3_dagster.host_lease import GPU_POOL

    try:
        limit = context.instance.event_log_storage.get_concurrency_info(GPU_POOL).slot_count
    except Exception:  # an instance without concurrency storage: nothing to compare
        return
    if limit != num_hosts:
        context.log.warning(f"pool {GPU_POOL} has {limit} slots for {num_hosts} GPU hosts: set it with "
                            "`eagle3 pool-limits` (scripts/ui.sh does) so each host runs one step at a time")
