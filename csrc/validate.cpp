// arfuse: validation as ops of its own (catch-all). The CPU implementation for world size 1
// (arfuse/_cpu.py) runs it before computing, so CPU and CUDA reject the same inputs with the same
// message. Fake tensors for torch.compile are described in Python (arfuse/_fake.py) instead, so
// that the token count stays symbolic.
#include <ATen/ATen.h>

#include "arfuse/ops.h"
#include "arfuse/ops_internal.h"

namespace arfuse::ops {

void validate_fused(const at::Tensor& expert_out, const std::optional<at::Tensor>& permuted_idx,
                    const std::optional<at::Tensor>& expert_weights,
                    const std::optional<at::Tensor>& shared_out,
                    const std::optional<at::Tensor>& residual, const at::Tensor& gamma, double eps,
                    double weight_bias, const std::optional<at::Tensor>& fp8_scale, int64_t comm,
                    int64_t algorithm) {
  const Comm& c = get_comm(comm);
  validate(c, expert_out, permuted_idx, expert_weights, shared_out, residual, gamma, eps,
           weight_bias, fp8_scale, algorithm, /*check_device=*/false);
}

void validate_fp8_dynamic(const at::Tensor& expert_out,
                          const std::optional<at::Tensor>& permuted_idx,
                          const std::optional<at::Tensor>& expert_weights,
                          const std::optional<at::Tensor>& shared_out,
                          const std::optional<at::Tensor>& residual, const at::Tensor& gamma,
                          double eps, double weight_bias, int64_t group_size,
                          const std::optional<at::Tensor>& scale_ub, bool col_major_scales,
                          bool ue8m0, int64_t comm, int64_t algorithm) {
  const Comm& c = get_comm(comm);
  const DynamicQuant dq{group_size, &scale_ub, col_major_scales, ue8m0};
  validate(c, expert_out, permuted_idx, expert_weights, shared_out, residual, gamma, eps,
           weight_bias, std::nullopt, algorithm, /*check_device=*/false, &dq);
}

void validate_moe_finalize(const at::Tensor& expert_out,
                           const std::optional<at::Tensor>& permuted_idx,
                           const std::optional<at::Tensor>& expert_weights,
                           const std::optional<at::Tensor>& shared_out, int64_t num_tokens) {
  validate_finalize(expert_out, permuted_idx, expert_weights, shared_out, num_tokens);
}

}  // namespace arfuse::ops
