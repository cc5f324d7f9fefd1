"""The engine never imports Dagster: it also runs inside SGLang and torchrun workers."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
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


def test_the_code_location_uses_only_dagsters_public_api() -> None:
    """`dagster._*` modules are private and move between releases; the assets, resources and definitions use
    what `dagster` exports (private imports broke on upgrades before: four of them in automation and resources)."""
    offenders = []
    for path in [*ROOT.glob("assets/*.py"), *ROOT.glob("resources/*.py"), ROOT / "definitions.py"]:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else []
            )
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno} {n}"
                for n in names
                if n.split(".")[0] == "dagster" and any(p.startswith("_") for p in n.split(".")[1:])
            ]
    assert offenders == []


# A module of the code location, named in a string: `-m resources.pipes_child`, importlib, runpy.
CODE_LOCATION_MODULE = re.compile(r"(assets|resources|definitions)(\.[A-Za-z_]\w*)*")


def test_no_engine_string_names_a_module_of_the_code_location() -> None:
    """An import the test above sees; a module named in a string (a torchrun worker, an importlib path) it
    does not, yet it binds the engine to the Dagster layer all the same: the layer above passes such a name
    down (prepare_training's `worker`). A whole literal naming one, or a dotted word in a longer one, fails."""
    offenders = []
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            words = [w.strip("`'\"(),:;") for w in node.value.split()]
            if CODE_LOCATION_MODULE.fullmatch(node.value.strip()) or any(
                "." in w and CODE_LOCATION_MODULE.fullmatch(w) for w in words
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value[:80]!r}")
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


def _imports(path: Path) -> set[str]:
    """eagle3_dagster modules a file imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in out if n.startswith("eagle3_dagster")}


def _module_graph() -> dict[str, set[str]]:
    modules = {}
    for path in ENGINE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = path
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_stages_depend_on_the_engine_not_on_each_other() -> None:
    graph = _module_graph()
    stage_modules = [m for m in graph if m.startswith("eagle3_dagster.stages.")]
    crossing = {m: sorted(d for d in graph[m] if d.startswith("eagle3_dagster.stages.")) for m in stage_modules}
    assert {m: d for m, d in crossing.items() if d} == {}
    engine = [m for m in graph if not m.startswith(("eagle3_dagster.stages", "eagle3_dagster.cli"))]
    assert {
        m: sorted(d for d in graph[m] if d.startswith("eagle3_dagster.stages"))
        for m in engine
        if any(d.startswith("eagle3_dagster.stages") for d in graph[m])
    } == {}


def test_no_import_cycle_in_the_engine() -> None:
    graph = _module_graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if d.startswith(m + "."):
                continue  # a package importing its own submodule is not a cycle
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d] if d in stack else [m, d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_hidden_states_steps_and_the_shard_format_import_no_torch() -> None:
    """What a hidden_states step imports around a driver on another host (manifests, sizes, checksums), the
    training schedule extraction_plan reports, and the definitions the run worker loads keep torch out: its
    import is ~2 s of CPU in every such run."""
    probe = textwrap.dedent("""
        import sys, types
        import definitions, eagle3_dagster.hidden.shards
        from eagle3_dagster.config import load_profile
        from eagle3_dagster.hidden.sharding import ShardSpec
        from eagle3_dagster.stages.hidden import training_schedule
        shard = ShardSpec("shard-00000", 0, 0, 40, 4000, 0, tuple(f"s{i}" for i in range(40)), (100,) * 40)
        schedule = training_schedule(load_profile("micro").train, types.SimpleNamespace(shards=[shard]))
        assert schedule.num_train_samples + schedule.num_heldout_samples == 40 and schedule.total_steps > 0
        print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))
    """)
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "EAGLE3_PROFILE": "micro"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
