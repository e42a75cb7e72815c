// The floor of the latency ladder (python -m arfuse.bench.ladder, issue 16): the least work a
// one-shot all-reduce + residual add + RMSNorm of bf16 rows needs, and nothing else -- each
// rank pushes its [T, H] row into every rank's buffer, polls its own buffer until the N rows are
// there, resets them to the sentinel as it reads them, sums them in rank order in float32, adds
// the residual, writes residual_out (bf16) and the RMSNorm of it. No finalize, no shared row, no
// epoch or completion counter (the caller passes the slot: call c of a graph uses slot c % 3),
// no timeout, no grid cap: one block per token, one 16-byte vector per thread.
//
// The safe floor (counters != nullptr; the ladder's rung `safe_floor`): the same kernel made
// usable in a graph replayed as it is -- the slot is no longer a launch argument but read from a
// per-rank epoch in device memory (counters[0], after the input loads are issued, so that the two
// round trips overlap), every block counts its arrival at its end (counters[1], a `red`), and
// block 0 waits for all of them, then resets the count and advances the epoch for the next call
// (at T = 1 it is the only block: no wait). The least a replay-safe one-shot adds; still no
// timeout, no grid cap.
//
// A benchmark tool, not part of the library: compiled on the GPU machine by the ladder with the
// nvcc it finds (one shared object per world size) against the kernel's own device helpers
// (csrc/arfuse/device.cuh: vectors, sentinel, loads and stores), launched through ctypes on the
// caller's stream (so that CUDA-graph capture records it).
//
// Protocol facts it relies on (the same as arfuse's one-shot, docs/design.md): a pushed value is
// never the sentinel (-0.0 in every bf16 lane; pushes are canonicalised to +0.0), every slot is
// all-sentinel when a call starts (each reader resets what it read), and three slots rotate so
// that no rank can push into a slot a peer is still reading.
#include <cuda_runtime.h>
#include <stdint.h>

#include "arfuse/device.cuh"  // the kernel's own vector, sentinel, load and store helpers

#ifndef FLOOR_WORLD
#error "compile with -DFLOOR_WORLD=N"
#endif

namespace {

using arfuse::canonical;
using arfuse::has_sentinel;
using arfuse::ld_poll;
using arfuse::ld_stream;
using arfuse::pack;
using arfuse::sentinel_vec;
using arfuse::sentinel_word;
using arfuse::st_push;
using arfuse::st_vec;
using arfuse::unpack;
using T = __nv_bfloat16;

constexpr int kWorld = FLOOR_WORLD;

struct FloorArgs {
  const uint16_t* x;          // [T, H] this rank's partial
  const uint16_t* residual;   // [T, H]
  const uint16_t* gamma;      // [H]
  uint16_t* norm_out;         // [T, H]
  uint16_t* residual_out;     // [T, H]
  uint16_t* buffers[kWorld];  // every rank's buffer: 3 slots of [max_tokens][N][H]
  int* counters;              // nullptr, or this rank's {epoch, arrivals} (the safe floor)
  int64_t slot_elems;
  int rank, hidden, slot;
  float eps;
};

// Up to 1024 threads (H = 7168: 896): the launch bound keeps the registers within one block per SM
// (without it ptxas took 80 registers and the launch failed with too many resources).
__global__ void __launch_bounds__(1024) floor_oneshot(const __grid_constant__ FloorArgs a) {
  __shared__ float warp_sums[32];
  const int t = blockIdx.x;
  const int v = threadIdx.x;
  const int nvec = a.hidden / 8;
  const bool active = v < nvec;
  const int64_t H = a.hidden;
  const int64_t elem = static_cast<int64_t>(v) * 8;

  // Every input load issued first: the row, the residual, gamma.
  uint4 xv = make_uint4(0, 0, 0, 0), rv = xv, gv = xv;
  if (active) {
    xv = ld_stream(a.x + t * H + elem);
    rv = ld_stream(a.residual + t * H + elem);
    gv = ld_stream(a.gamma + elem);
  }
  const int slot = a.counters != nullptr ? __ldcg(a.counters) % 3 : a.slot;
  const int64_t slot_off = static_cast<int64_t>(slot) * a.slot_elems;
  float s[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) s[j] = 0.0f;
  if (active) {
    const uint4 out = canonical<T>(xv);
    const int64_t off = slot_off + (static_cast<int64_t>(t) * kWorld + a.rank) * H + elem;
#pragma unroll
    for (int q = 0; q < kWorld; ++q) st_push(a.buffers[q] + off, out);

    uint16_t* own = a.buffers[a.rank] + slot_off + static_cast<int64_t>(t) * kWorld * H + elem;
    uint4 in[kWorld];
#pragma unroll
    for (int q = 0; q < kWorld; ++q) in[q] = ld_poll(own + q * H);
    const uint4 sentinel = sentinel_vec(sentinel_word<T>());
#pragma unroll
    for (int q = 0; q < kWorld; ++q) {
      while (has_sentinel<T>(in[q])) in[q] = ld_poll(own + q * H);
      st_vec(own + q * H, sentinel);
      float f[8];
      unpack<T>(in[q], f);
#pragma unroll
      for (int j = 0; j < 8; ++j) s[j] += f[j];
    }
  }
  // residual_out = round(sum + residual); the norm reads the rounded value.
  float r[8], g[8];
  unpack<T>(rv, r);
  unpack<T>(gv, g);
#pragma unroll
  for (int j = 0; j < 8; ++j) s[j] += r[j];
  const uint4 ro = pack<T>(s);
  float ss = 0.0f;
  if (active) {
    st_vec(a.residual_out + t * H + elem, ro);
    unpack<T>(ro, s);
#pragma unroll
    for (int j = 0; j < 8; ++j) ss = fmaf(s[j], s[j], ss);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if ((v & 31) == 0) warp_sums[v / 32] = ss;
  __syncthreads();
  float total = 0.0f;
  const int warps = (blockDim.x + 31) / 32;
  for (int w = 0; w < warps; ++w) total += warp_sums[w];
  const float inv = rsqrtf(total / static_cast<float>(a.hidden) + a.eps);
  if (active) {
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j] = (s[j] * inv) * g[j];
    st_vec(a.norm_out + t * H + elem, pack<T>(s));
  }
  if (a.counters != nullptr && v == 0) {
    // Every thread of this block read the epoch before the __syncthreads above: arriving now
    // cannot let block 0 advance it under a reader.
    if (gridDim.x > 1) atomicAdd(a.counters + 1, 1);
    if (t == 0) {
      if (gridDim.x > 1) {
        volatile int* arrivals = a.counters + 1;
        while (*arrivals < static_cast<int>(gridDim.x)) {
        }
        *arrivals = 0;
      }
      a.counters[0] += 1;  // the next call on this stream reads it after this kernel ends
    }
  }
}

__global__ void empty_kernel() {}

}  // namespace

extern "C" {

// One call of the floor kernel on `stream`: T blocks of round_up(H / 8, 32) threads. Returns a
// cudaError_t (0: launched).
// counters: nullptr (the slot as given), or this rank's two int32 {epoch, arrivals}, zero before
// the first call (the safe floor: the slot is then epoch % 3).
int floor_launch(const void* x, const void* residual, const void* gamma, void* norm_out,
                 void* residual_out, void* const* buffers, int64_t slot_elems, int rank,
                 int tokens, int hidden, int slot, float eps, void* counters, void* stream) {
  if (hidden % 8 != 0 || hidden / 8 > 1024 || tokens < 1) return cudaErrorInvalidValue;
  FloorArgs a;
  a.x = static_cast<const uint16_t*>(x);
  a.residual = static_cast<const uint16_t*>(residual);
  a.gamma = static_cast<const uint16_t*>(gamma);
  a.norm_out = static_cast<uint16_t*>(norm_out);
  a.residual_out = static_cast<uint16_t*>(residual_out);
  for (int q = 0; q < kWorld; ++q) a.buffers[q] = static_cast<uint16_t*>(buffers[q]);
  a.counters = static_cast<int*>(counters);
  a.slot_elems = slot_elems;
  a.rank = rank;
  a.hidden = hidden;
  a.slot = slot;
  a.eps = eps;
  const int threads = ((hidden / 8 + 31) / 32) * 32;
  floor_oneshot<<<tokens, threads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  return static_cast<int>(cudaGetLastError());
}

// One empty kernel of one block on `stream` (the ladder's first rung: what a graph node costs).
int empty_launch(void* stream) {
  empty_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>();
  return static_cast<int>(cudaGetLastError());
}

int world_size() { return kWorld; }

// Loads the floor kernel's module now (CUDA's lazy loading would otherwise load it at the first
// launch, which must not happen while a peer's copy spins). Returns a cudaError_t.
int floor_prepare() {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, floor_oneshot);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, empty_kernel);
  return static_cast<int>(e);
}

}  // extern "C"
