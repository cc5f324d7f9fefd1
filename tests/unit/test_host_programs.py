"""The programs another interpreter runs from this package's source: the preflight probe and the SGLang health
checks (on the GPU host), and the SGLang locator (`eagle3 patch --python PATH`).

Each runs here exactly as the host runs it (`gpu_host.program_argv`: `python -c <the file's source> ARGS`),
under `python -S`, with no site-packages: an interpreter that has neither this project nor anything but the
standard library, which is what the probe must survive (it reports whether the project is importable).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eagle3_dagster import host_probe
from eagle3_dagster.gpu_host import program_argv
from eagle3_dagster.sglang import health, location, patch
from tests.sshd_server import free_port


def _run(program, *args, env: dict | None = None, cwd: Path) -> subprocess.CompletedProcess:
    python, *rest = program_argv(sys.executable, program, *args)
    return subprocess.run(
        [python, "-S", *rest],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": "", **(env or {})},
    )


def _probe_on_devices(devices: list[Path], *args, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """The probe as the host runs it, on a host whose GPU device nodes are `devices` (instead of /dev's)."""
    source = Path(host_probe.__file__).read_text()
    pinned = f"GPU_DEVICE_PATHS = {tuple(map(str, devices))!r}"
    assert source.count("GPU_DEVICE_PATHS = (") == 1
    source = re.sub(r"^GPU_DEVICE_PATHS = \(.*\)$", lambda _: pinned, source, count=1, flags=re.M)
    return subprocess.run(
        [sys.executable, "-S", "-c", source, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": "", **env},
    )


def _torch_site(tmp_path: Path, gpus: int) -> tuple[Path, Path]:
    """A site folder whose `torch` sees `gpus` GPUs and records that it was imported (in the returned file)."""
    site, imported = tmp_path / "torch_site", tmp_path / "torch_imported"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(
        f"open({str(imported)!r}, 'w').close()\n"
        f"class cuda:\n    @staticmethod\n    def device_count():\n        return {gpus}\n"
    )
    return site, imported


def test_probe_on_a_bare_interpreter_reports_no_project_no_sglang_and_the_nearest_folders_free_space(tmp_path):
    device = tmp_path / "nvidiactl"
    device.touch()  # a GPU host without nvidia-smi: the probe asks torch, which this interpreter lacks
    proc = _probe_on_devices([device], tmp_path / "not" / "yet", cwd=tmp_path, env={"PATH": str(tmp_path / "empty")})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["python"] == sys.executable and report["eagle3_dagster"] is False
    assert report["sglang_version"] is None and report["sglang_error"].startswith("ModuleNotFoundError")
    assert report["gpu_count"] == 0 and "no nvidia-smi" in report["gpu_error"] and "no torch" in report["gpu_error"]
    assert report["disk_path"] == str(tmp_path) and report["free_bytes"] > 0


def test_probe_without_nvidia_smi_asks_torch_only_where_the_host_has_a_gpu_device(tmp_path):
    site, imported = _torch_site(tmp_path, gpus=3)
    env = {"PATH": str(tmp_path / "empty"), "PYTHONPATH": str(site)}
    proc = _probe_on_devices([tmp_path / "nvidiactl", tmp_path / "kfd"], tmp_path, cwd=tmp_path, env=env)
    report = json.loads(proc.stdout)
    assert report["gpu_count"] == 0 and not imported.exists()  # a CPU host: ~2 s of torch import saved per step
    assert "no nvidia-smi" in report["gpu_error"] and "no GPU device" in report["gpu_error"]
    assert str(tmp_path / "kfd") in report["gpu_error"]

    (tmp_path / "kfd").touch()
    report = json.loads(
        _probe_on_devices([tmp_path / "nvidiactl", tmp_path / "kfd"], tmp_path, cwd=tmp_path, env=env).stdout
    )
    assert report["gpu_count"] == 3 and report["gpu_error"] is None and imported.exists()


def test_probe_reads_sglangs_version_the_sha256_of_its_deepseek_v2_and_the_gpus_nvidia_smi_lists(tmp_path):
    site = tmp_path / "site"
    models = site / "sglang" / "srt" / "models"
    models.mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text('__version__ = "0.5.14"\n')
    (models / "deepseek_v2.py").write_bytes(b"# not the real one\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: a (UUID: GPU-0)'\necho 'GPU 1: b (UUID: GPU-1)'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    proc = _run(host_probe, tmp_path, cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["sglang_version"] == "0.5.14" and report["sglang_error"] is None
    assert report["deepseek_v2_sha256"] == hashlib.sha256(b"# not the real one\n").hexdigest()
    assert report["gpu_count"] == 2 and report["gpu_error"] is None


def _sglang_site(tmp_path: Path, version: str) -> Path:
    """A site folder with an installed SGLang (its dist-info) whose package raises on import."""
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("raise ImportError('sglang was imported')\n")
    (site / f"sglang-{version}.dist-info").mkdir()
    (site / f"sglang-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n"
    )
    return site


def test_locator_on_a_bare_interpreter_prints_sglangs_version_and_folder_without_importing_it(tmp_path):
    site = _sglang_site(tmp_path, "0.5.14")
    proc = _run(location, cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"version": "0.5.14", "root": str(site / "sglang")}


def test_locator_exits_naming_the_missing_module_when_there_is_no_sglang(tmp_path):
    proc = _run(location, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named sglang"


def test_patch_finds_the_deepseek_v2_of_the_sglang_the_given_interpreter_has_through_the_locator(tmp_path):
    site = _sglang_site(tmp_path, "0.5.14")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    assert patch.locate_sglang(str(python)) == ("0.5.14", site / "sglang" / "srt" / "models" / "deepseek_v2.py")
    (site / "sglang-0.5.14.dist-info" / "METADATA").unlink()
    (site / "sglang-0.5.14.dist-info").rmdir()
    (site / "sglang").rename(site / "other")
    with pytest.raises(patch.PatchError, match="has no usable sglang: ModuleNotFoundError: No module named sglang$"):
        patch.locate_sglang(str(python))


def test_port_check_exits_0_when_something_listens_and_1_when_nothing_does(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert _run(health, "port", s.getsockname()[1], cwd=tmp_path).returncode == 0
    assert _run(health, "port", free_port(), cwd=tmp_path).returncode == 1


class _Server:
    """/health_generate answers 503 for the first `loading` requests, then 200; the name under /model_info
    (0.5.18+) or, with `model_info=False`, only under /v1/models (older releases), which answers
    `models_status`."""

    def __init__(
        self, name: str, *, loading: int = 2, model_info: bool = True, healthy: bool = True, models_status: int = 200
    ) -> None:
        state = {"health_calls": 0}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health_generate":
                    state["health_calls"] += 1
                    return self._send(200 if healthy and state["health_calls"] > loading else 503, {})
                if self.path == "/model_info":
                    return self._send(200, {"served_model_name": name} if model_info else {"model_path": "/m"})
                if self.path == "/v1/models":
                    return self._send(models_status, {"data": [{"id": name}]})
                self._send(404, {})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self) -> "_Server":
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("model_info", [True, False], ids=["model_info", "v1_models"])
def test_health_wait_exits_0_once_healthy_and_serving_the_name_it_was_launched_with(tmp_path, model_info):
    with _Server("eagle3-abc", model_info=model_info) as server:
        proc = _run(health, "wait", server.url, 30, "eagle3-abc", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_health_wait_exits_2_naming_what_another_server_on_the_port_serves(tmp_path):
    with _Server("someone-else", loading=0) as server:
        proc = _run(health, "wait", server.url, 30, "eagle3-abc", cwd=tmp_path)
    assert proc.returncode == 2
    assert "serves ['someone-else'], not 'eagle3-abc'" in proc.stdout


def test_health_wait_exits_2_saying_there_is_no_model_list_when_v1_models_answers_an_error(tmp_path):
    with _Server("eagle3-abc", loading=0, model_info=False, models_status=500) as server:
        proc = _run(health, "wait", server.url, 30, "eagle3-abc", cwd=tmp_path)
    assert proc.returncode == 2
    assert """serves ["<no model list: <HTTPError 500: 'Internal Server Error'>>"], not 'eagle3-abc'""" in proc.stdout


def test_health_wait_exits_1_with_the_last_error_when_the_server_never_turns_healthy(tmp_path):
    with _Server("eagle3-abc", healthy=False) as server:
        proc = _run(health, "wait", server.url, 2, "eagle3-abc", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout.strip() == "HTTP 503"


def test_health_check_refuses_an_unknown_command(tmp_path):
    proc = _run(health, "ready", cwd=tmp_path)
    assert proc.returncode == 64 and "usage" in proc.stderr
