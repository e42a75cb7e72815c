"""The arfuse pass for vLLM's one official compile-pass slot, without the plugin's pass hook:

    --compilation-config '{"inductor_passes":
        {"post_grad_custom_post_pass": "arfuse_vllm_pass.post_grad_pass"},
        "pass_config": {"fuse_allreduce_rms": false, "fuse_norm_quant": false}}'

vLLM (0.26.0 ... 0.34.0, config/compilation.py) resolves the qualified name with
`__import__(module).__dict__[name]`, which finds only attributes of a top-level module: hence the
top-level module `arfuse_vllm_pass` (arfuse_vllm_pass.py, in the wheel) holding `post_grad_pass`,
this module's ArfuseSlotPass singleton. Being an InductorPass instance, vLLM uses it as it is;
VllmBackend.configure_post_pass appends it after vLLM's own passes (still before vLLM's IR
lowering), so vLLM's fusions that consume the chain must be off (above; docs/vllm.md).

The slot object knows no VllmConfig (vLLM resolves it while building the CompilationConfig). It
takes vLLM's current config when one is set, else the config of this process's last
Worker.load_model, and builds the arfuse pass (arfuse.vllm.passes.build_pass) on first use
(uuid, range check or call, whichever comes first; all ranks compile in the same order, and
creating the communicator is collective). Importing this module installs the plugin's
Worker.load_model hook body without the rows switch (load.after_load_model_slot; only that
hook): the communicator then exists before a graph from vLLM's compile cache runs, and the MoE
layers keep vLLM's finalize (docs/vllm.md). vLLM pickles the CompilationConfig to its workers: the singleton pickles by
reference, so unpickling it imports this module there.

With ARFUSE_VLLM=1 as well, the plugin's configure hook already puts the pass earlier in the
list; the slot then does nothing. Failures follow arfuse.vllm.guard: one log line, graph
untouched, vLLM keeps running.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from vllm.compilation.passes.inductor_pass import InductorPass

from . import communicators as _comms
from . import guard as _guard
from . import load as _load
from . import passes as _passes
from . import plugin as _plugin

logger = logging.getLogger("vllm.arfuse")


class ArfuseSlotPass(InductorPass):  # type: ignore[misc]
    """vLLM's post_grad_custom_post_pass slot's object (use the `post_grad_pass` singleton)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # id(config) -> (config, the GuardedPass or None)
        self._built: dict[int, tuple[Any, Any]] = {}
        self._told: set[str] = set()

    def _once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._told:
            self._told.add(what)
            logger.info(msg, *args)

    def _config(self) -> Any:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if config is not None and config.model_config is not None:
            return config
        return _load.worker_config()

    def inner(self) -> Any | None:
        """The arfuse pass for the config in force (built on first use), or None."""
        if not _guard.active():
            return None
        if _plugin.is_registered():
            self._once("plugin", "arfuse: the plugin's configure hook adds the pass; the "
                       "post_grad_custom_post_pass slot does nothing")
            return None
        try:
            if not _comms.model_parallel_ready():
                return None  # too early (e.g. vLLM hashing its config before the workers start)
            config = self._config()
            if config is None:
                self._once("config", "arfuse: slot pass: no vLLM config in this process yet; "
                           "the graph stays as it is")
                return None
            with self._lock:
                entry = self._built.get(id(config))
                if entry is None or entry[0] is not config:
                    entry = (config, _passes.build_pass(config))
                    self._built[id(config)] = entry
            return entry[1]
        except Exception as e:  # noqa: BLE001
            _guard.disable(f"slot pass: {_guard.describe(e)}")
            return None

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        p = self.inner()
        return p is not None and p.is_applicable_for_range(compile_range)

    def __call__(self, graph: Any) -> None:
        p = self.inner()
        if p is not None:
            p(graph)

    def uuid(self) -> str:
        p = self.inner()
        return self._uuid(p.uuid() if p is not None else "arfuse-off")

    @classmethod
    def _uuid(cls, inner: str) -> str:
        return InductorPass.hash_dict({"slot": InductorPass.hash_source(cls), "pass": inner})

    @classmethod
    def off_uuid(cls) -> str:
        """The uuid while the slot leaves graphs alone."""
        return cls._uuid("arfuse-off")

    def __deepcopy__(self, memo: Any) -> ArfuseSlotPass:
        return self  # vLLM deep-copies inductor_compile_config; the singleton stays one

    def __reduce__(self) -> str:
        return "post_grad_pass"  # pickled by reference: arfuse.vllm.slot.post_grad_pass


post_grad_pass = ArfuseSlotPass()


def _install_worker_hook() -> None:
    worker = _plugin.hook_target("hook.worker")
    if isinstance(worker, str):
        # Without it a graph from vLLM's compile cache could run before the communicator exists.
        _guard.disable(f"{worker}; the slot pass stays off")
    else:
        _guard.after_hook(*worker, _load.after_load_model_slot, "Worker.load_model hook")


try:
    _install_worker_hook()
except Exception as e:  # noqa: BLE001  (importing the slot must not stop vLLM)
    _guard.disable(f"slot: {_guard.describe(e)}")
