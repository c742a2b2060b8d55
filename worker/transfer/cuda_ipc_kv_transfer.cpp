#include "worker/transfer/cuda_ipc_kv_transfer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/error.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/kv_rows.h"

namespace duet {
namespace {

constexpr uint32_t kExportMagic = 0x3143'5049;  // "IPC1"

// exported(): magic, device, staging bytes, then the two IPC handles.
struct ExportRecord {
  uint32_t magic = kExportMagic;
  int32_t device = 0;
  uint64_t bytes = 0;
  cudaIpcMemHandle_t memory{};
  cudaIpcEventHandle_t event{};
};
static_assert(sizeof(ExportRecord) <= CudaIpcKvTransfer::kExportBytes);

void bind(int device) { DUET_CUDA_CHECK(cudaSetDevice(device)); }

}  // namespace

CudaIpcKvTransfer::CudaIpcKvTransfer(int device, bool sends, bool receives, Options options)
    : device_(device), options_(options) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    throw Error(ErrorKind::kUnsupported,
                format("CUDA IPC KV transfers: no CUDA device {} on this machine", device));
  }
  bind(device_);
  if (sends) {
    send_staging_ = std::make_unique<DeviceStaging>(options_.send_staging_bytes);
    send_tables_ = std::make_unique<TableStaging>(options_.table_entries);
    cudaEvent_t event = nullptr;
    DUET_CUDA_CHECK(
        cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess));
    send_event_ = event;
  }
  try {
    if (receives) {
      receive_staging_ = std::make_unique<DeviceStaging>(options_.receive_staging_bytes);
      receive_tables_ = std::make_unique<TableStaging>(options_.table_entries);
      stream_ = std::make_unique<DeviceStream>();
    }
  } catch (...) {
    // No destructor runs for a constructor that throws: the event is ours to free.
    if (send_event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(send_event_));
    throw;
  }
}

CudaIpcKvTransfer::~CudaIpcKvTransfer() {
  cudaSetDevice(device_);
  if (stream_) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_->get()));
  receipts_.clear();
  for (auto& [peer, sender] : senders_) {
    if (sender.staging != nullptr) cudaIpcCloseMemHandle(sender.staging);
    if (sender.event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(sender.event));
  }
  if (send_event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(send_event_));
}

std::vector<std::byte> CudaIpcKvTransfer::exported() const {
  DUET_ASSERT(send_staging_ != nullptr, "a CUDA IPC transfer that does not send exports nothing");
  bind(device_);
  ExportRecord record;
  record.device = device_;
  record.bytes = send_staging_->capacity();
  DUET_CUDA_CHECK(cudaIpcGetMemHandle(&record.memory, send_staging_->data()));
  DUET_CUDA_CHECK(cudaIpcGetEventHandle(&record.event, static_cast<cudaEvent_t>(send_event_)));
  std::vector<std::byte> bytes(kExportBytes);
  std::memcpy(bytes.data(), &record, sizeof record);
  return bytes;
}

void CudaIpcKvTransfer::add_receiver(int peer) {
  DUET_ASSERT(send_staging_ != nullptr, "rank {} receives from a transfer that does not send",
              peer);
  std::lock_guard lock(send_mutex_);
  receivers_.insert(peer);
}

void CudaIpcKvTransfer::add_sender(int peer, std::span<const std::byte> exported) {
  DUET_ASSERT(receive_staging_ != nullptr, "rank {} sends to a transfer that does not receive",
              peer);
  ExportRecord record;
  DUET_REQUIRE(exported.size() == kExportBytes, "CUDA IPC handles of {} bytes, not {}",
               exported.size(), kExportBytes);
  std::memcpy(&record, exported.data(), sizeof record);
  DUET_REQUIRE(record.magic == kExportMagic && record.bytes > 0,
               "rank {}'s CUDA IPC handles are not a device transfer's export", peer);
  DUET_ASSERT(!senders_.contains(peer), "rank {}'s handles opened twice", peer);
  bind(device_);
  Sender sender;
  sender.bytes = record.bytes;
  DUET_CUDA_CHECK(
      cudaIpcOpenMemHandle(&sender.staging, record.memory, cudaIpcMemLazyEnablePeerAccess));
  cudaEvent_t event = nullptr;
  const cudaError_t opened = cudaIpcOpenEventHandle(&event, record.event);
  if (opened != cudaSuccess) cudaIpcCloseMemHandle(sender.staging);
  DUET_CUDA_CHECK(opened);
  sender.event = event;
  senders_.emplace(peer, sender);
}

bool CudaIpcKvTransfer::carries(int peer) const {
  if (senders_.contains(peer)) return true;
  std::lock_guard lock(send_mutex_);
  return receivers_.contains(peer);
}

// ---------------------------------------------------------------- sending (engine thread)

std::optional<DeviceRowsTicket> CudaIpcKvTransfer::send(int peer, const KvLayout& layout,
                                                        const DeviceKv& kv, int64_t layer,
                                                        std::span<const int32_t> block_table,
                                                        int64_t pos0, int64_t n, KvHeads heads) {
  DUET_ASSERT(send_staging_ != nullptr && kv.valid() && kv.device == device_,
              "CUDA IPC send from device {} through a transfer of device {}", kv.device, device_);
  const size_t bytes = payload_bytes(layout, n, heads);
  if (bytes == 0 || bytes > send_staging_->capacity()) return std::nullopt;
  size_t offset = 0;
  {
    std::unique_lock lock(send_mutex_);
    if (!receivers_.contains(peer)) return std::nullopt;
    std::optional<size_t> room;
    const bool got = send_room_.wait_for(lock, options_.patience, [&] {
      room = send_staging_->acquire(bytes);
      return room.has_value();
    });
    if (!got) return std::nullopt;
    offset = *room;
  }
  // The event (what the receiver waits for) follows the packing on kv.stream.
  try {
    bind(device_);
    pack_into_staging(*send_staging_, offset, *send_tables_, layout, kv, layer, block_table, pos0,
                      n, heads, [&] {
                        DUET_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(send_event_),
                                                        static_cast<cudaStream_t>(kv.stream)));
                      });
  } catch (...) {
    released(peer, {offset, bytes});
    throw;
  }
  return DeviceRowsTicket{offset, bytes};
}

void CudaIpcKvTransfer::released(int peer, const DeviceRowsTicket& ticket) {
  DUET_ASSERT(send_staging_ != nullptr, "rank {} released staging this rank never sent", peer);
  {
    std::lock_guard lock(send_mutex_);
    send_staging_->release(ticket.offset);
  }
  send_room_.notify_all();
}

// ---------------------------------------------------------------- receiving (communication thread)

uint64_t CudaIpcKvTransfer::receive(int peer, const DeviceRowsTicket& ticket,
                                    const KvLayout& layout, const DeviceKv* kv,
                                    std::span<const int32_t> block_table, int64_t layer,
                                    int64_t pos0, int64_t n, KvHeads heads) {
  const auto sender = senders_.find(peer);
  DUET_ASSERT(sender != senders_.end(), "rows from rank {}, whose CUDA IPC handles are not open",
              peer);
  DUET_ASSERT(kv == nullptr || kv->device == device_,
              "rows for device {} through a transfer of device {}", kv->device, device_);
  // The ticket comes off the wire: no sum that could wrap.
  DUET_REQUIRE((kv == nullptr || ticket.bytes == payload_bytes(layout, n, heads)) &&
                   ticket.bytes <= sender->second.bytes &&
                   ticket.offset <= sender->second.bytes - ticket.bytes,
               "rank {}'s payload [{}, +{}) is not its rows' size or outside its staging", peer,
               ticket.offset, ticket.bytes);
  // What the unpack would refuse later, on the communication thread, is
  // refused here, before anything is queued.
  DUET_REQUIRE(kv == nullptr || (layer >= 0 && layer < layout.n_layers && pos0 >= 0 && n >= 0 &&
                                 heads.first >= 0 && heads.count >= 0 &&
                                 heads.first + heads.count <= layout.n_kv_heads),
               "rank {}'s rows (layer {}, [{}, +{}), heads [{}, +{})) are not in a {}-layer, "
               "{}-head cache",
               peer, layer, pos0, n, heads.first, heads.count, layout.n_layers, layout.n_kv_heads);
  DUET_REQUIRE(kv == nullptr || ticket.bytes <= receive_staging_->capacity(),
               "a {}-byte KV payload is larger than the {}-byte receive staging", ticket.bytes,
               receive_staging_->capacity());
  bind(device_);  // the receipt's event belongs to this transfer's device
  auto receipt = std::make_unique<Receipt>();
  receipt->id = next_receipt_++;
  receipt->peer = peer;
  receipt->ticket = ticket;
  receipt->layout = layout;
  receipt->layer = layer;
  receipt->n = n;
  receipt->heads = heads;
  if (kv != nullptr) {
    receipt->kv = *kv;
    const CoveringBlocks covering = covering_blocks(block_table, layout.block_size, pos0, n);
    receipt->block_table.assign(covering.table.begin(), covering.table.end());
    receipt->pos0 = covering.pos0;
  }
  const uint64_t id = receipt->id;
  receipts_.push_back(std::move(receipt));
  return id;
}

bool CudaIpcKvTransfer::start(Receipt& r) {
  if (!r.kv.valid()) {  // drained: nothing to copy
    r.started = true;
    return true;
  }
  const std::optional<size_t> offset = receive_staging_->acquire(r.ticket.bytes);
  if (!offset) return false;
  const std::optional<TableStaging::Slot> table =
      receive_tables_->upload(r.block_table, stream_->get());
  if (!table) {
    receive_staging_->release(*offset);
    return false;
  }
  const Sender& sender = senders_.at(r.peer);
  const auto stream = static_cast<cudaStream_t>(stream_->get());
  try {
    DUET_CUDA_CHECK(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(sender.event), 0));
    DUET_CUDA_CHECK(cudaMemcpyAsync(receive_staging_->at(*offset),
                                    static_cast<const std::byte*>(sender.staging) + r.ticket.offset,
                                    r.ticket.bytes, cudaMemcpyDeviceToDevice, stream));
    cuda::unpack_kv_rows(r.layout, r.kv.data, r.layer, table->device, r.pos0, r.n, r.heads.first,
                         r.heads.count, receive_staging_->at(*offset), stream);
    r.done.record(stream);
  } catch (const std::exception& e) {
    // Its slots go back (what was queued runs first on this one stream) and
    // it completes not ok, so that the receipts behind it are not stuck.
    receive_staging_->release(*offset);
    receive_tables_->release(table->offset);
    notes_.push_back(format("rows from rank {} could not be copied: {}", r.peer, e.what()));
    r.kv = {};
    r.ok = false;
    r.started = true;
    return true;
  }
  r.staging_offset = *offset;
  r.table_offset = table->offset;
  r.started = true;
  return true;
}

std::vector<DeviceKvTransfer::Done> CudaIpcKvTransfer::poll() {
  std::vector<Done> done;
  if (receipts_.empty()) return done;
  bind(device_);
  for (auto& r : receipts_) {
    if (!r->started && !start(*r)) break;  // in order: the rest wait for room too
  }
  // They finish in order (one stream).
  while (!receipts_.empty() && receipts_.front()->started) {
    Receipt& r = *receipts_.front();
    if (r.kv.valid()) {
      if (!r.done.done()) break;
      receive_staging_->release(r.staging_offset);
      receive_tables_->release(r.table_offset);
    }
    done.push_back(Done{r.id, r.peer, r.ok, r.ticket});
    receipts_.pop_front();
  }
  return done;
}

void CudaIpcKvTransfer::abandon(int) {}

std::vector<std::string> CudaIpcKvTransfer::take_notes() { return std::exchange(notes_, {}); }

bool CudaIpcKvTransfer::busy() const { return !receipts_.empty(); }

}  // namespace duet
