"""`scripts/test.sh` runs the tiers on pytest-xdist workers with `--dist loadgroup`: a module's tests must run
on one worker (its module-scoped servers start once) and a named group's modules too (the micro run is
built once). pytest-xdist groups by rewriting each item's node id, which some pytest releases ignore."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = """
import os
from pathlib import Path

import pytest

{mark}

@pytest.mark.parametrize("n", range(4))
def test_records_its_worker(n):
    Path(os.environ["RECORD"], f"{{__name__}}-{{n}}").write_text(os.environ["PYTEST_XDIST_WORKER"])
"""


def test_a_module_and_a_named_group_each_run_on_one_worker(tmp_path):
    suite = tmp_path / "tests"
    suite.mkdir()
    (suite / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (suite / "test_alone.py").write_text(MODULE.format(mark=""))
    for name in ("test_shared_a", "test_shared_b"):
        (suite / f"{name}.py").write_text(MODULE.format(mark='pytestmark = pytest.mark.xdist_group("shared")'))
    record = tmp_path / "record"
    record.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "--rootdir",
            str(tmp_path),
            str(suite),
        ],
        cwd=tmp_path,
        env={**os.environ, "RECORD": str(record)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers = {p.name: p.read_text() for p in record.iterdir()}
    assert len(workers) == 12
    alone = {w for name, w in workers.items() if name.startswith("test_alone")}
    shared = {w for name, w in workers.items() if name.startswith("test_shared")}
    assert len(alone) == 1, f"test_alone.py ran on {sorted(alone)}"
    assert len(shared) == 1, f"the group 'shared' ran on {sorted(shared)}"
