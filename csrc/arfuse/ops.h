// arfuse: the torch op implementations that the generated registration (out/ops_registration.cpp)
// binds to the schemas. Hand-written in csrc/ops.cpp (CUDA and catch-all) and csrc/validate.cpp;
// the fake (Meta) implementations are Python (arfuse/_fake.py), so token counts stay symbolic.
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

namespace arfuse::ops {

// ---- communicator (opaque int64 handles; buffers live outside torch's caching allocator) ----
int64_t comm_create(int64_t rank, int64_t world_size, int64_t hidden, at::ScalarType dtype,
                    int64_t max_tokens, int64_t oneshot_max_tokens, int64_t ranks_per_device,
                    at::Device device, double timeout_s);
at::Tensor comm_ipc_handle(int64_t comm);
void comm_open_peers(int64_t comm, const at::Tensor& handles);
void comm_set_local_peers(int64_t comm, at::IntArrayRef comms);
void comm_destroy(int64_t comm);
int64_t comm_status(int64_t comm);
std::vector<int64_t> comm_info(int64_t comm);

// ---- the fused op ----
std::tuple<at::Tensor, at::Tensor> fused(
    const at::Tensor& expert_out, const std::optional<at::Tensor>& permuted_idx,
    const std::optional<at::Tensor>& expert_weights, const std::optional<at::Tensor>& shared_out,
    const std::optional<at::Tensor>& residual, const at::Tensor& gamma, double eps,
    double weight_bias, double routed_scaling, const std::optional<at::Tensor>& fp8_scale,
    int64_t comm, int64_t algorithm);
// FP8-e4m3 output with dynamic scales computed in the kernel: group_size 0 = one scale per
// token (optionally bounded by scale_ub), 128 = one per group of 128 elements (row-major
// [T, H/128], or column-major with strides (1, T); ue8m0 rounds them up to powers of two).
// Returns (q [T, H] float8_e4m3fn, residual_out [T, H], scales float32 [T] or [T, H/128]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_fp8_dynamic(
    const at::Tensor& expert_out, const std::optional<at::Tensor>& permuted_idx,
    const std::optional<at::Tensor>& expert_weights, const std::optional<at::Tensor>& shared_out,
    const std::optional<at::Tensor>& residual, const at::Tensor& gamma, double eps,
    double weight_bias, double routed_scaling, int64_t group_size,
    const std::optional<at::Tensor>& scale_ub, bool col_major_scales, bool ue8m0, int64_t comm,
    int64_t algorithm);
void fused_inplace(at::Tensor& input, at::Tensor& residual,
                   const std::optional<at::Tensor>& shared_out, const at::Tensor& gamma, double eps,
                   double weight_bias, double routed_scaling, int64_t comm, int64_t algorithm);
// ---- the standalone finalize kernel (the unfused pipeline's first step) ----
at::Tensor moe_finalize(const at::Tensor& expert_out, const std::optional<at::Tensor>& permuted_idx,
                        const std::optional<at::Tensor>& expert_weights,
                        const std::optional<at::Tensor>& shared_out, double routed_scaling,
                        int64_t num_tokens);
// ---- validation alone (the CPU implementation of world size 1 runs it before computing) ----
void validate_fused(const at::Tensor& expert_out, const std::optional<at::Tensor>& permuted_idx,
                    const std::optional<at::Tensor>& expert_weights,
                    const std::optional<at::Tensor>& shared_out,
                    const std::optional<at::Tensor>& residual, const at::Tensor& gamma, double eps,
                    double weight_bias, const std::optional<at::Tensor>& fp8_scale, int64_t comm,
                    int64_t algorithm);
void validate_fp8_dynamic(const at::Tensor& expert_out,
                          const std::optional<at::Tensor>& permuted_idx,
                          const std::optional<at::Tensor>& expert_weights,
                          const std::optional<at::Tensor>& shared_out,
                          const std::optional<at::Tensor>& residual, const at::Tensor& gamma,
                          double eps, double weight_bias, int64_t group_size,
                          const std::optional<at::Tensor>& scale_ub, bool col_major_scales,
                          bool ue8m0, int64_t comm, int64_t algorithm);
void validate_moe_finalize(const at::Tensor& expert_out,
                           const std::optional<at::Tensor>& permuted_idx,
                           const std::optional<at::Tensor>& expert_weights,
                           const std::optional<at::Tensor>& shared_out, int64_t num_tokens);

// ---- deferred launches (emulated groups on one GPU) ----
// While enabled on this thread, the fused ops validate, allocate and prepare (load the kernel,
// size the grid) but queue the launch; flush_launches(true) then launches the queue back to back,
// flush_launches(false) discards it. Returns how many were queued. An emulated group needs this:
// a device allocation, a kernel's lazy loading or any other implicitly synchronising call issued
// between two ranks' launches stops the later rank from running beside the earlier, spinning one.
void defer_launches(bool enable);
int64_t flush_launches(bool launch);

// ---- introspection ----
std::vector<std::string> supported_variants();
std::string instance_for(at::ScalarType dtype, int64_t hidden, int64_t world_size,
                         int64_t algorithm, int64_t out_kind);
int64_t oneshot_threshold(at::ScalarType dtype, int64_t hidden, int64_t world_size);

}  // namespace arfuse::ops
