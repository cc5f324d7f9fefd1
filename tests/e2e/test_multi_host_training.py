"""drafter_checkpoint on two hosts (two real sshd on this machine), one killed mid-run, then resumed.

Through Dagster on a real instance (tests/two_host_training.py): train.nnodes 2, one gloo rank per host,
torchrun started on each host by the asset. First an uninterrupted run, whose run folder is set aside as the
reference. Then host A's interpreter runs torchrun's worker under a hook that, once the first checkpoint is
written, tells the test (a loopback socket) and waits; the test kills host A's torchrun with SIGKILL. That run
must fail naming host A, leave nothing running on either host, and the next materialization must resume from
the checkpoint and export a drafter equal, byte for byte, to the reference's.

Slow for its processes, not its compute: 3 trainings x 2 hosts of torchrun agents and workers (each imports
torch), plus the micro corpus and shards materialized once (~1 min of CPU in all on a 2-core machine).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path

import pytest

from tests.two_host_training import REPO, two_host_training

pytestmark = pytest.mark.e2e

# Host A's python: torchrun's worker (`-m resources.pipes_child`) becomes PAUSING_WORKER; anything else is plain.
WRAPPER = """#!{python}
import os, sys
args = sys.argv[1:]
if args[:2] == ["-m", "torch.distributed.run"] and "resources.pipes_child" in args:
    at = args.index("resources.pipes_child")
    args[at - 1:at + 1] = [{worker!r}]
    print("host A's torchrun: its worker pauses at a checkpoint while the test says so", file=sys.stderr, flush=True)
os.execv({python!r}, [{python!r}, *args])
"""

# While `armed` exists: after its first checkpoint this worker says so on the test's socket and waits there,
# its peer waiting in the next collective, until the test kills its torchrun.
PAUSING_WORKER = """
import json, os, runpy, socket, sys, threading
sys.path.insert(0, {repo!r})
from eagle3_dagster.train.checkpoint import Checkpointer
original = Checkpointer.save
def save(self, step, **parts):
    path = original(self, step, **parts)
    if os.path.exists({armed!r}):
        with socket.create_connection(("127.0.0.1", {port})) as s:
            s.sendall(json.dumps({{"step": step, "pid": os.getpid(), "torchrun": os.getppid(),
                                   "checkpoint": str(path)}}).encode())
        threading.Event().wait()
    return path
Checkpointer.save = save
runpy.run_module("resources.pipes_child", run_name="__main__", alter_sys=True)
"""


def export_sha256(run_dir: Path) -> str:
    return hashlib.sha256((run_dir / "export" / "model.safetensors").read_bytes()).hexdigest()


def trainers_running(job: Path) -> list[str]:
    """Live processes (torchrun agents and their workers, on either host) whose command line names the job."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if str(job) in cmdline and state not in ("Z", "X"):
            found.append(f"{entry.name}: {cmdline}")
    return found


def kill_on_pause(server: socket.socket, record: dict) -> None:
    """Wait for the paused worker's message; kill its torchrun with SIGKILL (the trainer of host A dies)."""
    try:
        conn, _ = server.accept()
        with conn:
            record.update(json.loads(conn.makefile().read()))
        os.kill(record["torchrun"], signal.SIGKILL)
    except OSError as e:  # the timeout: the run ended without pausing; the test says so
        record["error"] = repr(e)


def failure_text(result) -> str:
    return "\n".join(e.step_failure_data.error.to_string() for e in result.all_events if e.is_step_failure)


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, micro_target) -> dict:
    root = tmp_path_factory.mktemp("two_host_training")
    state = root / "state"
    state.mkdir()
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(600)
    worker = root / "pausing_worker.py"
    worker.write_text(PAUSING_WORKER.format(repo=str(REPO), armed=str(state / "armed"), port=server.getsockname()[1]))
    python_a = root / "python_a"
    python_a.write_text(WRAPPER.format(python=sys.executable, worker=str(worker)))
    python_a.chmod(0o755)
    with server, two_host_training(root, micro_target, python={"host-a": str(python_a)}) as hosts:
        reference = hosts.materialize()
        assert reference.success, failure_text(reference)
        (run_dir,) = hosts.run_dirs()
        shutil.move(run_dir, root / "reference")  # the same job trains again in a fresh run folder

        (state / "armed").touch()
        paused: dict = {}
        killer = threading.Thread(target=kill_on_pause, args=(server, paused))
        killer.start()
        killed = hosts.materialize()
        killer.join()
        (state / "armed").unlink()
        left_running = trainers_running(run_dir / "job.json")
        latest = (run_dir / "ckpt" / "latest").read_text()
        resumed = hosts.materialize()
        logs = {run.run_id: hosts.stderr_of(run.run_id) for run in (killed, resumed)}
        with hosts.instance() as instance:
            tags = instance.get_run_by_id(killed.run_id).tags
        return {
            "reference": root / "reference",
            "run_dir": run_dir,
            "paused": paused,
            "killed": killed,
            "left_running": left_running,
            "latest_at_kill": latest,
            "resumed": resumed,
            "logs": logs,
            "tags": tags,
            "pid_files": sorted(p.name for w in hosts.workdirs.values() for p in w.glob("train-*.pid")),
        }


def test_a_host_whose_trainer_is_killed_fails_the_run_naming_it_and_leaves_nothing_running(killed_and_resumed):
    r = killed_and_resumed
    assert "error" not in r["paused"], f"host A never paused at a checkpoint: {r['paused']}"
    assert not r["killed"].success
    failure = failure_text(r["killed"])
    assert "train on host host-a failed with exit code 137 (killed by SIGKILL)" in failure
    assert "__dagster_pipes_version" not in failure  # its last lines are log text, not Pipes messages
    assert r["left_running"] == []
    assert r["pid_files"] == []  # each host's process group stopped and its pid file removed
    assert r["tags"]["eagle3/gpu_host"] == "host-a,host-b"


def test_every_hosts_output_reaches_the_run_log_prefixed_with_its_name(killed_and_resumed):
    log = killed_and_resumed["logs"][killed_and_resumed["killed"].run_id]
    assert "[host-a] host A's torchrun: its worker pauses at a checkpoint" in log  # host A's interpreter said so
    assert "\n[host-b] " in log  # host B's torchrun, stopped or failing without its peer
    assert "EAGLE3_LAUNCH_NONCE=" not in log  # bash's notice of the killed job, the launch's environment in it


def test_the_next_run_resumes_from_the_checkpoint_and_exports_the_uninterrupted_runs_drafter(killed_and_resumed):
    r = killed_and_resumed
    assert r["resumed"].success, failure_text(r["resumed"])
    assert r["latest_at_kill"] == f"step_{r['paused']['step']:07d}"  # resumed from there, not from scratch
    metrics = json.loads((r["run_dir"] / "metrics.json").read_text())
    assert metrics["steps"] == 8
    assert export_sha256(r["run_dir"]) == export_sha256(r["reference"])
