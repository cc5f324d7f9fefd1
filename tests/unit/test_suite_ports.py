"""The loopback ports the suite hands its servers (`tests.sshd_server.free_port`) must suit every server it starts.

- Below the kernel's ephemeral range, where neither bind(0) nor connect() of another process can take a port
  between the test finding it free and its server binding it. CI once lost SGLang's HTTP port to another process
  while the server loaded; SGLang's warm-up then polled that process for 12 minutes before it killed itself.
- Outside SGLang 0.5.23's own below-ephemeral picks for its NCCL port (`get_free_port_below_ephemeral`,
  22000-29999), also with 0.5.12's gRPC port (its port + 10000 unless SGLANG_GRPC_PORT is set,
  `ServerArgs._handle_deprecated_args`), which exits before it is healthy past 65535: the real tier did once (69113).
- Never the same port for two processes of one machine (the two pytest-xdist workers, or two tiers of one user).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.sshd_server import free_port

ROOT = Path(__file__).resolve().parents[2]
DRAW = "import json; from tests.sshd_server import free_port; print(json.dumps([free_port() for _ in range(100)]))"


def test_free_ports_lie_below_the_ephemeral_range_and_clear_of_the_ports_sglang_derives_and_picks():
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(100)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert 1024 < port < ephemeral_low and port + 10000 < 22000, port


def test_two_processes_never_hold_the_same_port():
    mine = {free_port() for _ in range(100)}
    other = subprocess.run([sys.executable, "-c", DRAW], cwd=ROOT, capture_output=True, text=True, check=True)
    theirs = set(json.loads(other.stdout))
    assert len(theirs) == 100 and not mine & theirs
