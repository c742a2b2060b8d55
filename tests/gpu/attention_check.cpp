// The CUDA attention ops against their CPU twins (kernels/cpu/attention.h):
// cuda::kv_cache_store_batch must write the cache bit for bit as the CPU does
// (and nothing else), cuda::attention_batch must agree with
// cpu::attention_batch to kTolerance normalized error. Batches mix a long
// decode row on shuffled, non-contiguous blocks, a 37-row prefill, a chunk
// (pos0 > 0) and decode rows at a block's last and first slot, with head_dim
// 64, 128 and 256, GQA and MHA, with and without a sliding window (Gemma 3's
// shape among them); and a decode step is replayed from a CUDA graph after
// its positions moved on, also past a window.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "common/model/kv_layout.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/backend.h"
#include "tests/gpu/backend_check.h"
#include "tests/gpu/device_vector.h"
#include "tests/gpu/gpu_check.h"

namespace duet {
namespace {

constexpr int64_t kLayers = 4;
constexpr int64_t kLayer = 2;  // the others must stay untouched
constexpr int64_t kBlockSize = 16;
constexpr int64_t kBlocks = 96;
constexpr KvElement kSentinel = 0x7e01;  // a NaN no store writes
// The CPU rounds the probabilities to F16 before weighting V; the GPU does not.
constexpr double kTolerance = 2e-3;

struct Config {
  int64_t head_dim, n_heads, n_kv_heads;
  int64_t window = 0;  // keys a query attends to at most (0: all before it)
};

// One sequence of a step: where its rows start and which rows they are.
struct Rows {
  const char* name;
  int64_t pos0, n_q, row;
};

std::vector<float> random_floats(size_t n, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// Block tables for every sequence, cut from one shuffled list of the blocks.
std::vector<std::vector<int32_t>> block_tables(const std::vector<int64_t>& n_blocks,
                                               std::mt19937& rng) {
  std::vector<int32_t> ids(kBlocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::vector<int32_t>> tables;
  size_t next = 0;
  for (int64_t n : n_blocks) {
    if (next + static_cast<size_t>(n) > ids.size()) std::abort();  // kBlocks too small
    tables.emplace_back(ids.begin() + static_cast<std::ptrdiff_t>(next),
                        ids.begin() + static_cast<std::ptrdiff_t>(next + static_cast<size_t>(n)));
    next += static_cast<size_t>(n);
  }
  return tables;
}

struct Fixture {
  Config config;
  KvLayout layout;
  AttentionShape shape;
  const cpu::KernelTable& kernels = cpu::kernel_table(cpu::best_isa());
  cpu::ThreadPool pool{4};
  std::vector<KvElement> cache;  // the CPU's
  cuda::DeviceBuffer device_cache;

  Fixture(const Config& c, cuda::CudaBackend& backend) : config(c) {
    layout = KvLayout{kLayers, c.n_kv_heads, c.head_dim, kBlockSize, kBlocks};
    shape.n_heads = c.n_heads;
    shape.n_kv_heads = c.n_kv_heads;
    shape.head_dim = c.head_dim;
    shape.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    shape.window = c.window;
    cache.assign(static_cast<size_t>(layout.total_elems()), kSentinel);
    device_cache = gpu_check::to_device(cache, backend);
  }
  int64_t kv_row() const { return config.n_kv_heads * config.head_dim; }
  int64_t q_row() const { return config.n_heads * config.head_dim; }

  // Stores random K and V for `sequences` on both sides (through `batch`).
  void store(const std::vector<AttentionSequence>& sequences, int64_t n_rows,
             cuda::AttentionBatch& batch, cuda::CudaBackend& backend, std::mt19937& rng) {
    const std::vector<float> k = random_floats(static_cast<size_t>(n_rows * kv_row()), 1.5f, rng);
    const std::vector<float> v = random_floats(static_cast<size_t>(n_rows * kv_row()), 1.0f, rng);
    cpu::kv_cache_store_batch(kernels, layout, cache.data(), kLayer, sequences, k.data(), v.data(),
                              pool);
    const cuda::DeviceBuffer dk = gpu_check::to_device(k, backend),
                             dv = gpu_check::to_device(v, backend);
    batch.set(sequences, backend);
    cuda::kv_cache_store_batch(layout, device_cache.as<KvElement>(), kLayer, batch, dk.as<float>(),
                               dv.as<float>(), backend);
    backend.synchronize();
  }

  // The device cache is the CPU's, bit for bit (sentinels included).
  void expect_same_cache(cuda::CudaBackend& backend) {
    const std::vector<KvElement> got =
        gpu_check::to_host<KvElement>(device_cache, cache.size(), backend);
    int64_t mismatches = 0, first = -1;
    for (size_t i = 0; i < cache.size(); ++i) {
      if (got[i] != cache[i]) {
        if (first < 0) first = static_cast<int64_t>(i);
        ++mismatches;
      }
    }
    std::printf("    cache: %lld of %zu elements differ\n", static_cast<long long>(mismatches),
                cache.size());
    if (mismatches > 0) {
      gpu_check::fail("%lld cache elements differ, first at %lld (GPU 0x%04x, CPU 0x%04x)",
                      static_cast<long long>(mismatches), static_cast<long long>(first),
                      got[static_cast<size_t>(first)], cache[static_cast<size_t>(first)]);
    }
  }

  // cuda::attention_batch against cpu::attention_batch, each sequence's rows on their own.
  void expect_same_attention(const std::vector<AttentionSequence>& sequences,
                             const std::vector<Rows>& rows, int64_t n_rows,
                             const cuda::AttentionBatch& batch, cuda::CudaBackend& backend,
                             std::mt19937& rng, const cuda::Graph* graph = nullptr,
                             const cuda::DeviceBuffer* graph_q = nullptr,
                             const cuda::DeviceBuffer* graph_out = nullptr) {
    const size_t n = static_cast<size_t>(n_rows * q_row());
    const std::vector<float> q = random_floats(n, 1.0f, rng);
    std::vector<float> want(n, NAN);
    cpu::attention_batch(kernels, layout, cache.data(), kLayer, sequences, shape, q.data(),
                         want.data(), pool);
    std::vector<float> got;
    if (graph != nullptr) {  // replay: q and out at the captured addresses
      backend.upload(graph_q->data(), q.data(), n * sizeof(float));
      backend.launch(*graph);
      got = gpu_check::to_host<float>(*graph_out, n, backend);
    } else {
      const cuda::DeviceBuffer dq = gpu_check::to_device(q, backend);
      cuda::DeviceBuffer dout(n * sizeof(float));
      cuda::attention_batch(layout, device_cache.as<KvElement>(), kLayer, batch, shape,
                            dq.as<float>(), dout.as<float>(), backend);
      got = gpu_check::to_host<float>(dout, n, backend);
    }
    for (const Rows& r : rows) {
      const size_t begin = static_cast<size_t>(r.row * q_row());
      const size_t count = static_cast<size_t>(r.n_q * q_row());
      char what[96];
      std::snprintf(what, sizeof(what), "%s (pos0 %lld, %lld rows)", r.name,
                    static_cast<long long>(r.pos0), static_cast<long long>(r.n_q));
      gpu_check::expect_close(what, std::span<const float>(got).subspan(begin, count),
                              std::span<const float>(want).subspan(begin, count), kTolerance);
    }
  }
};

// The history (positions [0, pos0)) of every sequence as one batch of rows.
std::vector<AttentionSequence> history(const std::vector<Rows>& rows,
                                       const std::vector<std::vector<int32_t>>& tables,
                                       int64_t* n_rows) {
  std::vector<AttentionSequence> sequences;
  *n_rows = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].pos0 == 0) continue;
    sequences.push_back({tables[i], 0, rows[i].pos0, *n_rows});
    *n_rows += rows[i].pos0;
  }
  return sequences;
}

void mixed_batch(const Config& c, cuda::CudaBackend& backend) {
  std::mt19937 rng(
      static_cast<uint32_t>(1000 * c.head_dim + 10 * c.n_heads + c.n_kv_heads + 7 * c.window));
  Fixture f(c, backend);
  // Rows out of sequence order, to check that `row` is honoured.
  const std::vector<Rows> rows = {
      {"decode row, long context", 700, 1, 37},
      {"prefill from position 0", 0, 37, 0},
      {"chunk", 50, 20, 39},
      {"decode at a block's last slot", 15, 1, 38},
      {"decode at a block's first slot", 16, 1, 59},
  };
  const int64_t n_rows = 60;
  std::vector<int64_t> n_blocks;
  for (const Rows& r : rows) n_blocks.push_back((r.pos0 + r.n_q + kBlockSize - 1) / kBlockSize);
  const std::vector<std::vector<int32_t>> tables = block_tables(n_blocks, rng);

  cuda::AttentionBatch batch;  // set twice: the history, then the step
  int64_t n_history = 0;
  const std::vector<AttentionSequence> past = history(rows, tables, &n_history);
  f.store(past, n_history, batch, backend, rng);
  std::vector<AttentionSequence> step;
  for (size_t i = 0; i < rows.size(); ++i) {
    step.push_back({tables[i], rows[i].pos0, rows[i].n_q, rows[i].row});
  }
  f.store(step, n_rows, batch, backend, rng);
  f.expect_same_cache(backend);
  f.expect_same_attention(step, rows, n_rows, batch, backend, rng);
}

// A decode step captured once, replayed after every sequence moved on by one
// position (same number of rows and block-table sizes: same device arrays).
void graph_replay(const Config& c, cuda::CudaBackend& backend) {
  std::mt19937 rng(77);
  Fixture f(c, backend);
  std::vector<Rows> rows = {{"decode a", 100, 1, 0}, {"decode b", 31, 1, 1}, {"decode c", 5, 1, 2}};
  const std::vector<std::vector<int32_t>> tables = block_tables({8, 8, 8}, rng);
  const int64_t n_rows = static_cast<int64_t>(rows.size());
  cuda::AttentionBatch batch;
  int64_t n_history = 0;
  const std::vector<AttentionSequence> past = history(rows, tables, &n_history);
  f.store(past, n_history, batch, backend, rng);

  const size_t n = static_cast<size_t>(n_rows * f.q_row());
  cuda::DeviceBuffer q(n * sizeof(float)), out(n * sizeof(float));
  cuda::Graph graph;
  for (int iteration = 0; iteration < 3; ++iteration) {
    std::vector<AttentionSequence> step;
    for (size_t i = 0; i < rows.size(); ++i)
      step.push_back({tables[i], rows[i].pos0, 1, rows[i].row});
    f.store(step, n_rows, batch, backend, rng);  // set() moves the positions on
    if (!graph.valid()) {
      backend.begin_capture();
      cuda::attention_batch(f.layout, f.device_cache.as<KvElement>(), kLayer, batch, f.shape,
                            q.as<float>(), out.as<float>(), backend);
      graph = backend.end_capture();
    }
    std::printf("    replay %d\n", iteration);
    f.expect_same_attention(step, rows, n_rows, batch, backend, rng, &graph, &q, &out);
    for (Rows& r : rows) ++r.pos0;
  }
  f.expect_same_cache(backend);
}

}  // namespace
}  // namespace duet

int main() {
  using namespace duet;
  return gpu_check::run_on_backend([](cuda::CudaBackend& backend) {
    const Config configs[] = {
        {64, 8, 2},
        {128, 8, 2},  // GQA, 4 query heads per KV head
        {64, 4, 4},
        {128, 4, 4},   // MHA
        {128, 12, 2},  // 6 per KV head (a block of 8 with 2 idle)
        {64, 32, 2},   // 16 per KV head (two blocks per KV head)
        {256, 8, 2},   // Gemma 3's head size
        // Sliding windows: Gemma 3 1B's layer (4 heads, 1 KV head, 512 keys)
        // cuts the long decode row only; 32 keys cut it, the chunk and the
        // prefill's last rows, not the decode rows at 15 and 16; 17 keys (a
        // block and one) are exactly the row at 16's.
        {256, 4, 1, 512},
        {64, 8, 2, 32},
        {128, 4, 4, 17},
    };
    for (const Config& c : configs) {
      char name[128];
      std::snprintf(name, sizeof(name),
                    "mixed batch, head_dim %lld, %lld heads / %lld KV heads, window %lld",
                    static_cast<long long>(c.head_dim), static_cast<long long>(c.n_heads),
                    static_cast<long long>(c.n_kv_heads), static_cast<long long>(c.window));
      gpu_check::run_case(name, [&] { mixed_batch(c, backend); });
    }
    gpu_check::run_case("decode step replayed from a CUDA graph", [&] {
      graph_replay({128, 8, 2}, backend);
    });
    gpu_check::run_case("decode step with a window of 16 replayed from a CUDA graph", [&] {
      graph_replay({128, 8, 2, 16}, backend);
    });
  });
}
