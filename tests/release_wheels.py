"""Release wheels from PyPI, cached in `.cache/<package>-wheels/` (gitignored): `pip download --no-deps`.

The suite's xdist workers share the cache, so each download and each unpacking holds a lock on the
package's folder, and an unpacked release is renamed into place only once it is whole (pip copies the
wheel into the folder: unlocked, another process could open a half-copied file). A failed download is an
error, never a skip.

`python -m tests.release_wheels` fetches every release the tier reads (`tier_releases`) into the cache;
scripts/test.sh runs it in the background while setup.sh installs the environment, on the core pip leaves idle.
It needs only the standard library and pip, so any Python 3.11 runs it before the venv exists.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cache_dir(package: str) -> Path:
    return ROOT / ".cache" / f"{package}-wheels"


@contextmanager
def _locked(package: str, version: str) -> Iterator[Path]:
    folder = cache_dir(package)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


def _download(package: str, version: str, folder: Path) -> Path:
    hits = sorted(folder.glob(f"{package}-{version}-*.whl"))
    if hits:
        return hits[0]
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                           f"{package}=={version}", "-d", str(folder)], capture_output=True, text=True)
    hits = sorted(folder.glob(f"{package}-{version}-*.whl"))
    if proc.returncode != 0 or not hits:
        raise RuntimeError(f"could not download {package}=={version}: {proc.stderr.strip()[-2000:]}")
    return hits[0]


def wheel(package: str, version: str) -> Path:
    """The cached wheel of `package==version`, downloaded if needed."""
    with _locked(package, version) as folder:
        return _download(package, version, folder)


def unpacked(package: str, version: str) -> Path:
    """The wheel of `package==version` unpacked: a folder holding its top-level packages."""
    out = cache_dir(package) / f"{package}-{version}"
    with _locked(package, version) as folder:
        if not out.exists():
            partial = folder / f".{out.name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            with zipfile.ZipFile(_download(package, version, folder)) as z:
                z.extractall(partial)
            partial.rename(out)
    return out


# The SGLang releases the tests read that releases.json does not support (the patch tests check they are refused).
UNSUPPORTED_SGLANG = ("0.5.6.post2", "0.5.9")


def tier_releases() -> list[tuple[str, str]]:
    """(package, version) of every release the tier reads: SGLang's supported and refused ones, SpecForge's."""
    from eagle3_dagster.sglang import releases
    from tests.specforge_release import VERSION as SPECFORGE

    return [*(("sglang", v) for v in [*releases.supported(), *UNSUPPORTED_SGLANG]), ("specforge", SPECFORGE)]


def main() -> int:
    failed = []
    for package, version in tier_releases():
        try:
            print(unpacked(package, version) if package == "specforge" else wheel(package, version), flush=True)
        except RuntimeError as e:  # the test that reads it downloads it again, and fails naming why
            failed.append(f"{package}=={version}: {e}")
    print("\n".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
