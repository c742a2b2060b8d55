// NcclKvLink (worker/transfer/device/nccl_kv_link.h) on one GPU: a one-rank NCCL
// communicator whose only peer is the rank itself, so the real transfer
// packs, posts ncclSend and ncclRecv in one group, unpacks and signals, as
// between two hosts. (Two ranks on one GPU are refused by NCCL; the multi-GPU
// path needs two GPUs.)
//
// Checked: the rows of every layer land in other blocks of another cache
// exactly as the CPU's pack and unpack would put them (all heads and a head
// range, ranges across blocks); a drained payload leaves the cache alone;
// the staging comes back (more payloads than it holds at once, sent from
// one thread while another receives, as in serving); a receive whose send
// never comes is ended by abandon(): the receipt completes not ok and the
// connection stays broken.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/cuda/backend.h"
#include "tests/gpu/device_vector.h"
#include "tests/gpu/gpu_check.h"
#include "worker/kv/kv_rows.h"
#include "worker/transfer/device/nccl_kv_link.h"

namespace duet {
namespace {

using gpu_check::fail;

constexpr int kSelf = 0;

KvLayout test_layout() {
  KvLayout layout;
  layout.n_layers = 4;
  layout.n_kv_heads = 3;
  layout.head_dim = 64;
  layout.block_size = 16;
  layout.n_blocks = 48;
  return layout;
}

std::vector<KvElement> random_cache(const KvLayout& layout, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<KvElement> cache(static_cast<size_t>(layout.total_elems()));
  for (KvElement& e : cache) e = static_cast<KvElement>(rng());
  return cache;
}

std::vector<int32_t> shuffled_blocks(const KvLayout& layout, int64_t n, uint32_t seed) {
  std::vector<int32_t> all(static_cast<size_t>(layout.n_blocks));
  std::iota(all.begin(), all.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(n));
  return all;
}

// Polls until every receipt in `receipts` is done; returns how they ended.
std::vector<DeviceKvLink::Done> wait_for(NcclKvLink& transfer, size_t count) {
  std::vector<DeviceKvLink::Done> done;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (done.size() < count && std::chrono::steady_clock::now() < deadline) {
    for (const auto& d : transfer.poll()) done.push_back(d);
  }
  if (done.size() < count) fail("%zu of %zu receipts done after 20 s", done.size(), count);
  return done;
}

struct Rig {
  cuda::CudaBackend backend{0};
  KvLayout layout = test_layout();
  std::vector<KvElement> source = random_cache(layout, 1);
  std::vector<KvElement> target_host = random_cache(layout, 2);
  cuda::DeviceBuffer source_device = gpu_check::to_device(source, backend);
  cuda::DeviceBuffer target_device = gpu_check::to_device(target_host, backend);
  DeviceKv from{source_device.as<KvElement>(), 0, backend.stream()};
  DeviceKv to{target_device.as<KvElement>(), 0, backend.stream()};

  std::vector<KvElement> target_now() {
    return gpu_check::to_host<KvElement>(target_device, target_host.size(), backend);
  }
};

void check_rows_land(NcclKvLink& transfer, Rig& rig) {
  const KvLayout& l = rig.layout;
  const std::vector<int32_t> from_table = shuffled_blocks(l, 5, 3);
  const std::vector<int32_t> to_table = shuffled_blocks(l, 5, 4);
  std::vector<KvElement> want = rig.target_host;
  std::vector<KvElement> packed;
  size_t receipts = 0;
  // Layer by layer in two chunks (positions [0, 37) and [37, 70)), all heads;
  // then one range of heads [1, 3) of the last layer again.
  struct Part {
    int64_t layer, pos0, n;
    KvHeads heads;
  };
  std::vector<Part> parts;
  for (int64_t layer = 0; layer < l.n_layers; ++layer) {
    parts.push_back({layer, 0, 37, all_kv_heads(l)});
    parts.push_back({layer, 37, 33, all_kv_heads(l)});
  }
  parts.push_back({l.n_layers - 1, 5, 60, {1, 2}});
  for (const Part& p : parts) {
    const auto ticket =
        transfer.send(kSelf, l, rig.from, p.layer, from_table, p.pos0, p.n, p.heads);
    if (!ticket) {
      fail("send of layer %lld refused", static_cast<long long>(p.layer));
      return;
    }
    transfer.receive(kSelf, *ticket, l, &rig.to, to_table, p.layer, p.pos0, p.n, p.heads);
    ++receipts;
    packed.resize(static_cast<size_t>(packed_kv_elems(l, p.n, p.heads)));
    pack_kv_rows(l, rig.source.data(), p.layer, from_table, p.pos0, p.n, p.heads, packed.data());
    unpack_kv_rows(l, want.data(), p.layer, to_table, p.pos0, p.n, p.heads, packed.data());
  }
  for (const auto& d : wait_for(transfer, receipts)) GPU_EXPECT(d.ok);
  const std::vector<KvElement> got = rig.target_now();
  size_t wrong = 0;
  for (size_t i = 0; i < got.size(); ++i) wrong += got[i] != want[i];
  std::printf("    %zu payloads through NCCL: %zu of %zu cache elements differ from the CPU's\n",
              receipts, wrong, got.size());
  if (wrong != 0) fail("%zu elements differ", wrong);
  rig.target_host = got;
}

void check_drained(NcclKvLink& transfer, Rig& rig) {
  const KvLayout& l = rig.layout;
  const std::vector<int32_t> table = shuffled_blocks(l, 3, 5);
  const auto ticket = transfer.send(kSelf, l, rig.from, 1, table, 0, 40, all_kv_heads(l));
  GPU_EXPECT(ticket.has_value());
  if (!ticket) return;
  transfer.receive(kSelf, *ticket, l, nullptr, {}, 1, 0, 40, {});
  for (const auto& d : wait_for(transfer, 1)) GPU_EXPECT(d.ok);
  GPU_EXPECT(rig.target_now() == rig.target_host);
}

// 4 MiB of staging, 200 payloads of 480 KiB each, sent from this thread
// (the engine's) while another takes them (the transfer's communication
// thread: receive and poll), as in serving: the staging comes back.
void check_staging_recycles(Rig& rig) {
  NcclKvLink::Options options;
  options.send_staging_bytes = options.receive_staging_bytes = size_t{4} << 20;
  options.patience = std::chrono::seconds(10);
  NcclKvLink transfer(0, true, true, options);
  transfer.add_peer(kSelf, NcclKvLink::join(NcclKvLink::unique_id(), 1, 0, 0), 0);
  const KvLayout& l = rig.layout;
  const std::vector<int32_t> table = shuffled_blocks(l, 48, 6);
  constexpr int kPayloads = 200;
  std::mutex mutex;
  std::deque<std::pair<int, DeviceRowsTicket>> headers;  // the "wire"
  std::atomic<int> landed{0}, sent_count{0};
  std::atomic<bool> sending{true};
  std::thread communication([&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while ((sending || landed < sent_count) && std::chrono::steady_clock::now() < deadline) {
      std::deque<std::pair<int, DeviceRowsTicket>> fresh;
      {
        std::lock_guard lock(mutex);
        fresh.swap(headers);
      }
      for (const auto& [layer, ticket] : fresh)
        transfer.receive(kSelf, ticket, l, &rig.to, table, layer, 0, 640, all_kv_heads(l));
      for (const auto& d : transfer.poll()) landed += d.ok ? 1 : 0;
    }
  });
  size_t bytes = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kPayloads; ++i) {
    const int layer = static_cast<int>(i % l.n_layers);
    const auto ticket = transfer.send(kSelf, l, rig.from, layer, table, 0, 640, all_kv_heads(l));
    if (!ticket) break;
    bytes += ticket->bytes;
    {
      std::lock_guard lock(mutex);
      headers.push_back({layer, *ticket});
    }
    ++sent_count;
  }
  sending = false;
  communication.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("    %d payloads (%.1f MB) through 4 MiB of staging: %d sent, %d landed, %.2f GB/s\n",
              kPayloads, static_cast<double>(bytes) / 1e6, sent_count.load(), landed.load(),
              static_cast<double>(bytes) / seconds / 1e9);
  GPU_EXPECT(sent_count == kPayloads && landed == kPayloads);
  rig.target_host = rig.target_now();
}

void check_abandon(Rig& rig) {
  NcclKvLink transfer(0, true, true, {});
  transfer.add_peer(kSelf, NcclKvLink::join(NcclKvLink::unique_id(), 1, 0, 0), 0);
  const KvLayout& l = rig.layout;
  const std::vector<int32_t> table = shuffled_blocks(l, 2, 7);
  // A receive whose send never comes (a rank's receive from itself is only
  // posted with its send, so it waits unposted) until it is abandoned: the
  // communicator is aborted, the receipt completes not ok, the connection stays
  // broken, and a receive after that completes not ok at once.
  const DeviceRowsTicket ticket{0, static_cast<uint64_t>(packed_kv_elems(l, 20)) * 2};
  transfer.receive(kSelf, ticket, l, &rig.to, table, 0, 0, 20, all_kv_heads(l));
  for (int i = 0; i < 100; ++i) GPU_EXPECT(transfer.poll().empty());
  transfer.abandon(kSelf);
  const auto done = wait_for(transfer, 1);
  GPU_EXPECT(done.size() == 1 && !done[0].ok);
  GPU_EXPECT(!transfer.send(kSelf, l, rig.from, 0, table, 0, 20, all_kv_heads(l)).has_value());
  transfer.receive(kSelf, ticket, l, &rig.to, table, 0, 0, 20, all_kv_heads(l));
  const auto late = wait_for(transfer, 1);
  GPU_EXPECT(late.size() == 1 && !late[0].ok);
  GPU_EXPECT(!transfer.busy());
  std::printf(
      "    an unmatched receive, abandoned: %s\n",
      done.size() == 1 && !done[0].ok ? "completed not ok, connection broken" : "NOT ENDED");
}

}  // namespace
}  // namespace duet

int main() {
  using namespace duet;
  if (gpu_check::no_gpu()) return gpu_check::kSkipped;
  Rig rig;
  std::printf("device: %s\n", rig.backend.name().c_str());
  {
    NcclKvLink transfer(0, true, true, {});
    transfer.add_peer(kSelf, NcclKvLink::join(NcclKvLink::unique_id(), 1, 0, 0), 0);
    gpu_check::run_case("rows of every layer land as the CPU unpacks them",
                        [&] { check_rows_land(transfer, rig); });
    gpu_check::run_case("a drained payload writes nothing", [&] { check_drained(transfer, rig); });
  }
  gpu_check::run_case("the staging comes back", [&] { check_staging_recycles(rig); });
  gpu_check::run_case("abandon ends an unmatched receive", [&] { check_abandon(rig); });
  return gpu_check::finish();
}
