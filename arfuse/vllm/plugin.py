"""The vLLM plugin's start: register() checks the library and the vLLM release and installs the
three hooks, whose bodies live by job in arfuse.vllm.passes, arfuse.vllm.cache_key and
arfuse.vllm.load. vLLM reaches it through the entry point arfuse_vllm_plugin:register
(`vllm.general_plugins`), which imports this module only when ARFUSE_VLLM is set.

vLLM calls register() once in every process it starts (API server, engine core, workers), through
vllm.plugins.load_general_plugins. With ARFUSE_VLLM unset or 0 it returns at once and touches
nothing. With ARFUSE_VLLM=1 it hooks three places of vLLM (0.26.0 ... 0.34.0; the targets are
items of arfuse.vllm.contract), each once per process (register() is re-entrant):

1. PostGradPassManager.configure: after vLLM has set up its own passes, the arfuse fusion pass is
   put in front of vLLM's own all-reduce / norm-quant fusion passes (so it sees the all-reduce +
   norm pairs first), i.e. still before vLLM's IR lowering. vLLM has no plugin API for compile
   passes (PassConfig forbids extra fields; the post_grad_custom_post_pass slot, arfuse.vllm.slot,
   runs after the built-in fusions), hence the wrapper. With tensor parallelism 1 the pass holds
   only the MoE-tail patterns on the expert rows, without an all-reduce (the local algorithm),
   and is added only where the rows switch (3.) is on. (arfuse.vllm.passes)
2. The compile cache key: VllmConfig.compute_hash up to 0.33 (0.30+ with an include_version
   keyword, hence *args/**kwargs), VllmConfig.compile_factors from 0.34 (compute_hash is gone; the
   compile cache, the AOT artifacts and FlashInfer's autotune cache hash these factors). The key
   names the arfuse configuration, so vLLM's compile cache never hands a graph compiled without
   arfuse to a run with it, or back. (arfuse.vllm.cache_key)
3. Worker.load_model: the communicator for vLLM's tensor-parallel group is created right after the
   weights are loaded, on every rank, whether or not torch.compile runs later. A graph loaded
   from vLLM's cache holds the communicator's handle as a constant, so the communicator must exist
   even when the pass is never constructed; and the eager call can use it without torch.compile.
   With a communicator, the same hook switches the model's eligible MoE layers to hand their
   unfinalized expert rows to the graph (arfuse.vllm.moe_rows; ARFUSE_VLLM_MOE_ROWS=0 keeps
   vLLM's finalize), before vLLM compiles or profiles the model. At TP > 1 the ranks agree to
   fuse together or not at all, and every step's communicators are watched. (arfuse.vllm.load)

A failure in arfuse never stops vLLM (arfuse.vllm.guard): a hook target that this vLLM lacks is
skipped with one log line, and since the three belong together (a pass without the cache key or
the communicator hook would be unsafe) the integration then stays off; an exception in register()
or in what a hook adds is logged (one line) and switches the integration off in that process,
vLLM's own behaviour and graphs untouched. vLLM's own exceptions pass through the hooks unchanged.
On a vLLM release not in contract.SUPPORTED, register() first checks the contract against the
installed vLLM and stays off (one log line) if something the integration needs is missing.

The communicator is created lazily (first of: the hook above, the pass, the eager call) over the
tensor-parallel group's gloo group, with max_tokens = scheduler_config.max_num_batched_tokens
(capped by ARFUSE_VLLM_MAX_TOKENS), and only when arfuse serves (dtype, hidden, world size); at
tensor parallelism 1 it has world size 1 (the local algorithm: nothing exchanged or allocated).
"""

from __future__ import annotations

import threading
from typing import Any

from . import cache_key as _cache
from . import contract as _contract
from . import guard as _guard
from . import load as _load
from . import passes as _passes
from . import settings as _settings
from .contract.installed import check_installed as _check_installed
from .guard import logger

_lock = threading.RLock()
_hooked = False
_told_settings = False


def register() -> None:
    """The `vllm.general_plugins` entry point. Does nothing unless ARFUSE_VLLM=1; never raises."""
    try:
        s = _settings.from_env()
    except ValueError as e:
        global _told_settings
        if not _told_settings:  # once per process, as every other reason
            _told_settings = True
            logger.error("arfuse: fusion is OFF in this process: %s", e)
        return
    if not s.enabled:
        return
    try:
        with _lock:
            if _hooked or not _guard.active():
                return
            if not _library_ready() or not _install_hooks():
                return
    except _guard.FusionOff:
        raise
    except Exception as e:  # noqa: BLE001  (vLLM's plugin loader does not catch: vLLM would not start)
        _guard.disable(f"register: {_guard.describe(e)}")
        return
    logger.info("arfuse: vLLM integration enabled (%s)", s.as_dict())


def _library_ready() -> bool:
    """Loads arfuse's compiled library; False (and the integration off) when it cannot."""
    from .. import _lib

    if _lib.load():
        return True
    _guard.disable(f"the compiled library is not available: {_lib.load_error()}")
    return False


def is_registered() -> bool:
    """Whether register() has installed the hooks in this process."""
    return _hooked


# ---- the hooks -----------------------------------------------------------------------------------

def hook_target(key: str) -> tuple[type, str] | str:
    """(class, method name) of the hook target contract item `key`, or why this vLLM lacks it."""
    import importlib

    item = _contract.BY_KEY[key]
    cls_name, method = item.name.rsplit(".", 1)
    try:
        owner = importlib.import_module(item.module)
        for part in cls_name.split("."):
            owner = getattr(owner, part)
        getattr(owner, method)
    except Exception as e:  # noqa: BLE001  (ImportError, AttributeError, or the module failing)
        return f"hook {key} skipped: {item.module}.{item.name} not found ({_guard.describe(e)})"
    return owner, method


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:  # noqa: BLE001
        return "unknown"


def _unknown_release_problems() -> list[str]:
    """For a vLLM release not in contract.SUPPORTED: what the integration needs and the installed
    vLLM lacks (hook and pass items). Empty for a supported release (checked statically)."""
    version = _vllm_version()
    if version.split("+")[0] in _contract.SUPPORTED:
        return []
    problems = _contract.summarize(_check_installed(needs=("hook", "pass")))
    if not problems:
        logger.info("arfuse: vLLM %s is not among the releases checked (%s ... %s); the installed "
                    "vLLM has everything arfuse.vllm.contract lists", version,
                    _contract.SUPPORTED[0], _contract.SUPPORTED[-1])
    return problems


def _install_hooks() -> bool:
    """Installs every hook, or none. Returns whether the integration is on."""
    global _hooked
    problems = _unknown_release_problems()
    if problems:
        _guard.disable(f"vLLM {_vllm_version()} is not among the releases checked "
                       f"({_contract.SUPPORTED[0]} ... {_contract.SUPPORTED[-1]}) and lacks what "
                       f"the integration needs: {'; '.join(problems)}")
        return False
    # Up to 0.33 the compile cache hashes VllmConfig.compute_hash, from 0.34 compile_factors.
    cache = hook_target("hook.cache_key.compute_hash")
    after_cache = _cache.after_compute_hash
    if isinstance(cache, str):
        cache = hook_target("hook.cache_key.compile_factors")
        after_cache = _cache.after_compile_factors
    targets = {"cache key": cache, "configure": hook_target("hook.configure"),
               "worker": hook_target("hook.worker")}
    for what, target in targets.items():
        if isinstance(target, str):  # the three belong together: none, or all of them
            _guard.disable(f"{target}; no {what} hook possible, so the integration stays off")
            return False
    _cache.compute()  # once, before anything is hooked
    owner, name = targets["cache key"]
    _guard.after_hook(owner, name, after_cache, f"{owner.__name__}.{name} hook")
    _guard.after_hook(*targets["worker"], _load.after_load_model, "Worker.load_model hook")
    _guard.after_hook(*targets["configure"], _passes.after_configure,
                      "PostGradPassManager.configure hook")
    _hooked = True
    return True
