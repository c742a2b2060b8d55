// duet-membw: DRAM read bandwidth, the roofline for token generation (every
// weight is read once per generated token). Streams a buffer far larger than
// the caches with 256-bit loads, each line prefetched 4 KiB ahead, from 1..N
// threads and prints the median of several passes in GB/s (10^9 bytes per
// second).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/stats.h"

namespace {

// Sums 32-byte chunks so the loads cannot be elided; returns a value that depends on all.
// Each line is asked for 4 KiB ahead, as the decode kernels do: the hardware
// prefetchers stop at page boundaries, and without it a core reads a third
// less on some machines (13-16 against 19-25 GB/s on a Zen 3 VM).
__attribute__((target("avx2"))) uint64_t stream_read(const uint8_t* data, size_t bytes) {
  constexpr size_t kPrefetchBytes = 4096;
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  for (size_t i = 0; i + 64 <= bytes; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(data + i + kPrefetchBytes), _MM_HINT_T0);
    acc0 = _mm256_add_epi64(acc0, _mm256_load_si256(reinterpret_cast<const __m256i*>(data + i)));
    acc1 =
        _mm256_add_epi64(acc1, _mm256_load_si256(reinterpret_cast<const __m256i*>(data + i + 32)));
  }
  acc0 = _mm256_add_epi64(acc0, acc1);
  uint64_t lanes[4];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), acc0);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

}  // namespace

int main(int argc, char** argv) {
  size_t mib = 1024;
  int max_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int passes = 7;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--mib" && i + 1 < argc) {
      mib = std::strtoul(argv[++i], nullptr, 10);
    } else if (arg == "--threads" && i + 1 < argc) {
      max_threads = std::atoi(argv[++i]);
    } else if (arg == "--passes" && i + 1 < argc) {
      passes = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: duet-membw [--mib N] [--threads N] [--passes N]\n");
      return 2;
    }
  }
  if (mib < 64 || max_threads < 1 || passes < 1) {
    std::fprintf(stderr, "duet-membw: need --mib >= 64, --threads >= 1, --passes >= 1\n");
    return 2;
  }
  const size_t bytes = mib << 20;
  auto* data = static_cast<uint8_t*>(std::aligned_alloc(64, bytes));
  if (data == nullptr) {
    std::fprintf(stderr, "duet-membw: cannot allocate %zu MiB\n", mib);
    return 1;
  }
  std::memset(data, 1, bytes);  // fault every page in before timing
  std::printf("| threads | read GB/s (median of %d passes over %zu MiB) |\n|---:|---:|\n", passes,
              mib);
  uint64_t sink = 0;
  for (int n_threads = 1; n_threads <= max_threads; ++n_threads) {
    std::vector<double> rates;
    for (int pass = 0; pass < passes; ++pass) {
      std::vector<uint64_t> sums(static_cast<size_t>(n_threads));
      std::vector<std::thread> threads;
      const size_t share = bytes / static_cast<size_t>(n_threads) / 64 * 64;
      const auto start = std::chrono::steady_clock::now();
      for (int t = 0; t < n_threads; ++t) {
        threads.emplace_back([&, t] { sums[t] = stream_read(data + t * share, share); });
      }
      for (auto& thread : threads) thread.join();
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      for (uint64_t s : sums) sink += s;
      rates.push_back(static_cast<double>(share) * n_threads / seconds / 1e9);
    }
    std::printf("| %d | %.2f |\n", n_threads, duet::median(rates));
  }
  std::free(data);
  return sink == 42 ? 1 : 0;  // keep the sums observable
}
