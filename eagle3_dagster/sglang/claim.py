"""Whose SGLang server a port's pid file names: a live run's, which a launch leaves alone, or a dead one's.

Owns: the launch record beside a server's pid file on the host (`sglang-<port>.holder`: the lease its
launcher held, as lease folder + host name, with the run id, pid and machine), and the check a launch makes
before it stops a recorded server group that is still alive (`refuse_if_leased_elsewhere`): the host's
lease is looked up in each lease folder known here, the record's and that of the lease this process holds on
the host (`host_lease.held_here`). Held by another live process: the server is that run's (an extraction
and a served benchmark use the same port), and the launch is refused naming the run. Free, or held by this
process: the launcher is gone, and the stale server is stopped as before (`GpuHost.stop_stale`).
The pid file and the process group are `eagle3_dagster.gpu_host`'s; the lease files `host_lease`'s.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from eagle3_dagster.gpu_host import GpuHost
from eagle3_dagster.host_lease import held_here, lease_path, who_holds


class HostInUseError(RuntimeError):
    """The server on the port belongs to a live run that holds the host's lease; it is not stopped."""


def record_name(name: str) -> str:
    return f"{name}.holder"


def launch_record(host: GpuHost) -> dict:
    """What a launch by this process records: the lease it holds on the host (if any), the run, this process."""
    record: dict = {"pid": os.getpid(), "machine": socket.gethostname(), "since": time.time()}
    if (held := held_here(host.name)) is not None:
        lease_dir, holder = held
        record |= {"lease_dir": str(Path(lease_dir).resolve()), "lease_name": host.name, "run_id": holder.get("run_id")}
    return record


def record_launch(host: GpuHost, name: str) -> None:
    """Write this launch's record beside `name`'s pid file on the host (before the server is spawned)."""
    host.write_file(record_name(name), json.dumps(launch_record(host), sort_keys=True).encode())


def forget(host: GpuHost, name: str) -> None:
    """Remove the launch record once this launch's server is stopped."""
    host.run(["rm", "-f", record_name(name)], check=False, timeout=60)


def _recorded(host: GpuHost, name: str) -> dict:
    """The record on the host, read as foreign: anything but a JSON object naming an absolute lease folder
    and a host name gives no lease to look up."""
    proc = host.run(["cat", record_name(name)], check=False, timeout=60)
    try:
        record = json.loads(proc.stdout) if proc.returncode == 0 else {}
    except ValueError:
        return {}
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("lease_dir"), str)
        or not os.path.isabs(record["lease_dir"])
        or not isinstance(record.get("lease_name"), str)
    ):
        return {}
    return record


def refuse_if_leased_elsewhere(host: GpuHost, name: str) -> None:
    """Raise HostInUseError when `name`'s pid file names a live server group of this project and the host is
    leased by another live process (in the record's lease folder or this process's); otherwise return, and
    the caller stops the stale group."""
    if not host.group_alive(f"{name}.pid"):
        return
    record = _recorded(host, name)
    folders = {}
    if record:
        folders[Path(record["lease_dir"])] = record["lease_name"]
    mine = held_here(host.name)
    if mine is not None:
        folders[Path(mine[0])] = host.name
    for lease_dir, lease_name in folders.items():
        if mine is not None and lease_name == host.name and _same_folder(lease_dir, mine[0]):
            continue  # the lease is this process's: no one else's run can be serving there
        holder = who_holds(lease_dir, lease_name)
        if holder is None:
            continue
        launched = (
            f"; the server was launched by run {record.get('run_id')} (pid {record.get('pid')} on "
            f"{record.get('machine')})"
            if record
            else ""
        )
        raise HostInUseError(
            f"{host.where()}: the SGLang server recorded in {host.spec.workdir}/{name}.pid is live and host "
            f"{lease_name} is leased by run {holder.get('run_id', '?')} (pid {holder.get('pid', '?')}, "
            f"{lease_path(lease_dir, lease_name)}){launched}; another run's server is never stopped: wait for "
            f"that run to end, or give this launch another port (gpu_host.hosts[i].sglang_port)"
        )


def _same_folder(a: Path | str, b: Path | str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False
