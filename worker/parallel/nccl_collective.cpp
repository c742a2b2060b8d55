#include "worker/parallel/nccl_collective.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "kernels/cuda/check.h"

namespace duet {
static_assert(sizeof(ncclUniqueId) == NcclCollective::kUniqueIdBytes);

namespace {

ncclComm_t as_comm(void* comm) { return static_cast<ncclComm_t>(comm); }
cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Throws kUnsupported unless CUDA device `device` exists.
void require_device(int device) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    throw Error(ErrorKind::kUnsupported,
                format("NCCL collective on cuda:{}, but this machine has no GPU ({})", device,
                       status != cudaSuccess ? cudaGetErrorString(status) : "0 CUDA devices"));
  }
  if (device < 0 || device >= count) {
    throw Error(ErrorKind::kUnsupported,
                format("NCCL collective on cuda:{}: this machine has {} CUDA device(s), 0..{}",
                       device, count, count - 1));
  }
}

}  // namespace

std::vector<std::byte> NcclCollective::unique_id() {
  ncclUniqueId id;
  DUET_NCCL_CHECK(ncclGetUniqueId(&id));
  std::vector<std::byte> bytes(sizeof(id.internal));
  std::memcpy(bytes.data(), id.internal, bytes.size());
  return bytes;
}

NcclCollective::NcclCollective(int rank, int size, int device)
    : rank_(rank), size_(size), device_(device) {}

NcclCollective::NcclCollective(std::span<const std::byte> unique_id, int rank, int size, int device)
    : rank_(rank), size_(size), device_(device) {
  ncclUniqueId id;
  DUET_REQUIRE(unique_id.size() == sizeof(id.internal),
               "NCCL collective: a unique id has {} bytes, got {}", sizeof(id.internal),
               unique_id.size());
  DUET_REQUIRE(size >= 1 && rank >= 0 && rank < size, "NCCL collective: rank {} of {} ranks", rank,
               size);
  require_device(device);
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  DUET_CUDA_CHECK(cudaSetDevice(device));
  ncclComm_t comm = nullptr;
  DUET_NCCL_CHECK(ncclCommInitRank(&comm, size, id, rank));
  comm_ = comm;
}

std::vector<std::unique_ptr<NcclCollective>> NcclCollective::on_devices(
    std::span<const int> devices) {
  DUET_REQUIRE(!devices.empty(), "NCCL collective: on_devices needs at least one device");
  for (size_t i = 0; i < devices.size(); ++i) {
    require_device(devices[i]);
    DUET_REQUIRE(std::find(devices.begin(), devices.begin() + static_cast<ptrdiff_t>(i),
                           devices[i]) == devices.begin() + static_cast<ptrdiff_t>(i),
                 "NCCL collective: cuda:{} is listed twice (NCCL refuses two ranks on one GPU)",
                 devices[i]);
  }
  const int n = static_cast<int>(devices.size());
  // The objects first, so that none of the communicators leaks should
  // making one throw.
  std::vector<std::unique_ptr<NcclCollective>> ranks;
  ranks.reserve(devices.size());
  for (int r = 0; r < n; ++r) {
    ranks.push_back(
        std::unique_ptr<NcclCollective>(new NcclCollective(r, n, devices[static_cast<size_t>(r)])));
  }
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  DUET_NCCL_CHECK(ncclCommInitAll(comms.data(), n, devices.data()));
  for (size_t r = 0; r < comms.size(); ++r) ranks[r]->comm_ = comms[r];
  return ranks;
}

NcclCollective::~NcclCollective() {
  // After abort() the communicator is gone already. A failure here cannot
  // be reported (NCCL has logged it, NCCL_DEBUG=WARN).
  if (comm_ != nullptr && !aborted_.load()) ncclCommDestroy(as_comm(comm_));
}

void NcclCollective::abort() {
  if (comm_ == nullptr || aborted_.exchange(true)) return;
  DUET_NCCL_CHECK(ncclCommAbort(as_comm(comm_)));
}

void* NcclCollective::usable_comm() const {
  DUET_REQUIRE(!aborted_.load(std::memory_order_relaxed),
               "NCCL collective: rank {} of {} was aborted", rank_, size_);
  DUET_ASSERT(comm_ != nullptr);
  return comm_;
}

void NcclCollective::all_reduce_sum(float* data, int64_t n, void* stream) {
  void* comm = usable_comm();
  DUET_REQUIRE(n >= 0, "NCCL collective: all_reduce_sum of {} floats", n);
  if (n == 0) return;
  DUET_REQUIRE(data != nullptr, "NCCL collective: all_reduce_sum of {} floats at null", n);
  DUET_NCCL_CHECK(ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat, ncclSum,
                                as_comm(comm), as_stream(stream)));
}

void NcclCollective::all_gather(const float* mine, float* all, int64_t n_per_rank, void* stream) {
  void* comm = usable_comm();
  DUET_REQUIRE(n_per_rank >= 0, "NCCL collective: all_gather of {} floats per rank", n_per_rank);
  if (n_per_rank == 0) return;
  DUET_REQUIRE(mine != nullptr && all != nullptr,
               "NCCL collective: all_gather of {} floats per rank with a null buffer", n_per_rank);
  DUET_NCCL_CHECK(ncclAllGather(mine, all, static_cast<size_t>(n_per_rank), ncclFloat,
                                as_comm(comm), as_stream(stream)));
}

void NcclCollective::broadcast(void* data, size_t bytes, int root, void* stream) {
  void* comm = usable_comm();
  DUET_REQUIRE(root >= 0 && root < size_, "NCCL collective: broadcast root {} of {} ranks", root,
               size_);
  if (bytes == 0) return;
  DUET_REQUIRE(data != nullptr, "NCCL collective: broadcast of {} bytes at null", bytes);
  DUET_NCCL_CHECK(
      ncclBroadcast(data, data, bytes, ncclChar, root, as_comm(comm), as_stream(stream)));
}

}  // namespace duet
