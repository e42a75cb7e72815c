// arfuse: torch op implementations (hand-written). The generated out/ops_registration.cpp binds
// them to the schemas. Every check happens here, on the host, before anything is launched or
// allocated: one error that names the argument and the rule.
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include "arfuse/dispatch.h"
#include "arfuse/host_kernels.h"
#include "arfuse/ops.h"
#include "arfuse/ops_internal.h"

namespace arfuse::ops {

namespace {

#define ARFUSE_CUDA_CHECK(expr, what)                                                   \
  do {                                                                                  \
    const cudaError_t err_ = (expr);                                                    \
    TORCH_CHECK(err_ == cudaSuccess, "arfuse: ", what, " failed: ", cudaGetErrorString(err_)); \
  } while (0)

std::mutex g_mu;
std::unordered_map<int64_t, std::unique_ptr<Comm>> g_comms;
int64_t g_next = 1;

// Deferred launches of this thread (see ops.h: defer_launches).
struct Pending {
  const Instance* instance;
  LaunchParams params;
  cudaStream_t stream;
  at::Device device;
  std::vector<at::Tensor> keep;  // every tensor the launch reads or writes stays alive until then
};
thread_local bool t_defer = false;
thread_local std::vector<Pending> t_pending;

int64_t rows_per_slot(int64_t world, int64_t max_tokens, int64_t oneshot_cap) {
  const int64_t oneshot = world * oneshot_cap;
  const int64_t per = (max_tokens + world - 1) / world;
  const int64_t twoshot = per * world + max_tokens;
  return std::max(oneshot, twoshot);
}

}  // namespace

DType to_dtype(at::ScalarType t, const char* arg) {
  switch (t) {
    case at::kBFloat16:
      return DType::kBF16;
    case at::kHalf:
      return DType::kFP16;
    case at::kFloat:
      return DType::kFP32;
    default:
      TORCH_CHECK_TYPE(false, "arfuse: ", arg, ": dtype ", t,
                       " is not supported (want bfloat16, float16 or float32)");
  }
}

Comm& get_comm(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_comms.find(handle);
  TORCH_CHECK_VALUE(it != g_comms.end(), "arfuse: comm: ", handle,
                    " is not an open communicator (closed, or never created)");
  return *it->second;
}

int64_t comm_create(int64_t rank, int64_t world_size, int64_t hidden, at::ScalarType dtype,
                    int64_t max_tokens, int64_t oneshot_max_tokens, int64_t ranks_per_device,
                    at::Device device, double timeout_s) {
  TORCH_CHECK_VALUE(world_size >= 1 && world_size <= kMaxWorld, "arfuse: world_size: ", world_size,
                    " is not supported (want 1..", kMaxWorld, ")");
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "arfuse: rank: ", rank,
                    " is outside the group (want 0..", world_size - 1, ")");
  const DType dt = to_dtype(dtype, "dtype");
  const int vec = vector_elems(dt);
  TORCH_CHECK_VALUE(hidden > 0 && hidden % vec == 0, "arfuse: hidden: ", hidden,
                    " must be a positive multiple of ", vec, " (one 16-byte vector of ",
                    dtype_name(dt), ")");
  TORCH_CHECK_VALUE(max_tokens >= 1 && max_tokens <= (1 << 20), "arfuse: max_tokens: ", max_tokens,
                    " must be 1..1048576");
  if (oneshot_max_tokens < 0) oneshot_max_tokens = max_tokens;
  TORCH_CHECK_VALUE(oneshot_max_tokens <= max_tokens, "arfuse: oneshot_max_tokens: ",
                    oneshot_max_tokens, " must not exceed max_tokens (", max_tokens, ")");
  TORCH_CHECK_VALUE(ranks_per_device >= 1 && ranks_per_device <= world_size,
                    "arfuse: ranks_per_device: ", ranks_per_device, " must be 1..world_size");
  TORCH_CHECK_VALUE(timeout_s > 0, "arfuse: timeout_s: ", timeout_s, " must be positive");
  std::string why;
  TORCH_CHECK_VALUE(device.is_cuda() || (device.is_cpu() && world_size == 1), "arfuse: device: ",
                    device, " is not supported (want a CUDA device; CPU only for world_size 1)");
  if (device.is_cuda()) {
    const bool any = find_instance(dt, static_cast<int>(hidden), static_cast<int>(world_size),
                                   Algo::kOneShot, OutKind::kNorm, &why) != nullptr ||
                     find_instance(dt, static_cast<int>(hidden), static_cast<int>(world_size),
                                   Algo::kTwoShot, OutKind::kNorm, &why) != nullptr;
    TORCH_CHECK_VALUE(any, "arfuse: hidden: ", why);
  }

  auto c = std::make_unique<Comm>();
  c->rank = static_cast<int>(rank);
  c->world = static_cast<int>(world_size);
  c->hidden = static_cast<int>(hidden);
  c->dtype = dt;
  c->scalar = dtype;
  c->max_tokens = max_tokens;
  c->oneshot_cap = oneshot_max_tokens;
  c->ranks_per_device = static_cast<int>(ranks_per_device);
  c->device = device;
  c->timeout_ns = static_cast<int64_t>(timeout_s * 1e9);
  c->slot_elems = rows_per_slot(world_size, max_tokens, oneshot_max_tokens) * hidden;
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    const int64_t elem = dt == DType::kFP32 ? 4 : 2;
    const size_t bytes = static_cast<size_t>(kNumSlots * c->slot_elems * elem);
    ARFUSE_CUDA_CHECK(cudaMalloc(&c->data, bytes), "cudaMalloc of the Lamport buffer");
    ARFUSE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&c->ctrl), sizeof(Ctrl)),
                      "cudaMalloc of the control block");
    ARFUSE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&c->error_host), sizeof(uint32_t),
                                    cudaHostAllocMapped | cudaHostAllocPortable),
                      "cudaHostAlloc of the error word");
    *c->error_host = 0;
    ARFUSE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&c->error_dev),
                                               c->error_host, 0),
                      "cudaHostGetDevicePointer");
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    ARFUSE_CUDA_CHECK(cudaMemsetAsync(c->ctrl, 0, sizeof(Ctrl), stream), "cudaMemset of control");
    ARFUSE_CUDA_CHECK(fill_sentinel(c->data, kNumSlots * c->slot_elems, dt, stream),
                      "sentinel fill");
    ARFUSE_CUDA_CHECK(cudaStreamSynchronize(stream), "workspace initialisation");
    for (int i = 0; i < kMaxWorld; ++i) c->peers[i] = nullptr;
    c->peers[c->rank] = c->data;
  }
  if (world_size == 1) c->peers_ready = true;
  std::lock_guard<std::mutex> lock(g_mu);
  const int64_t handle = g_next++;
  g_comms.emplace(handle, std::move(c));
  return handle;
}

at::Tensor comm_ipc_handle(int64_t comm) {
  Comm& c = get_comm(comm);
  TORCH_CHECK_VALUE(c.device.is_cuda(), "arfuse: comm: a CPU communicator has no IPC handle");
  const c10::cuda::CUDAGuard guard(c.device);
  cudaIpcMemHandle_t h;
  ARFUSE_CUDA_CHECK(cudaIpcGetMemHandle(&h, c.data), "cudaIpcGetMemHandle");
  at::Tensor out = at::empty({static_cast<int64_t>(sizeof(h))}, at::kByte);
  std::memcpy(out.data_ptr(), &h, sizeof(h));
  return out;
}

void comm_open_peers(int64_t comm, const at::Tensor& handles) {
  Comm& c = get_comm(comm);
  TORCH_CHECK_VALUE(!c.peers_ready, "arfuse: comm: peers are already set");
  TORCH_CHECK_VALUE(handles.device().is_cpu() && handles.scalar_type() == at::kByte &&
                        handles.dim() == 2 && handles.size(0) == c.world &&
                        handles.size(1) == static_cast<int64_t>(sizeof(cudaIpcMemHandle_t)),
                    "arfuse: handles: want a CPU uint8 tensor [world_size=", c.world, ", ",
                    sizeof(cudaIpcMemHandle_t), "], got ", handles.sizes(), " ",
                    handles.scalar_type(), " on ", handles.device());
  const at::Tensor h = handles.contiguous();
  const c10::cuda::CUDAGuard guard(c.device);
  for (int n = 0; n < c.world; ++n) {
    if (n == c.rank) continue;
    cudaIpcMemHandle_t mh;
    std::memcpy(&mh, h[n].data_ptr(), sizeof(mh));
    void* ptr = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&ptr, mh, cudaIpcMemLazyEnablePeerAccess);
    TORCH_CHECK(err == cudaSuccess, "arfuse: opening rank ", n, "'s buffer (cudaIpcOpenMemHandle) failed: ",
                cudaGetErrorString(err));
    c.peers[n] = ptr;
    c.ipc_opened[n] = true;
  }
  c.peers_ready = true;
}

void comm_set_local_peers(int64_t comm, at::IntArrayRef comms) {
  Comm& c = get_comm(comm);
  TORCH_CHECK_VALUE(!c.peers_ready, "arfuse: comm: peers are already set");
  TORCH_CHECK_VALUE(static_cast<int>(comms.size()) == c.world, "arfuse: comms: want ", c.world,
                    " communicators (one per rank, in rank order), got ", comms.size());
  for (int n = 0; n < c.world; ++n) {
    Comm& o = get_comm(comms[n]);
    TORCH_CHECK_VALUE(o.rank == n && o.world == c.world && o.hidden == c.hidden &&
                          o.dtype == c.dtype && o.max_tokens == c.max_tokens &&
                          o.oneshot_cap == c.oneshot_cap && o.device == c.device,
                      "arfuse: comms[", n, "]: must be rank ", n, " of the same group, hidden, ",
                      "dtype, capacity and device");
    c.peers[n] = o.data;
  }
  c.peers_ready = true;
}

void comm_destroy(int64_t comm) {
  if (!t_pending.empty()) {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_comms.find(comm);
    for (const Pending& q : t_pending) {
      TORCH_CHECK(it == g_comms.end() || q.params.ctrl != it->second->ctrl, "arfuse: comm: ",
                  comm, " has deferred launches still queued (flush_launches first)");
    }
  }
  std::unique_ptr<Comm> c;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_comms.find(comm);
    if (it == g_comms.end()) return;  // closing twice is harmless
    c = std::move(it->second);
    g_comms.erase(it);
  }
  if (!c->device.is_cuda()) return;
  const c10::cuda::CUDAGuard guard(c->device);
  cudaDeviceSynchronize();  // no kernel may still use the buffers
  for (int n = 0; n < c->world; ++n) {
    if (c->ipc_opened[n]) cudaIpcCloseMemHandle(c->peers[n]);
  }
  if (c->data) cudaFree(c->data);
  if (c->ctrl) cudaFree(c->ctrl);
  if (c->error_host) cudaFreeHost(c->error_host);
}

int64_t comm_status(int64_t comm) {
  Comm& c = get_comm(comm);
  return c.error_host ? static_cast<int64_t>(*reinterpret_cast<volatile uint32_t*>(c.error_host)) : 0;
}

std::vector<int64_t> comm_info(int64_t comm) {
  Comm& c = get_comm(comm);
  return {c.rank,
          c.world,
          c.hidden,
          static_cast<int64_t>(c.dtype),
          c.max_tokens,
          c.oneshot_cap,
          c.ranks_per_device,
          c.device.is_cuda() ? c.device.index() : -1,
          c.peers_ready ? 1 : 0,
          c.slot_elems};
}

// ---------------------------------------------------------------------------------------------
// Validation shared by the CUDA and Meta implementations.
// ---------------------------------------------------------------------------------------------
namespace {

void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 || t.numel() == 0,
                    "arfuse: ", name, ": data must be 16-byte aligned (a view at an odd offset?)");
}

void check_tensor(const at::Tensor& t, const char* name, const Comm& c, bool check_device) {
  TORCH_CHECK_VALUE(t.is_contiguous(), "arfuse: ", name, ": must be contiguous");
  if (check_device) {
    TORCH_CHECK_VALUE(t.device() == c.device, "arfuse: ", name, ": is on ", t.device(),
                      " but the communicator is on ", c.device);
    check_aligned(t, name);
  }
}

// The finalize inputs of LaunchParams, shared by the fused op and the standalone finalize
// (Checked and FinalizeChecked both carry T, H, K, P, layout and weights_f32).
template <class K>
LaunchParams finalize_params(const K& k, const at::Tensor& expert_out,
                             const std::optional<at::Tensor>& permuted_idx,
                             const std::optional<at::Tensor>& expert_weights,
                             const std::optional<at::Tensor>& shared_out, double routed_scaling) {
  LaunchParams p;
  std::memset(&p, 0, sizeof(p));
  p.expert_out = expert_out.data_ptr();
  p.permuted_idx = permuted_idx ? permuted_idx->data_ptr<int32_t>() : nullptr;
  p.expert_weights = expert_weights ? expert_weights->data_ptr() : nullptr;
  p.shared_out = shared_out ? shared_out->data_ptr() : nullptr;
  p.num_rows = k.P;
  p.layout = static_cast<int32_t>(k.layout);
  p.weights_f32 = k.weights_f32 ? 1 : 0;
  p.num_tokens = static_cast<int32_t>(k.T);
  p.top_k = static_cast<int32_t>(k.K);
  p.hidden = static_cast<int32_t>(k.H);
  p.routed_scaling = static_cast<float>(routed_scaling);
  return p;
}

void check_act(const at::Tensor& t, const char* name, const Comm& c) {
  TORCH_CHECK_TYPE(t.scalar_type() == c.scalar, "arfuse: ", name, ": dtype ", t.scalar_type(),
                   " does not match the communicator's ", c.scalar);
}

}  // namespace

Checked validate(const Comm& c, const at::Tensor& expert_out,
                 const std::optional<at::Tensor>& permuted_idx,
                 const std::optional<at::Tensor>& expert_weights,
                 const std::optional<at::Tensor>& shared_out,
                 const std::optional<at::Tensor>& residual_opt, const at::Tensor& gamma, double eps,
                 double weight_bias,
                 const std::optional<at::Tensor>& fp8_scale, int64_t algorithm, bool check_device,
                 const DynamicQuant* dq) {
  Checked k;
  TORCH_CHECK_VALUE(c.peers_ready, "arfuse: comm: peers are not set (Communicator not finished)");
  TORCH_CHECK_VALUE(algorithm >= 0 && algorithm <= 2, "arfuse: algorithm: ", algorithm,
                    " is not one of 0 (auto), 1 (oneshot), 2 (twoshot)");
  // T and H come from the residual, or without one (no residual add: vLLM's first layer) from
  // the expert input: [T, H] plain, [T, K, H] dense, permuted_idx [T, K] with rows [P, H].
  const char* shape_arg = "residual";
  if (residual_opt.has_value()) {
    const at::Tensor& residual = *residual_opt;
    TORCH_CHECK_VALUE(residual.dim() == 2, "arfuse: residual: want [T, H], got ", residual.sizes());
    k.T = residual.size(0);
    k.H = residual.size(1);
    check_act(residual, "residual", c);
    check_tensor(residual, "residual", c, check_device);
  } else if (permuted_idx.has_value()) {
    shape_arg = "permuted_idx";
    TORCH_CHECK_VALUE(permuted_idx->dim() == 2, "arfuse: permuted_idx: want [T, K], got ",
                      permuted_idx->sizes());
    k.T = permuted_idx->size(0);
    k.H = expert_out.size(-1);
  } else {
    shape_arg = "expert_out";
    TORCH_CHECK_VALUE(expert_out.dim() == 2 || expert_out.dim() == 3,
                      "arfuse: expert_out: want [T, H] or [T, K, H], got ", expert_out.sizes());
    k.T = expert_out.size(0);
    k.H = expert_out.size(-1);
  }
  TORCH_CHECK_VALUE(k.H == c.hidden, "arfuse: ", shape_arg, ": hidden size ", k.H,
                    " does not match the communicator's ", c.hidden);
  TORCH_CHECK_VALUE(k.T <= c.max_tokens, "arfuse: ", shape_arg, ": ", k.T,
                    " tokens exceed the communicator's capacity max_tokens=", c.max_tokens);

  check_act(expert_out, "expert_out", c);
  check_tensor(expert_out, "expert_out", c, check_device);
  if (permuted_idx.has_value()) {
    const at::Tensor& idx = *permuted_idx;
    k.layout = Layout::kPermuted;
    TORCH_CHECK_VALUE(expert_out.dim() == 2 && expert_out.size(1) == k.H,
                      "arfuse: expert_out: with permuted_idx want permuted rows [P, H=", k.H,
                      "], got ", expert_out.sizes());
    TORCH_CHECK_TYPE(idx.scalar_type() == at::kInt, "arfuse: permuted_idx: dtype ",
                     idx.scalar_type(), " (want int32)");
    TORCH_CHECK_VALUE(idx.dim() == 2 && idx.size(0) == k.T && idx.size(1) >= 1 &&
                          idx.size(1) <= kMaxTopK,
                      "arfuse: permuted_idx: want [T=", k.T, ", K] with 1 <= K <= ", kMaxTopK,
                      ", got ", idx.sizes());
    check_tensor(idx, "permuted_idx", c, check_device);
    k.K = idx.size(1);
    k.P = expert_out.size(0);
  } else if (expert_out.dim() == 3) {
    k.layout = Layout::kDense;
    TORCH_CHECK_VALUE(expert_out.size(0) == k.T && expert_out.size(2) == k.H &&
                          expert_out.size(1) >= 1 && expert_out.size(1) <= kMaxTopK,
                      "arfuse: expert_out: dense layout wants [T=", k.T, ", K, H=", k.H,
                      "] with 1 <= K <= ", kMaxTopK, ", got ", expert_out.sizes());
    k.K = expert_out.size(1);
    k.P = k.T * k.K;
  } else {
    k.layout = Layout::kPlain;
    TORCH_CHECK_VALUE(expert_out.dim() == 2 && expert_out.size(0) == k.T &&
                          expert_out.size(1) == k.H,
                      "arfuse: expert_out: want [T=", k.T, ", H=", k.H,
                      "] (plain), [T, K, H] (dense) or [P, H] with permuted_idx, got ",
                      expert_out.sizes());
    k.K = 1;
    k.P = k.T;
  }
  if (expert_weights.has_value()) {
    const at::Tensor& w = *expert_weights;
    TORCH_CHECK_VALUE(k.layout != Layout::kPlain,
                      "arfuse: expert_weights: the plain layout is already reduced over experts; "
                      "pass no weights (fold them into expert_out or routed_scaling)");
    TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat || w.scalar_type() == c.scalar,
                     "arfuse: expert_weights: dtype ", w.scalar_type(), " (want float32 or ",
                     c.scalar, ")");
    TORCH_CHECK_VALUE(w.dim() == 2 && w.size(0) == k.T && w.size(1) == k.K,
                      "arfuse: expert_weights: want [T=", k.T, ", K=", k.K, "], got ", w.sizes());
    check_tensor(w, "expert_weights", c, check_device);
    k.weights_f32 = w.scalar_type() == at::kFloat;
  }
  if (shared_out.has_value()) {
    const at::Tensor& s = *shared_out;
    check_act(s, "shared_out", c);
    TORCH_CHECK_VALUE(s.dim() == 2 && s.size(0) == k.T && s.size(1) == k.H,
                      "arfuse: shared_out: want [T=", k.T, ", H=", k.H, "], got ", s.sizes());
    check_tensor(s, "shared_out", c, check_device);
  }
  TORCH_CHECK_TYPE(gamma.scalar_type() == at::kFloat || gamma.scalar_type() == c.scalar,
                   "arfuse: gamma: dtype ", gamma.scalar_type(), " (want float32 or ", c.scalar,
                   ")");
  TORCH_CHECK_VALUE(gamma.dim() == 1 && gamma.size(0) == k.H, "arfuse: gamma: want [H=", k.H,
                    "], got ", gamma.sizes());
  check_tensor(gamma, "gamma", c, check_device);
  k.gamma_f32 = gamma.scalar_type() == at::kFloat;
  TORCH_CHECK_VALUE(eps >= 0.0, "arfuse: eps: ", eps, " must be >= 0");
  TORCH_CHECK_VALUE(weight_bias == 0.0 || weight_bias == 1.0, "arfuse: weight_bias: ", weight_bias,
                    " must be 0 (x * gamma) or 1 (x * (1 + gamma))");
  k.out = OutKind::kNorm;
  if (fp8_scale.has_value()) {
    const at::Tensor& s = *fp8_scale;
    TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, "arfuse: fp8_scale: dtype ", s.scalar_type(),
                     " (want float32)");
    TORCH_CHECK_VALUE(s.numel() == 1, "arfuse: fp8_scale: want one element (per-tensor), got ",
                      s.sizes());
    check_tensor(s, "fp8_scale", c, check_device);
    k.out = OutKind::kFP8Static;
  }
  if (dq != nullptr) {
    // Dynamic FP8 scales (vLLM's per-token and per-token-group quantization; see params.h).
    TORCH_CHECK_VALUE(dq->group_size == 0 || dq->group_size == kQuantGroup, "arfuse: group_size: ",
                      dq->group_size, " is not supported (want 0: one scale per token, or ",
                      kQuantGroup, ": one scale per group of ", kQuantGroup, " elements)");
    const bool has_ub = dq->scale_ub != nullptr && dq->scale_ub->has_value();
    if (dq->group_size == kQuantGroup) {
      TORCH_CHECK_VALUE(k.H % kQuantGroup == 0, "arfuse: hidden: ", k.H,
                        " is not a multiple of group_size=", kQuantGroup,
                        " (per-group FP8 scales need whole groups of ", kQuantGroup,
                        " elements; use group_size=0, one scale per token)");
      TORCH_CHECK_VALUE(!has_ub, "arfuse: scale_ub: an upper bound applies to per-token scales "
                        "only (group_size=0), not to group_size=", kQuantGroup);
      k.out = OutKind::kFP8Group128;
    } else {
      TORCH_CHECK_VALUE(!dq->col_major, "arfuse: col_major_scales: the column-major layout "
                        "applies to per-group scales only (group_size=", kQuantGroup, ")");
      TORCH_CHECK_VALUE(!dq->ue8m0, "arfuse: ue8m0: power-of-two scales apply to per-group "
                        "scales only (group_size=", kQuantGroup, ")");
      if (has_ub) {
        const at::Tensor& ub = **dq->scale_ub;
        TORCH_CHECK_TYPE(ub.scalar_type() == at::kFloat, "arfuse: scale_ub: dtype ",
                         ub.scalar_type(), " (want float32)");
        TORCH_CHECK_VALUE(ub.numel() == 1, "arfuse: scale_ub: want one element (an upper bound "
                          "of every token's amax), got ", ub.sizes());
        const at::Device want = check_device ? c.device : expert_out.device();
        TORCH_CHECK_VALUE(ub.device() == want, "arfuse: scale_ub: is on ", ub.device(), " but ",
                          check_device ? "the communicator" : "expert_out", " is on ", want);
      }
      k.out = OutKind::kFP8Token;
    }
  }

  // Algorithm and instance, decided before anything is launched. A CPU communicator (world
  // size 1, arfuse/_cpu.py) launches no kernel: nothing more to decide.
  if (!c.device.is_cuda()) return k;
  Algo algo = static_cast<Algo>(algorithm);
  const int H = static_cast<int>(k.H);
  std::string why;
  if (algo == Algo::kAuto) {
    const int64_t limit =
        std::min<int64_t>(c.oneshot_cap, oneshot_max_tokens(c.dtype, H, c.world));
    algo = k.T <= limit ? Algo::kOneShot : Algo::kTwoShot;
    if (find_instance(c.dtype, H, c.world, algo, k.out, &why) == nullptr) {
      const Algo other = algo == Algo::kOneShot ? Algo::kTwoShot : Algo::kOneShot;
      if ((other == Algo::kTwoShot || k.T <= c.oneshot_cap) &&
          find_instance(c.dtype, H, c.world, other, k.out, nullptr) != nullptr) {
        algo = other;
      }
    }
  }
  if (algo == Algo::kOneShot) {
    TORCH_CHECK_VALUE(k.T <= c.oneshot_cap, "arfuse: algorithm: one-shot with ", k.T,
                      " tokens exceeds the communicator's oneshot_max_tokens=", c.oneshot_cap);
  }
  k.algo = algo;
  k.instance = find_instance(c.dtype, H, c.world, algo, k.out, &why);
  TORCH_CHECK_VALUE(k.instance != nullptr, "arfuse: ", why);
  return k;
}

// The dynamic FP8 outputs and settings of one launch (fused_fp8_dynamic).
struct QuantOut {
  at::Tensor scales;                   // float32 [T] or [T, H / 128] (either layout)
  std::optional<at::Tensor> scale_ub;  // per token: [1] float32 on the device
  bool col_major = false, ue8m0 = false;
};

void launch(const Comm& c, const Checked& k, const at::Tensor& expert_out,
            const std::optional<at::Tensor>& permuted_idx,
            const std::optional<at::Tensor>& expert_weights,
            const std::optional<at::Tensor>& shared_out,
            const std::optional<at::Tensor>& residual, const at::Tensor& gamma, double eps,
            double weight_bias, double routed_scaling, const std::optional<at::Tensor>& fp8_scale,
            const at::Tensor& norm_out, const at::Tensor& residual_out,
            const QuantOut* quant = nullptr) {
  const uint32_t err_word = *reinterpret_cast<volatile uint32_t*>(c.error_host);
  TORCH_CHECK(err_word == 0, "arfuse: comm: this communicator is broken: an earlier call gave up "
              "waiting for rank ", err_word - 1, " after ", c.timeout_ns / 1000000,
              " ms (ranks called with different token counts, or a rank died); close it and "
              "create a new one");
  LaunchParams p =
      finalize_params(k, expert_out, permuted_idx, expert_weights, shared_out, routed_scaling);
  p.residual = residual ? residual->data_ptr() : nullptr;
  p.gamma = gamma.data_ptr();
  p.fp8_scale = fp8_scale ? fp8_scale->data_ptr<float>() : nullptr;
  p.gamma_f32 = k.gamma_f32 ? 1 : 0;
  p.world_size = c.world;
  p.rank = c.rank;
  p.eps = static_cast<float>(eps);
  p.weight_bias = static_cast<float>(weight_bias);
  p.norm_out = norm_out.data_ptr();
  p.residual_out = residual_out.data_ptr();
  if (quant != nullptr) {
    p.scale_out = quant->scales.data_ptr<float>();
    p.scale_ub = quant->scale_ub.has_value() ? quant->scale_ub->data_ptr<float>() : nullptr;
    p.scale_col_major = quant->col_major ? 1 : 0;
    p.scale_ue8m0 = quant->ue8m0 ? 1 : 0;
  }
  for (int n = 0; n < kMaxWorld; ++n) p.buffers[n] = c.peers[n];
  p.ctrl = c.ctrl;
  p.error_flag = c.error_dev;
  p.slot_elems = c.slot_elems;
  p.max_blocks = 0;
  p.ranks_per_device = c.ranks_per_device;
  p.timeout_ns = c.timeout_ns;
  const c10::cuda::CUDAGuard guard(c.device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(c.device.index()).stream();
  TORCH_CHECK(t_defer || t_pending.empty(), "arfuse: ", t_pending.size(),
              " deferred launches are still queued on this thread: flush_launches first");
  if (t_defer) {
    // Load the kernel and size the grid now, so that flushing issues nothing but launches.
    p.prepare_only = 1;
    const cudaError_t err = k.instance->launch(p, stream);
    TORCH_CHECK(err == cudaSuccess, "arfuse: preparing ", k.instance->name,
                " failed: ", cudaGetErrorString(err));
    p.prepare_only = 0;
    std::vector<at::Tensor> keep = {expert_out, gamma, norm_out, residual_out};
    for (const auto* t : {&permuted_idx, &expert_weights, &shared_out, &residual, &fp8_scale}) {
      if (t->has_value()) keep.push_back(**t);
    }
    if (quant != nullptr) {
      keep.push_back(quant->scales);
      if (quant->scale_ub.has_value()) keep.push_back(*quant->scale_ub);
    }
    t_pending.push_back(Pending{k.instance, p, stream, c.device, std::move(keep)});
    return;
  }
  const cudaError_t err = k.instance->launch(p, stream);
  TORCH_CHECK(err == cudaSuccess, "arfuse: launch of ", k.instance->name,
              " failed: ", cudaGetErrorString(err));
}

void defer_launches(bool enable) {
  TORCH_CHECK_VALUE(!enable || t_pending.empty(),
                    "arfuse: defer_launches: ", t_pending.size(),
                    " deferred launches were never flushed");
  t_defer = enable;
}

int64_t flush_launches(bool do_launch) {
  std::vector<Pending> pending;
  pending.swap(t_pending);
  if (!do_launch) return static_cast<int64_t>(pending.size());
  std::string failed;
  for (const Pending& q : pending) {
    const c10::cuda::CUDAGuard guard(q.device);
    const cudaError_t err = q.instance->launch(q.params, q.stream);
    if (err != cudaSuccess && failed.empty()) {
      failed = std::string(q.instance->name) + ": " + cudaGetErrorString(err);
    }
  }
  // A failed launch leaves its peers waiting: they give up after the timeout (no hang).
  TORCH_CHECK(failed.empty(), "arfuse: deferred launch of ", failed, " failed");
  return static_cast<int64_t>(pending.size());
}

std::tuple<at::Tensor, at::Tensor> fused(
    const at::Tensor& expert_out, const std::optional<at::Tensor>& permuted_idx,
    const std::optional<at::Tensor>& expert_weights, const std::optional<at::Tensor>& shared_out,
    const std::optional<at::Tensor>& residual, const at::Tensor& gamma, double eps,
    double weight_bias, double routed_scaling, const std::optional<at::Tensor>& fp8_scale,
    int64_t comm, int64_t algorithm) {
  const Comm& c = get_comm(comm);
  TORCH_CHECK_VALUE(c.device.is_cuda(), "arfuse: comm: a CPU communicator cannot run CUDA tensors");
  const Checked k = validate(c, expert_out, permuted_idx, expert_weights, shared_out, residual,
                             gamma, eps, weight_bias, fp8_scale, algorithm, /*check_device=*/true);
  const auto out_type = k.out == OutKind::kFP8Static ? at::kFloat8_e4m3fn : c.scalar;
  at::Tensor norm_out = at::empty({k.T, k.H}, expert_out.options().dtype(out_type));
  at::Tensor residual_out = at::empty({k.T, k.H}, expert_out.options());
  if (k.T == 0) return {norm_out, residual_out};
  launch(c, k, expert_out, permuted_idx, expert_weights, shared_out, residual, gamma, eps,
         weight_bias, routed_scaling, fp8_scale, norm_out, residual_out);
  return {norm_out, residual_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_fp8_dynamic(
    const at::Tensor& expert_out, const std::optional<at::Tensor>& permuted_idx,
    const std::optional<at::Tensor>& expert_weights, const std::optional<at::Tensor>& shared_out,
    const std::optional<at::Tensor>& residual, const at::Tensor& gamma, double eps,
    double weight_bias, double routed_scaling, int64_t group_size,
    const std::optional<at::Tensor>& scale_ub, bool col_major_scales, bool ue8m0, int64_t comm,
    int64_t algorithm) {
  const Comm& c = get_comm(comm);
  TORCH_CHECK_VALUE(c.device.is_cuda(), "arfuse: comm: a CPU communicator cannot run CUDA tensors");
  const DynamicQuant dq{group_size, &scale_ub, col_major_scales, ue8m0};
  const Checked k = validate(c, expert_out, permuted_idx, expert_weights, shared_out, residual,
                             gamma, eps, weight_bias, std::nullopt, algorithm,
                             /*check_device=*/true, &dq);
  // Allocated in this order (q, residual_out, scales): the GPU tests poison these blocks first.
  at::Tensor q = at::empty({k.T, k.H}, expert_out.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor residual_out = at::empty({k.T, k.H}, expert_out.options());
  const auto f32 = expert_out.options().dtype(at::kFloat);
  at::Tensor scales;
  if (k.out == OutKind::kFP8Token) {
    scales = at::empty({k.T}, f32);
  } else if (col_major_scales) {
    // Column-major [T, G]: scale (t, g) at g * T + t, the layout block-FP8 GEMMs read (strides
    // (1, T); a [G, T] tensor transposed, as vLLM's per_token_group_quant_fp8 allocates it).
    scales = at::empty({k.H / kQuantGroup, k.T}, f32).t();
  } else {
    scales = at::empty({k.T, k.H / kQuantGroup}, f32);
  }
  if (k.T == 0) return {q, residual_out, scales};
  const QuantOut quant{scales, scale_ub, col_major_scales, ue8m0};
  launch(c, k, expert_out, permuted_idx, expert_weights, shared_out, residual, gamma, eps,
         weight_bias, routed_scaling, std::nullopt, q, residual_out, &quant);
  return {q, residual_out, scales};
}

void fused_inplace(at::Tensor& input, at::Tensor& residual,
                   const std::optional<at::Tensor>& shared_out, const at::Tensor& gamma, double eps,
                   double weight_bias, double routed_scaling, int64_t comm, int64_t algorithm) {
  const Comm& c = get_comm(comm);
  TORCH_CHECK_VALUE(c.device.is_cuda(), "arfuse: comm: a CPU communicator cannot run CUDA tensors");
  TORCH_CHECK_VALUE(input.dim() == 2, "arfuse: input: in-place needs the plain layout [T, H], got ",
                    input.sizes());
  const std::optional<at::Tensor> res(residual);
  const Checked k = validate(c, input, std::nullopt, std::nullopt, shared_out, res, gamma, eps,
                             weight_bias, std::nullopt, algorithm, /*check_device=*/true);
  if (k.T == 0) return;
  launch(c, k, input, std::nullopt, std::nullopt, shared_out, res, gamma, eps, weight_bias,
         routed_scaling, std::nullopt, input, residual);
}

at::Tensor moe_finalize(const at::Tensor& expert_out, const std::optional<at::Tensor>& permuted_idx,
                        const std::optional<at::Tensor>& expert_weights,
                        const std::optional<at::Tensor>& shared_out, double routed_scaling,
                        int64_t num_tokens) {
  const FinalizeChecked k =
      validate_finalize(expert_out, permuted_idx, expert_weights, shared_out, num_tokens);
  at::Tensor out = at::empty({k.T, k.H}, expert_out.options());
  if (k.T == 0) return out;
  auto dev_check = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.device() == expert_out.device(), "arfuse: ", name, ": is on ", t.device(),
                      " but expert_out is on ", expert_out.device());
  };
  TORCH_CHECK_VALUE(expert_out.is_cuda(), "arfuse: expert_out: must be a CUDA tensor");
  check_aligned(expert_out, "expert_out");
  if (shared_out) check_aligned(*shared_out, "shared_out");
  if (permuted_idx) dev_check(*permuted_idx, "permuted_idx");
  if (expert_weights) dev_check(*expert_weights, "expert_weights");
  if (shared_out) dev_check(*shared_out, "shared_out");
  LaunchParams p =
      finalize_params(k, expert_out, permuted_idx, expert_weights, shared_out, routed_scaling);
  p.norm_out = out.data_ptr();
  const c10::cuda::CUDAGuard guard(expert_out.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(expert_out.device().index()).stream();
  ARFUSE_CUDA_CHECK(launch_finalize(p, k.dtype, stream), "launch of the finalize kernel");
  return out;
}

FinalizeChecked validate_finalize(const at::Tensor& expert_out,
                                  const std::optional<at::Tensor>& permuted_idx,
                                  const std::optional<at::Tensor>& expert_weights,
                                  const std::optional<at::Tensor>& shared_out, int64_t num_tokens) {
  FinalizeChecked k;
  k.dtype = to_dtype(expert_out.scalar_type(), "expert_out");
  TORCH_CHECK_VALUE(expert_out.is_contiguous(), "arfuse: expert_out: must be contiguous");
  TORCH_CHECK_VALUE(num_tokens >= 0 && num_tokens <= (1 << 24), "arfuse: num_tokens: ",
                    num_tokens, " must be 0..16777216");
  k.T = num_tokens;
  if (permuted_idx) {
    TORCH_CHECK_VALUE(expert_out.dim() == 2, "arfuse: expert_out: with permuted_idx want [P, H], got ",
                      expert_out.sizes());
    TORCH_CHECK_TYPE(permuted_idx->scalar_type() == at::kInt, "arfuse: permuted_idx: dtype ",
                     permuted_idx->scalar_type(), " (want int32)");
    TORCH_CHECK_VALUE(permuted_idx->dim() == 2 && permuted_idx->size(0) == k.T &&
                          permuted_idx->size(1) >= 1 && permuted_idx->size(1) <= kMaxTopK &&
                          permuted_idx->is_contiguous(),
                      "arfuse: permuted_idx: want contiguous [T=", k.T, ", K<=", kMaxTopK,
                      "], got ", permuted_idx->sizes());
    k.layout = Layout::kPermuted;
    k.K = permuted_idx->size(1);
    k.P = expert_out.size(0);
    k.H = expert_out.size(1);
  } else if (expert_out.dim() == 3) {
    TORCH_CHECK_VALUE(expert_out.size(0) == k.T && expert_out.size(1) >= 1 &&
                          expert_out.size(1) <= kMaxTopK,
                      "arfuse: expert_out: dense layout wants [T=", k.T, ", K<=", kMaxTopK,
                      ", H], got ", expert_out.sizes());
    k.layout = Layout::kDense;
    k.K = expert_out.size(1);
    k.H = expert_out.size(2);
    k.P = k.T * k.K;
  } else {
    TORCH_CHECK_VALUE(expert_out.dim() == 2 && expert_out.size(0) == k.T,
                      "arfuse: expert_out: want [T=", k.T, ", H], [T, K, H] or [P, H] with "
                      "permuted_idx, got ", expert_out.sizes());
    k.layout = Layout::kPlain;
    k.K = 1;
    k.H = expert_out.size(1);
    k.P = k.T;
  }
  const int vec = vector_elems(k.dtype);
  TORCH_CHECK_VALUE(k.H > 0 && k.H % vec == 0, "arfuse: expert_out: hidden ", k.H,
                    " must be a positive multiple of ", vec);
  if (expert_weights) {
    TORCH_CHECK_VALUE(k.layout != Layout::kPlain,
                      "arfuse: expert_weights: the plain layout takes no weights");
    TORCH_CHECK_TYPE(expert_weights->scalar_type() == at::kFloat ||
                         expert_weights->scalar_type() == expert_out.scalar_type(),
                     "arfuse: expert_weights: dtype ", expert_weights->scalar_type(),
                     " (want float32 or ", expert_out.scalar_type(), ")");
    TORCH_CHECK_VALUE(expert_weights->dim() == 2 && expert_weights->size(0) == k.T &&
                          expert_weights->size(1) == k.K && expert_weights->is_contiguous(),
                      "arfuse: expert_weights: want contiguous [T=", k.T, ", K=", k.K, "], got ",
                      expert_weights->sizes());
    k.weights_f32 = expert_weights->scalar_type() == at::kFloat;
  }
  if (shared_out) {
    TORCH_CHECK_TYPE(shared_out->scalar_type() == expert_out.scalar_type(),
                     "arfuse: shared_out: dtype ", shared_out->scalar_type(), " (want ",
                     expert_out.scalar_type(), ")");
    TORCH_CHECK_VALUE(shared_out->dim() == 2 && shared_out->size(0) == k.T &&
                          shared_out->size(1) == k.H && shared_out->is_contiguous(),
                      "arfuse: shared_out: want contiguous [T=", k.T, ", H=", k.H, "], got ",
                      shared_out->sizes());
  }
  return k;
}

// ---------------------------------------------------------------------------------------------
// Introspection.
// ---------------------------------------------------------------------------------------------
std::vector<std::string> supported_variants() {
  int count = 0;
  const Instance* table = instance_table(&count);
  std::vector<std::string> names;
  names.reserve(count);
  for (int i = 0; i < count; ++i) names.emplace_back(table[i].name);
  return names;
}

std::string instance_for(at::ScalarType dtype, int64_t hidden, int64_t world_size,
                         int64_t algorithm, int64_t out_kind) {
  TORCH_CHECK_VALUE(algorithm == 1 || algorithm == 2, "arfuse: algorithm: want 1 or 2");
  TORCH_CHECK_VALUE(out_kind >= 0 && out_kind <= 3, "arfuse: out_kind: ", out_kind,
                    " is not one of 0 (norm), 1 (fp8_static), 2 (fp8_token), 3 (fp8_group128)");
  std::string why;
  const Instance* inst =
      find_instance(to_dtype(dtype, "dtype"), static_cast<int>(hidden), static_cast<int>(world_size),
                    static_cast<Algo>(algorithm), static_cast<OutKind>(out_kind), &why);
  return inst ? std::string(inst->name) : std::string();
}

int64_t oneshot_threshold(at::ScalarType dtype, int64_t hidden, int64_t world_size) {
  return oneshot_max_tokens(to_dtype(dtype, "dtype"), static_cast<int>(hidden),
                            static_cast<int>(world_size));
}

}  // namespace arfuse::ops
