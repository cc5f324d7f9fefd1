"""The tier's venvs hold what SGLang's release pins, wherever it can import it from (tests/sglang_cpu/venv.py)."""

from __future__ import annotations

import pytest

from tests.sglang_cpu import venv as sglang_venv

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
]  # SGLang's own release code on CPU, in a venv built from PyPI (tests/sglang_cpu)


@pytest.mark.parametrize("version", ["0.5.23", "0.5.12"])
def test_what_the_venv_imports_is_at_sglangs_own_pins(sglang_pythons, version):
    """A package SGLang pins that the venv's requirements leave out comes from the project's environment or at
    pip's newest: transformers 5.25 brought kernels 0.19.1 into the project's, and SGLang 0.5.12 no longer
    imported. Only `PIN_DEVIATIONS` (the CPU torch) may differ."""
    assert sglang_venv.unmet_release_pins(sglang_pythons(version)) == []
