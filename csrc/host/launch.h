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

// The finalize inputs of LaunchParams (validation read them), shared by the fused op and the
// standalone finalize.
LaunchParams finalize_params(const Rows& k, double routed_scaling);

// The tensors a queued launch must keep alive until it is issued.
struct Inputs {
  const Tensor& expert_out;
  const OptTensor& permuted_idx;
  const OptTensor& expert_weights;
  const OptTensor& shared_out;
  const OptTensor& residual;
  const Tensor& gamma;
  const OptTensor& fp8_scale;
};

// Launches (or queues) the instance validation chose, on torch's current stream of the
// communicator's device. Refuses a communicator whose earlier call timed out.
void launch_fused(const Comm& c, const Checked& k, const Inputs& in, double eps,
                  double weight_bias, double routed_scaling, const Outputs& out);

// Loads every kernel instance that may serve a call of this communicator (its dtype, hidden and
// world size; every algorithm and output kind) and sizes its grid, before its first call. Loading
// a module lazily (CUDA_MODULE_LOADING=LAZY, the default) may synchronise the context; where
// ranks share a GPU under MPS that context is shared, so a load on one rank while a peer's kernel
// spins waiting for it stalls both until the timeout. Called by create() for world size > 1.
void preload(const Comm& c);

void defer(bool enable);
int64_t flush(bool launch);
// Whether a queued launch of this thread uses the communicator.
bool has_pending(const Comm& c);

}  // namespace arfuse::host
