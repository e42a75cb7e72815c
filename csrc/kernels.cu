// arfuse: variant-independent kernels and launch helpers (hand-written).
#include <mutex>
#include <vector>

#include "arfuse/host_kernels.h"
#include "arfuse/kernel.cuh"

namespace arfuse {

namespace detail {

// How many blocks of `kernel` (with `block_threads` threads, in clusters of `cluster`) one GPU
// holds at once. Cached per (device, kernel, block, cluster): the occupancy query is host work.
cudaError_t co_resident_blocks(const void* kernel, int block_threads, int cluster, int* per_device) {
  struct Entry {
    int device;
    const void* kernel;
    int block, cluster, blocks;
  };
  static std::mutex mu;
  static std::vector<Entry> cache;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const Entry& e : cache) {
      if (e.device == device && e.kernel == kernel && e.block == block_threads &&
          e.cluster == cluster) {
        *per_device = e.blocks;
        return cudaSuccess;
      }
    }
  }
  int sms = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  int blocks = 0;
  if (cluster <= 1) {
    int per_sm = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block_threads, 0);
    if (err != cudaSuccess) return err;
    blocks = per_sm * sms;
  } else {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(cluster * sms);
    config.blockDim = dim3(block_threads);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    int clusters = 0;
    err = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
    if (err != cudaSuccess) return err;
    blocks = clusters * cluster;
  }
  std::lock_guard<std::mutex> lock(mu);
  cache.push_back(Entry{device, kernel, block_threads, cluster, blocks});
  *per_device = blocks;
  return cudaSuccess;
}

}  // namespace detail

namespace {

__global__ void fill_kernel(uint4* buffer, int64_t nvecs, uint32_t word) {
  const uint4 v = make_uint4(word, word, word, word);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nvecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    buffer[i] = v;
  }
}

template <typename T>
__global__ void finalize_kernel(const __grid_constant__ LaunchParams p) {
  constexpr int kVec = Elem<T>::kVec;
  const int nvec = p.hidden / kVec;
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      const int64_t elem = static_cast<int64_t>(v) * kVec;
      float acc[kVec];
      finalize_vec<T>(p, t, elem, acc);
      st_vec(static_cast<T*>(p.norm_out) + t * p.hidden + elem, pack<T>(acc));
    }
  }
}

}  // namespace

cudaError_t fill_sentinel(void* buffer, int64_t elems, DType dtype, cudaStream_t stream) {
  const int64_t nvecs = elems * dtype_bytes(dtype) / kVectorBytes;
  const uint32_t word = dtype == DType::kFP32 ? sentinel_word<float>() : sentinel_word<__half>();
  const int64_t want = (nvecs + 255) / 256;
  const int grid = static_cast<int>(want < 4096 ? (want > 0 ? want : 1) : 4096);
  fill_kernel<<<grid, 256, 0, stream>>>(static_cast<uint4*>(buffer), nvecs, word);
  return cudaGetLastError();
}

cudaError_t launch_finalize(const LaunchParams& p, DType dtype, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int vec = dtype_vec(dtype);
  const int nvec = p.hidden / vec;
  int block = ((nvec + 31) / 32) * 32;
  if (block > 512) block = 512;
  const int grid = p.num_tokens < 65535 ? p.num_tokens : 65535;
  switch (dtype) {
    case DType::kBF16:
      finalize_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(p);
      break;
    case DType::kFP16:
      finalize_kernel<__half><<<grid, block, 0, stream>>>(p);
      break;
    case DType::kFP32:
      finalize_kernel<float><<<grid, block, 0, stream>>>(p);
      break;
  }
  return cudaGetLastError();
}

}  // namespace arfuse
