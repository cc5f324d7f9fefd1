"""Training on several GPU hosts: each host's torchrun command, the pool-size refusal, and the host group that
runs one command per host (every line named by its host, Pipes messages from any host, the first failure named
and the others stopped). Two hosts through the whole drafter_checkpoint asset, killed and resumed, are
tests/e2e/test_multi_host_training.py."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import dagster as dg
import pytest

from eagle3_dagster.config import TrainConfig, load_profile_file
from eagle3_dagster.gpu_host import GpuHost
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.host_group import HostCommand, HostFailed, run_on_hosts
from eagle3_dagster import ports
from eagle3_dagster.train.nodes import TooFewHostsError, check_host_count, free_port, node_commands
from tests.sshd_server import local_and_ssh_hosts

ROOT = Path(__file__).resolve().parents[2]
JOB = "/shared/run/drafter/run-0123/job.json"
WORKER = "resources.pipes_child"


def alive(pid: int) -> bool:
    """The process exists and has not ended (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def named_hosts(tmp_path: Path, sshd) -> dict[str, GpuHost]:
    """This machine as two hosts named "local" and "ssh" (tests/sshd_server.py), sharing one workdir."""
    return {
        name: GpuHost(host.spec.model_copy(update={"name": name}))
        for name, host in local_and_ssh_hosts(tmp_path, sshd).items()
    }


def _ssh(name: str, target: str, python: str) -> GpuHost:
    return GpuHost(HostConfig(name=name, transport="ssh", ssh_target=target, python=python))


def test_each_host_runs_torchrun_with_its_own_interpreter_and_joins_the_first_hosts_rendezvous():
    hosts = [
        _ssh("gpu-0", "eagle@node0.cluster", "/opt/a/python"),
        _ssh("gpu-1", "node1", "/opt/b/python"),
        _ssh("gpu-2", "node2", "/opt/c/python"),
    ]
    nodes = node_commands(JOB, TrainConfig(nnodes=2, nproc_per_node=8), hosts, module=WORKER, port=29611)
    assert [n.host.name for n in nodes] == ["gpu-0", "gpu-1"]  # the first nnodes of the leased hosts
    assert [n.argv[:3] for n in nodes] == [
        ["/opt/a/python", "-m", "torch.distributed.run"],
        ["/opt/b/python", "-m", "torch.distributed.run"],
    ]
    for node in nodes:
        assert {
            "--nproc-per-node=8",
            "--nnodes=2",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=node0.cluster:29611",
            "--rdzv-id=eagle3-drafter",
        } <= set(node.argv)
        assert "--standalone" not in node.argv
        assert node.argv[-4:] == ["-m", WORKER, "--config", JOB]
    # the first host hosts the rendezvous store; the others join it
    assert "--rdzv-conf=is_host=1" in nodes[0].argv and "--rdzv-conf=is_host=0" in nodes[1].argv

    local = [GpuHost(HostConfig(name=f"l{i}", workdir=f"/w{i}")) for i in range(2)]
    nodes = node_commands(JOB, TrainConfig(nnodes=2), local, module=WORKER, port=29612)
    assert all(n.argv[0] == sys.executable and "--rdzv-endpoint=127.0.0.1:29612" in n.argv for n in nodes)


def test_a_rendezvous_endpoint_in_the_profile_is_every_hosts_and_one_node_is_standalone():
    hosts = [_ssh("gpu-0", "node0", "/opt/a/python"), _ssh("gpu-1", "node1", "/opt/b/python")]
    train = TrainConfig(nnodes=2, rdzv_endpoint="rdzv.cluster:29500", rdzv_id="run-7")
    for node in node_commands(JOB, train, hosts, module=WORKER):
        assert {"--rdzv-endpoint=rdzv.cluster:29500", "--rdzv-id=run-7"} <= set(node.argv)
        assert not any(a.startswith("--rdzv-conf") for a in node.argv)  # torchrun decides who hosts the store
    (single,) = node_commands(JOB, TrainConfig(nproc_per_node=4), hosts, module=WORKER)
    assert single.host.name == "gpu-0" and single.argv[0] == "/opt/a/python"
    assert "--standalone" in single.argv and "--nnodes=1" in single.argv


def test_a_pool_smaller_than_train_nnodes_is_refused_naming_both_settings():
    with pytest.raises(TooFewHostsError, match=r"train.nnodes is 3 but gpu_host.hosts lists 2 hosts"):
        check_host_count(3, 2)
    with pytest.raises(TooFewHostsError, match=r"train.nnodes is 2 but gpu_host.hosts lists 1 host;"):
        node_commands(JOB, TrainConfig(nnodes=2), [_ssh("gpu-0", "node0", "p")], module=WORKER, port=1)
    check_host_count(2, 2)


def test_drafter_checkpoint_refuses_more_nodes_than_hosts_before_it_leases_or_launches(tmp_path):
    import yaml

    from definitions import build_definitions

    raw = yaml.safe_load((ROOT / "configs" / "micro.yaml").read_text())
    raw["run_root"] = str(tmp_path / "run")
    raw["hidden"]["root"] = str(tmp_path / "run" / "hidden_states")
    raw["train"] |= {"nnodes": 2, "nproc_per_node": 1}  # the micro profile lists one host
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    defs = build_definitions(load_profile_file(tmp_path / "p.yaml"))
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            list(defs.assets),
            instance=instance,
            resources=defs.resources,
            selection=["drafter_checkpoint"],
            raise_on_error=False,
        )
    failures = [e for e in result.all_events if e.is_step_failure]
    assert failures and all(
        "train.nnodes is 2 but gpu_host.hosts lists 1 host" in e.step_failure_data.error.to_string() for e in failures
    )
    assert not (tmp_path / "run" / "drafter").exists()  # refused before any job was written


@pytest.mark.slow  # a real sshd
def test_the_rendezvous_port_is_one_the_first_host_finds_free_below_its_ephemeral_range(tmp_path, sshd):
    for host in local_and_ssh_hosts(tmp_path, sshd).values():
        # below it, no other process's bind(0) or connect() is handed the port before torchrun's store binds it
        port = free_port(host)
        assert port in ports.PORTS and port < ports.ephemeral_low(), port


# Pipes child for the second host: the process that opens Pipes may run on any host (torchrun's rank 0).
PIPES_CHILD = r"""
import os
from dagster_pipes import open_dagster_pipes
print("plain line from the pipes host", flush=True)
with open_dagster_pipes() as pipes:
    pipes.report_asset_materialization(metadata={"x": os.environ["EAGLE3_X"], "store": os.environ["EAGLE3_STORAGE"]})
"""


@pytest.mark.slow  # a real sshd and process groups
def test_pipes_messages_from_any_host_reach_the_run_and_other_lines_are_named_by_their_host(tmp_path, sshd, capfd):
    from eagle3_dagster import storage
    from resources.gpu_host import GpuHostResource, HostEntry

    hosts = named_hosts(tmp_path, sshd)
    resource = GpuHostResource(
        hosts=[HostEntry(**hosts[n].spec.model_dump()) for n in ("local", "ssh")], lease_dir=str(tmp_path / "leases")
    )
    (tmp_path / "child.py").write_text(PIPES_CHILD)

    @dg.asset(required_resource_keys={"gpu_host"})
    def on_two_hosts(context):
        gpu_host = context.resources.gpu_host
        with gpu_host.lease_hosts(context, 2) as leased:
            assert [h.name for h in leased] == ["local", "ssh"]
            commands = [
                HostCommand(leased[0], [sys.executable, "-c", "print('plain line from local')"]),
                HostCommand(leased[1], [sys.executable, str(tmp_path / "child.py")]),
            ]
            return gpu_host.run_pipes_on_hosts(
                context=context, commands=commands, env={"EAGLE3_X": "y z", **storage.child_env()}
            ).get_materialize_result()

    with dg.instance_for_test() as instance:
        result = dg.materialize([on_two_hosts], resources={"gpu_host": resource}, instance=instance)
        run = instance.get_run_by_id(result.run_id)
    metadata = result.asset_materializations_for_node("on_two_hosts")[0].metadata
    # the store settings reach an ssh host, which forwards no environment of its own
    assert metadata["x"].value == "y z" and metadata["store"].value == storage.child_env()["EAGLE3_STORAGE"]
    err = capfd.readouterr().err
    assert "[local] plain line from local" in err and "[ssh] plain line from the pipes host" in err
    assert run.tags["eagle3/gpu_host"] == "local,ssh"


# The host that does not fail: says it runs (its pid, through a FIFO the failing one waits on), then waits forever.
BLOCKER = "import os, sys, threading\nopen(sys.argv[1], 'w').write(f'{os.getpid()}\\n')\nthreading.Event().wait()"
# The failing host: once the other runs, names its pid and exits 3.
FAILER = "import sys\nprint('blocker', open(sys.argv[1]).read().strip(), flush=True)\nsys.exit(3)"


@pytest.mark.slow  # a real sshd and process groups
def test_the_first_host_to_fail_is_named_and_every_other_hosts_command_is_stopped(tmp_path, sshd):
    hosts = named_hosts(tmp_path, sshd)
    os.mkfifo(tmp_path / "fifo")
    lines: list[tuple[str, str]] = []
    commands = [
        HostCommand(hosts["local"], [sys.executable, "-c", BLOCKER, str(tmp_path / "fifo")]),
        HostCommand(hosts["ssh"], [sys.executable, "-c", FAILER, str(tmp_path / "fifo")]),
    ]
    with pytest.raises(HostFailed) as failed:
        run_on_hosts(
            commands, {}, name="train", on_line=lambda host, line: lines.append((host, line)), log=lambda _line: None
        )
    assert (failed.value.host, failed.value.returncode) == ("ssh", 3)
    assert str(failed.value).startswith("train on host ssh failed with exit code 3; local was stopped")
    assert "The last lines from ssh:\nblocker " in str(failed.value)
    blocker = int(next(line.split()[1] for host, line in lines if host == "ssh" and line.startswith("blocker")))
    assert not alive(blocker)
    assert not list((tmp_path / "work").glob("*.pid"))  # both pid files removed, no group left to stop


RUNNING = "import os, threading\nprint('running', os.getpid(), flush=True)\nthreading.Event().wait()"


@pytest.mark.slow  # a real sshd and process groups
def test_an_interrupted_job_stops_the_command_on_every_host(tmp_path, sshd):
    hosts = named_hosts(tmp_path, sshd)
    pids: dict[str, int] = {}

    def on_line(host: str, line: str) -> None:
        if line.startswith("running"):
            pids[host] = int(line.split()[1])
            if len(pids) == 2:  # both run: the run is cancelled (Dagster interrupts the step's thread)
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        run_on_hosts(
            [HostCommand(h, [sys.executable, "-c", RUNNING]) for h in hosts.values()],
            {},
            name="train",
            on_line=on_line,
            log=lambda _line: None,
        )
    assert sorted(pids) == ["local", "ssh"] and not any(alive(pid) for pid in pids.values())
    assert not list((tmp_path / "work").glob("*.pid"))


# Two hosts failing one after the other: the first exits 1 at once, the second reports a worker killed by SIGKILL
# (torchrun's failure summary) and exits 1 after it. The signal is the cause; the first was only its peer.
PEER = "import sys\nopen(sys.argv[1], 'w').write('done\\n')\nsys.exit(1)"
KILLED = (
    "import sys\nopen(sys.argv[1]).read()\n"
    "print('  exitcode  : -9 (pid: 4242)', file=sys.stderr, flush=True)\nsys.exit(1)"
)


@pytest.mark.slow  # a real sshd and process groups
def test_a_host_whose_worker_a_signal_killed_is_named_before_a_peer_that_failed_first(tmp_path, sshd):
    hosts = named_hosts(tmp_path, sshd)
    os.mkfifo(tmp_path / "fifo")
    commands = [
        HostCommand(hosts["local"], [sys.executable, "-c", PEER, str(tmp_path / "fifo")]),
        HostCommand(hosts["ssh"], [sys.executable, "-c", KILLED, str(tmp_path / "fifo")]),
    ]
    with pytest.raises(HostFailed) as failed:
        run_on_hosts(commands, {}, name="train", on_line=lambda _host, _line: None, log=lambda _line: None)
    assert failed.value.host == "ssh"
    assert "train on host ssh failed with exit code 1 (a worker there was killed by signal 9)" in str(failed.value)
    assert "local also failed (exit 1)" in str(failed.value)


LAUNCHER = r"""
import subprocess, sys, threading
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, stdout=subprocess.PIPE,
                         text=True)  # as torchrun starts a worker: a session of its own
print(child.pid, child.stdout.readline().strip(), flush=True)
threading.Event().wait()
"""
WORKER_CHILD = (
    "import threading\nfrom eagle3_dagster.train.worker import die_with_launcher\n"
    "print(die_with_launcher(), flush=True)\nthreading.Event().wait()"
)


def test_a_torchrun_worker_dies_with_its_launcher_even_when_the_launcher_is_killed_outright():
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, WORKER_CHILD],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    pid, armed = launcher.stdout.readline().split()
    assert armed == "True"
    worker = os.pidfd_open(int(pid))
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        readable, _, _ = select.select([worker], [], [], 60)  # a pidfd turns readable when its process ends
        assert readable, f"the worker {pid} outlived its launcher"
    finally:
        os.close(worker)
