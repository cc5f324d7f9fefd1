"""Leases on GPU hosts: one run per host at a time, released by the kernel when the holder dies.

Owns: the lease files (one per host, `<lease_dir>/<host>.lease`), taking a free
host for the length of a `with` block (or several at once, all or none: a
training on several nodes), skipping hosts that fail their preflight
(logged with the host and the reason, never retried by the same run), and the
one-slot-per-host size of the Dagster pool `gpu_host` (`pool_limits`).

A lease is an exclusive, non-blocking `fcntl.flock` on the host's file, held by
the process that runs the step. The kernel drops the lock when that process
exits, kill -9 included, so a dead worker never keeps a host. The file also
holds the holder's run id, pid and shards as JSON (written after the lock is
taken), for the UI, the logs and `who_holds`; `<lease_dir>/history.jsonl` gets a
line when a lease is taken and one just before it is given back (none when the
holder is killed), so which host ran what, when, can be read afterwards. The lock needs one file system
seen by every run worker that can lease these hosts: local disk when runs are
processes on one machine (Dagster's default run launcher), otherwise a shared
file system with working flock (NFSv4, CephFS, Lustre with `flock`).

The pool keeps more runs than hosts from starting; the lease decides which host
a started run gets. Both are needed: the pool alone cannot say which host is
free, the lease alone would start runs that only wait.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from eagle3_dagster.io import iter_jsonl

GPU_POOL = "gpu_host"  # the Dagster pool of every asset that runs on a GPU host
HISTORY = "history.jsonl"

H = TypeVar("H")


class NoHostError(RuntimeError):
    """No host could be leased: every one failed its preflight, or the usable ones stayed leased."""


class LeaseFileError(NoHostError):
    """The lease directory cannot be used (a symbolic link where a lease file goes, a full or read-only disk)."""


def _open_no_follow(path: Path, flags: int) -> int:
    """Open a file of the lease directory, never through a symbolic link: truncating the holder record
    through one would truncate whatever file it points at."""
    try:
        return os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)  # CLOEXEC: children never hold the lease
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LeaseFileError(
                f"{path} is a symbolic link (to {os.readlink(path)!r}); a lease file must be a "
                f"plain file: remove the link"
            ) from None
        raise LeaseFileError(f"{path}: cannot open the lease file: {e.strerror} (errno {e.errno})") from None


@dataclass(frozen=True)
class Lease(Generic[H]):
    name: str
    host: H
    path: Path
    holder: dict
    skipped: dict[str, str]  # hosts this run passed over, with the reason


def pool_limits(num_hosts: int) -> dict[str, int]:
    """The Dagster pool limits a profile implies: one gpu_host slot per host."""
    return {GPU_POOL: num_hosts}


def lease_path(lease_dir: Path | str, name: str) -> Path:
    # A host name is usually user@host; keep the file name readable and safe.
    return Path(lease_dir) / (re.sub(r"[^A-Za-z0-9_.@-]", "_", name) + ".lease")


def try_lock(path: Path) -> int | None:
    """An fd holding the exclusive lock on `path`, or None when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _open_no_follow(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def who_holds(lease_dir: Path | str, name: str) -> dict | None:
    """The holder recorded in the host's lease file if the lease is held now, else None."""
    path = lease_path(lease_dir, name)
    if not path.exists():
        return None
    fd = try_lock(path)
    if fd is not None:  # free: whatever the file says is a past holder
        os.close(fd)
        return None
    try:
        return json.loads(path.read_text() or "{}")
    except ValueError:  # the holder is between taking the lock and writing its record
        return {}


# The leases this process holds now: host name -> (lease folder, holder record). A launch on a host records which
# lease it runs under from here (`sglang.claim`).
_HELD: dict[str, tuple[Path, dict]] = {}


def held_here(name: str) -> tuple[Path, dict] | None:
    """The lease folder and holder record of host `name` while this process holds its lease, else None."""
    return _HELD.get(name)


def history(lease_dir: Path | str) -> list[dict]:
    """Every `leased` / `released` record written under `lease_dir`, oldest first."""
    path = Path(lease_dir) / HISTORY
    return list(iter_jsonl(path)) if path.exists() else []


def _append_history(lease_dir: Path | str, record: Mapping) -> None:
    # One short write with O_APPEND: lines from concurrent holders do not interleave.
    fd = _open_no_follow(Path(lease_dir) / HISTORY, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


def _write_holder(fd: int, holder: Mapping) -> None:
    data = json.dumps(holder, sort_keys=True).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


@contextlib.contextmanager
def lease_host(
    hosts: Sequence[tuple[str, H]],
    lease_dir: Path | str,
    *,
    holder: Mapping,
    preflight: Callable[[str, H], object] | None = None,
    log: Callable[[str], None] = print,
    wait_s: float = 600.0,
    poll_s: float = 2.0,
) -> Iterator[Lease[H]]:
    """Hold one free host that passes `preflight` for the `with` block.

    Hosts are tried in order. One whose preflight raises is skipped for the rest of this call (logged
    with the reason). When every host that is left is leased by someone else, wait up to `wait_s` for
    one; when none is left, raise NoHostError naming every host and why.
    """
    with lease_hosts(
        hosts, 1, lease_dir, holder=holder, preflight=preflight, log=log, wait_s=wait_s, poll_s=poll_s
    ) as leases:
        yield leases[0]


@contextlib.contextmanager
def lease_hosts(
    hosts: Sequence[tuple[str, H]],
    count: int,
    lease_dir: Path | str,
    *,
    holder: Mapping,
    preflight: Callable[[str, H], object] | None = None,
    log: Callable[[str], None] = print,
    wait_s: float = 600.0,
    poll_s: float = 2.0,
) -> Iterator[list[Lease[H]]]:
    """Hold `count` free hosts that pass `preflight` for the `with` block (a training on several nodes), the
    first ones in order, as `lease_host` holds one.

    All or none: when fewer than `count` are free, the ones locked in this pass are let go before waiting,
    so two runs that each want two hosts never hold one each and wait for the other's. Fewer than `count`
    usable hosts (the others failed their preflight) is a NoHostError at once, naming each reason.
    """
    skipped: dict[str, str] = {}
    deadline = time.monotonic() + wait_s
    said_waiting = False
    while True:
        busy: dict[str, dict | None] = {}
        taken: list[tuple[str, H, Path, int]] = []
        try:
            for name, host in hosts:
                if len(taken) == count:
                    break
                if name in skipped:
                    continue
                path = lease_path(lease_dir, name)
                fd = try_lock(path)
                if fd is None:
                    busy[name] = who_holds(lease_dir, name)
                    continue
                if preflight is not None:
                    try:
                        preflight(name, host)
                    except Exception as e:  # the host, not this run, is at fault: say why and try the next
                        os.close(fd)
                        skipped[name] = str(e) or type(e).__name__
                        log(f"gpu host {name} skipped: {skipped[name]}")
                        continue
                taken.append((name, host, path, fd))
            if len(taken) == count:
                with contextlib.ExitStack() as stack:
                    yield [
                        stack.enter_context(_recorded(lease_dir, name, host, path, fd, holder, skipped, log))
                        for name, host, path, fd in taken
                    ]
                return
        finally:
            for *_, fd in taken:
                os.close(fd)  # releases the lock (also on kill -9: the kernel closes it)
        usable = len(hosts) - len(skipped)
        if usable < count:
            reasons = "; ".join(f"{n}: {r}" for n, r in skipped.items())
            if count == 1:
                raise NoHostError(f"no usable GPU host among {len(hosts)}: {reasons}")
            raise NoHostError(
                f"{usable} usable GPU host{'s' * (usable != 1)} among {len(hosts)}, {count} needed"
                + (f": {reasons}" if reasons else "")
            )
        holders = ", ".join(
            f"{n} (run {(h or {}).get('run_id', '?')}, pid {(h or {}).get('pid', '?')})" for n, h in busy.items()
        )
        if time.monotonic() >= deadline:
            raise NoHostError(
                f"every usable GPU host stayed leased for {wait_s:.0f} s: {holders}"
                + (f"; skipped: {'; '.join(f'{n}: {r}' for n, r in skipped.items())}" if skipped else "")
                + f". Is the {GPU_POOL} pool limit larger than the number of hosts?"
            )
        if not said_waiting:
            log(f"waiting for {'a GPU host' if count == 1 else f'{count} GPU hosts'}: leased {holders}")
            said_waiting = True
        time.sleep(poll_s)


@contextlib.contextmanager
def _recorded(
    lease_dir: Path | str,
    name: str,
    host: H,
    path: Path,
    fd: int,
    holder: Mapping,
    skipped: Mapping[str, str],
    log: Callable[[str], None],
) -> Iterator[Lease[H]]:
    """The holder record and history lines of a lock taken: `leased` before the block, `released` after it."""
    record = {**holder, "host": name, "pid": os.getpid(), "since": time.time()}
    try:
        _write_holder(fd, record)
        _append_history(lease_dir, {**record, "event": "leased", "time": record["since"]})
    except (OSError, LeaseFileError) as e:  # before the step runs: nothing of it is lost
        raise LeaseFileError(
            f"{lease_dir}: cannot record the lease of host {name}: {e}; free space there or set gpu_host.lease_dir"
        ) from None
    log(f"gpu host {name} leased ({path})")
    _HELD[name] = (Path(lease_dir), record)
    try:
        yield Lease(name=name, host=host, path=path, holder=record, skipped=dict(skipped))
    finally:  # recorded while the lock is still held: the next holder's `leased` comes after it
        _HELD.pop(name, None)
        try:
            _append_history(lease_dir, {**record, "event": "released", "time": time.time()})
        except (OSError, LeaseFileError) as e:  # never in place of the step's own outcome
            log(
                f"gpu host {name}: its release could not be recorded in {Path(lease_dir) / HISTORY} "
                f"({e}); the lease is given back all the same"
            )
