"""Thread counts from the cores a process really gets: affinity, cgroup v1/v2 quotas, ranks x threads."""

from __future__ import annotations

import os
from pathlib import Path

from eagle3_dagster import threads


def _v2(tmp_path, cpu_max: dict[str, str], proc_path: str = "/a/b"):
    root = tmp_path / "cg"
    for folder, value in cpu_max.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "cpu.max").write_text(value + "\n")
    (root / "cgroup.controllers").write_text("cpu memory\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text(f"0::{proc_path}\n")
    return root, proc


def test_a_cgroup_v2_quota_anywhere_above_the_process_caps_the_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    root, proc = _v2(tmp_path, {"a/b": "max 100000", "a": "250000 100000", ".": "max 100000"})
    assert threads.cgroup_cpu_limit(root, proc) == 2.5
    assert threads.cores_granted(root, proc) == 2  # 2.5 CPUs of time: two threads that never wait for a third


def test_a_cgroup_v1_cfs_quota_caps_the_cores_and_minus_one_means_none(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    root = tmp_path / "cg"
    (root / "cpu" / "docker" / "c1").mkdir(parents=True)
    (root / "cpu" / "docker" / "c1" / "cpu.cfs_quota_us").write_text("300000\n")
    (root / "cpu" / "docker" / "c1" / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text("4:memory:/docker/c1\n1:cpu,cpuacct:/docker/c1\n0::/\n")
    assert threads.cores_granted(root, proc) == 3
    (root / "cpu" / "docker" / "c1" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_cpu_limit(root, proc) is None
    assert threads.cores_granted(root, proc) == 8


def test_the_affinity_mask_caps_the_cores_and_a_quota_under_one_cpu_still_gives_one_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {3, 5})
    root, proc = _v2(tmp_path, {"a/b": "max 100000"})
    assert threads.cores_granted(root, proc) == 2
    root, proc = _v2(tmp_path / "q", {"a/b": "50000 100000"})
    assert threads.cores_granted(root, proc) == 1


def test_ranks_times_threads_fit_the_cores_and_the_users_settings_win(monkeypatch):
    monkeypatch.setattr(threads, "cores_granted", lambda *a, **k: 8)
    assert threads.thread_env(1, environ={}) == {"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"}
    assert threads.thread_env(3, environ={})["OMP_NUM_THREADS"] == "2"
    assert threads.thread_env(16, environ={})["OMP_NUM_THREADS"] == "1"
    assert threads.thread_env(2, environ={"OMP_NUM_THREADS": "3"}) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "4"}


def _task(proc, pid: int, tid: int, state: str, nice: int, comm: str = "python (busy) x"):
    # stat(5): pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    # cutime cstime priority nice ...; comm may hold spaces and parentheses
    fields = [
        state,
        "1",
        "1",
        "1",
        "0",
        "-1",
        "0",
        "0",
        "0",
        "0",
        "0",
        "0",
        "0",
        "0",
        "0",
        str(20 + nice),
        str(nice),
        "1",
        "0",
        "100",
    ]
    folder = proc / str(pid) / "task" / str(tid)
    folder.mkdir(parents=True)
    (folder / "stat").write_text(f"{tid} ({comm}) " + " ".join(fields) + "\n")


def test_free_cores_count_runnable_threads_of_other_processes_at_our_priority_or_above(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "cores_granted", lambda *a, **k: 4)
    monkeypatch.setattr(os, "getpriority", lambda *_a: 0)
    proc = tmp_path / "proc"
    _task(proc, 100, 100, "R", 0)
    _task(proc, 100, 101, "R", 0)  # a second runnable thread of the same process counts too
    _task(proc, 200, 200, "R", -5)  # higher priority
    _task(proc, 300, 300, "R", 19)  # nice 19: a background job takes no share worth counting
    _task(proc, 400, 400, "S", 0)  # sleeping
    _task(proc, os.getpid(), os.getpid(), "R", 0)  # this process's own threads are not competitors
    assert threads.cores_free(samples=1, proc=proc) == 1
    _task(proc, 500, 500, "R", 0)
    _task(proc, 600, 600, "R", 0)
    assert threads.cores_free(samples=1, proc=proc) == 1  # never below one thread


def test_the_free_cores_of_this_machine_drop_beside_busy_processes():
    """Real /proc: two busy loops at our priority take two of the granted cores (or all but one)."""
    import subprocess
    import sys
    import time

    granted = threads.cores_granted()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        deadline = time.monotonic() + 30
        # the loops count once the kernel reports them runnable (past interpreter start-up, in `while`)
        while not all(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "R" for p in busy):
            assert time.monotonic() < deadline, "the busy loops never ran"
        loaded = threads.cores_free()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert loaded <= max(1, granted - 2)  # other work at our priority may take more


def test_stage_threads_sizes_torch_from_the_granted_cores(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cores_granted", lambda *a, **k: 1)
    try:
        assert threads.stage_threads() == 1 == threads.stage_threads(load_aware=True)
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert threads.stage_threads() == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
