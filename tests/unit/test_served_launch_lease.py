"""A served SGLang launch never stops another live run's server on the same host and port, and `eagle3 bench`
in served mode holds the host's lease as a run does.

Production extracts and serves on one port (`hidden.sglang_port`). Before, a launch stopped whatever server
group the port's pid file named (`GpuHost.stop_stale`) when this project had started it, also the live
server of an extraction that held the host; and `eagle3 bench` took no lease, so a benchmark during an
extraction killed it. Now the launch records the lease it runs under beside the pid file
(`eagle3_dagster/sglang/claim.py`), and a later launch that finds the recorded group alive and the host
leased by another live process is refused, naming the run; a server whose launcher is gone is still
stopped. Real processes: a run in a child process holds the lease and serves the stand-in
(tests/sglang_standin.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from eagle3_dagster.gpu_host import GpuHost
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.host_lease import lease_host, who_holds
from eagle3_dagster.sglang.server import ServerSpec, sglang_server
from tests.sshd_server import free_port

pytestmark = pytest.mark.slow  # stand-in SGLang server processes on the host

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "tests" / "sglang_standin.py"
RUN = "extraction-run-1"

# The extraction run: it leases the host, serves on the port and waits, as hidden_states does with its server.
EXTRACTION = """
import sys, time
from pathlib import Path
from eagle3_dagster.gpu_host import GpuHost
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.host_lease import lease_host
from eagle3_dagster.sglang.server import ServerSpec, sglang_server
workdir, lease_dir, port, standin, ready, run_id = sys.argv[1:]
host = GpuHost(HostConfig(workdir=workdir))
with lease_host([(host.name, host)], lease_dir, holder={"run_id": run_id}, log=lambda _l: None) as lease:
    spec = ServerSpec(model_path="/models/t", port=int(port), launcher=(sys.executable, standin),
                      health_timeout_s=120)
    with sglang_server(lease.host, spec, on_log=lambda _l: None) as running:
        Path(ready).write_text(running.base_url)
        time.sleep(600)
"""


def _spec(port: int) -> ServerSpec:
    return ServerSpec(model_path="/models/t", port=port, launcher=(sys.executable, str(STANDIN)), health_timeout_s=120)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def extraction(tmp_path, monkeypatch):
    """(host, port, lease folder, base url) of a live extraction run in a child process, stopped afterwards."""
    monkeypatch.setenv("STANDIN_LOAD_S", "0")
    host = GpuHost(HostConfig(workdir=str(tmp_path / "work")))
    port, leases, ready = free_port(), tmp_path / "leases", tmp_path / "ready"
    child = subprocess.Popen(
        [sys.executable, "-c", EXTRACTION, host.spec.workdir, str(leases), str(port), str(STANDIN), str(ready), RUN],
        cwd=ROOT,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline:
        assert child.poll() is None, "the extraction run died before its server was healthy"
        time.sleep(0.1)
    url = ready.read_text()
    assert _healthy(url) and who_holds(leases, host.name)["run_id"] == RUN
    yield host, port, leases, url
    child.send_signal(signal.SIGTERM)  # its server goes with it (the watchdog on the host)
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 30
    while _healthy(url) and time.monotonic() < deadline:
        time.sleep(0.2)


def _launch_again(host: GpuHost, port: int) -> Exception | None:
    try:
        with sglang_server(host, _spec(port), on_log=lambda _l: None):
            return None
    except Exception as e:  # the test names what it expects
        return e


def test_an_unleased_launch_on_a_live_runs_port_is_refused_naming_the_run_and_its_server_lives_on(extraction):
    host, port, _leases, url = extraction
    refused = _launch_again(host, port)  # what `eagle3 bench` did: no lease, the same host and port
    assert _healthy(url), f"the extraction's server was stopped ({refused!r})"
    assert refused is not None and RUN in str(refused) and f"sglang-{port}.pid" in str(refused), refused


def test_a_launch_holding_the_host_in_another_lease_folder_is_refused_as_well(extraction, tmp_path):
    """A CLI whose lease folder is not the runs' (another DAGSTER_HOME) takes its lease there, and still meets
    the run's lease through the record beside the pid file."""
    host, port, _leases, url = extraction
    with lease_host(
        [(host.name, host)], tmp_path / "other-leases", holder={"run_id": "bench"}, log=lambda _l: None
    ) as lease:
        refused = _launch_again(lease.host, port)
    assert _healthy(url), f"the extraction's server was stopped ({refused!r})"
    assert refused is not None and RUN in str(refused), refused


def _stale_group(host: GpuHost, port: int, record: dict | str | None) -> int:
    """A live server group of this project on the port (its pid file written by the launch), whose launcher
    is gone; `record`: what the launch record beside it says."""
    host.spawn(["sleep", "300"], None, f"sglang-{port}")
    pidfile = Path(host.spec.workdir) / f"sglang-{port}.pid"
    deadline = time.monotonic() + 30
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    if record is not None:
        (Path(host.spec.workdir) / f"sglang-{port}.holder").write_text(
            record if isinstance(record, str) else json.dumps(record)
        )
    assert host.group_alive(pidfile.name)
    return int(pidfile.read_text().split()[0])


@pytest.mark.parametrize("record", ["a free lease", "no record", "a forged record", "this process's lease"])
def test_a_server_whose_launcher_is_gone_is_still_stopped_and_the_launch_goes_ahead(tmp_path, monkeypatch, record):
    monkeypatch.setenv("STANDIN_LOAD_S", "0")
    host = GpuHost(HostConfig(workdir=str(tmp_path / "work")))
    port, leases = free_port(), tmp_path / "leases"
    forged = '{"lease_dir": "relative/leases", "lease_name": "local", "run_id": "x"}'
    written = {
        "a free lease": {"lease_dir": str(leases), "lease_name": host.name, "run_id": "gone", "pid": 1},
        "no record": None,
        "a forged record": forged,
        "this process's lease": {"lease_dir": str(leases), "lease_name": host.name, "run_id": "me"},
    }[record]
    leases.mkdir()
    if record == "a free lease":  # the run that launched it held the lease and died
        with lease_host([(host.name, host)], leases, holder={"run_id": "gone"}, log=lambda _l: None):
            pass
    stale = _stale_group(host, port, written)
    if record == "this process's lease":
        with lease_host([(host.name, host)], leases, holder={"run_id": "me"}, log=lambda _l: None) as lease:
            assert _launch_again(lease.host, port) is None
    else:
        assert _launch_again(host, port) is None
    assert not Path(f"/proc/{stale}").exists() or Path(f"/proc/{stale}/stat").read_text().split()[2] == "Z"
    assert not (Path(host.spec.workdir) / f"sglang-{port}.holder").exists()  # forgotten with the new server


def test_a_launch_records_the_lease_it_runs_under_beside_the_pid_file(tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_LOAD_S", "0")
    host = GpuHost(HostConfig(workdir=str(tmp_path / "work")))
    port, leases = free_port(), tmp_path / "leases"
    with lease_host([(host.name, host)], leases, holder={"run_id": "r7"}, log=lambda _l: None) as lease:
        with sglang_server(lease.host, _spec(port), on_log=lambda _l: None):
            record = json.loads((Path(host.spec.workdir) / f"sglang-{port}.holder").read_text())
    assert record["lease_dir"] == str(leases.resolve()) and record["lease_name"] == host.name
    assert record["run_id"] == "r7" and record["pid"] == os.getpid()


def _bench_profile(tmp_path: Path, host: GpuHost, port: int, leases: Path) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "micro.yaml").read_text())
    raw.update(
        run_root=str(tmp_path / "run"),
        gpu_host={
            "hosts": [{"workdir": host.spec.workdir, "sglang_port": port}],
            "lease_dir": str(leases),
            "lease_wait_s": 1,
        },
    )
    raw["bench"] = {**raw.get("bench", {}), "mode": "served"}
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(raw))
    return profile


def _drafter(tmp_path: Path) -> Path:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    return drafter


def test_eagle3_bench_served_holds_the_host_lease_while_it_benchmarks(tmp_path, monkeypatch, capsys):
    from eagle3_dagster import cli
    from eagle3_dagster.stages import bench
    from eagle3_dagster.stages import StageReport

    host = GpuHost(HostConfig(workdir=str(tmp_path / "work")))
    leases = tmp_path / "leases"
    seen = {}

    def benchmark_stage(profile, layout, *, gpu_host, out_dir, **_kw):
        seen["holder"] = who_holds(leases, gpu_host.name)
        (out_dir).mkdir(parents=True, exist_ok=True)
        return StageReport(metadata={})

    monkeypatch.setattr(bench, "benchmark_stage", benchmark_stage)
    profile = _bench_profile(tmp_path, host, free_port(), leases)
    assert cli.main(["--profile", str(profile), "bench", "--drafter", str(_drafter(tmp_path))]) == 0, (
        capsys.readouterr().err
    )
    assert seen["holder"] is not None and seen["holder"]["pid"] == os.getpid()
    assert seen["holder"]["run_id"].startswith("eagle3-bench-")
    assert who_holds(leases, host.name) is None  # given back


def test_eagle3_bench_served_during_an_extraction_waits_then_fails_naming_the_run_and_stops_nothing(
    extraction, tmp_path, monkeypatch, capsys
):
    from eagle3_dagster import cli
    from eagle3_dagster.stages import bench

    host, port, leases, url = extraction
    called = []
    monkeypatch.setattr(
        bench,
        "benchmark_stage",
        lambda *a, **kw: (
            called.append(kw) or (_ for _ in ()).throw(AssertionError("benchmarked on a host another run holds"))
        ),
    )
    profile = _bench_profile(tmp_path, host, port, leases)
    rc = cli.main(["--profile", str(profile), "bench", "--drafter", str(_drafter(tmp_path))])
    err = capsys.readouterr().err
    assert rc == 2 and not called, err
    assert err.startswith("eagle3 bench: ") and RUN in err and "leased" in err, err
    assert _healthy(url)


def test_eagle3_bench_served_leases_where_the_instances_runs_do_or_refuses_when_that_is_unknown(
    tmp_path, monkeypatch, capsys
):
    """No gpu_host.lease_dir: the runs lease under the instance's storage (resources/gpu_host.py), so the CLI
    leases under DAGSTER_HOME's; with neither, a lease taken anywhere would guard nothing, and it is refused."""
    from eagle3_dagster import cli
    from eagle3_dagster.stages import StageReport, bench

    host = GpuHost(HostConfig(workdir=str(tmp_path / "work")))
    profile = _bench_profile(tmp_path, host, free_port(), tmp_path / "unused")
    raw = yaml.safe_load(profile.read_text())
    del raw["gpu_host"]["lease_dir"]
    profile.write_text(yaml.safe_dump(raw))
    seen = []
    monkeypatch.setattr(
        bench,
        "benchmark_stage",
        lambda *a, gpu_host, out_dir, **kw: (
            seen.append(who_holds(tmp_path / "home" / "storage" / "gpu_host_leases", gpu_host.name))
            or StageReport(metadata={})
        ),
    )
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    assert cli.main(["--profile", str(profile), "bench", "--drafter", str(_drafter(tmp_path))]) == 2
    assert "gpu_host.lease_dir" in capsys.readouterr().err and not seen
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    assert cli.main(["--profile", str(profile), "bench", "--drafter", str(tmp_path / "drafter")]) == 0
    assert seen and seen[0]["pid"] == os.getpid()
