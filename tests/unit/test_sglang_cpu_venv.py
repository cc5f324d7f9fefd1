"""The real-SGLang tier's venv stamp (tests/sglang_cpu/venv.py) depends on the project's environment only."""

from __future__ import annotations

import sys

from tests.sglang_cpu import venv


def test_base_packages_ignore_distributions_elsewhere_on_sys_path(tmp_path, monkeypatch):
    # `python -m tests.sglang_cpu.venv` from the checkout puts the checkout on sys.path, and with it the
    # `eagle3_dagster.egg-info` an editable install leaves there; pytest does not. The digest differed and
    # the venv was rebuilt (minutes) every time the tier ran after a build from the command line.
    before = venv.base_packages()
    probe = tmp_path / "eagle3_probe-1.0.dist-info"
    probe.mkdir()
    (probe / "METADATA").write_text("Metadata-Version: 2.1\nName: eagle3-probe\nVersion: 1.0\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert venv.base_packages() == before
