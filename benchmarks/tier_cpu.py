"""The test tier's CPU seconds by module, counted per xdist worker with a cgroup (servers and daemons included).

The tier is CPU-bound on a 2-core machine: its wall time is its CPU seconds over the cores, so what to trim
is whatever takes the most CPU. `time` counts only reaped children (not `dagster dev`'s daemon, PostgreSQL or
sshd while they run), so each worker moves itself into a cgroup of its own (v1 `cpuacct`, or v2), which
every process it starts inherits, and the CPU the cgroup used is logged at every test report. Needs write
access to the cgroup hierarchy (root, or a delegated subtree).

As a pytest plugin (the logs go to TIER_CPU_DIR, default .eagle3/tier_cpu):

    TIER_CPU_DIR=/tmp/tier PYTHONPATH=benchmarks scripts/test.sh -q -p tier_cpu

then the table, modules by CPU seconds (wall seconds, the worker, and CPU/wall beside them):

    .venv/bin/python benchmarks/tier_cpu.py /tmp/tier
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

CGROUP_V1 = Path("/sys/fs/cgroup/cpuacct")
CGROUP_V2 = [Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")]
_state: dict = {}


def _own_cgroup(name: str) -> tuple[Path, str]:
    """A new cgroup holding this process (and what it starts from now on): its folder and its usage file."""
    if (CGROUP_V1 / "cpuacct.usage").exists():
        group, usage = CGROUP_V1 / name, "cpuacct.usage"
    else:
        base = next((p for p in CGROUP_V2 if (p / "cgroup.controllers").exists()), None)
        if base is None:
            raise RuntimeError("tier_cpu: no cgroup v1 cpuacct or v2 hierarchy under /sys/fs/cgroup")
        group, usage = base / name, "cpu.stat"
    group.mkdir(exist_ok=True)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group, usage


def _cpu_seconds(group: Path, usage: str) -> float:
    text = (group / usage).read_text()
    if usage == "cpuacct.usage":
        return int(text) / 1e9
    return int(dict(line.split() for line in text.splitlines())["usage_usec"]) / 1e6


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", default=None):
        return  # the xdist controller: it runs no test, and sees every worker's reports
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    out = Path(os.environ.get("TIER_CPU_DIR", ".eagle3/tier_cpu"))
    out.mkdir(parents=True, exist_ok=True)
    _state["group"], _state["usage"] = _own_cgroup(f"tier-cpu-{os.getpid()}-{worker}")
    _state["log"] = open(out / f"{worker}.jsonl", "w", buffering=1)


def pytest_runtest_logreport(report) -> None:
    if "log" in _state:
        _state["log"].write(
            json.dumps(
                {
                    "t": time.time(),
                    "id": report.nodeid,
                    "when": report.when,
                    "cpu": _cpu_seconds(_state["group"], _state["usage"]),
                }
            )
            + "\n"
        )


def summarize(folder: Path) -> str:
    """Per module: the CPU and wall seconds from the report before its first to its last (fixtures and the
    servers it started included), by worker."""
    modules: dict[str, list] = {}
    total = 0.0
    for log in sorted(folder.glob("*.jsonl")):
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        for before, row in zip(rows, rows[1:]):
            entry = modules.setdefault(row["id"].split("::")[0], [0.0, 0.0, log.stem])
            entry[0] += row["cpu"] - before["cpu"]
            entry[1] += row["t"] - before["t"]
        if rows:
            total += rows[-1]["cpu"] - rows[0]["cpu"]
    lines = [f"{'CPU s':>7} {'wall s':>7} {'CPU/wall':>8}  worker  module"]
    for name, (cpu, wall, worker) in sorted(modules.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{cpu:7.0f} {wall:7.0f} {cpu / max(wall, 1e-9):8.2f}  {worker:6}  {name}")
    lines.append(f"{total:7.0f} CPU s in all, from each worker's first report to its last")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the TIER_CPU_DIR of a tier run")
    print(summarize(parser.parse_args(argv).folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
