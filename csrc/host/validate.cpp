// arfuse host code: argument validation (validate.h).
#include "host/validate.h"

#include <algorithm>
#include <string>

#include "arfuse/dispatch.h"
#include "host/errors.h"

namespace arfuse::host {

using torch::headeronly::ScalarType;

namespace {

// Where the tensors of a call must be: on one CUDA device (named for errors by `owner`), or
// anywhere (the CPU implementation's validation checks no placement).
struct Placement {
  bool check = false;
  int device_index = -1;
  const char* owner = "";
};

void check_tensor(const Tensor& t, const char* name, const Placement& where) {
  ARFUSE_CHECK_VALUE(t.is_contiguous(), name, ": must be contiguous");
  if (!where.check) return;
  const torch::stable::Device d = t.device();
  ARFUSE_CHECK_VALUE(d.is_cuda() && d.index() == where.device_index, name, ": is on ",
                     DeviceName{d}, " but ", where.owner, " is on cuda:", where.device_index);
  ARFUSE_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 || t.numel() == 0, name,
                     ": data must be 16-byte aligned (a view at an odd offset?)");
}

void check_act(const Tensor& t, const char* name, ScalarType act, const char* owner) {
  const ScalarType s = t.scalar_type();
  ARFUSE_CHECK_TYPE(s == act, name, ": dtype ", TypeName{s}, " does not match ", owner, " ",
                    TypeName{act});
}

// T and H of a fused call: from the residual, or without one (no residual add: vLLM's first
// layer) from the expert input: permuted_idx [T, K] with rows [P, H], dense [T, K, H] or plain
// [T, H]. Returns the argument they were read from (errors about T and H name it).
const char* tokens_and_hidden(Rows& k, const Tensor& expert_out, const OptTensor& permuted_idx,
                              const OptTensor& residual) {
  if (residual.has_value()) {
    ARFUSE_CHECK_VALUE(residual->dim() == 2, "residual: want [T, H], got ", Sizes{*residual});
    k.T = residual->size(0);
    k.H = residual->size(1);
    return "residual";
  }
  if (permuted_idx.has_value()) {
    ARFUSE_CHECK_VALUE(permuted_idx->dim() == 2, "permuted_idx: want [T, K], got ",
                       Sizes{*permuted_idx});
    ARFUSE_CHECK_VALUE(expert_out.dim() >= 1, "expert_out: with permuted_idx want permuted rows ",
                       "[P, H], got ", Sizes{expert_out});
    k.T = permuted_idx->size(0);
    k.H = expert_out.size(expert_out.dim() - 1);
    return "permuted_idx";
  }
  ARFUSE_CHECK_VALUE(expert_out.dim() == 2 || expert_out.dim() == 3,
                     "expert_out: want [T, H] or [T, K, H], got ", Sizes{expert_out});
  k.T = expert_out.size(0);
  k.H = expert_out.size(expert_out.dim() - 1);
  return "expert_out";
}

// The layout, K and P of the expert rows for k.T tokens of hidden k.H (the one place that
// decides plain / dense / permuted).
void infer_layout(Rows& k, const Tensor& expert_out, const OptTensor& permuted_idx,
                  const Placement& where) {
  if (permuted_idx.has_value()) {
    const Tensor& idx = *permuted_idx;
    k.layout = Layout::kPermuted;
    ARFUSE_CHECK_VALUE(expert_out.dim() == 2 && expert_out.size(1) == k.H,
                       "expert_out: with permuted_idx want permuted rows [P, H=", k.H, "], got ",
                       Sizes{expert_out});
    ARFUSE_CHECK_TYPE(idx.scalar_type() == ScalarType::Int, "permuted_idx: dtype ",
                      TypeName{idx.scalar_type()}, " (want int32)");
    ARFUSE_CHECK_VALUE(idx.dim() == 2 && idx.size(0) == k.T && idx.size(1) >= 1 &&
                           idx.size(1) <= kMaxTopK,
                       "permuted_idx: want [T=", k.T, ", K] with 1 <= K <= ", kMaxTopK, ", got ",
                       Sizes{idx});
    check_tensor(idx, "permuted_idx", where);
    k.K = idx.size(1);
    k.P = expert_out.size(0);
  } else if (expert_out.dim() == 3) {
    k.layout = Layout::kDense;
    ARFUSE_CHECK_VALUE(expert_out.size(0) == k.T && expert_out.size(2) == k.H &&
                           expert_out.size(1) >= 1 && expert_out.size(1) <= kMaxTopK,
                       "expert_out: dense layout wants [T=", k.T, ", K, H=", k.H,
                       "] with 1 <= K <= ", kMaxTopK, ", got ", Sizes{expert_out});
    k.K = expert_out.size(1);
    k.P = k.T * k.K;
  } else {
    k.layout = Layout::kPlain;
    ARFUSE_CHECK_VALUE(expert_out.dim() == 2 && expert_out.size(0) == k.T &&
                           expert_out.size(1) == k.H,
                       "expert_out: want [T=", k.T, ", H=", k.H,
                       "] (plain), [T, K, H] (dense) or [P, H] with permuted_idx, got ",
                       Sizes{expert_out});
    k.K = 1;
    k.P = k.T;
  }
}

void check_weights(Rows& k, const Tensor& w, ScalarType act, const Placement& where) {
  ARFUSE_CHECK_VALUE(k.layout != Layout::kPlain,
                     "expert_weights: the plain layout is already reduced over experts; pass no "
                     "weights (fold them into expert_out or routed_scaling)");
  const ScalarType s = w.scalar_type();
  ARFUSE_CHECK_TYPE(s == ScalarType::Float || s == act, "expert_weights: dtype ", TypeName{s},
                    " (want float32 or ", TypeName{act}, ")");
  ARFUSE_CHECK_VALUE(w.dim() == 2 && w.size(0) == k.T && w.size(1) == k.K,
                     "expert_weights: want [T=", k.T, ", K=", k.K, "], got ", Sizes{w});
  check_tensor(w, "expert_weights", where);
  k.weights_f32 = s == ScalarType::Float;
}

void check_shared(const Rows& k, const Tensor& s, ScalarType act, const char* owner,
                  const Placement& where) {
  check_act(s, "shared_out", act, owner);
  ARFUSE_CHECK_VALUE(s.dim() == 2 && s.size(0) == k.T && s.size(1) == k.H,
                     "shared_out: want [T=", k.T, ", H=", k.H, "], got ", Sizes{s});
  check_tensor(s, "shared_out", where);
}

void check_dynamic_quant(Checked& k, const DynamicQuant& dq, const Comm& c,
                         const Tensor& expert_out, bool check_device) {
  ARFUSE_CHECK_VALUE(dq.group_size == 0 || dq.group_size == kQuantGroup, "group_size: ",
                     dq.group_size, " is not supported (want 0: one scale per token, or ",
                     kQuantGroup, ": one scale per group of ", kQuantGroup, " elements)");
  const bool has_ub = dq.scale_ub != nullptr && dq.scale_ub->has_value();
  if (dq.group_size == kQuantGroup) {
    ARFUSE_CHECK_VALUE(k.H % kQuantGroup == 0, "hidden: ", k.H,
                       " is not a multiple of group_size=", kQuantGroup,
                       " (per-group FP8 scales need whole groups of ", kQuantGroup,
                       " elements; use group_size=0, one scale per token)");
    ARFUSE_CHECK_VALUE(!has_ub, "scale_ub: an upper bound applies to per-token scales only "
                       "(group_size=0), not to group_size=", kQuantGroup);
    k.out = OutKind::kFP8Group128;
    return;
  }
  ARFUSE_CHECK_VALUE(!dq.col_major, "col_major_scales: the column-major layout applies to "
                     "per-group scales only (group_size=", kQuantGroup, ")");
  ARFUSE_CHECK_VALUE(!dq.ue8m0, "ue8m0: power-of-two scales apply to per-group scales only "
                     "(group_size=", kQuantGroup, ")");
  if (has_ub) {
    const Tensor& ub = **dq.scale_ub;
    ARFUSE_CHECK_TYPE(ub.scalar_type() == ScalarType::Float, "scale_ub: dtype ",
                      TypeName{ub.scalar_type()}, " (want float32)");
    ARFUSE_CHECK_VALUE(ub.numel() == 1, "scale_ub: want one element (an upper bound of every "
                       "token's amax), got ", Sizes{ub});
    const torch::stable::Device d = ub.device();
    if (check_device) {
      ARFUSE_CHECK_VALUE(d.is_cuda() && d.index() == c.device_index, "scale_ub: is on ",
                         DeviceName{d}, " but the communicator is on cuda:", c.device_index);
    } else {
      const torch::stable::Device want = expert_out.device();
      ARFUSE_CHECK_VALUE(d == want, "scale_ub: is on ", DeviceName{d}, " but expert_out is on ",
                         DeviceName{want});
    }
  }
  k.out = OutKind::kFP8Token;
}

// Algorithm and instance, decided before anything is launched.
void choose_instance(Checked& k, const Comm& c, int64_t algorithm) {
  Algo algo = static_cast<Algo>(algorithm);
  const int H = static_cast<int>(k.H);
  std::string why;
  if (algo == Algo::kAuto) {
    const int64_t limit = std::min<int64_t>(c.oneshot_cap, oneshot_max_tokens(c.dtype, H, c.world));
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
    ARFUSE_CHECK_VALUE(k.T <= c.oneshot_cap, "algorithm: one-shot with ", k.T,
                       " tokens exceeds the communicator's oneshot_max_tokens=", c.oneshot_cap);
  }
  k.algo = algo;
  k.instance = find_instance(c.dtype, H, c.world, algo, k.out, &why);
  ARFUSE_CHECK_VALUE(k.instance != nullptr, why);
}

}  // namespace

Checked validate_fused(const Comm& c, const Tensor& expert_out, const OptTensor& permuted_idx,
                       const OptTensor& expert_weights, const OptTensor& shared_out,
                       const OptTensor& residual, const Tensor& gamma, double eps,
                       double weight_bias, const OptTensor& fp8_scale, int64_t algorithm,
                       bool check_device, const DynamicQuant* dq) {
  static const char* const kOwner = "the communicator's";
  Checked k;
  ARFUSE_CHECK_VALUE(c.peers_ready, "comm: peers are not set (Communicator not finished)");
  ARFUSE_CHECK_VALUE(algorithm >= 0 && algorithm <= 2, "algorithm: ", algorithm,
                     " is not one of 0 (auto), 1 (oneshot), 2 (twoshot)");
  const Placement where{check_device, c.device_index, "the communicator"};
  const char* shape_arg = tokens_and_hidden(k, expert_out, permuted_idx, residual);
  if (residual.has_value()) {
    check_act(*residual, "residual", c.scalar, kOwner);
    check_tensor(*residual, "residual", where);
  }
  ARFUSE_CHECK_VALUE(k.H == c.hidden, shape_arg, ": hidden size ", k.H,
                     " does not match the communicator's ", c.hidden);
  ARFUSE_CHECK_VALUE(k.T <= c.max_tokens, shape_arg, ": ", k.T,
                     " tokens exceed the communicator's capacity max_tokens=", c.max_tokens);

  check_act(expert_out, "expert_out", c.scalar, kOwner);
  check_tensor(expert_out, "expert_out", where);
  infer_layout(k, expert_out, permuted_idx, where);
  if (expert_weights.has_value()) check_weights(k, *expert_weights, c.scalar, where);
  if (shared_out.has_value()) check_shared(k, *shared_out, c.scalar, kOwner, where);

  const ScalarType g = gamma.scalar_type();
  ARFUSE_CHECK_TYPE(g == ScalarType::Float || g == c.scalar, "gamma: dtype ", TypeName{g},
                    " (want float32 or ", TypeName{c.scalar}, ")");
  ARFUSE_CHECK_VALUE(gamma.dim() == 1 && gamma.size(0) == k.H, "gamma: want [H=", k.H,
                     "], got ", Sizes{gamma});
  check_tensor(gamma, "gamma", where);
  k.gamma_f32 = g == ScalarType::Float;
  ARFUSE_CHECK_VALUE(eps >= 0.0, "eps: ", eps, " must be >= 0");
  ARFUSE_CHECK_VALUE(weight_bias == 0.0 || weight_bias == 1.0, "weight_bias: ", weight_bias,
                     " must be 0 (x * gamma) or 1 (x * (1 + gamma))");
  k.out = OutKind::kNorm;
  if (fp8_scale.has_value()) {
    const Tensor& s = *fp8_scale;
    ARFUSE_CHECK_TYPE(s.scalar_type() == ScalarType::Float, "fp8_scale: dtype ",
                      TypeName{s.scalar_type()}, " (want float32)");
    ARFUSE_CHECK_VALUE(s.numel() == 1, "fp8_scale: want one element (per-tensor), got ",
                       Sizes{s});
    check_tensor(s, "fp8_scale", where);
    k.out = OutKind::kFP8Static;
  }
  if (dq != nullptr) check_dynamic_quant(k, *dq, c, expert_out, check_device);

  // A CPU communicator (world size 1, arfuse/_cpu.py) launches no kernel: nothing more to decide.
  if (c.cuda) choose_instance(k, c, algorithm);
  return k;
}

Rows validate_finalize(const Tensor& expert_out, const OptTensor& permuted_idx,
                       const OptTensor& expert_weights, const OptTensor& shared_out,
                       int64_t num_tokens, bool check_device) {
  Rows k;
  const ScalarType act = expert_out.scalar_type();
  const DType dt = to_dtype(act, "expert_out");
  ARFUSE_CHECK_VALUE(num_tokens >= 0 && num_tokens <= (1 << 24), "num_tokens: ", num_tokens,
                     " must be 0..16777216");
  ARFUSE_CHECK_VALUE(expert_out.dim() == 2 || expert_out.dim() == 3,
                     "expert_out: want [T, H], [T, K, H] or [P, H] with permuted_idx, got ",
                     Sizes{expert_out});
  Placement where;
  if (check_device) {
    const torch::stable::Device d = expert_out.device();
    ARFUSE_CHECK_VALUE(d.is_cuda(), "expert_out: must be a CUDA tensor");
    where = Placement{true, d.index(), "expert_out"};
  }
  check_tensor(expert_out, "expert_out", where);
  k.T = num_tokens;
  k.H = expert_out.size(expert_out.dim() - 1);
  infer_layout(k, expert_out, permuted_idx, where);
  const int vec = vector_elems(dt);
  ARFUSE_CHECK_VALUE(k.H > 0 && k.H % vec == 0, "expert_out: hidden ", k.H,
                     " must be a positive multiple of ", vec);
  if (expert_weights.has_value()) check_weights(k, *expert_weights, act, where);
  if (shared_out.has_value()) check_shared(k, *shared_out, act, "expert_out's", where);
  return k;
}

}  // namespace arfuse::host
