// CUDA devices and library versions. Only kernels/cuda/ includes CUDA
// headers; this interface is plain C++.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace duet::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  size_t memory_bytes = 0;
  int compute_major = 0;
  int compute_minor = 0;
};

// The devices this process can use; empty, never an error, on a machine
// without a GPU or driver.
std::vector<DeviceInfo> list_devices();

// "CUDA runtime X.Y, cuBLAS X.Y.Z, NCCL X.Y.Z" of the linked libraries.
std::string library_versions();

}  // namespace duet::cuda
