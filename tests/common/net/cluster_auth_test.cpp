// The cluster key and handshake (common/net/cluster_auth.h) over socket pairs
// in one process, the other side on a thread: HMAC-SHA256 against RFC 4231,
// key files (mode, length, whitespace), a handshake that goes through (hello
// and answer intact, nothing read past it), every way one is refused (keys
// that differ, a forged proof, another purpose, another version, strangers
// on either side, a connection that ends, a silent peer), and the wire
// format itself, spelled out here so that a change to it shows.
#include "common/net/cluster_auth.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <future>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "tests/common/net/byte_text.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr uint32_t kControl = 1;
constexpr uint32_t kKv = 2;
const std::string kKeyA = "0123456789abcdef0123456789abcdef";
const std::string kKeyB = "fedcba9876543210fedcba9876543210";

// A non-blocking socket pair: the dialer's end and the listener's.
struct SocketPair {
  int dialer = -1;
  int listener = -1;

  SocketPair() {
    int fds[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds), 0);
    dialer = fds[0];
    listener = fds[1];
  }
  ~SocketPair() {
    close_dialer();
    if (listener >= 0) close(listener);
  }
  SocketPair(const SocketPair&) = delete;
  SocketPair& operator=(const SocketPair&) = delete;

  void close_dialer() {
    if (dialer >= 0) close(dialer);
    dialer = -1;
  }
};

// What `f` threw as a duet::Error, or "(no error)".
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A judge that counts its calls, keeps the hello it saw, and answers `answer`.
struct Judge {
  AuthAnswer answer;
  std::atomic<int> calls{0};
  std::vector<std::byte> hello;

  std::function<AuthAnswer(std::span<const std::byte>)> fn() {
    return [this](std::span<const std::byte> seen) {
      ++calls;
      hello.assign(seen.begin(), seen.end());
      return answer;
    };
  }
};

// The listener's side on a thread, with `key`, `purpose` and `patience`.
std::future<AuthAnswer> listen(SocketPair& pair, const ClusterKey& key, uint32_t purpose,
                               Judge& judge, std::chrono::milliseconds patience = 5s) {
  return std::async(std::launch::async, [&pair, &key, purpose, &judge, patience] {
    return authenticate_listener(pair.listener, key, purpose, judge.fn(), Clock::now() + patience);
  });
}

template <typename T>
std::string error_of_future(std::future<T>& future) {
  return error_of([&] { future.get(); });
}

// --- Raw bytes, for the peers written by hand --------------------------------

// Writes all of `bytes` (the socket has room: the messages are small).
void write_all(int fd, std::span<const std::byte> bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, 100);
      continue;
    }
    ASSERT_GT(n, 0) << strerror(errno);
    sent += static_cast<size_t>(n);
  }
}

// Exactly `n` bytes, or fewer when the connection ends or 5 s pass.
std::vector<std::byte> read_exact(int fd, size_t n) {
  std::vector<std::byte> out(n);
  size_t got = 0;
  const auto deadline = Clock::now() + 5s;
  while (got < n && Clock::now() < deadline) {
    const ssize_t r = recv(fd, out.data() + got, n - got, 0);
    if (r == 0) break;
    if (r < 0) {
      pollfd p{fd, POLLIN, 0};
      poll(&p, 1, 100);
      continue;
    }
    got += static_cast<size_t>(r);
  }
  out.resize(got);
  return out;
}

uint32_t get_u32(const std::byte* at) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= static_cast<uint32_t>(at[i]) << (8 * i);
  return value;
}

// (By resize and memcpy: GCC 12 warns falsely about insert() after push_back().)
void append(std::vector<std::byte>& out, std::span<const std::byte> bytes) {
  const size_t at = out.size();
  out.resize(at + bytes.size());
  if (!bytes.empty()) std::memcpy(out.data() + at, bytes.data(), bytes.size());
}

void put_u32(std::vector<std::byte>& out, uint32_t value) {
  std::array<std::byte, 4> bytes;
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<std::byte>((value >> (8 * i)) & 0xff);
  append(out, bytes);
}

// A message as cluster_auth.h says: "DUETAUTH", version and kind (uint16),
// the body's length (uint32, `length` when given), the body.
std::vector<std::byte> message(uint16_t version, uint16_t kind, std::span<const std::byte> body,
                               std::optional<uint32_t> length = std::nullopt) {
  std::vector<std::byte> out = bytes_of("DUETAUTH");
  put_u32(out, static_cast<uint32_t>(version) | static_cast<uint32_t>(kind) << 16);
  put_u32(out, length.value_or(static_cast<uint32_t>(body.size())));
  append(out, body);
  return out;
}

struct RawMessage {
  uint16_t version = 0;
  uint16_t kind = 0;
  std::vector<std::byte> body;
};

RawMessage read_message(int fd) {
  const std::vector<std::byte> header = read_exact(fd, 16);
  EXPECT_EQ(header.size(), 16u);
  if (header.size() < 16) return {};
  EXPECT_EQ(text_of(std::span(header).first(8)), "DUETAUTH");
  const uint32_t version_kind = get_u32(header.data() + 8);
  RawMessage m;
  m.version = static_cast<uint16_t>(version_kind & 0xffff);
  m.kind = static_cast<uint16_t>(version_kind >> 16);
  m.body = read_exact(fd, get_u32(header.data() + 12));
  return m;
}

std::vector<std::byte> challenge_body(uint32_t purpose, std::span<const std::byte> nonce) {
  std::vector<std::byte> body;
  put_u32(body, purpose);
  append(body, nonce);
  return body;
}

// HMAC(key, label || purpose || first || second), as the header says.
std::array<std::byte, 32> proof_of(const ClusterKey& key, std::string_view label, uint32_t purpose,
                                   std::span<const std::byte> first,
                                   std::span<const std::byte> second) {
  std::vector<std::byte> signed_bytes = bytes_of(label);
  put_u32(signed_bytes, purpose);
  append(signed_bytes, first);
  append(signed_bytes, second);
  return key.sign(signed_bytes);
}

struct DecodedAnswer {
  uint32_t accepted = 99;
  std::string reason;
  std::vector<std::byte> payload;
};

DecodedAnswer decode_answer(const RawMessage& m) {
  EXPECT_EQ(m.kind, 4);
  EXPECT_GE(m.body.size(), 8u);
  if (m.body.size() < 8) return {};
  DecodedAnswer a;
  a.accepted = get_u32(m.body.data());
  const uint32_t reason_bytes = get_u32(m.body.data() + 4);
  a.reason = text_of(std::span(m.body).subspan(8, reason_bytes));
  a.payload.assign(m.body.begin() + 8 + reason_bytes, m.body.end());
  return a;
}

// --- The handshake -----------------------------------------------------------

TEST(ClusterAuth, HelloAndAnswerArriveIntact) {
  SocketPair pair;
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  // Every byte value, and the largest hello there may be.
  std::vector<std::byte> hello(kClusterAuthMaxPayloadBytes);
  for (size_t i = 0; i < hello.size(); ++i) hello[i] = static_cast<std::byte>(i * 7 % 256);
  Judge judge;
  judge.answer = {true, bytes_of(std::string("welcome\0rank 3", 14)), ""};
  auto listener = listen(pair, key, kControl, judge);
  const std::vector<std::byte> answer =
      authenticate_dialer(pair.dialer, key, kControl, hello, Clock::now() + 5s);
  const AuthAnswer judged = listener.get();
  EXPECT_EQ(judge.calls, 1);
  EXPECT_EQ(judge.hello, hello);
  EXPECT_TRUE(judged.accepted);
  EXPECT_EQ(answer, judge.answer.payload);

  // The sockets are the callers' now, with nothing of theirs read.
  write_all(pair.listener, bytes_of("frames"));
  write_all(pair.dialer, bytes_of("more frames"));
  EXPECT_EQ(text_of(read_exact(pair.dialer, 6)), "frames");
  EXPECT_EQ(text_of(read_exact(pair.listener, 11)), "more frames");
}

TEST(ClusterAuth, EmptyHelloAndAnswer) {
  SocketPair pair;
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  Judge judge;
  judge.answer.accepted = true;
  auto listener = listen(pair, key, kKv, judge);
  EXPECT_TRUE(authenticate_dialer(pair.dialer, key, kKv, {}, Clock::now() + 5s).empty());
  EXPECT_TRUE(listener.get().accepted);
  EXPECT_TRUE(judge.hello.empty());
}

TEST(ClusterAuth, RefusalReachesTheDialer) {
  SocketPair pair;
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  Judge judge;
  judge.answer = {false, bytes_of("try 10.0.0.9"), "model qwen3-8b is not served by this cluster"};
  auto listener = listen(pair, key, kControl, judge);
  const std::string error = error_of(
      [&] { authenticate_dialer(pair.dialer, key, kControl, bytes_of("hi"), Clock::now() + 5s); });
  EXPECT_NE(error.find("refused: model qwen3-8b is not served by this cluster"), std::string::npos)
      << error;
  const AuthAnswer judged = listener.get();
  EXPECT_FALSE(judged.accepted);
  EXPECT_EQ(judged.reason, judge.answer.reason);
  EXPECT_EQ(judge.calls, 1);
}

TEST(ClusterAuth, KeysThatDifferStopTheDialerFirst) {
  // The dialer checks the listener's proof before it proves anything itself:
  // whichever side holds the "wrong" key, the dialer finds it, sends nothing
  // more, and the listener sees it hang up.
  SocketPair pair;
  const ClusterKey listener_key = ClusterKey::from_bytes(kKeyA);
  const ClusterKey dialer_key = ClusterKey::from_bytes(kKeyB);
  Judge judge;
  auto listener = listen(pair, listener_key, kControl, judge);
  const std::string dialer_error = error_of([&] {
    authenticate_dialer(pair.dialer, dialer_key, kControl, bytes_of("hi"), Clock::now() + 5s);
  });
  EXPECT_NE(dialer_error.find("did not prove the cluster key"), std::string::npos) << dialer_error;
  EXPECT_NE(dialer_error.find("a local socket"), std::string::npos) << dialer_error;
  pair.close_dialer();  // as its caller does
  const std::string listener_error = error_of_future(listener);
  EXPECT_NE(listener_error.find("closed the connection instead of proving the cluster key"),
            std::string::npos)
      << listener_error;
  EXPECT_EQ(judge.calls, 0);
}

TEST(ClusterAuth, ForgedDialerProofIsRefused) {
  // A dialer that goes on although it cannot prove the key: the listener
  // says why and never judges its hello.
  SocketPair pair;
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  const ClusterKey other = ClusterKey::from_bytes(kKeyB);
  Judge judge;
  auto listener = listen(pair, key, kControl, judge);

  const std::vector<std::byte> dialer_nonce(32, std::byte{7});
  write_all(pair.dialer, message(1, 1, challenge_body(kControl, dialer_nonce)));
  const RawMessage proof = read_message(pair.dialer);
  ASSERT_EQ(proof.kind, 2);
  ASSERT_EQ(proof.body.size(), 64u);
  const std::span<const std::byte> listener_nonce = std::span(proof.body).first(32);
  // The listener's proof is as documented.
  EXPECT_EQ(hex_of(std::span(proof.body).subspan(32)),
            hex_of(proof_of(key, "duet listener", kControl, dialer_nonce, listener_nonce)));

  std::vector<std::byte> hello;
  append(hello, proof_of(other, "duet dialer", kControl, listener_nonce, dialer_nonce));
  append(hello, bytes_of("let me in"));
  write_all(pair.dialer, message(1, 3, hello));
  const DecodedAnswer answer = decode_answer(read_message(pair.dialer));
  EXPECT_EQ(answer.accepted, 0u);
  EXPECT_EQ(answer.reason, "the cluster key does not match");

  try {
    listener.get();
    FAIL() << "a forged proof was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()),
              "refused a connection from a local socket: the cluster key does not match");
  }
  EXPECT_EQ(judge.calls, 0);
}

TEST(ClusterAuth, ReflectedProofIsRefused) {
  // The listener's own proof sent back as the dialer's, with the nonces
  // swapped to fit: the labels differ, so it does not pass.
  SocketPair pair;
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  Judge judge;
  auto listener = listen(pair, key, kControl, judge);
  const std::vector<std::byte> dialer_nonce(32, std::byte{9});
  write_all(pair.dialer, message(1, 1, challenge_body(kControl, dialer_nonce)));
  const RawMessage proof = read_message(pair.dialer);
  ASSERT_EQ(proof.body.size(), 64u);
  std::vector<std::byte> hello(proof.body.begin() + 32, proof.body.end());
  write_all(pair.dialer, message(1, 3, hello));
  EXPECT_EQ(decode_answer(read_message(pair.dialer)).reason, "the cluster key does not match");
  EXPECT_NE(error_of_future(listener).find("cluster key does not match"), std::string::npos);
  EXPECT_EQ(judge.calls, 0);
}

TEST(ClusterAuth, TheDialersProofAsDocumented) {
  // A listener written by hand from the header's description: the dialer
  // takes its proof, proves itself as documented, and reads no byte past
  // the answer although the frames that follow came in the same write.
  SocketPair pair;
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  auto dialer = std::async(std::launch::async, [&] {
    return authenticate_dialer(pair.dialer, key, kKv, bytes_of("hello"), Clock::now() + 5s);
  });
  const RawMessage challenge = read_message(pair.listener);
  ASSERT_EQ(challenge.version, 1);
  ASSERT_EQ(challenge.kind, 1);
  ASSERT_EQ(challenge.body.size(), 36u);
  EXPECT_EQ(get_u32(challenge.body.data()), kKv);
  const std::span<const std::byte> dialer_nonce = std::span(challenge.body).subspan(4);
  const std::vector<std::byte> listener_nonce(32, std::byte{0x5a});
  std::vector<std::byte> proof = listener_nonce;
  append(proof, proof_of(key, "duet listener", kKv, dialer_nonce, listener_nonce));
  write_all(pair.listener, message(1, 2, proof));

  const RawMessage hello = read_message(pair.listener);
  ASSERT_EQ(hello.kind, 3);
  ASSERT_EQ(hello.body.size(), 32u + 5u);
  EXPECT_EQ(hex_of(std::span(hello.body).first(32)),
            hex_of(proof_of(key, "duet dialer", kKv, listener_nonce, dialer_nonce)));
  EXPECT_EQ(text_of(std::span(hello.body).subspan(32)), "hello");

  std::vector<std::byte> answer;
  put_u32(answer, 1);
  put_u32(answer, 0);
  append(answer, bytes_of("granted"));
  std::vector<std::byte> both = message(1, 4, answer);
  append(both, bytes_of("FRAME"));
  write_all(pair.listener, both);
  EXPECT_EQ(text_of(dialer.get()), "granted");
  EXPECT_EQ(text_of(read_exact(pair.dialer, 5)), "FRAME");
}

TEST(ClusterAuth, AnotherPurposeIsRefused) {
  SocketPair pair;
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  Judge judge;
  judge.answer.accepted = true;
  auto listener = listen(pair, key, kControl, judge);
  const std::string dialer_error = error_of(
      [&] { authenticate_dialer(pair.dialer, key, kKv, bytes_of("hi"), Clock::now() + 5s); });
  EXPECT_NE(dialer_error.find("refused: "), std::string::npos) << dialer_error;
  EXPECT_NE(dialer_error.find("purpose 2"), std::string::npos) << dialer_error;
  const std::string listener_error = error_of_future(listener);
  EXPECT_NE(listener_error.find("refused a connection from a local socket"), std::string::npos)
      << listener_error;
  EXPECT_EQ(judge.calls, 0);
}

TEST(ClusterAuth, AStrangerIsRefusedAtOnce) {
  for (const std::string_view garbage : {"GET / HTTP/1.1\r\n\r\n", "GE"}) {
    SocketPair pair;
    const ClusterKey key = ClusterKey::from_bytes(kKeyA);
    Judge judge;
    const auto start = Clock::now();
    auto listener = listen(pair, key, kControl, judge, 30s);
    write_all(pair.dialer, bytes_of(garbage));
    const std::string error = error_of_future(listener);
    EXPECT_LT(Clock::now() - start, 3s) << garbage;
    EXPECT_EQ(error, "refused a connection from a local socket: not a Duet cluster connection");
    EXPECT_EQ(judge.calls, 0);
    // Nothing is sent to a stranger.
    EXPECT_EQ(recv(pair.dialer, std::array<char, 1>{}.data(), 1, 0), -1);
  }
}

TEST(ClusterAuth, AnOversizedMessageIsAStrangers) {
  SocketPair pair;
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  Judge judge;
  auto listener = listen(pair, key, kControl, judge);
  write_all(pair.dialer, message(1, 1, {}, uint32_t{1} << 20));
  const std::string error = error_of_future(listener);
  EXPECT_NE(error.find("not a Duet cluster connection (a 1048576-byte message"), std::string::npos)
      << error;
}

TEST(ClusterAuth, TheDialerRefusesAStranger) {
  SocketPair pair;
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  write_all(pair.listener, bytes_of("HTTP/1.1 400 Bad Request\r\n\r\n"));
  const std::string error = error_of(
      [&] { authenticate_dialer(pair.dialer, key, kControl, bytes_of("hi"), Clock::now() + 5s); });
  EXPECT_EQ(error, "the coordinator at a local socket does not speak Duet's cluster protocol");
}

TEST(ClusterAuth, AnotherVersionIsNamed) {
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  {  // A newer dialer: refused, in the listener's version.
    SocketPair pair;
    Judge judge;
    auto listener = listen(pair, key, kControl, judge);
    write_all(pair.dialer,
              message(2, 1, challenge_body(kControl, std::vector<std::byte>(32, std::byte{1}))));
    const RawMessage refusal = read_message(pair.dialer);
    EXPECT_EQ(refusal.version, 1);
    const DecodedAnswer answer = decode_answer(refusal);
    EXPECT_EQ(answer.accepted, 0u);
    EXPECT_NE(answer.reason.find("version 1"), std::string::npos) << answer.reason;
    try {
      listener.get();
      FAIL() << "version 2 was taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
      const std::string what = e.what();
      EXPECT_NE(what.find("version 2"), std::string::npos) << what;
      EXPECT_NE(what.find("version 1"), std::string::npos) << what;
    }
  }
  {  // A newer listener.
    SocketPair pair;
    auto listener = std::async(std::launch::async, [&] {
      read_message(pair.listener);
      write_all(pair.listener, message(2, 2, std::vector<std::byte>(64)));
    });
    try {
      authenticate_dialer(pair.dialer, key, kControl, bytes_of("hi"), Clock::now() + 5s);
      FAIL() << "version 2 was taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
      EXPECT_EQ(std::string(e.what()),
                "the coordinator at a local socket speaks cluster protocol version 2; this build "
                "speaks version 1");
    }
    listener.get();
  }
}

TEST(ClusterAuth, AnUnprovenAcceptanceIsRefused) {
  // An answer that accepts in place of the listener's proof.
  SocketPair pair;
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  std::vector<std::byte> answer;
  put_u32(answer, 1);
  put_u32(answer, 0);
  write_all(pair.listener, message(1, 4, answer));
  const std::string error = error_of(
      [&] { authenticate_dialer(pair.dialer, key, kControl, bytes_of("hi"), Clock::now() + 5s); });
  EXPECT_NE(error.find("accepted without proving the cluster key"), std::string::npos) << error;
}

TEST(ClusterAuth, AConnectionThatEnds) {
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  {
    SocketPair pair;
    Judge judge;
    auto listener = listen(pair, key, kControl, judge);
    pair.close_dialer();
    const std::string error = error_of_future(listener);
    EXPECT_NE(error.find("closed the connection before the challenge came"), std::string::npos)
        << error;
  }
  {
    SocketPair pair;
    close(pair.listener);
    pair.listener = -1;
    const std::string error = error_of([&] {
      authenticate_dialer(pair.dialer, key, kControl, bytes_of("hi"), Clock::now() + 5s);
    });
    EXPECT_NE(error.find("the coordinator at"), std::string::npos) << error;
  }
}

TEST(ClusterAuth, ASilentPeerRunsIntoTheDeadline) {
  const ClusterKey key = ClusterKey::from_bytes(kKeyA);
  {
    SocketPair pair;
    const auto start = Clock::now();
    const std::string error = error_of([&] {
      authenticate_dialer(pair.dialer, key, kControl, bytes_of("hi"), Clock::now() + 200ms);
    });
    const auto took = Clock::now() - start;
    EXPECT_GE(took, 200ms);
    EXPECT_LT(took, 5s);
    EXPECT_EQ(error.rfind("timed out after ", 0), 0u) << error;
    EXPECT_NE(error.find(" ms waiting for the proof of the cluster key from the coordinator at"),
              std::string::npos)
        << error;
  }
  {
    SocketPair pair;
    Judge judge;
    const auto start = Clock::now();
    auto listener = listen(pair, key, kControl, judge, 200ms);
    const std::string error = error_of_future(listener);
    const auto took = Clock::now() - start;
    EXPECT_GE(took, 200ms);
    EXPECT_LT(took, 5s);
    EXPECT_NE(error.find("waiting for the challenge from the dialer at a local socket"),
              std::string::npos)
        << error;
  }
}

}  // namespace
}  // namespace duet
