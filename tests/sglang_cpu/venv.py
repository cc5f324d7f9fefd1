"""Build the venv of the real-SGLang test tier: a release wheel from PyPI, a CPU torch, our CPU shim.

`.cache/sglang-venv/<version>/` (gitignored) holds, in this order:
1. a venv of this interpreter's Python with the CPU torch (`-c constraints.txt torch==2.13.0`: every
   pip call passes the constraints; an unpinned torch would pull a multi-GB CUDA build);
2. the runtime packages SGLang's server imports on CPU (`requirements-<version>.txt`, pinned);
3. the release wheel itself, `pip download --no-deps --only-binary :all: sglang==<version>`, installed
   `--no-deps` (its metadata pins CUDA-only packages: flashinfer, sglang-kernel, deep-gemm, ...);
4. our patch `torch-native-mla-<version>.patch` applied to the installed wheel's file, checked by
   sha256 before and after (the project's strict applier: no fuzz, no offsets);
5. `site/` (our `sgl_kernel` stand-in and torchvision import guard) on the venv's path by a .pth;
6. this project, `pip install -e ".[gpu]"`, as on a GPU host (the patched SGLang imports its dump hook).

A stamp file, written last, names a digest of everything above; a venv without it or with another
digest is removed and rebuilt. A failed download or install raises: the tier never skips.

    python -m tests.sglang_cpu.venv 0.5.23    # build (or reuse) and print the interpreter
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CACHE = ROOT / ".cache" / "sglang-venv"
CONSTRAINTS = ROOT / "constraints.txt"
TORCH = "torch==2.13.0"
# The installed file each of our patches changes, with its pristine and patched sha256.
PATCHES = {
    "0.5.23": (
        "sglang/srt/models/deepseek_common/attention_backend_handler.py",
        "5c9786089d61e1ab70b11007e01f2c5c3cebd091034dcbff7a3411e61b4dc05a",
        "450e4ab324068af8f443e96452290211724a36131aa83896a6594bcb30595fec",
    ),
}
# What the tier's server runs with: SGLang's CPU engine (is_cpu() reads the variable), the torch attention
# backend (no FlashInfer on CPU); the radix cache is off through the project's own extraction options.
SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
# On CPU SGLang sizes its KV pool from free host memory (about 15 GB of this 24 GB machine for the tiny
# target), so the tier caps it; its tests prefill a few hundred tokens at a time. SGLang's scheduler
# watchdog kills the server when one forward takes over 300 s, which a loaded 2-core CI machine reached.
SERVER_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "4096",
               "--watchdog-timeout", "3600")


# Bump when build() installs something differently; the digest covers the files it installs from.
RECIPE = 1


def inputs_digest(version: str) -> str:
    h = hashlib.sha256(f"{RECIPE}\n{version}\n{TORCH}\n{sys.version_info[:2]}\n".encode())
    for path in (CONSTRAINTS, requirements(version), patch_file(version)):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def requirements(version: str) -> Path:
    return HERE / f"requirements-{version}.txt"


def patch_file(version: str) -> Path:
    return HERE / f"torch-native-mla-{version}.patch"


def venv_dir(version: str) -> Path:
    return CACHE / version


def _run(argv: list[str], what: str, log) -> None:
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"SGLang CPU venv: {what} failed ({proc.returncode}):\n{(proc.stderr or proc.stdout)[-4000:]}")
    log(f"{what}: {time.monotonic() - started:.0f} s")


def _pip(python: Path, *args: str) -> list[str]:
    return [str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args]


def build(version: str, log=print) -> Path:
    """The venv's interpreter, with SGLang `version` installed, patched for CPU and the shim on its path."""
    if version not in PATCHES:
        raise ValueError(f"no CPU patch for SGLang {version} (have {sorted(PATCHES)})")
    target = venv_dir(version)
    python = target / "bin" / "python"
    stamp = target / ".eagle3-stamp"
    digest = inputs_digest(version)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text() == digest and python.exists():
            return python
        started = time.monotonic()
        shutil.rmtree(target, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(target)], "venv", log)
        constrained = ("-c", str(CONSTRAINTS))
        _run(_pip(python, "install", *constrained, TORCH, "-r", str(requirements(version))), "torch and runtime packages", log)
        wheel = download_wheel(version, target / "wheel", python)
        # --no-compile: the wheel holds ~6,000 modules and the server imports a fraction of them
        _run(_pip(python, "install", *constrained, "--no-deps", "--no-compile", str(wheel)), f"sglang {version} wheel", log)
        apply_cpu_patch(version, python)
        (site_packages(python) / "eagle3_sglang_cpu.pth").write_text(str(HERE / "site") + "\n")
        _run(_pip(python, "install", *constrained, "-e", f"{ROOT}[gpu]"), "eagle3-dagster[gpu]", log)
        stamp.write_text(digest)
        log(f"SGLang {version} CPU venv built in {time.monotonic() - started:.0f} s at {target}")
    return python


def download_wheel(version: str, dest: Path, python: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    _run(_pip(python, "download", *("-c", str(CONSTRAINTS)), "--no-deps", "--only-binary", ":all:",
              f"sglang=={version}", "-d", str(dest)), f"download sglang=={version}", lambda _m: None)
    hits = sorted(dest.glob(f"sglang-{version}-*.whl"))
    if not hits:
        raise RuntimeError(f"pip download sglang=={version} left no wheel in {dest}")
    return hits[0]


def site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def apply_cpu_patch(version: str, python: Path) -> Path:
    """Our one-line CPU patch on the installed release file; refuses a file that is not the release's."""
    from eagle3_dagster.io import atomic_write_bytes
    from eagle3_dagster.sglang.patch import apply_unified_diff

    relpath, pristine, patched = PATCHES[version]
    path = site_packages(python) / relpath
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest == patched:
        return path
    if digest != pristine:
        raise RuntimeError(f"{path}: not SGLang {version}'s file (sha256 {digest}); refusing to patch it")
    result = apply_unified_diff(data.decode(), patch_file(version).read_text()).encode()
    if hashlib.sha256(result).hexdigest() != patched:
        raise RuntimeError(f"{patch_file(version)} did not give the expected file for SGLang {version}")
    atomic_write_bytes(path, result)
    os.chmod(path, 0o644)
    return path


if __name__ == "__main__":
    for v in sys.argv[1:]:
        print(build(v, log=lambda m: print(m, file=sys.stderr)))
