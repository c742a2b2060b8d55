// Device links of several kinds behind one (a rank with CUDA IPC peers on its own
// host and NCCL peers on others): each call goes to the links that carry
// its peer, and receipts are renumbered so that two kinds' never clash.
// Plain C++; threads as DeviceKvLinks.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/error.h"
#include "worker/transfer/device_kv_links.h"

namespace duet {

class MixedDeviceKvLinks final : public DeviceKvLinks {
 public:
  // Link sets that carry disjoint sets of peers.
  explicit MixedDeviceKvLinks(std::vector<std::unique_ptr<DeviceKvLinks>> kinds)
      : kinds_(std::move(kinds)) {}

  bool carries(int peer) const override { return find(peer) != nullptr; }

  std::optional<DeviceRowsTicket> send(int peer, const KvLayout& layout, const DeviceKv& kv,
                                       int64_t layer, std::span<const int32_t> block_table,
                                       int64_t pos0, int64_t n, KvHeads heads) override {
    DeviceKvLinks* links = find(peer);
    if (links == nullptr) return std::nullopt;
    return links->send(peer, layout, kv, layer, block_table, pos0, n, heads);
  }

  uint64_t receive(int peer, const DeviceRowsTicket& ticket, const KvLayout& layout,
                   const DeviceKv* kv, std::span<const int32_t> block_table, int64_t layer,
                   int64_t pos0, int64_t n, KvHeads heads) override {
    const size_t index = index_of(peer);
    const uint64_t own =
        kinds_[index]->receive(peer, ticket, layout, kv, block_table, layer, pos0, n, heads);
    const uint64_t id = next_++;
    ids_[{index, own}] = id;
    return id;
  }

  std::vector<Done> poll() override {
    std::vector<Done> all;
    for (size_t i = 0; i < kinds_.size(); ++i) {
      for (Done done : kinds_[i]->poll()) {
        const auto it = ids_.find({i, done.receipt});
        if (it == ids_.end()) continue;
        done.receipt = it->second;
        ids_.erase(it);
        all.push_back(done);
      }
    }
    return all;
  }

  void released(int peer, const DeviceRowsTicket& ticket) override {
    if (DeviceKvLinks* links = find(peer)) links->released(peer, ticket);
  }

  void abandon(int peer) override {
    if (DeviceKvLinks* links = find(peer)) links->abandon(peer);
  }

  std::vector<std::string> take_notes() override {
    std::vector<std::string> all;
    for (const auto& links : kinds_) {
      for (std::string& note : links->take_notes()) all.push_back(std::move(note));
    }
    return all;
  }

  bool busy() const override {
    for (const auto& links : kinds_) {
      if (links->busy()) return true;
    }
    return false;
  }

 private:
  DeviceKvLinks* find(int peer) const {
    for (const auto& links : kinds_) {
      if (links->carries(peer)) return links.get();
    }
    return nullptr;
  }
  size_t index_of(int peer) const {
    for (size_t i = 0; i < kinds_.size(); ++i) {
      if (kinds_[i]->carries(peer)) return i;
    }
    DUET_ASSERT(false, "no device links carry rank {}", peer);
    return 0;
  }

  std::vector<std::unique_ptr<DeviceKvLinks>> kinds_;
  std::map<std::pair<size_t, uint64_t>, uint64_t> ids_;  // (kind, its receipt) -> ours
  uint64_t next_ = 1;
};

}  // namespace duet
