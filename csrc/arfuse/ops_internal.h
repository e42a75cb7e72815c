// arfuse: state and validation shared by the CUDA (csrc/ops.cpp) and validation (csrc/validate.cpp) op
// implementations. Not part of the generated interface.
#pragma once

#include <optional>

#include <ATen/ATen.h>

#include "arfuse/dispatch.h"
#include "arfuse/params.h"

namespace arfuse::ops {

// One rank's communicator: its Lamport buffer (kNumSlots slots), control block, host-mapped
// error word and the peers' buffers (opened through CUDA IPC, or the other ranks' buffers of an
// emulated group on the same GPU).
struct Comm {
  int rank = 0, world = 1, hidden = 0;
  DType dtype = DType::kBF16;
  at::ScalarType scalar = at::kBFloat16;
  int64_t max_tokens = 0, oneshot_cap = 0;
  int ranks_per_device = 1;
  at::Device device{at::kCPU};
  int64_t timeout_ns = 0;
  int64_t slot_elems = 0;
  void* data = nullptr;
  Ctrl* ctrl = nullptr;
  uint32_t* error_host = nullptr;
  uint32_t* error_dev = nullptr;
  void* peers[kMaxWorld] = {};
  bool ipc_opened[kMaxWorld] = {};
  bool peers_ready = false;
};

Comm& get_comm(int64_t handle);
DType to_dtype(at::ScalarType t, const char* arg);

// What validation decided: sizes, layout, output kind, algorithm and the instance to launch.
struct Checked {
  int64_t T = 0, H = 0, K = 1, P = 0;
  Layout layout = Layout::kPlain;
  bool weights_f32 = false, gamma_f32 = false;
  OutKind out = OutKind::kNorm;
  Algo algo = Algo::kOneShot;
  const Instance* instance = nullptr;
};

// The dynamic FP8 request of fused_fp8_dynamic: group_size 0 (per token) or 128 (per group),
// the per-token upper bound and the per-group scale layout.
struct DynamicQuant {
  int64_t group_size = 0;
  const std::optional<at::Tensor>* scale_ub = nullptr;
  bool col_major = false;
  bool ue8m0 = false;
};

// dq: nullptr for the norm and fp8_static outputs (fp8_scale decides), else the dynamic kind.
Checked validate(const Comm& c, const at::Tensor& expert_out,
                 const std::optional<at::Tensor>& permuted_idx,
                 const std::optional<at::Tensor>& expert_weights,
                 const std::optional<at::Tensor>& shared_out,
                 const std::optional<at::Tensor>& residual, const at::Tensor& gamma, double eps,
                 double weight_bias,
                 const std::optional<at::Tensor>& fp8_scale, int64_t algorithm, bool check_device,
                 const DynamicQuant* dq = nullptr);

struct FinalizeChecked {
  int64_t T = 0, H = 0, K = 1, P = 0;
  Layout layout = Layout::kPlain;
  bool weights_f32 = false;
  DType dtype = DType::kBF16;
};

FinalizeChecked validate_finalize(const at::Tensor& expert_out,
                                  const std::optional<at::Tensor>& permuted_idx,
                                  const std::optional<at::Tensor>& expert_weights,
                                  const std::optional<at::Tensor>& shared_out, int64_t num_tokens);

}  // namespace arfuse::ops
