"""arfuse's vLLM integration (vLLM 0.26.0 ... 0.34.0; docs/vllm.md, arfuse/vllm/contract/).

* ArfuseAllReduceFusionPass (arfuse.vllm.fusion): a VllmPatternMatcherPass for vLLM's post-grad
  pass manager that replaces all_reduce + rms_norm / fused_add_rms_norm (and the MoE tail before
  them) by torch.ops.arfuse.fused.
* moe_finalize_allreduce_rms_norm (arfuse.vllm.eager): the same fusion as an eager call.
* register (arfuse.vllm.plugin): the `vllm.general_plugins` entry point, enabled by ARFUSE_VLLM=1.
* post_grad_pass (arfuse.vllm.slot; top-level alias arfuse_vllm_pass.post_grad_pass): the object
  for vLLM's official CompilationConfig.inductor_passes["post_grad_custom_post_pass"] slot.

Attributes load their module on first use, so that vLLM's plugin loader importing
arfuse.vllm.plugin pulls in neither vLLM's compiler stack nor the compiled library while the
integration is off.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ArfuseAllReduceFusionPass": "fusion",
    "moe_finalize_allreduce_rms_norm": "eager",
    "register": "plugin",
    "get_communicator": "communicators",
    "post_grad_pass": "slot",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
