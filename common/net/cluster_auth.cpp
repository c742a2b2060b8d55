#include "common/net/cluster_auth.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <string_view>
#include <utility>

#include "common/error.h"
#include "common/format.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::string_view kMagic = "DUETAUTH";
constexpr uint16_t kVersion = 1;
constexpr size_t kHeaderBytes = 16;
constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;
constexpr size_t kMaxReasonBytes = 1024;
constexpr size_t kChallengeBytes = 4 + kNonceBytes;
constexpr size_t kProofMessageBytes = kNonceBytes + kProofBytes;
constexpr size_t kMaxHelloBytes = kProofBytes + kClusterAuthMaxPayloadBytes;
constexpr size_t kMaxAnswerBytes = 8 + kMaxReasonBytes + kClusterAuthMaxPayloadBytes;
// A key file longer than this is not a key file.
constexpr size_t kMaxKeyFileBytes = size_t{64} << 10;

constexpr std::string_view kListenerLabel = "duet listener";
constexpr std::string_view kDialerLabel = "duet dialer";
constexpr std::string_view kKeyMismatch = "the cluster key does not match";

enum class Kind : uint16_t { kChallenge = 1, kProof = 2, kHello = 3, kAnswer = 4 };

using Nonce = std::array<std::byte, kNonceBytes>;
using Proof = std::array<std::byte, kProofBytes>;

void put_bytes(std::vector<std::byte>& out, std::span<const std::byte> bytes) {
  const size_t at = out.size();
  out.resize(at + bytes.size());
  if (!bytes.empty()) std::memcpy(out.data() + at, bytes.data(), bytes.size());
}

void put_u16(std::vector<std::byte>& out, uint16_t value) {
  const std::array<std::byte, 2> bytes = {static_cast<std::byte>(value & 0xff),
                                          static_cast<std::byte>(value >> 8)};
  put_bytes(out, bytes);
}

void put_u32(std::vector<std::byte>& out, uint32_t value) {
  std::array<std::byte, 4> bytes;
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<std::byte>((value >> (8 * i)) & 0xff);
  put_bytes(out, bytes);
}

void put_text(std::vector<std::byte>& out, std::string_view text) {
  put_bytes(out, std::as_bytes(std::span(text.data(), text.size())));
}

uint16_t get_u16(const std::byte* at) {
  return static_cast<uint16_t>(static_cast<uint32_t>(at[0]) | static_cast<uint32_t>(at[1]) << 8);
}

uint32_t get_u32(const std::byte* at) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= static_cast<uint32_t>(at[i]) << (8 * i);
  return value;
}

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

Nonce fresh_nonce() {
  Nonce nonce;
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) !=
      1)
    throw Error(ErrorKind::kInternal, "cluster handshake: no random bytes from OpenSSL");
  return nonce;
}

// HMAC(key, label || purpose || first || second).
Proof prove(const ClusterKey& key, std::string_view label, uint32_t purpose, const Nonce& first,
            const Nonce& second) {
  std::vector<std::byte> message;
  put_text(message, label);
  put_u32(message, purpose);
  put_bytes(message, first);
  put_bytes(message, second);
  return key.sign(message);
}

bool proofs_equal(std::span<const std::byte> a, const Proof& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), b.size()) == 0;
}

// One line of printable ASCII, at most kMaxReasonBytes: a reason as it goes
// on the wire or into an error message.
std::string one_line(std::string_view text) {
  std::string line(text.substr(0, kMaxReasonBytes));
  for (char& c : line) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  }
  return line;
}

// The socket's peer as "ip:port", or what it is when it has none.
std::string peer_name(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0)
    return "an unknown peer";
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&address);
    inet_ntop(AF_INET, &v4->sin_addr, text, sizeof text);
    return format("{}:{}", text, ntohs(v4->sin_port));
  }
  if (address.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&address);
    inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof text);
    return format("[{}]:{}", text, ntohs(v6->sin6_port));
  }
  return "a local socket";
}

// What came of reading one message.
struct Received {
  enum class Status { kMessage, kStranger, kOtherVersion, kClosed, kTimedOut };
  Status status = Status::kMessage;
  uint16_t version = 0;
  uint16_t kind = 0;
  std::vector<std::byte> body;
  std::string detail;  // kStranger: what was wrong; kClosed: how it ended
};

// One side's end of the handshake: whole messages out and in, never a byte
// read past the message asked for (what follows belongs to the caller).
// Every wait is a poll() bounded by the deadline.
class Wire {
 public:
  enum class Sent { kSent, kClosed, kTimedOut };

  Wire(int fd, Clock::time_point deadline) : fd_(fd), deadline_(deadline) {}

  // kClosed: how it ended is in closed_why().
  Sent send(Kind kind, std::span<const std::byte> body) {
    std::vector<std::byte> message;
    message.reserve(kHeaderBytes + body.size());
    put_text(message, kMagic);
    put_u16(message, kVersion);
    put_u16(message, static_cast<uint16_t>(kind));
    put_u32(message, static_cast<uint32_t>(body.size()));
    put_bytes(message, body);
    size_t sent = 0;
    while (sent < message.size()) {
      const ssize_t n = ::send(fd_, message.data() + sent, message.size() - sent, MSG_NOSIGNAL);
      if (n >= 0) {
        sent += static_cast<size_t>(n);
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!wait(POLLOUT)) return Sent::kTimedOut;
      } else if (errno != EINTR) {
        closed_why_ = format("ended the connection ({})", strerror(errno));
        return Sent::kClosed;
      }
    }
    return Sent::kSent;
  }

  // One message, its body at most `max_body` bytes. A message of another
  // version comes back with its header only.
  Received receive(size_t max_body) {
    Received r;
    std::array<std::byte, kHeaderBytes> header{};
    size_t got = 0;
    while (got < header.size()) {
      if (!read_some(std::span(header).subspan(got), got, r)) return r;
      const size_t n_magic = std::min(got, kMagic.size());
      if (std::memcmp(header.data(), kMagic.data(), n_magic) != 0) {
        r.status = Received::Status::kStranger;
        return r;
      }
    }
    r.version = get_u16(header.data() + 8);
    r.kind = get_u16(header.data() + 10);
    if (r.version != kVersion) {
      r.status = Received::Status::kOtherVersion;
      return r;
    }
    const size_t length = get_u32(header.data() + 12);
    if (length > max_body) {
      r.status = Received::Status::kStranger;
      r.detail = format("a {}-byte message where at most {} were due", length, max_body);
      return r;
    }
    r.body.resize(length);
    got = 0;
    while (got < length) {
      if (!read_some(std::span(r.body).subspan(got), got, r)) return r;
    }
    return r;
  }

  const std::string& closed_why() const { return closed_why_; }

 private:
  // At least one byte into `out`, added to `got`; false when the connection
  // ended or the deadline passed (said in `r`).
  bool read_some(std::span<std::byte> out, size_t& got, Received& r) {
    for (;;) {
      const ssize_t n = recv(fd_, out.data(), out.size(), 0);
      if (n > 0) {
        got += static_cast<size_t>(n);
        return true;
      }
      if (n == 0) {
        r.status = Received::Status::kClosed;
        r.detail = "closed the connection";
        return false;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!wait(POLLIN)) {
          r.status = Received::Status::kTimedOut;
          return false;
        }
      } else if (errno != EINTR) {
        r.status = Received::Status::kClosed;
        r.detail = format("ended the connection ({})", strerror(errno));
        return false;
      }
    }
  }

  // Until the socket is ready for `events` (or has an error to report):
  // false when the deadline passed first.
  bool wait(short events) const {
    for (;;) {
      const Clock::time_point now = Clock::now();
      if (now >= deadline_) return false;
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline_ - now).count();
      pollfd p{fd_, events, 0};
      const int n = poll(&p, 1, static_cast<int>(std::min<int64_t>(left, INT_MAX)));
      if (n > 0 || (n < 0 && errno != EINTR)) return true;
    }
  }

  const int fd_;
  const Clock::time_point deadline_;
  std::string closed_why_;
};

// An answer message's fields.
struct Answer {
  bool accepted = false;
  std::string reason;
  std::vector<std::byte> payload;
};

std::vector<std::byte> encode_answer(bool accepted, std::string_view reason,
                                     std::span<const std::byte> payload) {
  const std::string line = one_line(reason);
  std::vector<std::byte> body;
  body.reserve(8 + line.size() + payload.size());
  put_u32(body, accepted ? 1 : 0);
  put_u32(body, static_cast<uint32_t>(line.size()));
  put_text(body, line);
  put_bytes(body, payload);
  return body;
}

// False: not a well-formed answer.
bool decode_answer(std::span<const std::byte> body, Answer& answer) {
  if (body.size() < 8) return false;
  const uint32_t accepted = get_u32(body.data());
  const size_t reason_bytes = get_u32(body.data() + 4);
  if (accepted > 1 || reason_bytes > kMaxReasonBytes || reason_bytes > body.size() - 8)
    return false;
  if (body.size() - 8 - reason_bytes > kClusterAuthMaxPayloadBytes) return false;
  answer.accepted = accepted == 1;
  answer.reason.assign(reinterpret_cast<const char*>(body.data() + 8), reason_bytes);
  answer.payload.assign(body.begin() + 8 + static_cast<std::ptrdiff_t>(reason_bytes), body.end());
  return true;
}

int64_t elapsed_ms(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

// The errors of one side of one handshake, each naming the peer.
class Failures {
 public:
  // `who`: the peer in a sentence ("the coordinator at 10.0.0.2:7070").
  Failures(std::string who, Clock::time_point start) : who_(std::move(who)), start_(start) {}

  // A message that did not come: `what` it was ("the answer").
  [[noreturn]] void unreceived(const Received& r, std::string_view what) const {
    if (r.status == Received::Status::kTimedOut) {
      throw Error(ErrorKind::kInternal, format("timed out after {} ms waiting for {} from {}",
                                               elapsed_ms(start_), what, who_));
    }
    DUET_ASSERT(r.status == Received::Status::kClosed);
    throw Error(ErrorKind::kInternal, format("{} {} before {} came", who_, r.detail, what));
  }
  // A message that could not be sent: `what` it was ("the hello").
  [[noreturn]] void unsent(Wire::Sent sent, const Wire& wire, std::string_view what) const {
    if (sent == Wire::Sent::kTimedOut) {
      throw Error(ErrorKind::kInternal,
                  format("timed out after {} ms sending {} to {}", elapsed_ms(start_), what, who_));
    }
    throw Error(ErrorKind::kInternal,
                format("{} {} while {} was being sent", who_, wire.closed_why(), what));
  }
  // "WHO WHY".
  [[noreturn]] void fail(ErrorKind kind, std::string_view why) const {
    throw Error(kind, format("{} {}", who_, why));
  }

 private:
  const std::string who_;
  const Clock::time_point start_;
};

}  // namespace

ClusterKey ClusterKey::from_file(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw Error(ErrorKind::kNotFound,
                format("cluster key {}: cannot open: {}", path, strerror(errno)));
  struct stat status {};
  std::string bytes;
  std::string failure;
  if (fstat(fd, &status) != 0) {
    failure = strerror(errno);
  } else {
    char chunk[4096];
    for (;;) {
      const ssize_t n = read(fd, chunk, sizeof chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) failure = strerror(errno);
      if (n <= 0 || bytes.size() > kMaxKeyFileBytes) break;
      bytes.append(chunk, static_cast<size_t>(n));
    }
  }
  close(fd);
  if (!failure.empty())
    throw Error(ErrorKind::kNotFound, format("cluster key {}: cannot read: {}", path, failure));
  if ((status.st_mode & 077) != 0) {
    throw Error(ErrorKind::kInvalidArgument,
                format("cluster key {}: is {} by others (chmod 600 {})", path,
                       (status.st_mode & 044) != 0 ? "readable" : "writable", path));
  }
  if (bytes.size() > kMaxKeyFileBytes) {
    throw Error(
        ErrorKind::kInvalidArgument,
        format("cluster key {}: longer than {} bytes: not a key file", path, kMaxKeyFileBytes));
  }
  const auto first = std::find_if_not(bytes.begin(), bytes.end(), is_space);
  const auto last = std::find_if_not(bytes.rbegin(), bytes.rend(), is_space).base();
  std::string key = first < last ? std::string(first, last) : std::string();
  if (key.size() < kMinBytes) {
    throw Error(ErrorKind::kInvalidArgument,
                format("cluster key {}: {} bytes after trimming whitespace, at least {} needed "
                       "(make one: head -c 32 /dev/urandom | base64 > {}; chmod 600 {})",
                       path, key.size(), kMinBytes, path, path));
  }
  return ClusterKey(std::move(key));
}

ClusterKey ClusterKey::from_bytes(std::string bytes) {
  DUET_REQUIRE(bytes.size() >= kMinBytes, "cluster key: {} bytes, at least {} needed", bytes.size(),
               kMinBytes);
  return ClusterKey(std::move(bytes));
}

std::array<std::byte, 32> ClusterKey::sign(std::span<const std::byte> message) const {
  std::array<std::byte, 32> mac{};
  unsigned int length = 0;
  const unsigned char* made =
      HMAC(EVP_sha256(), bytes_.data(), static_cast<int>(bytes_.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(),
           reinterpret_cast<unsigned char*>(mac.data()), &length);
  if (made == nullptr || length != mac.size())
    throw Error(ErrorKind::kInternal, "cluster key: HMAC-SHA256 failed in OpenSSL");
  return mac;
}

std::string ClusterKey::fingerprint() const {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(bytes_.data(), bytes_.size(), digest, &length, EVP_sha256(), nullptr) != 1)
    throw Error(ErrorKind::kInternal, "cluster key: SHA-256 failed in OpenSSL");
  constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (size_t i = 0; i < 8; ++i) {
    hex += kHex[digest[i] >> 4];
    hex += kHex[digest[i] & 0xf];
  }
  return hex;
}

std::vector<std::byte> authenticate_dialer(int fd, const ClusterKey& key, uint32_t purpose,
                                           std::span<const std::byte> hello,
                                           Clock::time_point deadline) {
  DUET_REQUIRE(hello.size() <= kClusterAuthMaxPayloadBytes, "a {}-byte cluster hello (at most {})",
               hello.size(), kClusterAuthMaxPayloadBytes);
  const Failures failures(format("the coordinator at {}", peer_name(fd)), Clock::now());
  Wire wire(fd, deadline);

  // A reply that is not Duet's cluster protocol, or not this version of it.
  const auto check_speaks = [&](const Received& r) {
    if (r.status == Received::Status::kStranger) {
      failures.fail(ErrorKind::kInvalidArgument,
                    format("does not speak Duet's cluster protocol{}",
                           r.detail.empty() ? "" : format(" ({})", r.detail)));
    }
    if (r.status == Received::Status::kOtherVersion) {
      failures.fail(ErrorKind::kUnsupported,
                    format("speaks cluster protocol version {}; this build speaks version {}",
                           r.version, kVersion));
    }
  };
  // An answer's fields; throws on a refusal.
  const auto accepted_answer = [&](const Received& r) {
    Answer answer;
    if (r.kind != static_cast<uint16_t>(Kind::kAnswer) || !decode_answer(r.body, answer)) {
      failures.fail(ErrorKind::kInvalidArgument,
                    format("broke the cluster protocol (a kind {} message of {} bytes)", r.kind,
                           r.body.size()));
    }
    if (!answer.accepted)
      failures.fail(ErrorKind::kInvalidArgument, format("refused: {}", one_line(answer.reason)));
    return answer;
  };

  const Nonce dialer_nonce = fresh_nonce();
  std::vector<std::byte> challenge;
  put_u32(challenge, purpose);
  put_bytes(challenge, dialer_nonce);
  if (const Wire::Sent sent = wire.send(Kind::kChallenge, challenge); sent != Wire::Sent::kSent)
    failures.unsent(sent, wire, "the challenge");

  const Received proof = wire.receive(std::max(kProofMessageBytes, kMaxAnswerBytes));
  check_speaks(proof);
  if (proof.status != Received::Status::kMessage)
    failures.unreceived(proof, "the proof of the cluster key");
  if (proof.kind == static_cast<uint16_t>(Kind::kAnswer)) {
    // Refused before any proof: another purpose, say. Never an acceptance.
    accepted_answer(proof);
    failures.fail(ErrorKind::kInvalidArgument,
                  "broke the cluster protocol (accepted without proving the cluster key)");
  }
  if (proof.kind != static_cast<uint16_t>(Kind::kProof) ||
      proof.body.size() != kProofMessageBytes) {
    failures.fail(ErrorKind::kInvalidArgument,
                  format("broke the cluster protocol (a kind {} message of {} bytes where its "
                         "proof was due)",
                         proof.kind, proof.body.size()));
  }
  Nonce listener_nonce;
  std::memcpy(listener_nonce.data(), proof.body.data(), kNonceBytes);
  const std::span<const std::byte> listener_proof =
      std::span(proof.body).subspan(kNonceBytes, kProofBytes);
  if (!proofs_equal(listener_proof,
                    prove(key, kListenerLabel, purpose, dialer_nonce, listener_nonce))) {
    failures.fail(ErrorKind::kInvalidArgument,
                  format("did not prove the cluster key (this side's is key {}: do the cluster "
                         "keys match?)",
                         key.fingerprint()));
  }

  std::vector<std::byte> hello_message;
  put_bytes(hello_message, prove(key, kDialerLabel, purpose, listener_nonce, dialer_nonce));
  put_bytes(hello_message, hello);
  if (const Wire::Sent sent = wire.send(Kind::kHello, hello_message); sent != Wire::Sent::kSent)
    failures.unsent(sent, wire, "the hello");

  const Received answer = wire.receive(kMaxAnswerBytes);
  check_speaks(answer);
  if (answer.status != Received::Status::kMessage) failures.unreceived(answer, "the answer");
  return accepted_answer(answer).payload;
}

AuthAnswer authenticate_listener(
    int fd, const ClusterKey& key, uint32_t purpose,
    const std::function<AuthAnswer(std::span<const std::byte> hello)>& judge,
    Clock::time_point deadline) {
  const std::string peer = peer_name(fd);
  const Clock::time_point start = Clock::now();
  const Failures failures(format("the dialer at {}", peer), start);
  const Failures refusals(format("refused a connection from {}:", peer), start);
  Wire wire(fd, deadline);

  // Tells the dialer why, if it still listens, then throws.
  const auto refuse = [&](ErrorKind kind, std::string_view reason, std::string_view why) {
    static_cast<void>(wire.send(Kind::kAnswer, encode_answer(false, reason, {})));
    refusals.fail(kind, why);
  };
  const auto check_speaks = [&](const Received& r, std::string_view what) {
    if (r.status == Received::Status::kStranger) {
      refusals.fail(ErrorKind::kInvalidArgument,
                    format("not a Duet cluster connection{}",
                           r.detail.empty() ? "" : format(" ({})", r.detail)));
    }
    if (r.status == Received::Status::kOtherVersion) {
      refuse(ErrorKind::kUnsupported,
             format("this coordinator speaks cluster protocol version {}, not {}", kVersion,
                    r.version),
             format("it speaks cluster protocol version {}; this build speaks version {}",
                    r.version, kVersion));
    }
    if (r.status == Received::Status::kClosed || r.status == Received::Status::kTimedOut)
      failures.unreceived(r, what);
  };

  const Received challenge = wire.receive(kChallengeBytes);
  check_speaks(challenge, "the challenge");
  if (challenge.kind != static_cast<uint16_t>(Kind::kChallenge) ||
      challenge.body.size() != kChallengeBytes) {
    refusals.fail(ErrorKind::kInvalidArgument,
                  format("not a Duet cluster connection (a kind {} message of {} bytes where "
                         "its challenge was due)",
                         challenge.kind, challenge.body.size()));
  }
  const uint32_t dialer_purpose = get_u32(challenge.body.data());
  if (dialer_purpose != purpose) {
    refuse(ErrorKind::kInvalidArgument,
           format("connection purpose {} is not this listener's ({})", dialer_purpose, purpose),
           format("it asked for connection purpose {}; this listener serves purpose {}",
                  dialer_purpose, purpose));
  }
  Nonce dialer_nonce;
  std::memcpy(dialer_nonce.data(), challenge.body.data() + 4, kNonceBytes);

  const Nonce listener_nonce = fresh_nonce();
  std::vector<std::byte> proof;
  put_bytes(proof, listener_nonce);
  put_bytes(proof, prove(key, kListenerLabel, purpose, dialer_nonce, listener_nonce));
  if (const Wire::Sent sent = wire.send(Kind::kProof, proof); sent != Wire::Sent::kSent)
    failures.unsent(sent, wire, "the proof");

  const Received hello = wire.receive(kMaxHelloBytes);
  if (hello.status == Received::Status::kClosed) {
    // What a dialer does when this side's proof fails.
    failures.fail(ErrorKind::kInvalidArgument,
                  format("{} instead of proving the cluster key (this side's is key {}: do the "
                         "cluster keys match?)",
                         hello.detail, key.fingerprint()));
  }
  check_speaks(hello, "the proof of the cluster key");
  if (hello.kind != static_cast<uint16_t>(Kind::kHello) || hello.body.size() < kProofBytes) {
    refusals.fail(ErrorKind::kInvalidArgument,
                  format("not a Duet cluster connection (a kind {} message of {} bytes where "
                         "its proof was due)",
                         hello.kind, hello.body.size()));
  }
  const std::span<const std::byte> body(hello.body);
  if (!proofs_equal(body.first(kProofBytes),
                    prove(key, kDialerLabel, purpose, listener_nonce, dialer_nonce))) {
    refuse(ErrorKind::kInvalidArgument, kKeyMismatch, kKeyMismatch);
  }

  AuthAnswer answer = judge(body.subspan(kProofBytes));
  DUET_REQUIRE(answer.payload.size() <= kClusterAuthMaxPayloadBytes,
               "a {}-byte cluster answer (at most {})", answer.payload.size(),
               kClusterAuthMaxPayloadBytes);
  if (const Wire::Sent sent =
          wire.send(Kind::kAnswer, encode_answer(answer.accepted, answer.reason, answer.payload));
      sent != Wire::Sent::kSent)
    failures.unsent(sent, wire, "the answer");
  return answer;
}

}  // namespace duet
