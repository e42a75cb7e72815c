"""arfuse's pass for vLLM's `post_grad_custom_post_pass` slot, as a top-level module.

vLLM resolves `CompilationConfig.inductor_passes` names with `__import__(module).__dict__[name]`,
which finds only attributes of a top-level module, so the object lives here:

    --compilation-config '{"inductor_passes":
        {"post_grad_custom_post_pass": "arfuse_vllm_pass.post_grad_pass"},
        "pass_config": {"fuse_allreduce_rms": false, "fuse_norm_quant": false}}'

See arfuse.vllm.slot and docs/vllm.md.
"""

from arfuse.vllm.slot import post_grad_pass

__all__ = ["post_grad_pass"]
