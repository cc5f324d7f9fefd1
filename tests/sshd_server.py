"""A real OpenSSH server (Debian `openssh-server`) on a loopback port, for tests that need an SSH "host".

It accepts a throwaway key for the current user; every connection runs on this
machine, so a test can start several and treat each as a GPU host of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_dagster import ports
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


# Test servers take their ports from TEST_PORTS, below the kernel's ephemeral range (`eagle3_dagster.ports`: CI
# once lost SGLang's HTTP port to another process while the server loaded, and SGLang's warm-up then polled that
# process for 12 minutes before it killed itself), below the range the project's own picks come from (the
# torchrun store, `dagster dev`), and with 0.5.12's gRPC port (its HTTP port + 10000,
# `ServerArgs._handle_deprecated_args`) below SGLang's own NCCL picks (22000-29999). Each port is reserved for the
# process that handed it out (a lock file held open until that process exits), so no two tests of one tier, nor
# two tiers of one user on one machine, share one.
TEST_PORTS = range(10000, 12000)
_PORT_LOCKS = Path(tempfile.gettempdir()) / f"eagle3-test-ports-{os.getuid()}"  # a user's own: files of 0600
_held: dict[int, int] = {}  # port -> the open lock file's descriptor, for this process's lifetime


def _reserve(port: int) -> bool:
    if port in _held:
        return False
    fd = os.open(_PORT_LOCKS / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another live process holds it
        os.close(fd)
        return False
    _held[port] = fd
    return True


def free_port() -> int:
    """A loopback port for a server a test starts: free now, never handed out before by this process, and
    reserved against every other process that takes its ports here."""
    _PORT_LOCKS.mkdir(exist_ok=True)
    return ports.free_port(TEST_PORTS, claim=_reserve)


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
