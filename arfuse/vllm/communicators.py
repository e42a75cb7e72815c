"""The arfuse communicator of vLLM's tensor-parallel group, and what arfuse can serve there.

Shared by the plugin's hooks (arfuse.vllm.plugin), the fusion pass (arfuse.vllm.fusion), the slot
pass (arfuse.vllm.slot) and the eager call (arfuse.vllm.eager); it imports none of them, so no
import circle runs through it. One communicator per (tensor-parallel group, hidden size, dtype,
capacity) per process, created lazily and collectively (every rank asks at the same point).
"""

from __future__ import annotations

import threading
from typing import Any

from . import guard as _guard
from . import settings as _settings
from .guard import logger

_lock = threading.RLock()
# (tp group name, hidden, dtype, max_tokens, oneshot_max_tokens) -> arfuse.Communicator
_communicators: dict[tuple[Any, ...], Any] = {}




def model_parallel_ready() -> bool:
    """Whether vLLM has set its parallel groups up in this process."""
    from vllm.distributed import parallel_state as ps

    return bool(ps.model_parallel_is_initialized())


def tensor_parallel_size() -> int:
    """vLLM's tensor-parallel world size in this process (1 before vLLM set its groups up)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    return ps.get_tensor_model_parallel_world_size()


def plan(vllm_config: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The communicator this config wants: (registry key, constructor arguments), or None.
    Tensor parallelism 1 gets one too: a communicator of world size 1, for the local algorithm
    (no all-reduce; it allocates nothing)."""
    if vllm_config is None or vllm_config.model_config is None:
        return None
    if not model_parallel_ready():
        return None
    world = tensor_parallel_size()
    import arfuse
    from vllm.distributed.parallel_state import get_tp_group

    s = _settings.from_env()
    hidden = vllm_config.model_config.get_hidden_size()
    dtype = vllm_config.model_config.dtype
    if not arfuse.is_built():
        from .. import _lib

        _guard.disable(f"the compiled library is not available: {_lib.load_error()}")
        return None
    if not arfuse.supported(dtype, hidden, world):
        _guard.disable(f"no arfuse kernel for the model: dtype={dtype} hidden={hidden} "
                       f"world_size={world} (arfuse.supported_variants() lists what the library "
                       f"serves)")
        return None
    max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
    if s.max_tokens is not None:
        max_tokens = min(max_tokens, s.max_tokens)
    tp = get_tp_group()
    oneshot = oneshot_capacity(s, dtype, hidden, world, max_tokens, tp.device)
    key = (tp.unique_name, hidden, dtype, max_tokens, oneshot, s.pdl)
    kwargs = dict(
        group=tp.cpu_group,
        max_tokens=max_tokens,
        hidden=hidden,
        dtype=dtype,
        oneshot_max_tokens=oneshot,
        device=tp.device,
        timeout_s=float(s.timeout_s),
        pdl=s.pdl,
    )
    return key, kwargs


def oneshot_capacity(s: Any, dtype: Any, hidden: int, world: int, max_tokens: int,
                     device: Any) -> int | None:
    """The communicator's one-shot capacity (tokens): ARFUSE_VLLM_ONESHOT_MAX_TOKENS if set;
    max_tokens when ARFUSE_VLLM_ALGORITHM=oneshot forces one-shot for every call; else what auto
    can dispatch to one-shot on this card (arfuse.oneshot_threshold: the measured row for this
    dtype, hidden size and world size). The buffer holds three slots of max(N * this, ~2 *
    max_tokens) rows (Communicator.buffer_bytes), so sizing one-shot by auto's need rather than
    by max_tokens cuts it up to N/2 times (DeepSeek-V3 at TP 8, 8192 tokens: 2,688 -> 672 MiB by
    that rule; docs/vllm.md, "Memory at TP > 1").
    None at world size 1 (no buffer)."""
    if world <= 1:
        return None
    if s.oneshot_max_tokens is not None:
        return min(s.oneshot_max_tokens, max_tokens)
    if s.algorithm == "oneshot":
        return max_tokens
    import arfuse
    import torch

    card = torch.cuda.get_device_name(device) if torch.cuda.is_available() else None
    return max(1, min(max_tokens, arfuse.oneshot_threshold(dtype, hidden, world, card=card)))


def fp8_supported(dtype: Any, hidden: int, world_size: int, algorithm: str = "auto",
                  output: str = "fp8_static") -> bool:
    """Whether arfuse has a kernel with FP8 output `output` (fp8_static, fp8_group128) for
    (dtype, hidden, world size) and every algorithm that `algorithm` may dispatch to (auto:
    one-shot and two-shot; at world size 1 the local algorithm)."""
    import arfuse
    from arfuse._vocab import algorithms_for

    algorithms = algorithms_for(world_size) if algorithm == "auto" else (algorithm,)
    try:
        return all(
            arfuse.instance_for(dtype, hidden, world_size, a, output=output)
            for a in algorithms
        )
    except Exception as e:  # no library, or one that does not know the output kind
        logger.debug("arfuse: %s lookup failed: %s", output, e)
        return False


def algorithm_for(world_size: int, setting: str) -> str:
    """The algorithm the fused calls ask for: the setting (ARFUSE_VLLM_ALGORITHM), except at
    world size 1, which has no all-reduce and one algorithm: there a one-shot or two-shot
    setting is logged once and "auto" (the local algorithm) used instead."""
    from arfuse._vocab import LOCAL_ALGORITHMS

    if world_size != 1 or setting == "auto" or setting in LOCAL_ALGORITHMS:
        return setting
    global _warned_algorithm
    if not _warned_algorithm:
        _warned_algorithm = True
        logger.info("arfuse: %s=%s applies to tensor parallelism > 1; at tensor parallelism 1 "
                    "the fused calls run the local algorithm (no all-reduce)",
                    _settings.ALGORITHM_ENV, setting)
    return "auto"


_warned_algorithm = False


def get_communicator(vllm_config: Any, *, create: bool = True) -> Any | None:
    """The arfuse.Communicator for vLLM's tensor-parallel group and this config's model.

    None when there is nothing to fuse (vLLM's groups not set up, no model config) or arfuse does
    not serve the model's (dtype, hidden, world size); at tensor parallelism 1 it is a
    communicator of world size 1 (the local algorithm, no buffers). Creating it is collective:
    every rank of the group must ask at the same point (the hooks do). `create=False` only looks
    it up.
    """
    wanted = plan(vllm_config)
    if wanted is None:
        return None
    key, kwargs = wanted
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
        logger.info("arfuse: %r: one-shot up to %s tokens, buffer %.1f MiB per rank", comm,
                    comm.oneshot_max_tokens, comm.buffer_bytes / 2**20)
        if comm.world_size > 1 and comm.device.type == "cuda":
            from . import watch

            watch.watch(comm)  # a broken call stops this process instead of serving NaN
        return comm
