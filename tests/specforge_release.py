"""SpecForge's own code from its PyPI release, for tests that check our files against its readers.

`pip download --no-deps specforge==VERSION` into `.cache/specforge-wheels/` (gitignored), unpacked
beside the wheel; tests put that folder on `sys.path` and import only the modules they need
(the offline feature reader, the EAGLE-3 normaliser, TargetHead, the draft model), which import
with this project's torch and transformers. Its pinned dependencies (torch 2.11, sglang 0.5.14,
yunchang, wandb...) are not installed: nothing imported here needs them. A failed download
is an error, never a skip.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "0.2.0"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "specforge-wheels"


def release_dir(version: str = VERSION) -> Path:
    """The unpacked wheel of `specforge==version` (a folder holding the `specforge` package)."""
    out = CACHE / f"specforge-{version}"
    if (out / "specforge" / "__init__.py").exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob(f"specforge-{version}-*.whl"))
    if not wheels:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               f"specforge=={version}", "-d", str(CACHE)], capture_output=True, text=True)
        wheels = sorted(CACHE.glob(f"specforge-{version}-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download specforge=={version}: {proc.stderr.strip()[-2000:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(out)
    return out
