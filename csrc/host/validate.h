// arfuse host code: argument validation, the one place that reads the inputs' layout.
//
// Every op validates all of its arguments here before it allocates, writes or launches
// anything: one error naming the argument and the rule (host/errors.h). The CPU implementation
// of world size 1 (arfuse/_cpu.py) runs the same validation through the validate ops, and takes
// the layout it infers from them, so CPU and CUDA accept and reject the same inputs.
#pragma once

#include <cstdint>
#include <optional>

#include <torch/csrc/stable/tensor.h>

#include "arfuse/dispatch.h"
#include "arfuse/params.h"
#include "host/comm.h"

namespace arfuse::host {

using torch::stable::Tensor;
using OptTensor = std::optional<Tensor>;

// How the routed experts' outputs arrive, as read from the arguments:
//   plain    expert_out [T, H], already reduced (K = 1, no weights)
//   dense    expert_out [T, K, H]
//   permuted expert_out [P, H], rows addressed by permuted_idx [T, K] (int32, -1: not here)
struct Rows {
  int64_t T = 0, H = 0, K = 1, P = 0;
  Layout layout = Layout::kPlain;
  bool weights_f32 = false;  // expert_weights float32 (else the activation dtype, or none)
};

// What validating a fused call decided: the rows, the output kind, the algorithm and the
// kernel instance (nullptr for a CPU communicator, which launches nothing).
struct Checked : Rows {
  bool gamma_f32 = false;
  OutKind out = OutKind::kNorm;
  Algo algo = Algo::kOneShot;
  const Instance* instance = nullptr;
};

// The dynamic FP8 request of fused_fp8_dynamic: group_size 0 (per token) or 128 (per group),
// the per-token upper bound and the per-group scale layout.
struct DynamicQuant {
  int64_t group_size = 0;
  const OptTensor* scale_ub = nullptr;
  bool col_major = false;
  bool ue8m0 = false;
};

// A fused call (fused, fused_fp8_dynamic, fused_inplace). check_device: the tensors must be on
// the communicator's CUDA device, 16-byte aligned (the CUDA ops); false for the CPU
// implementation's validation. dq: nullptr for the norm and fp8_static outputs (fp8_scale
// decides), else the dynamic kind.
Checked validate_fused(const Comm& c, const Tensor& expert_out, const OptTensor& permuted_idx,
                       const OptTensor& expert_weights, const OptTensor& shared_out,
                       const OptTensor& residual, const Tensor& gamma, double eps,
                       double weight_bias, const OptTensor& fp8_scale, int64_t algorithm,
                       bool check_device, const DynamicQuant* dq = nullptr);

// The standalone finalize (moe_finalize): num_tokens tokens; every tensor on expert_out's device.
Rows validate_finalize(const Tensor& expert_out, const OptTensor& permuted_idx,
                       const OptTensor& expert_weights, const OptTensor& shared_out,
                       int64_t num_tokens, bool check_device);

}  // namespace arfuse::host
