"""The arfuse pass as it goes into vLLM's pass list: failures leave the graph as it was.

Imports vLLM's compiler stack; loaded only when a pass is built (arfuse.vllm.guard is the part
the plugin entry point loads).
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.compilation.passes.inductor_pass import InductorPass

from .guard import active, call_safely, describe, disable


def _restore(graph: Any, backup: Any) -> None:
    """Makes `graph` (an fx.Graph, in place) a copy of `backup` again."""
    for node in reversed(list(graph.nodes)):
        graph.erase_node(node)
    namespace = getattr(graph, "_graph_namespace", None)
    if namespace is not None:  # free the erased nodes' names, so the copies get them back
        graph._graph_namespace = type(namespace)()
    output = graph.graph_copy(backup, {}, return_output_node=True)
    value, node = output
    graph.output(value, type_expr=getattr(node, "type", None))


class GuardedPass(InductorPass):  # type: ignore[misc]
    """What goes into vLLM's pass list in place of the arfuse pass: the same pass, but a failure
    in it leaves the graph as it was (and switches the integration off)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        if not active():
            return False
        return bool(call_safely("fusion pass (range check)", self.inner.is_applicable_for_range,
                                compile_range, default=False))

    def __call__(self, graph: Any) -> None:
        if not active():
            return
        try:
            backup = copy.deepcopy(graph)
        except Exception as e:  # noqa: BLE001  (cannot undo a failure: do not start)
            disable(f"fusion pass: the graph cannot be copied ({describe(e)})")
            return
        try:
            self.inner(graph)
        except Exception as e:  # noqa: BLE001
            _restore(graph, backup)
            disable(f"fusion pass: {describe(e)}")

    def uuid(self) -> str:
        if not active():
            return "arfuse-off"
        return str(call_safely("fusion pass (uuid)", self.inner.uuid, default="arfuse-off"))

    def __getattr__(self, name: str) -> Any:  # matched_count, specs, ... of the inner pass
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
