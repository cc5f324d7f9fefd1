"""The SGLang server's lifecycle on a GPU host (`eagle3_dagster.sglang.server`), local and through real SSH.

The launcher is a fake SGLang script (a tiny HTTP server with /health_generate, /v1/models and /generate that
also forks a child); the tests check the health wait, the log stream, the options an extraction launch adds,
and that the whole process group is gone afterwards. The SSH case runs against a real OpenSSH server on
loopback (the `sshd` fixture, tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from eagle3_dagster.gpu_host import GpuHost
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.sglang.server import ServerError, ServerSpec, sglang_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sshd_server import free_port, local_and_ssh_hosts

pytestmark = pytest.mark.slow  # a real sshd and server processes

FAKE_SERVER = r"""
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
"""


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


def _fake_spec(tmp_path, port, **kw) -> ServerSpec:
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SERVER)
    return ServerSpec(
        model_path="/models/tiny",
        port=port,
        dump_dir=str(tmp_path / "dumps"),
        dump_layers=(2, 30, 58),
        launcher=(sys.executable, str(script)),
        health_timeout_s=30,
        env={"FAKE_STATE_DIR": str(tmp_path), **kw},
    )


@pytest.mark.parametrize("transport", ["local", "ssh"])
def test_server_lifecycle_health_wait_log_stream_and_group_killed_on_exception(tmp_path, sshd, transport):
    host = local_and_ssh_hosts(tmp_path, sshd)[transport]
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


# SGLang's HTTP server as it fails when its port was taken between the free-port check and its bind (CI stop 38's
# failure): a real uvicorn.Server on an app whose lifespan starts a warm-up thread at startup and joins it at
# shutdown (sglang/srt/entrypoints/http_server.py `lifespan`), so after uvicorn logs the bind error it stays alive
# for as long as the warm-up polls the port; SGLang's polls 120 times with a 5 s timeout, this one sleeps 120 s.
# The port is taken by another process that listens and never answers, as the torchrun store that had it did.
PORT_TAKEN_SERVER = r"""
import contextlib, subprocess, sys, threading, time
import uvicorn
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
occupy = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(16); "
occupy += "print('bound', flush=True); time.sleep(600)"
occupant = subprocess.Popen([sys.executable, "-c", occupy, str(port)], stdout=subprocess.PIPE, text=True)
occupant.stdout.readline()
@contextlib.asynccontextmanager
async def lifespan():
    warmup = threading.Thread(target=time.sleep, args=(120,))
    warmup.start()
    try:
        yield
    finally:
        warmup.join()
async def app(scope, receive, send):
    assert scope["type"] == "lifespan"  # nothing is ever served: the bind fails
    await receive()
    async with lifespan():
        await send({"type": "lifespan.startup.complete"})
        await receive()
    await send({"type": "lifespan.shutdown.complete"})
uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on")).run()
"""


def test_a_server_whose_port_was_taken_before_it_bound_fails_at_once_naming_the_port(tmp_path):
    host = GpuHost(HostConfig(python=sys.executable, workdir=str(tmp_path / "work")))
    port = free_port()
    script = tmp_path / "port_taken_sglang.py"
    script.write_text(PORT_TAKEN_SERVER)
    spec = ServerSpec(model_path="/m", port=port, launcher=(sys.executable, str(script)), health_timeout_s=600)
    logs: list[str] = []
    started = time.monotonic()
    with pytest.raises(ServerError, match=rf"could not listen on http://127.0.0.1:{port}(.|\n)*hidden.sglang_port"):
        with sglang_server(host, spec, on_log=logs.append):
            pass
    assert time.monotonic() - started < 60, "waited out the warm-up instead of failing at the bind error"
    assert any("address already in use" in line.lower() for line in logs), logs
    with pytest.raises(httpx.TransportError):  # the server's group, the occupant with it, is gone
        httpx.get(f"http://127.0.0.1:{port}/", timeout=2)


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


def test_server_runs_code_shipped_with_a_checkpoint_only_when_the_profile_says_so():
    extraction = ServerSpec("/m", dump_dir="/d", dump_layers=(2, 30, 58), sglang_version="0.5.23")
    assert "--trust-remote-code" not in extraction.argv("python")
    assert "--trust-remote-code" in ServerSpec("/m", trust_remote_code=True).argv("python")
