"""The house's import structure, read from the sources (no import): no module of the arfuse package
imports, at module level or inside a function, a module that imports it back, directly or
through others; and every module says what it is for in its first line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "arfuse"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The arfuse modules `name` imports anywhere in its source. `from P import X` counts as an
    import of P.X where that is a module, else of P; relative imports are resolved."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base[: len(base) - (node.level - 1)]
                mod = ".".join(pkg + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "arfuse":
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in known:
                    out.add(sub)
                elif mod in known:
                    out.add(mod)
    out.discard(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {n: imports_of(n, p, set(mods)) for n, p in mods.items()}


def test_the_import_graph_is_read():
    g = graph()
    assert "arfuse.vllm.contract" in g["arfuse.vllm.contract.installed"]
    assert "arfuse.vllm.contract.source" in g["arfuse.vllm.contract.installed"]
    assert "arfuse.bench.impls" in g["arfuse.bench.run"]
    assert "arfuse._vocab" in g["arfuse.bench.group"]  # `from .. import _vocab`


def test_no_import_circle():
    assert cycles(graph()) == []


def test_the_circle_check_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_states_its_job_first():
    silent = []
    for name, path in modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if path.name == "__main__.py":
            continue
        if not doc or len(doc.split("\n")[0].split()) < 4:
            silent.append(name)
    assert not silent, "no docstring whose first line says what the module is for: " + ", ".join(silent)
