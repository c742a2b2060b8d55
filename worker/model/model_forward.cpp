#include "worker/model/model_forward.h"

#include <algorithm>
#include <string>

#include "common/error.h"
#include "worker/model/cpu_forward.h"
#ifdef DUET_HAVE_CUDA
#include "kernels/cuda/device.h"
#include "worker/model/cuda_forward.h"
#include "worker/parallel/nccl_collective.h"
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

void require_device(int device) {
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
#else
  throw Error(ErrorKind::kUnsupported,
              format("--device cuda:{} asked for a GPU, but this build of duet has no CUDA "
                     "backend (nvcc was not found when it was built)",
                     device));
#endif
}

std::unique_ptr<DeviceCollective> join_device_collective(Collective& instance, int device) {
  if (device < 0 || instance.size() < 2) return nullptr;
  require_device(device);
#ifdef DUET_HAVE_CUDA
  // The leader's id, after a byte saying whether it has one: a leader that
  // fails here still broadcasts, so that no follower waits for it.
  std::vector<std::byte> message(1 + NcclCollective::kUniqueIdBytes);
  std::string failure;
  if (instance.rank() == 0) {
    try {
      const std::vector<std::byte> id = NcclCollective::unique_id();
      message[0] = std::byte{1};
      std::copy(id.begin(), id.end(), message.begin() + 1);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  instance.broadcast(message, 0);
  if (message[0] != std::byte{1}) {
    throw Error(ErrorKind::kInternal,
                failure.empty() ? "the instance's leader could not make an NCCL id (see its log)"
                                : failure);
  }
  return std::make_unique<NcclCollective>(std::span(message).subspan(1), instance.rank(),
                                          instance.size(), device);
#else
  DUET_ASSERT(false, "require_device refuses a GPU in a build without CUDA");
#endif
}

std::unique_ptr<ModelForward> make_forward(const LlamaModel& model, const cpu::KernelTable& kernels,
                                           cpu::ThreadPool& pool,
                                           const ForwardPlacement& placement) {
  require_device(placement.device);
  if (placement.device < 0) {
    return std::make_unique<CpuForward>(model, kernels, pool, placement.collective);
  }
#ifdef DUET_HAVE_CUDA
  if (!model.shard().whole() && placement.device_collective == nullptr) {
    throw Error(ErrorKind::kUnsupported,
                "a tensor-parallel shard on a GPU needs its instance's NCCL communicator "
                "(join_device_collective)");
  }
  return std::make_unique<CudaForward>(model, placement.device, placement.device_collective);
#else
  DUET_ASSERT(false, "require_device refuses a GPU in a build without CUDA");
#endif
}

}  // namespace duet
