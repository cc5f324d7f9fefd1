"""`pip install -e ".[gpu]"` into SGLang's environment keeps every package SGLang pins.

The GPU host runs the engine inside SGLang's own interpreter. pip keeps an installed
package when it satisfies every requirement naming it, so the `.[gpu]` install is safe
exactly when each requirement of its closure that a release also pins (`==`) admits the
release's pinned version. The closure is this project's base dependencies plus the `gpu`
extra (self-referencing extras followed), and then the requirements of those
distributions as installed here (an approximation: pip on the host may pick other
versions of them). Pins come from each supported release's wheel METADATA.

The second half keeps the closure honest the other way round: it must name exactly the
third-party distributions the modules that run on the GPU host import, so nothing the
host does not need (dagster, transformers, datasets) can replace a pin there, and nothing
it needs is missing.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sglang_wheels

pytestmark = pytest.mark.slow  # every supported SGLang release's metadata

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "eagle3-dagster"
# Every release the patches support: the first that serves Kimi-K2.5 with EAGLE-3 (0.5.10) through 0.5.23.
SUPPORTED = [
    "0.5.10",
    "0.5.10.post1",
    "0.5.11",
    "0.5.12",
    "0.5.12.post1",
    "0.5.13",
    "0.5.13.post1",
    "0.5.14",
    "0.5.15",
    "0.5.15.post1",
    *(f"0.5.{m}" for m in range(16, 24)),
]
# What runs on the GPU host: the dump hook inside SGLang, the extraction driver, the served-benchmark
# client, and the torchrun worker (through the Pipes child). The argv that start them name these modules.
GPU_HOST_MODULES = [
    "eagle3_dagster.sglang.dump_hook",
    "eagle3_dagster.sglang.driver",
    "eagle3_dagster.bench.served",
    "eagle3_dagster.train.worker",
    "resources.pipes_child",
]
# Provided by the host itself: SGLang is the environment, and it brings its own CUDA torch.
HOST_PROVIDED = {"sglang"}
# Loaded by name rather than imported: fsspec imports the implementation of a URL's protocol when one is
# used, s3fs for s3:// (the SGLang driver uploads shards from the GPU host when hidden.root is on S3).
LOADED_BY = {"fsspec": ["s3fs"]}
# The GPU host is Linux x86_64 whatever machine runs the test; extras of SGLang are not installed.
HOST_ENV = default_environment() | {
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "extra": "",
}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def gpu_closure(pins: dict[str, str]) -> list[tuple[Requirement, str]]:
    """(requirement, who requires it) for everything `pip install -e ".[gpu]"` asks for.

    A pinned distribution's own requirements are not followed: the host keeps the pinned
    version, whose requirements SGLang's install already satisfied (the version installed
    here would say something else).
    """
    project = _pyproject()
    extras = project["optional-dependencies"]
    out: list[tuple[Requirement, str]] = []
    todo = [(Requirement(r), PROJECT) for r in project["dependencies"]]
    todo += [(Requirement(r), f"{PROJECT}[gpu]") for r in extras["gpu"]]
    seen_extras, seen_dists = {"gpu"}, set()
    while todo:
        req, by = todo.pop()
        if req.marker is not None and not req.marker.evaluate(HOST_ENV):
            continue
        name = canonicalize_name(req.name)
        if name == PROJECT:  # a self-referencing extra: follow it
            for extra in req.extras - seen_extras:
                seen_extras.add(extra)
                todo += [(Requirement(r), f"{PROJECT}[{extra}]") for r in extras[extra]]
            continue
        out.append((req, by))
        if name in seen_dists or name in pins:
            continue
        seen_dists.add(name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        for sub in dist.requires or []:
            sub_req = Requirement(sub)
            env = HOST_ENV | {"extra": next(iter(req.extras), "")}
            if sub_req.marker is None or sub_req.marker.evaluate(env):
                todo.append((Requirement(str(sub_req).split(";")[0]), f"{dist.name} {dist.version}"))
    return out


def release_pins(version: str) -> dict[str, str]:
    """{canonical name: pinned version} for the release's `==` requirements that apply on the host."""
    with zipfile.ZipFile(sglang_wheels.wheel_path(version)) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    pins = {}
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(HOST_ENV):
            continue
        exact = [s.version for s in req.specifier if s.operator in ("==", "===") and "*" not in s.version]
        if exact:
            pins[canonicalize_name(req.name)] = exact[0]
    return pins


@pytest.mark.parametrize("version", SUPPORTED)
def test_gpu_install_keeps_every_package_the_release_pins(version):
    pins = release_pins(version)
    assert "torch" in pins, f"sglang {version}: no torch pin read from METADATA; the parser is wrong"
    broken = []
    for req, by in gpu_closure(pins):
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is not None and not req.specifier.contains(pinned, prereleases=True):
            broken.append(f"{by} requires {req}, sglang {version} pins {req.name}=={pinned}")
    assert not broken, "pip install -e '.[gpu]' would replace SGLang's pinned packages:\n" + "\n".join(broken)


def _module_file(module: str) -> Path | None:
    path = ROOT / Path(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(tree: ast.Module, module: str, *, everywhere: bool) -> set[str]:
    """Absolute module names imported at module level (everywhere=True: also inside functions)."""
    nodes = ast.walk(tree) if everywhere else _module_level(tree.body)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import submodule`
    return names


def _module_level(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _module_level(getattr(node, field, []) or [])


def gpu_host_imports() -> dict[str, str]:
    """{top-level third-party package: first module importing it} over what the GPU-host modules load.

    Entry modules count every import (a function-level one runs when that entry point does, e.g.
    the worker's matplotlib plot); the project modules they pull in count module-level imports only
    (a function-level import there belongs to a path the GPU host does not take).
    """
    own = {"eagle3_dagster", "resources"}
    found: dict[str, str] = {}
    seen: set[tuple[str, bool]] = set()
    todo = [(m, True) for m in GPU_HOST_MODULES]
    while todo:
        module, entry = todo.pop()
        if (module, entry) in seen or (module, True) in seen:
            continue
        seen.add((module, entry))
        file = _module_file(module)
        if file is None:
            continue
        parts = module.split(".")
        parents = [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b.c runs a and a.b first
        todo += [(p, False) for p in parents]
        for name in _imports(ast.parse(file.read_text()), module, everywhere=entry):
            top = name.split(".")[0]
            if top in own:
                todo.append((name, False))
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, module)
    return found


def test_gpu_install_names_exactly_what_the_gpu_host_modules_import():
    packages = md.packages_distributions()
    needed = {}
    for top, module in gpu_host_imports().items():
        if top in HOST_PROVIDED:
            continue
        assert top in packages, f"{module} imports {top}, which no installed distribution provides"
        needed[canonicalize_name(packages[top][0])] = f"{top} (imported by {module})"
        for loaded in LOADED_BY.get(top, []):
            needed[canonicalize_name(packages[loaded][0])] = f"{loaded} (loaded by {top}, imported by {module})"
    project = _pyproject()
    direct = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["gpu"]]
    declared = {canonicalize_name(r.name) for r in direct if canonicalize_name(r.name) != PROJECT}
    missing = sorted(f"{name}: {why}" for name, why in needed.items() if name not in declared)
    unneeded = sorted(declared - set(needed))
    assert not missing, f"the GPU host would lack: {missing}"
    assert not unneeded, (
        f"base dependencies + [gpu] name {unneeded}, which no GPU-host module imports; "
        "they belong in the [pipeline] extra, where they cannot replace SGLang's pins"
    )
