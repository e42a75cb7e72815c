"""The vLLM plugin: entry point `arfuse = "arfuse.vllm.plugin:register"` in the
`vllm.general_plugins` group.

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
   and is added only where the rows switch (3.) is on.
2. The compile cache key: VllmConfig.compute_hash up to 0.33 (0.30+ with an include_version
   keyword, hence *args/**kwargs), VllmConfig.compile_factors from 0.34 (compute_hash is gone; the
   compile cache, the AOT artifacts and FlashInfer's autotune cache hash these factors). The key
   names the arfuse configuration, so vLLM's compile cache never hands a graph compiled without
   arfuse to a run with it, or back.
3. Worker.load_model: the communicator for vLLM's tensor-parallel group is created right after the
   weights are loaded, on every rank, whether or not torch.compile runs later. A graph loaded
   from vLLM's cache holds the communicator's handle as a constant, so the communicator must exist
   even when the pass is never constructed; and the eager call can use it without torch.compile.
   With a communicator, the same hook switches the model's eligible MoE layers to hand their
   unfinalized expert rows to the graph (arfuse.vllm.moe_rows; ARFUSE_VLLM_MOE_ROWS=0 keeps
   vLLM's finalize), before vLLM compiles or profiles the model.

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

import hashlib
import threading
from typing import Any

from . import communicators as _comms
from . import contract as _contract
from .contract.installed import check_installed as _check_installed
from . import guard as _guard
from . import settings as _settings
from .guard import logger

_lock = threading.RLock()
_hooked = False
_told_settings = False
_cache_key: str | None = None
# The config of the last Worker.load_model in this process (the slot pass falls back to it).
_worker_config: Any = None


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

# vLLM passes the arfuse pass goes in front of, by class name: the ones that consume all_reduce +
# rms_norm / fused_add_rms_norm, or the norm itself (RMSNormReshapeFusionPass: 0.27+, transformers
# backend; the ROCm ones for completeness, arfuse is CUDA-only).
_BEFORE = (
    "AllReduceFusionPass",
    "RocmAiterTritonAddRMSNormPadFusionPass",
    "RocmAiterAllReduceFusionPass",
    "RMSNormReshapeFusionPass",
    "RocmAiterRMSNormQuantFusionPass",
    "RMSNormQuantFusionPass",
)
_ARFUSE_PASSES = ("ArfuseAllReduceFusionPass", "GuardedPass")


def add_pass(pass_manager: Any, fusion_pass: Any) -> None:
    """Puts `fusion_pass` into vLLM's pass list before the first pass named in _BEFORE (at the
    end if there is none). All of pass_manager.passes run before vLLM's IR lowering."""
    passes = pass_manager.passes
    for i, p in enumerate(passes):
        if type(p).__name__ in _BEFORE:
            passes.insert(i, fusion_pass)
            return
    passes.append(fusion_pass)


def build_pass(vllm_config: Any, *, rows: bool = False) -> Any | None:
    """The arfuse pass for `vllm_config`, wrapped in GuardedPass; None when there is nothing to
    fuse (no communicator for the model; tensor parallelism 1 without `rows`). `rows`: the MoE
    layers hand their expert rows to the graph (the plugin's switch, arfuse.vllm.moe_rows); at
    tensor parallelism 1 the MoE tails on those rows are all there is to fuse (vLLM's graph has no
    all-reduce), so without the switch no pass is built. Exceptions propagate (the callers are
    guarded)."""
    if _comms.tensor_parallel_size() <= 1 and not rows:
        return None
    from .fusion import ArfuseAllReduceFusionPass
    from .guarded_pass import GuardedPass

    fusion_pass = ArfuseAllReduceFusionPass(vllm_config)
    if fusion_pass.disabled:
        return None
    return GuardedPass(fusion_pass)


def configure_pass_manager(pass_manager: Any, vllm_config: Any) -> Any | None:
    """What the configure hook does after vLLM's own configure: adds the arfuse pass when there
    is something to fuse. Returns the pass, or None when it stays out."""
    if any(type(p).__name__ in _ARFUSE_PASSES for p in pass_manager.passes):
        return None  # configure called twice on one manager
    fusion_pass = build_pass(vllm_config, rows=_settings.from_env().moe_rows)
    if fusion_pass is not None:
        add_pass(pass_manager, fusion_pass)
    return fusion_pass


def cache_key() -> str:
    """What the arfuse configuration contributes to vLLM's compile cache key."""
    import arfuse

    parts = [
        str(getattr(arfuse, "__version__", "unknown")),
        _settings.source_hash(),
        repr(sorted(_settings.from_env().as_dict().items())),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def _mix_hash(base: str) -> str:
    assert _cache_key is not None
    return hashlib.sha256(f"{base}|arfuse|{_cache_key}".encode()).hexdigest()[: len(base)]


def _after_compute_hash(config: Any, base: str, args: Any, kwargs: Any) -> str:
    return _mix_hash(base)


def _after_compile_factors(config: Any, factors: Any, args: Any, kwargs: Any) -> Any:
    return {**factors, "arfuse": _cache_key}


def _after_configure(pass_manager: Any, result: Any, args: Any, kwargs: Any) -> Any:
    config = args[0] if args else kwargs.get("config")
    configure_pass_manager(pass_manager, config)
    return result


def _after_load_model(worker: Any, result: Any, args: Any, kwargs: Any) -> Any:
    global _worker_config
    config = _worker_config = worker.vllm_config
    if _comms.tensor_parallel_size() <= 1:  # no peers: nothing to agree on
        comm = _comms.get_communicator(config)
        if comm is not None:
            switch_moe_rows(config)
        return result
    # Tensor parallelism > 1: the ranks fuse together or not at all. A rank that cannot (no
    # library, no kernel, a failed switch) would otherwise run vLLM's all-reduce while its peers
    # wait in arfuse's kernel for it. Two agreements over the TP group's CPU (gloo) group: before
    # the communicator is created (collectively), and after the MoE layers were switched.
    ok, why = _step(lambda: _comms.plan(config) is not None)
    if not _agree(ok, why, "before creating the communicator"):
        return result
    comm = _comms.get_communicator(config)
    switched: list[str] = []

    def switch() -> bool:
        switched.extend(switch_moe_rows(config))
        return comm is not None

    ok, why = _step(switch)
    if _agree(ok, why, "after switching the MoE layers"):
        from . import watch

        # every step's result leaves only after the communicators' error words were read
        _guard.after_hook(type(worker), "execute_model", watch.after_step,
                          "Worker.execute_model hook")
    else:
        from . import moe_rows

        n = moe_rows.restore(config)
        if n:
            logger.info("arfuse: vLLM's own finalize put back in %d MoE layers", n)
    return result


def _step(fn: Any) -> tuple[bool, str]:
    """(whether fn() returned true and arfuse is still on in this process, why not)."""
    try:
        ok = bool(fn()) and _guard.active()
    except _guard.FusionOff:
        raise
    except Exception as e:  # noqa: BLE001  (the agreement must still be reached on every rank)
        return False, _guard.describe(e)
    return ok, "" if ok else (_guard.disabled_reason() or "nothing to fuse")


def _agree(ok: bool, why: str, when: str) -> bool:
    """Whether every rank of vLLM's tensor-parallel group is ok (all_gather over its CPU group).
    Where one is not, every rank switches arfuse off with one line naming the first such rank and
    its reason (in strict mode: raises)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    gathered: list = [None] * tp.world_size
    dist.all_gather_object(gathered, (ok, why), group=tp.cpu_group)
    bad = [(r, w) for r, (o, w) in enumerate(gathered) if not o]
    if not bad:
        return True
    rank, reason = bad[0]
    _guard.disable(f"{when}: rank {rank} of the tensor-parallel group cannot fuse ({reason}); "
                   f"every rank of the group stays unfused")
    return False


_rows_problems: list[str] | None = None


def switch_moe_rows(vllm_config: Any) -> list[str]:
    """Hands the finalize of the model's eligible MoE layers to arfuse (arfuse.vllm.moe_rows),
    unless ARFUSE_VLLM_MOE_ROWS=0 or this vLLM lacks something the switch needs (contract items
    of need "rows": one log line, the switch stays off). Returns the switched layer names."""
    global _rows_problems
    if not _settings.from_env().moe_rows:
        return []
    if _rows_problems is None:
        _rows_problems = _contract.summarize(_check_installed(needs=("rows",)))
        if _rows_problems:
            logger.warning("arfuse: MoE finalize stays in vLLM: this vLLM lacks %s",
                           "; ".join(_rows_problems))
    if _rows_problems:
        return []
    from . import moe_rows

    return moe_rows.switch(vllm_config)[0]


def worker_config() -> Any:
    """The VllmConfig of the last Worker.load_model in this process (None before)."""
    return _worker_config


def _target(key: str) -> tuple[type, str] | str:
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
    global _hooked, _cache_key
    problems = _unknown_release_problems()
    if problems:
        _guard.disable(f"vLLM {_vllm_version()} is not among the releases checked "
                       f"({_contract.SUPPORTED[0]} ... {_contract.SUPPORTED[-1]}) and lacks what "
                       f"the integration needs: {'; '.join(problems)}")
        return False
    # Up to 0.33 the compile cache hashes VllmConfig.compute_hash, from 0.34 compile_factors.
    cache = _target("hook.cache_key.compute_hash")
    after_cache = _after_compute_hash
    if isinstance(cache, str):
        cache, after_cache = _target("hook.cache_key.compile_factors"), _after_compile_factors
    targets = {"cache key": cache, "configure": _target("hook.configure"),
               "worker": _target("hook.worker")}
    for what, target in targets.items():
        if isinstance(target, str):  # the three belong together: none, or all of them
            _guard.disable(f"{target}; no {what} hook possible, so the integration stays off")
            return False
    _cache_key = cache_key()  # computed once, before anything is hooked
    owner, name = targets["cache key"]
    _guard.after_hook(owner, name, after_cache, f"{owner.__name__}.{name} hook")
    _guard.after_hook(*targets["worker"], _after_load_model, "Worker.load_model hook")
    _guard.after_hook(*targets["configure"], _after_configure, "PostGradPassManager.configure hook")
    _hooked = True
    return True
