// arfuse: the launch parameters shared by the host op code (g++) and the device code (nvcc).
//
// Plain C++ only: no CUDA or torch types, so that the torch op file and every generated kernel
// instance agree on one layout. Hand-written; the vocabulary it builds on (the device API version
// ARFUSE_DEVICE_API_VERSION, which versions this file's LaunchParams; the enums DType, Algo,
// OutKind and their names; kMaxWorld, kMaxTopK, kQuantGroup and the other kernel limits) is
// arfuse/vocab.h, generated from gen/tables.go.
#pragma once

#include <cstdint>

#include "arfuse/protocol.h"
#include "arfuse/vocab.h"

namespace arfuse {

// Bytes per element of a dtype, and the elements of one kVectorBytes access (the vocabulary's
// kDTypeBytes row).
constexpr int dtype_bytes(DType dtype) { return kDTypeBytes[static_cast<int>(dtype)]; }
constexpr int dtype_vec(DType dtype) { return kVectorBytes / dtype_bytes(dtype); }

// Whether a one-shot row may be split over a thread-block cluster of c CTAs: 1, or one of the
// vocabulary's kClusterSizes.
constexpr bool is_cluster_size(int c) {
  if (c == 1) return true;
  for (int s : kClusterSizes) {
    if (s == c) return true;
  }
  return false;
}

// Output kinds (enum class OutKind): kNorm writes norm_out in the activation dtype; the others
// write FP8-e4m3 (saturating) and differ in the scale:
//   kFP8Static:   saturate(y * (1 / scale)), a float32 per-tensor scale input (fp8_scale);
//   kFP8Token:    one dynamic scale per token, max(min(amax_t, ub) / 448, 1 / (448 * 512)),
//                 written to scale_out[t] (vLLM's dynamic per-token FP8 quantization);
//   kFP8Group128: one dynamic scale per group of kQuantGroup (128) consecutive elements,
//                 max(amax, 1e-10) / 448 (optionally rounded up to a power of two), written to
//                 scale_out (vLLM's per-token-group FP8 quantization with group size 128).
// y is the float32 RMSNorm output; the dynamic kinds write saturate(y / scale). amax is
// NaN-propagating: a NaN in the token (group) makes its scale and every code of it NaN.

// How the routed experts' outputs arrive.
enum class Layout : int32_t {
  kPlain = 0,     // [T, H], already reduced over experts (K = 1, no weights)
  kDense = 1,     // [T, K, H], token-major
  kPermuted = 2,  // [P, H] rows addressed by permuted_idx[T, K] (int32, -1 = not on this rank)
};

struct LaunchParams {
  // ---- inputs (device pointers) ----
  const void* expert_out;       // see Layout
  const int32_t* permuted_idx;  // [T, K] or nullptr
  const void* expert_weights;   // [T, K] or nullptr (weight 1)
  const void* shared_out;       // [T, H] or nullptr
  const void* residual;         // [T, H], or nullptr (no residual add)
  const void* gamma;            // [H]
  const float* fp8_scale;       // [1] for OutKind::kFP8Static, else nullptr
  const float* scale_ub;        // kFP8Token: optional [1] upper bound of amax, else nullptr
  int64_t num_rows;             // P, rows of expert_out in the permuted layout (bounds check)
  int32_t layout;               // Layout
  int32_t weights_f32;          // 1: expert_weights is float32; 0: activation dtype
  int32_t gamma_f32;            // 1: gamma is float32; 0: activation dtype
  int32_t num_tokens;           // T
  int32_t top_k;                // K (1 for the plain layout)
  int32_t hidden;               // H
  int32_t world_size;           // N
  int32_t rank;                 // r
  float eps;
  float weight_bias;            // 0: x * gamma; 1: x * (1 + gamma)
  float routed_scaling;

  int32_t scale_col_major;      // kFP8Group128: 1 = scale (t, g) at g * T + t; 0 = t * G + g
  int32_t scale_ue8m0;          // kFP8Group128: 1 = each scale rounded up to a power of two

  // ---- outputs (device pointers, [T, H]) ----
  void* norm_out;               // activation dtype (kNorm) or FP8-e4m3 codes (the other kinds)
  void* residual_out;
  float* scale_out;             // kFP8Token: [T]; kFP8Group128: [T, H / 128]; else nullptr

  // ---- workspace ----
  void* buffers[kMaxWorld];  // every rank's Lamport data buffer (kNumSlots * slot_elems elements)
  Ctrl* ctrl;                // this rank's control block
  uint32_t* error_flag;      // host-mapped word: set to 1 + peer rank when a wait times out
  int64_t slot_elems;        // elements (activation dtype) per slot
  int32_t max_blocks;        // grid cap so that every rank sharing this GPU is co-resident
  int32_t ranks_per_device;  // 1 for one GPU per rank; N for an emulated group
  int64_t timeout_ns;        // a wait longer than this gives up, poisons outputs, sets error_flag
  int32_t prepare_only;      // 1: load the kernel and size the grid, launch nothing (deferred launches)
  // 1: launched as a programmatic dependent (PDL: cudaLaunchAttributeProgrammaticStreamSerialization):
  // the grid may start while the kernel before it on the stream is finishing; every block waits
  // (griddepcontrol.wait) for that kernel's completion and memory before its first global access,
  // so the results are those of plain stream order. 0: a plain launch (the wait is a no-op).
  int32_t pdl;
};

}  // namespace arfuse
