"""The engine's packages form layers: no import cycle between them, counting modules named in strings.

test_architecture.py checks modules; a cycle between packages hides from it when the modules on the way differ
(config -> sglang.releases, sglang.driver -> hidden.context, hidden.context -> config once closed one), so here
the unit is a package of eagle3_dagster (`hidden`, `sglang`, ...) or a top-level module (`config`, `contracts`).
An import inside a function or under TYPE_CHECKING counts: it is a dependency all the same. So does a module
named in a string that is run or imported by name (`python -m eagle3_dagster.hidden.hf_driver` in an argv,
an importlib path): such a name must also name a module that exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "eagle3_dagster"
# A module (or a name in one) of the engine, written out in a string: `eagle3_dagster.train.worker.main`.
ENGINE_NAME = re.compile(r"(?<![\w.])eagle3_dagster(?:\.[A-Za-z_]\w*)+")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ENGINE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    return out


MODULES = _modules()


def _package(module: str) -> str:
    """The unit the layers are made of: eagle3_dagster.hidden.plan -> eagle3_dagster.hidden."""
    return ".".join(module.split(".")[:2])


def _module_of(name: str) -> str | None:
    """The longest prefix of a dotted name that is an engine module."""
    parts = name.split(".")
    return next((m for i in range(len(parts), 0, -1) if (m := ".".join(parts[:i])) in MODULES), None)


def _top_level_names(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for n in tree.body:
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
    submodules = {
        m.rsplit(".", 1)[1] for m in MODULES if m.startswith(module + ".") and m.count(".") == module.count(".") + 1
    }
    return names | submodules


def _strings(tree: ast.AST) -> list[ast.Constant]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _dependencies(path: Path) -> list[tuple[int, str]]:
    """(line, engine module) for each import of the file, and each string that is a module name run or
    imported by name: the whole string (`"eagle3_dagster.sglang.driver"` in an argv, an importlib path) or
    the module of a `-m` in it (`"python -m eagle3_dagster.train"`)."""
    out = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    for node in _strings(tree):
        text = node.value.strip()
        named = [text] if ENGINE_NAME.fullmatch(text) else re.findall(r"-m\s+(eagle3_dagster[\w.]*)", text)
        out += [(node.lineno, n) for n in named]
    return [(line, m) for line, name in out if (m := _module_of(name)) is not None]


def _package_graph(sources: dict[str, Path]) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> where, for each dependency between two packages."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in sources.items():
        for line, dep in _dependencies(path):
            if _package(dep) != _package(module):
                edges.setdefault((_package(module), _package(dep)), []).append(f"{module}:{line} -> {dep}")
    return edges


def _cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one package (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            groups.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [g for g in groups if len(g) > 1]


def test_no_import_cycle_between_the_engines_packages() -> None:
    edges = _package_graph(MODULES)
    cycles = _cycles(edges)
    where = {
        " <-> ".join(c): [w for (a, b), ws in sorted(edges.items()) if a in c and b in c for w in ws] for c in cycles
    }
    assert where == {}


def test_a_cycle_through_a_function_level_import_or_an_argv_string_is_found(tmp_path) -> None:
    """The check itself: two packages that reach each other through a lazy import and a `-m` in an argv."""
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from eagle3_dagster.hidden.shards import ShardFormat\n")
    argv = tmp_path / "argv.py"
    argv.write_text("ARGV = ['python', '-m', 'eagle3_dagster.config']\n")
    command = tmp_path / "command.py"
    command.write_text("CMD = 'python -m eagle3_dagster.config --help'\n")
    for runs_config in (argv, command):
        graph = _package_graph({"eagle3_dagster.config": lazy, "eagle3_dagster.hidden.x": runs_config})
        assert _cycles(graph) == [["eagle3_dagster.config", "eagle3_dagster.hidden"]]
    assert _cycles(_package_graph({"eagle3_dagster.config": lazy})) == []


def test_every_engine_module_named_in_a_string_exists() -> None:
    """A module run (`-m`), imported or patched by name, or named in a docstring, must exist, and a name after
    it must be defined there: a rename that leaves the old name in a string breaks only at run time (on a GPU
    host, for a driver) or misleads the reader."""
    sources = [
        *ENGINE.rglob("*.py"),
        *ROOT.glob("assets/*.py"),
        *ROOT.glob("resources/*.py"),
        ROOT / "definitions.py",
        *ROOT.glob("scripts/*.py"),
    ]
    missing = []
    for path in sources:
        for node in _strings(ast.parse(path.read_text(), filename=str(path))):
            for name in ENGINE_NAME.findall(node.value):
                module = _module_of(name)
                rest = name[len(module) + 1 :].split(".") if module and name != module else []
                if module is None or (rest and rest[0] not in _top_level_names(module)):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert missing == []
