// Test-only kernels of tests/test_gpu_pdl.py (compiled there with nvcc, loaded with ctypes): an
// upstream kernel that lets its programmatic dependents start at once and writes its output late,
// and a consumer that does NOT wait for it (the control that shows the producer's early start is
// real, so that a fused kernel reading stale data would be seen).
#include <cstdint>

#include <cuda_runtime.h>

namespace {

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Triggers its dependents first (griddepcontrol.launch_dependents: a dependent grid may start as
// soon as every block of this one has run it), then spins for spin_ns and only then copies src
// to dst: a dependent that reads dst before waiting reads what dst held before.
__global__ void produce(const uint4* src, uint4* dst, int64_t n, int64_t spin_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const uint64_t t0 = now_ns();
  while (now_ns() - t0 < static_cast<uint64_t>(spin_ns)) {
  }
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

// The control: copies src to dst with no griddepcontrol.wait.
__global__ void consume_without_wait(const uint4* src, uint4* dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

}  // namespace

extern "C" int produce_launch(const void* src, void* dst, int64_t bytes, int64_t spin_ns,
                              void* stream) {
  produce<<<8, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint4*>(src), static_cast<uint4*>(dst), bytes / 16, spin_ns);
  return static_cast<int>(cudaGetLastError());
}

// Launched as a programmatic dependent of the kernel before it on the stream.
extern "C" int consume_launch_pdl(const void* src, void* dst, int64_t bytes, void* stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(8);
  config.blockDim = dim3(256);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return static_cast<int>(cudaLaunchKernelEx(&config, consume_without_wait,
                                             static_cast<const uint4*>(src),
                                             static_cast<uint4*>(dst), bytes / 16));
}
