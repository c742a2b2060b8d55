#include "worker/transfer/transfer_kind.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <set>

#include "common/error.h"
#include "common/format.h"

namespace duet {
namespace {

// The record: magic, device, host (NUL-terminated), UUID (NUL-terminated).
constexpr uint32_t kPlacementMagic = 0x314c'5044;  // "DPL1"
constexpr size_t kHostOffset = 8;
constexpr size_t kHostBytes = 64;
constexpr size_t kUuidOffset = kHostOffset + kHostBytes;
constexpr size_t kUuidBytes = kPlacementRecordBytes - kUuidOffset;

void put_string(PlacementRecord& record, size_t offset, size_t size, const std::string& value,
                const char* what) {
  DUET_REQUIRE(value.size() < size && value.find('\0') == std::string::npos,
               "rank placement: a {} of {} bytes does not fit in {}", what, value.size(), size - 1);
  std::memcpy(record.data() + offset, value.data(), value.size());
}

std::string get_string(std::span<const std::byte> record, size_t offset, size_t size,
                       const char* what) {
  const char* begin = reinterpret_cast<const char*>(record.data() + offset);
  const char* end = std::find(begin, begin + size, '\0');
  DUET_REQUIRE(end != begin + size, "rank placement: the {} is not terminated", what);
  return {begin, end};
}

}  // namespace

std::string_view transfer_kind_name(TransferKind kind) {
  switch (kind) {
    case TransferKind::kMpi:
      return "mpi";
    case TransferKind::kMpiStaged:
      return "mpi-staged";
    case TransferKind::kCudaIpc:
      return "cuda-ipc";
    case TransferKind::kNccl:
      return "nccl";
  }
  return "?";
}

SameHostGpus parse_same_host_gpus(std::string_view name) {
  if (name == "ipc") return SameHostGpus::kCudaIpc;
  if (name == "nccl") return SameHostGpus::kNccl;
  throw Error(ErrorKind::kInvalidArgument,
              format("--kv-same-host must be ipc or nccl, got '{}'", name));
}

bool same_gpu(const RankPlacement& a, const RankPlacement& b) {
  if (!a.on_gpu() || !b.on_gpu() || a.host != b.host) return false;
  // UUIDs decide when both sides know theirs; else the device index does.
  return !a.gpu_uuid.empty() && !b.gpu_uuid.empty() ? a.gpu_uuid == b.gpu_uuid
                                                    : a.device == b.device;
}

void require_gpu_per_rank(const InstanceSpec& instance, std::span<const RankPlacement> placements) {
  const std::vector<Rank>& ranks = instance.ranks;
  for (Rank r : ranks) {
    DUET_REQUIRE(r.value >= 0 && r.value < static_cast<int>(placements.size()),
                 "no placement for rank {}", r.value);
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    for (size_t j = i + 1; j < ranks.size(); ++j) {
      const RankPlacement& a = placements[static_cast<size_t>(ranks[i].value)];
      const RankPlacement& b = placements[static_cast<size_t>(ranks[j].value)];
      if (!same_gpu(a, b)) continue;
      throw Error(ErrorKind::kUnsupported,
                  format("instance {}: ranks {} and {} (tensor-parallel ranks {} and {}) would "
                         "share one GPU, {}; its collectives run on NCCL, which needs one GPU per "
                         "rank: give the instance as many GPUs as --tp, or run it on the CPU",
                         instance.id, ranks[i].value, ranks[j].value, i, j, describe_placement(a)));
    }
  }
}

TransferKind select_transfer_kind(const RankPlacement& prefill, const RankPlacement& decode,
                                  SameHostGpus same_host) {
  if (!prefill.on_gpu() && !decode.on_gpu()) return TransferKind::kMpi;
  if (!prefill.on_gpu() || !decode.on_gpu()) return TransferKind::kMpiStaged;
  if (prefill.host != decode.host) return TransferKind::kNccl;
  if (same_gpu(prefill, decode))
    return TransferKind::kCudaIpc;  // NCCL refuses two ranks on one GPU
  return same_host == SameHostGpus::kNccl ? TransferKind::kNccl : TransferKind::kCudaIpc;
}

std::vector<std::pair<Rank, Rank>> nccl_pairs(const ClusterSpec& spec,
                                              std::span<const RankPlacement> placements,
                                              SameHostGpus same_host) {
  std::set<std::pair<Rank, Rank>> pairs;
  if (spec.mode != ClusterMode::kDisaggregated) return {};
  const auto placement = [&](Rank rank) -> const RankPlacement& {
    DUET_REQUIRE(rank.value >= 0 && static_cast<size_t>(rank.value) < placements.size(),
                 "rank placement: rank {} of a world of {}", rank.value, placements.size());
    return placements[static_cast<size_t>(rank.value)];
  };
  for (const InstanceSpec& prefill : spec.instances) {
    if (prefill.role != InstanceRole::kPrefill) continue;
    for (const InstanceSpec& decode : spec.instances) {
      if (decode.role != InstanceRole::kDecode) continue;
      for (Rank p : prefill.ranks) {
        for (Rank d : decode.ranks) {
          if (select_transfer_kind(placement(p), placement(d), same_host) == TransferKind::kNccl)
            pairs.insert({std::min(p, d), std::max(p, d)});
        }
      }
    }
  }
  return {pairs.begin(), pairs.end()};
}

PlacementRecord encode_placement(const RankPlacement& placement) {
  PlacementRecord record{};
  const auto device = static_cast<int32_t>(placement.device);
  std::memcpy(record.data(), &kPlacementMagic, sizeof kPlacementMagic);
  std::memcpy(record.data() + 4, &device, sizeof device);
  put_string(record, kHostOffset, kHostBytes, placement.host, "host name");
  put_string(record, kUuidOffset, kUuidBytes, placement.gpu_uuid, "GPU UUID");
  return record;
}

RankPlacement decode_placement(std::span<const std::byte> record) {
  DUET_REQUIRE(record.size() == kPlacementRecordBytes,
               "rank placement: a record of {} bytes, not {}", record.size(),
               kPlacementRecordBytes);
  uint32_t magic = 0;
  int32_t device = 0;
  std::memcpy(&magic, record.data(), sizeof magic);
  std::memcpy(&device, record.data() + 4, sizeof device);
  DUET_REQUIRE(magic == kPlacementMagic, "rank placement: not a placement record");
  DUET_REQUIRE(device >= -1, "rank placement: device {}", device);
  RankPlacement placement;
  placement.device = device;
  placement.host = get_string(record, kHostOffset, kHostBytes, "host name");
  placement.gpu_uuid = get_string(record, kUuidOffset, kUuidBytes, "GPU UUID");
  DUET_REQUIRE(placement.on_gpu() || placement.gpu_uuid.empty(),
               "rank placement: a GPU UUID for a rank on the CPU");
  return placement;
}

std::string describe_placement(const RankPlacement& placement) {
  if (!placement.on_gpu()) return placement.host + " cpu";
  std::string text = format("{} cuda:{}", placement.host, placement.device);
  if (!placement.gpu_uuid.empty()) text += " (" + placement.gpu_uuid + ")";
  return text;
}

}  // namespace duet
