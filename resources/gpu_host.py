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
A training on several nodes takes several with `lease_hosts` and runs one
command on each in one Pipes session (`run_pipes_on_hosts`): every host's lines
go to the run's log prefixed with its name, and the first host to fail stops
the others (eagle3_dagster/host_group.py).
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
from eagle3_dagster.host_group import HostCommand, HostFailed, run_on_hosts

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

    hosts: list[HostEntry] = Field(
        default_factory=lambda: [HostEntry()], min_length=1, description=HostsConfig.model_fields["hosts"].description
    )

    @classmethod
    def from_profile(cls, profile) -> "GpuHostResource":
        g = profile.gpu_host
        return cls(
            hosts=[HostEntry(**h.model_dump()) for h in g.hosts],
            **g.model_dump(include=set(HostsConfig.model_fields) - {"hosts"}),
        )

    def all_hosts(self) -> list[GpuHost]:
        return [GpuHost(h) for h in self.hosts]

    def host(self) -> GpuHost:
        """The first host: for work that needs no GPU of its own (reading the target, free space)."""
        return self.all_hosts()[0]

    def free_bytes(self, path: str) -> int:
        return int(self.host().preflight(path, require_sglang=False)["free_bytes"])

    @contextmanager
    def lease(
        self,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        *,
        preflight: Callable[[GpuHost], object] | None = None,
        shards: Sequence[str] = (),
    ) -> Iterator[GpuHost]:
        """Hold one free host that passes `preflight` for the block; the run is tagged with its name.

        A host whose preflight raises is skipped (a warning names it and the reason); no usable host is a
        dg.Failure naming every host."""
        with self.lease_hosts(context, 1, preflight=preflight, shards=shards) as hosts:
            yield hosts[0]

    @contextmanager
    def lease_hosts(
        self,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        count: int,
        *,
        preflight: Callable[[GpuHost], object] | None = None,
        shards: Sequence[str] = (),
    ) -> Iterator[list[GpuHost]]:
        """Hold `count` free hosts (all or none; host_lease.lease_hosts) for the block, as `lease` holds one; the
        run tag names them all, comma-separated."""
        from eagle3_dagster.host_lease import GPU_POOL, NoHostError, lease_hosts

        hosts = self.all_hosts()
        lease_dir = self.lease_dir or str(Path(context.instance.storage_directory()) / "gpu_host_leases")
        _warn_on_pool_size(context, len(hosts))
        holder = {"run_id": context.run_id, "shards": list(shards)}
        try:
            with lease_hosts(
                [(h.name, h) for h in hosts],
                count,
                lease_dir,
                holder=holder,
                preflight=None if preflight is None else (lambda _name, h: preflight(h)),
                log=lambda line: (context.log.warning if " skipped: " in line else context.log.info)(line),
                wait_s=self.lease_wait_s,
            ) as leases:
                _tag(context, {HOST_TAG: ",".join(lease.name for lease in leases)})
                yield [lease.host for lease in leases]
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
        with nullcontext(host) if host is not None else self.lease(context) as leased:
            return self._run_pipes(leased, context=context, command=command, env=env, cwd=cwd, extras=extras, name=name)

    def _run_pipes(
        self, host: GpuHost, *, context, command, env, cwd, extras, name
    ) -> dg.PipesClientCompletedInvocation:
        with dg.open_pipes_session(
            context=context,
            context_injector=dg.PipesEnvContextInjector(),
            message_reader=_StderrMessageReader(),
            extras=dict(extras or {}),
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

    def run_pipes_on_hosts(
        self,
        *,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        commands: Sequence[HostCommand],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        extras: Mapping | None = None,
        name: str = "pipes",
    ) -> dg.PipesClientCompletedInvocation:
        """Run each command on its host (hosts the caller leased, `lease_hosts`) inside one Pipes session: the
        messages of whichever process opens Pipes (torchrun's rank 0, on any host) reach the run, every other
        line goes to the run's log prefixed with its host's name. The first host to fail stops the others and
        raises `dg.Failure` naming it (eagle3_dagster/host_group.py)."""
        with dg.open_pipes_session(
            context=context,
            context_injector=dg.PipesEnvContextInjector(),
            message_reader=_StderrMessageReader(),
            extras=dict(extras or {}),
        ) as session:
            lock = threading.Lock()

            def on_line(host: str, line: str) -> bool:
                with lock:  # a line at a time into the session and the log, whichever host's reader calls
                    return _handle_line(session, line, prefix=f"[{host}] ")

            try:
                run_on_hosts(
                    commands,
                    {**(env or {}), **session.get_bootstrap_env_vars()},
                    name=name,
                    cwd=cwd,
                    on_line=on_line,
                    log=lambda line: context.log.info(f"[{name}] {line}"),
                )
            except HostFailed as e:
                raise dg.Failure(description=str(e), metadata={"failed_host": e.host}) from None
        return dg.PipesClientCompletedInvocation(session)


def _pump(stream, session: dg.PipesSession) -> None:
    """The child's stderr: Pipes messages to the session, every other line to this process's stderr (the run's
    captured log). Dagster's own reader for this is not public API (`dagster._core.pipes.utils`)."""
    for line in stream:
        _handle_line(session, line.rstrip("\n"))


def _handle_line(session: dg.PipesSession, line: str, prefix: str = "") -> bool:
    """A Pipes message to the session (True), any other line to the run's captured log after `prefix`."""
    try:
        handled = forward_message(session.message_handler, line)
    except Exception as e:  # the pump must drain the pipe, or the child blocks on a full one
        sys.stderr.write(f"{prefix}{line}\n[pipes] message not handled: {type(e).__name__}: {e}\n")
        return False
    if not handled:
        sys.stderr.write(f"{prefix}{line}\n")
    return handled


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
        context.log.warning(
            f"pool {GPU_POOL} has {limit} slots for {num_hosts} GPU hosts: set it with "
            "`eagle3 pool-limits` (scripts/ui.sh does) so each host runs one step at a time"
        )
