"""A TCP port free now that no other process is handed before the server it is for binds it.

A port from bind(0) lies in the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), from which
bind(0) and connect() of every other process draw, so it can be taken between the pick and the server's bind,
seconds later for the torchrun store or `dagster dev`, minutes later for a loading SGLang server (the test tier
lost one so). Below that range a port goes only to a process that asks for it by number. SGLang picks its own
NCCL port the same way, in 22000-29999 (`get_free_port_below_ephemeral`), so `PORTS` stops below it.

Standard library only: the GPU host's interpreter runs it beside the server (`gpu_host.program_argv`; it prints
one port free on every address of that host), and this project imports it.
"""

from __future__ import annotations

import random
import socket
import sys
from collections.abc import Callable

PORTS = range(12000, 22000)
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_low() -> int:
    """The lowest port the kernel hands out to bind(0) and connect() (32768, Linux's default, when unreadable)."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(ports: range = PORTS, *, address: str = "127.0.0.1", claim: Callable[[int], bool] | None = None) -> int:
    """A port of `ports`, below the ephemeral range, that `address` can bind now, tried in random order;
    `claim(port)`, when given, must agree too (the test suite reserves each port it hands out)."""
    low = ephemeral_low()
    candidates = [p for p in ports if 1024 <= p < low]
    for port in random.sample(candidates, len(candidates)):
        try:
            with socket.socket() as s:
                s.bind((address, port))
        except OSError:
            continue
        if claim is None or claim(port):
            return port
    raise RuntimeError(
        f"no port in {ports.start}-{ports.stop - 1} below the ephemeral range (from {low}) is free on "
        f"{address or 'every address'}"
    )


if __name__ == "__main__":  # on a host: the rendezvous port torchrun's store will listen on, on every address
    print(free_port(address=sys.argv[1] if len(sys.argv) > 1 else ""))
