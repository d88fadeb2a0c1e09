"""The import graph of the two packages reads one way: no circles (no module reaches itself again
through its imports), and nothing in jacobi_ext, the package users import, imports from
python_training, the training folder that builds on it. Drawn from the sources with ``ast``,
imports inside functions included (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jacobi_ext", "python_training")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The module ``name`` is, or the package it lies in (the longest prefix that is one)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in mods:
            return ".".join(parts[:k])
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the two packages it imports."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                edges.update(_resolve(a.name, mods) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for a in node.names:  # `from pkg import module` names the module itself
                    sub = f"{base}.{a.name}"
                    if sub in mods:
                        edges.add(sub)
                    elif node.level and not node.module:
                        # `from . import X` names a sibling module: one that is not a source
                        # file (the compiled _C, the generated _build_info) is outside the graph.
                        continue
                    else:
                        edges.add(_resolve(base, mods))
        graph[mod] = {e for e in edges if e is not None and e != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_drawn():
    g = import_graph()
    assert "jacobi_ext.apps.cli_args" in g["jacobi_ext.apps.cli"]  # a top-level import
    assert "jacobi_ext.apps.demo" in g["jacobi_ext.apps.cli"]  # an import inside a function
    assert "jacobi_ext.apps.cli_args" in g["python_training.cli"]
    # a relative import
    assert "jacobi_ext.kernels._attn_streams" in g["jacobi_ext.kernels.attention"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_circles():
    assert circles(import_graph()) == []


def test_jacobi_ext_imports_nothing_from_python_training():
    up = {
        (m, t)
        for m, targets in import_graph().items()
        if m.split(".")[0] == "jacobi_ext"
        for t in targets
        if t.split(".")[0] == "python_training"
    }
    assert up == set(), "python_training adds its commands through an entry point (pyproject)"
