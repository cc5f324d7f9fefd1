"""The `eagle3` command behaves like a conventional CLI: messages and exit codes, not tracebacks."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3_dagster.io import atomic_write_json

ROOT = Path(__file__).resolve().parents[2]


def eagle3(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "eagle3_dagster.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def profile_in(tmp: Path, **overrides) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "micro.yaml").read_text())
    raw["run_root"] = str(tmp / "run")
    raw["hidden"]["root"] = str(tmp / "hidden")
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    path = tmp / "profile.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_wrong_profile_is_one_line_and_exit_2_without_a_traceback():
    out = eagle3("--profile", "no_such_profile", "plan")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "no_such_profile.yaml: profile file not found" in out.stderr.strip().splitlines()[0]


@pytest.mark.slow  # the eagle3 command in subprocesses
def test_profile_is_accepted_after_the_subcommand_too(tmp_path):
    profile = profile_in(tmp_path)
    before, after = eagle3("--profile", str(profile), "plan"), eagle3("plan", "--profile", str(profile))
    # merged_train was never built: a user error naming it, the same wherever --profile stands
    assert before.returncode == after.returncode == 2
    assert before.stderr == after.stderr and str(tmp_path / "run") in after.stderr
    assert "Traceback" not in after.stderr


def test_subcommand_help_describes_the_subcommand():
    out = eagle3("preflight", "--help")
    assert out.returncode == 0
    assert "pass/fail table" in out.stdout and "--profile" in out.stdout
    listing = eagle3("--help").stdout
    assert "Print the extraction plan" in listing and "Export the current hidden-state shards" in listing


def test_preflight_fails_with_a_table_when_a_needed_check_fails(tmp_path):
    # The sglang backend on this interpreter, which has no sglang and no GPU.
    profile = profile_in(tmp_path, hidden={"backend": "sglang"}, gpu_host={"hosts": [{"num_gpus": 1}]})
    out = eagle3("--profile", str(profile), "preflight")
    assert out.returncode == 1, out.stdout + out.stderr
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:]}
    assert rows["interpreter"] == "PASS" and rows["sglang"] == "FAIL" and rows["gpus"] == "FAIL"
    assert "preflight failed: sglang, patch, eagle3_dagster, gpus" in out.stderr or "sglang" in out.stderr


def test_a_served_benchmark_alone_needs_sglang_on_the_host(tmp_path):
    """The benchmark's mode is its own setting: hf extraction with a served benchmark still needs SGLang."""
    profile = profile_in(tmp_path, bench={"mode": "served"})
    out = eagle3("--profile", str(profile), "preflight")
    assert out.returncode == 1, out.stdout + out.stderr
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:]}
    assert rows["sglang"] == "FAIL"


def test_preflight_passes_when_the_profile_needs_neither_sglang_nor_gpus(tmp_path):
    out = eagle3("--profile", str(profile_in(tmp_path)), "preflight")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:]}
    assert rows["sglang"] == "SKIP" and rows["gpus"] == "SKIP" and rows["free_disk"] == "PASS"


def test_atomic_writes_get_the_mode_a_plain_open_gives(tmp_path):
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    atomic_write_json(tmp_path / "atomic.json", {})
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731  (a one-line helper of this test)
    assert mode(tmp_path / "atomic.json") == mode(plain)


def test_bench_names_a_drafter_directory_without_config_and_a_target_never_built(tmp_path, capsys):
    from eagle3_dagster.cli import main

    profile = profile_in(tmp_path)
    (tmp_path / "drafter").mkdir()
    assert main(["--profile", str(profile), "bench", "--drafter", str(tmp_path / "drafter")]) == 2
    assert "not a drafter directory (no config.json)" in capsys.readouterr().err
    (tmp_path / "drafter" / "config.json").write_text("{}")
    assert main(["bench", "--drafter", str(tmp_path / "drafter"), "--profile", str(profile)]) == 2
    err = capsys.readouterr().err
    assert "target_model" in err and "Traceback" not in err
