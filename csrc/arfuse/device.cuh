// arfuse: device helpers shared by the fused kernel and the standalone kernels.
//
// Hand-written, variant-independent: element types, 16-byte vector packing, the Lamport sentinel,
// memory-access primitives with explicit caching and ordering, and the bounded wait.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "arfuse/params.h"

namespace arfuse {

// ---------------------------------------------------------------------------------------------
// Element types. kVec elements make one 16-byte access (kVectorBytes, a uint4). The Lamport sentinel is the bit pattern
// of -0.0 in the element type: buffers are filled with it, a sender never sends it (a -0.0 value
// is sent as +0.0), and a receiver treats any element still holding it as "not arrived". The
// test is on bits, never a float compare (a float compare would also match +0.0 and, with
// flush-to-zero, subnormals).
// ---------------------------------------------------------------------------------------------
template <typename T>
struct Elem;

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kVec = kVectorBytes / static_cast<int>(sizeof(__nv_bfloat16));
  static __device__ __forceinline__ float to_float(uint16_t bits) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  }
  static __device__ __forceinline__ uint16_t from_float(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
};

template <>
struct Elem<__half> {
  static constexpr int kVec = kVectorBytes / static_cast<int>(sizeof(__half));
  static __device__ __forceinline__ float to_float(uint16_t bits) {
    return __half2float(__ushort_as_half(bits));
  }
  static __device__ __forceinline__ uint16_t from_float(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
};

template <>
struct Elem<float> {
  static constexpr int kVec = kVectorBytes / static_cast<int>(sizeof(float));
};

// A 16-byte vector unpacked to / packed from kVec floats.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& v, float (&f)[Elem<T>::kVec]) {
  if constexpr (sizeof(T) == 2) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = Elem<T>::to_float(static_cast<uint16_t>(w[i] & 0xffffu));
      f[2 * i + 1] = Elem<T>::to_float(static_cast<uint16_t>(w[i] >> 16));
    }
  } else {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float (&f)[Elem<T>::kVec]) {
  if constexpr (sizeof(T) == 2) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = static_cast<uint32_t>(Elem<T>::from_float(f[2 * i])) |
             (static_cast<uint32_t>(Elem<T>::from_float(f[2 * i + 1])) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
}

// The sentinel, replicated over one 32-bit word.
template <typename T>
__host__ __device__ constexpr uint32_t sentinel_word() {
  return sizeof(T) == 2 ? 0x80008000u : 0x80000000u;
}

// True if any element of the vector still holds the sentinel.
template <typename T>
__device__ __forceinline__ bool has_sentinel(const uint4& v) {
  if constexpr (sizeof(T) == 2) {
    auto word = [](uint32_t w) { return ((w & 0xffffu) == 0x8000u) | ((w >> 16) == 0x8000u); };
    return word(v.x) | word(v.y) | word(v.z) | word(v.w);
  } else {
    return (v.x == 0x80000000u) | (v.y == 0x80000000u) | (v.z == 0x80000000u) |
           (v.w == 0x80000000u);
  }
}

// Replace every -0.0 element by +0.0 so that a sent value can never look like the sentinel.
template <typename T>
__device__ __forceinline__ uint4 canonical(uint4 v) {
  if constexpr (sizeof(T) == 2) {
    auto word = [](uint32_t w) {
      if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
      if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
      return w;
    };
    return make_uint4(word(v.x), word(v.y), word(v.z), word(v.w));
  } else {
    auto word = [](uint32_t w) { return w == 0x80000000u ? 0u : w; };
    return make_uint4(word(v.x), word(v.y), word(v.z), word(v.w));
  }
}

__device__ __forceinline__ uint4 sentinel_vec(uint32_t word) {
  return make_uint4(word, word, word, word);
}

// ---------------------------------------------------------------------------------------------
// Memory access.
// ---------------------------------------------------------------------------------------------
// Read-only input read once: non-coherent path, no L1 allocation.
// atomicAdd without a return value (red.relaxed.gpu): the issuing thread does not wait for it.
__device__ __forceinline__ void red_add_gpu(uint32_t* p, uint32_t v) {
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v));
}

__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Brings the 128-byte line of p into L1 (no register, no wait): a later load of it hits there.
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Poll of a Lamport buffer that peers (other GPUs, or other ranks' kernels on this GPU) write:
// volatile, so every poll goes to L2 / memory instead of a stale L1 line.
__device__ __forceinline__ uint4 ld_poll(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// One 16-byte store: outputs, and the reset of this rank's own buffer after reading it.
__device__ __forceinline__ void st_vec(void* p, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// One 16-byte store into a Lamport buffer that another rank polls (a peer GPU over NVLink, or
// another rank's kernel on this GPU): relaxed at system scope, the strong counterpart of the
// polls' ld.volatile (= ld.relaxed.sys), so a push and a poll of the same bytes are not a data
// race in the PTX memory model. No ordering is needed beyond that: the data is its own flag.
__device__ __forceinline__ void st_push(void* p, const uint4& v) {
  asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// Programmatic dependent launch (PDL): waits until the grids this one depends on have completed and
// their memory operations are visible (griddepcontrol.wait). A kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the kernel before it on the
// stream is still finishing; launched without it, this returns at once. Every block calls it
// before its first global memory access (the LaunchParams in constant space are not one).
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// Cluster exchange without a memory fence (row_reduce, kernel.cuh). cooperative_groups'
// cluster.sync() is barrier.cluster.arrive.release + wait: the release compiles to MEMBAR.ALL.GPU,
// which waits until every store the thread issued before it (pushes, sentinel resets,
// residual_out) is acknowledged. A value is sent instead with st.async into each peer's shared
// memory, completing bytes on the peer's mbarrier (no fence), and the receiver waits on its own
// mbarrier. The barrier.cluster below is used once per call, at the start, with nothing issued.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The address of the same shared variable in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_peer_addr(uint32_t local, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
  return r;
}
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}
// Makes the initialisations above visible to the cluster's other CTAs (with the barrier below).
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Every thread of every CTA of the cluster; no memory ordering (nothing is issued before it).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}
// This CTA's one arrival on bar for the current phase, expecting `bytes` from st.async.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// Writes v into the cluster shared address dst and completes 4 bytes on the mbarrier at bar (a
// cluster shared address of the same CTA as dst).
__device__ __forceinline__ void st_async_f32(uint32_t dst, float v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%0], %1, [%2];" ::"r"(
                   dst),
               "r"(__float_as_uint(v)), "r"(bar)
               : "memory");
}
// Waits until the phase of bar with the given parity has completed (acquire at cluster scope:
// the peers' st.async data is visible afterwards).
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) {
  const uint32_t a = smem_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], "
        "%2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A bounded wait. Each thread carries one Waiter through a call: the first time a poll finds
// data missing it starts the clock; once the wait has lasted longer than the communicator's
// timeout the thread gives up for the rest of the call (every further wait returns at once),
// records which peer it was waiting for in the host-mapped error word, and the caller poisons
// what it writes with NaN. The kernel therefore always ends, even when a peer never arrives
// (a rank that crashed, ranks that disagree on T, a bug): no hang, and a loud error on the host.
struct Waiter {
  uint64_t start = 0;
  bool gave_up = false;
  uint32_t* ctrl_error = nullptr;  // the communicator's device-side error word

  template <typename T>
  __device__ __forceinline__ uint4 wait(const void* addr, const LaunchParams& p, int peer) {
    uint4 v = ld_poll(addr);
    while (has_sentinel<T>(v)) {
      if (gave_up) return make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
      const uint64_t now = global_timer_ns();
      if (start == 0) {
        start = now;
      } else if (now - start > static_cast<uint64_t>(p.timeout_ns)) {
        gave_up = true;
        if (ctrl_error != nullptr) {
          *reinterpret_cast<volatile uint32_t*>(ctrl_error) = 1u + static_cast<uint32_t>(peer);
        }
        if (p.error_flag != nullptr) {
          *reinterpret_cast<volatile uint32_t*>(p.error_flag) = 1u + static_cast<uint32_t>(peer);
          __threadfence_system();
        }
        continue;
      }
      v = ld_poll(addr);
    }
    start = 0;  // the clock measures one wait, not the whole call
    return v;
  }
};

// NaN in every element of a vector of T (0x7fc0 is a quiet NaN in bf16, 0x7e00 in fp16).
template <typename T>
__device__ __forceinline__ uint4 nan_vec() {
  if constexpr (sizeof(T) == 4) return sentinel_vec(0x7fc00000u);
  if constexpr (std::is_same_v<T, __half>) return sentinel_vec(0x7e007e00u);
  return sentinel_vec(0x7fc07fc0u);
}

// Load one 16-byte vector's worth (kVec elements) of a per-hidden vector that is either float32
// or the activation dtype (gamma).
template <typename T>
__device__ __forceinline__ void load_param_vec(const void* base, bool is_f32, int64_t elem,
                                               float (&f)[Elem<T>::kVec]) {
  constexpr int kVec = Elem<T>::kVec;
  if (is_f32) {
    const float* q = static_cast<const float*>(base) + elem;
#pragma unroll
    for (int j = 0; j < kVec; j += 4) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(q + j));
      f[j] = __uint_as_float(v.x);
      f[j + 1] = __uint_as_float(v.y);
      f[j + 2] = __uint_as_float(v.z);
      f[j + 3] = __uint_as_float(v.w);
    }
  } else {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(base) + elem));
    unpack<T>(v, f);
  }
}

// One scalar of a [T, K] weight tensor that is float32 or the activation dtype.
template <typename T>
__device__ __forceinline__ float load_weight(const void* base, bool is_f32, int64_t i) {
  if (base == nullptr) return 1.0f;
  if (is_f32) return __ldg(static_cast<const float*>(base) + i);
  if constexpr (sizeof(T) == 2) {
    const uint16_t bits = __ldg(reinterpret_cast<const unsigned short*>(base) + i);
    return Elem<T>::to_float(bits);
  } else {
    return __ldg(static_cast<const float*>(base) + i);
  }
}

// ---------------------------------------------------------------------------------------------
// Finalize of one token's vector: partial = routed_scaling * sum_k w[t,k] * row(t,k)[v] + shared[t][v]
// in float32, with all K loads of the vector issued before the first one is used (in groups of
// 8 experts). Rows absent from this rank (index -1) contribute nothing; an index outside
// [-1, P) makes the token's partial NaN instead of reading out of bounds.
// ---------------------------------------------------------------------------------------------
// kPrefetchShared: the one-shot kernel's choice (its finalize is on the critical path of every
// small-T call); the two-shot instances at 7168 spill more with the prefetch's address live.
// kGroup: expert rows loaded together (kGroup uint4 in flight per thread). 8 everywhere but in
// two-shot phase 2, where the owner's finalize shares its registers with the polls and the norm:
// there 8 took the unbound two-shot instances from 72-80 registers to 95-128 (4096: 3 -> 2 blocks
// per SM) and the bound ones from 20-140 to 164-184 bytes spilled; 4 keeps them at 71-79 and
// 0-20 (ptxas -v, dd07534 vs its successor).
template <typename T, bool kPrefetchShared = false, int kGroup = 8>
__device__ __forceinline__ void finalize_vec(const LaunchParams& p, int64_t t, int64_t elem,
                                             float (&acc)[Elem<T>::kVec]) {
  constexpr int kVec = Elem<T>::kVec;
  const T* rows = static_cast<const T*>(p.expert_out);
  const int64_t H = p.hidden;
  const int K = p.top_k;
  // The shared row is fetched into L1 first, beside the index and weight loads: it depends on
  // nothing, and its load (volatile asm) comes after the row loop, so without the prefetch it
  // would start only once the rows are summed. A prefetch holds no register (holding the loaded
  // row across the loop made ptxas spill).
  if (kPrefetchShared && p.shared_out != nullptr) {
    prefetch_l1(static_cast<const T*>(p.shared_out) + t * H + elem);
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) acc[j] = 0.0f;
  bool bad = false;
  for (int k0 = 0; k0 < K; k0 += kGroup) {
    uint4 v[kGroup];
    float w[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int k = k0 + g;
      w[g] = 0.0f;
      v[g] = make_uint4(0, 0, 0, 0);
      if (k < K) {
        int64_t row;
        if (p.layout == static_cast<int32_t>(Layout::kPermuted)) {
          row = __ldg(p.permuted_idx + t * K + k);
          if (row < -1 || row >= p.num_rows) {
            bad = true;
            row = -1;
          }
        } else {
          row = t * K + k;  // dense [T, K, H]; plain is dense with K = 1
        }
        if (row >= 0) {
          v[g] = ld_stream(rows + row * H + elem);
          w[g] = load_weight<T>(p.expert_weights, p.weights_f32 != 0, t * K + k);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      float f[kVec];
      unpack<T>(v[g], f);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = fmaf(w[g], f[j], acc[j]);
    }
  }
  float sh[kVec];
  if (p.shared_out != nullptr) {
    unpack<T>(ld_stream(static_cast<const T*>(p.shared_out) + t * H + elem), sh);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) sh[j] = 0.0f;
  }
  const float rs = p.routed_scaling;
#pragma unroll
  for (int j = 0; j < kVec; ++j) acc[j] = bad ? __int_as_float(0x7fc00000) : fmaf(rs, acc[j], sh[j]);
}

// The finalize of kN vectors of one token at once (vector i at element elem[i]; has[i]: whether
// this thread has it), each expert's index and weight loaded once for all of them and kGroup
// experts' rows of every vector in flight together (kGroup * kN uint4). Bitwise the same as kN
// calls of finalize_vec: per vector the same float operations in the same order. Two-shot
// phase 2 (the owner's own tokens): there every vector's finalize precedes the polls, and one
// vector's row loads no longer wait for another's, nor the second index chain for the first.
// finalize_vec is not written as finalize_vecs of one: that compiled to other SASS (register
// allocation and order, cuobjdump) for the one-shot, local and bound two-shot instances, whose
// code a6de6df's and cab67f4's sets measured; folding is a kernel change: fold with a re-measure.
template <typename T, int kN, int kGroup>
__device__ __forceinline__ void finalize_vecs(const LaunchParams& p, int64_t t,
                                              const int64_t (&elem)[kN], const bool (&has)[kN],
                                              float (&acc)[kN][Elem<T>::kVec]) {
  constexpr int kVec = Elem<T>::kVec;
  const T* rows = static_cast<const T*>(p.expert_out);
  const int64_t H = p.hidden;
  const int K = p.top_k;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[i][j] = 0.0f;
  }
  bool bad = false;
  for (int k0 = 0; k0 < K; k0 += kGroup) {
    uint4 v[kGroup][kN];
    float w[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int k = k0 + g;
      w[g] = 0.0f;
#pragma unroll
      for (int i = 0; i < kN; ++i) v[g][i] = make_uint4(0, 0, 0, 0);
      if (k < K) {
        int64_t row;
        if (p.layout == static_cast<int32_t>(Layout::kPermuted)) {
          row = __ldg(p.permuted_idx + t * K + k);
          if (row < -1 || row >= p.num_rows) {
            bad = true;
            row = -1;
          }
        } else {
          row = t * K + k;  // dense [T, K, H]; plain is dense with K = 1
        }
        if (row >= 0) {
#pragma unroll
          for (int i = 0; i < kN; ++i) {
            if (has[i]) v[g][i] = ld_stream(rows + row * H + elem[i]);
          }
          w[g] = load_weight<T>(p.expert_weights, p.weights_f32 != 0, t * K + k);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        float f[kVec];
        unpack<T>(v[g][i], f);
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[i][j] = fmaf(w[g], f[j], acc[i][j]);
      }
    }
  }
  const float rs = p.routed_scaling;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    float sh[kVec];
    if (p.shared_out != nullptr && has[i]) {
      unpack<T>(ld_stream(static_cast<const T*>(p.shared_out) + t * H + elem[i]), sh);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) sh[j] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      acc[i][j] = bad ? __int_as_float(0x7fc00000) : fmaf(rs, acc[i][j], sh[j]);
    }
  }
}

}  // namespace arfuse
