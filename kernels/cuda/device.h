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
  // "GPU-5e2a1c3d-0f4b-7a6e-9c8d-112233445566", as nvidia-smi writes it: the
  // same GPU has the same UUID in every process, whatever its index there.
  std::string uuid;
};

// The devices this process can use; empty, never an error, on a machine
// without a GPU or driver.
std::vector<DeviceInfo> list_devices();

// "CUDA runtime X.Y, cuBLAS X.Y.Z, NCCL X.Y.Z" of the linked libraries.
std::string library_versions();

}  // namespace duet::cuda
