"""The release wheels the tests read and install are the ones PyPI published: each is pinned by name and sha256
in tests/release_hashes.json, checked when the cache hands it out and on download (pip's `--require-hashes`),
and installed into the SGLang venv in pip's hash-checking mode. Before, any file in the cache matching
`<package>-<version>-*.whl` was read, unpacked and installed unverified.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path

import pytest

from tests import release_wheels
from tests.sglang_cpu import venv

# The refusal's type on the new code; on the old code nothing was refused, and the tests fail on what came back.
WheelHashError = getattr(release_wheels, "WheelHashError", RuntimeError)
TABLE = Path(__file__).resolve().parents[1] / "release_hashes.json"
PINNED_10 = "ac8855a5d57dac8831fee526bca5212f1ae451f378e2ab08b3baecbc4deb4076"  # PyPI's sglang-0.5.10 wheel


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty wheel cache, and pip pointed at `tmp_path/links` only (no index): nothing is fetched from PyPI."""
    monkeypatch.setattr(release_wheels, "cache_dir", lambda package: tmp_path / f"{package}-wheels")
    (tmp_path / "links").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    return tmp_path


def _fake_wheel(path: Path, text: str = "print('not the release')\n") -> Path:
    """A well-formed wheel under the release's name (pip takes it) whose code is not the release's."""
    name, version = path.name.split("-")[:2]
    info = f"{name}-{version}.dist-info"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", text)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_release_the_tier_reads_has_pypis_hashes_pinned_and_every_cached_wheel_matches():
    table = json.loads(TABLE.read_text())
    for package, version in release_wheels.tier_releases():
        files = table[package][version]
        assert files and all(
            name.startswith(f"{package}-{version}-") and name.endswith(".whl") and re.fullmatch(r"[0-9a-f]{64}", digest)
            for name, digest in files.items()
        ), (package, version)
    cached = [
        (p, v)
        for p, v in release_wheels.tier_releases()
        for f in release_wheels.cache_dir(p).glob(f"{p}-{v}-*.whl")
        if f.name in table[p][v]
    ]
    for package, version in cached:  # computed from the wheels already fetched: the pins are PyPI's
        release_wheels.wheel(package, version)


def test_a_tampered_wheel_in_the_cache_is_refused_naming_the_file_and_both_hashes(cache):
    bad = _fake_wheel(cache / "sglang-wheels" / "sglang-0.5.10-py3-none-any.whl")
    with pytest.raises(WheelHashError) as refused:
        got = release_wheels.wheel("sglang", "0.5.10")
        pytest.fail(f"handed out {got}")
    said = str(refused.value)
    assert str(bad) in said and _sha(bad) in said and PINNED_10 in said


def test_a_cached_file_pypi_never_published_for_the_release_is_not_taken(cache):
    """`sglang-0.5.10-*.whl` also matches a name PyPI has no wheel under; the cache took the first such file."""
    evil = _fake_wheel(cache / "sglang-wheels" / "sglang-0.5.10-0evil-py3-none-any.whl")
    try:
        got = release_wheels.wheel("sglang", "0.5.10")
    except RuntimeError as e:  # nothing to download from here: the real wheel is fetched, or nothing
        assert str(evil) not in str(e)
    else:
        assert got != evil and _sha(got) == PINNED_10


def test_a_download_whose_bytes_are_not_pypis_is_refused_and_never_lands_in_the_cache(cache):
    offered = _fake_wheel(cache / "links" / "sglang-0.5.10-py3-none-any.whl")  # what a mirror or index offers
    with pytest.raises(RuntimeError) as refused:
        got = release_wheels.wheel("sglang", "0.5.10")
        pytest.fail(f"downloaded {got}")
    said = str(refused.value)
    assert PINNED_10 in said and _sha(offered) in said  # pip's hash check: expected and got
    assert not list((cache / "sglang-wheels").glob("*.whl"))


def test_a_release_without_a_pinned_hash_is_refused_before_any_download(cache):
    with pytest.raises(WheelHashError, match=r"no sha256 pinned for sglang==0\.0\.1.*release_wheels pin"):
        release_wheels.wheel("sglang", "0.0.1")


def test_an_unpacked_release_not_from_the_checked_wheel_is_unpacked_again(cache):
    source = Path(release_wheels.ROOT) / ".cache" / "specforge-wheels" / "specforge-0.2.0-py3-none-any.whl"
    if not source.exists():
        pytest.skip("specforge 0.2.0 is not in the real cache")  # the tier fetches it; nothing is downloaded here
    folder = cache / "specforge-wheels"
    folder.mkdir()
    (folder / source.name).write_bytes(source.read_bytes())
    planted = folder / "specforge-0.2.0" / "specforge" / "__init__.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("raise SystemExit('planted')\n")
    out = release_wheels.unpacked("specforge", "0.2.0")
    assert "planted" not in planted.read_text()
    with zipfile.ZipFile(source) as z:
        assert planted.read_bytes() == z.read("specforge/__init__.py")
    (folder / source.name).write_bytes(source.read_bytes() + b"x")  # the wheel itself tampered with
    with pytest.raises(WheelHashError, match=re.escape(str(folder / source.name))):
        release_wheels.unpacked("specforge", "0.2.0")
    assert out.exists()


@pytest.fixture
def venv_cache(tmp_path, monkeypatch, cache):
    """The SGLang venv builder on temp folders with its steps recorded, not run; a stale venv already there."""
    monkeypatch.setattr(venv, "CACHE", tmp_path / "venvs")
    steps: list[list[str]] = []

    def run(argv, what, log):
        steps.append(list(argv))
        if what == "venv":  # what `python -m venv` leaves that the build writes into
            venv.site_packages(Path(argv[-1]) / "bin" / "python").mkdir(parents=True)

    monkeypatch.setattr(venv, "_run", run)
    monkeypatch.setattr(venv, "apply_cpu_patch", lambda version, python: None)
    monkeypatch.setattr(venv, "unmet_release_pins", lambda python: [])
    old = venv.venv_dir("0.5.23")
    (old / "bin").mkdir(parents=True)
    (old / "bin" / "python").write_text("")
    (old / "kept.txt").write_text("the venv in use")
    return steps


def test_the_sglang_venv_refuses_a_tampered_wheel_before_it_touches_the_venv(venv_cache, cache):
    bad = _fake_wheel(cache / "sglang-wheels" / "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl")
    pinned = json.loads(TABLE.read_text())["sglang"]["0.5.23"][bad.name]
    with pytest.raises(Exception) as refused:
        venv.build("0.5.23", log=lambda _m: None)
    said = str(refused.value)
    assert str(bad) in said and _sha(bad) in said and pinned in said, said
    assert venv_cache == [] and (venv.venv_dir("0.5.23") / "kept.txt").exists()


def test_the_sglang_venv_installs_the_wheel_in_pips_hash_checking_mode(venv_cache, cache, monkeypatch):
    wheel = _fake_wheel(cache / "sglang-wheels" / "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl", "ok\n")
    table = cache / "hashes.json"
    table.write_text(json.dumps({"sglang": {"0.5.23": {wheel.name: _sha(wheel)}}}))
    monkeypatch.setattr(release_wheels, "HASHES", table)
    venv.build("0.5.23", log=lambda _m: None)
    (install,) = [argv for argv in venv_cache if "--no-deps" in argv]
    assert "--require-hashes" in install
    requirement = Path(install[install.index("-r") + 1]).read_text().split()
    assert requirement == [str(wheel), f"--hash=sha256:{_sha(wheel)}"]
