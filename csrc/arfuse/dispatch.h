// arfuse: the dispatch table's types and lookup, shared by the generated table (out/dispatch.cu)
// and the hand-written op code. The generator emits the data (one Instance per kernel instance,
// one Threshold per measured tuning row); the lookup logic lives once, in csrc/dispatch.cpp.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "arfuse/params.h"

namespace arfuse {

using Launcher = cudaError_t (*)(const LaunchParams&, cudaStream_t);

// One compiled kernel instance and the plan it was built with. hidden == 0 / world_size == 0
// mark the generic instance of a (dtype, algorithm, output kind), which serves any hidden size
// that is a multiple of the vector width, up to max_hidden, and any world size up to kMaxWorld.
struct Instance {
  const char* name;
  DType dtype;
  int32_t hidden;
  int32_t world_size;
  Algo algo;
  OutKind out;
  int32_t block_threads;      // 0: chosen at launch (generic)
  int32_t tokens_per_block;
  int32_t cluster;            // CTAs per token (thread-block cluster size)
  int32_t max_hidden;         // largest hidden size served (== hidden when specialised)
  // 0: every token count. Else a token split's twin (variants/tuning.yaml min_blocks_splits: the
  // same plan built without its blocks-per-SM bound), served for T <= max_tokens; its sibling,
  // the same combination with max_tokens 0, serves the larger T.
  int32_t max_tokens;
  Launcher launch;
};

// A measured one-shot/two-shot crossover: one-shot for T <= oneshot_max_tokens.
struct Threshold {
  DType dtype;
  int32_t hidden;
  int32_t world_size;
  int32_t oneshot_max_tokens;
};

// The crossovers measured on one card (variants/tuning.yaml card_thresholds): on a device whose
// name (cudaDeviceProp::name) is exactly `card`, a combination's row is taken from here first.
struct CardThresholds {
  const char* card;
  const Threshold* rows;
  int32_t count;
};

// ---- generated (out/dispatch.cu) ----
const Instance* instance_table(int* count);
const Threshold* threshold_table(int* count);         // the default table (every card)
const CardThresholds* card_threshold_tables(int* count);

// ---- hand-written (csrc/dispatch.cpp) ----
int vector_elems(DType dtype);  // elements per 16-byte access
const char* dtype_name(DType dtype);
const char* algo_name(Algo algo);
const char* out_name(OutKind out);
// The instance that serves this combination at `tokens` tokens: the specialised one (of a token
// split, the twin with the smallest max_tokens >= tokens, else its sibling; tokens < 0: the
// sibling, which serves every token count), else the generic one, else nullptr with *why set to
// one sentence naming the combination and the rule it breaks.
const Instance* find_instance(DType dtype, int hidden, int world_size, Algo algo, OutKind out,
                              int64_t tokens, std::string* why);
// The per-card table of the device named `card` (exact match), or nullptr: that card uses the
// default table.
const CardThresholds* card_thresholds(const std::string& card);
// One-shot for T <= this: the row of `card` (card_thresholds(), may be nullptr) if it has one,
// else the default table's row, else the default rule.
int oneshot_max_tokens(DType dtype, int hidden, int world_size, const CardThresholds* card);
// The default rule for unmeasured combinations (documented in docs/performance.md).
int default_oneshot_max_tokens(DType dtype, int hidden, int world_size);

}  // namespace arfuse
