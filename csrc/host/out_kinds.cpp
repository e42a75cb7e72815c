// arfuse host code: lookups over the generated output-kind traits (out_kinds.h).
#include "host/out_kinds.h"

#include "host/errors.h"

namespace arfuse::host {

namespace {

bool dynamic(const OutKindTraits& t) {
  return t.scales == Scales::kPerToken || t.scales == Scales::kPerGroup;
}

}  // namespace

const OutKindTraits* find_out_kind(int64_t value) {
  int count = 0;
  const OutKindTraits* table = out_kind_table(&count);
  return value >= 0 && value < count ? &table[value] : nullptr;
}

const OutKindTraits& traits(OutKind kind) {
  const OutKindTraits* t = find_out_kind(static_cast<int64_t>(kind));
  ARFUSE_CHECK(t != nullptr, "output kind ", static_cast<int>(kind), " is not in the generated table");
  return *t;
}

const OutKindTraits* kind_with(Scales scales) {
  int count = 0;
  const OutKindTraits* table = out_kind_table(&count);
  for (int i = 0; i < count; ++i) {
    if (table[i].scales == scales) return &table[i];
  }
  return nullptr;
}

const OutKindTraits* dynamic_kind(int64_t group_size) {
  int count = 0;
  const OutKindTraits* table = out_kind_table(&count);
  for (int i = 0; i < count; ++i) {
    if (dynamic(table[i]) && table[i].group == group_size) return &table[i];
  }
  return nullptr;
}

ScalarType out_dtype(const OutKindTraits& t, ScalarType act) { return t.act_dtype ? act : t.dtype; }

std::string scale_text(const OutKindTraits& t) {
  if (t.scales == Scales::kPerGroup) {
    return "one scale per group of " + std::to_string(t.group) + " elements";
  }
  return t.scales == Scales::kPerToken ? "one scale per token" : "one scale per tensor";
}

std::string out_kind_list() {
  int count = 0;
  const OutKindTraits* table = out_kind_table(&count);
  std::string s;
  for (int i = 0; i < count; ++i) {
    s += (i ? ", " : "") + std::to_string(i) + " (" + table[i].name + ")";
  }
  return s;
}

}  // namespace arfuse::host
