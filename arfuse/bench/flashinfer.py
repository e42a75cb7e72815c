"""FlashInfer's TRT-LLM all-reduce fusion as the benchmark calls it (under torchrun only): one wrapper
over its unified API and its older trtllm_* functions."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist


class FlashInfer:
    """Thin wrapper over FlashInfer's TRT-LLM all-reduce fusion (unified API when present,
    the older trtllm_* functions otherwise)."""

    def __init__(self, setup, max_tokens: int):  # setup: the run's group.Setup
        import flashinfer
        import flashinfer.comm as fc
        self.version = getattr(flashinfer, "__version__", "?")
        self.fc, self.setup = fc, setup
        self.P = fc.AllReduceFusionPattern
        self.ws = self.ws_tensor = self.ipc = None
        dt, H, N, r = setup.dtype, setup.args.hidden, setup.world_size, setup.rank
        if hasattr(fc, "allreduce_fusion") and hasattr(fc, "create_allreduce_fusion_workspace"):
            self.kind = "unified"
            self.ws = fc.create_allreduce_fusion_workspace(
                backend="trtllm", world_size=N, rank=r, max_token_num=max_tokens,
                hidden_dim=H, dtype=dt)
        else:
            self.kind = "legacy"
            res = fc.trtllm_create_ipc_workspace_for_all_reduce_fusion(
                r, N, max_tokens, H, use_fp32_lamport=(dt == torch.float32),
                group=dist.group.WORLD)
            self.ipc, self.ws_tensor = res[0], res[1]

    def close(self):
        try:
            if self.ws is not None:
                self.ws.destroy()
            elif self.ipc is not None:
                fn = getattr(self.fc, "trtllm_destroy_ipc_workspace_for_all_reduce_fusion", None)
                if fn:
                    fn(self.ipc, dist.group.WORLD)
        except Exception:
            pass

    def pattern1(self, x, residual, gamma, eps, norm_out, resid_out, use_oneshot):
        T, H = x.shape
        if self.kind == "unified":
            self.fc.allreduce_fusion(
                input=x, workspace=self.ws, pattern=self.P.kARResidualRMSNorm,
                launch_with_pdl=False, residual_out=resid_out, norm_out=norm_out,
                residual_in=residual, rms_gamma=gamma, rms_eps=eps, use_oneshot=use_oneshot,
                fp32_acc=True)
        else:
            self.fc.trtllm_allreduce_fusion(
                allreduce_in=x, world_size=self.setup.world_size, world_rank=self.setup.rank,
                token_num=T, hidden_dim=H, workspace_ptrs=self.ws_tensor,
                launch_with_pdl=False, use_oneshot=use_oneshot,
                trigger_completion_at_end=True, fp32_acc=True,
                pattern_code=self.P.kARResidualRMSNorm, allreduce_out=None,
                residual_in=residual, residual_out=resid_out, norm_out=norm_out,
                quant_out=None, scale_out=None, rms_gamma=gamma, rms_eps=eps,
                scale_factor=None, layout_code=None)

    def pattern7(self, fi, shared, residual, gamma, eps, norm_out, resid_out):
        if self.kind == "unified":
            self.fc.allreduce_fusion(
                input=fi["rows"], workspace=self.ws, pattern=self.P.kMoEFinalizeARResidualRMSNorm,
                launch_with_pdl=False, residual_out=resid_out, norm_out=norm_out,
                residual_in=residual, rms_gamma=gamma, rms_eps=eps,
                expanded_idx_to_permuted_idx=fi["idx"], expert_scale_factor=fi["weights"],
                shared_expert_output=shared)
        else:
            kw = dict(allreduce_in=fi["rows"], residual_in=residual, norm_weight=gamma,
                      expanded_idx_to_permuted_idx=fi["idx"], norm_out=norm_out,
                      residual_out=resid_out, launch_with_pdl=False,
                      world_rank=self.setup.rank, world_size=self.setup.world_size, eps=eps,
                      shared_expert_output=shared, expert_scale_factor=fi["weights"])
            fn = self.fc.trtllm_moe_finalize_allreduce_fusion
            params = inspect.signature(fn).parameters
            kw["workspace_ptrs" if "workspace_ptrs" in params else "workspace"] = self.ws_tensor
            if "quant_out" in params:
                kw.update(quant_out=None, scale_out=None)
            if "routed_scaling_factor" in params:
                kw["routed_scaling_factor"] = None
            fn(**kw)
