// arfuse: host entry points of the hand-written, variant-independent kernels (csrc/kernels.cu).
// Plain C++ interface so that the torch op code (compiled by g++) can call them.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "arfuse/params.h"

namespace arfuse {

// Fills `elems` elements of dtype with the Lamport sentinel (-0.0 bit pattern).
cudaError_t fill_sentinel(void* buffer, int64_t elems, DType dtype, cudaStream_t stream);

// Standalone MoE finalize: out[t] = routed_scaling * sum_k w[t,k] * row(t,k) + shared[t], fp32
// accumulation, one rounding. Uses LaunchParams' input fields (layout, expert_out, permuted_idx,
// expert_weights, shared_out, num_rows, top_k, hidden, num_tokens, routed_scaling) and writes
// p.norm_out ([T, H], activation dtype). The unfused pipeline's first kernel.
cudaError_t launch_finalize(const LaunchParams& p, DType dtype, cudaStream_t stream);

}  // namespace arfuse
