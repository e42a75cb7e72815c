"""The vLLM plugin: entry point `arfuse = "arfuse.vllm.plugin:register"` in the
`vllm.general_plugins` group.

vLLM calls register() once in every process it starts (API server, engine core, workers), through
vllm.plugins.load_general_plugins. With ARFUSE_VLLM unset or 0 it returns at once and touches
nothing. With ARFUSE_VLLM=1 it hooks three places of vLLM 0.26.0, each once per process
(register() is re-entrant):

1. PostGradPassManager.configure: after vLLM has set up its own passes, the arfuse fusion pass is
   put in front of vLLM's own all-reduce / norm-quant fusion passes (so it sees the all-reduce +
   norm pairs first), i.e. still before vLLM's IR lowering. vLLM has no plugin API for compile
   passes (PassConfig forbids extra fields; the post_grad_custom_post_pass slot runs after the
   built-in fusions), hence the wrapper. With tensor parallelism 1 nothing is added.
2. VllmConfig.compute_hash: the hash names the arfuse configuration, so vLLM's compile cache (and
   its AOT artifacts) never hands a graph compiled without arfuse to a run with it, or back.
3. Worker.load_model: the communicator for vLLM's tensor-parallel group is created right after the
   weights are loaded, on every rank, whether or not torch.compile runs later. A graph loaded
   from vLLM's cache holds the communicator's handle as a constant, so the communicator must exist
   even when the pass is never constructed; and the eager call can use it without torch.compile.

The communicator is created lazily (first of: the hook above, the pass, the eager call) over the
tensor-parallel group's gloo group, with max_tokens = scheduler_config.max_num_batched_tokens
(capped by ARFUSE_VLLM_MAX_TOKENS), and only when arfuse serves (dtype, hidden, world size).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from typing import Any

from . import settings as _settings

# Under "vllm" so that vLLM's logging configuration (format, level) applies.
logger = logging.getLogger("vllm.arfuse")

_lock = threading.RLock()
_hooked = False
# (tp group name, hidden, dtype, max_tokens, oneshot_max_tokens) -> arfuse.Communicator
_communicators: dict[tuple[Any, ...], Any] = {}
_MARK = "__arfuse_vllm_hook__"


def register() -> None:
    """The `vllm.general_plugins` entry point. Does nothing unless ARFUSE_VLLM=1."""
    try:
        s = _settings.from_env()
    except ValueError as e:
        logger.error("arfuse: not enabled: %s", e)
        return
    if not s.enabled:
        return
    global _hooked
    with _lock:
        if _hooked:
            return
        _hook_pass_manager()
        _hook_config_hash()
        _hook_worker()
        _hooked = True
    logger.info("arfuse: vLLM integration enabled (%s)", s.as_dict())


def is_registered() -> bool:
    """Whether register() has installed the hooks in this process."""
    return _hooked


# ---- the communicator ----------------------------------------------------------------------------


def tensor_parallel_size() -> int:
    """vLLM's tensor-parallel world size in this process (1 before vLLM set its groups up)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    return ps.get_tensor_model_parallel_world_size()


def _plan(vllm_config: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The communicator this config wants: (registry key, constructor arguments), or None."""
    if vllm_config is None or vllm_config.model_config is None:
        return None
    world = tensor_parallel_size()
    if world <= 1:
        return None
    import arfuse
    from vllm.distributed.parallel_state import get_tp_group

    s = _settings.from_env()
    hidden = vllm_config.model_config.get_hidden_size()
    dtype = vllm_config.model_config.dtype
    if not arfuse.is_built():
        logger.warning("arfuse: the compiled library is not available; fusion stays off")
        return None
    if not arfuse.supported(dtype, hidden, world):
        logger.warning(
            "arfuse: no kernel for dtype=%s hidden=%d world_size=%d; fusion stays off",
            dtype,
            hidden,
            world,
        )
        return None
    max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
    if s.max_tokens is not None:
        max_tokens = min(max_tokens, s.max_tokens)
    oneshot = s.oneshot_max_tokens
    if oneshot is not None:
        oneshot = min(oneshot, max_tokens)
    tp = get_tp_group()
    key = (tp.unique_name, hidden, dtype, max_tokens, oneshot)
    kwargs = dict(
        group=tp.cpu_group,
        max_tokens=max_tokens,
        hidden=hidden,
        dtype=dtype,
        oneshot_max_tokens=oneshot,
        device=tp.device,
        timeout_s=float(s.timeout_s),
    )
    return key, kwargs


def fp8_supported(dtype: Any, hidden: int, world_size: int, algorithm: str = "auto") -> bool:
    """Whether arfuse has a kernel with FP8 output (fp8_static) for (dtype, hidden, world size)
    and every algorithm that `algorithm` may dispatch to (auto: one-shot and two-shot)."""
    import arfuse

    algorithms = ("oneshot", "twoshot") if algorithm == "auto" else (algorithm,)
    try:
        return all(
            arfuse.instance_for(dtype, hidden, world_size, a, output="fp8_static")
            for a in algorithms
        )
    except Exception as e:  # no library, or one that does not know the output kind
        logger.debug("arfuse: fp8_static lookup failed: %s", e)
        return False


def get_communicator(vllm_config: Any, *, create: bool = True) -> Any | None:
    """The arfuse.Communicator for vLLM's tensor-parallel group and this config's model.

    None when there is nothing to fuse (tensor parallelism 1, no model config) or arfuse does not
    serve the model's (dtype, hidden, world size). Creating it is collective: every rank of the
    group must ask at the same point (the hooks do). `create=False` only looks it up.
    """
    plan = _plan(vllm_config)
    if plan is None:
        return None
    key, kwargs = plan
    with _lock:
        comm = _communicators.get(key)
        if comm is not None and not comm.closed:
            return comm
        if not create:
            return None
        import arfuse

        group = kwargs.pop("group")
        comm = arfuse.Communicator(group, **kwargs)
        _communicators[key] = comm
        logger.info("arfuse: %r", comm)
        return comm


def close_communicators() -> None:
    """Closes every communicator this module created (tests; process teardown). Collective, as
    Communicator.close() is: every rank of the group calls it."""
    with _lock:
        for comm in _communicators.values():
            comm.close()
        _communicators.clear()


# ---- the hooks -----------------------------------------------------------------------------------

# vLLM passes the arfuse pass goes in front of, by class name (the ones that consume
# all_reduce + rms_norm / fused_add_rms_norm, or the norm itself).
_BEFORE = (
    "AllReduceFusionPass",
    "RocmAiterAllReduceFusionPass",
    "RocmAiterRMSNormQuantFusionPass",
    "RMSNormQuantFusionPass",
)


def add_pass(pass_manager: Any, fusion_pass: Any) -> None:
    """Puts `fusion_pass` into vLLM's pass list before the first pass named in _BEFORE (at the
    end if there is none). All of pass_manager.passes run before vLLM's IR lowering."""
    passes = pass_manager.passes
    for i, p in enumerate(passes):
        if type(p).__name__ in _BEFORE:
            passes.insert(i, fusion_pass)
            return
    passes.append(fusion_pass)


def configure_pass_manager(pass_manager: Any, vllm_config: Any) -> Any | None:
    """What the configure hook does after vLLM's own configure: adds the arfuse pass when there
    is something to fuse. Returns the pass, or None when it stays out."""
    if any(type(p).__name__ == "ArfuseAllReduceFusionPass" for p in pass_manager.passes):
        return None  # configure called twice on one manager
    if tensor_parallel_size() <= 1:
        return None
    from .fusion import ArfuseAllReduceFusionPass

    fusion_pass = ArfuseAllReduceFusionPass(vllm_config)
    if fusion_pass.disabled:
        return None
    add_pass(pass_manager, fusion_pass)
    return fusion_pass


def _hook_pass_manager() -> None:
    from vllm.compilation.passes.pass_manager import PostGradPassManager

    original = PostGradPassManager.configure
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def configure(self: Any, config: Any) -> None:
        original(self, config)
        configure_pass_manager(self, config)

    setattr(configure, _MARK, True)
    PostGradPassManager.configure = configure


def cache_key() -> str:
    """What the arfuse configuration contributes to vLLM's config hash."""
    import arfuse

    parts = [
        str(getattr(arfuse, "__version__", "unknown")),
        _settings.source_hash(),
        repr(sorted(_settings.from_env().as_dict().items())),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def _hook_config_hash() -> None:
    from vllm.config import VllmConfig

    original = VllmConfig.compute_hash
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def compute_hash(self: Any) -> str:
        base = original(self)
        mixed = hashlib.sha256(f"{base}|arfuse|{cache_key()}".encode()).hexdigest()
        return mixed[: len(base)]

    setattr(compute_hash, _MARK, True)
    VllmConfig.compute_hash = compute_hash


def _hook_worker() -> None:
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception as e:  # no GPU worker in this build or platform: nothing to hook
        logger.debug("arfuse: GPU worker not hooked: %s", e)
        return
    original = Worker.load_model
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        get_communicator(self.vllm_config)
        return result

    setattr(load_model, _MARK, True)
    Worker.load_model = load_model
