"""Leases on GPU hosts: exclusive, released by the kernel when the holder is killed, preflight failures skipped
once, a clear error when no host is usable; the profile's host list; hours on several hosts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_dagster.config import ProfileError, load_profile, load_profile_file
from eagle3_dagster.gpu_host import GpuHost, PreflightError
from eagle3_dagster.hidden.estimate import hours_on_hosts
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.host_lease import (
    NoHostError,
    history,
    lease_host,
    lease_hosts,
    lease_path,
    pool_limits,
    try_lock,
    who_holds,
)

ROOT = Path(__file__).resolve().parents[2]

# A lease holder in another process: takes host `a`, says so, and holds it until its stdin closes.
HOLDER = """
import sys
from eagle3_dagster.host_lease import lease_host
with lease_host([("a", None)], sys.argv[1], holder={"run_id": "run-in-child"}, log=lambda _l: None):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
    """Start a child holding host `a`'s lease; yields the Popen once the lease is held."""
    procs = []

    def start() -> subprocess.Popen:
        child = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(tmp_path / "leases")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ | {"PYTHONPATH": str(ROOT)},
        )
        procs.append(child)
        assert child.stdout.readline() == "held\n", f"the holder exited {child.wait()} before taking the lease"
        return child

    yield start
    for child in procs:
        child.kill()
        child.wait()


def test_a_held_host_is_not_leased_twice_and_names_its_holder(tmp_path, holder):
    holder()
    assert try_lock(lease_path(tmp_path / "leases", "a")) is None
    assert who_holds(tmp_path / "leases", "a")["run_id"] == "run-in-child"
    with lease_host([("a", "A"), ("b", "B")], tmp_path / "leases", holder={"run_id": "r2"}, log=lambda _l: None) as got:
        assert got.name == "b" and got.host == "B"
        assert json.loads(got.path.read_text())["run_id"] == "r2"


def test_a_lease_is_released_when_its_holder_is_killed(tmp_path, holder):
    child = holder()
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert who_holds(tmp_path / "leases", "a") is None
    with lease_host([("a", "A")], tmp_path / "leases", holder={"run_id": "next"}, wait_s=0) as got:
        assert got.name == "a"


def test_a_lease_is_released_when_its_block_ends_or_raises(tmp_path):
    with pytest.raises(ValueError, match="boom"):
        with lease_host([("a", "A")], tmp_path, holder={}, log=lambda _l: None):
            raise ValueError("boom")
    assert who_holds(tmp_path, "a") is None
    with lease_host([("a", "A")], tmp_path, holder={"run_id": "r2"}, log=lambda _l: None):
        assert who_holds(tmp_path, "a")["run_id"] == "r2"
    assert who_holds(tmp_path, "a") is None
    events = [(e["event"], e["host"], e.get("run_id")) for e in history(tmp_path)]
    assert events == [("leased", "a", None), ("released", "a", None), ("leased", "a", "r2"), ("released", "a", "r2")]
    times = [e["time"] for e in history(tmp_path)]
    assert times == sorted(times)


def test_a_host_failing_preflight_is_skipped_with_its_reason_and_never_retried(tmp_path, holder):
    child = holder()  # `a` is busy; `b` is unreachable: the run must wait for `a` without probing `b` again
    probes, lines = [], []

    def preflight(name, _host):
        probes.append(name)
        if name == "b":
            raise PreflightError("b: ssh: connect to host 127.0.0.1 port 1: Connection refused")

    def log(line):
        lines.append(line)
        if line.startswith("waiting for a GPU host"):
            child.stdin.close()  # the holder ends its run: `a` comes free

    with lease_host(
        [("a", "A"), ("b", "B")], tmp_path / "leases", holder={}, preflight=preflight, log=log, wait_s=60, poll_s=0.05
    ) as got:
        assert got.name == "a" and got.skipped == {"b": "b: ssh: connect to host 127.0.0.1 port 1: Connection refused"}
    assert probes == ["b", "a"]
    assert "gpu host b skipped: b: ssh: connect to host 127.0.0.1 port 1: Connection refused" in lines
    assert any(line.startswith("waiting for a GPU host: leased a (run run-in-child") for line in lines)


def test_no_usable_host_fails_naming_every_host_and_reason(tmp_path):
    def preflight(name, _host):
        raise PreflightError(f"{name}: 0 GPUs visible, 8 needed")

    with pytest.raises(
        NoHostError,
        match=r"no usable GPU host among 2: a: a: 0 GPUs visible, 8 needed; "
        r"b: b: 0 GPUs visible, 8 needed",
    ):
        with lease_host([("a", 1), ("b", 2)], tmp_path, holder={}, preflight=preflight, log=lambda _l: None):
            pass
    assert who_holds(tmp_path, "a") is None and who_holds(tmp_path, "b") is None


def test_a_host_held_past_the_wait_fails_naming_its_holder(tmp_path, holder):
    holder()
    with pytest.raises(NoHostError, match=r"stayed leased for 0 s: a \(run run-in-child"):
        with lease_host([("a", "A")], tmp_path / "leases", holder={}, wait_s=0, log=lambda _l: None):
            pass


def _profile(tmp_path: Path, gpu_host: dict) -> Path:
    import yaml

    raw = yaml.safe_load((ROOT / "configs" / "micro.yaml").read_text())
    raw["gpu_host"] = gpu_host
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_every_checked_in_profile_lists_one_host_and_one_pool_slot():
    for name in ("demo", "micro", "production"):
        g = load_profile(name).gpu_host
        assert len(g.hosts) == 1 and pool_limits(len(g.hosts)) == {"gpu_host": 1}
    prod = load_profile("production").gpu_host.hosts[0]
    assert (prod.label, prod.transport, prod.python, prod.num_gpus) == (
        "eagle@gpu-host-0",
        "ssh",
        "/opt/sglang/.venv/bin/python",
        8,
    )


def test_a_host_given_flat_under_gpu_host_is_refused_with_the_list_to_write_instead(tmp_path):
    path = _profile(tmp_path, {"transport": "ssh", "ssh_target": "eagle@h0", "num_gpus": 8, "lease_wait_s": 60})
    with pytest.raises(ProfileError) as e:
        load_profile_file(path)
    message = str(e.value)
    assert message.startswith(f"{path}: invalid profile")
    assert (
        "gpu_host.num_gpus, gpu_host.ssh_target, gpu_host.transport: a host's fields go in the list "
        "gpu_host.hosts (one element for one host)" in message
    )
    # the block to paste (keys in the file's order, which _profile sorts): the same host as a one-element list,
    # the section's own fields left where they are
    assert (
        "gpu_host:\n  hosts:\n  - num_gpus: 8\n    ssh_target: eagle@h0\n    transport: ssh\n"
        "  lease_wait_s: 60\n" in message
    )


def test_a_host_list_gives_each_host_its_fields_and_the_pool_one_slot_per_host(tmp_path):
    g = load_profile_file(
        _profile(
            tmp_path,
            {
                "hosts": [
                    {"transport": "ssh", "ssh_target": "eagle@h0", "python": "/opt/a/python", "num_gpus": 8},
                    {"name": "h1", "transport": "ssh", "ssh_target": "eagle@h1", "workdir": "/w1", "num_gpus": 4},
                    {"transport": "local"},
                ]
            },
        )
    ).gpu_host
    assert [(h.label, h.python, h.workdir, h.num_gpus) for h in g.hosts] == [
        ("eagle@h0", "/opt/a/python", ".eagle3/gpu_host", 8),
        ("h1", "python", "/w1", 4),
        ("local", "python", ".eagle3/gpu_host", 0),
    ]
    assert pool_limits(len(g.hosts)) == {"gpu_host": 3}


def test_a_local_host_with_the_default_interpreter_runs_the_pipelines_own():
    """`eagle3 preflight` and the Dagster resource alike: not the first `python` on PATH."""
    assert GpuHost(HostConfig()).spec.python == sys.executable
    assert GpuHost(HostConfig(python="/opt/x/python")).spec.python == "/opt/x/python"
    assert GpuHost(HostConfig(transport="ssh", ssh_target="u@h")).spec.python == "python"


def test_the_dagster_resource_holds_the_profiles_hosts_with_their_fields_help_and_checks(tmp_path):
    import dagster as dg

    from resources.gpu_host import GpuHostResource, HostEntry

    g = load_profile_file(
        _profile(
            tmp_path,
            {
                "lease_wait_s": 5,
                "hosts": [
                    {
                        "name": "h0",
                        "transport": "ssh",
                        "ssh_target": "eagle@h0",
                        "ssh_options": ["-p", "2222"],
                        "num_gpus": 8,
                    },
                    {"python": "/opt/a/python", "workdir": "/w1"},
                ],
            },
        )
    ).gpu_host
    resource = GpuHostResource.from_profile(SimpleNamespace(gpu_host=g))
    assert [h.model_dump() for h in resource.hosts] == [h.model_dump() for h in g.hosts]
    assert (resource.lease_dir, resource.lease_wait_s) == (None, 5)
    assert [h.name for h in resource.all_hosts()] == ["h0", "local"]
    # the launchpad's fields for a host are HostConfig's, with its help
    hosts = GpuHostResource.to_config_schema().as_field().config_type.fields["hosts"].config_type  # Noneable(Array)
    fields = hosts.inner_type.inner_type.fields
    assert {k: f.description for k, f in fields.items()} == {
        k: f.description for k, f in HostConfig.model_fields.items()
    }
    with pytest.raises(ValueError, match="ssh_target is required for transport 'ssh'"):
        HostEntry(transport="ssh")
    with pytest.raises(ValueError, match="gpu_host.python: a host's fields go in the list gpu_host.hosts"):
        GpuHostResource(python="/x/python", hosts=[HostEntry()])

    @dg.asset(required_resource_keys={"gpu_host"})
    def uses_a_host(context) -> None:
        assert [h.name for h in context.resources.gpu_host.all_hosts()] == ["g0"]

    def launch(config: dict) -> bool:
        return dg.materialize(
            [uses_a_host],
            resources={"gpu_host": GpuHostResource.configure_at_launch()},
            run_config={"resources": {"gpu_host": {"config": config}}},
        ).success

    assert launch({"hosts": [{"name": "g0", "transport": "local"}]})
    with pytest.raises(dg.DagsterInvalidConfigError, match='Received unexpected config entry "python"'):
        launch({"python": "/x/python"})  # the one-host form of earlier resource configs


@pytest.mark.parametrize(
    "gpu_host, message",
    [
        (
            {
                "hosts": [
                    {"transport": "ssh", "ssh_target": "u@127.0.0.1", "ssh_options": ["-p", "2201"]},
                    {"transport": "ssh", "ssh_target": "u@127.0.0.1", "ssh_options": ["-p", "2202"]},
                ]
            },
            "gpu_host: Value error, gpu_host.hosts: names must be unique, ['u@127.0.0.1'] name several hosts",
        ),
        (
            {"python": "/x/python", "hosts": [{"transport": "local"}]},
            "gpu_host: Value error, gpu_host.python: a host's fields go in the list gpu_host.hosts",
        ),
        (
            {"hosts": [{"transport": "ssh"}]},
            "gpu_host.hosts.0: Value error, ssh_target is required for transport 'ssh'",
        ),
        ({"hosts": []}, "gpu_host.hosts: List should have at least 1 item"),
    ],
)
def test_a_bad_host_list_names_the_field(tmp_path, gpu_host, message):
    with pytest.raises(ProfileError) as e:
        load_profile_file(_profile(tmp_path, gpu_host))
    assert message in str(e.value)


def test_hours_on_hosts_round_up_to_whole_shards():
    # 5 equal shards of one hour each: 2 hosts need 3 hours (not 2.5), 4 hosts 2, more hosts than shards 1
    one_hour = [3600] * 5
    assert [hours_on_hosts(one_hour, 1.0, n) for n in (1, 2, 4, 8)] == [5.0, 3.0, 2.0, 1.0]
    # unequal shards go in key order to the first free host: 2 + 1 on one, 2 on the other
    assert hours_on_hosts([7200, 7200, 3600], 1.0, 2) == 3.0
    assert hours_on_hosts([], 1.0, 4) == 0.0


def test_pool_limits_command_prints_one_gpu_host_slot_per_host(tmp_path):
    two = _profile(tmp_path, {"hosts": [{"name": "h0"}, {"name": "h1"}]})
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    for profile, expected in ((str(two), "gpu_host 2\n"), ("production", "gpu_host 1\n")):
        out = subprocess.run(
            [sys.executable, "-m", "eagle3_dagster.cli", "--profile", profile, "pool-limits"],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=120,
        )
        assert (out.returncode, out.stdout) == (0, expected), out.stderr


def test_the_plan_gives_hours_on_the_profiles_hosts_and_on_1_2_4_in_whole_shards(tmp_path):
    from eagle3_dagster.cli import hours_table
    from eagle3_dagster.hidden.estimate import estimate_extraction
    from eagle3_dagster.hidden.sharding import ShardSpec, shard_key
    from eagle3_dagster.hidden.shards import ShardFormat

    fmt = ShardFormat(hidden_size=8, dtype="bfloat16", aux_layers=(1, 2, 3), target_identity="t", code_version="c")
    specs = [
        ShardSpec(
            key=shard_key(i),
            index=i,
            first_record=i,
            num_records=1,
            num_tokens=3600,
            byte_offset=0,
            sample_ids=(f"d/{i}",),
            lengths=(3600,),
        )
        for i in range(5)
    ]
    estimate = estimate_extraction(
        specs, fmt, tmp_path, "hs-000000000000", throughput_tokens_per_s=1.0, free_bytes=1 << 40, num_hosts=3
    )
    assert estimate.hours_by_hosts == {1: 5.0, 2: 3.0, 3: 2.0, 4: 2.0}
    assert estimate.estimated_hours == 2.0 and estimate.num_hosts == 3
    assert hours_table({str(n): h for n, h in estimate.hours_by_hosts.items()}, 3).splitlines() == [
        "hours   1 host  2 hosts  3 hosts (profile)  4 hosts",
        "         5.0 h    3.0 h              2.0 h    2.0 h",
    ]


def test_a_symbolic_link_where_the_lease_file_goes_is_refused_and_its_target_left_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    leases = tmp_path / "leases"
    leases.mkdir()
    lease_path(leases, "a").symlink_to(victim)
    with pytest.raises(NoHostError, match="is a symbolic link"):
        with lease_host([("a", None)], leases, holder={"run_id": "r"}, log=lambda _l: None, wait_s=0):
            pass
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("step_fails", [True, False])
def test_a_lease_directory_that_cannot_be_written_at_release_never_replaces_the_steps_outcome(tmp_path, step_fails):
    leases = tmp_path / "leases"
    lines: list[str] = []

    def step() -> str:
        (leases / "history.jsonl").unlink()
        (leases / "history.jsonl").mkdir()  # the release record cannot be written any more
        if step_fails:
            raise ValueError("the step's own error")
        return "done"

    if step_fails:
        with pytest.raises(ValueError, match="the step's own error"):
            with lease_host([("a", None)], leases, holder={"run_id": "r"}, log=lines.append):
                step()
    else:
        with lease_host([("a", None)], leases, holder={"run_id": "r"}, log=lines.append):
            assert step() == "done"
    assert any("its release could not be recorded" in line and "history.jsonl" in line for line in lines)
    assert try_lock(lease_path(leases, "a")) is not None  # given back all the same


def test_a_lease_directory_that_cannot_be_written_is_a_no_host_error_naming_it(tmp_path):
    leases = tmp_path / "leases"
    (leases / "history.jsonl").mkdir(parents=True)
    with pytest.raises(NoHostError, match="cannot record the lease of host a"):
        with lease_host([("a", None)], leases, holder={"run_id": "r"}, log=lambda _l: None):
            pass


def test_several_hosts_are_leased_together_and_none_is_held_while_waiting_for_the_rest(tmp_path, holder):
    child = holder()  # `a` is busy: a two-host lease of [a, b] waits holding neither, then takes both
    with lease_hosts(
        [("a", "A"), ("b", "B"), ("c", "C")], 2, tmp_path / "leases", holder={"run_id": "r"}, log=lambda _l: None
    ) as got:
        assert [(g.name, g.host) for g in got] == [("b", "B"), ("c", "C")]
        assert who_holds(tmp_path / "leases", "b")["run_id"] == who_holds(tmp_path / "leases", "c")["run_id"] == "r"
    held_while_waiting = []

    def log(line):
        if line.startswith("waiting for 2 GPU hosts"):
            held_while_waiting.append(who_holds(tmp_path / "leases", "b"))
            child.stdin.close()  # the holder ends its run: `a` comes free

    with lease_hosts(
        [("a", "A"), ("b", "B")], 2, tmp_path / "leases", holder={"run_id": "r2"}, log=log, wait_s=60, poll_s=0.05
    ) as got:
        assert [g.name for g in got] == ["a", "b"]
    assert held_while_waiting == [None]  # another multi-host run could take b meanwhile: no deadlock
    assert who_holds(tmp_path / "leases", "a") is None and who_holds(tmp_path / "leases", "b") is None
    events = [(e["event"], e["host"]) for e in history(tmp_path / "leases") if e.get("run_id") == "r2"]
    assert events == [("leased", "a"), ("leased", "b"), ("released", "b"), ("released", "a")]


def test_too_few_usable_hosts_for_a_multi_host_lease_fails_at_once_naming_each_reason(tmp_path):
    def preflight(name, _host):
        if name == "b":
            raise PreflightError("b: ssh: connect to host 127.0.0.1 port 1: Connection refused")

    with pytest.raises(NoHostError, match=r"1 usable GPU host among 2, 2 needed: b: b: ssh: connect"):
        with lease_hosts(
            [("a", 1), ("b", 2)], 2, tmp_path, holder={}, preflight=preflight, wait_s=600, log=lambda _l: None
        ):
            pass
    assert who_holds(tmp_path, "a") is None and history(tmp_path) == []  # a was never recorded as leased
