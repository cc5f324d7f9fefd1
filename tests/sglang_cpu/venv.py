"""Build the venv of the real-SGLang test tier: SGLang's release wheel over the project's own packages.

`.cache/sglang-venv/<version>/` (gitignored) holds, in this order:
1. a venv of this interpreter's Python, without pip of its own (`--without-pip`): every install below runs
   this interpreter's pip with `--python <venv>`, under `-c constraints.txt`;
2. on its path, after its own site-packages, this interpreter's site-packages (`eagle3_1_base.pth`,
   `site.addsitedir`): the CPU torch 2.13.0, numpy, safetensors and this project (its editable install)
   come from there instead of a second multi-GB copy, as on a GPU host, where the project is installed
   into SGLang's interpreter. The venv's own site-packages come first on `sys.path`, so whatever SGLang pins
   differently (transformers, tokenizers, huggingface-hub, ...) is installed into the venv and wins;
   pip leaves the project's copies alone ("outside environment");
3. the runtime packages SGLang's server imports on CPU that the project's environment does not already
   satisfy (`requirements-<version>.txt`, pinned);
4. the release wheel itself (`tests/sglang_wheels.wheel_path`: `pip download --no-deps sglang==<version>`
   from PyPI, the cache the patch tests share), checked against the sha256 PyPI publishes for it
   (tests/release_hashes.json) before the venv is touched, and installed `--no-deps --require-hashes` (pip
   checks it again; its metadata pins CUDA-only packages: flashinfer, sglang-kernel, deep-gemm, ...).
   SGLang's code is the wheel's, byte for byte, but for
5. our patch `torch-native-mla-<version>.patch`, applied to the installed file and checked by sha256
   before and after (the project's strict applier: no fuzz, no offsets);
6. `site/` (our `sgl_kernel` CPU shim and torchvision import guard) on the path by `eagle3_0_cpu_shim.pth`.

A stamp file, written last, names a digest of everything above, the base environment's packages included;
a venv without it or with another digest is removed and rebuilt. A failed download or install raises:
the tier never skips. The production dump patch is not part of the build: the tier applies it to the venv
with `eagle3 patch apply --python` (`dump_patch`), as on a GPU host. `benchmarks/sglang_prefill.py` keeps a
second venv of the same release, built the same way under another name (`variant`), that stays pristine.

    python -m tests.sglang_cpu.venv 0.5.23 0.5.12    # build (or reuse) and print the interpreters
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CACHE = ROOT / ".cache" / "sglang-venv"
CONSTRAINTS = ROOT / "constraints.txt"
# The installed file each of our patches changes, with its pristine and patched sha256.
PATCHES = {
    "0.5.12": (
        "sglang/srt/models/deepseek_common/attention_backend_handler.py",
        "17f701c2e45c533e3b60dd0fb837c465c8b5011f0530cd8a2e1a916a42cd9275",
        "94fd327a53f022f439cdd3bffb358e1da3fca959df3c13e547868a461648c35a",
    ),
    "0.5.23": (
        "sglang/srt/models/deepseek_common/attention_backend_handler.py",
        "5c9786089d61e1ab70b11007e01f2c5c3cebd091034dcbff7a3411e61b4dc05a",
        "450e4ab324068af8f443e96452290211724a36131aa83896a6594bcb30595fec",
    ),
}
# What the tier's server runs with: SGLang's CPU engine (is_cpu() reads SGLANG_USE_CPU_ENGINE, which the
# project's launcher sets for `--device cpu`), the torch attention backend (no FlashInfer on CPU); the radix
# cache is off through the project's own extraction options.
# On CPU SGLang sizes its KV pool from free host memory (about 15 GB of this 24 GB machine for the tiny
# target), so the tier caps it; its tests prefill a few hundred tokens at a time. SGLang's scheduler
# watchdog kills the server when one forward takes over 300 s, which a loaded 2-core CI machine reached.
# `--sleep-on-idle`: an idle scheduler otherwise polls its sockets without pause, a whole core for as long as the
# server is up ("each GPU would otherwise pin one thread at 100% CPU usage", sglang/srt/managers/
# scheduler_components/idle_sleeper.py), which on this 2-core machine is half of it, taken from the test that is
# comparing the server's output and from the other worker; with it, the scheduler waits on its sockets.
SERVER_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--max-total-tokens",
    "4096",
    "--max-running-requests",
    "16",
    "--watchdog-timeout",
    "3600",
    "--sleep-on-idle",
)
# The model modules SGLang's server must import for the tier: the DeepSeek-V3 target, Kimi-K2.5's class
# around it, and the EAGLE-3 drafters (Llama's, and `Eagle3DeepseekV2ForCausalLM`, the MLA one). SGLang imports
# every module of `sglang.srt.models` at start-up to build its registry unless SGLANG_DISABLED_MODEL_ARCHS names
# it (`sglang/srt/models/registry.py`).
MODEL_MODULES = ("deepseek_v2", "kimi_k25", "llama", "llama_eagle3", "kimi_k25_eagle3")

# Bump when build() installs something differently; the digest covers the files it installs from.
RECIPE = 3

# SGLang's own pins that the venv does not meet on purpose. Every other package of its metadata that the venv
# can import must be at SGLang's pin (`unmet_release_pins`): one left unpinned in requirements-<version>.txt
# is taken from the project's environment or at pip's newest (kernels 0.19.1 with transformers 5.25 broke
# 0.5.12's import on 2026-12-03).
PIN_DEVIATIONS = {"torch": "the project's CPU build (constraints.txt) stands in for SGLang's CUDA one"}

# Run by the venv's interpreter: [name, version, SGLang's specifier, where] of each unmet pin.
_UNMET_PINS = """
import importlib.metadata as md, json
from packaging.requirements import Requirement
unmet = []
for line in md.distribution("sglang").requires or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra's, or another platform's
    try:
        dist = md.distribution(req.name)  # the first on sys.path: what an import finds
    except md.PackageNotFoundError:
        continue  # CUDA-only, or nothing the server imports on CPU
    if not req.specifier.contains(dist.version, prereleases=True):
        unmet.append([req.name, dist.version, str(req.specifier), str(dist.locate_file(""))])
print(json.dumps(unmet))
"""


def base_site_packages() -> Path:
    """This interpreter's site-packages: the project's environment the venv builds on."""
    return Path(sysconfig.get_paths()["purelib"])


def base_packages() -> list[str]:
    """The packages of the base site-packages the venv builds on, whatever else is on sys.path (an
    editable install's `*.egg-info` in the checkout is there under `python -m`, not under pytest)."""
    dists = importlib.metadata.distributions(path=[str(base_site_packages())])
    return sorted(f"{d.metadata['Name']}=={d.version}" for d in dists if d.metadata["Name"])


def inputs_digest(version: str) -> str:
    h = hashlib.sha256(f"{RECIPE}\n{version}\n{sys.version_info[:2]}\n{base_site_packages()}\n".encode())
    h.update("\n".join(base_packages()).encode())
    for path in (CONSTRAINTS, requirements(version), patch_file(version)):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def requirements(version: str) -> Path:
    return HERE / f"requirements-{version}.txt"


def patch_file(version: str) -> Path:
    return HERE / f"torch-native-mla-{version}.patch"


def venv_dir(version: str, variant: str = "") -> Path:
    return CACHE / (f"{version}-{variant}" if variant else version)


def _run(argv: list[str], what: str, log) -> None:
    started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(argv, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(
            f"SGLang CPU venv: {what} failed ({proc.returncode}):\n{(proc.stderr or proc.stdout)[-4000:]}"
        )
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    log(f"{what}: {time.monotonic() - started:.0f} s ({cpu:.0f} s CPU)")


def _pip(python: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check", "-q", *args]


def build(version: str, log=print, variant: str = "") -> Path:
    """The venv's interpreter, with SGLang `version` installed, patched for CPU and the shim on its path.

    `variant` names a second venv of the same release, built the same way beside the first."""
    from tests.release_wheels import hashed_requirement
    from tests.sglang_wheels import wheel_path

    if version not in PATCHES:
        raise ValueError(f"no CPU patch for SGLang {version} (have {sorted(PATCHES)})")
    target = venv_dir(version, variant)
    python = target / "bin" / "python"
    stamp = target / ".eagle3-stamp"
    digest = inputs_digest(version)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text() == digest and python.exists():
            return python
        started = time.monotonic()
        wheel = wheel_path(version)  # checked against PyPI's sha256 (a mismatch raises) before anything is removed
        shutil.rmtree(target, ignore_errors=True)
        _run([sys.executable, "-m", "venv", "--without-pip", str(target)], "venv", log)
        site = site_packages(python)
        if target not in site.parents:  # never write a .pth into another interpreter's site-packages
            raise RuntimeError(f"{site} is not inside the venv {target}")
        # Our shim first (its names must win), then the project's environment after the venv's own packages.
        (site / "eagle3_0_cpu_shim.pth").write_text(str(HERE / "site") + "\n")
        (site / "eagle3_1_base.pth").write_text(f"import site; site.addsitedir({str(base_site_packages())!r})\n")
        # Byte-compiled at install only where bytecode is never written (PYTHONDONTWRITEBYTECODE set): each of
        # the server's three processes would compile what it imports at every start. Elsewhere (scripts/test.sh)
        # the first process to import a module writes its bytecode and what no server imports is never compiled
        # (measured on this machine: both installs 88 s of CPU compiled, 30 s not).
        compile_flag = "--compile" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "--no-compile"
        constrained = ("-c", str(CONSTRAINTS), compile_flag)
        _run(_pip(python, "install", *constrained, "-r", str(requirements(version))), "runtime packages", log)
        hashed = target / "sglang-wheel.txt"  # pip's hash-checking mode: the file must have PyPI's sha256
        hashed.write_text(hashed_requirement("sglang", version, spec=str(wheel)) + "\n")
        _run(
            _pip(python, "install", *constrained, "--no-deps", "--require-hashes", "-r", str(hashed)),
            f"sglang {version} wheel",
            log,
        )
        apply_cpu_patch(version, python)
        if unmet := unmet_release_pins(python):
            raise RuntimeError(
                f"SGLang {version} CPU venv: packages it can import are not at SGLang's own pins; pin "
                f"them in {requirements(version)}: " + "; ".join(unmet)
            )
        stamp.write_text(digest)
        log(f"SGLang {version} CPU venv built in {time.monotonic() - started:.0f} s at {target}")
    return python


def unmet_release_pins(python: Path) -> list[str]:
    """Each package SGLang's metadata pins that the venv imports at another version (`PIN_DEVIATIONS` aside),
    with where it comes from."""
    from packaging.utils import canonicalize_name

    out = subprocess.run([str(python), "-c", _UNMET_PINS], capture_output=True, text=True, check=True).stdout
    return [
        f"{name} {version} from {where} (SGLang pins {spec})"
        for name, version, spec, where in json.loads(out)
        if canonicalize_name(name) not in PIN_DEVIATIONS
    ]


def dump_patch(python: Path, action: str) -> str:
    """`eagle3 patch {apply,revert,verify} --python <python>`: the production dump patch, as on a GPU host.
    Returns its output; raises when it fails (verify: when the release is not patched)."""
    eagle3 = Path(sys.executable).parent / "eagle3"
    proc = subprocess.run([str(eagle3), "patch", action, "--python", str(python)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"eagle3 patch {action} --python {python} exited {proc.returncode}: {proc.stdout}{proc.stderr}"
        )
    return proc.stdout.strip()


def site_packages(python: Path) -> Path:
    """The venv's own site-packages (made with this interpreter's Python, so laid out as its scheme says)."""
    venv = python.parent.parent
    return Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))


def disabled_model_archs(python: Path) -> str:
    """SGLANG_DISABLED_MODEL_ARCHS for the tier: every module of the release's `sglang/srt/models` but
    MODEL_MODULES, so that the server does not import some 200 model files it never builds."""
    models = site_packages(python) / "sglang" / "srt" / "models"
    names = sorted(p.stem for p in models.glob("*.py") if p.stem not in MODEL_MODULES and p.stem != "__init__")
    missing = [m for m in MODEL_MODULES if not (models / f"{m}.py").exists()]
    if missing:
        raise RuntimeError(f"{models}: no {missing}; the tier's model modules are not in this release")
    return ",".join(names)


def server_env(python: Path, *, cuda_sync: bool = False) -> dict[str, str]:
    """The environment the tier's servers get besides the launcher's own. `cuda_sync`: `cuda_sync/sitecustomize.py`
    on the path, for SGLang's MLA drafter class, which calls `torch.cuda.synchronize()` at start-up."""
    env = {"SGLANG_DISABLED_MODEL_ARCHS": disabled_model_archs(python)}
    return env | ({"PYTHONPATH": str(HERE / "cuda_sync")} if cuda_sync else {})


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
