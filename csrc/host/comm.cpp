// arfuse host code: communicators and their registry (comm.h).
#include "host/comm.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include <cuda_runtime_api.h>

#include "arfuse/dispatch.h"
#include "arfuse/host_kernels.h"
#include "arfuse/protocol.h"
#include "host/device.h"
#include "host/errors.h"
#include "host/launch.h"

namespace arfuse::host {

using torch::headeronly::ScalarType;

namespace {
std::mutex g_mu;
std::unordered_map<int64_t, std::unique_ptr<Comm>> g_comms;
int64_t g_next = 1;
}  // namespace

DType to_dtype(ScalarType t, const char* arg) {
  switch (t) {
    case ScalarType::BFloat16:
      return DType::kBF16;
    case ScalarType::Half:
      return DType::kFP16;
    case ScalarType::Float:
      return DType::kFP32;
    default:
      ARFUSE_CHECK_TYPE(false, arg, ": dtype ", TypeName{t},
                        " is not supported (want bfloat16, float16 or float32)");
  }
  return DType::kBF16;  // unreachable
}

ScalarType to_scalar(DType d) {
  switch (d) {
    case DType::kBF16:
      return ScalarType::BFloat16;
    case DType::kFP16:
      return ScalarType::Half;
    case DType::kFP32:
      return ScalarType::Float;
  }
  return ScalarType::BFloat16;
}

Comm& get(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_comms.find(handle);
  ARFUSE_CHECK_VALUE(it != g_comms.end(), "comm: ", handle,
                     " is not an open communicator (closed, or never created)");
  return *it->second;
}

Comm* find(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_comms.find(handle);
  return it == g_comms.end() ? nullptr : it->second.get();
}

namespace {

// Frees what a communicator allocated (any subset, in reverse order). Errors are ignored: this
// runs on paths that are already failing or closing.
void release(Comm& c) {
  if (!c.cuda) return;
  const DeviceScope scope(c.device_index);
  for (int n = 0; n < c.world; ++n) {
    if (c.ipc_opened[n]) cudaIpcCloseMemHandle(c.peers[n]);
    c.ipc_opened[n] = false;
  }
  if (c.data) cudaFree(c.data);
  if (c.ctrl) cudaFree(c.ctrl);
  if (c.error_host) cudaFreeHost(c.error_host);
  c.data = nullptr;
  c.ctrl = nullptr;
  c.error_host = c.error_dev = nullptr;
}

void allocate(Comm& c) {
  const DeviceScope scope(c.device_index);
  const int64_t elem = dtype_bytes(c.dtype);
  const size_t bytes = static_cast<size_t>(kNumSlots * c.slot_elems * elem);
  ARFUSE_CUDA_CHECK(cudaMalloc(&c.data, bytes), "cudaMalloc of the Lamport buffer");
  ARFUSE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&c.ctrl), sizeof(Ctrl)),
                    "cudaMalloc of the control block");
  ARFUSE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&c.error_host), sizeof(uint32_t),
                                  cudaHostAllocMapped | cudaHostAllocPortable),
                    "cudaHostAlloc of the error word");
  *c.error_host = 0;
  ARFUSE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&c.error_dev),
                                             c.error_host, 0),
                    "cudaHostGetDevicePointer");
  cudaStream_t stream = current_stream(c.device_index);
  ARFUSE_CUDA_CHECK(cudaMemsetAsync(c.ctrl, 0, sizeof(Ctrl), stream), "cudaMemset of control");
  ARFUSE_CUDA_CHECK(fill_sentinel(c.data, kNumSlots * c.slot_elems, c.dtype, stream),
                    "sentinel fill");
  ARFUSE_CUDA_CHECK(cudaStreamSynchronize(stream), "workspace initialisation");
  c.peers[c.rank] = c.data;
}

}  // namespace

int64_t create(int64_t rank, int64_t world_size, int64_t hidden, ScalarType dtype,
               int64_t max_tokens, int64_t oneshot_max_tokens, int64_t ranks_per_device,
               const torch::stable::Device& device, double timeout_s) {
  ARFUSE_CHECK_VALUE(world_size >= 1 && world_size <= kMaxWorld, "world_size: ", world_size,
                     " is not supported (want 1..", kMaxWorld, ")");
  ARFUSE_CHECK_VALUE(rank >= 0 && rank < world_size, "rank: ", rank,
                     " is outside the group (want 0..", world_size - 1, ")");
  const DType dt = to_dtype(dtype, "dtype");
  const int vec = vector_elems(dt);
  ARFUSE_CHECK_VALUE(hidden > 0 && hidden % vec == 0, "hidden: ", hidden,
                     " must be a positive multiple of ", vec, " (one 16-byte vector of ",
                     dtype_name(dt), ")");
  ARFUSE_CHECK_VALUE(max_tokens >= 1 && max_tokens <= (1 << 20), "max_tokens: ", max_tokens,
                     " must be 1..1048576");
  if (oneshot_max_tokens < 0) oneshot_max_tokens = max_tokens;
  ARFUSE_CHECK_VALUE(oneshot_max_tokens <= max_tokens, "oneshot_max_tokens: ", oneshot_max_tokens,
                     " must not exceed max_tokens (", max_tokens, ")");
  ARFUSE_CHECK_VALUE(ranks_per_device >= 1 && ranks_per_device <= world_size,
                     "ranks_per_device: ", ranks_per_device, " must be 1..world_size");
  ARFUSE_CHECK_VALUE(timeout_s > 0, "timeout_s: ", timeout_s, " must be positive");
  ARFUSE_CHECK_VALUE(device.is_cuda() || (device.is_cpu() && world_size == 1), "device: ",
                     DeviceName{device},
                     " is not supported (want a CUDA device; CPU only for world_size 1)");
  if (device.is_cuda()) {
    std::string why;
    bool any = false;
    for (const Algo a : {Algo::kOneShot, Algo::kTwoShot, Algo::kLocal}) {
      if (find_instance(dt, static_cast<int>(hidden), static_cast<int>(world_size), a,
                        OutKind::kNorm, /*tokens=*/-1, nullptr) != nullptr) {
        any = true;
      }
    }
    if (!any) {  // the reason of the algorithm that serves this world size
      find_instance(dt, static_cast<int>(hidden), static_cast<int>(world_size),
                    world_size == 1 ? Algo::kLocal : Algo::kOneShot, OutKind::kNorm,
                    /*tokens=*/-1, &why);
    }
    ARFUSE_CHECK_VALUE(any, "hidden: ", why);
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
  c->cuda = device.is_cuda();
  c->device_index = c->cuda ? (device.has_index() ? device.index() : current_device()) : -1;
  if (c->cuda) {
    // A device that does not exist is refused before any CUDA call is made on it: no CUDA error
    // is raised at all (compute-sanitizer reports every failed API call, even a cleared one).
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      count = 0;
    }
    ARFUSE_CHECK_VALUE(c->device_index >= 0 && c->device_index < count, "device: cuda:",
                       c->device_index, " does not exist (this process sees ", count,
                       " CUDA devices)");
    cudaDeviceProp prop{};
    const cudaError_t err = cudaGetDeviceProperties(&prop, c->device_index);
    if (err != cudaSuccess) (void)cudaGetLastError();  // not left for the next launch's check
    ARFUSE_CHECK_VALUE(err == cudaSuccess, "device: cuda:", c->device_index, " cannot be used (",
                       cudaGetErrorString(err), ")");
    if (world_size > 1) {
      c->auto_oneshot = std::min<int64_t>(
          oneshot_max_tokens, arfuse::oneshot_max_tokens(dt, static_cast<int>(hidden),
                                                         static_cast<int>(world_size),
                                                         card_thresholds(prop.name)));
    }
  }
  c->timeout_ns = static_cast<int64_t>(timeout_s * 1e9);
  // World size 1 runs the local algorithm: no peers, no exchange, so no Lamport buffer, control
  // block or error word (nothing is allocated; the kernel reads only the call's tensors).
  c->slot_elems =
      world_size == 1 ? 0 : rows_per_slot(world_size, max_tokens, oneshot_max_tokens) * hidden;
  if (c->cuda && world_size > 1) {
    try {
      allocate(*c);
      preload(*c);
    } catch (...) {
      release(*c);
      throw;
    }
  }
  if (world_size == 1) c->peers_ready = true;
  std::lock_guard<std::mutex> lock(g_mu);
  const int64_t handle = g_next++;
  g_comms.emplace(handle, std::move(c));
  return handle;
}

void destroy(int64_t handle) {
  std::unique_ptr<Comm> c;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_comms.find(handle);
    if (it == g_comms.end()) return;  // closing twice is harmless
    c = std::move(it->second);
    g_comms.erase(it);
  }
  if (c->local_group) {
    int none = -1;
    c->local_group->closed_rank.compare_exchange_strong(none, c->rank);
  }
  if (!c->cuda) return;
  {
    const DeviceScope scope(c->device_index);
    cudaDeviceSynchronize();  // no kernel may still use the buffers
  }
  release(*c);
}

std::vector<uint8_t> ipc_handle(const Comm& c) {
  ARFUSE_CHECK_VALUE(c.cuda, "comm: a CPU communicator has no IPC handle");
  ARFUSE_CHECK_VALUE(c.data != nullptr, "comm: a communicator of world size 1 has no buffer ",
                     "(the local algorithm exchanges nothing), so no IPC handle");
  const DeviceScope scope(c.device_index);
  cudaIpcMemHandle_t h;
  ARFUSE_CUDA_CHECK(cudaIpcGetMemHandle(&h, c.data), "cudaIpcGetMemHandle");
  std::vector<uint8_t> out(sizeof(h));
  std::memcpy(out.data(), &h, sizeof(h));
  return out;
}

void open_ipc_peers(Comm& c, const uint8_t* handles, int64_t handle_bytes) {
  ARFUSE_CHECK_VALUE(!c.peers_ready, "comm: peers are already set");
  ARFUSE_CHECK_VALUE(handle_bytes == static_cast<int64_t>(sizeof(cudaIpcMemHandle_t)),
                     "handles: want ", sizeof(cudaIpcMemHandle_t), " bytes per rank, got ",
                     handle_bytes);
  const DeviceScope scope(c.device_index);
  for (int n = 0; n < c.world; ++n) {
    if (n == c.rank) continue;
    cudaIpcMemHandle_t mh;
    std::memcpy(&mh, handles + n * handle_bytes, sizeof(mh));
    void* ptr = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&ptr, mh, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      // Close what this call opened: the communicator stays as it was before the call.
      for (int m = 0; m < n; ++m) {
        if (c.ipc_opened[m]) cudaIpcCloseMemHandle(c.peers[m]);
        c.ipc_opened[m] = false;
        if (m != c.rank) c.peers[m] = nullptr;
      }
      ARFUSE_CHECK(false, "opening rank ", n, "'s buffer (cudaIpcOpenMemHandle) failed: ",
                   cudaGetErrorString(err));
    }
    c.peers[n] = ptr;
    c.ipc_opened[n] = true;
  }
  c.peers_ready = true;
}

void set_local_peers(Comm& c, const std::vector<int64_t>& comms) {
  ARFUSE_CHECK_VALUE(!c.peers_ready, "comm: peers are already set");
  ARFUSE_CHECK_VALUE(static_cast<int>(comms.size()) == c.world, "comms: want ", c.world,
                     " communicators (one per rank, in rank order), got ", comms.size());
  void* peers[kMaxWorld] = {};
  std::shared_ptr<LocalGroupState> state;
  for (int n = 0; n < c.world; ++n) {
    const Comm& o = get(comms[n]);
    if (o.local_group) state = o.local_group;
    ARFUSE_CHECK_VALUE(o.rank == n && o.world == c.world && o.hidden == c.hidden &&
                           o.dtype == c.dtype && o.max_tokens == c.max_tokens &&
                           o.oneshot_cap == c.oneshot_cap && o.cuda == c.cuda &&
                           o.device_index == c.device_index,
                       "comms[", n, "]: must be rank ", n, " of the same group, hidden, ",
                       "dtype, capacity and device");
    peers[n] = o.data;
  }
  for (int n = 0; n < c.world; ++n) c.peers[n] = peers[n];
  c.local_group = state ? state : std::make_shared<LocalGroupState>();
  c.peers_ready = true;
}

std::vector<int64_t> info(const Comm& c) {
  return {c.rank,
          c.world,
          c.hidden,
          static_cast<int64_t>(c.dtype),
          c.max_tokens,
          c.oneshot_cap,
          c.ranks_per_device,
          c.cuda ? c.device_index : -1,
          c.peers_ready ? 1 : 0,
          c.slot_elems,
          c.pdl ? 1 : 0,
          c.auto_oneshot};
}

void set_pdl(Comm& c, bool enable) {
  ARFUSE_CHECK_VALUE(c.cuda, "pdl: a CPU communicator launches no kernels (programmatic dependent "
                     "launch is for CUDA communicators)");
  c.pdl = enable;
}

}  // namespace arfuse::host
