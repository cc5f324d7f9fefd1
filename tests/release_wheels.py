"""Release wheels from PyPI, cached in `.cache/<package>-wheels/` (gitignored): `pip download --no-deps`.

Each wheel is pinned by file name and sha256 in tests/release_hashes.json (the hashes PyPI publishes: its JSON
API, `releases[<version>][].digests.sha256`), downloaded with `--require-hashes` into a folder of its own and
moved into the cache only once checked, and checked again whenever the cache hands it out (`wheel`): a cached
file that is not one PyPI published for the release, or whose bytes are not, is refused naming the file and
both hashes, never read or installed. `python -m tests.release_wheels pin PACKAGE VERSION` adds a release's
hashes from PyPI to the table.

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
import hashlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HASHES = Path(__file__).resolve().with_name("release_hashes.json")
PYPI_JSON = "https://pypi.org/pypi/{package}/json"


class WheelHashError(RuntimeError):
    """A wheel that is not the one PyPI published for the release (or a release with no pinned hash)."""


def cache_dir(package: str) -> Path:
    return ROOT / ".cache" / f"{package}-wheels"


def pinned(package: str, version: str) -> dict[str, str]:
    """file name → sha256 of every wheel PyPI published for `package==version` (tests/release_hashes.json)."""
    files = json.loads(HASHES.read_text()).get(package, {}).get(version)
    if not files:
        raise WheelHashError(
            f"no sha256 pinned for {package}=={version} in {HASHES}: add PyPI's with "
            f"`python -m tests.release_wheels pin {package} {version}`"
        )
    return files


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_CHECKED: dict[str, tuple[int, int, int, int]] = {}  # path → (device, inode, size, mtime) when last checked


def verify(path: Path, package: str, version: str) -> Path:
    """`path`, when it is a wheel PyPI published for `package==version`, byte for byte; else WheelHashError naming
    the file and both hashes. A file unchanged since this process checked it is not hashed again."""
    files = pinned(package, version)
    want = files.get(path.name)
    if want is None:
        raise WheelHashError(
            f"{path}: not a wheel PyPI published for {package}=={version} (pinned in {HASHES}: "
            f"{', '.join(sorted(files))})"
        )
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if _CHECKED.get(str(path)) == key:
        return path
    got = sha256_file(path)
    if got != want:
        raise WheelHashError(
            f"{path}: sha256 {got}, but PyPI's {path.name} of {package}=={version} has sha256 "
            f"{want} ({HASHES}); it is not installed or read: remove it and fetch it again"
        )
    _CHECKED[str(path)] = key
    return path


def hashed_requirement(package: str, version: str, spec: str | None = None) -> str:
    """A requirements-file line pip checks in hash-checking mode (`--require-hashes`): `spec` (default
    `package==version`; a wheel's path to install that file) with every pinned hash of the release."""
    hashes = " ".join(f"--hash=sha256:{h}" for h in sorted(set(pinned(package, version).values())))
    return f"{spec or f'{package}=={version}'} {hashes}"


@contextmanager
def _locked(package: str, version: str) -> Iterator[Path]:
    folder = cache_dir(package)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


def _download(package: str, version: str, folder: Path) -> Path:
    """The cached wheel of the release, checked; else one downloaded with pip's hash check into a folder of its
    own, checked again and only then moved into the cache. A cached file whose name PyPI did not publish for
    the release is never taken (the cache once took whatever matched `<package>-<version>-*.whl`)."""
    files = pinned(package, version)
    hits = sorted(p for p in folder.glob(f"{package}-{version}-*.whl") if p.name in files)
    if hits:
        return verify(hits[0], package, version)
    partial = folder / f".{package}-{version}.download"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        requirements = partial / "requirements.txt"
        requirements.write_text(hashed_requirement(package, version) + "\n")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "--require-hashes",
                "-r",
                str(requirements),
                "-d",
                str(partial),
            ],
            capture_output=True,
            text=True,
        )
        got = sorted(partial.glob(f"{package}-{version}-*.whl"))
        if proc.returncode != 0 or not got:
            raise RuntimeError(f"could not download {package}=={version}: {proc.stderr.strip()[-2000:]}")
        verify(got[0], package, version)
        dest = folder / got[0].name
        os.replace(got[0], dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return verify(dest, package, version)


def wheel(package: str, version: str) -> Path:
    """The cached wheel of `package==version`, downloaded if needed."""
    with _locked(package, version) as folder:
        return _download(package, version, folder)


UNPACKED_FROM = ".wheel-sha256"  # in an unpacked release: the sha256 of the checked wheel it came from


def unpacked(package: str, version: str) -> Path:
    """The wheel of `package==version` unpacked: a folder holding its top-level packages. The wheel is checked
    each time; a folder unpacked from anything else (or before the check existed) is unpacked again."""
    out = cache_dir(package) / f"{package}-{version}"
    with _locked(package, version) as folder:
        wheel_file = _download(package, version, folder)
        digest = pinned(package, version)[wheel_file.name]
        stamp = out / UNPACKED_FROM
        if not (stamp.is_file() and stamp.read_text() == digest):
            partial = folder / f".{out.name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            with zipfile.ZipFile(wheel_file) as z:
                z.extractall(partial)
            (partial / UNPACKED_FROM).write_text(digest)
            if out.exists():
                old = folder / f".{out.name}.old"
                shutil.rmtree(old, ignore_errors=True)
                out.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            partial.rename(out)
    return out


# The SGLang releases the tests read that releases.json does not support (the patch tests check they are refused).
UNSUPPORTED_SGLANG = ("0.5.6.post2", "0.5.9")


def tier_releases() -> list[tuple[str, str]]:
    """(package, version) of every release the tier reads: SGLang's supported and refused ones, SpecForge's."""
    from eagle3_dagster import sglang_releases
    from tests.specforge_release import VERSION as SPECFORGE

    return [*(("sglang", v) for v in [*sglang_releases.supported(), *UNSUPPORTED_SGLANG]), ("specforge", SPECFORGE)]


def pin(package: str, version: str) -> dict[str, str]:
    """Add every wheel PyPI publishes for `package==version` to the table, with the sha256 its JSON API gives."""
    with urllib.request.urlopen(PYPI_JSON.format(package=package), timeout=60) as response:
        releases = json.load(response)["releases"]
    files = {
        u["filename"]: u["digests"]["sha256"]
        for u in releases.get(version, [])
        if u.get("packagetype") == "bdist_wheel"
    }
    if not files:
        raise WheelHashError(f"PyPI lists no wheel of {package}=={version}")
    table = json.loads(HASHES.read_text())
    table.setdefault(package, {})[version] = dict(sorted(files.items()))
    HASHES.write_text(json.dumps(table, indent=1) + "\n")
    return files


def main(argv: list[str]) -> int:
    if argv[:1] == ["pin"] and len(argv) == 3:
        for name, digest in pin(argv[1], argv[2]).items():
            print(digest, name)
        return 0
    if argv:
        print("usage: python -m tests.release_wheels [pin PACKAGE VERSION]", file=sys.stderr)
        return 2
    failed = []
    for package, version in tier_releases():
        try:
            print(unpacked(package, version) if package == "specforge" else wheel(package, version), flush=True)
        except RuntimeError as e:  # the test that reads it downloads it again, and fails naming why
            failed.append(f"{package}=={version}: {e}")
    print("\n".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
