"""The install adds one top-level package, `eagle3_dagster`: the code location's `assets` and `resources`
stay folders of the checkout, not global names that collide with other projects' in site-packages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_only_the_engine_package(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    [wheel] = tmp_path.glob("eagle3_dagster-*.whl")
    top = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist() if not name.split("/")[0].endswith(
        (".dist-info", ".data"))}
    assert top == {"eagle3_dagster"}


def test_the_training_child_is_started_from_the_checkout_where_resources_lives():
    from eagle3_dagster.config import PROJECT_ROOT
    from eagle3_dagster.stages.train import PIPES_WORKER

    assert (PROJECT_ROOT / (PIPES_WORKER.replace(".", "/") + ".py")).exists()
