"""A real OpenSSH server (Debian `openssh-server`) on a loopback port, for tests that need an SSH "host".

It accepts a throwaway key for the current user; every connection runs on this
machine, so a test can start several and treat each as a GPU host of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_dagster.gpu_host import GpuHost
from eagle3_dagster.host_config import HostConfig


@dataclass
class Sshd:
    proc: subprocess.Popen  # the listening sshd (-D: it never daemonizes)
    target: str  # user@127.0.0.1
    options: tuple[str, ...]  # ssh arguments: key, port, no host-key prompts

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=10)


# Test servers take their ports from TEST_PORTS, each port reserved for the process that handed it out (a lock
# file held open until that process exits), so no two tests of one tier, nor two tiers on one machine, share one.
# The range lies below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 here),
# where bind(0) and connect() never hand a port to anyone else: a port found free by bind(0) could be taken by
# another process before the server bound it, and was (CI stop 38: SGLang's HTTP port went to another process while
# its server loaded, and SGLang's warm-up then polled that process for 12 minutes before killing itself). It also
# avoids SGLang's own below-ephemeral picks (`get_free_port_below_ephemeral`, 22000-29999) and keeps
# 0.5.12's gRPC port (its HTTP port + 10000, `ServerArgs._handle_deprecated_args`) at or below 21999.
TEST_PORTS = range(10000, 12000)
_PORT_LOCKS = Path(tempfile.gettempdir()) / "eagle3-test-ports"
_held: dict[int, int] = {}  # port -> the open lock file's descriptor, for this process's lifetime


def free_port() -> int:
    """A loopback port for a server a test starts: free now, never handed out before by this process, and
    reserved against every other process that takes its ports here."""
    _PORT_LOCKS.mkdir(exist_ok=True)
    for port in random.sample(TEST_PORTS, len(TEST_PORTS)):
        if port in _held:
            continue
        fd = os.open(_PORT_LOCKS / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another live process holds it
            os.close(fd)
            continue
        try:
            with socket.socket() as s:  # a server left running from an earlier tier, or anything else
                s.bind(("127.0.0.1", port))
        except OSError:
            os.close(fd)
            continue
        _held[port] = fd
        return port
    raise RuntimeError(f"no free loopback port in {TEST_PORTS.start}-{TEST_PORTS.stop - 1} ({_PORT_LOCKS})")


def start_sshd(d: Path, env: dict[str, str] | None = None) -> Sshd:
    """Start sshd with its keys and config in `d`; returns once it accepts a connection. `env`: variables every
    session starts with (sshd's `SetEnv`), as a host's login environment would hold them."""
    sshd_bin = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(sshd_bin).exists():
        raise FileNotFoundError("openssh-server is required: apt-get install -y openssh-server")
    d.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PubkeyAuthentication yes\nStrictModes no\nUsePAM no\nPermitRootLogin prohibit-password\n"
        # one SetEnv line: sshd takes the first of a keyword's lines only
        + (f"SetEnv {' '.join(f'{k}={v}' for k, v in env.items())}\n" if env else "")
    )
    with contextlib.suppress(OSError):
        os.makedirs("/run/sshd", exist_ok=True)
    proc = subprocess.Popen([sshd_bin, "-D", "-e", "-f", str(d / "sshd_config")], stderr=subprocess.PIPE)
    options = (
        "-i",
        str(d / "user_key"),
        "-p",
        str(port),
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
    )
    target = f"{getpass.getuser()}@127.0.0.1"
    for _ in range(100):
        if (
            subprocess.run(["ssh", "-o", "BatchMode=yes", *options, target, "true"], capture_output=True).returncode
            == 0
        ):
            return Sshd(proc, target, options)
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"sshd did not accept connections: {proc.stderr.read1().decode()}")


def local_and_ssh_hosts(tmp_path: Path, sshd: tuple[str, tuple[str, ...]]) -> dict[str, GpuHost]:
    """This machine as two GPU hosts on this interpreter, both working in tmp_path/work: "local", and "ssh"
    through the server of the `sshd` fixture (tests/conftest.py)."""
    target, options = sshd
    return {
        "local": GpuHost(HostConfig(python=sys.executable, workdir=str(tmp_path / "work"))),
        "ssh": GpuHost(
            HostConfig(
                transport="ssh",
                python=sys.executable,
                workdir=str(tmp_path / "work"),
                ssh_target=target,
                ssh_options=list(options),
            )
        ),
    }
