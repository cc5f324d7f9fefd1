"""torchrun on every node of a training: which hosts, where they meet, and the command each one runs.

Owns: refusing a host pool smaller than `train.nnodes`, the c10d rendezvous
endpoint, and each leased host's torchrun command (with that host's own
interpreter). Starting the commands together and stopping them together is
`eagle3_dagster.host_group`'s; leasing the hosts and the Pipes session, the
gpu_host resource's.

The endpoint is `train.rdzv_endpoint` when set. Otherwise, with several nodes,
the first leased host hosts the rendezvous store: its ssh target's host name
(127.0.0.1 for a local host) and a port that host's interpreter finds free just
before the launch; its torchrun is told to host the store (`is_host=1`) and the
others to join it, rather than each guessing from its own host names. The port
is chosen per launch and is not part of the job, so a retry finds the same run
folder. Every node reads the job file, the shards and the target where the
first host's path names them: the hosts share the run_root file system.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eagle3_dagster import ports
from eagle3_dagster.config import TrainConfig
from eagle3_dagster.gpu_host import GpuHost, program_argv
from eagle3_dagster.host_group import HostCommand
from eagle3_dagster.train import build_torchrun_command


class TooFewHostsError(ValueError):
    """The gpu_host pool lists fewer hosts than train.nnodes."""


def check_host_count(nnodes: int, num_hosts: int) -> None:
    """Refuse, naming both settings, a training on more nodes than the pool has hosts (one node per host)."""
    if num_hosts < nnodes:
        raise TooFewHostsError(
            f"drafter_checkpoint: train.nnodes is {nnodes} but gpu_host.hosts lists {num_hosts} host"
            f"{'s' * (num_hosts != 1)}; torchrun runs one node per host: list at least {nnodes} hosts under "
            f"gpu_host.hosts or lower train.nnodes"
        )


def rendezvous_host(host: GpuHost) -> str:
    """The name the other nodes reach `host` by: its ssh target's host part, 127.0.0.1 for a local host."""
    if host.spec.transport == "local":
        return "127.0.0.1"
    return str(host.spec.ssh_target).rsplit("@", 1)[-1]


def free_port(host: GpuHost) -> int:
    """A TCP port free on every address of `host` now, below its ephemeral range (`eagle3_dagster.ports`), found
    by its own interpreter."""
    return int(host.run(program_argv(host.spec.python, ports, ""), timeout=120).stdout.split()[-1])


def node_commands(
    job_path: Path | str, train: TrainConfig, hosts: Sequence[GpuHost], *, module: str, port: int | None = None
) -> list[HostCommand]:
    """The torchrun command of each of the first `train.nnodes` hosts (the leased ones, in lease order).

    `port`: the rendezvous port when train.rdzv_endpoint is unset (default: one the first host finds free)."""
    check_host_count(train.nnodes, len(hosts))
    hosts = list(hosts)[: train.nnodes]
    endpoint, store_on_first = train.rdzv_endpoint, False
    if endpoint is None and train.nnodes > 1:
        endpoint = f"{rendezvous_host(hosts[0])}:{port if port is not None else free_port(hosts[0])}"
        store_on_first = True
    return [
        HostCommand(
            host,
            build_torchrun_command(
                Path(job_path),
                train.nproc_per_node,
                train.nnodes,
                python=host.spec.python,
                module=module,
                rdzv_endpoint=endpoint,
                rdzv_id=train.rdzv_id,
                extra_args=[f"--rdzv-conf=is_host={int(rank == 0)}"] if store_on_first else [],
            ),
        )
        for rank, host in enumerate(hosts)
    ]
