#include "kernels/cuda/check.h"
#include "kernels/cuda/device.h"

namespace duet::cuda {

std::vector<DeviceInfo> list_devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    return {};
  }
  std::vector<DeviceInfo> devices;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    std::string uuid = "GPU-";
    constexpr char kHex[] = "0123456789abcdef";
    for (int b = 0; b < 16; ++b) {
      if (b == 4 || b == 6 || b == 8 || b == 10) uuid += '-';
      const auto byte = static_cast<unsigned char>(prop.uuid.bytes[b]);
      uuid += kHex[byte >> 4];
      uuid += kHex[byte & 0xf];
    }
    devices.push_back({i, prop.name, prop.totalGlobalMem, prop.major, prop.minor, uuid});
  }
  return devices;
}

std::string library_versions() {
  int runtime = 0;
  DUET_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  int cublas_major = 0, cublas_minor = 0, cublas_patch = 0;
  DUET_CUBLAS_CHECK(cublasGetProperty(MAJOR_VERSION, &cublas_major));
  DUET_CUBLAS_CHECK(cublasGetProperty(MINOR_VERSION, &cublas_minor));
  DUET_CUBLAS_CHECK(cublasGetProperty(PATCH_LEVEL, &cublas_patch));
  int nccl = 0;
  DUET_NCCL_CHECK(ncclGetVersion(&nccl));
  return format("CUDA runtime {}.{}, cuBLAS {}.{}.{}, NCCL {}.{}.{}", runtime / 1000,
                runtime % 1000 / 10, cublas_major, cublas_minor, cublas_patch, nccl / 10000,
                nccl % 10000 / 100, nccl % 100);
}

}  // namespace duet::cuda
