"""The dump patch against the real deepseek_v2.py of every supported SGLang release."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sglang_wheels

import importlib.util

from eagle3_dagster import sglang_releases
from eagle3_dagster.sglang import patch
from tests.release_wheels import UNSUPPORTED_SGLANG

pytestmark = pytest.mark.slow  # every supported SGLang release's wheel: generated, patched, reverted

UNSUPPORTED_RELEASE = "0.5.9"  # real release whose KimiK25ForConditionalGeneration cannot serve EAGLE-3
ROOT = Path(__file__).resolve().parents[2]


def _make_patch_module():
    spec = importlib.util.spec_from_file_location("make_patch", ROOT / "patches" / "sglang" / "make_patch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_file(python: Path) -> Path:
    return python.parent / "site" / sglang_wheels.MODEL_FILE


@pytest.mark.parametrize("version", list(sglang_releases.supported()))
def test_apply_compile_verify_idempotent_revert_restores_pristine_bytes(version, tmp_path):
    python = sglang_wheels.make_site(version, tmp_path)
    target = _model_file(python)
    pristine = target.read_bytes()
    assert hashlib.sha256(pristine).hexdigest() == sglang_releases.release(version).pristine_sha256
    target.chmod(0o644)

    assert patch.verify(str(python)) == "unpatched"
    assert patch.apply(str(python)).startswith("patched:")
    patched = target.read_bytes()
    compile(patched, str(target), "exec")
    assert b"_eagle3_hs_dump.capture_final(hidden_states, forward_batch)" in patched
    assert patch.verify(str(python)) == "patched"
    assert target.stat().st_mode & 0o777 == 0o644

    assert patch.apply(str(python)).startswith("already patched")
    assert target.read_bytes() == patched

    assert patch.revert(str(python)).startswith("reverted:")
    assert target.read_bytes() == pristine
    assert patch.verify(str(python)) == "unpatched"
    assert patch.revert(str(python)).startswith("already pristine")


# What a guard's probe printed, by (guard text, dump dir set): releases whose patch inserts the same guard run it
# once (a probe is an interpreter importing the hook and torch: 18 releases x 2 probes were ~45 s of CPU).
_PROBED: dict[tuple[str, bool], str] = {}


@pytest.mark.parametrize("version", list(sglang_releases.supported()))
def test_patched_module_is_inert_without_dump_dir_and_imports_hook_with_it(version, tmp_path):
    """The inserted guard binds the hook only when SGLANG_HS_DUMP_DIR is set at import."""
    python = sglang_wheels.make_site(version, tmp_path)
    patch.apply(str(python))
    source = _model_file(python).read_text()
    guard = source[source.index("# eagle3-dagster") : source.index("class DeepseekV2Model(")]
    for env, expected in [({}, "None"), ({"SGLANG_HS_DUMP_DIR": str(tmp_path)}, "eagle3_dagster.sglang.dump_hook")]:
        key = (guard, bool(env))
        if key not in _PROBED:
            probe = guard + "print(getattr(_eagle3_hs_dump, '__name__', None))\n"
            _PROBED[key] = subprocess.run(
                [sys.executable, "-c", probe],
                capture_output=True,
                text=True,
                check=True,
                env={"PATH": "/usr/bin:/bin", **env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
            ).stdout.strip()
        assert _PROBED[key] == expected


def test_unsupported_release_is_refused_naming_supported_ones(tmp_path):
    python = sglang_wheels.make_site(UNSUPPORTED_RELEASE, tmp_path)
    before = _model_file(python).read_bytes()
    with pytest.raises(patch.PatchError) as err:
        patch.apply(str(python))
    assert UNSUPPORTED_RELEASE in str(err.value)
    for v in list(sglang_releases.supported()):
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
    python = sglang_wheels.make_site("0.5.14", tmp_path)
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


def test_supported_releases_are_every_final_release_that_serves_kimi_k25_eagle3_through_0_5_23():
    assert list(sglang_releases.supported()) == [
        "0.5.10",
        "0.5.10.post1",
        "0.5.11",
        "0.5.12",
        "0.5.12.post1",
        "0.5.13",
        "0.5.13.post1",
        "0.5.14",
        "0.5.15",
        "0.5.15.post1",
        "0.5.16",
        "0.5.17",
        "0.5.18",
        "0.5.19",
        "0.5.20",
        "0.5.21",
        "0.5.22",
        "0.5.23",
    ]
    make_patch = _make_patch_module()
    for version in UNSUPPORTED_SGLANG:  # no kimi_k25.py / no set_eagle3_layers_to_capture on K2.5
        row, _ = make_patch.analyze(version)
        assert row["serves_kimi_k25_eagle3"] is False
        with pytest.raises(SystemExit, match="cannot serve Kimi-K2.5 with EAGLE-3"):
            make_patch.refuse_unless_serves(row)


@pytest.mark.parametrize("version", list(sglang_releases.supported()))
def test_table_patch_and_matrix_are_what_the_generator_makes_from_the_wheel(version):
    make_patch = _make_patch_module()
    row, diff = make_patch.analyze(version)
    assert row == json_row(version)
    assert sglang_releases.release(version).patch_file.read_text() == diff
    assert make_patch.matrix([row]).splitlines()[2] in (ROOT / "patches" / "sglang" / "README.md").read_text()


def json_row(version: str) -> dict:
    import json

    rows = json.loads(sglang_releases.TABLE.read_text())["releases"]
    return next(r for r in rows if r["version"] == version)


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23"])
def test_generator_refuses_a_patch_whose_hook_call_reads_a_name_not_in_scope(version):
    """The loop style on a release whose layer loop no longer holds `residual` compiles but would NameError."""
    make_patch = _make_patch_module()
    pristine = sglang_wheels.read_model_file(version).decode()
    with pytest.raises(SystemExit, match="reads 'residual'"):
        make_patch.render(pristine, "loop")
    assert make_patch.detect_style(pristine) == "collector"


def test_generator_refuses_a_moved_anchor():
    make_patch = _make_patch_module()
    pristine = sglang_wheels.read_model_file("0.5.23").decode()
    moved = pristine.replace("        if len(aux_hidden_states) == 0:\n", "        if not len(aux_hidden_states):\n")
    with pytest.raises(SystemExit, match="anchor 'return'"):
        make_patch.render(moved, "collector")


def test_readme_matrix_lists_every_extraction_option_the_table_passes():
    """The README's options column is the launch's: radix cache and chunked prefill included."""
    text = (ROOT / "patches" / "sglang" / "README.md").read_text()
    for version, release in sglang_releases.supported().items():
        line = next(s for s in text.splitlines() if s.startswith(f"| {version} |"))
        assert f"`{' '.join(release.extraction_args)}`" in line, version
        assert f"`{' '.join(release.serving_args)}`" in line, version


# SGLang marks a tensor whose all-reduce is fused into the next layer with this attribute; dump_hook refuses it.
FUSED_MARKER = "_sglang_needs_allreduce_fusion"
RELEASES_WITH_MARKER = [
    "0.5.10",
    "0.5.10.post1",
    "0.5.11",
    "0.5.12",
    "0.5.12.post1",
    "0.5.13",
    "0.5.13.post1",
    "0.5.14",
    "0.5.15",
    "0.5.15.post1",
    "0.5.16",
    "0.5.17",
    "0.5.18",
    "0.5.19",
    "0.5.20",
]


def test_which_fused_all_reduce_guard_is_live_on_each_release():
    """Two guards against per-rank partial sums: the server option (every release: the launch forces the fusion
    off) and dump_hook's check of SGLang's marker attribute, which only 0.5.10-0.5.20 still set (0.5.21 on,
    the marker is gone from the sources, so there the option alone guards)."""
    import zipfile

    from eagle3_dagster.sglang import dump_hook

    assert FUSED_MARKER in Path(dump_hook.__file__).read_text()
    with_marker = []
    for version, release in sglang_releases.supported().items():
        assert "--enforce-disable-flashinfer-allreduce-fusion" in release.extraction_args, version
        assert "--enforce-disable-flashinfer-allreduce-fusion" in release.serving_args, version
        with zipfile.ZipFile(sglang_wheels.wheel_path(version)) as z:
            if any(
                FUSED_MARKER.encode() in z.read(n)
                for n in z.namelist()
                if n.startswith("sglang/srt/") and n.endswith(".py")
            ):
                with_marker.append(version)
    assert with_marker == RELEASES_WITH_MARKER
