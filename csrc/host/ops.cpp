// arfuse: the torch op entry points (declared in arfuse/ops.h): each reads its arguments,
// validates them (host/validate.h), allocates its outputs and launches (host/launch.h).
#include "arfuse/ops.h"

#include <algorithm>
#include <cstring>

#include <torch/csrc/stable/ops.h>

#include "arfuse/dispatch.h"
#include "arfuse/host_kernels.h"
#include "host/comm.h"
#include "host/device.h"
#include "host/errors.h"
#include "host/launch.h"
#include "host/out_kinds.h"
#include "host/tensor_arg.h"
#include "host/validate.h"

namespace arfuse::ops {

using host::Comm;
using torch::headeronly::DeviceType;

namespace {

const Comm& cuda_comm(int64_t handle) {
  const Comm& c = host::get(handle);
  ARFUSE_CHECK_VALUE(c.cuda, "comm: a CPU communicator cannot run CUDA tensors");
  return c;
}

std::vector<int64_t> summary(const host::Rows& k) {
  return {k.T, k.H, k.K, k.P, static_cast<int64_t>(k.layout), k.weights_f32 ? 1 : 0};
}

}  // namespace

// ---- communicator ----------------------------------------------------------------------------

int64_t comm_create(int64_t rank, int64_t world_size, int64_t hidden, ScalarType dtype,
                    int64_t max_tokens, int64_t oneshot_max_tokens, int64_t ranks_per_device,
                    Device device, double timeout_s) {
  return host::create(rank, world_size, hidden, dtype, max_tokens, oneshot_max_tokens,
                      ranks_per_device, device, timeout_s);
}

Tensor comm_ipc_handle(int64_t comm) {
  const std::vector<uint8_t> bytes = host::ipc_handle(host::get(comm));
  Tensor out = host::empty({static_cast<int64_t>(bytes.size())}, ScalarType::Byte, -1);
  std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
  return out;
}

void comm_open_peers(int64_t comm, const Tensor& handles) {
  Comm& c = host::get(comm);
  ARFUSE_CHECK_VALUE(c.cuda, "comm: a CPU communicator has no peers to open");
  ARFUSE_CHECK_VALUE(handles.is_cpu() && handles.scalar_type() == ScalarType::Byte &&
                         handles.dim() == 2 && handles.size(0) == c.world,
                     "handles: want a CPU uint8 tensor [world_size=", c.world,
                     ", bytes per handle], got ", host::Sizes{handles}, " ",
                     host::TypeName{handles.scalar_type()}, " on ",
                     host::DeviceName{handles.device()});
  const Tensor h = torch::stable::contiguous(handles);
  host::open_ipc_peers(c, static_cast<const uint8_t*>(h.data_ptr()), h.size(1));
}

void comm_set_local_peers(int64_t comm, const std::vector<int64_t>& comms) {
  host::set_local_peers(host::get(comm), comms);
}

void comm_destroy(int64_t comm) {
  const Comm* c = host::find(comm);
  if (c == nullptr) return;  // closing twice is harmless
  // A queued launch of this communicator would run on freed memory.
  ARFUSE_CHECK(!host::has_pending(*c), "comm: ", comm,
               " has deferred launches still queued (flush_launches first)");
  host::destroy(comm);
}

int64_t comm_status(int64_t comm) { return host::get(comm).error_word(); }

void comm_set_pdl(int64_t comm, bool enable) { host::set_pdl(host::get(comm), enable); }

std::vector<int64_t> comm_info(int64_t comm) { return host::info(host::get(comm)); }

// ---- the fused ops ---------------------------------------------------------------------------

std::tuple<Tensor, Tensor> fused(const Tensor& expert_out, const OptTensor& permuted_idx,
                                 const OptTensor& expert_weights, const OptTensor& shared_out,
                                 const OptTensor& residual, const Tensor& gamma, double eps,
                                 double weight_bias, double routed_scaling,
                                 const OptTensor& fp8_scale, int64_t comm, int64_t algorithm) {
  const Comm& c = cuda_comm(comm);
  const host::Checked k =
      host::validate_fused(c, expert_out, permuted_idx, expert_weights, shared_out, residual,
                           gamma, eps, weight_bias, fp8_scale, algorithm, /*check_device=*/true);
  const host::OutKindTraits& kind = host::traits(k.out);
  host::Outputs out{host::empty({k.T, k.H}, host::out_dtype(kind, c.scalar), k.device),
                    host::empty({k.T, k.H}, c.scalar, k.device)};
  if (k.T > 0) {
    const host::Inputs in{expert_out, permuted_idx, expert_weights, shared_out,
                          residual,   gamma,        fp8_scale};
    host::launch_fused(c, k, in, eps, weight_bias, routed_scaling, out);
  }
  return {out.norm_out, out.residual_out};
}

std::tuple<Tensor, Tensor, Tensor> fused_fp8_dynamic(
    const Tensor& expert_out, const OptTensor& permuted_idx, const OptTensor& expert_weights,
    const OptTensor& shared_out, const OptTensor& residual, const Tensor& gamma, double eps,
    double weight_bias, double routed_scaling, int64_t group_size, const OptTensor& scale_ub,
    bool col_major_scales, bool ue8m0, int64_t comm, int64_t algorithm) {
  const Comm& c = cuda_comm(comm);
  const host::DynamicQuant dq{group_size, &scale_ub, col_major_scales, ue8m0};
  const host::Checked k = host::validate_fused(c, expert_out, permuted_idx, expert_weights,
                                               shared_out, residual, gamma, eps, weight_bias,
                                               std::nullopt, algorithm, /*check_device=*/true, &dq);
  // Allocated in this order (q, residual_out, scales): the GPU tests poison these blocks first.
  const host::OutKindTraits& kind = host::traits(k.out);
  host::Outputs out{host::empty({k.T, k.H}, host::out_dtype(kind, c.scalar), k.device),
                    host::empty({k.T, k.H}, c.scalar, k.device)};
  // The scales by the kind's rule (validation chose a kind whose scales the kernel writes).
  if (kind.scales == host::Scales::kPerToken) {
    out.scales = host::empty({k.T}, ScalarType::Float, k.device);
  } else if (col_major_scales) {
    // Column-major [T, G]: scale (t, g) at g * T + t, the layout block-FP8 GEMMs read: a [G, T]
    // tensor transposed (strides (1, T)), as vLLM's per_token_group_quant_fp8 allocates it.
    out.scales = host::empty_strided({k.T, k.H / kind.group}, {1, std::max<int64_t>(k.T, 1)},
                                     ScalarType::Float, k.device);
  } else {
    out.scales = host::empty({k.T, k.H / kind.group}, ScalarType::Float, k.device);
  }
  out.scale_ub = &scale_ub;
  out.col_major = col_major_scales;
  out.ue8m0 = ue8m0;
  if (k.T > 0) {
    const OptTensor none;
    const host::Inputs in{expert_out, permuted_idx, expert_weights, shared_out,
                          residual,   gamma,        none};
    host::launch_fused(c, k, in, eps, weight_bias, routed_scaling, out);
  }
  return {out.norm_out, out.residual_out, *out.scales};
}

void fused_inplace(Tensor& input, Tensor& residual, const OptTensor& shared_out,
                   const Tensor& gamma, double eps, double weight_bias, double routed_scaling,
                   int64_t comm, int64_t algorithm) {
  const Comm& c = cuda_comm(comm);
  const host::Checked k = host::validate_inplace(c, input, residual, shared_out, gamma, eps,
                                                 weight_bias, algorithm, /*check_device=*/true);
  if (k.T == 0) return;
  const OptTensor none, res(residual);
  const host::Inputs in{input, none, none, shared_out, res, gamma, none};
  host::launch_fused(c, k, in, eps, weight_bias, routed_scaling, host::Outputs{input, residual});
}

Tensor moe_finalize(const Tensor& expert_out, const OptTensor& permuted_idx,
                    const OptTensor& expert_weights, const OptTensor& shared_out,
                    double routed_scaling, int64_t num_tokens) {
  const host::Rows k = host::validate_finalize(expert_out, permuted_idx, expert_weights,
                                               shared_out, num_tokens, /*check_device=*/true);
  const ScalarType act = expert_out.scalar_type();
  Tensor out = host::empty({k.T, k.H}, act, k.device);
  if (k.T == 0) return out;
  LaunchParams p = host::finalize_params(k, routed_scaling);
  p.norm_out = out.data_ptr();
  const host::DeviceScope scope(k.device);
  ARFUSE_CUDA_CHECK(launch_finalize(p, host::to_dtype(act, "expert_out"),
                                    host::current_stream(k.device)),
                    "launch of the finalize kernel");
  return out;
}

// ---- validation alone ------------------------------------------------------------------------

std::vector<int64_t> validate_fused(const Tensor& expert_out, const OptTensor& permuted_idx,
                                    const OptTensor& expert_weights, const OptTensor& shared_out,
                                    const OptTensor& residual, const Tensor& gamma, double eps,
                                    double weight_bias, const OptTensor& fp8_scale, int64_t comm,
                                    int64_t algorithm) {
  return summary(host::validate_fused(host::get(comm), expert_out, permuted_idx, expert_weights,
                                      shared_out, residual, gamma, eps, weight_bias, fp8_scale,
                                      algorithm, /*check_device=*/false));
}

std::vector<int64_t> validate_fp8_dynamic(
    const Tensor& expert_out, const OptTensor& permuted_idx, const OptTensor& expert_weights,
    const OptTensor& shared_out, const OptTensor& residual, const Tensor& gamma, double eps,
    double weight_bias, int64_t group_size, const OptTensor& scale_ub, bool col_major_scales,
    bool ue8m0, int64_t comm, int64_t algorithm) {
  const host::DynamicQuant dq{group_size, &scale_ub, col_major_scales, ue8m0};
  return summary(host::validate_fused(host::get(comm), expert_out, permuted_idx, expert_weights,
                                      shared_out, residual, gamma, eps, weight_bias, std::nullopt,
                                      algorithm, /*check_device=*/false, &dq));
}

std::vector<int64_t> validate_inplace(const Tensor& input, const Tensor& residual,
                                      const OptTensor& shared_out, const Tensor& gamma, double eps,
                                      double weight_bias, int64_t comm, int64_t algorithm) {
  return summary(host::validate_inplace(host::get(comm), input, residual, shared_out, gamma, eps,
                                        weight_bias, algorithm, /*check_device=*/false));
}

std::vector<int64_t> validate_moe_finalize(const Tensor& expert_out,
                                           const OptTensor& permuted_idx,
                                           const OptTensor& expert_weights,
                                           const OptTensor& shared_out, int64_t num_tokens) {
  return summary(host::validate_finalize(expert_out, permuted_idx, expert_weights, shared_out,
                                         num_tokens, /*check_device=*/false));
}

// ---- deferred launches -----------------------------------------------------------------------

void defer_launches(bool enable) { host::defer(enable); }

int64_t flush_launches(bool launch) { return host::flush(launch); }

// ---- introspection ---------------------------------------------------------------------------

std::vector<std::string> supported_variants() {
  int count = 0;
  const Instance* table = instance_table(&count);
  std::vector<std::string> names;
  names.reserve(count);
  for (int i = 0; i < count; ++i) names.emplace_back(table[i].name);
  return names;
}

std::string instance_for(ScalarType dtype, int64_t hidden, int64_t world_size, int64_t algorithm,
                         int64_t out_kind, int64_t num_tokens) {
  ARFUSE_CHECK_VALUE(algorithm >= 1 && algorithm <= 3,
                     "algorithm: want 1 (oneshot), 2 (twoshot) or 3 (local)");
  ARFUSE_CHECK_VALUE(host::find_out_kind(out_kind) != nullptr, "out_kind: ", out_kind,
                     " is not one of ", host::out_kind_list());
  std::string why;
  const Instance* inst = find_instance(host::to_dtype(dtype, "dtype"), static_cast<int>(hidden),
                                       static_cast<int>(world_size), static_cast<Algo>(algorithm),
                                       static_cast<OutKind>(out_kind), num_tokens, &why);
  return inst ? std::string(inst->name) : std::string();
}

int64_t oneshot_threshold(ScalarType dtype, int64_t hidden, int64_t world_size, std::string card) {
  return oneshot_max_tokens(host::to_dtype(dtype, "dtype"), static_cast<int>(hidden),
                            static_cast<int>(world_size), card_thresholds(card));
}

}  // namespace arfuse::ops
