// arfuse host code: the current CUDA device and stream, through the PyTorch stable ABI.
#pragma once

#include <optional>

#include <cuda_runtime_api.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include "host/errors.h"

namespace arfuse::host {

// Makes `index` the current device for the scope (torch's device guard, stable ABI); a CPU
// communicator's -1 changes nothing.
class DeviceScope {
 public:
  explicit DeviceScope(int index) {
    if (index >= 0) guard_.emplace(index);
  }

 private:
  std::optional<torch::stable::accelerator::DeviceGuard> guard_;
};

// torch's current stream on that device (what torch.cuda.current_stream() returns).
inline cudaStream_t current_stream(int index) {
  void* stream = nullptr;
  ARFUSE_CHECK(aoti_torch_get_current_cuda_stream(index, &stream) == AOTI_TORCH_SUCCESS,
               "reading torch's current CUDA stream of device ", index, " failed");
  return static_cast<cudaStream_t>(stream);
}

inline int current_device() {
  return static_cast<int>(torch::stable::accelerator::getCurrentDeviceIndex());
}

}  // namespace arfuse::host
