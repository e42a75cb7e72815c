// arfuse: the fused MoE-finalize + shared add + all-reduce + residual + RMSNorm kernel.
//
// Hand-written device code, the same for every variant. The generator instantiates it once per
// kernel instance (out/kernels/<name>.cu) with the plan it decided in Go:
//
//   KernelConfig<T, Out, Algo, kHidden, kWorld, kThreadsPerToken, kVecsPerThread,
//                kTokensPerBlock, kCluster, kMinBlocksPerSM>
//
// kHidden == 0 / kWorld == 0 / kThreadsPerToken == 0 make the generic instance: hidden size,
// world size and block size come from the launch (one token per block, up to kVecsPerThread
// vectors per thread).
//
// Data flow per rank r of N (see docs/design.md for the protocol and why it cannot deadlock):
//   one-shot: finalize each token -> push the partial row into every rank's buffer at
//             [t][r] -> poll own buffer [t][0..N) -> sum in rank order -> + residual -> RMSNorm.
//   two-shot: finalize -> push the partial row of token t to its owner (t / ceil(T/N)) at
//             [t_local][r] -> the owner finalizes its own tokens (their partials stay in
//             registers), sums them with the peers' in rank order, adds the residual, pushes
//             residual_out rows to every peer's gather area and writes residual_out and the
//             RMSNorm of its own tokens -> every rank polls the gather area for the other
//             ranks' tokens, writes residual_out and the RMSNorm of them.
//   local (world size 1, no all-reduce): finalize each token, round the partial once to the
//             activation dtype (as every rank's partial is) -> + residual -> RMSNorm, all in
//             registers in one pass over the token: no workspace, no waits, no epoch.
// Block b of every rank works on the same tokens in every phase it shares with its peers (one-shot:
// token chunks b, b + G, ...; two-shot: the work items of TwoShotItems), so block b only ever
// waits for blocks b of its peers. With blocks dispatched in index order no wait depends on a
// block that cannot become resident (docs/design.md, tests/test_protocol_model.py).
// Every wait is on Lamport sentinels in the data (no flags, no barriers between ranks); three
// buffer slots rotate with a per-rank epoch so that no barrier is needed between calls either.
#pragma once

#include "arfuse/device.cuh"

namespace arfuse {

template <typename T_, class Out_, Algo kAlgo_, int kHidden_, int kWorld_, int kTpt_, int kVpt_,
          int kTpb_, int kCluster_, int kMinBlocks_>
struct KernelConfig {
  using T = T_;
  // The output writer (csrc/arfuse/writers.cuh): what is written after the RMSNorm.
  using Out = Out_;
  static constexpr OutKind kOut = Out::kKind;
  static constexpr Algo kAlgo = kAlgo_;
  static constexpr int kHidden = kHidden_;  // 0: run-time
  static constexpr int kWorld = kWorld_;    // 0: run-time
  static constexpr int kTpt = kTpt_;        // threads per token; 0: blockDim.x (generic)
  static constexpr int kVpt = kVpt_;        // vectors per thread (max, when generic)
  static constexpr int kTpb = kTpb_;        // tokens per block
  static constexpr int kCluster = kCluster_;
  // Blocks per SM the register allocation must leave room for (__launch_bounds__'s second
  // argument); 0: none asked (ptxas's choice). Decided by the plan (gen/plan.go).
  static constexpr int kMinBlocks = kMinBlocks_;
  // Two-shot: the owner keeps its own tokens' partials and gathered rows in registers (phase 2
  // finalizes them) instead of a round trip through its own buffer. A config derived from this
  // one may set it false: the token split's twin of variants/tuning.yaml buffered_splits
  // (gen/plan.go splitByTokens), the two-shot of before 3f9a5cd, which measured faster at mid T.
  static constexpr bool kOwnInRegs = kAlgo_ == Algo::kTwoShot;
  static constexpr int kVec = Elem<T>::kVec;
  static constexpr bool kGeneric = kHidden == 0;
  static constexpr int kBlockThreads = kGeneric ? kGenericMaxThreads : kTpt * kTpb;  // launch bound
  static constexpr int kWarpsPerToken = kGeneric ? kGenericMaxThreads / 32 : (kTpt + 31) / 32;
  // Ranks polled per batch: all of them when N is fixed (loads issued together), 4 otherwise.
  static constexpr int kRankBatch = kWorld == 0 ? 4 : (kWorld < 8 ? kWorld : 8);

  // Quantization groups (Out::kGroup elements, 0: none): a group is kGroupVecs consecutive
  // vectors. With the plan's layout (vector v = cta_in_cluster * slice + lane + i *
  // threads_per_token) and slice and threads_per_token multiples of kGroupVecs, a group is
  // kGroupVecs aligned consecutive lanes of one warp, so its amax is a few shuffles. The
  // generator rejects specialised plans that break this; generic instances (one CTA per token,
  // whole warps) need hidden % kGroup == 0, checked on the host.
  static constexpr int kGroup = Out::kGroup;
  static constexpr int kGroupVecs = kGroup == 0 ? 1 : kGroup / kVec;

  static_assert(kGroup == 0 || (kGroup % kVec == 0 && kGroupVecs >= 1 && kGroupVecs <= 32 &&
                                32 % kGroupVecs == 0),
                "a quantization group must be whole vectors within one warp");
  static_assert(kGroup == 0 || kGeneric ||
                    (kHidden % (kGroupVecs * kVec) == 0 &&
                     (kHidden / kVec / kCluster) % kGroupVecs == 0 &&
                     kTpt % kGroupVecs == 0),
                "quantization groups: hidden must be a multiple of the group and each CTA's slice "
                "of the row whole groups");
  static_assert(kAlgo == Algo::kOneShot || kAlgo == Algo::kTwoShot || kAlgo == Algo::kLocal,
                "auto is resolved on the host");
  static_assert((kAlgo == Algo::kLocal) == (kWorld == 1) || kWorld == 0,
                "world size 1 is the local algorithm's alone (gen/plan.go worldRule)");
  static_assert(kGeneric || kHidden % kVec == 0, "hidden must be a multiple of the vector width");
  static_assert(kGeneric || (kTpt % 32 == 0 && kTpt > 0), "threads per token: whole warps");
  static_assert(kGeneric || (kHidden / kVec) % kCluster == 0, "cluster must divide the row");
  static_assert(kGeneric || (kHidden / kVec / kCluster) <= kTpt * kVpt, "row does not fit");
  static_assert(kVpt >= 1 && kVpt <= kMaxVecsPerThread, "vectors per thread must be 1..kMaxVecsPerThread (row in registers)");
  static_assert(is_cluster_size(kCluster), "cluster size: 1 or one of kClusterSizes");
  static_assert(kWorld == 0 || (kWorld >= 1 && kWorld <= kMaxWorld), "world size");
  static_assert(kBlockThreads <= 1024, "block too large");
  static_assert(kMinBlocks >= 0 && kMinBlocks * kBlockThreads <= 2048,
                "min blocks per SM: at most 2048 threads per SM");
};

// Two-shot work items. Owner o holds tokens [o * per, o * per + count(o)), per = ceil(T / N);
// its tokens form chunks of kTpb, and item w = o * chunks + c is chunk c of owner o. Block b
// (cluster b) takes items b, b + G, ... in phase 1 (finalize and push to the owner), the items of
// its own rank among them in phase 2 (reduce, push to every gather area), and all of them again
// in phase 3 (gather and norm). Phase 2 of item w on the owner waits for phase 1 of item w on
// every rank, phase 3 for phase 2 of item w on the owner: the same block index everywhere.
struct TwoShotItems {
  int per, chunks, items;
  __device__ __forceinline__ TwoShotItems(int T, int N, int tpb) {
    per = (T + N - 1) / N;
    chunks = (per + tpb - 1) / tpb;
    items = chunks * N;
  }
  // The first item >= lo that block (cluster) id of G takes: lo rounded up to id modulo G.
  __device__ __forceinline__ static int first_at_or_after(int lo, int id, int G) {
    const int r = lo % G;
    return lo - r + id + (id < r ? G : 0);
  }
};

// Per-call geometry, derived once at kernel entry from the config and the launch.
template <class Cfg>
struct Geometry {
  int H, N, nvec, slice, tpt, vpt, T;
  int cta_in_cluster, cluster_id, num_clusters;
  int g, lane;  // token within block, thread within token
  __device__ __forceinline__ Geometry(const LaunchParams& p) {
    H = Cfg::kGeneric ? p.hidden : Cfg::kHidden;
    N = Cfg::kWorld == 0 ? p.world_size : Cfg::kWorld;
    T = p.num_tokens;
    nvec = H / Cfg::kVec;
    slice = nvec / Cfg::kCluster;
    tpt = Cfg::kGeneric ? static_cast<int>(blockDim.x) : Cfg::kTpt;
    vpt = Cfg::kGeneric ? (slice + tpt - 1) / tpt : Cfg::kVpt;
    cta_in_cluster = static_cast<int>(blockIdx.x) % Cfg::kCluster;
    cluster_id = static_cast<int>(blockIdx.x) / Cfg::kCluster;
    num_clusters = static_cast<int>(gridDim.x) / Cfg::kCluster;
    g = static_cast<int>(threadIdx.x) / tpt;
    lane = static_cast<int>(threadIdx.x) % tpt;
  }
  // The i-th vector of this thread within the row, or -1 if it has none there.
  __device__ __forceinline__ int vec(int i) const {
    const int local = lane + i * tpt;
    return (i < vpt && local < slice) ? cta_in_cluster * slice + local : -1;
  }
};

// Reduction operators of row_reduce. Both have 0.0f as identity on what they reduce (sums of
// squares; absolute values, NaN included).
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
// NaN-propagating max: a NaN in either operand gives NaN (fmaxf would drop it).
struct MaxNanOp {
  __device__ __forceinline__ float operator()(float a, float b) const {
    return (a != a || a > b) ? a : b;
  }
};

__device__ __forceinline__ float max_nan(float a, float b) { return MaxNanOp{}(a, b); }
// NaN-propagating min (fminf would drop a NaN).
__device__ __forceinline__ float min_nan(float a, float b) { return (a != a || a < b) ? a : b; }

// Shared memory of the per-token reductions (row_reduce): the warps' partials and, with a
// cluster, one slot per CTA of the cluster for every token of the block and two mbarriers; all
// double-buffered (reduction n uses buffer n % 2), so that one __syncthreads per reduction is
// enough (a warp can only rewrite buffer b in reduction n + 2 after every warp passed reduction
// n + 1's barrier, i.e. after it read buffer b in reduction n).
template <class Cfg>
struct ReduceSmem {
  float warp[2][Cfg::kTpb][Cfg::kWarpsPerToken];
  float cta[2][Cfg::kTpb][Cfg::kCluster];
  alignas(8) uint64_t bar[2];
};

// One per thread: the shared memory and how many reductions the block has done (the same count
// in every thread of the block and, since a cluster's CTAs take the same work units, in every CTA
// of the cluster).
template <class Cfg>
struct Reducer {
  ReduceSmem<Cfg>* s;
  int uses = 0;
  // Every thread of the block calls it at the kernel's start. With a cluster, thread 0 sets up
  // the two mbarriers (one arrival each: its own expect_tx) and every thread arrives on the
  // cluster barrier; the first reduction waits on it, so no CTA sends into a peer's mbarrier
  // before the peer initialised it (the arrive is relaxed: nothing was issued before it).
  __device__ __forceinline__ explicit Reducer(ReduceSmem<Cfg>* smem) : s(smem) {
    if constexpr (Cfg::kCluster > 1) {
      if (threadIdx.x == 0) {
        mbarrier_init(&s->bar[0], 1);
        mbarrier_init(&s->bar[1], 1);
        fence_mbarrier_init_cluster();
      }
      cluster_arrive_relaxed();
    }
  }
  // At the kernel's end: a block that did no reduction still waits on the cluster barrier it
  // arrived on (every block does at least one; this keeps the pairing whole regardless).
  __device__ __forceinline__ void finish() {
    if constexpr (Cfg::kCluster > 1) {
      if (uses == 0) cluster_wait();
    }
  }
};

// Reduces one value per thread over the threads of a token (warp shuffles, then the warps in a
// fixed order, then the CTAs of the cluster in a fixed order): deterministic, so every rank gets
// bitwise the same value. Every thread of the block (of the cluster) must call it, the same
// number of times. With a cluster, each token's first thread sends the CTA's value into every
// CTA's slot with st.async and every CTA sums its slots once its mbarrier has all of them: no
// cluster barrier (cooperative_groups' cluster.sync() fenced every outstanding store twice per
// reduction, see device.cuh).
template <class Cfg, class Op>
__device__ __forceinline__ float row_reduce(float partial, const Geometry<Cfg>& geo,
                                            Reducer<Cfg>& red, Op op) {
  const int b = red.uses & 1;                                        // buffer
  const uint32_t parity = static_cast<uint32_t>(red.uses >> 1) & 1u;  // phase of bar[b]
  ++red.uses;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) partial = op(partial, __shfl_xor_sync(0xffffffffu, partial, off));
  const int warp = geo.lane / 32;
  if ((geo.lane & 31) == 0) red.s->warp[b][geo.g][warp] = partial;
  __syncthreads();
  float total = 0.0f;
  const int warps = (geo.tpt + 31) / 32;
  for (int w = 0; w < warps; ++w) total = op(total, red.s->warp[b][geo.g][w]);
  if constexpr (Cfg::kCluster > 1) {
    if (red.uses == 1) cluster_wait();  // the first: every peer's mbarriers are initialised
    if (threadIdx.x == 0) {
      mbarrier_arrive_expect_tx(&red.s->bar[b], Cfg::kTpb * Cfg::kCluster * sizeof(float));
    }
    if (geo.lane == 0) {
      const uint32_t slot = smem_addr(&red.s->cta[b][geo.g][geo.cta_in_cluster]);
      const uint32_t bar = smem_addr(&red.s->bar[b]);
#pragma unroll
      for (int c = 0; c < Cfg::kCluster; ++c) {
        st_async_f32(cluster_peer_addr(slot, c), total, cluster_peer_addr(bar, c));
      }
    }
    mbarrier_wait_parity(&red.s->bar[b], parity);
    total = 0.0f;
#pragma unroll
    for (int c = 0; c < Cfg::kCluster; ++c) total = op(total, red.s->cta[b][geo.g][c]);
  }
  return total;
}

// Sum of squares of one token's row (see row_reduce).
template <class Cfg>
__device__ __forceinline__ float row_sum_squares(float partial, const Geometry<Cfg>& geo,
                                                 Reducer<Cfg>& red) {
  return row_reduce<Cfg>(partial, geo, red, SumOp{});
}

// One token's vectors of this thread: residual_out (rounded, already stored) and, where the
// one-shot kernel loaded them before its polls (gamma_in_regs: specialised one-shot instances,
// gamma in the activation dtype), gamma's matching vectors. Loaded after the reduction instead,
// gamma is one more memory round trip on the critical path of every small-T call (the cluster
// exchange's acquire invalidates L1, so an L1 prefetch of it does not survive).
template <class Cfg>
struct TokenRow {
  static constexpr bool kGammaRegs =
      (Cfg::kAlgo == Algo::kOneShot || Cfg::kAlgo == Algo::kLocal) && !Cfg::kGeneric;
  uint4 rv[Cfg::kVpt];
  uint4 gamma[kGammaRegs ? Cfg::kVpt : 1];
  bool gamma_in_regs = false;

  // Vector i before the token's loads (threads without a vector there keep the zeros).
  __device__ __forceinline__ void clear(int i) {
    rv[i] = make_uint4(0, 0, 0, 0);
    if constexpr (kGammaRegs) gamma[i] = make_uint4(0, 0, 0, 0);
  }
};

// y = the RMSNorm of vector i (element v * kVec) of the row, in float32:
// (r * inv) * (gamma + weight_bias). The one definition of y for every output kind.
template <class Cfg>
__device__ __forceinline__ void norm_vec(const LaunchParams& p, const TokenRow<Cfg>& row, int i,
                                         int v, float inv, float (&y)[Cfg::kVec]) {
  using T = typename Cfg::T;
  constexpr int kVec = Cfg::kVec;
  float r[kVec], gm[kVec];
  unpack<T>(row.rv[i], r);
  if (TokenRow<Cfg>::kGammaRegs && row.gamma_in_regs) {
    unpack<T>(row.gamma[TokenRow<Cfg>::kGammaRegs ? i : 0], gm);
  } else {
    load_param_vec<T>(p.gamma, p.gamma_f32 != 0, static_cast<int64_t>(v) * kVec, gm);
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) y[j] = (r[j] * inv) * (gm[j] + p.weight_bias);
}

// Loads gamma's vector v into row.gamma[i] when gamma is in the activation dtype (else norm_vec
// loads it itself).
template <class Cfg>
__device__ __forceinline__ void load_gamma_regs(const LaunchParams& p, TokenRow<Cfg>& row, int i,
                                                int v) {
  using T = typename Cfg::T;
  if constexpr (TokenRow<Cfg>::kGammaRegs) {
    row.gamma_in_regs = p.gamma_f32 == 0 || sizeof(T) == 4;
    if (row.gamma_in_regs) {
      row.gamma[i] = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.gamma) +
                                                          static_cast<int64_t>(v) * Cfg::kVec));
    }
  }
}

// The output writers (one struct per output kind, KernelConfig's Out): they use Geometry,
// row_reduce and norm_vec above.
}  // namespace arfuse
#include "arfuse/writers.cuh"
namespace arfuse {

// Writes the RMSNorm of one token's residual_out (already rounded and stored, in row.rv) in the
// output kind of the config (its writer, Cfg::Out). Every thread of the block must call it, valid
// or not: a writer may reduce over the token or a warp, and only valid threads write.
template <class Cfg>
__device__ __forceinline__ void write_norm(const LaunchParams& p, const Geometry<Cfg>& geo,
                                           int64_t t, const TokenRow<Cfg>& row,
                                           float sum_squares, bool valid, Reducer<Cfg>& red) {
  const float inv = rsqrtf(sum_squares / static_cast<float>(geo.H) + p.eps);
  Cfg::Out::template write<Cfg>(p, geo, t, row, inv, valid, red);
}

// Pushes one vector to element offset off of every rank's buffer (kSkipSelf: every rank but
// this one, whose copy stays in registers). A world fixed at compile time unrolls the loop.
template <class Cfg, bool kSkipSelf = false>
__device__ __forceinline__ void push_to_ranks(const LaunchParams& p, int N, int rank, int64_t off,
                                              const uint4& out) {
  using T = typename Cfg::T;
  if constexpr (Cfg::kWorld != 0) {
#pragma unroll
    for (int q = 0; q < Cfg::kWorld; ++q) {
      if (!kSkipSelf || q != rank) st_push(static_cast<T*>(p.buffers[q]) + off, out);
    }
  } else {
    for (int q = 0; q < N; ++q) {
      if (!kSkipSelf || q != rank) st_push(static_cast<T*>(p.buffers[q]) + off, out);
    }
  }
}

// Sums the N partial vectors at base + n * stride (n in rank order) once every one has arrived,
// and resets each to the sentinel right after reading it: this rank is the only reader of its
// own buffer, so the slot is clean again when the call ends (see docs/design.md).
// kOwnInRegs (two-shot phase 2): rank own_rank's partial is own_val, already in registers; its
// row in the buffer was never written, so it is neither polled nor reset. The sum is the same
// float additions in the same rank order either way.
template <class Cfg, bool kOwnInRegs = false>
__device__ __forceinline__ void sum_ranks(const LaunchParams& p, const Geometry<Cfg>& geo,
                                          typename Cfg::T* base, int64_t stride,
                                          Waiter& waiter, float (&s)[Cfg::kVec],
                                          int own_rank = -1, uint4 own_val = uint4{}) {
  using T = typename Cfg::T;
  constexpr int kB = Cfg::kRankBatch;
#pragma unroll
  for (int j = 0; j < Cfg::kVec; ++j) s[j] = 0.0f;
  for (int n0 = 0; n0 < geo.N; n0 += kB) {
    uint4 x[kB];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      if (n0 + b < geo.N) {
        x[b] = kOwnInRegs && n0 + b == own_rank ? own_val : ld_poll(base + (n0 + b) * stride);
      }
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      if (n0 + b < geo.N) {
        if (!kOwnInRegs || n0 + b != own_rank) {
          if (has_sentinel<T>(x[b])) x[b] = waiter.wait<T>(base + (n0 + b) * stride, p, n0 + b);
          st_vec(base + (n0 + b) * stride, sentinel_vec(sentinel_word<T>()));
        }
        float f[Cfg::kVec];
        unpack<T>(x[b], f);
#pragma unroll
        for (int j = 0; j < Cfg::kVec; ++j) s[j] += f[j];
      }
    }
  }
}

template <class Cfg>
__device__ __forceinline__ void fused_body(const LaunchParams& p) {
  using T = typename Cfg::T;
  constexpr int kVec = Cfg::kVec;
  constexpr int kVpt = Cfg::kVpt;
  constexpr bool kOneShot = Cfg::kAlgo == Algo::kOneShot;

  __shared__ ReduceSmem<Cfg> reduce_smem;

  const Geometry<Cfg> geo(p);
  Reducer<Cfg> red(&reduce_smem);
  const int64_t H = geo.H;
  const int N = geo.N;
  const int T_ = geo.T;
  const int rank = p.rank;
  // PDL: nothing above touched global memory (the shared-memory set-up overlaps the kernel before
  // this one); the epoch below was written by the previous call on this stream, which may be that
  // kernel, and the inputs may be its outputs.
  grid_dependency_wait();

  // ---- epoch and slot (every slot is all-sentinel at the start of a call: each element is
  // reset by its reader right after it is read) ----
  const uint32_t epoch_read = *reinterpret_cast<volatile uint32_t*>(&p.ctrl->epoch);
  const uint32_t epoch = epoch_read % kNumSlots;
  // One-shot: arrival at the start, the block has read this call's epoch. A reduction without a return
  // value (nothing waits for it); its operand depends on the epoch just read (epoch_read / 4 is
  // 0, but the compiler cannot know), so it is issued only once that read has returned. Block 0
  // advances the epoch at its end once every block has arrived (below).
  if (kOneShot && threadIdx.x == 0) red_add_gpu(&p.ctrl->arrived, 1u + epoch_read / 4u);
  const int slot = static_cast<int>(epoch);
  const int64_t slot_off = static_cast<int64_t>(slot) * p.slot_elems;
  T* const own = static_cast<T*>(p.buffers[rank]);

  const TwoShotItems items(T_, N, Cfg::kTpb);
  const int per = items.per;                                    // two-shot: tokens per owner
  const int64_t gather_off = static_cast<int64_t>(per) * N * H;  // two-shot: gather area
  Waiter waiter;
  waiter.ctrl_error = &p.ctrl->error;
  // A communicator that timed out before is broken: no waits, NaN outputs (the host refuses
  // new calls; this covers calls that were already queued when it happened).
  if (*reinterpret_cast<volatile uint32_t*>(&p.ctrl->error) != 0) waiter.gave_up = true;

  // The work of phases 1 and 3: one-shot token chunks, or two-shot items (TwoShotItems). For work
  // unit w: this thread's token t, its owner and its index there (two-shot), and whether the
  // thread has a token at all. Uniform over the block: every thread runs the same units.
  const int units = kOneShot ? (T_ + Cfg::kTpb - 1) / Cfg::kTpb : items.items;
  auto unit_token = [&](int w, int& t, int& owner, int& local) -> bool {
    if constexpr (kOneShot) {
      t = w * Cfg::kTpb + geo.g;
      owner = 0;
      local = t;
      return t < T_ && geo.g < Cfg::kTpb;
    } else {
      owner = w / items.chunks;
      local = (w - owner * items.chunks) * Cfg::kTpb + geo.g;
      t = owner * per + local;
      return geo.g < Cfg::kTpb && local < per && t < T_;
    }
  };

  // ---- phase 1: finalize every token and push the partial row (two-shot: the tokens of the
  // other ranks; this rank's own tokens are finalized in phase 2, their partials never leave the
  // registers) ----
  for (int w = geo.cluster_id; w < units; w += geo.num_clusters) {
    if (Cfg::kOwnInRegs && w / items.chunks == rank) continue;  // uniform: one owner per item
    int t, owner, local;
    if (!unit_token(w, t, owner, local)) continue;
#pragma unroll
    for (int i = 0; i < kVpt; ++i) {
      const int v = geo.vec(i);
      if (v < 0) continue;
      const int64_t elem = static_cast<int64_t>(v) * kVec;
      float acc[kVec];
      finalize_vec<T, kOneShot>(p, t, elem, acc);
      const uint4 out = canonical<T>(pack<T>(acc));
      if constexpr (kOneShot) {
        push_to_ranks<Cfg>(p, N, rank,
                           slot_off + (static_cast<int64_t>(t) * N + rank) * H + elem, out);
      } else {
        const int64_t off = slot_off + (static_cast<int64_t>(local) * N + rank) * H + elem;
        st_push(static_cast<T*>(p.buffers[owner]) + off, out);
      }
    }
  }

  if constexpr (Cfg::kOwnInRegs) {
    // ---- two-shot phase 2: the owner finalizes its own tokens (its items among this block's),
    // sums them with the peers' partials, adds the residual, pushes residual_out to the peers'
    // gather areas and writes both outputs itself: its own partial row and its own gather row
    // are never written, read or reset (3 + 3 rows of traffic per own token fewer than a
    // round trip through its own buffer), and its own tokens need no phase 3 ----
    // kOwnFirst: every vector's own partial before the first poll (below), in the specialised
    // instances without a register bound (kMinBlocks 0: the small-T ones). The bound and generic
    // ones keep 3f9a5cd's order (per vector: finalize, polls, pushes), where finalizing first
    // spilled more (ptxas -v: fp16 7168 N = 8 0 -> 80 bytes, generic 0 -> 16-44).
    constexpr bool kOwnFirst = !Cfg::kGeneric && Cfg::kMinBlocks == 0;
    // ... and only where no block has more than one own item (the latency-bound calls): with
    // several per block, finalizing first measured slower (Qwen3-30B N = 2, T = 1024 / 8192:
    // 1.024 / 1.012x, H100, lab/perf/h100-a6de6df/hoist), the order of 3f9a5cd runs there.
    const bool own_first = items.chunks <= geo.num_clusters;
    const int lo = rank * items.chunks;
    for (int w = TwoShotItems::first_at_or_after(lo, geo.cluster_id, geo.num_clusters);
         w < lo + items.chunks; w += geo.num_clusters) {
      int t_, owner, local;
      const bool valid = unit_token(w, t_, owner, local);
      const int64_t t = t_;
      TokenRow<Cfg> row;
      float sq = 0.0f;
      if (!kOwnFirst || !own_first) {
#pragma unroll
        for (int i = 0; i < kVpt; ++i) {
          row.clear(i);
          const int v = geo.vec(i);
          if (!valid || v < 0) continue;
          const int64_t elem = static_cast<int64_t>(v) * kVec;
          const uint4 res = p.residual != nullptr
                                ? ld_stream(static_cast<const T*>(p.residual) + t * H + elem)
                                : make_uint4(0, 0, 0, 0);
          float acc[kVec];
          finalize_vec<T, false, 4>(p, t, elem, acc);  // 4 rows at a time: see finalize_vec
          const uint4 mine = canonical<T>(pack<T>(acc));  // rounded as a pushed partial is
          float s[kVec], r[kVec];
          sum_ranks<Cfg, true>(p, geo, own + slot_off + static_cast<int64_t>(local) * N * H + elem,
                               H, waiter, s, rank, mine);
          unpack<T>(res, r);
#pragma unroll
          for (int j = 0; j < kVec; ++j) s[j] += r[j];
          uint4 out = canonical<T>(pack<T>(s));
          if (waiter.gave_up) out = nan_vec<T>();
          push_to_ranks<Cfg, true>(p, N, rank, slot_off + gather_off + t * H + elem, out);
          row.rv[i] = out;
          st_vec(static_cast<T*>(p.residual_out) + t * H + elem, out);
          float f[kVec];
          unpack<T>(out, f);
#pragma unroll
          for (int j = 0; j < kVec; ++j) sq = fmaf(f[j], f[j], sq);
        }
      } else {
        // (The reduce-and-push below repeats the one above on purpose: written once, as a
        // lambda both orders call, it changed the SASS of the bound instances, which run only the
        // order above and are byte-identical to a6de6df's measured code as written.)
        // Every vector's own partial (into row.rv) and residual first, then the polls: the
        // rows of all the vectors are in flight together (each expert's index and weight loaded
        // once) and no vector's loads wait behind another vector's polls and pushes.
        uint4 res[kVpt];
        int64_t elems[kVpt];
        bool has[kVpt];
#pragma unroll
        for (int i = 0; i < kVpt; ++i) {
          row.clear(i);
          const int v = geo.vec(i);
          has[i] = valid && v >= 0;
          elems[i] = has[i] ? static_cast<int64_t>(v) * kVec : 0;
          res[i] = has[i] && p.residual != nullptr
                       ? ld_stream(static_cast<const T*>(p.residual) + t * H + elems[i])
                       : make_uint4(0, 0, 0, 0);
        }
        if (valid) {
          float acc[kVpt][kVec];
          finalize_vecs<T, kVpt, 2>(p, t, elems, has, acc);  // 2 experts x kVpt rows at a time
#pragma unroll
          for (int i = 0; i < kVpt; ++i) {
            if (has[i]) row.rv[i] = canonical<T>(pack<T>(acc[i]));  // as a pushed partial
          }
        }
#pragma unroll
        for (int i = 0; i < kVpt; ++i) {
          if (!has[i]) continue;
          const int64_t elem = elems[i];
          float s[kVec], r[kVec];
          sum_ranks<Cfg, true>(p, geo, own + slot_off + static_cast<int64_t>(local) * N * H + elem,
                               H, waiter, s, rank, row.rv[i]);
          unpack<T>(res[i], r);
#pragma unroll
          for (int j = 0; j < kVec; ++j) s[j] += r[j];
          uint4 out = canonical<T>(pack<T>(s));
          if (waiter.gave_up) out = nan_vec<T>();
          push_to_ranks<Cfg, true>(p, N, rank, slot_off + gather_off + t * H + elem, out);
          row.rv[i] = out;
          st_vec(static_cast<T*>(p.residual_out) + t * H + elem, out);
          float f[kVec];
          unpack<T>(out, f);
#pragma unroll
          for (int j = 0; j < kVec; ++j) sq = fmaf(f[j], f[j], sq);
        }
      }
      const float total = row_sum_squares<Cfg>(sq, geo, red);
      write_norm<Cfg>(p, geo, t, row, total, valid, red);
    }
  }

  if constexpr (!kOneShot && !Cfg::kOwnInRegs) {
    // ---- two-shot phase 2 through the owner's own buffer (the buffered twin): the owner reduces
    // its tokens (its items among this block's), its own partial among them, and all-gathers
    // residual_out to every rank, itself included; phase 3 reads its own tokens back ----
    const int lo = rank * items.chunks;
    for (int w = TwoShotItems::first_at_or_after(lo, geo.cluster_id, geo.num_clusters);
         w < lo + items.chunks; w += geo.num_clusters) {
      int t_, owner, local;
      if (!unit_token(w, t_, owner, local)) continue;
      const int64_t t = t_;
#pragma unroll
      for (int i = 0; i < kVpt; ++i) {
        const int v = geo.vec(i);
        if (v < 0) continue;
        const int64_t elem = static_cast<int64_t>(v) * kVec;
        const uint4 res = p.residual != nullptr
                              ? ld_stream(static_cast<const T*>(p.residual) + t * H + elem)
                              : make_uint4(0, 0, 0, 0);
        float s[kVec], r[kVec];
        sum_ranks<Cfg>(p, geo, own + slot_off + static_cast<int64_t>(local) * N * H + elem, H,
                       waiter, s);
        unpack<T>(res, r);
#pragma unroll
        for (int j = 0; j < kVec; ++j) s[j] += r[j];
        uint4 out = canonical<T>(pack<T>(s));
        if (waiter.gave_up) out = nan_vec<T>();
        push_to_ranks<Cfg>(p, N, rank, slot_off + gather_off + t * H + elem, out);
      }
    }
  }

  // ---- last phase: residual_out and RMSNorm for every token ----
  // One-shot, block 0: the arrivals counted so far, read on its last work unit once its polls
  // are done (by then every block of this rank has long pushed and arrived, so this is usually
  // all of them) and looked at only at the end: the read's round trip overlaps the reduction and
  // the norm instead of following them.
  uint32_t arrivals_seen = 0;
  for (int w = geo.cluster_id; w < units; w += geo.num_clusters) {
    if (Cfg::kOwnInRegs && w / items.chunks == rank) continue;  // own tokens: done in phase 2
    int t_, owner, local;
    const bool valid = unit_token(w, t_, owner, local);
    const int64_t t = t_;
    TokenRow<Cfg> row;
    float sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kVpt; ++i) {
      row.clear(i);
      const int v = geo.vec(i);
      if (!valid || v < 0) continue;
      const int64_t elem = static_cast<int64_t>(v) * kVec;
      uint4 rv;
      if constexpr (kOneShot) {
        const uint4 res = p.residual != nullptr
                              ? ld_stream(static_cast<const T*>(p.residual) + t * H + elem)
                              : make_uint4(0, 0, 0, 0);
        load_gamma_regs<Cfg>(p, row, i, v);
        float s[kVec], r[kVec];
        sum_ranks<Cfg>(p, geo, own + slot_off + t * N * H + elem, H, waiter, s);
        unpack<T>(res, r);
#pragma unroll
        for (int j = 0; j < kVec; ++j) s[j] += r[j];
        rv = canonical<T>(pack<T>(s));
      } else {
        T* const at = own + slot_off + gather_off + t * H + elem;
        rv = waiter.wait<T>(at, p, owner);
        st_vec(at, sentinel_vec(sentinel_word<T>()));
      }
      if (waiter.gave_up) rv = nan_vec<T>();
      row.rv[i] = rv;
      st_vec(static_cast<T*>(p.residual_out) + t * H + elem, rv);
      float f[kVec];
      unpack<T>(rv, f);
#pragma unroll
      for (int j = 0; j < kVec; ++j) sq = fmaf(f[j], f[j], sq);
    }
    if (kOneShot && blockIdx.x == 0 && threadIdx.x == 0 && w + geo.num_clusters >= units) {
      arrivals_seen = ld_relaxed_gpu(&p.ctrl->arrived);
    }
    const float total = row_sum_squares<Cfg>(sq, geo, red);
    write_norm<Cfg>(p, geo, t, row, total, valid, red);
  }
  red.finish();

  // ---- completion ----
  if constexpr (kOneShot) {
    // Block 0 advances the epoch once every block has read it (arrived at its start). Only block
    // 0 waits, and only for those arrivals (all blocks of the capped grid are resident, so they
    // come); no block waits for an atomic's return at its end. The next call reads the new epoch
    // after this kernel has finished (stream order), so no block of this call can see it.
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      while (arrivals_seen < gridDim.x) arrivals_seen = ld_relaxed_gpu(&p.ctrl->arrived);
      // Read again rather than kept live through the call (registers): nothing else writes it.
      volatile uint32_t* const e = &p.ctrl->epoch;
      *reinterpret_cast<volatile uint32_t*>(&p.ctrl->arrived) = 0;
      *e = (*e + 1) % kNumSlots;
    }
  } else {
    // Two-shot: the last block to finish advances the epoch (the arrival-at-start form above
    // made the large-T two-shot 3-4 % slower at Qwen3-30B N = 2 in the A/B of 2026-12-03; at
    // large T the end-of-block atomic is amortised anyway). Both forms leave arrived = 0 and the
    // epoch advanced by one, so calls of either algorithm may follow each other.
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      const unsigned prev = atomicAdd(&p.ctrl->arrived, 1u);
      if (prev == gridDim.x - 1) {
        p.ctrl->arrived = 0;
        __threadfence();
        *reinterpret_cast<volatile uint32_t*>(&p.ctrl->epoch) = (epoch + 1) % kNumSlots;
      }
    }
  }
}

// The world-size-1 op (Algo::kLocal): per token, the finalize, the partial rounded once to the
// activation dtype (the op's definition at every world size: residual_out is bitwise what the CPU
// implementation and a one-rank all-reduce give), + residual, residual_out stored, RMSNorm; the
// row stays in registers between the steps, and nothing is exchanged, waited for or reset. The
// residual and gamma loads are issued before the expert rows', so the token's loads are all in
// flight together. Block (cluster) b takes token chunks b, b + G, ... of the grid.
template <class Cfg>
__device__ __forceinline__ void local_body(const LaunchParams& p) {
  using T = typename Cfg::T;
  constexpr int kVec = Cfg::kVec;
  constexpr int kVpt = Cfg::kVpt;

  __shared__ ReduceSmem<Cfg> reduce_smem;

  const Geometry<Cfg> geo(p);
  Reducer<Cfg> red(&reduce_smem);
  const int64_t H = geo.H;
  const int units = (geo.T + Cfg::kTpb - 1) / Cfg::kTpb;
  grid_dependency_wait();  // PDL: the inputs may be the outputs of the kernel before this one
  for (int w = geo.cluster_id; w < units; w += geo.num_clusters) {
    const int64_t t = static_cast<int64_t>(w) * Cfg::kTpb + geo.g;
    const bool valid = geo.g < Cfg::kTpb && t < geo.T;
    TokenRow<Cfg> row;
    float sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kVpt; ++i) {
      row.clear(i);
      const int v = geo.vec(i);
      if (!valid || v < 0) continue;
      const int64_t elem = static_cast<int64_t>(v) * kVec;
      const uint4 res = p.residual != nullptr
                            ? ld_stream(static_cast<const T*>(p.residual) + t * H + elem)
                            : make_uint4(0, 0, 0, 0);
      load_gamma_regs<Cfg>(p, row, i, v);
      float acc[kVec];
      finalize_vec<T, true>(p, t, elem, acc);
      uint4 rv = pack<T>(acc);  // the partial, rounded once
      if (p.residual != nullptr) {  // without one, residual_out is the partial as it is
        float s[kVec], r[kVec];
        unpack<T>(rv, s);
        unpack<T>(res, r);
#pragma unroll
        for (int j = 0; j < kVec; ++j) s[j] += r[j];
        rv = pack<T>(s);
      }
      row.rv[i] = rv;
      st_vec(static_cast<T*>(p.residual_out) + t * H + elem, rv);
      float f[kVec];
      unpack<T>(rv, f);
#pragma unroll
      for (int j = 0; j < kVec; ++j) sq = fmaf(f[j], f[j], sq);
    }
    const float total = row_sum_squares<Cfg>(sq, geo, red);
    write_norm<Cfg>(p, geo, t, row, total, valid, red);
  }
  red.finish();
}

template <class Cfg>
__device__ __forceinline__ void kernel_body(const LaunchParams& p) {
  if constexpr (Cfg::kAlgo == Algo::kLocal) {
    local_body<Cfg>(p);
  } else {
    fused_body<Cfg>(p);
  }
}

// The kernel. __launch_bounds__ takes the plan's minimum of blocks per SM only where the plan
// asks for one: an explicit 1 is not the same as none (ptxas then allocated 108 registers to
// instances that take 72 without it).
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kBlockThreads)
    fused_kernel(const __grid_constant__ LaunchParams p) {
  kernel_body<Cfg>(p);
}
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kBlockThreads, Cfg::kMinBlocks)
    fused_kernel_min_blocks(const __grid_constant__ LaunchParams p) {
  kernel_body<Cfg>(p);
}
template <class Cfg>
constexpr auto kernel_of() {
  if constexpr (Cfg::kMinBlocks > 0) {
    return &fused_kernel_min_blocks<Cfg>;
  } else {
    return &fused_kernel<Cfg>;
  }
}

// ---------------------------------------------------------------------------------------------
// Host launcher: block and cluster shape from the config (generic: from the hidden size), grid
// capped at the co-resident count (a persistent grid; with ranks sharing this GPU, each rank's
// share of it, since their separate grids must all run at once), launched with
// cudaLaunchKernelEx so the cluster shape (and, where the communicator asks for it, programmatic
// stream serialization: PDL) is an attribute.
// ---------------------------------------------------------------------------------------------
namespace detail {
cudaError_t co_resident_blocks(const void* kernel, int block_threads, int cluster, int* per_device);
}  // namespace detail

template <class Cfg>
cudaError_t launch_fused(const LaunchParams& p, cudaStream_t stream) {
  int block = Cfg::kBlockThreads;
  if constexpr (Cfg::kGeneric) {
    const int nvec = p.hidden / Cfg::kVec;
    block = ((nvec + 31) / 32) * 32;
    if (block > Cfg::kBlockThreads) block = Cfg::kBlockThreads;
    if ((nvec + block - 1) / block > Cfg::kVpt) return cudaErrorInvalidValue;
    if constexpr (Cfg::kGroup != 0) {
      if (p.hidden % Cfg::kGroup != 0) {
        return cudaErrorInvalidValue;  // the host checks this first, with a clear error
      }
    }
  }
  constexpr auto kernel_fn = kernel_of<Cfg>();
  const void* kernel = reinterpret_cast<const void*>(kernel_fn);
  int per_device = 0;
  cudaError_t err = detail::co_resident_blocks(kernel, block, Cfg::kCluster, &per_device);
  if (err != cudaSuccess) return err;
  int cap = per_device;
  if (Cfg::kAlgo != Algo::kLocal && p.ranks_per_device > 1) {
    // Emulated group: N grids share one GPU. Each gets 3/4 of its 1/N share, cluster grids half:
    // packing the GPU exactly full is not enough (seen on the H200: 8 ranks of 2-blocks-per-SM
    // grids sized to exactly 1/8 of the occupancy count, and 8 ranks of 4-CTA clusters, did not
    // all become resident; clusters also fragment the GPCs, a cluster's CTAs share one GPC).
    cap = per_device / p.ranks_per_device;
    cap = Cfg::kCluster > 1 ? cap / 2 : cap * 3 / 4;
  }
  if (p.max_blocks > 0 && p.max_blocks < cap) cap = p.max_blocks;
  cap = (cap / Cfg::kCluster) * Cfg::kCluster;
  if (cap < Cfg::kCluster) return cudaErrorLaunchOutOfResources;
  if (p.prepare_only) return cudaSuccess;
  // One cluster per work unit (token chunk; two-shot: item, see TwoShotItems), at most the cap.
  int units = (p.num_tokens + Cfg::kTpb - 1) / Cfg::kTpb;
  if constexpr (Cfg::kAlgo == Algo::kTwoShot) {
    const int n = Cfg::kWorld != 0 ? Cfg::kWorld : p.world_size;
    units = (((p.num_tokens + n - 1) / n + Cfg::kTpb - 1) / Cfg::kTpb) * n;
  }
  int grid = units * Cfg::kCluster;
  if (grid > cap) grid = cap;

  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n_attr = 0;
  if constexpr (Cfg::kCluster > 1) {
    attr[n_attr].id = cudaLaunchAttributeClusterDimension;
    attr[n_attr].val.clusterDim.x = Cfg::kCluster;
    attr[n_attr].val.clusterDim.y = 1;
    attr[n_attr].val.clusterDim.z = 1;
    ++n_attr;
  }
  if (p.pdl) {  // every block waits for the kernel before it (grid_dependency_wait)
    attr[n_attr].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n_attr].val.programmaticStreamSerializationAllowed = 1;
    ++n_attr;
  }
  config.attrs = n_attr > 0 ? attr : nullptr;
  config.numAttrs = n_attr;
  return cudaLaunchKernelEx(&config, kernel_fn, p);
}

}  // namespace arfuse
