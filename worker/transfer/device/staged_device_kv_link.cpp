#include "worker/transfer/device/staged_device_kv_link.h"

#include <cuda_runtime.h>

#include <utility>

#include "common/error.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/kv_rows.h"

namespace duet {
namespace {

void bind(int device) { DUET_CUDA_CHECK(cudaSetDevice(device)); }

}  // namespace

StagedDeviceKvLink::StagedDeviceKvLink(const char* kind, int device, bool sends, bool receives,
                                       Options options)
    : device_(device), options_(options), kind_(kind) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    throw Error(ErrorKind::kUnsupported,
                format("{} KV transfers: no CUDA device {} on this machine", kind, device));
  }
  bind(device_);
  if (sends) {
    send_staging_ = std::make_unique<DeviceStaging>(options_.send_staging_bytes);
    send_tables_ = std::make_unique<TableStaging>(options_.table_entries);
  }
  if (receives) {
    receive_staging_ = std::make_unique<DeviceStaging>(options_.receive_staging_bytes);
    receive_tables_ = std::make_unique<TableStaging>(options_.table_entries);
  }
}

// ---------------------------------------------------------------- sending (engine thread)

std::optional<DeviceRowsTicket> StagedDeviceKvLink::send(int peer, const KvLayout& layout,
                                                         const DeviceKv& kv, int64_t layer,
                                                         std::span<const int32_t> block_table,
                                                         int64_t pos0, int64_t n, KvHeads heads) {
  DUET_ASSERT(send_staging_ != nullptr && kv.valid() && kv.device == device_,
              "{} send from device {} through a transfer of device {}", kind_, kv.device, device_);
  const size_t bytes = payload_bytes(layout, n, heads);
  if (bytes == 0 || bytes > send_staging_->capacity()) return std::nullopt;
  size_t offset = 0;
  {
    std::unique_lock lock(send_mutex_);
    if (!sends_to(peer)) return std::nullopt;
    std::optional<size_t> room;
    const bool got = send_room_.wait_for(lock, options_.patience, [&] {
      if (!sends_to(peer)) return true;  // the connection broke while this thread waited
      room = send_staging_->acquire(bytes);
      return room.has_value();
    });
    if (!got || !room) {
      if (room) send_staging_->release(*room);
      return std::nullopt;
    }
    offset = *room;
  }
  // Packed (and waited for) before the subclass takes the payload on.
  try {
    bind(device_);
    pack_into_staging(*send_staging_, offset, *send_tables_, layout, kv, layer, block_table, pos0,
                      n, heads, [&] { after_pack(kv.stream); });
  } catch (...) {
    release_send_staging(offset);
    throw;
  }
  if (!queue_send(peer, offset, bytes)) return std::nullopt;
  return DeviceRowsTicket{offset, bytes};
}

void StagedDeviceKvLink::released(int peer, const DeviceRowsTicket& ticket) {
  DUET_ASSERT(send_staging_ != nullptr, "rank {} released staging this rank never sent", peer);
  release_send_staging(ticket.offset);
}

void StagedDeviceKvLink::release_send_staging(size_t offset) {
  {
    std::lock_guard lock(send_mutex_);
    send_staging_->release(offset);
  }
  send_room_.notify_all();
}

// ---------------------------------------------------------------- receiving (communication thread)

uint64_t StagedDeviceKvLink::receive(int peer, const DeviceRowsTicket& ticket,
                                     const KvLayout& layout, const DeviceKv* kv,
                                     std::span<const int32_t> block_table, int64_t layer,
                                     int64_t pos0, int64_t n, KvHeads heads) {
  DUET_ASSERT(kv == nullptr || kv->device == device_,
              "rows for device {} through a transfer of device {}", kv->device, device_);
  const Payload payload{peer, ticket, layout, kv, block_table, layer, pos0, n, heads};
  check(payload);
  const uint64_t id = next_receipt_++;
  queue_receipt(id, payload);
  return id;
}

StagedDeviceKvLink::RowsDestination StagedDeviceKvLink::destination(const Payload& payload) {
  RowsDestination rows;
  rows.layout = payload.layout;
  rows.layer = payload.layer;
  rows.n = payload.n;
  rows.heads = payload.heads;
  if (payload.kv != nullptr) {
    rows.kv = *payload.kv;
    const CoveringBlocks covering =
        covering_blocks(payload.block_table, payload.layout.block_size, payload.pos0, payload.n);
    rows.block_table.assign(covering.table.begin(), covering.table.end());
    rows.pos0 = covering.pos0;
  }
  return rows;
}

void StagedDeviceKvLink::unpack(const RowsDestination& rows, const int32_t* table,
                                size_t staging_offset, void* stream) const {
  cuda::unpack_kv_rows(rows.layout, rows.kv.data, rows.layer, table, rows.pos0, rows.n,
                       rows.heads.first, rows.heads.count, receive_staging_->at(staging_offset),
                       stream);
}

std::vector<std::string> StagedDeviceKvLink::take_notes() { return std::exchange(notes_, {}); }

}  // namespace duet
