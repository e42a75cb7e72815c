// arfuse: lookup over the generated dispatch table (out/dispatch.cu holds the data).
#include <algorithm>
#include <string>

#include "arfuse/dispatch.h"
#include "host/out_kinds.h"  // the output kinds' names (generated, out/out_kinds.cpp)

namespace arfuse {

int vector_elems(DType dtype) { return dtype_vec(dtype); }

// The vocabulary's names (csrc/arfuse/vocab.h) of a value, or "?" for a value outside the enum.
template <typename E, size_t N>
static const char* name_of(E value, const char* const (&names)[N]) {
  const auto i = static_cast<int64_t>(value);
  return i >= 0 && i < static_cast<int64_t>(N) ? names[i] : "?";
}

const char* dtype_name(DType dtype) { return name_of(dtype, kDTypeNames); }

const char* algo_name(Algo algo) { return name_of(algo, kAlgoNames); }

const char* out_name(OutKind out) {
  const host::OutKindTraits* t = host::find_out_kind(static_cast<int64_t>(out));
  return t != nullptr ? t->name : "?";
}

const Instance* find_instance(DType dtype, int hidden, int world_size, Algo algo, OutKind out,
                              int64_t tokens, std::string* why) {
  // World size 1 has no all-reduce: the local algorithm serves it, and nothing else (the same
  // rule as the generator's, gen/plan.go worldRule).
  if ((algo == Algo::kLocal) != (world_size == 1)) {
    if (why != nullptr) {
      *why = std::string("no kernel instance serves (dtype ") + dtype_name(dtype) + ", hidden " +
             std::to_string(hidden) + ", world size " + std::to_string(world_size) +
             ", algorithm " + algo_name(algo) + ", output " + out_name(out) + "): " +
             (world_size == 1 ? "world size 1 has no all-reduce; algorithm local serves it"
                              : "algorithm local serves world size 1 only (no all-reduce)");
    }
    return nullptr;
  }
  int count = 0;
  const Instance* table = instance_table(&count);
  const Instance* generic = nullptr;
  const Instance* every = nullptr;  // the specialised instance for every token count
  const Instance* twin = nullptr;   // the smallest token split serving `tokens`
  for (int i = 0; i < count; ++i) {
    const Instance& e = table[i];
    if (e.dtype != dtype || e.algo != algo || e.out != out) continue;
    if (e.hidden == hidden && e.world_size == world_size) {
      if (e.max_tokens == 0) {
        every = &e;
      } else if (tokens >= 0 && tokens <= e.max_tokens &&
                 (twin == nullptr || e.max_tokens < twin->max_tokens)) {
        twin = &e;
      }
    }
    if (e.hidden == 0 && e.world_size == 0) generic = &e;
  }
  if (twin != nullptr) return twin;
  if (every != nullptr) return every;
  const int vec = vector_elems(dtype);
  const bool served = generic != nullptr && hidden > 0 && hidden % vec == 0 &&
                      hidden <= generic->max_hidden && world_size >= 1 && world_size <= kMaxWorld;
  if (served) return generic;
  if (why == nullptr) return nullptr;
  // The reason, built only when asked for (the launch path asks with why == nullptr).
  const std::string combo = std::string("(dtype ") + dtype_name(dtype) + ", hidden " +
                            std::to_string(hidden) + ", world size " + std::to_string(world_size) +
                            ", algorithm " + algo_name(algo) + ", output " + out_name(out) + ")";
  if (generic == nullptr) {
    *why = "no kernel instance serves " + combo +
           ": it has no specialised instance and the build has no generic instance for this "
           "dtype, algorithm and output kind (add it to the variant matrix)";
  } else if (hidden <= 0 || hidden % vec != 0) {
    *why = "no kernel instance serves " + combo + ": hidden must be a positive multiple of " +
           std::to_string(vec) + " (one 16-byte vector of " + dtype_name(dtype) + ")";
  } else if (hidden > generic->max_hidden) {
    *why = "no kernel instance serves " + combo + ": the generic instance serves hidden <= " +
           std::to_string(generic->max_hidden) + " (add a specialised instance to the variant matrix)";
  } else {
    *why = "no kernel instance serves " + combo + ": world size must be 1.." +
           std::to_string(kMaxWorld);
  }
  return nullptr;
}

// Default crossover for combinations the tuning table has not measured: one-shot while the bytes
// each rank receives in one call (N * T * H * elem) stay within 1 MiB, at least 1 token. One-shot
// moves N times the row bytes but needs a single wait; two-shot moves about 2x the row bytes with
// two dependent waits. The budget is fitted to the 12 crossovers measured on the H200 at eb76442
// (variants/tuning.yaml): at the measured token counts it picks the same algorithm for 8 of them;
// one-shot one step late for hidden 4096 N = 8 at T = 16 (+6 %) and 2048 N = 8 at T = 32 (+9 %);
// two-shot early for 2880 (K = 4: a cheaper one-shot than the bytes say) N = 4 at T = 64 (+8 %)
// and N = 2 at T = 128 and 256 (+15 %, +8 %). (512 KiB, fitted to ac03913's crossovers, picked
// two-shot early at 10 of today's 12; the earlier 2 MiB took one-shot up to T = 18 at 7168 N = 8,
// 41 % slower than two-shot at T = 16 in fp16 at 1082a62.) docs/performance.md.
int default_oneshot_max_tokens(DType dtype, int hidden, int world_size) {
  const int64_t elem = dtype_bytes(dtype);
  const int64_t per_token = static_cast<int64_t>(std::max(world_size, 1)) * hidden * elem;
  const int64_t budget = int64_t{1} << 20;
  return static_cast<int>(std::max<int64_t>(1, budget / std::max<int64_t>(per_token, 1)));
}

const CardThresholds* card_thresholds(const std::string& card) {
  int count = 0;
  const CardThresholds* cards = card_threshold_tables(&count);
  for (int i = 0; i < count; ++i) {
    if (card == cards[i].card) return &cards[i];
  }
  return nullptr;
}

namespace {
const Threshold* find_row(const Threshold* rows, int count, DType dtype, int hidden, int world_size) {
  for (int i = 0; i < count; ++i) {
    if (rows[i].dtype == dtype && rows[i].hidden == hidden && rows[i].world_size == world_size) {
      return &rows[i];
    }
  }
  return nullptr;
}
}  // namespace

int oneshot_max_tokens(DType dtype, int hidden, int world_size, const CardThresholds* card) {
  const Threshold* row = card ? find_row(card->rows, card->count, dtype, hidden, world_size) : nullptr;
  if (row == nullptr) {
    int count = 0;
    const Threshold* table = threshold_table(&count);
    row = find_row(table, count, dtype, hidden, world_size);
  }
  return row ? row->oneshot_max_tokens : default_oneshot_max_tokens(dtype, hidden, world_size);
}

}  // namespace arfuse
