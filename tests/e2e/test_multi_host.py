"""Two GPU hosts behind two real sshd on this machine, a real `dagster dev`, the micro profile (hf backend).

The profile lists both hosts under `gpu_host.hosts` (two ports, two workdirs);
the instance's gpu_host pool gets one slot per host from `eagle3 pool-limits`.
The first SHARDS shard runs are submitted at once: each leases a free host, so
both hosts extract and no host runs two shards at a time. Host A's interpreter is a
wrapper that, in the second shard it extracts, says so half-way through and
waits there; the test then kills host A (its sshd and everything under it). That
run fails; the shard's next run skips A (preflight: connection refused, named
in the log) and resumes the shard on B from its manifest. Every shard must equal,
byte for byte, an uninterrupted extraction of the same plan on B.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import REPO, dagster_dev, wait_for_file, write_instance_yaml

sys.path.insert(0, str(REPO / "tests"))
from sshd_server import start_sshd

pytestmark = pytest.mark.e2e

# The shard runs the test submits, so that both hosts get work while one is killed mid-shard. The corpus
# registers more: how many of the micro conversations the pre-trained micro target answers within the length
# limit differs between machines (its floats do): 8 shards on one, 19 on another. Hosts are leased in order
# (A first when both are free) and the first two runs take A and B, so A misses a second shard only if B
# extracts all three others while A extracts its first; both hosts extract at the same speed.
# Every shard run past these would prove nothing more and costs a run process, a preflight and a driver start.
SHARDS = 5
HOST_TAG = "eagle3/gpu_host"

# Host A's interpreter. In the second shard the hf driver extracts on this host, once a sample of it is
# written, it records where it is and waits for the test to kill the host.
PAUSING_DRIVER = r"""
import json, os, runpy, threading
from pathlib import Path
import eagle3_dagster.hidden.extract as extract
state = Path({state!r})
original = extract.extract_shard
def extract_shard(spec, *args, progress=None, **kwargs):
    with open(state / "started", "a") as f:
        f.write(spec.key + "\n")
    nth = len((state / "started").read_text().split())
    def progress_then_pause(done, total):
        if progress is not None:
            progress(done, total)
        if nth == 2 and 0 < done < total:
            (state / "paused.tmp").write_text(json.dumps({{"shard": spec.key, "pid": os.getpid()}}))
            os.replace(state / "paused.tmp", state / "paused.json")
            threading.Event().wait()
    return original(spec, *args, progress=progress_then_pause, **kwargs)
extract.extract_shard = extract_shard
runpy.run_module("eagle3_dagster.hidden.hf_driver", run_name="__main__", alter_sys=True)
"""

WRAPPER = """#!/bin/sh
# Host A's python: the hf driver runs with the pause above; everything else (preflight, probes) is plain.
if [ "$1" = "-m" ] && [ "$2" = "eagle3_dagster.hidden.hf_driver" ]; then
  shift 2
  exec {python} {driver} "$@"
fi
exec {python} "$@"
"""


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_host(sshd_proc: subprocess.Popen) -> None:
    """The host dies: its sshd, every session and every process a session started."""
    victims = [sshd_proc.pid, *descendants(sshd_proc.pid)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sshd_proc.wait(timeout=10)


def sha256s(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.name.startswith("shard-")
    }


@pytest.fixture(scope="module")
def two_host_extraction(tmp_path_factory, micro_target) -> dict:
    import dagster as dg

    from assets.extraction_plan import plan_path_of
    from resources.upstream import latest_materialization
    from eagle3_dagster.gpu_host import GpuHost
    from eagle3_dagster.host_config import HostConfig
    from eagle3_dagster.host_lease import history, who_holds

    root = tmp_path_factory.mktemp("multi_host")
    sshd_a, sshd_b = start_sshd(root / "sshd_a"), start_sshd(root / "sshd_b")
    state = root / "host_a_state"
    state.mkdir()
    driver = root / "pausing_driver.py"
    driver.write_text(PAUSING_DRIVER.format(state=str(state)))
    python_a = root / "python_a"
    python_a.write_text(WRAPPER.format(python=sys.executable, driver=driver))
    python_a.chmod(0o755)
    hosts = [
        {
            "name": "host-a",
            "transport": "ssh",
            "ssh_target": sshd_a.target,
            "ssh_options": list(sshd_a.options),
            "python": str(python_a),
            "workdir": str(root / "work_a"),
        },
        {
            "name": "host-b",
            "transport": "ssh",
            "ssh_target": sshd_b.target,
            "ssh_options": list(sshd_b.options),
            "python": sys.executable,
            "workdir": str(root / "work_b"),
        },
    ]
    raw = yaml.safe_load((REPO / "configs" / "micro.yaml").read_text())
    raw["run_root"] = str(root / "run")
    raw["hidden"]["root"] = str(root / "run" / "hidden_states")  # both "hosts" see it: this machine
    raw["datasets"][0]["max_conversations"] = 100  # 15–37 records kept at micro size, by machine: shards of 2
    raw["hidden"]["samples_per_shard"] = 2
    # The runs are the test's: the automation sensor would also request the killed shard at its next tick
    # (every 10 minutes by default; a slow machine's test spans one), racing the test's own rerun.
    raw["hidden"]["backfill_cron"] = "0 0 1 1 *"
    raw["gpu_host"] = {"hosts": hosts, "lease_dir": str(root / "leases")}
    profile = root / "micro_two_hosts.yaml"
    profile.write_text(yaml.safe_dump(raw, sort_keys=False))
    home = root / "dagster_home"
    write_instance_yaml(home)
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "EAGLE3_PROFILE": str(profile),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    try:
        # Data, corpus and extraction_plan through the instance, shard partitions registered. The target is the
        # session's micro target (tests/conftest.py), what target_job builds for this profile's target settings:
        # the hosts are what this test is about, and a build is ~25 s of CPU.
        shutil.copytree(micro_target, root / "run" / "target")
        built = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "run_pipeline.py"), "--from", "data", "--until", "corpus"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=1500,
        )
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        with dg.DagsterInstance.from_config(str(home)) as instance:
            registered = sorted(instance.get_dynamic_partitions("hidden_state_shards"))
            plan_path = Path(plan_path_of(latest_materialization(instance, dg.AssetKey("extraction_plan"))))
        assert len(registered) >= SHARDS, registered
        keys = registered[:SHARDS]

        # The reference: the same plan extracted without interruption on host B, into another folder.
        plan = json.loads(plan_path.read_text())
        reference = root / "reference"
        plan["version_dir"] = str(reference)
        reference.mkdir()
        (reference / "plan.json").write_text(json.dumps(plan))
        host_b = GpuHost(HostConfig(**hosts[1]))
        host_b.run(
            [
                sys.executable,
                "-m",
                "eagle3_dagster.hidden.hf_driver",
                "--plan",
                str(reference / "plan.json"),
                "--batch-tokens",
                str(raw["hidden"]["batch_tokens"]),
                *(a for k in keys for a in ("--shard", k)),
            ],
            timeout=900,
        )

        with dagster_dev(REPO / "workspace.yaml", home, "eagle3_dagster", env={"EAGLE3_PROFILE": str(profile)}) as dep:
            tags = {"dagster/max_retries": "0"}  # the next run of a failed shard is the test's, not a retry's
            first = {k: dep.submit("extract_job", tags={**tags, "dagster/partition": k}) for k in keys}
            paused = wait_for_file(state / "paused.json", 600, "host A half-way through its second shard")
            kill_host(sshd_a.proc)
            runs = {k: dep.wait_for_run(r, timeout_s=900) for k, r in first.items()}
            failed = [k for k, r in runs.items() if r["status"] != "SUCCESS"]
            logs = {k: dep.run_log(first[k]) for k in failed}
            retried = {k: dep.submit("extract_job", tags={**tags, "dagster/partition": k}) for k in failed}
            reruns = {k: dep.wait_for_run(r, timeout_s=600) for k, r in retried.items()}
            rerun_logs = {k: dep.run_log(retried[k]) for k in retried}
        with dg.DagsterInstance.from_config(str(home)) as instance:
            done = instance.get_materialized_partitions(dg.AssetKey("hidden_states"))
            pool_slots = instance.event_log_storage.get_concurrency_info("gpu_host").slot_count
        return {
            "keys": keys,
            "paused": paused,
            "runs": runs,
            "failed": failed,
            "failed_logs": logs,
            "reruns": reruns,
            "rerun_logs": rerun_logs,
            "done": done,
            "pool_slots": pool_slots,
            "version_dir": plan_path.parent,
            "reference": reference,
            "holders": {h: who_holds(root / "leases", h) for h in ("host-a", "host-b")},
            "history": history(root / "leases"),
        }
    finally:
        for server in (sshd_a, sshd_b):
            if server.proc.poll() is None:
                kill_host(server.proc)


def _tag(run: dict, key: str) -> str | None:
    return {t["key"]: t["value"] for t in run["tags"]}.get(key)


def test_the_pool_has_one_slot_per_host(two_host_extraction):
    assert two_host_extraction["pool_slots"] == 2


def test_every_shard_completes_and_the_killed_one_finished_on_the_other_host(two_host_extraction):
    r = two_host_extraction
    assert r["done"] == set(r["keys"])
    killed = r["paused"]["shard"]
    assert r["failed"] == [killed], {k: r["failed_logs"][k][-3000:] for k in r["failed"]}
    assert _tag(r["runs"][killed], HOST_TAG) == "host-a"
    assert r["reruns"][killed]["status"] == "SUCCESS", r["rerun_logs"][killed][-3000:]
    assert _tag(r["reruns"][killed], HOST_TAG) == "host-b"
    assert "gpu host host-a skipped: " in r["rerun_logs"][killed]  # preflight failed: the host is gone


def test_each_host_ran_shards_and_never_two_at_once(two_host_extraction):
    r = two_host_extraction
    succeeded = [run for run in [*r["runs"].values(), *r["reruns"].values()] if run["status"] == "SUCCESS"]
    assert {_tag(run, HOST_TAG) for run in succeeded} == {"host-a", "host-b"}
    # The leases themselves (run start and end times are not: a queued run starts as the slot of the run
    # before it is freed, a moment before that run is marked finished).
    leases: dict[tuple, dict] = {}
    for e in r["history"]:
        lease = leases.setdefault((e["host"], e["run_id"], e["pid"]), {"start": None, "end": float("inf")})
        lease["start" if e["event"] == "leased" else "end"] = e["time"]
    assert {run_id for _, run_id, _ in leases} == {run["runId"] for run in [*r["runs"].values(), *r["reruns"].values()]}
    for run in [*r["runs"].values(), *r["reruns"].values()]:  # the run's tag names the host it leased
        assert [h for h, run_id, _ in leases if run_id == run["runId"]] == [_tag(run, HOST_TAG)]
    for host in ("host-a", "host-b"):
        spans = sorted((v["start"], v["end"]) for (h, _, _), v in leases.items() if h == host)
        for before, after in zip(spans, spans[1:]):
            assert before[1] <= after[0], f"{host} leased to two runs at once: {before} {after}"
    assert r["holders"] == {"host-a": None, "host-b": None}  # every lease was given back, the killed run's too


def test_shards_are_byte_identical_to_an_uninterrupted_extraction(two_host_extraction):
    r = two_host_extraction
    got, want = sha256s(r["version_dir"]), sha256s(r["reference"])
    assert len(want) == 2 * len(r["keys"])  # a .safetensors and a .manifest.json per shard
    assert got == want
