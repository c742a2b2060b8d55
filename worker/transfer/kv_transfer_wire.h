// The KV transfer's messages on the wire (the exchange itself is described in
// worker/transfer/mpi_kv_transfer.h). On the transfer's communicator, on tag
// kHeaderTag, every message starts with an 80-byte Header whose kind (below)
// says what it is; a rows payload follows on kPayloadTag.
// On a byte stream (worker/transfer/tcp_kv_transfer.h) each message is a
// frame: the header, then body_bytes(header) bytes: a control message, or a
// rows payload (there, the header and its payload travel together).
//
// Pure values and functions: any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "common/cluster/control_messages.h"
#include "common/model/kv_layout.h"
#include "worker/kv/kv_rows.h"

namespace duet::kv_wire {

inline constexpr int kHeaderTag = 1;   // headers (and control messages)
inline constexpr int kPayloadTag = 2;  // the rows after a rows header

// The kinds. Rows: one layer of one chunk of a request (layer, first position
// and count, the global KV heads it carries and, when checksums are on, the
// payload's checksum); the payload is the packed rows of worker/kv/kv_rows.h.
// Control: PrefillOrder, Cancel or KvHandoff (Cap'n Proto). Device rows: as
// rows, but the header names the payload's place in the sender's staging (a
// ticket). CMA rows: as device rows, the staging in the sender's host memory,
// read by cross-memory attach (worker/transfer/cma_staging.h).
inline constexpr uint32_t kMagic = 0x3256'4b44;  // "DKV2": rows packed in chunks
inline constexpr uint32_t kRows = 1;             // a payload follows on kPayloadTag
inline constexpr uint32_t kControl = 2;          // a control message follows in this message
inline constexpr uint32_t kDeviceRows = 3;       // the payload goes through the device transfer
inline constexpr uint32_t kRowsDone = 4;         // receiver -> sender: a payload's staging is free
inline constexpr uint32_t kCmaRows = 5;  // the receiver reads the payload from the sender's staging

struct Header {
  uint32_t magic = kMagic;
  uint32_t kind = 0;
  uint64_t request = 0;
  int64_t layer = 0;
  int64_t pos0 = 0;
  int64_t n = 0;
  uint64_t checksum = 0;   // of the rows payload; 0: not computed
  int64_t head_begin = 0;  // the global KV heads [head_begin, head_end) in the payload
  int64_t head_end = 0;
  uint64_t ticket_offset = 0;  // device or CMA rows, rows done: the payload's DeviceRowsTicket
  // Device or CMA rows, rows done: the ticket's size. Control, and rows on a
  // byte stream: the bytes after the header (body_bytes).
  uint64_t ticket_bytes = 0;
};
static_assert(sizeof(Header) == 80);

// The header alone, as one message.
inline std::vector<std::byte> header_bytes(const Header& header) {
  std::vector<std::byte> bytes(sizeof header);
  std::memcpy(bytes.data(), &header, sizeof header);
  return bytes;
}

// A control header followed by `message`.
inline std::vector<std::byte> control_bytes(const ControlMessage& message) {
  const std::vector<std::byte> encoded = encode_control_message(message);
  Header header;
  header.kind = kControl;
  header.ticket_bytes = encoded.size();
  std::vector<std::byte> bytes(sizeof header + encoded.size());
  std::memcpy(bytes.data(), &header, sizeof header);
  std::memcpy(bytes.data() + sizeof header, encoded.data(), encoded.size());
  return bytes;
}

// The header at the start of `bytes`; nullopt when the message is not the
// transfer's (too short, or another magic).
inline std::optional<Header> read_header(std::span<const std::byte> bytes) {
  Header header;
  if (bytes.size() < sizeof header) return std::nullopt;
  std::memcpy(&header, bytes.data(), sizeof header);
  if (header.magic != kMagic) return std::nullopt;
  return header;
}

// The bytes that follow `header` in a frame on a byte stream.
inline uint64_t body_bytes(const Header& header) {
  return header.kind == kControl || header.kind == kRows ? header.ticket_bytes : 0;
}

// The checksum a rows header carries for its payload (never 0, which means
// "not computed").
inline uint64_t rows_checksum(std::span<const KvElement> rows) { return kv_checksum(rows) | 1; }

}  // namespace duet::kv_wire
