// arfuse host code: how a bad argument becomes one error.
//
// The PyTorch stable ABI turns every C++ exception a kernel throws into a Python RuntimeError
// (std::invalid_argument's mapping to ValueError holds on torch 2.11 and 2.14 but not on 2.15,
// and no typed error exists for TypeError). So the kind of error travels in the message: every
// check below throws std::runtime_error("<Kind>: arfuse: <argument>: <rule>"), Kind one of
// ValueError, TypeError, RuntimeError. The public Python API (arfuse/_lib.py: raise_as_typed)
// re-raises the first two as ValueError / TypeError with the text after the kind; a direct
// torch.ops.arfuse.* call shows RuntimeError("ValueError: arfuse: ..."). docs/design.md, "Errors".
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

namespace arfuse::host {

enum class ErrorKind { kValue, kType, kRuntime };

[[noreturn]] inline void raise(ErrorKind kind, const std::string& message) {
  const char* prefix = kind == ErrorKind::kValue  ? "ValueError: "
                       : kind == ErrorKind::kType ? "TypeError: "
                                                  : "RuntimeError: ";
  throw std::runtime_error(prefix + message);
}

// Printable forms of what error messages name.
struct Sizes {
  const torch::stable::Tensor& t;
};
inline std::ostream& operator<<(std::ostream& os, const Sizes& s) {
  os << '[';
  const int64_t dim = s.t.dim();
  for (int64_t i = 0; i < dim; ++i) os << (i ? ", " : "") << s.t.size(i);
  return os << ']';
}
struct DeviceName {
  torch::stable::Device d;
};
inline std::ostream& operator<<(std::ostream& os, const DeviceName& n) {
  if (n.d.is_cuda()) return os << "cuda:" << static_cast<int>(n.d.index());
  if (n.d.is_cpu()) return os << "cpu";
  return os << "device type " << static_cast<int>(n.d.type());
}
struct TypeName {
  torch::headeronly::ScalarType t;
};
inline std::ostream& operator<<(std::ostream& os, const TypeName& n) {
  return os << torch::headeronly::toString(n.t);
}

template <class... A>
std::string cat(const A&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return s.str();
}

}  // namespace arfuse::host

// ARFUSE_CHECK_VALUE(cond, "expert_out: must be contiguous"): the message parts after the
// condition are streamed after "arfuse: ".
#define ARFUSE_CHECK_KIND(kind, cond, ...)                                       \
  do {                                                                           \
    if (!(cond)) ::arfuse::host::raise(kind, ::arfuse::host::cat("arfuse: ", __VA_ARGS__)); \
  } while (0)
#define ARFUSE_CHECK_VALUE(cond, ...) \
  ARFUSE_CHECK_KIND(::arfuse::host::ErrorKind::kValue, cond, __VA_ARGS__)
#define ARFUSE_CHECK_TYPE(cond, ...) \
  ARFUSE_CHECK_KIND(::arfuse::host::ErrorKind::kType, cond, __VA_ARGS__)
#define ARFUSE_CHECK(cond, ...) \
  ARFUSE_CHECK_KIND(::arfuse::host::ErrorKind::kRuntime, cond, __VA_ARGS__)
// A CUDA runtime call that must succeed; `what` names the step.
#define ARFUSE_CUDA_CHECK(expr, what)                                                  \
  do {                                                                                 \
    const cudaError_t err_ = (expr);                                                   \
    ARFUSE_CHECK(err_ == cudaSuccess, what, " failed: ", cudaGetErrorString(err_));    \
  } while (0)
