"""SpecForge's own code from its PyPI release, for tests that check our files against its readers.

`pip download --no-deps specforge==VERSION` into `.cache/specforge-wheels/` (tests/release_wheels.py), unpacked
beside the wheel; tests put that folder on `sys.path` and import only the modules they need
(the offline feature reader, the EAGLE-3 normaliser, TargetHead, the draft model), which import
with this project's torch and transformers. Its pinned dependencies (torch 2.11, sglang 0.5.14,
yunchang, wandb...) are not installed: nothing imported here needs them. A failed download
is an error, never a skip.
"""

from __future__ import annotations

from pathlib import Path

from tests.release_wheels import unpacked

VERSION = "0.2.0"


def release_dir(version: str = VERSION) -> Path:
    """The unpacked wheel of `specforge==version` (a folder holding the `specforge` package)."""
    return unpacked("specforge", version)
