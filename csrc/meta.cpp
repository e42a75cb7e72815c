// arfuse: Meta (fake tensor) implementations, used by torch.compile to trace the ops. They run
// the same validation as the CUDA implementations (minus device placement) and allocate nothing.
#include <ATen/ATen.h>

#include "arfuse/ops.h"
#include "arfuse/ops_internal.h"

namespace arfuse::ops {

std::tuple<at::Tensor, at::Tensor> fused_meta(
    const at::Tensor& expert_out, const std::optional<at::Tensor>& permuted_idx,
    const std::optional<at::Tensor>& expert_weights, const std::optional<at::Tensor>& shared_out,
    const at::Tensor& residual, const at::Tensor& gamma, double eps, double weight_bias,
    double routed_scaling, const std::optional<at::Tensor>& fp8_scale, int64_t comm,
    int64_t algorithm) {
  (void)routed_scaling;
  const Comm& c = get_comm(comm);
  const Checked k = validate(c, expert_out, permuted_idx, expert_weights, shared_out, residual,
                             gamma, eps, weight_bias, fp8_scale, algorithm, /*check_device=*/false);
  const auto out_type = k.out == OutKind::kFP8Static ? at::kFloat8_e4m3fn : residual.scalar_type();
  return {at::empty({k.T, k.H}, residual.options().dtype(out_type)),
          at::empty({k.T, k.H}, residual.options())};
}

void fused_inplace_meta(at::Tensor& input, at::Tensor& residual,
                        const std::optional<at::Tensor>& shared_out, const at::Tensor& gamma,
                        double eps, double weight_bias, double routed_scaling, int64_t comm,
                        int64_t algorithm) {
  (void)routed_scaling;
  const Comm& c = get_comm(comm);
  TORCH_CHECK_VALUE(input.dim() == 2, "arfuse: input: in-place needs the plain layout [T, H], got ",
                    input.sizes());
  validate(c, input, std::nullopt, std::nullopt, shared_out, residual, gamma, eps, weight_bias,
           std::nullopt, algorithm, /*check_device=*/false);
}

at::Tensor moe_finalize_meta(const at::Tensor& expert_out,
                             const std::optional<at::Tensor>& permuted_idx,
                             const std::optional<at::Tensor>& expert_weights,
                             const std::optional<at::Tensor>& shared_out, double routed_scaling,
                             int64_t num_tokens) {
  (void)routed_scaling;
  const FinalizeChecked k =
      validate_finalize(expert_out, permuted_idx, expert_weights, shared_out, num_tokens);
  return at::empty({k.T, k.H}, expert_out.options());
}

}  // namespace arfuse::ops
