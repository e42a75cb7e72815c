"""The contract against vLLM's Python sources, read without importing them (AST): the check of one item
over a Source (a folder holding the `vllm` package: an installed vLLM; scripts/vllm_contract.py
adds a wheel's zip).

Names are resolved the way Python would find them: a module's own definitions, then `from X import Y`
re-exports (relative or absolute, followed through vLLM's packages), then for classes the class
body, `self.X = ...` in its methods and its bases. Standard library only.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from typing import Any

from . import Result


class Source:
    def read(self, path: str) -> str | None:
        raise NotImplementedError

    def binaries(self) -> list[str]:
        """The paths of vLLM's kernel libraries (vllm/_C*.so)."""
        raise NotImplementedError

    def read_bytes(self, path: str) -> bytes:
        raise NotImplementedError


class DirSource(Source):
    """`root` holds the `vllm` package folder (site-packages)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def read(self, path: str) -> str | None:
        try:
            with open(os.path.join(self.root, path), encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return None

    def binaries(self) -> list[str]:
        folder = os.path.join(self.root, "vllm")
        try:
            names = os.listdir(folder)
        except OSError:
            return []
        return sorted(f"vllm/{n}" for n in names if n.startswith("_C") and n.endswith(".so"))

    def read_bytes(self, path: str) -> bytes:
        with open(os.path.join(self.root, path), "rb") as f:
            return f.read()


@dataclass
class Module:
    name: str
    path: str
    tree: ast.Module
    is_package: bool


class Index:
    """Parsed modules of one vLLM source tree, by module name (cached)."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self._modules: dict[str, Module | None] = {}

    def module(self, name: str) -> Module | None:
        if name not in self._modules:
            self._modules[name] = self._load(name)
        return self._modules[name]

    def _load(self, name: str) -> Module | None:
        base = name.replace(".", "/")
        for path, pkg in ((base + ".py", False), (base + "/__init__.py", True)):
            text = self.source.read(path)
            if text is not None:
                return Module(name, path, ast.parse(text, filename=path), pkg)
        return None

    # ---- names ---------------------------------------------------------------------------------

    def top(self, mod: Module, name: str, depth: int = 0) -> tuple[Module, ast.AST] | None:
        """The definition of top-level `name` in `mod`, following imports. For a submodule
        (`from . import x` or a package's child) the result is (submodule, its ast.Module)."""
        if depth > 8:
            return None
        found: ast.AST | None = None
        for node in mod.tree.body:
            for n in _defined(node, name):
                found = n  # the last definition wins, as at run time
        if isinstance(found, (ast.ImportFrom, ast.Import)):
            target = _import_target(mod, found, name)
            if target is not None:
                src_mod, src_name = target
                m = self.module(src_mod)
                if m is None:
                    return None
                if src_name is None:
                    return m, m.tree
                res = self.top(m, src_name, depth + 1)
                if res is None and m.is_package:
                    sub = self.module(f"{src_mod}.{src_name}")
                    if sub is not None:
                        return sub, sub.tree
                return res
            return None
        if found is not None:
            return mod, found
        for node in mod.tree.body:  # `from X import *` (vllm.distributed re-exports this way)
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                target = _import_target(mod, node, "*")
                m = self.module(target[0]) if target else None
                res = self.top(m, name, depth + 1) if m is not None else None
                if res is not None:
                    return res
        if mod.is_package:
            sub = self.module(f"{mod.name}.{name}")
            if sub is not None:
                return sub, sub.tree
        # `__getattr__`-based lazy exports: a dict literal {"Name": "module"} in the module
        lazy = _lazy_export(mod, name)
        if lazy is not None:
            m = self.module(lazy)
            if m is not None:
                return self.top(m, name, depth + 1)
        return None

    def member(self, mod: Module, cls: ast.ClassDef, name: str, depth: int = 0
               ) -> tuple[Module, ast.AST] | None:
        """`name` in the class body, as `self.name = ...` in one of its methods, or in a base."""
        if depth > 8:
            return None
        for node in cls.body:
            for n in _defined(node, name):
                return mod, n
        for node in ast.walk(cls):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if (isinstance(t, ast.Attribute) and t.attr == name
                            and isinstance(t.value, ast.Name) and t.value.id == "self"):
                        return mod, node
        for base in cls.bases:
            found = self.resolve_expr(mod, base)
            if found is not None and isinstance(found[1], ast.ClassDef):
                res = self.member(found[0], found[1], name, depth + 1)
                if res is not None:
                    return res
        return None

    def resolve_expr(self, mod: Module, expr: ast.expr) -> tuple[Module, ast.AST] | None:
        if isinstance(expr, ast.Name):
            return self.top(mod, expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.resolve_expr(mod, expr.value)
            if owner is None:
                return None
            m, node = owner
            if isinstance(node, ast.Module):
                return self.top(m, expr.attr)
            if isinstance(node, ast.ClassDef):
                return self.member(m, node, expr.attr)
        return None

    def lookup(self, module: str, dotted: str) -> tuple[Module, ast.AST] | None:
        mod = self.module(module)
        if mod is None:
            return None
        if not dotted:
            return mod, mod.tree
        parts = dotted.split(".")
        res = self.top(mod, parts[0])
        for part in parts[1:]:
            if res is None:
                return None
            m, node = res
            if isinstance(node, ast.ClassDef):
                res = self.member(m, node, part)
            elif isinstance(node, ast.Module):
                res = self.top(m, part)
            else:
                return None
        return res


def _defined(node: ast.stmt, name: str) -> list[ast.AST]:
    """The statements among `node` (and its if/try branches) that bind `name`."""
    out: list[ast.AST] = []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        if node.name == name:
            out.append(node)
    elif isinstance(node, ast.Assign):
        for t in node.targets:
            if isinstance(t, ast.Name) and t.id == name:
                out.append(node)
    elif isinstance(node, ast.AnnAssign):
        if isinstance(node.target, ast.Name) and node.target.id == name:
            out.append(node)
    elif isinstance(node, (ast.ImportFrom, ast.Import)):
        for a in node.names:
            if (a.asname or a.name.split(".")[0]) == name:
                out.append(node)
    elif isinstance(node, (ast.If, ast.Try)):
        branches = [node.body, node.orelse]
        if isinstance(node, ast.Try):
            branches += [h.body for h in node.handlers] + [node.finalbody]
        for b in branches:
            for s in b:
                out += _defined(s, name)
    return out


def _import_target(mod: Module, node: ast.stmt, name: str) -> tuple[str, str | None] | None:
    """(module, name in it) an import statement binds `name` to; name None: the module itself."""
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.asname == name:
                return a.name, None
            if a.asname is None and a.name.split(".")[0] == name:
                return name, None
        return None
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        pkg = mod.name if mod.is_package else mod.name.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}" if base else pkg
    if not base.startswith("vllm"):
        return None
    for a in node.names:
        if (a.asname or a.name) == name:
            return base, a.name
    return (base, None) if name == "*" else None


def _lazy_export(mod: Module, name: str) -> str | None:
    """vLLM packages that export lazily map names to modules in a dict literal."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if (isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Constant)
                        and isinstance(v.value, str) and v.value.startswith("vllm")):
                    return v.value
                if (isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Tuple)
                        and v.elts and isinstance(v.elts[0], ast.Constant)
                        and str(v.elts[0].value).startswith("vllm")):
                    return str(v.elts[0].value)
    return None


def params_of(fn: ast.AST) -> tuple[str, ...]:
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return tuple(names)


def signature_of(fn: ast.AST) -> str:
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    return ast.unparse(fn.args)


def _register_call_op(mod: Module, op: str) -> str | None:
    """The function registered as op `op` by direct_register_custom_op(op_name=..., op_func=...)."""
    for node in ast.walk(mod.tree):
        if not isinstance(node, ast.Call):
            continue
        fname = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
            node.func, "id", "")
        if not fname.endswith("register_custom_op"):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        op_name = kw.get("op_name", node.args[0] if node.args else None)
        op_func = kw.get("op_func", node.args[1] if len(node.args) > 1 else None)
        if isinstance(op_name, ast.Constant) and op_name.value == op and isinstance(op_func,
                                                                                    ast.Name):
            return op_func.id
    return None


def _ir_op(mod: Module, op: str) -> ast.FunctionDef | None:
    """A function `op` decorated with vLLM IR's register_op."""
    for node in mod.tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == op:
            for d in node.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                if ast.unparse(target).endswith("register_op"):
                    return node
    return None


def check(source: Source | Index, item: Any) -> Result:
    """The Result for one contract item against a source tree."""
    R = Result
    index = source if isinstance(source, Index) else Index(source)
    mod = index.module(item.module)
    if mod is None:
        return R(item, "missing", f"no module {item.module}", "source")
    if item.kind == "module":
        return R(item, "ok", mod.path, "source")
    if item.kind == "op":
        ns, op = item.name.split("::")
        fn: ast.AST | None = None
        if ns == "vllm_ir":
            fn = _ir_op(mod, op)
        else:
            func_name = _register_call_op(mod, op)
            if func_name is not None:
                found = index.top(mod, func_name)
                fn = found[1] if found else None
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return R(item, "missing", f"{item.name} not registered in {mod.path}", "source")
        return _compare(R, item, fn)
    if item.kind == "op_schema":
        source = index.source
        needle = item.name.encode()
        libs = source.binaries()
        for lib in libs:
            if needle in source.read_bytes(lib):
                return R(item, "ok", lib, "source")
        return R(item, "missing", f"schema not in {', '.join(libs) or 'any vllm/_C*.so'}",
                 "source")
    if item.kind == "op_ref":
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Attribute) and ast.unparse(node) == item.name:
                return R(item, "ok", "", "source")
        return R(item, "missing", f"{item.name} not referenced in {mod.path}", "source")
    if item.kind == "field":
        cls_name, field = item.name.rsplit(".", 1)
        found = index.lookup(item.module, cls_name)
        if found is None or not isinstance(found[1], ast.ClassDef):
            return R(item, "missing", f"no class {cls_name}", "source")
        m = index.member(found[0], found[1], field)
        if m is None or not isinstance(m[1], ast.AnnAssign) or isinstance(
                getattr(m[1], "target", None), ast.Attribute):
            return R(item, "missing", "", "source")
        return R(item, "ok", ast.unparse(m[1]).split("=")[0].strip(), "source")
    found = index.lookup(item.module, item.name)
    if found is None:
        return R(item, "missing", "", "source")
    node = found[1]
    if item.kind == "code":
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return R(item, "missing", "not a function", "source")
        text = ast.unparse(node)
        absent = [f for f in item.fragments if f not in text]
        if absent:
            return R(item, "changed", "no " + "; no ".join(absent), "source")
        return R(item, "ok", "", "source")
    if item.kind == "class" and not isinstance(node, ast.ClassDef):
        return R(item, "changed", f"{type(node).__name__}, not a class", "source")
    if item.kind in ("function", "method"):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # e.g. a name bound to another function (an alias): present, signature unknown
            return R(item, "ok", f"{type(node).__name__} (signature not read)", "source")
        return _compare(R, item, node)
    return R(item, "ok", "", "source")


def _compare(R: Any, item: Any, fn: ast.AST) -> Any:
    got = params_of(fn)
    sig = signature_of(fn)
    if item.params is None or got == tuple(item.params):
        return R(item, "ok", f"({sig})", "source")
    return R(item, "changed", f"({sig}), expected ({', '.join(item.params)})", "source")
