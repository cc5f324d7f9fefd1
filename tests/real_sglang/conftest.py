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

from tests.real_sglang.support import VERSION, extraction_server
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


@pytest.fixture(scope="session")
def plain_server(sglang_python, micro_target, tmp_path_factory):
    """VERSION's patched server in extraction mode on the micro target as DeepseekV3ForCausalLM, shared by
    test_real_extraction and test_real_kimi_k25, which run in its xdist group (`PLAIN_SERVER_GROUP`): a start is
    ~40 s of CPU; idle, it uses none (`--sleep-on-idle`, tests/sglang_cpu/venv.py). Yields (the running server,
    its dump folder, its log file); each test extracts into a folder of its own."""
    tmp = tmp_path_factory.mktemp(f"plain_server_{VERSION}")
    with extraction_server(sglang_python, micro_target, tmp) as served:
        yield served
