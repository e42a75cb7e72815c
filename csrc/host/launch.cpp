// arfuse host code: building a launch and the deferred-launch queue (launch.h).
#include "host/launch.h"

#include <cstring>
#include <string>
#include <vector>

#include "arfuse/dispatch.h"
#include "host/device.h"
#include "host/errors.h"

namespace arfuse::host {

namespace {

struct Pending {
  const Comm* comm;  // whose launch it is (a world-size-1 communicator has no control block)
  const Instance* instance;
  LaunchParams params;
  cudaStream_t stream;
  int device_index;
  std::vector<Tensor> keep;  // every tensor the launch reads or writes stays alive until then
};
thread_local bool t_defer = false;
thread_local std::vector<Pending> t_pending;

}  // namespace

LaunchParams finalize_params(const Rows& k, double routed_scaling) {
  LaunchParams p;
  std::memset(&p, 0, sizeof(p));
  p.expert_out = k.expert_out;
  p.permuted_idx = k.permuted_idx;
  p.expert_weights = k.expert_weights;
  p.shared_out = k.shared_out;
  p.num_rows = k.P;
  p.layout = static_cast<int32_t>(k.layout);
  p.weights_f32 = k.weights_f32 ? 1 : 0;
  p.num_tokens = static_cast<int32_t>(k.T);
  p.top_k = static_cast<int32_t>(k.K);
  p.hidden = static_cast<int32_t>(k.H);
  p.routed_scaling = static_cast<float>(routed_scaling);
  return p;
}

void launch_fused(const Comm& c, const Checked& k, const Inputs& in, double eps,
                  double weight_bias, double routed_scaling, const Outputs& out) {
  const uint32_t err_word = c.error_word();
  ARFUSE_CHECK(err_word == 0, "comm: this communicator is broken: an earlier call gave up "
               "waiting for rank ", err_word - 1, " after ", c.timeout_ns / 1000000,
               " ms (ranks called with different token counts, or a rank died); close it and "
               "create a new one");
  ARFUSE_CHECK(t_defer || t_pending.empty(), t_pending.size(),
               " deferred launches are still queued on this thread: flush_launches first");
  LaunchParams p = finalize_params(k, routed_scaling);
  p.residual = k.residual;
  p.gamma = k.gamma;
  p.fp8_scale = k.fp8_scale;
  p.gamma_f32 = k.gamma_f32 ? 1 : 0;
  p.world_size = c.world;
  p.rank = c.rank;
  p.eps = static_cast<float>(eps);
  p.weight_bias = static_cast<float>(weight_bias);
  p.norm_out = out.norm_out.data_ptr();
  p.residual_out = out.residual_out.data_ptr();
  if (out.scales.has_value()) {
    p.scale_out = static_cast<float*>(out.scales->data_ptr());
    p.scale_ub = k.scale_ub;
    p.scale_col_major = out.col_major ? 1 : 0;
    p.scale_ue8m0 = out.ue8m0 ? 1 : 0;
  }
  for (int n = 0; n < kMaxWorld; ++n) p.buffers[n] = c.peers[n];
  p.ctrl = c.ctrl;
  p.error_flag = c.error_dev;
  p.slot_elems = c.slot_elems;
  p.max_blocks = 0;
  p.ranks_per_device = c.ranks_per_device;
  p.timeout_ns = c.timeout_ns;
  p.pdl = c.pdl ? 1 : 0;
  const DeviceScope scope(c.device_index);
  cudaStream_t stream = current_stream(c.device_index);
  if (!t_defer) {
    const cudaError_t err = k.instance->launch(p, stream);
    ARFUSE_CHECK(err == cudaSuccess, "launch of ", k.instance->name, " failed: ",
                 cudaGetErrorString(err));
    return;
  }
  // Load the kernel and size the grid now, so that flushing issues nothing but launches.
  p.prepare_only = 1;
  const cudaError_t err = k.instance->launch(p, stream);
  ARFUSE_CHECK(err == cudaSuccess, "preparing ", k.instance->name, " failed: ",
               cudaGetErrorString(err));
  p.prepare_only = 0;
  std::vector<Tensor> keep = {in.expert_out, in.gamma, out.norm_out, out.residual_out};
  for (const OptTensor* t : {&in.permuted_idx, &in.expert_weights, &in.shared_out, &in.residual,
                             &in.fp8_scale, &out.scales}) {
    if (t->has_value()) keep.push_back(**t);
  }
  if (out.scale_ub != nullptr && out.scale_ub->has_value()) keep.push_back(**out.scale_ub);
  t_pending.push_back(Pending{&c, k.instance, p, stream, c.device_index, std::move(keep)});
}

void preload(const Comm& c) {
  if (!c.cuda || c.world <= 1) return;
  LaunchParams p;
  std::memset(&p, 0, sizeof(p));
  p.hidden = c.hidden;
  p.world_size = c.world;
  p.rank = c.rank;
  p.ranks_per_device = c.ranks_per_device;
  p.prepare_only = 1;
  const DeviceScope scope(c.device_index);
  cudaStream_t stream = current_stream(c.device_index);
  int count = 0;
  const Instance* table = instance_table(&count);
  for (int i = 0; i < count; ++i) {
    const Instance& e = table[i];
    if (e.dtype != c.dtype || e.algo == Algo::kLocal) continue;
    const bool specialised = e.hidden == c.hidden && e.world_size == c.world;
    const bool generic = e.hidden == 0 && e.world_size == 0 && c.hidden <= e.max_hidden;
    if (!specialised && !generic) continue;
    // Best effort: an instance that cannot serve this communicator (a generic one's hidden rule,
    // a grid that does not fit) reports it with a clear error at its launch, as before.
    if (e.launch(p, stream) != cudaSuccess) (void)cudaGetLastError();
  }
}

void defer(bool enable) {
  ARFUSE_CHECK_VALUE(!enable || t_pending.empty(), "defer_launches: ", t_pending.size(),
                     " deferred launches were never flushed");
  t_defer = enable;
}

int64_t flush(bool do_launch) {
  std::vector<Pending> pending;
  pending.swap(t_pending);
  if (!do_launch) return static_cast<int64_t>(pending.size());
  std::string failed;
  for (const Pending& q : pending) {
    const DeviceScope scope(q.device_index);
    const cudaError_t err = q.instance->launch(q.params, q.stream);
    if (err != cudaSuccess && failed.empty()) {
      failed = std::string(q.instance->name) + ": " + cudaGetErrorString(err);
    }
  }
  // A failed launch leaves its peers waiting: they give up after the timeout (no hang).
  ARFUSE_CHECK(failed.empty(), "deferred launch of ", failed, " failed");
  return static_cast<int64_t>(pending.size());
}

bool has_pending(const Comm& c) {
  for (const Pending& q : t_pending) {
    if (q.comm == &c) return true;
  }
  return false;
}

}  // namespace arfuse::host
