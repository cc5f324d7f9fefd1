"""The linter, the formatter and the type checker the code assumes run in the test command: `ruff check` and
`ruff format --check` with pyproject.toml's [tool.ruff], and mypy over the engine with its [tool.mypy]."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["eagle3_dagster", "assets", "resources", "definitions.py", "scripts", "tests", "benchmarks"]
# a noqa comment: its codes, then what is left of the line (the reason)
NOQA = re.compile(r"#\s*noqa(?::\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?(?P<why>.*)$")


def test_ruff_finds_nothing_in_the_code_location_the_engine_scripts_and_tests():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", *PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_the_code_is_as_ruff_formats_it():
    """`ruff format` with pyproject.toml's [tool.ruff.format]: run it before committing."""
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", *PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_mypy_finds_nothing_in_the_engine():
    """Annotations are checked, not only written (`_extract_sglang -> list` once returned a tuple). The cache
    under .cache/mypy makes a run after the first take seconds."""
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_every_noqa_says_why():
    """A `# noqa` silences a rule where it is wrong; the comment says why it is wrong there (ruff's RUF100 already
    refuses one that silences nothing)."""
    files = [
        p
        for d in [*PATHS, "benchmarks", "patches"]
        for p in ([ROOT / d] if d.endswith(".py") else (ROOT / d).rglob("*.py"))
    ]
    bare = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if (m := NOQA.search(line)) and not re.search(r"[a-z]{3}", m["why"])
    ]
    assert bare == []
