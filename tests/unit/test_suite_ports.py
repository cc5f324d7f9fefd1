"""The loopback ports the suite hands its servers (`tests.sshd_server.free_port`) must suit every server it starts.

SGLang 0.5.12 serves gRPC on its port + 10000 unless SGLANG_GRPC_PORT is set and exits before it is healthy when
that passes 65535 (`ServerArgs._handle_deprecated_args` in the release's `srt/server_args.py`); this kernel hands
out ephemeral ports up to 60999, so about one server start in five failed (the real tier did once: 69113).
"""

from __future__ import annotations

from tests.sshd_server import free_port


def test_free_ports_leave_room_for_the_grpc_port_sglang_derives_from_them():
    ports = [free_port() for _ in range(2000)]
    assert max(ports) + 10000 <= 65535, max(ports)
