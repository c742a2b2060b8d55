// Host vectors to and from the device, for the GPU checks.
#pragma once

#include <vector>

#include "kernels/cuda/backend.h"

namespace duet::gpu_check {

template <typename T>
cuda::DeviceBuffer to_device(const std::vector<T>& host, cuda::CudaBackend& backend) {
  cuda::DeviceBuffer buffer(std::max<size_t>(1, host.size() * sizeof(T)));
  backend.upload(buffer.data(), host.data(), host.size() * sizeof(T));
  backend.synchronize();
  return buffer;
}

template <typename T>
std::vector<T> to_host(const cuda::DeviceBuffer& buffer, size_t n, cuda::CudaBackend& backend) {
  std::vector<T> host(n);
  backend.download(host.data(), buffer.data(), n * sizeof(T));
  backend.synchronize();
  return host;
}

}  // namespace duet::gpu_check
