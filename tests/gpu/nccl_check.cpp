// NcclCollective (worker/parallel/nccl_collective.h) on the GPUs there are. On device
// 0, a one-rank communicator: all_reduce_sum and broadcast leave their data
// as it was, all_gather copies; the same three captured into a CUDA graph and
// replayed with new inputs; the caller's errors; abort(). With two or more
// GPUs, a two-rank communicator on devices 0 and 1 (on_devices), one thread
// per rank, with distinct inputs: sums, gathers and broadcasts from either
// root are exact on both ranks (the inputs are small multiples of 1/4, so
// any order of addition gives the same bits). With one GPU that case is
// skipped, saying why.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/check.h"
#include "tests/gpu/gpu_check.h"
#include "worker/parallel/nccl_collective.h"

namespace duet {
namespace {

using gpu_check::expect_close;
using gpu_check::fail;

// A non-blocking stream of the device current when it was made.
class Stream {
 public:
  Stream() { DUET_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const { return stream_; }
  void* handle() const { return stream_; }  // what DeviceCollective takes
  void synchronize() const { DUET_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

// An instantiated graph, destroyed before the communicators it captured
// (their destruction waits for it).
class GraphExec {
 public:
  explicit GraphExec(cudaGraphExec_t exec) : exec_(exec) {}
  ~GraphExec() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  }
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;

  void launch(const Stream& stream) const { DUET_CUDA_CHECK(cudaGraphLaunch(exec_, stream.get())); }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// Records what `body` queues on `stream` (in the CUDA backend's capture mode)
// into a graph.
std::unique_ptr<GraphExec> capture(const Stream& stream, const std::function<void()>& body) {
  DUET_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  try {
    body();
  } catch (...) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(stream.get(), &broken);
    if (broken != nullptr) cudaGraphDestroy(broken);
    throw;
  }
  cudaGraph_t graph = nullptr;
  DUET_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  DUET_CUDA_CHECK(status);
  return std::make_unique<GraphExec>(exec);
}

template <typename T>
void upload(const cuda::DeviceBuffer& to, const std::vector<T>& from, const Stream& stream) {
  DUET_CUDA_CHECK(cudaMemcpyAsync(to.data(), from.data(), from.size() * sizeof(T),
                                  cudaMemcpyHostToDevice, stream.get()));
}

template <typename T>
std::vector<T> download(const cuda::DeviceBuffer& from, size_t n, const Stream& stream) {
  std::vector<T> host(n);
  DUET_CUDA_CHECK(cudaMemcpyAsync(host.data(), from.data(), n * sizeof(T), cudaMemcpyDeviceToHost,
                                  stream.get()));
  stream.synchronize();
  return host;
}

// Fills a buffer with 0xff bytes (NaN as floats), so that an output nobody
// wrote fails its check.
void poison(const cuda::DeviceBuffer& buffer, const Stream& stream) {
  DUET_CUDA_CHECK(cudaMemsetAsync(buffer.data(), 0xff, buffer.bytes(), stream.get()));
}

// Small multiples of 1/4 (sums of a few are exact), different for every seed.
std::vector<float> pattern(int64_t n, int seed) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = static_cast<float>((i * 7 + seed * 13) % 101 - 50) * 0.25f;
  return v;
}

std::vector<uint8_t> byte_pattern(size_t n, int seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 31 + static_cast<size_t>(seed));
  return v;
}

void expect_bytes(const char* what, const std::vector<uint8_t>& got,
                  const std::vector<uint8_t>& want) {
  size_t first = 0;
  while (first < got.size() && first < want.size() && got[first] == want[first]) ++first;
  const bool ok = got.size() == want.size() && first == want.size();
  std::printf("    %-44s %s\n", what, ok ? "equal" : "differ  <-- FAILED");
  if (!ok) fail("%s: byte %zu differs (%zu bytes, want %zu)", what, first, got.size(), want.size());
}

template <typename Body>
void expect_error(const char* what, ErrorKind kind, Body body) {
  try {
    body();
  } catch (const Error& e) {
    const bool ok = e.kind() == kind;
    std::printf("    %-44s %s: %s\n", what, ok ? "throws" : "wrong kind  <-- FAILED", e.what());
    if (!ok)
      fail("%s: error kind %d, want %d", what, static_cast<int>(e.kind()), static_cast<int>(kind));
    return;
  }
  std::printf("    %-44s no error  <-- FAILED\n", what);
  fail("%s: no error", what);
}

constexpr int64_t kFloats = 1027;  // not a multiple of any vector width
constexpr size_t kBytes = 333;

void check_one_rank() {
  NcclCollective nccl(NcclCollective::unique_id(), 0, 1, 0);
  GPU_EXPECT(nccl.rank() == 0 && nccl.size() == 1 && nccl.device() == 0);
  DeviceCollective& collective = nccl;
  const Stream stream;
  const std::vector<float> x = pattern(kFloats, 1);
  const std::vector<uint8_t> b = byte_pattern(kBytes, 2);
  const cuda::DeviceBuffer data(x.size() * sizeof(float)), all(x.size() * sizeof(float));
  const cuda::DeviceBuffer bytes(kBytes);

  upload(data, x, stream);
  collective.all_reduce_sum(data.as<float>(), kFloats, stream.handle());
  expect_close("all_reduce_sum leaves data", download<float>(data, x.size(), stream), x, 0.0);

  poison(all, stream);
  collective.all_gather(data.as<float>(), all.as<float>(), kFloats, stream.handle());
  expect_close("all_gather copies mine to all", download<float>(all, x.size(), stream), x, 0.0);

  upload(bytes, b, stream);
  collective.broadcast(bytes.data(), kBytes, 0, stream.handle());
  expect_bytes("broadcast from root 0 keeps data", download<uint8_t>(bytes, kBytes, stream), b);

  // Empty operations queue nothing, whatever the pointers.
  collective.all_reduce_sum(nullptr, 0, stream.handle());
  collective.all_gather(nullptr, nullptr, 0, stream.handle());
  collective.broadcast(nullptr, 0, 0, stream.handle());
  stream.synchronize();
}

void check_graph() {
  NcclCollective nccl(NcclCollective::unique_id(), 0, 1, 0);
  DeviceCollective& collective = nccl;
  const Stream stream;
  const cuda::DeviceBuffer data(kFloats * sizeof(float)), all(kFloats * sizeof(float));
  const cuda::DeviceBuffer bytes(kBytes);
  auto step = [&] {
    collective.all_reduce_sum(data.as<float>(), kFloats, stream.handle());
    collective.all_gather(data.as<float>(), all.as<float>(), kFloats, stream.handle());
    collective.broadcast(bytes.data(), kBytes, 0, stream.handle());
  };
  // Once eagerly, as the engine runs a step before it captures one.
  const std::vector<float> x_eager = pattern(kFloats, 3);
  const std::vector<uint8_t> b_eager = byte_pattern(kBytes, 3);
  upload(data, x_eager, stream);
  upload(bytes, b_eager, stream);
  step();
  stream.synchronize();

  poison(all, stream);
  stream.synchronize();
  const std::unique_ptr<GraphExec> graph = capture(stream, step);
  const std::vector<float> untouched = download<float>(all, kFloats, stream);
  GPU_EXPECT(std::isnan(untouched[0]) && std::isnan(untouched.back()));  // capture ran nothing

  for (int replay = 1; replay <= 2; ++replay) {
    const std::vector<float> x = pattern(kFloats, 10 + replay);
    const std::vector<uint8_t> b = byte_pattern(kBytes, 10 + replay);
    upload(data, x, stream);
    upload(bytes, b, stream);
    poison(all, stream);
    graph->launch(stream);
    const std::string tag = " (replay " + std::to_string(replay) + ")";
    expect_close(("all_reduce_sum" + tag).c_str(), download<float>(data, x.size(), stream), x, 0.0);
    expect_close(("all_gather" + tag).c_str(), download<float>(all, x.size(), stream), x, 0.0);
    expect_bytes(("broadcast" + tag).c_str(), download<uint8_t>(bytes, kBytes, stream), b);
  }
}

void check_errors() {
  const std::vector<std::byte> id = NcclCollective::unique_id();
  GPU_EXPECT(!id.empty());
  int n_devices = 0;
  DUET_CUDA_CHECK(cudaGetDeviceCount(&n_devices));
  const std::span<const std::byte> short_id = std::span(id).first(5);
  expect_error("a unique id of 5 bytes", ErrorKind::kInvalidArgument,
               [&] { NcclCollective nccl(short_id, 0, 1, 0); });
  expect_error("rank 1 of 1", ErrorKind::kInvalidArgument,
               [&] { NcclCollective nccl(id, 1, 1, 0); });
  expect_error("a device past the last", ErrorKind::kUnsupported,
               [&] { NcclCollective nccl(id, 0, 1, n_devices); });
  expect_error("on_devices of no device", ErrorKind::kInvalidArgument,
               [&] { NcclCollective::on_devices({}); });
  const std::vector<int> twice = {0, 0};
  expect_error("on_devices of cuda:0 twice", ErrorKind::kInvalidArgument,
               [&] { NcclCollective::on_devices(twice); });
  NcclCollective nccl(id, 0, 1, 0);
  expect_error("broadcast from root 1 of 1", ErrorKind::kInvalidArgument,
               [&] { nccl.broadcast(nullptr, 0, 1, nullptr); });
  expect_error("all_reduce_sum of -1 floats", ErrorKind::kInvalidArgument,
               [&] { nccl.all_reduce_sum(nullptr, -1, nullptr); });
}

void check_abort() {
  NcclCollective nccl(NcclCollective::unique_id(), 0, 1, 0);
  nccl.abort();
  expect_error("an operation after abort", ErrorKind::kInvalidArgument,
               [&] { nccl.all_reduce_sum(nullptr, 0, nullptr); });
  nccl.abort();  // a second does nothing; the destructor destroys nothing more
}

// What one rank of the two-rank case saw.
struct RankResult {
  std::vector<float> sum;           // (n)
  std::vector<float> gathered;      // (2 * n)
  std::vector<uint8_t> from_root0;  // (kBytes)
  std::vector<uint8_t> from_root1;  // (kBytes)
  std::exception_ptr error;
};

// Runs on its own thread: rank r's inputs are pattern(n, r) and
// byte_pattern(kBytes, 100 + r).
RankResult run_rank(NcclCollective& nccl, int64_t n) {
  DUET_CUDA_CHECK(cudaSetDevice(nccl.device()));
  DeviceCollective& collective = nccl;
  const int r = collective.rank();
  const Stream stream;
  const std::vector<float> x = pattern(n, r);
  const std::vector<uint8_t> b = byte_pattern(kBytes, 100 + r);
  const size_t n_all = x.size() * static_cast<size_t>(collective.size());
  const cuda::DeviceBuffer data(x.size() * sizeof(float)), mine(x.size() * sizeof(float));
  const cuda::DeviceBuffer all(n_all * sizeof(float)), bytes0(kBytes), bytes1(kBytes);
  upload(data, x, stream);
  upload(mine, x, stream);
  upload(bytes0, b, stream);
  upload(bytes1, b, stream);
  poison(all, stream);
  collective.all_reduce_sum(data.as<float>(), n, stream.handle());
  collective.all_gather(mine.as<float>(), all.as<float>(), n, stream.handle());
  collective.broadcast(bytes0.data(), kBytes, 0, stream.handle());
  collective.broadcast(bytes1.data(), kBytes, 1, stream.handle());
  RankResult result;
  result.sum = download<float>(data, x.size(), stream);
  result.gathered = download<float>(all, n_all, stream);
  result.from_root0 = download<uint8_t>(bytes0, kBytes, stream);
  result.from_root1 = download<uint8_t>(bytes1, kBytes, stream);
  return result;
}

void check_two_ranks() {
  const std::vector<int> devices = {0, 1};
  const std::vector<std::unique_ptr<NcclCollective>> ranks = NcclCollective::on_devices(devices);
  GPU_EXPECT(ranks.size() == 2);
  for (int r = 0; r < 2; ++r) {
    const NcclCollective& rank = *ranks[static_cast<size_t>(r)];
    GPU_EXPECT(rank.rank() == r && rank.size() == 2 &&
               rank.device() == devices[static_cast<size_t>(r)]);
  }
  for (const int64_t n : {kFloats, int64_t{1} << 20}) {
    std::printf("  %lld floats per rank\n", static_cast<long long>(n));
    std::vector<RankResult> results(2);
    std::vector<std::thread> threads;
    for (size_t r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        try {
          results[r] = run_rank(*ranks[r], n);
        } catch (...) {
          results[r].error = std::current_exception();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (const RankResult& result : results) {
      if (result.error) std::rethrow_exception(result.error);
    }
    const std::vector<float> x0 = pattern(n, 0), x1 = pattern(n, 1);
    std::vector<float> sum(x0.size()), gathered = x0;
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = x0[i] + x1[i];
    gathered.insert(gathered.end(), x1.begin(), x1.end());
    for (size_t r = 0; r < 2; ++r) {
      const std::string tag = " on rank " + std::to_string(r);
      expect_close(("all_reduce_sum" + tag).c_str(), results[r].sum, sum, 0.0);
      expect_close(("all_gather" + tag).c_str(), results[r].gathered, gathered, 0.0);
      expect_bytes(("broadcast from root 0" + tag).c_str(), results[r].from_root0,
                   byte_pattern(kBytes, 100));
      expect_bytes(("broadcast from root 1" + tag).c_str(), results[r].from_root1,
                   byte_pattern(kBytes, 101));
    }
  }
}

}  // namespace
}  // namespace duet

int main() {
  using namespace duet;
  if (gpu_check::no_gpu()) return gpu_check::kSkipped;
  int n_devices = 0;
  DUET_CUDA_CHECK(cudaGetDeviceCount(&n_devices));
  std::printf("%d CUDA device(s); %s\n", n_devices, cuda::library_versions().c_str());
  gpu_check::run_case("one rank on cuda:0", [] { check_one_rank(); });
  gpu_check::run_case("one rank, captured into a CUDA graph, replayed twice",
                      [] { check_graph(); });
  gpu_check::run_case("the caller's errors", [] { check_errors(); });
  gpu_check::run_case("abort on a fresh communicator", [] { check_abort(); });
  if (n_devices >= 2) {
    gpu_check::run_case("two ranks on cuda:0 and cuda:1, one thread each",
                        [] { check_two_ranks(); });
  } else {
    std::printf("two-rank case skipped: it needs 2 CUDA devices, this machine has %d\n", n_devices);
  }
  return gpu_check::finish();
}
