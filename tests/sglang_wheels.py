"""Real SGLang release files for tests, fetched once from PyPI and cached.

`pip download --no-deps sglang==X` into `.cache/sglang-wheels/` (gitignored), checked against the sha256
PyPI publishes for it (tests/release_hashes.json, `tests.release_wheels.verify`);
from each wheel only `sglang/srt/models/deepseek_v2.py` and the dist-info
METADATA (its version) are extracted. A failed download is an error, never a
skip: the patch tests are only worth something against the real files.

`make_site(version, root)` lays those out as an importable-looking site folder
(`sglang/__init__.py` is empty; nothing of SGLang is ever imported) and returns
a wrapper interpreter whose `importlib` finds that SGLang, which is exactly what
`eagle3_dagster.sglang.patch` asks an interpreter.

    python -m tests.sglang_wheels 0.5.9   # fetch one into the cache
"""

from __future__ import annotations

import ast
import stat
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional

from tests.release_wheels import wheel

MODEL_FILE = "sglang/srt/models/deepseek_v2.py"


def wheel_path(version: str) -> Path:
    """The cached wheel of `sglang==version`, downloading it if needed."""
    return wheel("sglang", version)


def read_model_file(version: str) -> bytes:
    with zipfile.ZipFile(wheel_path(version)) as z:
        return z.read(MODEL_FILE)


def read_file(version: str, relpath: str) -> str | None:
    """A source file of the release (`sglang/...`), or None when the release has no such file."""
    with zipfile.ZipFile(wheel_path(version)) as z:
        try:
            return z.read(relpath).decode()
        except KeyError:
            return None


def find_method(source: str, class_name: str, method: str) -> ast.FunctionDef | None:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return item
    return None


def run_set_eagle3_layers_to_capture(source: str, class_name: str, layer_ids, num_layers: int = 61):
    """Run the release's own `set_eagle3_layers_to_capture` (plain Python) on a model-shaped object;
    returns the `layers_to_capture` it sets."""
    fn = find_method(source, class_name, "set_eagle3_layers_to_capture")
    if fn is None:
        raise LookupError(f"{class_name} has no set_eagle3_layers_to_capture")
    module = ast.Module(body=[fn], type_ignores=[])
    namespace = {"Optional": Optional, "List": List}
    exec(compile(module, f"<{class_name}.set_eagle3_layers_to_capture>", "exec"), namespace)
    model = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(num_hidden_layers=num_layers),
        model=SimpleNamespace(layers_to_capture=[]),
        capture_aux_hidden_states=False,
    )
    namespace["set_eagle3_layers_to_capture"](model, layer_ids)
    return list(model.model.layers_to_capture)


def make_site(version: str, root: Path, extra_paths: tuple[Path, ...] = ()) -> Path:
    """Lay out the release's deepseek_v2.py under `root/site`; return a wrapper interpreter for it."""
    site = root / "site"
    with zipfile.ZipFile(wheel_path(version)) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for name in (MODEL_FILE, meta):
            dest = site / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(z.read(name))
    (site / "sglang" / "__init__.py").write_text("")
    python = root / "python"
    path = ":".join(str(p) for p in (site, *extra_paths))
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{path}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


if __name__ == "__main__":
    for v in sys.argv[1:]:
        print(wheel_path(v))
