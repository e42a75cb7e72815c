// arfuse host code: reading tensor arguments and allocating outputs (tensor_arg.h).
#include "host/tensor_arg.h"

#include <array>
#include <utility>

#include "host/errors.h"

namespace arfuse::host {

namespace {

// The shim's codes of the dtypes the ops read, looked up once.
struct Codes {
  std::array<std::pair<int32_t, ScalarType>, 6> dtypes;
  int32_t cuda, cpu;
  Codes()
      : dtypes{{{aoti_torch_dtype_bfloat16(), ScalarType::BFloat16},
                {aoti_torch_dtype_float16(), ScalarType::Half},
                {aoti_torch_dtype_float32(), ScalarType::Float},
                {aoti_torch_dtype_int32(), ScalarType::Int},
                {aoti_torch_dtype_uint8(), ScalarType::Byte},
                {aoti_torch_dtype_float8_e4m3fn(), ScalarType::Float8_e4m3fn}}},
        cuda(aoti_torch_device_type_cuda()),
        cpu(aoti_torch_device_type_cpu()) {}
};

const Codes& codes() {
  static const Codes c;
  return c;
}

#define ARFUSE_SHIM(call, what) \
  ARFUSE_CHECK((call) == AOTI_TORCH_SUCCESS, "reading ", what, " failed (torch C shim)")

}  // namespace

ScalarType dtype_of_code(int32_t code) {
  for (const auto& [c, t] : codes().dtypes) {
    if (c == code) return t;
  }
  return ScalarType::Undefined;
}

int32_t code_of_dtype(ScalarType t) {
  for (const auto& [c, d] : codes().dtypes) {
    if (d == t) return c;
  }
  ARFUSE_CHECK(false, "no shim code for dtype ", TypeName{t});
  return 0;
}

int64_t Arg::element_size() const {
  switch (dtype) {
    case ScalarType::Float:
    case ScalarType::Int:
      return 4;
    case ScalarType::BFloat16:
    case ScalarType::Half:
      return 2;
    default:
      return 1;
  }
}

bool overlap(const Arg& a, const Arg& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  return a.begin() < b.end() && b.begin() < a.end();
}

Arg read(const Tensor& t, const char* name) {
  Arg a;
  a.name = name;
  AtenTensorHandle h = t.get();
  ARFUSE_CHECK_VALUE(h != nullptr && t.defined(), name, ": a tensor is required, got None");
  int32_t dtype = 0, type = 0, index = -1;
  ARFUSE_SHIM(aoti_torch_get_dim(h, &a.dim), name);
  int64_t* sizes = nullptr;
  ARFUSE_SHIM(aoti_torch_get_sizes(h, &sizes), name);
  a.sizes = sizes;
  ARFUSE_SHIM(aoti_torch_get_dtype(h, &dtype), name);
  ARFUSE_SHIM(aoti_torch_get_device_type(h, &type), name);
  ARFUSE_SHIM(aoti_torch_get_device_index(h, &index), name);
  ARFUSE_SHIM(aoti_torch_is_contiguous(h, &a.contiguous), name);
  ARFUSE_SHIM(aoti_torch_get_data_ptr(h, &a.data), name);
  a.dtype = dtype_of_code(dtype);
  if (a.dtype == ScalarType::Undefined) a.dtype = t.scalar_type();  // for the error message
  a.cuda = type == codes().cuda;
  a.cpu = type == codes().cpu;
  a.device = a.cuda ? index : -1;
  return a;
}

Tensor empty_strided(std::initializer_list<int64_t> sizes, std::initializer_list<int64_t> strides,
                     ScalarType dtype, int device) {
  AtenTensorHandle h = nullptr;
  ARFUSE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.begin(),
                                        strides.begin(), code_of_dtype(dtype),
                                        device >= 0 ? codes().cuda : codes().cpu,
                                        device >= 0 ? device : 0, &h) == AOTI_TORCH_SUCCESS,
               "allocating an output of ", sizes.size(), " dims failed (out of memory?)");
  return Tensor(h);
}

Tensor empty(std::initializer_list<int64_t> sizes, ScalarType dtype, int device) {
  int64_t strides[8];
  const int64_t n = static_cast<int64_t>(sizes.size());
  int64_t s = 1;
  for (int64_t i = n - 1; i >= 0; --i) {
    strides[i] = s;
    s *= sizes.begin()[i];
  }
  AtenTensorHandle h = nullptr;
  ARFUSE_CHECK(aoti_torch_empty_strided(n, sizes.begin(), strides, code_of_dtype(dtype),
                                        device >= 0 ? codes().cuda : codes().cpu,
                                        device >= 0 ? device : 0, &h) == AOTI_TORCH_SUCCESS,
               "allocating an output of ", n, " dims failed (out of memory?)");
  return Tensor(h);
}

}  // namespace arfuse::host
