"""The contract: what arfuse's vLLM integration uses of vLLM, one Item each, and what a check of one
found (Result, summarize). Data only.

Every name the plugin, the fusion pass, the eager call and the post_grad_custom_post_pass object
import from vLLM or hook in it is an Item here (tests/vllm/test_contract.py fails when a `vllm.`
import or a vLLM op name under arfuse/vllm/ is not), and the same table is checked

* at run time against the installed vLLM (``installed.check_installed``): by the plugin at
  start-up (the hook targets of a release not among SUPPORTED, the rows switch's items) and by
  tests/vllm/test_contract.py (everything); items it cannot import it reads from the installed
  sources (``source``, an AST index), and
* statically, release by release, from the released wheels' sources (scripts/vllm_contract.py,
  the tooling: it downloads each wheel and runs ``source`` over it; no torch, no install).

This package imports nothing but the standard library, so that the static checker can load it by
path without torch or vLLM.

Needs (what a missing item costs):
  hook  a plugin hook target: that hook is skipped with one log line. "one_of" groups are met when
        any member is there (the compile cache key: compute_hash up to 0.33, compile_factors 0.34).
  pass  the fusion pass or the eager call: the pass stays out of vLLM's pass list (one log line).
  slot  the official post_grad_custom_post_pass slot (docs/vllm.md).
  rows  the MoE finalize handed to arfuse (arfuse.vllm.moe_rows): that switch stays off (one log
        line); the pass and everything else work as without it.
  tests only the test harness (tests/vllm/vllm_harness.py); not the integration.
  info  reported only (what the eager call accepts from releases that have it).
"""

from __future__ import annotations

import dataclasses

# The releases the integration claims to support (all of 0.26.0 ... 0.34.0 on PyPI).
SUPPORTED = (
    "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0",
    "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0",
)  # fmt: skip
NEEDS_THAT_FAIL = ("hook", "pass", "slot", "rows")


@dataclasses.dataclass(frozen=True)
class Item:
    """One thing of vLLM the integration relies on.

    kind:
      module    the module exists (and imports; `cuda` modules are only read, see below)
      class / function / method / attr
                `name` (dotted inside `module`) exists; attr also finds `self.X = ...` in a method
                of the class or its bases; `params`: the parameter names expected (self included,
                `*`-prefixed for *args/**kwargs), compared in order
      field     a dataclass / pydantic field of the class `name.rsplit(".", 1)[0]`
      op        a custom op `ns::op` (name) registered in `module`; params: its argument names
      op_ref    `name` (an attribute chain like torch.ops._C.x) is referenced in `module`'s source
                (ops vLLM registers in C++: their schema is not in Python)
      op_schema `name`, a C++ op's schema string exactly as vLLM registers it, occurs in one of
                vLLM's kernel libraries (vllm/_C*.so; read as bytes, never loaded)
      code      every fragment of `fragments` occurs in the source of the function `name`
                (normalised by ast.unparse)
    strict: a changed signature counts as missing (the pass's patterns depend on the argument
      order); otherwise a changed signature is only reported ("changed"). A changed `code` item
      always counts.
    cuda: the module cannot be imported without vLLM's CUDA kernels (a GPU driver); the installed
      check reads its source instead of importing it.
    """

    key: str
    need: str
    kind: str
    module: str
    name: str = ""
    params: tuple[str, ...] | None = None
    strict: bool = False
    one_of: str = ""
    fragments: tuple[str, ...] = ()
    cuda: bool = False
    why: str = ""


_PM = "vllm.compilation.passes.pass_manager"
_IP = "vllm.compilation.passes.inductor_pass"
_VIP = "vllm.compilation.passes.vllm_inductor_pass"
_PS = "vllm.distributed.parallel_state"
_MOE = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
_FM = "vllm.model_executor.layers.fused_moe"
_MK = _FM + ".modular_kernel"
_TM = _FM + ".experts.triton_moe"
_WS = "vllm.v1.worker.workspace"
_FP8U = "vllm.model_executor.layers.quantization.utils.fp8_utils"
_MOE_PARAMS = (
    "hidden_states", "router_logits", "shared_experts_input", "input_ids", "layer_name",
    "hidden_dim_unpadded",
)  # fmt: skip

ITEMS: tuple[Item, ...] = (
    # ---- plugin hooks (arfuse.vllm.plugin) ------------------------------------------------------
    Item("hook.configure", "hook", "method", _PM, "PostGradPassManager.configure",
         ("self", "config"), why="the arfuse pass goes into vLLM's pass list after configure"),
    Item("hook.passes", "hook", "attr", _PM, "PostGradPassManager.passes",
         why="the list the configure hook inserts into"),
    Item("hook.cache_key.compute_hash", "hook", "method", "vllm.config", "VllmConfig.compute_hash",
         ("self",), one_of="cache_key",
         why="compile cache key up to 0.33 (0.30+: include_version=True keyword)"),
    Item("hook.cache_key.compile_factors", "hook", "method", "vllm.config",
         "VllmConfig.compile_factors", ("self", "include_version"), one_of="cache_key",
         why="compile cache key from 0.34 (hash_factors of these factors)"),
    Item("hook.worker", "hook", "method", "vllm.v1.worker.gpu_worker", "Worker.load_model",
         ("self", "load_dummy_weights"), cuda=True,
         why="the communicator is created after the weights are loaded"),
    Item("plugin.tp_group", "pass", "function", _PS, "get_tp_group", ()),
    Item("plugin.tp_initialized", "pass", "function", _PS, "model_parallel_is_initialized", ()),
    Item("plugin.tp_world_size", "pass", "function", _PS, "get_tensor_model_parallel_world_size",
         ()),
    Item("plugin.group.unique_name", "pass", "attr", _PS, "GroupCoordinator.unique_name"),
    Item("plugin.group.cpu_group", "pass", "attr", _PS, "GroupCoordinator.cpu_group"),
    Item("plugin.group.device", "pass", "attr", _PS, "GroupCoordinator.device"),
    Item("plugin.hidden_size", "pass", "method", "vllm.config.model",
         "ModelConfig.get_hidden_size", ("self",)),
    Item("plugin.max_num_batched_tokens", "pass", "field", "vllm.config.scheduler",
         "SchedulerConfig.max_num_batched_tokens"),
    # The arfuse pass goes in front of the first of these (by class name; their modules need CUDA).
    Item("order.allreduce_fusion", "pass", "class", "vllm.compilation.passes.fusion."
         "allreduce_rms_fusion", "AllReduceFusionPass", cuda=True,
         why="consumes all_reduce + rms_norm: the arfuse pass must run first"),
    Item("order.norm_quant_fusion", "pass", "class", "vllm.compilation.passes.fusion."
         "rms_quant_fusion", "RMSNormQuantFusionPass", cuda=True,
         why="consumes rms_norm + quant: the arfuse pass must run first"),
    Item("order.norm_reshape_fusion", "info", "class", "vllm.compilation.passes.fusion."
         "add_rms_fusion", "RMSNormReshapeFusionPass", cuda=True,
         why="0.27+, transformers backend: moves reshapes ahead of norms; arfuse goes first"),
    Item("order.passes_before_lowering", "pass", "code", _PM, "PostGradPassManager.__call__",
         fragments=("for pass_ in self.passes:", "pass_.is_applicable_for_range(compile_range)",
                    "self.ir_lowering(graph)"),
         why="the pass list runs (range-checked) before vLLM's IR lowering"),
    # ---- the fusion pass (arfuse.vllm.fusion) ----------------------------------------------------
    Item("pass.inductor_pass", "pass", "class", _IP, "InductorPass"),
    Item("pass.hash_source", "pass", "method", _IP, "InductorPass.hash_source", ("*srcs",)),
    Item("pass.hash_dict", "pass", "method", _IP, "InductorPass.hash_dict", ("dict_",)),
    Item("pass.fake_mode", "pass", "function", _IP, "enable_fake_mode", ("fn",)),
    Item("pass.vllm_inductor_pass", "pass", "method", _VIP, "VllmInductorPass.__init__",
         ("self", "config")),
    Item("pass.time_and_log", "pass", "method", _VIP, "VllmInductorPass.time_and_log",
         ("call_fn",)),
    Item("pass.model_dtype", "pass", "attr", _VIP, "VllmInductorPass.model_dtype"),
    Item("pass.device", "pass", "attr", _VIP, "VllmInductorPass.device"),
    Item("pass.pattern_matcher_pass", "pass", "class", _VIP, "VllmPatternMatcherPass"),
    Item("pass.match_table", "pass", "attr", _VIP, "VllmPatternMatcherPass.match_table"),
    Item("pass.dump_patterns", "pass", "method", _VIP, "VllmPatternMatcherPass.dump_patterns",
         ("self", "config", "pm_pass")),
    Item("pass.vllm_config", "pass", "class", "vllm.config", "VllmConfig"),
    Item("pass.range", "pass", "class", "vllm.config.utils", "Range"),
    Item("pass.ir_ops", "pass", "module", "vllm.ir.ops"),
    Item("op.all_reduce", "pass", "op", _PS, "vllm::all_reduce", ("tensor", "group_name"),
         strict=True),
    Item("op.rms_norm", "pass", "op", "vllm.ir.ops.layernorm", "vllm_ir::rms_norm",
         ("x", "weight", "epsilon", "variance_size"), strict=True),
    Item("op.fused_add_rms_norm", "pass", "op", "vllm.ir.ops.layernorm",
         "vllm_ir::fused_add_rms_norm", ("x", "x_residual", "weight", "epsilon", "variance_size"),
         strict=True),
    Item("op.moe_forward", "pass", "op", _MOE, "vllm::moe_forward", _MOE_PARAMS, strict=True),
    Item("op.moe_forward_shared", "pass", "op", _MOE, "vllm::moe_forward_shared", _MOE_PARAMS,
         strict=True),
    Item("op.static_scaled_fp8_quant", "pass", "op_ref", "vllm._custom_ops",
         "torch.ops._C.static_scaled_fp8_quant", why="the static FP8 quant folded into the call"),
    # The per-token-group-128 quant of FP8-block linear layers (fp8_fold.Group128Quant): the op,
    # its argument names (the graph's kwargs), how vLLM calls it and builds its scale buffer.
    Item("op.per_token_group_fp8_quant", "pass", "op_ref", _FP8U,
         "torch.ops._C.per_token_group_fp8_quant",
         why="the per-token-group FP8 quant folded into the call"),
    Item("op.per_token_group_fp8_quant.schema", "pass", "op_schema", "vllm",
         "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, "
         "int group_size, float eps, float fp8_min, float fp8_max, bool scale_ue8m0, "
         "bool dummy_is_scale_transposed, bool dummy_is_tma_aligned ) -> ()",
         why="the argument names the fold reads; the kernel's formula is arfuse's fp8_group128"),
    Item("pass.group_quant_call", "pass", "code", _FP8U, "per_token_group_quant_fp8",
         fragments=("eps: float=1e-10",
                    "x_s = torch.empty(shape, device=x.device, dtype=torch.float32)"
                    ".permute(-1, -2)",
                    "torch.ops._C.per_token_group_fp8_quant(x, x_q, x_s, group_size, eps, "
                    "fp8_min, fp8_max, use_ue8m0, column_major_scales, tma_aligned_scales)"),
         why="eps 1e-10; column-major scales as a transposed new buffer; the kernel's arguments"),
    Item("pass.quant_fp8_group_cuda", "pass", "code",
         "vllm.model_executor.layers.quantization.input_quant_fp8", "QuantFP8.forward_cuda",
         fragments=("fp8_utils.per_token_group_quant_fp8(x, group_size=self.group_size, "
                    "column_major_scales=self.column_major_scales",),
         why="a dynamic group QuantFP8 with the custom op on calls per_token_group_quant_fp8"),
    Item("info.block_models_quant_fp8", "info", "code", "vllm.config", "VllmConfig.__post_init__",
         fragments=("custom_ops.append('+quant_fp8')",),
         why="vLLM turns the quant_fp8 custom op on for models with block weights"),
    Item("pass.moe_tail", "pass", "method", _MOE, "MoERunner.forward",
         why="routed scale + shared add + all-reduce: the MoE tail the patterns match"),
    Item("pass.quant_fp8_native", "pass", "method",
         "vllm.model_executor.layers.quantization.input_quant_fp8", "QuantFP8.forward_native",
         why="the native static FP8 quant form the FP8 fold matches"),
    # ---- the eager call (arfuse.vllm.eager) ------------------------------------------------------
    Item("eager.rms_norm", "pass", "class", "vllm.model_executor.layers.layernorm", "RMSNorm"),
    Item("eager.gemma_rms_norm", "pass", "class", "vllm.model_executor.layers.layernorm",
         "GemmaRMSNorm"),
    Item("eager.current_config", "pass", "function", "vllm.config", "get_current_vllm_config", ()),
    Item("eager.all_reduce", "pass", "function", "vllm.distributed",
         "tensor_model_parallel_all_reduce", ("input_",)),
    Item("eager.ir_fused_add_rms_norm", "pass", "attr", "vllm.ir.ops", "fused_add_rms_norm"),
    # vLLM's unfinalized MoE output, read by field name (0.28+; 0.33 adds route_major, a hint:
    # the permute map stays valid). Absent from 0.26/0.27 by design, hence only "info".
    *(Item(f"eager.unfinalized.{f}", "info", "field",
           "vllm.model_executor.layers.fused_moe.moe_output", f"UnfinalizedMoEOutput.{f}")
      for f in ("gemm2_permuted", "expert_weights", "expanded_idx_to_permuted_idx")),
    *(Item(f"eager.moe_output.{f}", "info", "field",
           "vllm.model_executor.layers.fused_moe.moe_output", f"MoEOutput.{f}")
      for f in ("routed", "shared_output", "routed_scaling_factor")),
    # ---- the MoE finalize handed to arfuse (arfuse.vllm.moe_rows) ---------------------------------
    Item("rows.runner", "rows", "class", _MOE, "MoERunner"),
    Item("rows.entry_call", "rows", "code", _MOE, "MoERunner.forward",
         fragments=("self._forward_entry(",),
         why="MoERunner.forward calls the op through _forward_entry, which the switch replaces"),
    Item("rows.entry_set", "rows", "code", _MOE, "MoERunner.__init__",
         fragments=("self._forward_entry = self._select_forward()",)),
    Item("rows.forward_impl", "rows", "method", _MOE, "MoERunner._forward_impl",
         ("self", "hidden_states", "router_logits", "shared_experts_input", "input_ids"),
         strict=True, why="the rows op runs vLLM's own _forward_impl"),
    Item("rows.forward_modular_call", "rows", "code", _MOE, "MoERunner._apply_quant_method",
         fragments=("self.routed_experts.forward_modular(",),
         why="the one call the rows op redirects (an instance attribute for that call)"),
    Item("rows.get_layer", "rows", "function", _MOE, "get_layer_from_name", ("layer_name",)),
    Item("rows.resolve_layer_name", "rows", "function", _MOE, "_resolve_layer_name",
         ("layer_name",)),
    Item("rows.layer_name_type", "rows", "attr", _MOE, "_layer_name_type"),
    Item("rows.register_op", "rows", "function", "vllm.utils.torch_utils",
         "direct_register_custom_op",
         ("op_name", "op_func", "mutates_args", "fake_impl", "target_lib", "dispatch_key", "tags")),
    Item("rows.resize_cache", "rows", "function", _FM + ".utils", "_resize_cache", ("x", "v")),
    Item("rows.workspace_manager", "rows", "function", _WS, "current_workspace_manager", ()),
    Item("rows.workspace_initialized", "rows", "function", _WS,
         "is_workspace_manager_initialized", ()),
    Item("rows.get_simultaneous", "rows", "method", _WS, "WorkspaceManager.get_simultaneous",
         ("self", "*shapes_and_dtypes")),
    Item("rows.modular_impl", "rows", "class", _MK, "FusedMoEKernelModularImpl"),
    Item("rows.prepare", "rows", "method", _MK, "FusedMoEKernelModularImpl._prepare",
         ("self", "hidden_states", "topk_weights", "topk_ids", "global_num_experts", "expert_map",
          "apply_router_weight_on_input"), strict=True),
    Item("rows.problem_size", "rows", "method", _MK, "FusedMoEExpertsModular.moe_problem_size",
         ("self", "a1", "w1", "w2", "topk_ids"), strict=True),
    Item("rows.workspace_dtype", "rows", "method", _MK, "FusedMoEExpertsModular.workspace_dtype",
         ("self", "act_dtype"), strict=True),
    Item("rows.workspace_shapes", "rows", "method", _MK,
         "FusedMoEExpertsModular.workspace_shapes",
         ("self", "M", "N", "K", "topk", "global_num_experts", "local_num_experts",
          "expert_tokens_meta", "activation"), strict=True),
    Item("rows.a2_scale", "rows", "attr", _MK, "FusedMoEExperts.a2_scale"),
    Item("rows.kernel_impl", "rows", "attr", _MK, "FusedMoEKernel.impl"),
    Item("rows.kernel_experts", "rows", "attr", _MK, "FusedMoEKernel.fused_experts"),
    Item("rows.kernel_prepare_finalize", "rows", "attr", _MK, "FusedMoEKernel.prepare_finalize"),
    Item("rows.kernel_reduced", "rows", "method", _MK, "FusedMoEKernel.output_is_reduced",
         ("self",)),
    Item("rows.triton_experts", "rows", "class", _TM, "TritonExperts", cuda=True),
    Item("rows.triton_apply", "rows", "method", _TM, "TritonExperts.apply",
         ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
          "global_num_experts", "expert_map", "a1q_scale", "a2_scale", "workspace13",
          "workspace2", "expert_tokens_meta", "apply_router_weight_on_input"), strict=True,
         cuda=True),
    Item("rows.cache3", "rows", "code", _TM, "TritonExperts.apply",
         fragments=("intermediate_cache3 = _resize_cache(workspace2",),
         why="the rows are the first T*K*H elements of workspace2"),
    Item("rows.moe_sum", "rows", "method", _TM, "TritonExperts.moe_sum", cuda=True),
    Item("rows.no_dp_ep", "rows", "class", _FM + ".prepare_finalize.no_dp_ep",
         "MoEPrepareAndFinalizeNoDPEPModular"),
    Item("rows.routed_experts", "rows", "class", _FM + ".routed_experts", "RoutedExperts"),
    Item("rows.zero_expert_router", "rows", "class", _FM + ".router.zero_expert_router",
         "ZeroExpertRouter"),
    Item("rows.unquantized", "rows", "class", _FM + ".unquantized_fused_moe_method",
         "UnquantizedFusedMoEMethod"),
    Item("rows.fp8", "rows", "class", "vllm.model_executor.layers.quantization.fp8",
         "Fp8MoEMethod", cuda=True),
    Item("rows.ct_fp8", "rows", "class", "vllm.model_executor.layers.quantization."
         "compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_fp8",
         "CompressedTensorsW8A8Fp8MoEMethod", cuda=True),
    Item("rows.static_moe_layers", "rows", "field", "vllm.config.compilation",
         "CompilationConfig.static_all_moe_layers"),
    Item("rows.static_forward_context", "rows", "field", "vllm.config.compilation",
         "CompilationConfig.static_forward_context"),
    *(Item(f"rows.moe_config.{f}", "rows", "field", _FM + ".config", f"FusedMoEConfig.{f}")
      for f in ("experts_per_token", "hidden_dim", "hidden_dim_unpadded", "moe_parallel_config",
                "is_lora_enabled", "skip_final_all_reduce")),
    *(Item(f"rows.moe_config.{f}", "rows", "attr", _FM + ".config", f"FusedMoEConfig.{f}")
      for f in ("dp_size", "pcp_size", "ep_size", "is_sequence_parallel")),
    *(Item(f"rows.runner.{a}", "rows", "attr", _MOE, f"MoERunner.{a}")
      for a in ("routed_experts", "moe_config", "router", "routed_input_transform",
                "routed_output_transform", "enable_dbo", "shared_experts")),
    *(Item(f"rows.routed.{a}", "rows", "attr", _FM + ".routed_experts", f"RoutedExperts.{a}")
      for a in ("quant_method", "activation", "global_num_experts", "expert_map",
                "apply_router_weight_on_input")),
    Item("rows.routed.weights", "rows", "code", _FM + ".unquantized_fused_moe_method",
         "UnquantizedFusedMoEMethod.forward_native",
         fragments=("self.moe_kernel.apply(", "layer.w13_weight", "layer.w2_weight"),
         why="the weights the quant method passes to its kernel are the layer's w13/w2_weight "
             "parameters (registered on the routed experts by create_weights)"),
    *(Item(f"rows.quant_method.{a}", "rows", "attr", _FM + ".fused_moe_method_base",
           f"FusedMoEMethodBase.{a}")
      for a in ("is_monolithic", "moe_kernel", "has_unpadded_output")),
    Item("rows.parallel.use_ep", "rows", "field", _FM + ".config",
         "FusedMoEParallelConfig.use_ep"),
    Item("rows.parallel.all2all", "rows", "attr", _FM + ".config",
         "FusedMoEParallelConfig.use_all2all_kernels"),
    # ---- the post_grad_custom_post_pass slot (arfuse.vllm.slot) ----------------------------------
    Item("slot.inductor_passes", "slot", "field", "vllm.config.compilation",
         "CompilationConfig.inductor_passes"),
    Item("slot.resolution", "slot", "code", "vllm.config.compilation",
         "CompilationConfig.__post_init__",
         fragments=("__import__(module).__dict__[func_name]", "isinstance(func, InductorPass)"),
         why="a qualified name resolves to an attribute of a top-level module; an InductorPass "
             "instance is used as it is"),
    Item("slot.backend_adds", "slot", "code", "vllm.compilation.backends",
         "VllmBackend.configure_post_pass",
         fragments=("self.pass_manager.configure(self.vllm_config)", "self.pass_manager.add("),
         why="the slot's pass is appended after vLLM's own passes"),
    Item("slot.pass_manager_add", "slot", "method", _PM, "PostGradPassManager.add",
         ("self", "pass_")),
    Item("slot.current_config", "slot", "function", "vllm.config", "get_current_vllm_config_or_none",
         ()),
    Item("slot.fuse_allreduce_rms", "slot", "field", "vllm.config.compilation",
         "PassConfig.fuse_allreduce_rms", why="must be off for the slot to see the chain"),
    Item("slot.fuse_norm_quant", "slot", "field", "vllm.config.compilation",
         "PassConfig.fuse_norm_quant", why="must be off for the slot to see norm + FP8 quant"),
    # ---- the test harness (tests/vllm) -----------------------------------------------------------
    Item("tests.load_general_plugins", "tests", "function", "vllm.plugins",
         "load_general_plugins", ()),
    Item("tests.compilation_config", "tests", "class", "vllm.config", "CompilationConfig"),
    Item("tests.device_config", "tests", "class", "vllm.config", "DeviceConfig"),
    Item("tests.model_config", "tests", "class", "vllm.config", "ModelConfig"),
    Item("tests.set_current_config", "tests", "function", "vllm.config", "set_current_vllm_config",
         ("vllm_config", "check_compile", "prefix")),
    Item("tests.pass_config", "tests", "class", "vllm.config.compilation", "PassConfig"),
    Item("tests.eliminate_noops", "tests", "field", "vllm.config.compilation",
         "PassConfig.eliminate_noops"),
    Item("tests.init_distributed", "tests", "function", _PS, "init_distributed_environment"),
    Item("tests.init_model_parallel", "tests", "function", _PS, "initialize_model_parallel"),
    Item("tests.device_communicator", "tests", "method",
         "vllm.distributed.device_communicators.base_device_communicator",
         "DeviceCommunicatorBase.all_reduce", ("self", "input_")),
    Item("tests.moe_runner_interface", "tests", "class",
         "vllm.model_executor.layers.fused_moe.runner.moe_runner_interface", "MoERunnerInterface"),
    Item("tests.layer_name", "tests", "class", "vllm.utils.torch_utils", "LayerName"),
    Item("tests.use_layer_name", "tests", "attr", "vllm.utils.torch_utils", "_USE_LAYERNAME"),
    Item("tests.pass_context", "tests", "function", _IP, "pass_context", ("compile_range",)),
    Item("tests.ir_functionalization", "tests", "class",
         "vllm.compilation.passes.ir.inplace_functionalization",
         "VllmIRInplaceFunctionalizationPass"),
    Item("tests.strides_patch", "tests", "function", "vllm.env_override",
         "_apply_constrain_to_fx_strides_patch", ()),
    Item("tests.forward_context", "tests", "function", "vllm.forward_context",
         "set_forward_context"),
    Item("tests.post_grad_pass_manager", "tests", "class", _PM, "PostGradPassManager"),
    Item("tests.fix_functionalization", "tests", "attr", _PM,
         "PostGradPassManager.fix_functionalization"),
)

BY_KEY = {i.key: i for i in ITEMS}
assert len(BY_KEY) == len(ITEMS), "duplicate contract keys"


@dataclasses.dataclass
class Result:
    """What a check found for one item: status ok / changed / missing, and the detail."""

    item: Item
    status: str
    detail: str = ""
    how: str = ""  # "import" or "source" (installed check); "wheel" (static check)


def summarize(results: list[Result]) -> list[str]:
    """The reasons the integration cannot run as claimed: a missing item of a failing need (one_of
    groups: only when every member is missing), a strict item whose signature changed, or a code
    item whose fragments are gone."""
    problems: list[str] = []
    groups: dict[str, list[Result]] = {}
    for r in results:
        if r.item.need not in NEEDS_THAT_FAIL:
            continue
        if r.item.one_of:
            groups.setdefault(r.item.one_of, []).append(r)
            continue
        failing_change = r.item.strict or r.item.kind == "code"
        if r.status == "missing" or (r.status == "changed" and failing_change):
            problems.append(f"{r.item.key}: {r.status} {r.detail}".rstrip())
    for name, members in groups.items():
        if all(m.status == "missing" for m in members):
            problems.append(f"{name}: none of {', '.join(m.item.key for m in members)}")
    return problems
