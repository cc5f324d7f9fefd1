"""The linter the code assumes runs in the test command: `ruff check` with pyproject.toml's [tool.ruff]."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["eagle3_dagster", "assets", "resources", "definitions.py", "scripts", "tests"]


def test_ruff_finds_nothing_in_the_code_location_the_engine_scripts_and_tests():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *PATHS], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
