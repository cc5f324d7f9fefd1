"""The GPU-host runner: local and real-SSH transports, preflight, and the server lifecycle.

The SSH tests start a real OpenSSH server (Debian `openssh-server`) on loopback
with throwaway host and user keys. The server tests use a fake SGLang script
(tiny HTTP server with /health_generate and /generate that also forks a child)
as the launcher, and check that the whole process group is gone afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import httpx
import pytest

from eagle3_dagster.gpu_host import GpuHost, PreflightError
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.sglang import patch
from eagle3_dagster.sglang.server import ServerError, ServerSpec, sglang_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import sglang_wheels  # noqa: E402
from sshd_server import free_port, start_sshd  # noqa: E402
from resources.gpu_host import GpuHostResource, HostEntry  # noqa: E402

pytestmark = pytest.mark.slow  # a real sshd and server processes

FAKE_SERVER = r'''
import json, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
state = os.path.join(os.environ["FAKE_STATE_DIR"], f"pids-{port}.json")
json.dump({"server": os.getpid(), "child": child.pid}, open(state, "w"))
print("fake sglang starting", flush=True)
if os.environ.get("FAKE_CRASH"):
    print("CUDA out of memory (fake)", flush=True)
    sys.exit(7)
ready_at = time.monotonic() + 0.5
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, code, obj):
        b = json.dumps(obj).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def do_GET(self):
        if self.path == "/v1/models":  # how SGLang <= 0.5.17 names the model it serves
            return self._send(200, {"data": [{"id": args[args.index("--served-model-name") + 1]}]})
        self._send(200 if time.monotonic() > ready_at else 503, {})
    def do_POST(self):
        self._send(200, {"meta_info": {}, "argv": args, "dump_dir": os.environ.get("SGLANG_HS_DUMP_DIR"),
                         "layers": os.environ.get("SGLANG_HS_DUMP_LAYERS")})
print("fake sglang ready", flush=True)
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its parent is gone for our purposes
        return f.read().split()[2] != "Z"


def _wait_gone(pids, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A real sshd on a loopback port, accepting a throwaway key for the current user."""
    try:
        server = start_sshd(tmp_path_factory.mktemp("sshd"))
    except (FileNotFoundError, RuntimeError) as e:
        pytest.fail(str(e))
    yield server.target, server.options
    server.stop()


def _hosts(tmp_path, sshd):
    target, options = sshd
    return {
        "local": GpuHost(HostConfig(python=sys.executable, workdir=str(tmp_path / "work"))),
        "ssh": GpuHost(HostConfig(transport="ssh", python=sys.executable, workdir=str(tmp_path / "work"),
                                  ssh_target=target, ssh_options=list(options))),
    }


@pytest.mark.parametrize("transport", ["local", "ssh"])
def test_command_runs_with_explicit_interpreter_env_and_exit_code(tmp_path, sshd, transport):
    host = _hosts(tmp_path, sshd)[transport]
    script = "import os, sys; print(sys.executable); print(os.environ['EAGLE3_X']); print(os.getcwd()); sys.exit(3)"
    proc = host.run([sys.executable, "-c", script], env={"EAGLE3_X": "a b'c"}, check=False)
    assert proc.returncode == 3
    assert proc.stdout.splitlines() == [sys.executable, "a b'c", str(tmp_path / "work")]
    with pytest.raises(RuntimeError, match="exited 3"):
        host.run([sys.executable, "-c", script], env={"EAGLE3_X": "1"})


def test_preflight_fails_fast_on_interpreter_without_sglang(tmp_path):
    host = GpuHost(HostConfig(python=sys.executable, workdir=str(tmp_path / "work")))
    start = time.monotonic()
    with pytest.raises(PreflightError, match=rf"interpreter {sys.executable} has no sglang: ModuleNotFoundError"):
        host.preflight(str(tmp_path / "out"))
    assert time.monotonic() - start < 30
    missing = GpuHost(HostConfig(python="/nonexistent/python", workdir=str(tmp_path / "work")))
    with pytest.raises(PreflightError, match="/nonexistent/python does not run"):
        missing.preflight(str(tmp_path))


@pytest.mark.parametrize("transport", ["local", "ssh"])
def test_preflight_reports_sglang_version_patch_state_gpus_and_disk(tmp_path, sshd, transport):
    python = sglang_wheels.make_site("0.5.14", tmp_path, extra_paths=(Path(__file__).resolve().parents[2],))
    host = _hosts(tmp_path, sshd)[transport]
    host = GpuHost(host.spec.model_copy(update={"python": str(python)}))
    report = host.preflight(str(tmp_path / "not" / "yet"))
    assert report["sglang_version"] == "0.5.14" and report["patch_state"] == "unpatched"
    assert report["free_bytes"] > 0 and report["disk_path"] == str(tmp_path)
    if transport == "ssh":
        return  # the checks below are transport-independent
    with pytest.raises(PreflightError, match="not patched"):
        host.preflight(str(tmp_path), require_patch=True)
    patch.apply(str(python))
    assert host.preflight(str(tmp_path), require_patch=True)["patch_state"] == "patched"
    with pytest.raises(PreflightError, match=r"GPUs visible, 64 needed"):
        host.preflight(str(tmp_path), min_gpus=64)
    with pytest.raises(PreflightError, match="GiB needed"):
        host.preflight(str(tmp_path), min_free_bytes=2**62)


def _fake_spec(tmp_path, port, **kw) -> ServerSpec:
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SERVER)
    return ServerSpec(model_path="/models/tiny", port=port, dump_dir=str(tmp_path / "dumps"), dump_layers=(2, 30, 58),
                      launcher=(sys.executable, str(script)), health_timeout_s=30,
                      env={"FAKE_STATE_DIR": str(tmp_path), **kw})


@pytest.mark.parametrize("transport", ["local", "ssh"])
def test_server_lifecycle_health_wait_log_stream_and_group_killed_on_exception(tmp_path, sshd, transport):
    host = _hosts(tmp_path, sshd)[transport]
    port = free_port()
    logs: list[str] = []
    with pytest.raises(KeyError, match="boom"):
        with sglang_server(host, _fake_spec(tmp_path, port), on_log=logs.append) as server:
            reply = httpx.post(f"{server.base_url}/generate", json={}).json()
            assert reply["dump_dir"] == str(tmp_path / "dumps") and reply["layers"] == "2,30,58"
            for flag in ("--disable-radix-cache", "--disable-cuda-graph", "--skip-server-warmup"):
                assert flag in reply["argv"]
            assert reply["argv"][reply["argv"].index("--chunked-prefill-size") + 1] == "-1"
            raise KeyError("boom")
    pids = json.loads((tmp_path / f"pids-{port}.json").read_text())
    assert _wait_gone([pids["server"], pids["child"]]), "server process group survived"
    assert "fake sglang ready" in logs
    assert not (tmp_path / "work" / f"sglang-{port}.pid").exists()


def test_server_that_dies_during_startup_reports_its_log_tail(tmp_path):
    host = GpuHost(HostConfig(python=sys.executable, workdir=str(tmp_path / "work")))
    port = free_port()
    with pytest.raises(ServerError, match=r"exited with 7(.|\n)*CUDA out of memory"):
        with sglang_server(host, _fake_spec(tmp_path, port, FAKE_CRASH="1"), on_log=lambda line: None):
            pass
    assert _wait_gone([json.loads((tmp_path / f"pids-{port}.json").read_text())["child"]])


def test_stale_server_from_a_dead_worker_is_stopped_before_the_next_start(tmp_path):
    host = GpuHost(HostConfig(python=sys.executable, workdir=str(tmp_path / "work")))
    port = free_port()
    spec = _fake_spec(tmp_path, port)
    orphan = host.spawn(spec.argv(sys.executable), spec.environment(), f"sglang-{port}")
    deadline = time.monotonic() + 10
    while not (tmp_path / f"pids-{port}.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    first = json.loads((tmp_path / f"pids-{port}.json").read_text())
    (tmp_path / f"pids-{port}.json").unlink()
    with sglang_server(host, spec, on_log=lambda line: None):
        assert _wait_gone([first["server"], first["child"]])
    orphan.proc.wait(timeout=10)


PIPES_CHILD = r'''
import os, sys
from dagster_pipes import open_dagster_pipes
with open_dagster_pipes() as pipes:
    pipes.log.info(f"hello from {pipes.asset_key}")
    print("plain stdout line", flush=True)
    pipes.report_asset_materialization(metadata={"tokens": 42, "x": os.environ["EAGLE3_X"], "cwd": os.getcwd()})
    sys.exit(int(os.environ.get("EXIT", "0")))
'''


@pytest.mark.parametrize("transport", ["local", "ssh"])
def test_pipes_launch_carries_context_on_command_line_and_reads_messages_from_stderr(tmp_path, sshd, transport):
    target, options = sshd
    resource = GpuHostResource(hosts=[HostEntry(**_hosts(tmp_path, sshd)[transport].spec.model_dump())])
    script = tmp_path / "child.py"
    script.write_text(PIPES_CHILD)

    def make_asset(exit_code: str):
        @dg.asset(name="remote_thing")
        def remote_thing(context, gpu_host: GpuHostResource):
            return gpu_host.run_pipes(context=context, command=[sys.executable, str(script)],
                                      env={"EAGLE3_X": "y z", "EXIT": exit_code},
                                      cwd=str(tmp_path / "cwd")).get_materialize_result()
        return remote_thing

    result = dg.materialize([make_asset("0")], resources={"gpu_host": resource})
    assert result.success
    mat = result.asset_materializations_for_node("remote_thing")[0]
    assert mat.metadata["tokens"].value == 42 and mat.metadata["x"].value == "y z"
    assert mat.metadata["cwd"].value == str(tmp_path / "cwd")
    failed = dg.materialize([make_asset("5")], resources={"gpu_host": resource}, raise_on_error=False)
    assert not failed.success
    assert not (tmp_path / "work" / "pipes.pid").exists()


def test_ssh_target_that_looks_like_an_option_is_a_host_name_not_a_command(tmp_path):
    """Without `--`, ssh would read `-oProxyCommand=...` as an option and run the command."""
    marker = tmp_path / "proxy-command-ran"
    host = GpuHost(HostConfig(transport="ssh", workdir=str(tmp_path / "w"), ssh_target=f"-oProxyCommand=touch {marker}",
                              ssh_options=["-o", "ConnectTimeout=2"]))
    argv = host.command(["true"])
    assert argv[argv.index("--") + 1] == f"-oProxyCommand=touch {marker}"
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and not marker.exists()


def test_server_runs_code_shipped_with_a_checkpoint_only_when_the_profile_says_so():
    extraction = ServerSpec("/m", dump_dir="/d", dump_layers=(2, 30, 58), sglang_version="0.5.23")
    assert "--trust-remote-code" not in extraction.argv("python")
    assert "--trust-remote-code" in ServerSpec("/m", trust_remote_code=True).argv("python")


def _site_with_version(tmp_path, version: str) -> Path:
    """A host interpreter whose `sglang/__init__.py` sets `__version__` (no dist-info, as a source checkout)."""
    site = tmp_path / "site" / "sglang"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(f'__version__ = "{version}"\n')
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "site"}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python


def test_preflight_refuses_an_installed_sglang_other_than_gpu_host_sglang_version(tmp_path):
    """The export writes aux ids for the profile's release; another installed release may read them one layer off."""
    host = GpuHost(HostConfig(python=str(_site_with_version(tmp_path, "0.5.13")), workdir=str(tmp_path / "work")))
    assert host.preflight(str(tmp_path))["sglang_version"] == "0.5.13"
    assert host.preflight(str(tmp_path), sglang_version="0.5.13")["sglang_version"] == "0.5.13"
    with pytest.raises(PreflightError, match=r"has SGLang 0\.5\.13 installed.*gpu_host\.sglang_version is 0\.5\.12"):
        host.preflight(str(tmp_path), sglang_version="0.5.12")


def test_extraction_refuses_a_host_report_naming_another_sglang_release(tmp_path):
    from eagle3_dagster.config import load_profile
    from eagle3_dagster.stages import hidden as hidden_stage

    profile = load_profile("micro", overrides={"run_root": str(tmp_path / "run"), "hidden": {"backend": "sglang"},
                                               "gpu_host": {"sglang_version": "0.5.12"}})
    host = GpuHost(HostConfig(python=str(_site_with_version(tmp_path, "0.5.13")), workdir=str(tmp_path / "work")))
    with pytest.raises(PreflightError, match=r"SGLang 0\.5\.13 installed.*0\.5\.12"):
        hidden_stage.extraction_preflight(profile, host, tmp_path)
    ctx = type("Ctx", (), {"staging_dir": None, "version_dir": tmp_path / "v", "version": "v"})()
    with pytest.raises(PreflightError, match=r"SGLang 0\.5\.13 installed.*0\.5\.12"):
        hidden_stage._extract_sglang(profile, tmp_path / "v" / "plan.json", ctx, [], host, {"sglang_version": "0.5.13"},
                                     lambda _m: None)


def test_pipes_messages_on_stderr_reach_the_session_and_other_lines_stay_log_text():
    """The child's stderr carries both: a Pipes message (a JSON object with the protocol's version field) goes
    to the session's handler; anything else, JSON or not, stays a log line."""
    from dagster_pipes import PIPES_PROTOCOL_VERSION, PIPES_PROTOCOL_VERSION_FIELD

    from resources.gpu_host import forward_message

    class Handler:
        def __init__(self) -> None:
            self.messages: list[dict] = []

        def handle_message(self, message: dict) -> None:
            self.messages.append(message)

    handler = Handler()
    message = {PIPES_PROTOCOL_VERSION_FIELD: PIPES_PROTOCOL_VERSION, "method": "log", "params": {"message": "hi"}}
    assert forward_message(handler, json.dumps(message)) is True
    for line in ["plain text", '{"loss": 1.5}', "[1, 2]", "{broken", ""]:
        assert forward_message(handler, line) is False
    assert handler.messages == [message]
