// arfuse host code: communicators and their registry.
//
// A communicator is one rank's share of a tensor-parallel group: its Lamport buffer
// (kNumSlots slots of rows_per_slot rows, arfuse/protocol.h), control block, host-mapped error
// word and the peers' buffers (opened through CUDA IPC, or the other ranks' buffers of an
// emulated group on the same GPU). Python holds it as an opaque int64 handle.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/csrc/stable/device.h>
#include <torch/headeronly/core/ScalarType.h>

#include "arfuse/params.h"

namespace arfuse::host {

// What the ranks of an emulated group (one process, one GPU) share: each holds raw pointers to
// the others' buffers, so once one rank is closed no rank may launch again.
struct LocalGroupState {
  std::atomic<int> closed_rank{-1};
};

struct Comm {
  int rank = 0, world = 1, hidden = 0;
  DType dtype = DType::kBF16;
  torch::headeronly::ScalarType scalar = torch::headeronly::ScalarType::BFloat16;
  int64_t max_tokens = 0, oneshot_cap = 0;
  int ranks_per_device = 1;
  bool cuda = false;       // false: a CPU communicator (world size 1, arfuse/_cpu.py computes)
  int device_index = -1;   // the CUDA device, or -1
  // auto runs one-shot for T <= this (where both algorithms are built): this device's card row
  // (variants/tuning.yaml card_thresholds), else the default table's, else the default rule,
  // capped by oneshot_cap; 0 at world size 1. The communicator's dtype, hidden and world size
  // are fixed, so it is decided once, at creation.
  int64_t auto_oneshot = 0;
  int64_t timeout_ns = 0;
  int64_t slot_elems = 0;  // rows_per_slot * hidden
  void* data = nullptr;
  Ctrl* ctrl = nullptr;
  uint32_t* error_host = nullptr;
  uint32_t* error_dev = nullptr;
  void* peers[kMaxWorld] = {};
  bool ipc_opened[kMaxWorld] = {};
  bool peers_ready = false;
  std::shared_ptr<LocalGroupState> local_group;  // set by set_local_peers (emulated groups)
  // Launch the fused kernels as programmatic dependents of the kernel before them on the stream
  // (PDL, LaunchParams::pdl): set by set_pdl, off at creation.
  bool pdl = false;

  // 0 when healthy; 1 + r after a call gave up waiting for rank r.
  uint32_t error_word() const {
    return error_host ? *reinterpret_cast<volatile uint32_t*>(error_host) : 0;
  }
};

// The dtypes a communicator carries. `arg` names the argument in the error.
DType to_dtype(torch::headeronly::ScalarType t, const char* arg);
torch::headeronly::ScalarType to_scalar(DType d);

// Registry. get() raises ValueError naming the handle when it is not open. The reference stays
// valid until destroy() of that handle (callers do not keep it across calls).
Comm& get(int64_t handle);
Comm* find(int64_t handle);  // nullptr when not open
int64_t create(int64_t rank, int64_t world_size, int64_t hidden, torch::headeronly::ScalarType dtype,
               int64_t max_tokens, int64_t oneshot_max_tokens, int64_t ranks_per_device,
               const torch::stable::Device& device, double timeout_s);
// Removes the handle from the registry and frees its memory after the device is idle. Closing
// twice is harmless. (The entry op first refuses while a deferred launch of it is queued.)
void destroy(int64_t handle);
void open_ipc_peers(Comm& c, const uint8_t* handles, int64_t handle_bytes);
void set_local_peers(Comm& c, const std::vector<int64_t>& comms);
// cudaIpcMemHandle_t of the communicator's buffer, as bytes.
std::vector<uint8_t> ipc_handle(const Comm& c);
// Turns programmatic dependent launch of this communicator's fused kernels on or off. Only a CUDA
// communicator launches anything; a CPU one refuses (ValueError naming the rule).
void set_pdl(Comm& c, bool enable);
// [rank, world, hidden, dtype, max_tokens, oneshot_cap, ranks_per_device, device index or -1,
//  peers ready, slot_elems, pdl, auto_oneshot]
std::vector<int64_t> info(const Comm& c);

}  // namespace arfuse::host
