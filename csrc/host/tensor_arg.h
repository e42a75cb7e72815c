// arfuse host code: what the ops read of a tensor argument, read once through torch's C shims.
//
// Validation looks at every tensor's rank, sizes, dtype, device, contiguity and address. Read
// through torch::stable::Tensor's accessors, each dtype or device query converts torch's code
// by calling one shim function per known value; an op call makes dozens of such queries. Here
// each tensor is read once (a handful of shim calls) and the codes are compared against values
// cached on first use. Outputs are allocated with the shim's empty_strided (torch's caching
// allocator), not torch::stable::empty, which looks aten::empty up in the dispatcher by name
// on every call.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

namespace arfuse::host {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// One tensor argument. sizes points into the tensor's own metadata: valid while it lives (for
// the whole op call).
struct Arg {
  const char* name = "";
  int64_t dim = 0;
  const int64_t* sizes = nullptr;
  ScalarType dtype = ScalarType::Undefined;
  bool cuda = false, cpu = false;
  int device = -1;  // CUDA device index, -1 elsewhere
  bool contiguous = false;
  void* data = nullptr;

  int64_t size(int64_t i) const { return sizes[i]; }
  int64_t element_size() const;
  // The bytes [begin, end) the (contiguous) tensor covers.
  uintptr_t begin() const { return reinterpret_cast<uintptr_t>(data); }
  uintptr_t end() const { return begin() + static_cast<uintptr_t>(numel() * element_size()); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t i = 0; i < dim; ++i) n *= sizes[i];
    return n;
  }
};

// Raises ValueError naming the argument when t is undefined (None passed for a required tensor).
Arg read(const Tensor& t, const char* name);
// Whether two arguments share memory (contiguous tensors: their byte ranges intersect).
bool overlap(const Arg& a, const Arg& b);
// The dtype of a shim code, or Undefined for one arfuse never accepts.
ScalarType dtype_of_code(int32_t code);
int32_t code_of_dtype(ScalarType t);

// A new contiguous [sizes] tensor of dtype on `like`'s device (CUDA device `device`, or the CPU
// for device -1), from torch's caching allocator.
Tensor empty(std::initializer_list<int64_t> sizes, ScalarType dtype, int device);
// The same with explicit strides.
Tensor empty_strided(std::initializer_list<int64_t> sizes, std::initializer_list<int64_t> strides,
                     ScalarType dtype, int device);

// Printable forms for error messages.
struct SizesOf {
  const Arg& a;
};
inline std::ostream& operator<<(std::ostream& os, const SizesOf& s) {
  os << '[';
  for (int64_t i = 0; i < s.a.dim; ++i) os << (i ? ", " : "") << s.a.sizes[i];
  return os << ']';
}
struct DeviceOf {
  const Arg& a;
};
inline std::ostream& operator<<(std::ostream& os, const DeviceOf& d) {
  if (d.a.cuda) return os << "cuda:" << d.a.device;
  if (d.a.cpu) return os << "cpu";
  return os << "a device that is neither CPU nor CUDA";
}

}  // namespace arfuse::host
