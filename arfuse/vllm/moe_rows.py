"""The MoE finalize handed to arfuse: vLLM's MoE layers return their unfinalized expert rows.

vLLM runs each MoE layer as one opaque custom op (vllm::moe_forward / moe_forward_shared) that
finalizes inside (TritonExperts' moe_sum: the top-k sum of the router-weighted GEMM2 rows), so
the graph only ever holds the finalized [T, H]. For eligible layers (`ineligible` says which),
this module swaps the op MoERunner.forward calls (the runner's `_forward_entry`) for an op pair
mirroring vLLM's —

    arfuse_vllm::moe_forward_rows(hidden_states, router_logits, shared_experts_input, input_ids,
                                  layer_name, top_k) -> rows [T, top_k, H]
    arfuse_vllm::moe_forward_shared_rows(...) -> (shared [T, H], rows [T, top_k, H])

— followed by `rows.sum(dim=1)` as a visible graph op; the rest of MoERunner.forward (routed
scale, shared add, all-reduce) stays vLLM's own code. The fusion pass (arfuse.vllm.patterns,
the Rows* patterns) then replaces `rows -> sum -> (* rsf) -> (+ shared) -> all_reduce -> norm`
by one arfuse call on the dense rows (expert_weights None: the router weights are in the rows).
Where no pattern matches, Inductor computes the sum itself: the graph stays correct and does the
work vLLM's moe_sum did.

How the rows are made (the same code for vLLM 0.26.0 ... 0.34.0; every private name it touches
is an item of arfuse.vllm.contract, need "rows"): the op runs vLLM's own
MoERunner._forward_impl (gate, router, shared experts and their stream protocol unchanged) with
that one call's routed_experts.forward_modular redirected to `triton_rows`: vLLM's modular kernel
prepare step (input quantization for FP8 block models), then TritonExperts.apply on a shallow
copy whose moe_sum does nothing, with a freshly allocated workspace2 — its first T*K*H elements
are intermediate_cache3, the rows — so the rows never alias vLLM's shared workspace; the finalize
step (a copy, 0.26 only) is skipped. Research and per-release line map: docs/vllm.md.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
from collections import Counter
from typing import Any

import torch

from .guard import logger

NAMESPACE = "arfuse_vllm"
_lock = threading.Lock()
_library: Any = None
# runner -> the _forward_entry vLLM gave it (restore() puts it back).
_original: dict[Any, Any] = {}


# ---- the rows ------------------------------------------------------------------------------------


def _no_topk_sum(*args: Any, **kwargs: Any) -> None:
    """Stands in for TritonExperts.moe_sum: (input, output) up to 0.30, (input, output, topk_ids,
    expert_map) from 0.31; 0.33+ reaches it through _finalize_expert_output."""
    return None


def _workspace13(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """workspace13 (GEMM1's activation output, dead once apply returns) from vLLM's shared
    workspace, asked for no more than vLLM's own _allocate_buffers asks; fresh where vLLM has no
    workspace manager (its CPU worker starts none). Decided by the manager, not by the device: a
    process that has one on the CPU (the tests) then allocates as a GPU worker does."""
    from vllm.v1.worker import workspace as ws

    if not ws.is_workspace_manager_initialized():
        return torch.empty((n,), dtype=dtype, device=device)
    (buf,) = ws.current_workspace_manager().get_simultaneous(((n,), dtype))
    return buf


def triton_rows(kernel: Any, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any,
                global_num_experts: int, expert_map: torch.Tensor | None,
                apply_router_weight_on_input: bool) -> torch.Tensor:
    """[T, top_k, H] router-weighted GEMM2 rows of vLLM's TritonExperts (intermediate_cache3) in a
    fresh buffer: vLLM's prepare step, its experts' apply without moe_sum, no finalize."""
    from vllm.model_executor.layers.fused_moe.utils import _resize_cache

    impl = kernel.impl
    experts = impl.fused_experts
    local_num_experts = w1.shape[0]
    if global_num_experts == -1:
        global_num_experts = local_num_experts
    a1q, a1q_scale, meta, topk_ids, topk_weights = impl._prepare(
        hidden_states, topk_weights, topk_ids, global_num_experts, expert_map,
        apply_router_weight_on_input)
    _, M, N, K, top_k = experts.moe_problem_size(a1q, w1, w2, topk_ids)
    dtype = experts.workspace_dtype(hidden_states.dtype)
    if M == 0:
        return hidden_states.new_empty((0, top_k, K), dtype=dtype)
    ws13_shape, ws2_shape, out_shape = experts.workspace_shapes(
        M, N, K, top_k, global_num_experts, local_num_experts, meta, activation)
    common = _workspace13(max(math.prod(ws13_shape), math.prod(out_shape)), dtype, a1q.device)
    workspace13 = _resize_cache(common, ws13_shape)
    unused_output = _resize_cache(common, out_shape)
    # workspace2 holds intermediate_cache1, then intermediate_cache3 = the rows: fresh memory.
    workspace2 = torch.empty(ws2_shape, dtype=dtype, device=a1q.device)
    rows = _resize_cache(workspace2, (M, top_k, K))
    rows_experts = copy.copy(experts)  # shallow (same weights); vLLM's own object untouched
    rows_experts.moe_sum = _no_topk_sum
    rows_experts.apply(
        output=unused_output, hidden_states=a1q, w1=w1, w2=w2, topk_weights=topk_weights,
        topk_ids=topk_ids, activation=activation, global_num_experts=global_num_experts,
        expert_map=expert_map, a1q_scale=a1q_scale, a2_scale=experts.a2_scale,
        workspace13=workspace13, workspace2=workspace2, expert_tokens_meta=meta,
        apply_router_weight_on_input=apply_router_weight_on_input)
    return rows


def forward_rows(runner: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                 shared_experts_input: torch.Tensor | None, input_ids: torch.Tensor | None) -> Any:
    """vLLM's own MoERunner._forward_impl with this call's routed_experts.forward_modular
    redirected to triton_rows. Returns rows, or (shared_out, rows) for a layer with shared
    experts."""
    routed = runner.routed_experts

    def forward_modular(x, topk_weights, topk_ids, shared_experts=None,
                        shared_experts_input=None):
        # What UnquantizedFusedMoEMethod / Fp8MoEMethod / CompressedTensorsW8A8Fp8MoEMethod pass
        # to their moe_kernel.apply (0.26.0 ... 0.34.0).
        return triton_rows(
            routed.quant_method.moe_kernel, x, routed.w13_weight, routed.w2_weight, topk_weights,
            topk_ids, routed.activation, routed.global_num_experts, routed.expert_map,
            routed.apply_router_weight_on_input)

    routed.forward_modular = forward_modular  # an instance attribute, for this call only
    try:
        return runner._forward_impl(hidden_states, router_logits, shared_experts_input, input_ids)
    finally:
        del routed.forward_modular


# ---- the op pair -------------------------------------------------------------------------------


def register_ops() -> None:
    """Registers arfuse_vllm::moe_forward_rows / moe_forward_shared_rows once per process."""
    global _library
    with _lock:
        if _library is not None:
            return
        from vllm.model_executor.layers.fused_moe.runner import moe_runner as mr
        from vllm.utils.torch_utils import direct_register_custom_op

        layer_name_type = mr._layer_name_type

        def moe_forward_rows(hidden_states: torch.Tensor, router_logits: torch.Tensor,
                             shared_experts_input: torch.Tensor | None,
                             input_ids: torch.Tensor | None, layer_name: layer_name_type,
                             top_k: int) -> torch.Tensor:
            runner = mr.get_layer_from_name(mr._resolve_layer_name(layer_name))
            return forward_rows(runner, hidden_states, router_logits, shared_experts_input,
                                input_ids)

        def moe_forward_rows_fake(hidden_states, router_logits, shared_experts_input, input_ids,
                                  layer_name, top_k):
            return hidden_states.new_empty((hidden_states.shape[0], top_k,
                                            hidden_states.shape[-1]))

        def moe_forward_shared_rows(hidden_states: torch.Tensor, router_logits: torch.Tensor,
                                    shared_experts_input: torch.Tensor | None,
                                    input_ids: torch.Tensor | None, layer_name: layer_name_type,
                                    top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
            runner = mr.get_layer_from_name(mr._resolve_layer_name(layer_name))
            return forward_rows(runner, hidden_states, router_logits, shared_experts_input,
                                input_ids)

        def moe_forward_shared_rows_fake(hidden_states, router_logits, shared_experts_input,
                                         input_ids, layer_name, top_k):
            shared_in = hidden_states if shared_experts_input is None else shared_experts_input
            return (torch.empty_like(shared_in),
                    moe_forward_rows_fake(hidden_states, router_logits, shared_experts_input,
                                          input_ids, layer_name, top_k))

        # vLLM's MoE ops carry the stride tag of their torch (needs_fixed_stride_order up to the
        # torch of vLLM 0.32, needs_exact_strides later): TritonExperts wants a contiguous input.
        tag = getattr(torch.Tag, "needs_exact_strides", None) or torch.Tag.needs_fixed_stride_order
        # The layer name's type is vLLM's own (a LayerName opaque object on torch >= 2.11, else
        # str); the string annotations (PEP 563 in this module) cannot name it.
        for fn in (moe_forward_rows, moe_forward_shared_rows):
            fn.__annotations__["layer_name"] = layer_name_type
        lib = torch.library.Library(NAMESPACE, "FRAGMENT")
        for name, fn, fake in (("moe_forward_rows", moe_forward_rows, moe_forward_rows_fake),
                               ("moe_forward_shared_rows", moe_forward_shared_rows,
                                moe_forward_shared_rows_fake)):
            direct_register_custom_op(name, fn, mutates_args=[], fake_impl=fake, target_lib=lib,
                                      dispatch_key="CompositeExplicitAutograd", tags=(tag,))
        _library = lib


def rows_entry(runner: Any) -> Any:
    """What replaces runner._forward_entry: the same six arguments as vllm::moe_forward, the
    rows op, then the top-k sum as a graph op (MoERunner.forward continues unchanged)."""
    register_ops()
    top_k = int(runner.moe_config.experts_per_token)
    ops = getattr(torch.ops, NAMESPACE)
    if runner.shared_experts is not None:
        def entry(hidden_states, router_logits, shared_experts_input, input_ids, layer_name,
                  hidden_dim_unpadded):
            shared, rows = ops.moe_forward_shared_rows(
                hidden_states, router_logits, shared_experts_input, input_ids, layer_name, top_k)
            return shared, rows.sum(dim=1)
    else:
        def entry(hidden_states, router_logits, shared_experts_input, input_ids, layer_name,
                  hidden_dim_unpadded):
            rows = ops.moe_forward_rows(
                hidden_states, router_logits, shared_experts_input, input_ids, layer_name, top_k)
            return rows.sum(dim=1)
    entry.arfuse_rows = True  # type: ignore[attr-defined]
    return entry


# ---- which layers ------------------------------------------------------------------------------


def _allowed_quant_methods() -> tuple[type, ...]:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    allowed: list[type] = [UnquantizedFusedMoEMethod]
    with contextlib.suppress(ImportError):  # their modules may need vLLM's CUDA kernels
        from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

        allowed.append(Fp8MoEMethod)
    with contextlib.suppress(ImportError):
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_fp8 import (  # noqa: E501
            CompressedTensorsW8A8Fp8MoEMethod,
        )

        allowed.append(CompressedTensorsW8A8Fp8MoEMethod)
    return tuple(allowed)


def ineligible(runner: Any) -> list[str]:
    """Why this MoE layer keeps vLLM's own path (empty: its rows can go to arfuse). Eligible: a
    plain MoERunner whose experts are vLLM's TritonExperts (bf16 or FP8-block) on the
    no-DP/EP modular path, tensor-parallel only (any size, 1 included: there the tail has no
    all-reduce), no LoRA, nothing between the experts and the all-reduce (or, at tensor
    parallelism 1, the next norm) but the routed scale and the shared add."""
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
        MoEPrepareAndFinalizeNoDPEPModular,
    )
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.router.zero_expert_router import ZeroExpertRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    why: list[str] = []
    if type(runner) is not MoERunner:
        return [f"runner {type(runner).__name__}"]
    cfg = runner.moe_config
    pc = cfg.moe_parallel_config
    routed = runner.routed_experts
    if type(routed) is not RoutedExperts:
        return [f"routed experts {type(routed).__name__}"]
    qm = routed.quant_method
    if type(qm) not in _allowed_quant_methods():
        why.append(f"quant method {type(qm).__name__}")
    kernel = getattr(qm, "moe_kernel", None)
    if qm.is_monolithic or kernel is None or not isinstance(kernel.impl,
                                                            mk.FusedMoEKernelModularImpl):
        why.append("experts finalize inside one kernel (not vLLM's modular Triton path)")
    else:
        ex = kernel.fused_experts
        if type(ex) is not TritonExperts:
            why.append(f"experts {type(ex).__name__}, not TritonExperts")
        if type(kernel.prepare_finalize) is not MoEPrepareAndFinalizeNoDPEPModular:
            why.append(f"prepare/finalize {type(kernel.prepare_finalize).__name__} (DP/EP)")
        if getattr(ex, "_lora_context", None) is not None:
            why.append("LoRA")
        if getattr(ex, "post_gemm2_hook", None) is not None:  # 0.33+
            why.append("a post-GEMM2 hook")
        if kernel.output_is_reduced():
            why.append("the kernel reduces its output itself")
    if cfg.is_lora_enabled and "LoRA" not in why:
        why.append("LoRA")
    if cfg.dp_size != 1 or cfg.pcp_size != 1 or cfg.ep_size != 1 or pc.use_ep:
        why.append(f"dp={cfg.dp_size} pcp={cfg.pcp_size} ep={cfg.ep_size}")
    if pc.use_all2all_kernels:
        why.append("all2all kernels")
    if routed.expert_map is not None:
        why.append("an expert map (EP)")
    if cfg.is_sequence_parallel:
        why.append("sequence-parallel MoE")
    if cfg.skip_final_all_reduce:
        why.append("no final all-reduce")
    if runner.routed_input_transform is not None or runner.routed_output_transform is not None:
        why.append("a routed input/output transform (latent MoE)")
    if cfg.hidden_dim_unpadded not in (None, cfg.hidden_dim) or qm.has_unpadded_output:
        why.append("padded hidden size")
    if isinstance(runner.router, ZeroExpertRouter):
        why.append("zero experts")
    if routed.apply_router_weight_on_input:
        why.append("router weights on the input")
    if runner.enable_dbo:
        why.append("dual-batch overlap")
    return why


def moe_runners(vllm_config: Any) -> dict[str, Any]:
    """The MoE layers vLLM registered for its MoE ops, by layer name."""
    cc = vllm_config.compilation_config
    return {name: cc.static_forward_context[name] for name in cc.static_all_moe_layers
            if name in cc.static_forward_context}


def switch(vllm_config: Any) -> tuple[list[str], dict[str, list[str]]]:
    """Hands the finalize of every eligible MoE layer of the model to arfuse (installs
    rows_entry); returns (switched layer names, {kept layer name: reasons}) and logs one line
    per model: how many layers were switched and why the others were not."""
    switched: list[str] = []
    kept: dict[str, list[str]] = {}
    for name, runner in moe_runners(vllm_config).items():
        if getattr(runner._forward_entry, "arfuse_rows", False):
            switched.append(name)
            continue
        why = ineligible(runner)
        if why:
            kept[name] = why
            continue
        with _lock:
            _original[runner] = runner._forward_entry
        runner._forward_entry = rows_entry(runner)
        switched.append(name)
    model = getattr(vllm_config.model_config, "architecture", None) or "the model"
    total = len(switched) + len(kept)
    if total:
        reasons = Counter("; ".join(w) for w in kept.values())
        detail = "; ".join(f"{n} layer(s): {r}" for r, n in reasons.most_common())
        logger.info("arfuse: MoE finalize handed to arfuse in %d of %d MoE layers of %s%s",
                    len(switched), total, model,
                    f"; vLLM's path kept for {detail}" if kept else "")
    return switched, kept


def restore(vllm_config: Any) -> int:
    """Puts vLLM's own _forward_entry back on every switched layer; returns how many."""
    n = 0
    for runner in moe_runners(vllm_config).values():
        with _lock:
            entry = _original.pop(runner, None)
        if entry is not None:
            runner._forward_entry = entry
            n += 1
    return n
