"""Kill -9 a child process at a point it announces, so a crash lands where a test wants it whatever the
machine's speed: the child prints a word and waits there; EOF first means it died or finished before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def kill_when_it_says(code: str, argv: list[str], word: str, before: str) -> None:
    """Run `python -c code *argv` with this checkout importable; SIGKILL it once it prints `word`.

    The child computes with as many torch threads as this process: a float reduction split over another
    thread count rounds differently, and the tests compare what the child wrote with what this process
    writes, byte for byte."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    child = subprocess.Popen([sys.executable, "-c", code, *argv], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert f"{word}\n" in child.stdout, f"the child exited {before} (exit {child.wait()})"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
