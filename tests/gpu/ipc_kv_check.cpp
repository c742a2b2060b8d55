// A prefill process and a decode process on one GPU, moving a prompt's KV
// through the real CudaIpcKvLink (worker/transfer/device/cuda_ipc_kv_link.h), as two
// ranks of one host do under mpirun. The check forks both itself (no
// mpirun); the IPC handles, the rows headers and the acks travel over a
// socketpair, as they would over MPI.
//
//   prefill: loads the model on the GPU, runs the prompt; after each layer
//            sends its rows (packed into its exported staging) and a header;
//            samples the first token and hands it off.
//   decode:  opens the prefill's handles, takes every layer's rows into
//            other blocks of its own device KV, acks each, then decodes
//            greedily from the first token.
//   parent:  (after both, so that no CUDA context crosses a fork) runs the
//            same prompt in one process on the GPU: the decode process must
//            produce the same tokens.
//
// Then a burst of 8 MiB payloads (a synthetic 8-KV-head, 128-dim layout)
// measures the IPC transfer rate, against the device's own copy of the same
// payloads (one copy at a time, as the receiver takes them).
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <numeric>
#include <thread>
#include <vector>

#include "common/error.h"
#include "kernels/cuda/backend.h"
#include "tests/gpu/forward_runs.h"
#include "tests/gpu/gpu_check.h"
#include "tests/test_paths.h"
#include "worker/kv/kv_cache.h"
#include "worker/model/cuda_forward.h"
#include "worker/model/llama_model.h"
#include "worker/transfer/device/cuda_ipc_kv_link.h"

namespace duet {
namespace {

using gpu_check::blocks_from;

constexpr int kPrefillRank = 0;
constexpr int kDecodeRank = 1;
constexpr int64_t kBlocks = 64;
constexpr int64_t kSteps = 24;  // greedy tokens after the first
constexpr int kBurst = 48;      // payloads in the bandwidth burst
const std::vector<int32_t> kPrompt = {1,    9690, 198, 2683,  359,  253,  5356, 5646, 11173,
                                      3365, 3511, 308, 34519, 28,   7018, 411,  407,  19712,
                                      8182, 2,    1,   504,   3458, 282,  4649, 30,   198};

// One message on the socketpair.
struct Message {
  enum Kind : uint32_t { kRows = 1, kHandoff, kAck, kBurstRows, kBurstDone, kTokens } kind{};
  int64_t layer = 0, pos0 = 0, n = 0;
  DeviceRowsTicket ticket;
  int32_t value = 0;  // the first token
};

void write_all(int fd, const void* data, size_t size) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t w = ::write(fd, p, size);
    DUET_REQUIRE(w > 0, "socketpair write failed: {}", std::strerror(errno));
    p += w;
    size -= static_cast<size_t>(w);
  }
}

void read_all(int fd, void* data, size_t size) {
  auto* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t r = ::read(fd, p, size);
    DUET_REQUIRE(r > 0, "socketpair read failed: {}", r == 0 ? "closed" : std::strerror(errno));
    p += r;
    size -= static_cast<size_t>(r);
  }
}

Message read_message(int fd) {
  Message m;
  read_all(fd, &m, sizeof m);
  return m;
}

std::filesystem::path model_path() {
  if (auto path = testing::default_model_path()) return *path;
  return testing::fixture_path("fixtures/tiny_kquant/tiny_mixed_gqa_tied.gguf");  // head_dim 64
}

std::vector<int32_t> prompt_for(const LlamaModel& model) {
  std::vector<int32_t> prompt = kPrompt;
  for (int32_t& t : prompt) t %= static_cast<int32_t>(model.config().n_vocab);
  return prompt;
}

KvLayout burst_layout() {
  KvLayout layout;
  layout.n_layers = 1;
  layout.n_kv_heads = 8;
  layout.head_dim = 128;
  layout.block_size = 16;
  layout.n_blocks = 128;  // 2048 positions: 8 MiB of K and V
  return layout;
}

// ---------------------------------------------------------------- the prefill process

int run_prefill(int fd) {
  CudaIpcKvLink::Options options;
  options.send_staging_bytes = size_t{64} << 20;  // the burst waits for acks
  CudaIpcKvLink transfer(0, true, false, options);
  transfer.add_receiver(kDecodeRank);
  const std::vector<std::byte> exported = transfer.exported();
  write_all(fd, exported.data(), exported.size());

  // Acks come back while this thread sends: another thread frees the staging.
  std::atomic<int> acks{0};
  std::thread acker([&] {
    try {
      for (;;) {
        const Message m = read_message(fd);
        if (m.kind != Message::kAck) return;  // kBurstDone: the decode side is finished
        transfer.released(kDecodeRank, m.ticket);
        ++acks;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "  prefill process, acks: %s\n", e.what());
    }
  });
  // However this function ends, the acker is joined (an error below first
  // shuts the socket, which ends its read), so no joinable thread unwinds.
  struct Joined {
    std::thread& thread;
    int fd;
    ~Joined() {
      if (!thread.joinable()) return;
      ::shutdown(fd, SHUT_RDWR);
      thread.join();
    }
  } joined{acker, fd};

  auto model = LlamaModel::load(model_path());
  CudaForward forward(*model, 0);
  const KvLayout layout = model->kv_layout(kBlocks);
  KvCache staging(layout);
  const DeviceKv kv = forward.device_kv(layout);
  const std::vector<int32_t> prompt = prompt_for(*model);
  const auto n = static_cast<int64_t>(prompt.size());
  const std::vector<int32_t> table = blocks_from(3, 8);
  const ForwardSequence whole{table, 0, n};
  const int64_t last = n - 1;
  forward.run(prompt, {&whole, 1}, staging, {&last, 1}, nullptr, [&](int64_t layer) {
    const auto ticket =
        transfer.send(kDecodeRank, layout, kv, layer, table, 0, n, all_kv_heads(layout));
    DUET_REQUIRE(ticket.has_value(), "layer {}: the send staging stayed full", layer);
    Message m{Message::kRows, layer, 0, n, *ticket, 0};
    write_all(fd, &m, sizeof m);
  });
  const DeviceSampling greedy;
  int32_t first = 0;
  forward.sample({&greedy, 1}, {&first, 1});
  Message handoff{Message::kHandoff, 0, 0, 0, {}, first};
  write_all(fd, &handoff, sizeof handoff);

  // The burst: 8 MiB payloads from a synthetic cache of this GPU.
  const KvLayout big = burst_layout();
  cuda::DeviceBuffer cache(big.total_bytes());
  cuda::CudaBackend backend(0);
  const DeviceKv burst_kv{cache.as<KvElement>(), 0, backend.stream()};
  const std::vector<int32_t> burst_table = blocks_from(0, big.n_blocks);
  const int64_t positions = big.n_blocks * big.block_size;
  for (int i = 0; i < kBurst; ++i) {
    const auto ticket =
        transfer.send(kDecodeRank, big, burst_kv, 0, burst_table, 0, positions, all_kv_heads(big));
    DUET_REQUIRE(ticket.has_value(), "burst payload {}: the send staging stayed full", i);
    Message m{Message::kBurstRows, 0, 0, positions, *ticket, 0};
    write_all(fd, &m, sizeof m);
  }
  acker.join();
  return acks == model->config().n_layers + kBurst ? 0 : 1;
}

// ---------------------------------------------------------------- the decode process

// Takes the payload of `m` and returns when it is in place; acks it.
void take(CudaIpcKvLink& transfer, int fd, const Message& m, const KvLayout& layout,
          const DeviceKv& kv, std::span<const int32_t> table) {
  const uint64_t receipt = transfer.receive(kPrefillRank, m.ticket, layout, &kv, table, m.layer,
                                            m.pos0, m.n, all_kv_heads(layout));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    for (const auto& done : transfer.poll()) {
      DUET_REQUIRE(done.receipt == receipt && done.ok, "receipt {} ended badly", done.receipt);
      Message ack{Message::kAck, 0, 0, 0, *done.ack, 0};
      write_all(fd, &ack, sizeof ack);
      return;
    }
    DUET_REQUIRE(std::chrono::steady_clock::now() < deadline, "a payload did not land in 20 s");
  }
}

int run_decode(int fd, int result_fd) {
  std::vector<std::byte> exported(CudaIpcKvLink::kExportBytes);
  read_all(fd, exported.data(), exported.size());
  CudaIpcKvLink::Options options;
  options.receive_staging_bytes = size_t{64} << 20;
  CudaIpcKvLink transfer(0, false, true, options);
  transfer.add_sender(kPrefillRank, exported);

  auto model = LlamaModel::load(model_path());
  CudaForward forward(*model, 0);
  const KvLayout layout = model->kv_layout(kBlocks);
  KvCache staging(layout);
  const DeviceKv kv = forward.device_kv(layout);
  const std::vector<int32_t> table = blocks_from(40, 8);  // not the prefill side's blocks
  std::vector<int32_t> tokens = prompt_for(*model);
  int64_t layers = 0;
  for (;;) {
    const Message m = read_message(fd);
    if (m.kind == Message::kHandoff) {
      tokens.push_back(m.value);
      break;
    }
    DUET_REQUIRE(m.kind == Message::kRows, "unexpected message {}", static_cast<int>(m.kind));
    take(transfer, fd, m, layout, kv, table);
    ++layers;
  }
  DUET_REQUIRE(layers == model->config().n_layers, "{} layers arrived of {}", layers,
               model->config().n_layers);
  const std::vector<int32_t> decoded =
      gpu_check::greedy_decode(forward, staging, {&table, 1}, {tokens}, kSteps, false)[0];

  // The burst, timed from the first header to the last payload in place.
  const KvLayout big = burst_layout();
  cuda::DeviceBuffer cache(big.total_bytes());
  const DeviceKv burst_kv{cache.as<KvElement>(), 0, nullptr};
  const std::vector<int32_t> burst_table = blocks_from(0, big.n_blocks);
  double seconds = 0;
  uint64_t bytes = 0;
  for (int i = 0; i < kBurst; ++i) {
    const Message m = read_message(fd);
    const auto start = std::chrono::steady_clock::now();
    take(transfer, fd, m, big, burst_kv, burst_table);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    bytes += m.ticket.bytes;
  }
  Message done{Message::kBurstDone, 0, 0, 0, {}, 0};
  write_all(fd, &done, sizeof done);

  const auto n_tokens = static_cast<int64_t>(decoded.size());
  write_all(result_fd, &n_tokens, sizeof n_tokens);
  write_all(result_fd, decoded.data(), decoded.size() * sizeof(int32_t));
  write_all(result_fd, &bytes, sizeof bytes);
  write_all(result_fd, &seconds, sizeof seconds);
  return 0;
}

int child(const char* what, const std::function<int()>& body) {
  // A peer that died closes the socket: writes then fail with EPIPE, saying
  // so, instead of killing this process without a word.
  std::signal(SIGPIPE, SIG_IGN);
  try {
    return body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "  %s process: %s\n", what, e.what());
    return 1;
  }
}

// Waits for `pid` up to `seconds`; kills it after. Its exit status, or -1.
int wait_for(pid_t pid, int seconds) {
  for (int i = 0; i < seconds * 10; ++i) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return -1;
}

// The device's copy rate (bytes copied per second, one way) on `count`
// device-to-device copies of `bytes` each, each waited for.
double copy_rate(cuda::CudaBackend& backend, size_t bytes, int count) {
  cuda::DeviceBuffer from(bytes), to(bytes);
  backend.copy(to.data(), from.data(), bytes);
  backend.synchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < count; ++i) {
    backend.copy(to.data(), from.data(), bytes);
    backend.synchronize();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(count) * static_cast<double>(bytes) / s;
}

}  // namespace
}  // namespace duet

int main() {
  using namespace duet;
  // No CUDA call before the forks: a CUDA context does not survive fork().
  if (!std::filesystem::exists("/dev/nvidia0") && !std::filesystem::exists("/dev/nvidiactl")) {
    std::printf("no CUDA device: skipped\n");
    return gpu_check::kSkipped;
  }
  int sockets[2], results[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sockets) != 0 || ::pipe(results) != 0) {
    std::perror("socketpair");
    return 1;
  }
  const pid_t prefill = ::fork();
  if (prefill == 0) {
    ::close(sockets[1]);
    ::_exit(child("prefill", [&] { return run_prefill(sockets[0]); }));
  }
  const pid_t decode = ::fork();
  if (decode == 0) {
    ::close(sockets[0]);
    ::_exit(child("decode", [&] { return run_decode(sockets[1], results[1]); }));
  }
  ::close(sockets[0]);
  ::close(sockets[1]);
  ::close(results[1]);
  const int decode_status = wait_for(decode, 240);
  const int prefill_status = wait_for(prefill, 30);
  std::printf("[ case ] two processes, one GPU, KV over CUDA IPC\n");
  std::printf("    model %s\n", model_path().filename().c_str());
  std::printf("    prefill process exit %d, decode process exit %d\n", prefill_status,
              decode_status);
  if (prefill_status != 0 || decode_status != 0) {
    gpu_check::fail("a process failed");
    return gpu_check::finish();
  }
  int64_t n_tokens = 0;
  read_all(results[0], &n_tokens, sizeof n_tokens);
  std::vector<int32_t> decoded(static_cast<size_t>(n_tokens));
  read_all(results[0], decoded.data(), decoded.size() * sizeof(int32_t));
  uint64_t burst_bytes = 0;
  double burst_seconds = 0;
  read_all(results[0], &burst_bytes, sizeof burst_bytes);
  read_all(results[0], &burst_seconds, sizeof burst_seconds);

  gpu_check::run_case("the decode process's tokens are the single-process GPU run's", [&] {
    auto model = LlamaModel::load(model_path());
    CudaForward forward(*model, 0);
    const KvLayout layout = model->kv_layout(kBlocks);
    KvCache staging(layout);
    std::vector<int32_t> tokens = prompt_for(*model);
    const std::vector<int32_t> table = blocks_from(0, 8);
    const auto n = static_cast<int64_t>(tokens.size());
    const ForwardSequence whole{table, 0, n};
    const int64_t last = n - 1;
    forward.run(tokens, {&whole, 1}, staging, {&last, 1}, nullptr);
    const DeviceSampling greedy;
    int32_t first = 0;
    forward.sample({&greedy, 1}, {&first, 1});
    tokens.push_back(first);
    const std::vector<int32_t> alone =
        gpu_check::greedy_decode(forward, staging, {&table, 1}, {tokens}, kSteps, false)[0];
    size_t same = 0;
    while (same < alone.size() && same < decoded.size() && alone[same] == decoded[same]) ++same;
    std::printf("    %zu of %zu tokens equal (prompt %zu, then %lld generated)\n", same,
                alone.size(), kPrompt.size(), static_cast<long long>(kSteps + 1));
    if (decoded != alone) gpu_check::fail("the two-process tokens differ from position %zu", same);
  });
  gpu_check::run_case("IPC transfer rate against the device's copy rate", [&] {
    cuda::CudaBackend backend(0);
    if (burst_bytes == 0 || !(burst_seconds > 0)) {
      gpu_check::fail("the burst moved %llu bytes in %g s",
                      static_cast<unsigned long long>(burst_bytes), burst_seconds);
      return;
    }
    const size_t payload = burst_bytes / kBurst;
    const double copy = copy_rate(backend, payload, kBurst);
    const double ipc = static_cast<double>(burst_bytes) / burst_seconds;
    std::printf(
        "    device copy of the same %d payloads of %.1f MiB %.1f GB/s; IPC %.1f GB/s (%.2f of "
        "the copy; timed on the receiver: its copy across and its unpack)\n",
        kBurst, static_cast<double>(payload) / (1 << 20), copy / 1e9, ipc / 1e9, ipc / copy);
  });
  return gpu_check::finish();
}
