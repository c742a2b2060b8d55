#include "worker/transfer/device/cuda_ipc_kv_link.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/error.h"
#include "kernels/cuda/check.h"

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
static_assert(sizeof(ExportRecord) <= CudaIpcKvLink::kExportBytes);

void bind(int device) { DUET_CUDA_CHECK(cudaSetDevice(device)); }

}  // namespace

CudaIpcKvLink::CudaIpcKvLink(int device, bool sends, bool receives, Options options)
    : StagedDeviceKvLink("CUDA IPC", device, sends, receives, options) {
  if (receives) stream_ = std::make_unique<DeviceStream>();
  // Last: no destructor runs for a constructor that throws, and the event is
  // not a member that frees itself.
  if (sends) {
    cudaEvent_t event = nullptr;
    DUET_CUDA_CHECK(
        cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess));
    send_event_ = event;
  }
}

CudaIpcKvLink::~CudaIpcKvLink() {
  cudaSetDevice(device_);
  if (stream_) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_->get()));
  receipts_.clear();
  for (auto& [peer, sender] : senders_) {
    if (sender.staging != nullptr) cudaIpcCloseMemHandle(sender.staging);
    if (sender.event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(sender.event));
  }
  if (send_event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(send_event_));
}

std::vector<std::byte> CudaIpcKvLink::exported() const {
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

void CudaIpcKvLink::add_receiver(int peer) {
  DUET_ASSERT(send_staging_ != nullptr, "rank {} receives from a transfer that does not send",
              peer);
  std::lock_guard lock(send_mutex_);
  receivers_.insert(peer);
}

void CudaIpcKvLink::add_sender(int peer, std::span<const std::byte> exported) {
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

bool CudaIpcKvLink::carries(int peer) const {
  if (senders_.contains(peer)) return true;
  std::lock_guard lock(send_mutex_);
  return receivers_.contains(peer);
}

// ---------------------------------------------------------------- sending (engine thread)

bool CudaIpcKvLink::sends_to(int peer) const { return receivers_.contains(peer); }

// The event (what the receiver waits for) follows the packing on kv.stream.
void CudaIpcKvLink::after_pack(void* stream) {
  DUET_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(send_event_), static_cast<cudaStream_t>(stream)));
}

// ---------------------------------------------------------------- receiving (communication thread)

void CudaIpcKvLink::check(const Payload& p) const {
  const auto sender = senders_.find(p.peer);
  DUET_ASSERT(sender != senders_.end(), "rows from rank {}, whose CUDA IPC handles are not open",
              p.peer);
  const DeviceRowsTicket& ticket = p.ticket;
  // The ticket comes off the wire: no sum that could wrap.
  DUET_REQUIRE((p.kv == nullptr || ticket.bytes == payload_bytes(p.layout, p.n, p.heads)) &&
                   ticket.bytes <= sender->second.bytes &&
                   ticket.offset <= sender->second.bytes - ticket.bytes,
               "rank {}'s payload [{}, +{}) is not its rows' size or outside its staging", p.peer,
               ticket.offset, ticket.bytes);
  // What the unpack would refuse later, on the communication thread, is
  // refused here, before anything is queued.
  DUET_REQUIRE(p.kv == nullptr || (p.layer >= 0 && p.layer < p.layout.n_layers && p.pos0 >= 0 &&
                                   p.n >= 0 && p.heads.first >= 0 && p.heads.count >= 0 &&
                                   p.heads.first + p.heads.count <= p.layout.n_kv_heads),
               "rank {}'s rows (layer {}, [{}, +{}), heads [{}, +{})) are not in a {}-layer, "
               "{}-head cache",
               p.peer, p.layer, p.pos0, p.n, p.heads.first, p.heads.count, p.layout.n_layers,
               p.layout.n_kv_heads);
  DUET_REQUIRE(p.kv == nullptr || ticket.bytes <= receive_staging_->capacity(),
               "a {}-byte KV payload is larger than the {}-byte receive staging", ticket.bytes,
               receive_staging_->capacity());
}

void CudaIpcKvLink::queue_receipt(uint64_t id, const Payload& payload) {
  bind(device_);  // the receipt's event belongs to this transfer's device
  auto receipt = std::make_unique<Receipt>();
  receipt->id = id;
  receipt->peer = payload.peer;
  receipt->ticket = payload.ticket;
  receipt->rows = destination(payload);
  receipts_.push_back(std::move(receipt));
}

bool CudaIpcKvLink::start(Receipt& r) {
  if (!r.rows.kv.valid()) {  // drained: nothing to copy
    r.started = true;
    return true;
  }
  const std::optional<size_t> offset = receive_staging_->acquire(r.ticket.bytes);
  if (!offset) return false;
  const std::optional<TableStaging::Slot> table =
      receive_tables_->upload(r.rows.block_table, stream_->get());
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
    unpack(r.rows, table->device, *offset, stream);
    r.done.record(stream);
  } catch (const std::exception& e) {
    // Its slots go back (what was queued runs first on this one stream) and
    // it completes not ok, so that the receipts behind it are not stuck.
    receive_staging_->release(*offset);
    receive_tables_->release(table->offset);
    notes_.push_back(format("rows from rank {} could not be copied: {}", r.peer, e.what()));
    r.rows.kv = {};
    r.ok = false;
    r.started = true;
    return true;
  }
  r.staging_offset = *offset;
  r.table_offset = table->offset;
  r.started = true;
  return true;
}

std::vector<DeviceKvLink::Done> CudaIpcKvLink::poll() {
  std::vector<Done> done;
  if (receipts_.empty()) return done;
  bind(device_);
  for (auto& r : receipts_) {
    if (!r->started && !start(*r)) break;  // in order: the rest wait for room too
  }
  // They finish in order (one stream).
  while (!receipts_.empty() && receipts_.front()->started) {
    Receipt& r = *receipts_.front();
    if (r.rows.kv.valid()) {
      if (!r.done.done()) break;
      receive_staging_->release(r.staging_offset);
      receive_tables_->release(r.table_offset);
    }
    done.push_back(Done{r.id, r.peer, r.ok, r.ticket});
    receipts_.pop_front();
  }
  return done;
}

void CudaIpcKvLink::abandon(int) {}

bool CudaIpcKvLink::busy() const { return !receipts_.empty(); }

}  // namespace duet
