"""The engine never imports Dagster: it also runs inside SGLang and torchrun workers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "eagle3_dagster"


def test_no_engine_module_imports_dagster() -> None:
    offenders = []
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "dagster"]
    assert offenders == []


BLOCK_DAGSTER = """
import importlib.abc, pkgutil, sys, importlib
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "dagster" or name.startswith("dagster."):
            raise ImportError("dagster is blocked in this test")
sys.meta_path.insert(0, Block())
import eagle3_dagster
for mod in pkgutil.walk_packages(eagle3_dagster.__path__, "eagle3_dagster."):
    if mod.name.endswith("__main__"):
        continue
    importlib.import_module(mod.name)
print("imported", len(list(pkgutil.walk_packages(eagle3_dagster.__path__))))
"""


def test_every_engine_module_imports_with_dagster_unavailable() -> None:
    out = subprocess.run([sys.executable, "-c", BLOCK_DAGSTER], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "imported" in out.stdout
