"""The GPU pool and crash safety, through a real webserver + daemon and the queued run coordinator.

The code location is tests/e2e/fixture_defs.py: two assets in pool `gpu_host`
whose bodies launch a sleeping child through the GPU-host Pipes launch. The
instance is the project's dagster.yaml (pool limit 1, run monitoring freeing
slots of dead runs) with shorter intervals.
"""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import wait_for_file

pytestmark = pytest.mark.e2e

DEAD_WITHIN_S = 15
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def sleep_config(asset: str, seconds: float, record: Path) -> dict:
    return {"ops": {asset: {"config": {"seconds": seconds, "record": str(record)}}}}


def process_state(pid: int) -> str | None:
    """The /proc state letter, or None once the pid is gone. A zombie (Z) has already died."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


def pool_block(dep, run_id: str, timeout_s: float = 60) -> dict | None:
    """What the queued-run daemon logged when it held `run_id` back for a full pool, per pool; None if it never did.

    Dagster 1.13's QueuedRunCoordinatorDaemon logs, once per blocked run, "Run <id> is blocked by
    global concurrency limits: <json>" with each pool's slot_count, launched_count (this tick) and
    in_progress_count. A run still QUEUED without that line may only not have been looked at yet.
    """
    line = re.compile(rf"Run {re.escape(run_id)} is blocked by global concurrency limits: (\{{.*\}})$", re.M)
    deadline = time.monotonic() + timeout_s
    while True:
        found = line.search(ANSI.sub("", dep.log_path.read_text(errors="replace")))
        if found:
            return json.loads(found.group(1))
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def test_two_gpu_runs_submitted_together_run_one_at_a_time(fixture_deployment, tmp_path):
    dep = fixture_deployment
    run_a = dep.submit("gpu_a_job", run_config=sleep_config("gpu_a", 3, tmp_path / "a.json"))
    run_b = dep.submit("gpu_b_job", run_config=sleep_config("gpu_b", 3, tmp_path / "b.json"))
    a = dep.wait_for_run(run_a, timeout_s=180)
    b = dep.wait_for_run(run_b, timeout_s=180)
    assert a["status"] == "SUCCESS", dep.run_log(run_a)
    assert b["status"] == "SUCCESS", dep.run_log(run_b)
    first, second = sorted([a, b], key=lambda r: r["startTime"])
    assert first["endTime"] <= second["startTime"], f"pool gpu_host let two runs overlap: {first} {second}"
    # The children themselves never overlapped either.
    child_a, child_b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    starts = sorted([child_a["started"], child_b["started"]])
    assert starts[1] - starts[0] >= 3


@pytest.fixture(scope="module")
def killed_run(fixture_deployment, tmp_path_factory) -> dict:
    """A GPU run whose Dagster processes are SIGKILLed mid-step, and what became of it and of the queue."""
    dep, scratch = fixture_deployment, tmp_path_factory.mktemp("killed_run")
    # No run retry: a retry's launch would stop the stale child and hide whether the death of the worker did.
    victim = dep.submit(
        "gpu_a_job", run_config=sleep_config("gpu_a", 600, scratch / "victim.json"), tags={"dagster/max_retries": "0"}
    )
    child = wait_for_file(scratch / "victim.json", 120, "the GPU child of the victim run")
    worker = wait_for_file(scratch / "victim.worker", 5, "the step worker of the victim run")
    assert alive(child["pid"])
    child_pgid = os.getpgid(child["pid"])
    own_group = child_pgid != os.getpgid(dep.proc.pid)
    # Queued behind the victim in pool gpu_host: it can only start once the dead run's slot is freed.
    waiting = dep.submit("gpu_b_job", run_config=sleep_config("gpu_b", 1, scratch / "waiting.json"))
    waiting_block = pool_block(dep, waiting)  # None fails the test below, after the victim's child is gone
    waiting_before = dep.run(waiting)["status"]  # after the daemon's tick that held it back

    # The whole Dagster side of the run dies at once, as in an OOM kill: the run worker (`dagster api
    # execute_run`), then the step's process where the executor runs steps in processes of their own.
    for pid in (worker["step_ppid"], worker["step_pid"]):
        if pid == worker["step_pid"] or b"execute_run" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)
    survivors = lambda: group_members(child_pgid) if own_group else [child["pid"]] * alive(child["pid"])  # noqa: E731  (a one-line helper of this test)
    deadline = time.monotonic() + DEAD_WITHIN_S
    while survivors() and time.monotonic() < deadline:
        time.sleep(0.5)
    orphans = survivors()
    for pid in orphans:  # never leave them behind on the test machine
        os.kill(pid, signal.SIGKILL)
    return {
        "own_group": own_group,
        "orphans": orphans,
        "victim": dep.wait_for_run(victim, timeout_s=120),
        "waiting_block": waiting_block,
        "waiting_before": waiting_before,
        "waiting": dep.wait_for_run(waiting, timeout_s=120),
        "waiting_log": lambda: dep.run_log(waiting),
    }


def test_gpu_child_runs_in_its_own_process_group(killed_run):
    assert killed_run["own_group"], "the GPU launch must start the child in a new session/process group"


def test_sigkilled_run_worker_takes_its_gpu_child_with_it(killed_run):
    assert not killed_run["orphans"], (
        f"GPU child outlived its SIGKILLed run worker by {DEAD_WITHIN_S} s: pids {killed_run['orphans']}"
    )


def test_sigkilled_run_is_failed_and_frees_its_pool_slot_for_the_queued_run(killed_run):
    assert killed_run["victim"]["status"] == "FAILURE"
    # Held back because the victim fills gpu_host's one slot, not because the daemon had not ticked yet.
    assert killed_run["waiting_block"] is not None, "the daemon never held the queued run back for the pool"
    assert killed_run["waiting_block"]["gpu_host"]["slot_count"] == 1
    assert killed_run["waiting_block"]["gpu_host"]["in_progress_count"] == 1
    assert killed_run["waiting_before"] == "QUEUED"
    assert killed_run["waiting"]["status"] == "SUCCESS", killed_run["waiting_log"]()
