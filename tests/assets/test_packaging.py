"""The install adds one top-level package, `eagle3_dagster`: the code location's `assets` and `resources`
stay folders of the checkout, not global names that collide with other projects' in site-packages."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds and installs the wheel

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_only_the_engine_package(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources it builds.
    src = tmp_path / "src"
    src.mkdir()
    for name in ["pyproject.toml", "README.md"]:
        shutil.copy(ROOT / name, src / name)
    for name in ["eagle3_dagster", "assets", "resources"]:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    [wheel] = tmp_path.glob("eagle3_dagster-*.whl")
    top = {
        name.split("/")[0]
        for name in zipfile.ZipFile(wheel).namelist()
        if not name.split("/")[0].endswith((".dist-info", ".data"))
    }
    assert top == {"eagle3_dagster"}


def test_the_training_child_is_started_from_the_checkout_where_resources_lives():
    from eagle3_dagster.config import PROJECT_ROOT
    from assets.drafter_checkpoint import PIPES_WORKER

    assert (PROJECT_ROOT / (PIPES_WORKER.replace(".", "/") + ".py")).exists()
