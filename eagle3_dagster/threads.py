"""CPU threads for torch: as many as the cores this process really gets.

torch sizes its intra-op pool from the CPUs the machine has. A process may get fewer: an affinity mask
(`taskset`, a Kubernetes CPU set), a cgroup CPU quota (`docker --cpus 2` on a 16-core laptop gives 16
threads two cores' worth of time), or other programs that want the same cores. Oversubscribed, every
parallel region of OpenMP ends at a barrier that waits for its slowest thread, and a thread the scheduler
has put aside makes the whole step wait (spinning, by libgomp's default). `benchmarks/threads_under_load.py`
measured the demo target's pre-training step on 2 cores beside 6 busy processes: 2 threads cost 6.1
CPU-seconds and 12.7 s per step (1.4 and 0.8 alone); 1 thread 1.1 and 4.0 (1.0 and 1.0 alone).
Letting waiting threads sleep (`OMP_WAIT_POLICY=PASSIVE`) removed the wasted CPU but made the quiet step
3x slower, so it is not set.

- `cores_granted()`: the affinity mask capped by the cgroup CPU quota (v2 `cpu.max`, v1 `cpu.cfs_*`) of
  this process's cgroup and every cgroup above it; Python 3.11 has neither (`os.process_cpu_count` is
  3.13's and reads the affinity mask only). It depends on the machine, never on its load;
- `cores_free()`: the granted cores less the threads of other processes that are runnable now at this
  process's priority or a higher one (lower-priority work, such as `nice 19` jobs, does not take a
  share worth counting), sampled a few times;
- `thread_env(ranks)`: `OMP_NUM_THREADS`/`MKL_NUM_THREADS` for a child running `ranks` torch processes
  side by side: granted cores // ranks, so ranks x threads <= cores;
- `stage_threads(load_aware)`: sizes this process's torch. The user's `OMP_NUM_THREADS` always wins.

Float reductions round differently when another number of threads splits them. A stage whose bytes
must come out the same when it resumes after a crash (extraction, training) takes the granted cores,
the same on every run on the machine; the target's pre-training and the in-process benchmark, which
run once from the start and record the count they used (`torch_threads`), also take the load into
account.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cores_granted(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """CPUs this process may use at once: its affinity mask, capped by its cgroups' CPU quota."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    return max(1, min(cores, math.floor(quota))) if quota is not None else cores


def cgroup_cpu_limit(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup path, or None where none is set."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one hierarchy, `cpu.max` = "<quota|max> <period>"
            base = cgroup_root / "unified" if (cgroup_root / "unified" / "cgroup.controllers").exists() else cgroup_root
            limits += _walk(base, path, _v2_limit)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's cfs quota and period
            limits += _walk(cgroup_root / "cpu", path, _v1_limit)
    return min(limits) if limits else None


def _walk(base: Path, path: str, read) -> list[float]:
    """A quota may sit on any cgroup from this process's up to the hierarchy's root."""
    parts = [p for p in path.strip("/").split("/") if p]
    found = []
    for depth in range(len(parts), -1, -1):
        limit = read(base.joinpath(*parts[:depth]))
        if limit is not None:
            found.append(limit)
    return found


def _v2_limit(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_limit(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def thread_env(ranks: int = 1, *, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Thread counts for a child running `ranks` torch processes side by side; the user's own win."""
    env = os.environ if environ is None else environ
    per_rank = str(max(1, cores_granted() // max(1, ranks)))
    wanted = {"OMP_NUM_THREADS": per_rank, "MKL_NUM_THREADS": per_rank}
    return {key: env.get(key, value) for key, value in wanted.items()}


def cores_free(samples: int = 5, interval_s: float = 0.05, proc: Path = Path("/proc")) -> int:
    """Granted cores not wanted right now by other runnable threads of equal or higher priority (>= 1)."""
    import statistics
    import time

    mine = os.getpid()
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    counts = []
    for k in range(samples):
        if k:
            time.sleep(interval_s)
        counts.append(_runnable_competitors(proc, mine, nice))
    return max(1, cores_granted() - math.floor(statistics.median(counts)))


def _runnable_competitors(proc: Path, mine: int, nice: int) -> int:
    """Threads of other processes in state R whose nice value is at most ours (`/proc/<pid>/task/<tid>/stat`)."""
    found = 0
    for task_stat in proc.glob("[0-9]*/task/[0-9]*/stat"):
        if task_stat.parts[-4] == str(mine):
            continue
        try:
            fields = task_stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the thread ended while being read
        # after the command name: state is field 3 of stat(5), nice field 19
        if fields[0] == "R" and int(fields[16]) <= nice:
            found += 1
    return found


def stage_threads(load_aware: bool = False) -> int:
    """Size this process's torch pools: the granted cores (or, `load_aware`, the free ones); the user's
    `OMP_NUM_THREADS` wins. Returns the intra-op thread count."""
    import torch

    user = os.environ.get("OMP_NUM_THREADS")
    threads = int(user) if user else (cores_free() if load_aware else cores_granted())
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)  # none of the stages runs inter-op parallel work (torch.jit.fork)
    except RuntimeError:
        pass  # torch refuses once its inter-op pool has started; it then stays at its size, unused
    return threads
