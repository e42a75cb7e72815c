"""Building the arfuse pass for a vLLM config and putting it into vLLM's post-grad pass list (the
PostGradPassManager.configure hook's body; arfuse.vllm.plugin installs the hook)."""

from __future__ import annotations

from typing import Any

from . import communicators as _comms
from . import settings as _settings


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


def after_configure(pass_manager: Any, result: Any, args: Any, kwargs: Any) -> Any:
    """The PostGradPassManager.configure hook: vLLM's configure ran, then this."""
    config = args[0] if args else kwargs.get("config")
    configure_pass_manager(pass_manager, config)
    return result
