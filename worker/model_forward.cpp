#include "worker/model_forward.h"

#include "common/error.h"
#include "worker/llama_forward.h"
#ifdef DUET_HAVE_CUDA
#include "kernels/cuda/device.h"
#include "worker/cuda_forward.h"
#endif

namespace duet {

int parse_device(std::string_view device) {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  constexpr std::string_view kPrefix = "cuda:";
  if (device.starts_with(kPrefix) && device.size() > kPrefix.size() && device.size() < 12) {
    int index = 0;
    for (char c : device.substr(kPrefix.size())) {
      if (c < '0' || c > '9') index = -1;
      if (index >= 0) index = index * 10 + (c - '0');
    }
    if (index >= 0) return index;
  }
  throw Error(ErrorKind::kInvalidArgument,
              format("--device must be cpu, cuda or cuda:N (N a GPU index), got '{}'", device));
}

void ModelForward::sample(std::span<const DeviceSampling>, std::span<int32_t>) {
  DUET_ASSERT(false, "this forward samples on the host");
}

void ModelForward::kv_to_host(int64_t, std::span<const int32_t>, int64_t, int64_t, KvCache&) {}

DeviceKv ModelForward::device_kv(const KvLayout&) { return {}; }

void ModelForward::kv_from_host(std::span<const int32_t>, int64_t, int64_t, const KvCache&) {}

void require_device(int device, const LlamaModel* model) {
  if (device < 0) return;
#ifdef DUET_HAVE_CUDA
  const std::vector<cuda::DeviceInfo> devices = cuda::list_devices();
  if (devices.empty()) {
    throw Error(ErrorKind::kUnsupported,
                format("--device cuda:{} asked for a GPU, but this machine has no CUDA device "
                       "(or no NVIDIA driver)",
                       device));
  }
  if (device >= static_cast<int>(devices.size())) {
    throw Error(ErrorKind::kUnsupported,
                format("--device cuda:{}: this machine has {} GPU(s), cuda:0..cuda:{}", device,
                       devices.size(), devices.size() - 1));
  }
  if (model != nullptr && !model->shard().whole()) {
    throw Error(ErrorKind::kUnsupported,
                "tensor parallelism runs on the CPU only for now (--tp with --device cuda)");
  }
#else
  (void)model;
  throw Error(ErrorKind::kUnsupported,
              format("--device cuda:{} asked for a GPU, but this build of duet has no CUDA "
                     "backend (nvcc was not found when it was built)",
                     device));
#endif
}

std::unique_ptr<ModelForward> make_forward(const LlamaModel& model, const cpu::KernelTable& kernels,
                                           cpu::ThreadPool& pool,
                                           const ForwardPlacement& placement) {
  require_device(placement.device, &model);
  if (placement.device < 0) {
    return std::make_unique<LlamaForward>(model, kernels, pool, placement.attention_order,
                                          placement.collective);
  }
#ifdef DUET_HAVE_CUDA
  return std::make_unique<CudaForward>(model, placement.device);
#else
  DUET_ASSERT(false, "require_device refuses a GPU in a build without CUDA");
#endif
}

}  // namespace duet
