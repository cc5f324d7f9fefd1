"""`eagle3_dagster.ports`: a free port below the kernel's ephemeral range, imported here or run on a host."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from eagle3_dagster import ports
from eagle3_dagster.gpu_host import program_argv
from tests.sshd_server import free_port as reserved_port


def _listening(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_the_port_lies_below_the_ephemeral_range_and_below_sglangs_own_picks():
    for _ in range(50):
        port = ports.free_port()
        assert port in ports.PORTS and port < ports.ephemeral_low() and port < 22000, port


def test_a_port_something_holds_is_never_handed_out():
    port = reserved_port()  # one no other test hands out, so only this test binds it
    assert ports.free_port(range(port, port + 1)) == port
    with _listening(port), pytest.raises(RuntimeError, match=rf"no port in {port}-{port} below the ephemeral range"):
        ports.free_port(range(port, port + 1))


def test_a_port_the_claim_refuses_is_skipped():
    port = reserved_port()
    with pytest.raises(RuntimeError, match="no port in"):
        ports.free_port(range(port, port + 1), claim=lambda p: False)
    assert ports.free_port(range(port, port + 1), claim=lambda p: p == port) == port


def test_run_on_a_host_it_prints_a_port_free_on_every_address():
    out = subprocess.run(program_argv(sys.executable, ports, ""), capture_output=True, text=True, check=True)
    port = int(out.stdout)
    assert port in ports.PORTS and port < ports.ephemeral_low()
    with socket.socket() as s:
        s.bind(("", port))
