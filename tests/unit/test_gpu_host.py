"""The GPU-host runner: local and real-SSH transports, preflight, and Pipes launches through the resource.

The SSH tests start a real OpenSSH server (Debian `openssh-server`) on loopback
with throwaway host and user keys (the `sshd` fixture, tests/conftest.py). The SGLang
server's lifecycle on a host is tested in tests/unit/test_sglang_server.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from eagle3_dagster.gpu_host import GpuHost, PreflightError
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.sglang import patch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import sglang_wheels
from sshd_server import local_and_ssh_hosts
from resources.gpu_host import GpuHostResource, HostEntry

pytestmark = pytest.mark.slow  # a real sshd and process groups


@pytest.mark.parametrize("transport", ["local", "ssh"])
def test_command_runs_with_explicit_interpreter_env_and_exit_code(tmp_path, sshd, transport):
    host = local_and_ssh_hosts(tmp_path, sshd)[transport]
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
    host = local_and_ssh_hosts(tmp_path, sshd)[transport]
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


PIPES_CHILD = r"""
import os, sys
from dagster_pipes import open_dagster_pipes
with open_dagster_pipes() as pipes:
    pipes.log.info(f"hello from {pipes.asset_key}")
    print("plain stdout line", flush=True)
    pipes.report_asset_materialization(metadata={"tokens": 42, "x": os.environ["EAGLE3_X"], "cwd": os.getcwd()})
    sys.exit(int(os.environ.get("EXIT", "0")))
"""


@pytest.mark.parametrize("transport", ["local", "ssh"])
def test_pipes_launch_carries_context_on_command_line_and_reads_messages_from_stderr(tmp_path, sshd, transport):
    target, options = sshd
    resource = GpuHostResource(hosts=[HostEntry(**local_and_ssh_hosts(tmp_path, sshd)[transport].spec.model_dump())])
    script = tmp_path / "child.py"
    script.write_text(PIPES_CHILD)

    def make_asset(exit_code: str):
        @dg.asset(name="remote_thing")
        def remote_thing(context, gpu_host: GpuHostResource):
            return gpu_host.run_pipes(
                context=context,
                command=[sys.executable, str(script)],
                env={"EAGLE3_X": "y z", "EXIT": exit_code},
                cwd=str(tmp_path / "cwd"),
            ).get_materialize_result()

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
    host = GpuHost(
        HostConfig(
            transport="ssh",
            workdir=str(tmp_path / "w"),
            ssh_target=f"-oProxyCommand=touch {marker}",
            ssh_options=["-o", "ConnectTimeout=2"],
        )
    )
    argv = host.command(["true"])
    assert argv[argv.index("--") + 1] == f"-oProxyCommand=touch {marker}"
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and not marker.exists()


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
    from eagle3_dagster.stages.hidden import ExtractSettings

    profile = load_profile(
        "micro",
        overrides={
            "run_root": str(tmp_path / "run"),
            "hidden": {"backend": "sglang"},
            "gpu_host": {"sglang_version": "0.5.12"},
        },
    )
    host = GpuHost(HostConfig(python=str(_site_with_version(tmp_path, "0.5.13")), workdir=str(tmp_path / "work")))
    settings = ExtractSettings.from_profile(profile)
    with pytest.raises(PreflightError, match=r"SGLang 0\.5\.13 installed.*0\.5\.12"):
        hidden_stage.extraction_preflight(settings, host, tmp_path)
    plan = type("Plan", (), {"staging_dir": tmp_path, "version_dir": tmp_path / "v", "version": "v"})()
    with pytest.raises(PreflightError, match=r"SGLang 0\.5\.13 installed.*0\.5\.12"):
        hidden_stage._extract_sglang(
            settings, tmp_path / "v" / "plan.json", plan, [], host, {"sglang_version": "0.5.13"}, lambda _m: None
        )


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
