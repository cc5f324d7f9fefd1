"""The dump patch against the real deepseek_v2.py of every supported SGLang release."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sglang_wheels  # noqa: E402

from eagle3_dagster.sglang import patch  # noqa: E402

UNSUPPORTED_RELEASE = "0.5.13"  # real release between supported ones, deliberately not in the table


def _model_file(python: Path) -> Path:
    return python.parent / "site" / sglang_wheels.MODEL_FILE


@pytest.mark.parametrize("version", patch.supported_versions())
def test_apply_compile_verify_idempotent_revert_restores_pristine_bytes(version, tmp_path):
    python = sglang_wheels.make_site(version, tmp_path)
    target = _model_file(python)
    pristine = target.read_bytes()
    assert hashlib.sha256(pristine).hexdigest() == patch.SUPPORTED[version].pristine_sha256
    target.chmod(0o644)

    assert patch.verify(str(python)) == "unpatched"
    assert patch.apply(str(python)).startswith("patched:")
    patched = target.read_bytes()
    compile(patched, str(target), "exec")
    assert b"_eagle3_hs_dump.capture_final(hidden_states, input_ids, forward_batch)" in patched
    assert patch.verify(str(python)) == "patched"
    assert target.stat().st_mode & 0o777 == 0o644

    assert patch.apply(str(python)).startswith("already patched")
    assert target.read_bytes() == patched

    assert patch.revert(str(python)).startswith("reverted:")
    assert target.read_bytes() == pristine
    assert patch.verify(str(python)) == "unpatched"
    assert patch.revert(str(python)).startswith("already pristine")


@pytest.mark.parametrize("version", patch.supported_versions())
def test_patched_module_is_inert_without_dump_dir_and_imports_hook_with_it(version, tmp_path):
    """The inserted guard binds the hook only when SGLANG_HS_DUMP_DIR is set at import."""
    python = sglang_wheels.make_site(version, tmp_path)
    patch.apply(str(python))
    source = _model_file(python).read_text()
    guard = source[source.index("# eagle3-dagster") : source.index("class DeepseekV2Model(")]
    for env, expected in [({}, "None"), ({"SGLANG_HS_DUMP_DIR": str(tmp_path)}, "eagle3_dagster.sglang.dump_hook")]:
        probe = guard + "print(getattr(_eagle3_hs_dump, '__name__', None))\n"
        out = subprocess.run([sys.executable, "-c", probe], env={"PATH": "/usr/bin:/bin", **env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == expected


def test_unsupported_release_is_refused_naming_supported_ones(tmp_path):
    python = sglang_wheels.make_site(UNSUPPORTED_RELEASE, tmp_path)
    before = _model_file(python).read_bytes()
    with pytest.raises(patch.PatchError) as err:
        patch.apply(str(python))
    assert UNSUPPORTED_RELEASE in str(err.value)
    for v in patch.supported_versions():
        assert v in str(err.value)
    assert _model_file(python).read_bytes() == before


def test_modified_file_is_reported_and_never_patched_or_reverted(tmp_path):
    python = sglang_wheels.make_site("0.5.23", tmp_path)
    target = _model_file(python)
    target.write_bytes(target.read_bytes() + b"# local edit\n")
    assert patch.verify(str(python)) == "modified-unknown"
    for action in (patch.apply, patch.revert):
        with pytest.raises(patch.PatchError, match="refusing"):
            action(str(python))
    assert target.read_bytes().endswith(b"# local edit\n")


def test_cli_verify_exit_codes_and_interpreter_without_sglang(tmp_path, capsys):
    python = sglang_wheels.make_site("0.5.9", tmp_path)
    assert patch.main(["verify", "--python", str(python)]) == 1
    assert capsys.readouterr().out.strip() == "unpatched"
    assert patch.main(["apply", "--python", str(python)]) == 0
    assert patch.main(["verify", "--python", str(python)]) == 0
    bare = tmp_path / "bare"
    bare.write_text(f'#!/bin/sh\nPYTHONPATH= exec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    assert patch.main(["verify", "--python", str(bare)]) == 2
    assert "has no usable sglang" in capsys.readouterr().out


def test_diff_context_mismatch_is_an_error_not_a_fuzzy_apply():
    diff = "--- a\n+++ b\n@@ -1,2 +1,3 @@\n x\n+y\n z\n"
    assert patch.apply_unified_diff("x\nz\n", diff) == "x\ny\nz\n"
    assert patch.apply_unified_diff("x\ny\nz\n", diff, reverse=True) == "x\nz\n"
    with pytest.raises(patch.PatchError, match="context does not match"):
        patch.apply_unified_diff("x\nw\n", diff)
