// arfuse host code: the output kinds' traits, one row per kind, generated from gen/tables.go
// (OutKind) into out/out_kinds.cpp. Validation (validate.cpp), allocation (ops.cpp) and the
// dispatch messages loop over these rows instead of branching per kind: a kind whose arguments
// fit the existing ops (fused: an input scale or none; fused_fp8_dynamic: per-token or per-group
// scales chosen by group_size) needs no host code of its own.
#pragma once

#include <cstdint>
#include <string>

#include <torch/headeronly/core/ScalarType.h>

#include "arfuse/params.h"

namespace arfuse::host {

using torch::headeronly::ScalarType;

// How an output kind's scale arrives or is written: enum class Scales (kNone, kInput, kPerToken,
// kPerGroup), generated from gen/tables.go scaleRules into csrc/arfuse/vocab.h.

struct OutKindTraits {
  OutKind kind;
  const char* name;
  bool act_dtype;    // norm_out in the activation dtype; else in dtype
  ScalarType dtype;
  Scales scales;
  int32_t group;     // elements per scale (kPerGroup), else 0: fused_fp8_dynamic's group_size
  bool bounded;      // takes scale_ub, an upper bound of amax
  bool layouts;      // takes col_major_scales and ue8m0
};

// ---- generated (out/out_kinds.cpp): every kind, in arfuse::OutKind order ----
const OutKindTraits* out_kind_table(int* count);

// ---- hand-written (csrc/host/out_kinds.cpp) ----
// The row of an arfuse::OutKind value, or nullptr when value is none.
const OutKindTraits* find_out_kind(int64_t value);
const OutKindTraits& traits(OutKind kind);
// The first row with these scales (every Scales value but kPerGroup has at most one), or nullptr.
const OutKindTraits* kind_with(Scales scales);
// The kind fused_fp8_dynamic serves for group_size: the kernel-written scales (per token or per
// group) whose group is group_size; nullptr when none.
const OutKindTraits* dynamic_kind(int64_t group_size);
// The dtype of norm_out for activation dtype act.
ScalarType out_dtype(const OutKindTraits& t, ScalarType act);
// What one scale of a dynamic kind covers, for messages: "one scale per token", "one scale per
// group of 128 elements".
std::string scale_text(const OutKindTraits& t);
// Every kind as "0 (norm), 1 (fp8_static), ...", for messages.
std::string out_kind_list();

}  // namespace arfuse::host
