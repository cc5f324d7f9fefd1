"""The suite runs as from a terminal, whatever started it. A command started in the background of a
non-interactive shell (a CI script's `cmd &`) inherits SIGINT ignored, and so does everything it starts:
`dagster dev` then ignores the SIGINT the e2e tests stop it with (each stop waited out its grace), and
Dagster's in-process executions map SIGTERM to SIGINT's handler, so SIGTERM was ignored too."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sigint_is_handled_in_the_suite():
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN


def test_a_suite_started_with_sigint_ignored_handles_it():
    started_in_background = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'pytest', *sys.argv[1:]])"
    )
    probe = f"{Path(__file__).relative_to(ROOT)}::test_sigint_is_handled_in_the_suite"
    proc = subprocess.run(
        [sys.executable, "-c", started_in_background, "-q", "-p", "no:cacheprovider", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
