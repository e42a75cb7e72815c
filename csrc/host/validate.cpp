// arfuse host code: argument validation (validate.h). Each tensor is read once (tensor_arg.h).
#include "host/validate.h"

#include <algorithm>
#include <string>

#include "arfuse/dispatch.h"
#include "host/errors.h"
#include "host/out_kinds.h"

namespace arfuse::host {

namespace {

// Where the tensors of a call must be: on one CUDA device (named for errors by `owner`), or
// anywhere (the CPU implementation's validation checks no placement).
struct Placement {
  bool check = false;
  int device_index = -1;
  const char* owner = "";
};

std::optional<Arg> read_opt(const OptTensor& t, const char* name) {
  if (!t.has_value()) return std::nullopt;
  return read(*t, name);
}

void check_tensor(const Arg& a, const Placement& where) {
  ARFUSE_CHECK_VALUE(a.contiguous, a.name, ": must be contiguous");
  if (!where.check) return;
  ARFUSE_CHECK_VALUE(a.cuda && a.device == where.device_index, a.name, ": is on ", DeviceOf{a},
                     " but ", where.owner, " is on cuda:", where.device_index);
  ARFUSE_CHECK_VALUE(reinterpret_cast<uintptr_t>(a.data) % 16 == 0 || a.numel() == 0, a.name,
                     ": data must be 16-byte aligned (a view at an odd offset?)");
}

void check_act(const Arg& a, ScalarType act, const char* owner) {
  ARFUSE_CHECK_TYPE(a.dtype == act, a.name, ": dtype ", TypeName{a.dtype}, " does not match ",
                    owner, " ", TypeName{act});
}

// T and H of a fused call, from the expert input: permuted_idx [T, K] with rows [P, H], dense
// [T, K, H] or plain [T, H]. Returns the argument T was read from (errors about T name it).
const char* tokens_and_hidden(Rows& k, const Arg& x, const std::optional<Arg>& idx) {
  if (idx) {
    ARFUSE_CHECK_VALUE(idx->dim == 2, "permuted_idx: want [T, K], got ", SizesOf{*idx});
    ARFUSE_CHECK_VALUE(x.dim >= 1, "expert_out: with permuted_idx want permuted rows [P, H], got ",
                       SizesOf{x});
    k.T = idx->size(0);
    k.H = x.size(x.dim - 1);
    return "permuted_idx";
  }
  ARFUSE_CHECK_VALUE(x.dim == 2 || x.dim == 3, "expert_out: want [T, H] or [T, K, H], got ",
                     SizesOf{x});
  k.T = x.size(0);
  k.H = x.size(x.dim - 1);
  return "expert_out";
}

// The layout, K and P of the expert rows for k.T tokens of hidden k.H (the one place that
// decides plain / dense / permuted).
void infer_layout(Rows& k, const Arg& x, const std::optional<Arg>& idx, const Placement& where) {
  if (idx) {
    k.layout = Layout::kPermuted;
    ARFUSE_CHECK_VALUE(x.dim == 2 && x.size(1) == k.H,
                       "expert_out: with permuted_idx want permuted rows [P, H=", k.H, "], got ",
                       SizesOf{x});
    ARFUSE_CHECK_TYPE(idx->dtype == ScalarType::Int, "permuted_idx: dtype ",
                      TypeName{idx->dtype}, " (want int32)");
    ARFUSE_CHECK_VALUE(idx->dim == 2 && idx->size(0) == k.T && idx->size(1) >= 1 &&
                           idx->size(1) <= kMaxTopK,
                       "permuted_idx: want [T=", k.T, ", K] with 1 <= K <= ", kMaxTopK, ", got ",
                       SizesOf{*idx});
    check_tensor(*idx, where);
    k.K = idx->size(1);
    k.P = x.size(0);
    k.permuted_idx = static_cast<const int32_t*>(idx->data);
  } else if (x.dim == 3) {
    k.layout = Layout::kDense;
    ARFUSE_CHECK_VALUE(x.size(0) == k.T && x.size(2) == k.H && x.size(1) >= 1 &&
                           x.size(1) <= kMaxTopK,
                       "expert_out: dense layout wants [T=", k.T, ", K, H=", k.H,
                       "] with 1 <= K <= ", kMaxTopK, ", got ", SizesOf{x});
    k.K = x.size(1);
    k.P = k.T * k.K;
  } else {
    k.layout = Layout::kPlain;
    ARFUSE_CHECK_VALUE(x.dim == 2 && x.size(0) == k.T && x.size(1) == k.H, "expert_out: want [T=",
                       k.T, ", H=", k.H,
                       "] (plain), [T, K, H] (dense) or [P, H] with permuted_idx, got ", SizesOf{x});
    k.K = 1;
    k.P = k.T;
  }
  k.expert_out = x.data;
}

void check_weights(Rows& k, const Arg& w, ScalarType act, const Placement& where) {
  ARFUSE_CHECK_VALUE(k.layout != Layout::kPlain,
                     "expert_weights: the plain layout is already reduced over experts; pass no "
                     "weights (fold them into expert_out or routed_scaling)");
  ARFUSE_CHECK_TYPE(w.dtype == ScalarType::Float || w.dtype == act, "expert_weights: dtype ",
                    TypeName{w.dtype}, " (want float32 or ", TypeName{act}, ")");
  ARFUSE_CHECK_VALUE(w.dim == 2 && w.size(0) == k.T && w.size(1) == k.K,
                     "expert_weights: want [T=", k.T, ", K=", k.K, "], got ", SizesOf{w});
  check_tensor(w, where);
  k.weights_f32 = w.dtype == ScalarType::Float;
  k.expert_weights = w.data;
}

void check_shared(Rows& k, const Arg& s, ScalarType act, const char* owner,
                  const Placement& where) {
  check_act(s, act, owner);
  ARFUSE_CHECK_VALUE(s.dim == 2 && s.size(0) == k.T && s.size(1) == k.H, "shared_out: want [T=",
                     k.T, ", H=", k.H, "], got ", SizesOf{s});
  check_tensor(s, where);
  k.shared_out = s.data;
}

// "per-token" or "per-group": what a dynamic kind's scales are called in messages.
const char* scales_adjective(const OutKindTraits* t) {
  if (t == nullptr) return "no";
  return t->scales == Scales::kPerGroup ? "per-group" : "per-token";
}

// The first dynamic kind (one fused_fp8_dynamic serves) with flag set, for messages; nullptr if none.
const OutKindTraits* dynamic_with(bool OutKindTraits::*flag) {
  int count = 0;
  const OutKindTraits* table = out_kind_table(&count);
  for (int i = 0; i < count; ++i) {
    if (&table[i] == dynamic_kind(table[i].group) && table[i].*flag) return &table[i];
  }
  return nullptr;
}

// The group sizes fused_fp8_dynamic takes: "0: one scale per token, or 128: one scale per ...".
std::string dynamic_kinds_text() {
  int count = 0;
  const OutKindTraits* table = out_kind_table(&count);
  std::string s;
  for (int i = 0; i < count; ++i) {
    if (&table[i] != dynamic_kind(table[i].group)) continue;
    s += (s.empty() ? "" : ", or ") + std::to_string(table[i].group) + ": " + scale_text(table[i]);
  }
  return s;
}

// The dynamic kinds' arguments, each checked against the traits of the kind group_size picks
// (out_kinds.h): no branch per kind. The messages name the kinds that do take an argument.
void check_dynamic_quant(Checked& k, const DynamicQuant& dq, const Comm& c, const Arg& x,
                         bool check_device) {
  const OutKindTraits* kind = dynamic_kind(dq.group_size);
  ARFUSE_CHECK_VALUE(kind != nullptr, "group_size: ", dq.group_size, " is not supported (want ",
                     dynamic_kinds_text(), ")");
  if (kind->group != 0) {
    const OutKindTraits* token = kind_with(Scales::kPerToken);
    ARFUSE_CHECK_VALUE(k.H % kind->group == 0, "hidden: ", k.H,
                       " is not a multiple of group_size=", kind->group,
                       " (per-group FP8 scales need whole groups of ", kind->group,
                       " elements; use group_size=", token ? token->group : 0, ", ",
                       token ? scale_text(*token) : "", ")");
  }
  const bool has_ub = dq.scale_ub != nullptr && dq.scale_ub->has_value();
  if (!kind->bounded) {
    const OutKindTraits* b = dynamic_with(&OutKindTraits::bounded);
    ARFUSE_CHECK_VALUE(!has_ub, "scale_ub: an upper bound applies to ", scales_adjective(b),
                       " scales only (group_size=", b ? b->group : 0, "), not to group_size=",
                       kind->group);
  }
  if (!kind->layouts) {
    const OutKindTraits* l = dynamic_with(&OutKindTraits::layouts);
    ARFUSE_CHECK_VALUE(!dq.col_major, "col_major_scales: the column-major layout applies to ",
                       scales_adjective(l), " scales only (group_size=", l ? l->group : 0, ")");
    ARFUSE_CHECK_VALUE(!dq.ue8m0, "ue8m0: power-of-two scales apply to ", scales_adjective(l),
                       " scales only (group_size=", l ? l->group : 0, ")");
  }
  if (kind->bounded && has_ub) {
    const Arg ub = read(**dq.scale_ub, "scale_ub");
    ARFUSE_CHECK_TYPE(ub.dtype == ScalarType::Float, "scale_ub: dtype ", TypeName{ub.dtype},
                      " (want float32)");
    ARFUSE_CHECK_VALUE(ub.numel() == 1, "scale_ub: want one element (an upper bound of every "
                       "token's amax), got ", SizesOf{ub});
    if (check_device) {
      ARFUSE_CHECK_VALUE(ub.cuda && ub.device == c.device_index, "scale_ub: is on ", DeviceOf{ub},
                         " but the communicator is on cuda:", c.device_index);
    } else {
      ARFUSE_CHECK_VALUE(ub.cuda == x.cuda && ub.cpu == x.cpu && ub.device == x.device,
                         "scale_ub: is on ", DeviceOf{ub}, " but expert_out is on ", DeviceOf{x});
    }
    k.scale_ub = static_cast<const float*>(ub.data);
  }
  k.out = kind->kind;
}

// The algorithm against the world size (CPU and CUDA communicators alike): world size 1 has no
// all-reduce and runs the local algorithm (auto picks it); local serves world size 1 only.
void check_algorithm(const Comm& c, int64_t algorithm) {
  ARFUSE_CHECK_VALUE(algorithm >= 0 && algorithm <= 3, "algorithm: ", algorithm,
                     " is not one of 0 (auto), 1 (oneshot), 2 (twoshot), 3 (local)");
  const Algo algo = static_cast<Algo>(algorithm);
  if (c.world == 1) {
    ARFUSE_CHECK_VALUE(algo == Algo::kAuto || algo == Algo::kLocal, "algorithm: ",
                       algo_name(algo), " is an all-reduce algorithm; a communicator of world ",
                       "size 1 has no all-reduce (want auto or local)");
  } else {
    ARFUSE_CHECK_VALUE(algo != Algo::kLocal, "algorithm: local is the world-size-1 op; this ",
                       "communicator has world size ", c.world, " (want auto, oneshot or twoshot)");
  }
}

// Algorithm and instance, decided before anything is launched.
void choose_instance(Checked& k, const Comm& c, int64_t algorithm) {
  Algo algo = static_cast<Algo>(algorithm);
  const int H = static_cast<int>(k.H);
  std::string why;
  if (algo == Algo::kAuto && c.world == 1) algo = Algo::kLocal;
  if (algo == Algo::kAuto) {
    algo = k.T <= c.auto_oneshot ? Algo::kOneShot : Algo::kTwoShot;  // H == c.hidden (checked)
    if (find_instance(c.dtype, H, c.world, algo, k.out, k.T, nullptr) == nullptr) {
      const Algo other = algo == Algo::kOneShot ? Algo::kTwoShot : Algo::kOneShot;
      if ((other == Algo::kTwoShot || k.T <= c.oneshot_cap) &&
          find_instance(c.dtype, H, c.world, other, k.out, k.T, nullptr) != nullptr) {
        algo = other;
      }
    }
  }
  if (algo == Algo::kOneShot) {
    ARFUSE_CHECK_VALUE(k.T <= c.oneshot_cap, "algorithm: one-shot with ", k.T,
                       " tokens exceeds the communicator's oneshot_max_tokens=", c.oneshot_cap);
  }
  k.algo = algo;
  k.instance = find_instance(c.dtype, H, c.world, algo, k.out, k.T, nullptr);
  if (k.instance == nullptr) {
    find_instance(c.dtype, H, c.world, algo, k.out, k.T, &why);  // the reason, only when it is needed
    ARFUSE_CHECK_VALUE(false, why);
  }
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
  check_algorithm(c, algorithm);
  const Placement where{check_device, c.device_index, "the communicator"};
  k.device = check_device ? c.device_index : -1;
  if (c.local_group) {
    const int closed = c.local_group->closed_rank.load(std::memory_order_acquire);
    ARFUSE_CHECK_VALUE(closed < 0, "comm: rank ", closed, " of this emulated group is closed (its ",
                       "buffer is freed): no rank of the group may launch any more; close the ",
                       "whole group");
  }
  const Arg x = read(expert_out, "expert_out");
  const std::optional<Arg> idx = read_opt(permuted_idx, "permuted_idx");
  const char* t_arg = tokens_and_hidden(k, x, idx);
  ARFUSE_CHECK_VALUE(k.H == c.hidden, "expert_out: hidden size ", k.H,
                     " does not match the communicator's ", c.hidden);
  ARFUSE_CHECK_VALUE(k.T <= c.max_tokens, t_arg, ": ", k.T,
                     " tokens exceed the communicator's capacity max_tokens=", c.max_tokens);
  if (residual) {
    const Arg res = read(*residual, "residual");
    ARFUSE_CHECK_VALUE(res.dim == 2 && res.size(0) == k.T && res.size(1) == k.H,
                       "residual: want [T=", k.T, ", H=", k.H, "] (T from ", t_arg, "), got ",
                       SizesOf{res});
    check_act(res, c.scalar, kOwner);
    check_tensor(res, where);
    k.residual = res.data;
  }

  check_act(x, c.scalar, kOwner);
  check_tensor(x, where);
  infer_layout(k, x, idx, where);
  if (expert_weights) check_weights(k, read(*expert_weights, "expert_weights"), c.scalar, where);
  if (shared_out) check_shared(k, read(*shared_out, "shared_out"), c.scalar, kOwner, where);

  const Arg g = read(gamma, "gamma");
  ARFUSE_CHECK_TYPE(g.dtype == ScalarType::Float || g.dtype == c.scalar, "gamma: dtype ",
                    TypeName{g.dtype}, " (want float32 or ", TypeName{c.scalar}, ")");
  ARFUSE_CHECK_VALUE(g.dim == 1 && g.size(0) == k.H, "gamma: want [H=", k.H, "], got ",
                     SizesOf{g});
  check_tensor(g, where);
  k.gamma_f32 = g.dtype == ScalarType::Float;
  k.gamma = g.data;
  ARFUSE_CHECK_VALUE(eps >= 0.0, "eps: ", eps, " must be >= 0");
  ARFUSE_CHECK_VALUE(weight_bias == 0.0 || weight_bias == 1.0, "weight_bias: ", weight_bias,
                     " must be 0 (x * gamma) or 1 (x * (1 + gamma))");
  // fused: no scale (the kind without scales) or an input scale (the kind that takes one).
  k.out = kind_with(Scales::kNone)->kind;
  if (fp8_scale) {
    const Arg s = read(*fp8_scale, "fp8_scale");
    ARFUSE_CHECK_TYPE(s.dtype == ScalarType::Float, "fp8_scale: dtype ", TypeName{s.dtype},
                      " (want float32)");
    ARFUSE_CHECK_VALUE(s.numel() == 1, "fp8_scale: want one element (per-tensor), got ",
                       SizesOf{s});
    check_tensor(s, where);
    k.fp8_scale = static_cast<const float*>(s.data);
    k.out = kind_with(Scales::kInput)->kind;
  }
  if (dq != nullptr) check_dynamic_quant(k, *dq, c, x, check_device);

  // A CPU communicator (world size 1, arfuse/_cpu.py) launches no kernel: nothing more to decide.
  if (c.cuda) choose_instance(k, c, algorithm);
  return k;
}

Checked validate_inplace(const Comm& c, const Tensor& input, const Tensor& residual,
                         const OptTensor& shared_out, const Tensor& gamma, double eps,
                         double weight_bias, int64_t algorithm, bool check_device) {
  const Arg x = read(input, "input");
  const Arg r = read(residual, "residual");
  ARFUSE_CHECK_VALUE(x.dim == 2, "input: in-place needs the plain layout [T, H], got ",
                     SizesOf{x});
  const OptTensor res(residual);
  Checked k = validate_fused(c, input, std::nullopt, std::nullopt, shared_out, res, gamma, eps,
                             weight_bias, std::nullopt, algorithm, check_device);
  // The kernel writes norm_out into input and residual_out into residual while it reads them
  // and shared_out and gamma: a written buffer that shares memory with any other argument
  // would lose data (or read half-written rows).
  const std::optional<Arg> s = read_opt(shared_out, "shared_out");
  const Arg g = read(gamma, "gamma");
  const Arg* written[] = {&x, &r};
  for (const Arg* w : written) {
    for (const Arg* o : {&x, &r, s ? &*s : nullptr, &g}) {
      if (o == nullptr || o == w || (w == &r && o == &x)) continue;  // each pair once
      ARFUSE_CHECK_VALUE(!overlap(*w, *o), w->name, " and ", o->name, " overlap in memory: ",
                         "inplace=True writes norm_out into input and residual_out into residual, ",
                         "so neither may share memory with another argument (pass separate ",
                         "tensors, or inplace=False)");
    }
  }
  return k;
}

Rows validate_finalize(const Tensor& expert_out, const OptTensor& permuted_idx,
                       const OptTensor& expert_weights, const OptTensor& shared_out,
                       int64_t num_tokens, bool check_device) {
  Rows k;
  const Arg x = read(expert_out, "expert_out");
  const DType dt = to_dtype(x.dtype, "expert_out");
  ARFUSE_CHECK_VALUE(num_tokens >= 0 && num_tokens <= (1 << 24), "num_tokens: ", num_tokens,
                     " must be 0..16777216");
  ARFUSE_CHECK_VALUE(x.dim == 2 || x.dim == 3,
                     "expert_out: want [T, H], [T, K, H] or [P, H] with permuted_idx, got ",
                     SizesOf{x});
  Placement where;
  if (check_device) {
    ARFUSE_CHECK_VALUE(x.cuda, "expert_out: must be a CUDA tensor");
    where = Placement{true, x.device, "expert_out"};
    k.device = x.device;
  }
  check_tensor(x, where);
  k.T = num_tokens;
  k.H = x.size(x.dim - 1);
  infer_layout(k, x, read_opt(permuted_idx, "permuted_idx"), where);
  const int vec = vector_elems(dt);
  ARFUSE_CHECK_VALUE(k.H > 0 && k.H % vec == 0, "expert_out: hidden ", k.H,
                     " must be a positive multiple of ", vec);
  if (expert_weights) check_weights(k, read(*expert_weights, "expert_weights"), x.dtype, where);
  if (shared_out) check_shared(k, read(*shared_out, "shared_out"), x.dtype, "expert_out's", where);
  return k;
}

}  // namespace arfuse::host
