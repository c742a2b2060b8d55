// duet-cma-read-bench: what one cross-memory-attach read (process_vm_readv,
// the copy MpiKvTransfer's decode side makes out of the prefill side's
// staging ring) costs by the shape of its two sides. A transfer's rows are
// 2 KiB runs scattered over the blocks of a KV pool on either side; the
// ring holds them packed. The bench reads the same bytes four ways, each side
// contiguous or scattered: contiguous -> scattered is the transfer as built,
// scattered -> scattered is what reading straight from the sender's blocks
// (no packing) would cost.
//
// It reads its own memory: process_vm_readv on the calling process takes the
// same path in the kernel as on another (the "remote" pages pinned, then
// copied into the local iovecs). Every buffer is on huge pages, as the KV
// cache and the staging ring are. Prints the median of --reps reads of the
// whole transfer per shape, in ms and GB/s (10^9 bytes per second).
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/huge_pages.h"
#include "common/stats.h"

namespace {

struct Shape {
  size_t run_bytes = 2048;               // one block's rows of one K or V head
  size_t runs_per_message = 192;         // a 512-token layer of the default model
  size_t messages = 30;                  // its layers
  size_t pool_bytes = size_t{24} << 20;  // each side's KV pool

  size_t message_bytes() const { return run_bytes * runs_per_message; }
  size_t total_bytes() const { return message_bytes() * messages; }
};

// The run offsets of one side, in the order a message packs them: a fresh
// random choice of the pool's runs per rep, as shuffled block tables give.
std::vector<size_t> scattered_offsets(const Shape& shape, std::mt19937_64& rng) {
  std::vector<size_t> slots(shape.pool_bytes / shape.run_bytes);
  std::iota(slots.begin(), slots.end(), size_t{0});
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(shape.runs_per_message * shape.messages);
  for (size_t& slot : slots) slot *= shape.run_bytes;
  return slots;
}

// One message's side: a single run over the packed buffer, or its scattered runs.
void side_of(const Shape& shape, size_t message, std::byte* packed, std::byte* pool,
             const std::vector<size_t>* offsets, std::vector<iovec>& out) {
  out.clear();
  if (offsets == nullptr) {
    out.push_back({packed + message * shape.message_bytes(), shape.message_bytes()});
    return;
  }
  for (size_t r = 0; r < shape.runs_per_message; ++r)
    out.push_back({pool + (*offsets)[message * shape.runs_per_message + r], shape.run_bytes});
}

}  // namespace

int main(int argc, char** argv) {
  Shape shape;
  int reps = 15;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--run-bytes" && i + 1 < argc) {
      shape.run_bytes = std::strtoul(argv[++i], nullptr, 10);
    } else if (arg == "--runs" && i + 1 < argc) {
      shape.runs_per_message = std::strtoul(argv[++i], nullptr, 10);
    } else if (arg == "--messages" && i + 1 < argc) {
      shape.messages = std::strtoul(argv[++i], nullptr, 10);
    } else if (arg == "--pool-mib" && i + 1 < argc) {
      shape.pool_bytes = std::strtoul(argv[++i], nullptr, 10) << 20;
    } else if (arg == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: duet-cma-read-bench [--run-bytes B] [--runs N] [--messages N] "
                   "[--pool-mib N] [--reps N]\n");
      return 2;
    }
  }
  const size_t runs = shape.runs_per_message * shape.messages;
  if (shape.run_bytes == 0 || runs == 0 || reps < 1 || shape.runs_per_message > IOV_MAX ||
      shape.pool_bytes / shape.run_bytes < runs) {
    std::fprintf(stderr,
                 "duet-cma-read-bench: need runs that fit the pool and at most %d per message\n",
                 IOV_MAX);
    return 2;
  }
  duet::HugePageMemory source_pool(shape.pool_bytes);
  duet::HugePageMemory dest_pool(shape.pool_bytes);
  duet::HugePageMemory source_packed(shape.total_bytes());
  duet::HugePageMemory dest_packed(shape.total_bytes());
  std::memset(source_pool.data(), 1, source_pool.size());
  std::memset(source_packed.data(), 1, source_packed.size());
  const pid_t self = getpid();
  std::mt19937_64 rng(7);
  std::printf(
      "%zu messages of %zu runs x %zu B = %.2f MB per transfer; %zu MiB pools; "
      "medians of %d reps\n\n| remote (read) -> local (written) | ms | GB/s |\n|---|---|---|\n",
      shape.messages, shape.runs_per_message, shape.run_bytes, shape.total_bytes() / 1e6,
      shape.pool_bytes >> 20, reps);
  struct Case {
    const char* name;
    bool scattered_remote;
    bool scattered_local;
  };
  for (const Case& c : {Case{"contiguous -> contiguous", false, false},
                        Case{"contiguous -> scattered (MpiKvTransfer's CMA read)", false, true},
                        Case{"scattered -> contiguous", true, false},
                        Case{"scattered -> scattered (straight from the blocks)", true, true}}) {
    std::vector<double> seconds;
    std::vector<iovec> local;
    std::vector<iovec> remote;
    for (int rep = -1; rep < reps; ++rep) {  // rep -1 warms up
      const std::vector<size_t> from = scattered_offsets(shape, rng);
      const std::vector<size_t> into = scattered_offsets(shape, rng);
      const auto start = std::chrono::steady_clock::now();
      for (size_t m = 0; m < shape.messages; ++m) {
        side_of(shape, m, dest_packed.data(), dest_pool.data(), c.scattered_local ? &into : nullptr,
                local);
        side_of(shape, m, source_packed.data(), source_pool.data(),
                c.scattered_remote ? &from : nullptr, remote);
        const ssize_t got =
            process_vm_readv(self, local.data(), local.size(), remote.data(), remote.size(), 0);
        if (got != static_cast<ssize_t>(shape.message_bytes())) {
          std::perror("duet-cma-read-bench: process_vm_readv");
          return 1;
        }
      }
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      if (rep >= 0) seconds.push_back(took.count());
    }
    const double s = duet::median(seconds);
    std::printf("| %s | %.3f | %.2f |\n", c.name, s * 1e3, shape.total_bytes() / s / 1e9);
  }
  return 0;
}
