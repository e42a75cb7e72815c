// arfuse: the torch op implementations that the generated registration (out/ops_registration.cpp)
// binds to the schemas, on the PyTorch stable ABI (torch/csrc/stable): the library imports only
// torch's C shims, so one build serves torch 2.11 and every later release that keeps them.
// Implemented in csrc/host/ops.cpp over the host code in csrc/host/ (communicators, validation,
// launch). The fake (Meta) implementations are Python (arfuse/_fake.py), so token counts stay
// symbolic; the CPU implementations of world size 1 are Python too (arfuse/_cpu.py).
//
// Errors: every bad argument raises one RuntimeError whose message starts with its kind,
// "ValueError: arfuse: <argument>: <rule>" (or TypeError), before anything is written or
// launched; the Python API re-raises it as that kind (csrc/host/errors.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

namespace arfuse::ops {

using torch::headeronly::ScalarType;
using torch::stable::Device;
using torch::stable::Tensor;
using OptTensor = std::optional<Tensor>;

// ---- communicator (opaque int64 handles; buffers live outside torch's caching allocator) ----
int64_t comm_create(int64_t rank, int64_t world_size, int64_t hidden, ScalarType dtype,
                    int64_t max_tokens, int64_t oneshot_max_tokens, int64_t ranks_per_device,
                    Device device, double timeout_s);
Tensor comm_ipc_handle(int64_t comm);
void comm_open_peers(int64_t comm, const Tensor& handles);
void comm_set_local_peers(int64_t comm, const std::vector<int64_t>& comms);
void comm_destroy(int64_t comm);
int64_t comm_status(int64_t comm);
// Programmatic dependent launch of the communicator's fused kernels (CUDA communicators only).
void comm_set_pdl(int64_t comm, bool enable);
std::vector<int64_t> comm_info(int64_t comm);

// ---- the fused op ----
std::tuple<Tensor, Tensor> fused(const Tensor& expert_out, const OptTensor& permuted_idx,
                                 const OptTensor& expert_weights, const OptTensor& shared_out,
                                 const OptTensor& residual, const Tensor& gamma, double eps,
                                 double weight_bias, double routed_scaling,
                                 const OptTensor& fp8_scale, int64_t comm, int64_t algorithm);
// FP8-e4m3 output with dynamic scales computed in the kernel: group_size 0 = one scale per
// token (optionally bounded by scale_ub), 128 = one per group of 128 elements (row-major
// [T, H/128], or column-major with strides (1, T); ue8m0 rounds them up to powers of two).
// Returns (q [T, H] float8_e4m3fn, residual_out [T, H], scales float32 [T] or [T, H/128]).
std::tuple<Tensor, Tensor, Tensor> fused_fp8_dynamic(
    const Tensor& expert_out, const OptTensor& permuted_idx, const OptTensor& expert_weights,
    const OptTensor& shared_out, const OptTensor& residual, const Tensor& gamma, double eps,
    double weight_bias, double routed_scaling, int64_t group_size, const OptTensor& scale_ub,
    bool col_major_scales, bool ue8m0, int64_t comm, int64_t algorithm);
void fused_inplace(Tensor& input, Tensor& residual, const OptTensor& shared_out,
                   const Tensor& gamma, double eps, double weight_bias, double routed_scaling,
                   int64_t comm, int64_t algorithm);
// ---- the standalone finalize kernel (the unfused pipeline's first step) ----
Tensor moe_finalize(const Tensor& expert_out, const OptTensor& permuted_idx,
                    const OptTensor& expert_weights, const OptTensor& shared_out,
                    double routed_scaling, int64_t num_tokens);

// ---- validation alone (the CPU implementation of world size 1 runs it before computing) ----
// Each returns what it inferred: [T, H, K, P, layout (0 plain, 1 dense, 2 permuted),
// expert_weights float32 (1) or not (0)].
std::vector<int64_t> validate_fused(const Tensor& expert_out, const OptTensor& permuted_idx,
                                    const OptTensor& expert_weights, const OptTensor& shared_out,
                                    const OptTensor& residual, const Tensor& gamma, double eps,
                                    double weight_bias, const OptTensor& fp8_scale, int64_t comm,
                                    int64_t algorithm);
std::vector<int64_t> validate_fp8_dynamic(
    const Tensor& expert_out, const OptTensor& permuted_idx, const OptTensor& expert_weights,
    const OptTensor& shared_out, const OptTensor& residual, const Tensor& gamma, double eps,
    double weight_bias, int64_t group_size, const OptTensor& scale_ub, bool col_major_scales,
    bool ue8m0, int64_t comm, int64_t algorithm);
std::vector<int64_t> validate_inplace(const Tensor& input, const Tensor& residual,
                                      const OptTensor& shared_out, const Tensor& gamma, double eps,
                                      double weight_bias, int64_t comm, int64_t algorithm);
std::vector<int64_t> validate_moe_finalize(const Tensor& expert_out,
                                           const OptTensor& permuted_idx,
                                           const OptTensor& expert_weights,
                                           const OptTensor& shared_out, int64_t num_tokens);

// ---- deferred launches (emulated groups on one GPU; csrc/host/launch.h) ----
void defer_launches(bool enable);
int64_t flush_launches(bool launch);

// ---- introspection ----
std::vector<std::string> supported_variants();
// The instance that serves the combination at num_tokens tokens (< 0: at every token count).
std::string instance_for(ScalarType dtype, int64_t hidden, int64_t world_size, int64_t algorithm,
                         int64_t out_kind, int64_t num_tokens);
// auto's one-shot limit for the combination on the card named `card` (the device name CUDA
// reports; "" or a card without its own rows: the default table).
int64_t oneshot_threshold(ScalarType dtype, int64_t hidden, int64_t world_size, std::string card);

}  // namespace arfuse::ops
