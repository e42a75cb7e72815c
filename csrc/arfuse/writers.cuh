// arfuse: the output writers, one struct per output kind (gen/tables.go OutKind.Writer).
//
// The kernel is instantiated with one of them (KernelConfig's Out) and calls its write() once per
// token after the RMSNorm; the kernel body has no per-kind branch. A writer declares
//   kKind   its arfuse::OutKind enumerator (the dispatch table's key),
//   kGroup  elements per quantization group whose scale it reduces within one warp (0: none;
//           KernelConfig and gen/plan.go check that the plan keeps groups within a warp),
// and
//   template <class Cfg> static void write(p, geo, t, row, inv, valid, red)
// which writes the token's norm_out (and its scales) from row (TokenRow: the token's residual_out,
// already rounded and stored, and possibly gamma) and inv = rsqrt(mean square + eps). Every
// thread of the block calls it, valid or not, so that a writer may reduce over the token
// (row_reduce) or a warp; only valid threads write. y, the float32 RMSNorm of a vector, is
// norm_vec's (the one definition of y).
//
// Included by kernel.cuh after Geometry, row_reduce and norm_vec, which the writers use; not a
// header of its own. Adding an output kind adds one struct here (gen/README.md lists the rest).
#pragma once

namespace arfuse {

// FP8-e4m3 codes of kVec values, saturating (round to nearest even, clamped to +-448; NaN stays
// NaN), stored as one 8-byte (16-bit dtypes) or 4-byte (fp32) access at dst.
template <int kVec>
__device__ __forceinline__ void store_fp8(uint8_t* dst, const float (&x)[kVec]) {
  uint8_t q[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) q[j] = __nv_fp8_e4m3(x[j]).__x;
  if constexpr (kVec == 8) {
    uint2 w;
    w.x = q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<uint32_t>(q[3]) << 24);
    w.y = q[4] | (q[5] << 8) | (q[6] << 16) | (static_cast<uint32_t>(q[7]) << 24);
    *reinterpret_cast<uint2*>(dst) = w;
  } else {
    *reinterpret_cast<uint32_t*>(dst) =
        q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<uint32_t>(q[3]) << 24);
  }
}

// The smallest power of two >= s (UE8M0 scales); NaN and Inf unchanged. s is positive and normal
// here (at least 1e-10 / 448).
__device__ __forceinline__ float pow2_ceil(float s) {
  uint32_t b = __float_as_uint(s);
  if ((b & 0x7f800000u) == 0x7f800000u) return s;
  if ((b & 0x007fffffu) != 0u) b = (b & 0xff800000u) + 0x00800000u;
  return __uint_as_float(b);
}

// Dynamic scales (vLLM semantics; see OutKind in params.h). amax is NaN-propagating.
// Per token (vLLM dynamic_per_token_scaled_fp8_quant): max(min(amax, ub) / 448, 1 / (448 * 512)).
__device__ __forceinline__ float token_scale(float amax, const float* ub) {
  constexpr float kMinScale = 1.0f / (448.0f * 512.0f);
  if (ub != nullptr) amax = min_nan(amax, __ldg(ub));
  return max_nan(amax / 448.0f, kMinScale);
}
// Per group (vLLM per_token_group_quant_fp8): max(amax, 1e-10) / 448, optionally 2^ceil(log2).
__device__ __forceinline__ float group_scale(float amax, bool ue8m0) {
  const float s = max_nan(amax, 1e-10f) / 448.0f;
  return ue8m0 ? pow2_ceil(s) : s;
}

// Calls f(elem, y) for each vector this thread holds of token t's row: elem its first element in
// [T, H], y its RMSNorm in float32 (norm_vec). The loop every writer without a shuffle shares.
template <class Cfg, class F>
__device__ __forceinline__ void for_each_norm_vec(const LaunchParams& p, const Geometry<Cfg>& geo,
                                                  int64_t t, const TokenRow<Cfg>& row,
                                                  float inv, F&& f) {
#pragma unroll
  for (int i = 0; i < Cfg::kVpt; ++i) {
    const int v = geo.vec(i);
    if (v < 0) continue;
    float y[Cfg::kVec];
    norm_vec<Cfg>(p, row, i, v, inv, y);
    f(t * geo.H + static_cast<int64_t>(v) * Cfg::kVec, y);
  }
}

// norm: y in the activation dtype.
struct NormWriter {
  static constexpr OutKind kKind = OutKind::kNorm;
  static constexpr int kGroup = 0;
  template <class Cfg>
  static __device__ __forceinline__ void write(const LaunchParams& p, const Geometry<Cfg>& geo,
                                               int64_t t, const TokenRow<Cfg>& row, float inv,
                                               bool valid, Reducer<Cfg>&) {
    using T = typename Cfg::T;
    if (!valid) return;
    for_each_norm_vec<Cfg>(p, geo, t, row, inv, [&](int64_t elem, float (&y)[Cfg::kVec]) {
      st_vec(static_cast<T*>(p.norm_out) + elem, pack<T>(y));
    });
  }
};

// fp8_static: saturate(y * (1 / scale)), scale the float32 per-tensor input p.fp8_scale.
struct Fp8StaticWriter {
  static constexpr OutKind kKind = OutKind::kFP8Static;
  static constexpr int kGroup = 0;
  template <class Cfg>
  static __device__ __forceinline__ void write(const LaunchParams& p, const Geometry<Cfg>& geo,
                                               int64_t t, const TokenRow<Cfg>& row, float inv,
                                               bool valid, Reducer<Cfg>&) {
    constexpr int kVec = Cfg::kVec;
    if (!valid) return;
    const float inv_scale = 1.0f / __ldg(p.fp8_scale);
    for_each_norm_vec<Cfg>(p, geo, t, row, inv, [&](int64_t elem, float (&y)[kVec]) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) y[j] *= inv_scale;
      store_fp8<kVec>(static_cast<uint8_t*>(p.norm_out) + elem, y);
    });
  }
};

// fp8_token: one dynamic scale per token (token_scale, bounded by p.scale_ub when given), written
// to p.scale_out[t]; saturate(y / scale).
struct Fp8TokenWriter {
  static constexpr OutKind kKind = OutKind::kFP8Token;
  static constexpr int kGroup = 0;
  template <class Cfg>
  static __device__ __forceinline__ void write(const LaunchParams& p, const Geometry<Cfg>& geo,
                                               int64_t t, const TokenRow<Cfg>& row, float inv,
                                               bool valid, Reducer<Cfg>& red) {
    constexpr int kVec = Cfg::kVec;
    // Pass 1: amax over the token (threads, warps, CTAs of the cluster); pass 2 recomputes y
    // (the same operations, so the same values) instead of holding the row in registers.
    float amax = 0.0f;
    if (valid) {
      for_each_norm_vec<Cfg>(p, geo, t, row, inv, [&](int64_t, float (&y)[kVec]) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) amax = max_nan(amax, fabsf(y[j]));
      });
    }
    amax = row_reduce<Cfg>(amax, geo, red, MaxNanOp{});
    if (!valid) return;
    const float scale = token_scale(amax, p.scale_ub);
    if (geo.lane == 0 && geo.cta_in_cluster == 0) p.scale_out[t] = scale;
    for_each_norm_vec<Cfg>(p, geo, t, row, inv, [&](int64_t elem, float (&y)[kVec]) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) y[j] = y[j] / scale;
      store_fp8<kVec>(static_cast<uint8_t*>(p.norm_out) + elem, y);
    });
  }
};

// fp8_group128: one dynamic scale per group of kQuantGroup consecutive elements (group_scale,
// optionally a power of two: p.scale_ue8m0), written to p.scale_out row-major [T, H / 128] or
// column-major (p.scale_col_major); saturate(y / scale).
struct Fp8Group128Writer {
  static constexpr OutKind kKind = OutKind::kFP8Group128;
  static constexpr int kGroup = kQuantGroup;
  template <class Cfg>
  static __device__ __forceinline__ void write(const LaunchParams& p, const Geometry<Cfg>& geo,
                                               int64_t t, const TokenRow<Cfg>& row, float inv,
                                               bool valid, Reducer<Cfg>&) {
    constexpr int kVec = Cfg::kVec;
    constexpr int kGV = Cfg::kGroupVecs;
    const bool ue8m0 = p.scale_ue8m0 != 0;
    const int64_t groups = geo.H / kGroup;
#pragma unroll
    for (int i = 0; i < Cfg::kVpt; ++i) {
      if (Cfg::kGeneric && i >= geo.vpt) break;  // uniform over the block: shuffles stay whole
      const int v = geo.vec(i);
      const bool has = valid && v >= 0;
      // y for every lane (vector 0's gamma where it has none), so that nothing diverges before
      // the shuffles (a branch around norm_vec here made ptxas spill in the poll loop).
      float y[kVec];
      norm_vec<Cfg>(p, row, i, has ? v : 0, inv, y);
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < kVec; ++j) amax = max_nan(amax, fabsf(y[j]));
      if (!has) amax = 0.0f;
      // The group's kGV lanes are aligned and consecutive: a butterfly over them (every lane of
      // the warp takes part; lanes without a vector contribute 0).
#pragma unroll
      for (int off = kGV / 2; off > 0; off >>= 1) {
        amax = max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      }
      if (!has) continue;
      const float scale = group_scale(amax, ue8m0);
      if (v % kGV == 0) {
        const int64_t g = v / kGV;
        const int64_t at = p.scale_col_major ? g * geo.T + t : t * groups + g;
        p.scale_out[at] = scale;
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) y[j] = y[j] / scale;
      store_fp8<kVec>(static_cast<uint8_t*>(p.norm_out) + t * geo.H + static_cast<int64_t>(v) * kVec, y);
    }
  }
};

}  // namespace arfuse
