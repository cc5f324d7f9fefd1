"""Provenance recorded in every artifact: code, packages, config and command line."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "transformers", "safetensors", "tokenizers", "dagster", "eagle3-dagster")


def git_sha(root: Path | None = None) -> str:
    root = root or Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def provenance(config_json: str = "") -> dict:
    return {
        "git_sha": git_sha(),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "config_sha256": hashlib.sha256(config_json.encode()).hexdigest()[:16],
        "argv": list(sys.argv),
    }
