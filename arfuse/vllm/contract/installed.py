"""The contract against the installed vLLM, the plugin's start-up check: each item by import and inspect
where that works without a GPU, else (CUDA-only modules, `self.X` attributes, code fragments, op
references and schemas) from the installed sources through the AST index of ``source``."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
from typing import Any

from . import ITEMS, Item, Result
from . import source as _source


def _param_names(fn: Any) -> tuple[str, ...]:
    sig = inspect.signature(fn)
    out = []
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
        elif p.kind is p.VAR_KEYWORD:
            out.append("**" + p.name)
        else:
            out.append(p.name)
    return tuple(out)


def _compare(item: Item, got: tuple[str, ...] | None, how: str) -> Result:
    if item.params is None or got is None:
        return Result(item, "ok", "", how)
    if tuple(got) == item.params:
        return Result(item, "ok", f"({', '.join(got)})", how)
    return Result(item, "changed", f"({', '.join(got)}), expected ({', '.join(item.params)})", how)


def _lookup(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
    return obj


def _installed_source_root() -> str | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def _check_imported(item: Item) -> Result:
    module = importlib.import_module(item.module)
    if item.kind == "module":
        return Result(item, "ok", "", "import")
    if item.kind == "op":
        import torch

        ns, op = item.name.split("::")
        packet = getattr(getattr(torch.ops, ns), op, None)
        if packet is None or not hasattr(packet, "default"):
            return Result(item, "missing", f"torch.ops.{ns}.{op} not registered", "import")
        names = tuple(a.name for a in packet.default._schema.arguments)
        return _compare(item, names, "import")
    if item.kind == "field":
        cls_name, field = item.name.rsplit(".", 1)
        cls = _lookup(module, cls_name)
        names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        names |= set(getattr(cls, "model_fields", {}) or {})
        return Result(item, "ok" if field in names else "missing", "", "import")
    obj = _lookup(module, item.name)
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if item.kind in ("class",) and not inspect.isclass(obj):
        return Result(item, "changed", f"{type(obj).__name__}, not a class", "import")
    if item.kind in ("function", "method") and not callable(obj):
        return Result(item, "changed", f"{type(obj).__name__}, not callable", "import")
    if item.kind in ("function", "method") and item.params is not None:
        try:
            names = _param_names(inspect.unwrap(obj))
        except (TypeError, ValueError):
            names = None
        return _compare(item, names, "import")
    return Result(item, "ok", "", "import")


def check_item(item: Item) -> Result:
    """One item against the installed vLLM: by import and inspect where that works without a GPU,
    else (cuda modules, `self.X` attributes, code fragments, op_ref) from the installed sources."""
    by_source = item.cuda or item.kind in ("code", "op_ref", "op_schema")
    if not by_source:
        try:
            result = _check_imported(item)
        except (ImportError, AttributeError) as e:
            if item.kind == "attr":  # maybe `self.X = ...`, only visible in the source
                by_source = True
            else:
                return Result(item, "missing", f"{type(e).__name__}: {e}", "import")
        else:
            return result
    root = _installed_source_root()
    if root is None:
        return Result(item, "missing", "vllm is not installed", "source")
    res = _source.check(_source.DirSource(root), item)
    res.how = "source"
    return res


def check_installed(needs: tuple[str, ...] | None = None, keys: tuple[str, ...] | None = None
                    ) -> list[Result]:
    """The table (or the items of `needs` / `keys`) against the installed vLLM."""
    return [
        check_item(i)
        for i in ITEMS
        if (needs is None or i.need in needs) and (keys is None or i.key in keys)
    ]
