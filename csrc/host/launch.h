// arfuse host code: building a launch and the deferred-launch queue.
//
// Deferred launches (emulated groups on one GPU): while enabled on this thread, the fused ops
// validate, allocate and prepare (load the kernel, size the grid) but queue the launch;
// flush(true) then launches the queue back to back, flush(false) discards it. An emulated group
// needs this: a device allocation, a kernel's lazy loading or any other implicitly synchronising
// call issued between two ranks' launches stops the later rank from running beside the earlier,
// spinning one (arfuse/testing.py: LocalGroup.run).
#pragma once

#include <cstdint>

#include "host/comm.h"
#include "host/validate.h"

namespace arfuse::host {

// The outputs of one fused launch. scales: the dynamic FP8 kinds' [T] or [T, H / 128] (either
// layout), with the per-token bound and the per-group settings.
struct Outputs {
  Tensor norm_out;
  Tensor residual_out;
  OptTensor scales;
  const OptTensor* scale_ub = nullptr;
  bool col_major = false, ue8m0 = false;
};

// The finalize inputs of LaunchParams, shared by the fused op and the standalone finalize.
LaunchParams finalize_params(const Rows& k, const Tensor& expert_out, const OptTensor& permuted_idx,
                             const OptTensor& expert_weights, const OptTensor& shared_out,
                             double routed_scaling);

// Launches (or queues) the instance validation chose, on torch's current stream of the
// communicator's device. Refuses a communicator whose earlier call timed out.
void launch_fused(const Comm& c, const Checked& k, const Tensor& expert_out,
                  const OptTensor& permuted_idx, const OptTensor& expert_weights,
                  const OptTensor& shared_out, const OptTensor& residual, const Tensor& gamma,
                  double eps, double weight_bias, double routed_scaling,
                  const OptTensor& fp8_scale, const Outputs& out);

void defer(bool enable);
int64_t flush(bool launch);
// Whether a queued launch of this thread uses the communicator.
bool has_pending(const Comm& c);

}  // namespace arfuse::host
