// cuda::pack_kv_rows / cuda::unpack_kv_rows against their CPU twins
// (worker/kv/kv_rows.h), bit for bit: the packed rows must be the CPU's (and
// nothing past them written), and an unpack must leave the whole device cache
// equal to the CPU's after the same unpack (every other layer, block, head and
// slot untouched). Random F16 bits in the cache; head_dim 256, 128, 64 and tiny
// ones (8, and 12, 6, 5 for the narrower vector paths); 1 to 8 KV heads;
// block sizes 4 to 32; shuffled, non-contiguous block tables; ranges from
// position 0, starting mid-block, across many blocks, a single row at a
// block's last or first slot, no rows; every head or a sub-range (first > 0,
// count < n_kv_heads, or none); packed rows at every alignment (offset by 0,
// 1, 2 and 4 elements from 16 bytes, so every vector width runs). Then both
// ops replayed from a CUDA graph, and the host-side argument checks.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/model/kv_layout.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/kv_rows.h"
#include "tests/gpu/backend_check.h"
#include "tests/gpu/device_vector.h"
#include "tests/gpu/gpu_check.h"
#include "worker/kv/kv_rows.h"

namespace duet {
namespace {

using gpu_check::to_device;
using gpu_check::to_host;

constexpr int64_t kLayer = 1;                // every other layer must stay untouched
constexpr KvElement kSentinel = 0x7e01;      // fills the packed buffers around the rows
constexpr int64_t kGuard = 64;               // sentinel elements after the packed rows
constexpr int64_t kShifts[] = {0, 1, 2, 4};  // packed rows' offset (elements) from 16 bytes

struct Range {
  const char* name;
  int64_t pos0, n;
};

std::vector<KvElement> random_elements(size_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> bits(0, 0xffff);
  std::vector<KvElement> v(n);
  for (KvElement& x : v) x = static_cast<KvElement>(bits(rng));
  return v;
}

// A table covering positions [0, pos0 + n): distinct blocks in shuffled order.
std::vector<int32_t> block_table(const KvLayout& layout, int64_t pos0, int64_t n,
                                 std::mt19937& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(layout.n_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  const auto n_table = static_cast<size_t>((pos0 + n + layout.block_size - 1) / layout.block_size);
  if (n_table > ids.size()) std::abort();  // the layout has too few blocks for the range
  ids.resize(n_table);
  return ids;
}

// Exact comparison; reports the count and the first mismatch.
bool expect_same(const std::string& what, const std::vector<KvElement>& got,
                 const std::vector<KvElement>& want) {
  if (got.size() != want.size()) {
    gpu_check::fail("%s: %zu elements, want %zu", what.c_str(), got.size(), want.size());
    return false;
  }
  int64_t mismatches = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++mismatches;
    }
  }
  if (mismatches == 0) return true;
  gpu_check::fail("%s: %lld of %zu elements differ, first at %lld (GPU 0x%04x, CPU 0x%04x)",
                  what.c_str(), static_cast<long long>(mismatches), got.size(),
                  static_cast<long long>(first), got[static_cast<size_t>(first)],
                  want[static_cast<size_t>(first)]);
  return false;
}

std::string describe(const Range& range, KvHeads heads) {
  char text[160];
  std::snprintf(text, sizeof(text), "%s [%lld, +%lld), heads [%lld, +%lld)", range.name,
                static_cast<long long>(range.pos0), static_cast<long long>(range.n),
                static_cast<long long>(heads.first), static_cast<long long>(heads.count));
  return text;
}

// Pack and unpack of one range and head range at every shift of the packed rows.
void check_range(const KvLayout& layout, const std::vector<KvElement>& cache,
                 const cuda::DeviceBuffer& device_cache, const Range& range, KvHeads heads,
                 cuda::CudaBackend& backend, std::mt19937& rng) {
  const std::vector<int32_t> table = block_table(layout, range.pos0, range.n, rng);
  const cuda::DeviceBuffer device_table = to_device(table, backend);
  const auto packed = static_cast<size_t>(packed_kv_elems(layout, range.n, heads));
  std::vector<KvElement> want(packed);
  pack_kv_rows(layout, cache.data(), kLayer, table, range.pos0, range.n, heads, want.data());
  void* stream = backend.stream();
  bool ok = true;
  for (const int64_t shift : kShifts) {
    const std::string what = describe(range, heads) + ", shift " + std::to_string(shift);
    const auto at = static_cast<size_t>(shift);

    // Pack: the rows at `shift`, sentinels before and after them.
    std::vector<KvElement> want_out(at + packed + kGuard, kSentinel);
    std::copy(want.begin(), want.end(), want_out.begin() + static_cast<std::ptrdiff_t>(at));
    const cuda::DeviceBuffer out =
        to_device(std::vector<KvElement>(want_out.size(), kSentinel), backend);
    cuda::pack_kv_rows(layout, device_cache.as<KvElement>(), kLayer, device_table.as<int32_t>(),
                       range.pos0, range.n, heads.first, heads.count, out.as<KvElement>() + shift,
                       stream);
    ok &= expect_same("pack " + what, to_host<KvElement>(out, want_out.size(), backend), want_out);

    // Unpack random rows into a copy of the cache on both sides.
    const std::vector<KvElement> in = random_elements(at + packed, rng);
    std::vector<KvElement> want_cache = cache;
    unpack_kv_rows(layout, want_cache.data(), kLayer, table, range.pos0, range.n, heads,
                   in.data() + at);
    const cuda::DeviceBuffer got_cache = to_device(cache, backend);
    const cuda::DeviceBuffer device_in = to_device(in, backend);
    cuda::unpack_kv_rows(layout, got_cache.as<KvElement>(), kLayer, device_table.as<int32_t>(),
                         range.pos0, range.n, heads.first, heads.count,
                         device_in.as<KvElement>() + shift, stream);
    ok &= expect_same("unpack " + what, to_host<KvElement>(got_cache, cache.size(), backend),
                      want_cache);
  }
  std::printf("    %-72s %s\n", describe(range, heads).c_str(), ok ? "same" : "DIFFERENT");
}

void check_layout(const KvLayout& layout, cuda::CudaBackend& backend) {
  std::mt19937 rng(
      static_cast<uint32_t>(1000 * layout.head_dim + 10 * layout.n_kv_heads + layout.block_size));
  const std::vector<KvElement> cache =
      random_elements(static_cast<size_t>(layout.total_elems()), rng);
  const cuda::DeviceBuffer device_cache = to_device(cache, backend);
  const int64_t bs = layout.block_size;
  const Range ranges[] = {
      {"whole blocks from 0", 0, 3 * bs},
      {"mid-block to mid-block", bs / 2 + 1, 3 * bs + 3},
      {"many blocks", 3, 20 * bs},
      {"a block's last slot", 2 * bs - 1, 1},
      {"a block's first slot", 2 * bs, 1},
      {"across one boundary", bs - 1, 2},
      {"no rows", 5, 0},
  };
  std::vector<KvHeads> head_ranges = {all_kv_heads(layout), {0, 0}};
  if (layout.n_kv_heads >= 2) head_ranges.push_back({layout.n_kv_heads - 1, 1});
  if (layout.n_kv_heads >= 3) head_ranges.push_back({1, layout.n_kv_heads - 2});
  for (const Range& range : ranges) {
    for (const KvHeads heads : head_ranges) {
      check_range(layout, cache, device_cache, range, heads, backend, rng);
    }
  }
  // The packs read the device cache only.
  expect_same("device cache after the packs",
              to_host<KvElement>(device_cache, cache.size(), backend), cache);
}

// A pack and an unpack captured in a CUDA graph and replayed.
void graph_replay(cuda::CudaBackend& backend) {
  const KvLayout layout{3, 8, 128, 16, 40};
  std::mt19937 rng(5);
  const std::vector<KvElement> cache =
      random_elements(static_cast<size_t>(layout.total_elems()), rng);
  const Range range{"graph", 9, 50};
  const KvHeads heads{2, 5};
  const std::vector<int32_t> table = block_table(layout, range.pos0, range.n, rng);
  const auto packed = static_cast<size_t>(packed_kv_elems(layout, range.n, heads));
  std::vector<KvElement> want(packed);
  pack_kv_rows(layout, cache.data(), kLayer, table, range.pos0, range.n, heads, want.data());
  const std::vector<KvElement> in = random_elements(packed, rng);
  std::vector<KvElement> want_cache = cache;
  unpack_kv_rows(layout, want_cache.data(), kLayer, table, range.pos0, range.n, heads, in.data());

  const cuda::DeviceBuffer source = to_device(cache, backend);
  const cuda::DeviceBuffer device_table = to_device(table, backend);
  const cuda::DeviceBuffer device_in = to_device(in, backend);
  cuda::DeviceBuffer out(packed * sizeof(KvElement));
  cuda::DeviceBuffer target(cache.size() * sizeof(KvElement));
  backend.begin_capture();
  cuda::pack_kv_rows(layout, source.as<KvElement>(), kLayer, device_table.as<int32_t>(), range.pos0,
                     range.n, heads.first, heads.count, out.as<KvElement>(), backend.stream());
  cuda::unpack_kv_rows(layout, target.as<KvElement>(), kLayer, device_table.as<int32_t>(),
                       range.pos0, range.n, heads.first, heads.count, device_in.as<KvElement>(),
                       backend.stream());
  const cuda::Graph graph = backend.end_capture();
  for (int replay = 0; replay < 2; ++replay) {
    backend.upload(target.data(), cache.data(), cache.size() * sizeof(KvElement));
    backend.launch(graph);
    const bool ok =
        expect_same("graph pack", to_host<KvElement>(out, packed, backend), want) &
        expect_same("graph unpack", to_host<KvElement>(target, cache.size(), backend), want_cache);
    std::printf("    replay %d: %s\n", replay, ok ? "same" : "DIFFERENT");
  }
}

// Bad arguments throw on the host before anything is queued.
void argument_checks(cuda::CudaBackend& backend) {
  const KvLayout layout{2, 4, 64, 16, 8};
  cuda::DeviceBuffer cache(layout.total_bytes());
  cuda::DeviceBuffer rows(static_cast<size_t>(packed_kv_elems(layout, 16)) * sizeof(KvElement));
  const cuda::DeviceBuffer table = to_device(std::vector<int32_t>{3, 1}, backend);
  struct Bad {
    const char* name;
    int64_t layer, pos0, n, head_first, head_count;
  };
  const Bad bad[] = {
      {"layer past the last", 2, 0, 16, 0, 4},  {"negative layer", -1, 0, 16, 0, 4},
      {"negative n", 0, 0, -1, 0, 4},           {"negative pos0", 0, -1, 16, 0, 4},
      {"heads past the last", 0, 0, 16, 1, 4},  {"negative first head", 0, 0, 16, -1, 2},
      {"negative head count", 0, 0, 16, 0, -1},
  };
  for (const Bad& b : bad) {
    for (const bool pack : {true, false}) {
      bool threw = false;
      try {
        if (pack) {
          cuda::pack_kv_rows(layout, cache.as<KvElement>(), b.layer, table.as<int32_t>(), b.pos0,
                             b.n, b.head_first, b.head_count, rows.as<KvElement>(),
                             backend.stream());
        } else {
          cuda::unpack_kv_rows(layout, cache.as<KvElement>(), b.layer, table.as<int32_t>(), b.pos0,
                               b.n, b.head_first, b.head_count, rows.as<KvElement>(),
                               backend.stream());
        }
      } catch (const Error&) {
        threw = true;
      }
      if (!threw) gpu_check::fail("%s %s: no error", pack ? "pack" : "unpack", b.name);
    }
  }
  backend.synchronize();
}

}  // namespace
}  // namespace duet

int main() {
  using namespace duet;
  return gpu_check::run_on_backend([](cuda::CudaBackend& backend) {
    // {n_layers, n_kv_heads, head_dim, block_size, n_blocks}
    const KvLayout layouts[] = {
        {3, 8, 128, 16, 40}, {2, 2, 64, 16, 40}, {2, 1, 64, 8, 48}, {2, 2, 256, 32, 24},
        {2, 4, 8, 8, 48},    {2, 3, 12, 16, 40}, {2, 2, 6, 8, 48},  {2, 5, 5, 4, 100},
    };
    for (const KvLayout& layout : layouts) {
      char name[128];
      std::snprintf(name, sizeof(name), "head_dim %lld, %lld KV heads, block size %lld",
                    static_cast<long long>(layout.head_dim),
                    static_cast<long long>(layout.n_kv_heads),
                    static_cast<long long>(layout.block_size));
      gpu_check::run_case(name, [&] { check_layout(layout, backend); });
    }
    gpu_check::run_case("pack and unpack replayed from a CUDA graph",
                        [&] { graph_replay(backend); });
    gpu_check::run_case("bad arguments throw", [&] { argument_checks(backend); });
  });
}
