"""The real-SGLang tier: SGLang's release server on this machine's CPU (tests/sglang_cpu/README.md).

The venv is built here, inside the test run (CI has no cache), from PyPI only; a failed download
or install fails the tier. The production dump patch goes on with `eagle3 patch apply --python`,
as on a GPU host.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from tests.real_sglang.support import VERSION
from tests.sglang_cpu import venv as sglang_venv


@pytest.fixture(scope="session")
def sglang_pythons() -> Callable[[str], Path]:
    """The patched venv interpreter of a release, built (or reused) once per session."""

    @cache
    def python_of(version: str) -> Path:
        python = sglang_venv.build(version, log=lambda line: print(f"[sglang venv {version}] {line}", file=sys.stderr))
        sglang_venv.dump_patch(python, "apply")
        return python

    return python_of


@pytest.fixture(scope="session")
def sglang_python(sglang_pythons) -> Path:
    return sglang_pythons(VERSION)

