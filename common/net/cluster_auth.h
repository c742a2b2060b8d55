// The handshake on every connection made to join a running cluster: an
// instance dials the coordinator over TCP, and both ends prove that they hold
// the cluster key (read from a key file, never sent) by HMAC-SHA256 challenge
// and response, the listener first; only then does the dialer's one "hello"
// payload go out and the listener's one "answer" payload come back. After
// that the socket belongs to the caller (a framed control link), positioned
// just past the handshake: no byte of what follows is read here.
//
// Wire format, version 1. Every message is a 16-byte header, the magic
// "DUETAUTH", the protocol version (uint16), the message kind (uint16) and
// the body's length (uint32), integers little-endian, then the body:
//   1 challenge, dialer to listener: purpose (uint32), dialer_nonce (32 bytes)
//   2 proof, listener to dialer: listener_nonce (32), listener_proof (32)
//   3 hello, dialer to listener: dialer_proof (32), the hello payload
//   4 answer, listener to dialer: accepted (uint32, 0 or 1), the reason's
//     length (uint32), the reason (at most 1 KiB), the answer payload
// listener_proof = HMAC(key, "duet listener" || purpose || dialer_nonce ||
// listener_nonce); dialer_proof = HMAC(key, "duet dialer" || purpose ||
// listener_nonce || dialer_nonce), purpose as 4 bytes little-endian. A
// listener that will not answer a challenge (another purpose or version)
// sends a refusing answer in place of its proof; a dialer whose proof fails
// is sent one too ("the cluster key does not match"); a dialer that finds the
// listener's proof wrong sends nothing more. Payloads are at most
// kClusterAuthMaxPayloadBytes; a longer message, another magic, or a kind out
// of turn is a stranger's. The magic is checked byte by byte as it arrives,
// so a stranger is refused at its first wrong byte.
//
// Non-blocking sockets: every wait is a poll() bounded by the caller's
// deadline. Any thread (no state outside the arguments).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace duet {

// The most bytes a hello or an answer payload may hold.
inline constexpr size_t kClusterAuthMaxPayloadBytes = size_t{64} << 10;

// The cluster's shared secret: at least 32 bytes. A value; the bytes never
// leave it but through sign() and fingerprint().
class ClusterKey final {
 public:
  static constexpr size_t kMinBytes = 32;

  // Reads `path`: the key is the file's bytes with leading and trailing
  // ASCII whitespace trimmed, at least kMinBytes of them. Throws duet::Error,
  // the message starting "cluster key PATH: ": kNotFound when the file is
  // missing or unreadable; kInvalidArgument when the key is too short or the
  // file is open to its group or others (st_mode & 077).
  static ClusterKey from_file(const std::string& path);
  // Exactly `bytes` (tests); kInvalidArgument when shorter than kMinBytes.
  static ClusterKey from_bytes(std::string bytes);

  // HMAC-SHA256 of `message` under the key.
  std::array<std::byte, 32> sign(std::span<const std::byte> message) const;
  // For logs, to tell keys apart: the first 8 bytes of SHA-256(key) as 16
  // lowercase hex digits ("3fa2..."). Never the key.
  std::string fingerprint() const;

 private:
  explicit ClusterKey(std::string bytes) : bytes_(std::move(bytes)) {}

  std::string bytes_;
};

// What the listener decided about a dialer's hello.
struct AuthAnswer {
  bool accepted = false;
  std::vector<std::byte> payload;  // to the dialer, accepted or not
  std::string reason;              // refused: one line, sent to the dialer too
};

// The dialling side, on a connected non-blocking socket `fd` (left open):
// sends a challenge for `purpose`, checks the listener's proof, proves the
// key with `hello` (at most kClusterAuthMaxPayloadBytes), and returns the
// listener's answer payload. Throws duet::Error with a one-line message when
// the listener does not prove the key ("the coordinator at PEER did not prove
// the cluster key"), refuses ("the coordinator at PEER refused: REASON", its
// reason verbatim), is not a Duet cluster listener, speaks another protocol
// version (kUnsupported, naming both), or the connection ends or `deadline`
// passes first ("timed out after N ms waiting for ...", kInternal).
std::vector<std::byte> authenticate_dialer(int fd, const ClusterKey& key, uint32_t purpose,
                                           std::span<const std::byte> hello,
                                           std::chrono::steady_clock::time_point deadline);

// The listening side, on an accepted non-blocking socket `fd` (left open).
// A dialer that does not prove the key is sent a refusal ("the cluster key
// does not match") and this throws Error(kInvalidArgument, "refused a
// connection from PEER: the cluster key does not match"); `judge` is never
// called then. Otherwise calls `judge(hello)` once (an exception from it
// passes through, nothing sent), sends its answer and returns it; the caller
// logs a refusal. Also throws on a stranger ("refused a connection from PEER:
// not a Duet cluster connection"), another purpose or protocol version (both
// refused to the dialer first), a connection that ends, or the deadline.
AuthAnswer authenticate_listener(
    int fd, const ClusterKey& key, uint32_t purpose,
    const std::function<AuthAnswer(std::span<const std::byte> hello)>& judge,
    std::chrono::steady_clock::time_point deadline);

}  // namespace duet
