// Device transfers of several kinds behind one (a rank with CUDA IPC peers on its own
// host and NCCL peers on others): each call goes to the device transfer that carries
// its peer, and receipts are renumbered so that two kinds' never clash.
// Plain C++; threads as DeviceKvLink.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/error.h"
#include "worker/transfer/device/device_kv_link.h"

namespace duet {

class MixedDeviceKvLink final : public DeviceKvLink {
 public:
  // Device transfers that carry disjoint sets of peers.
  explicit MixedDeviceKvLink(std::vector<std::unique_ptr<DeviceKvLink>> kinds)
      : kinds_(std::move(kinds)) {}

  bool carries(int peer) const override { return find(peer) != nullptr; }

  std::optional<DeviceRowsTicket> send(int peer, const KvLayout& layout, const DeviceKv& kv,
                                       int64_t layer, std::span<const int32_t> block_table,
                                       int64_t pos0, int64_t n, KvHeads heads) override {
    DeviceKvLink* transfer = find(peer);
    if (transfer == nullptr) return std::nullopt;
    return transfer->send(peer, layout, kv, layer, block_table, pos0, n, heads);
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
    if (DeviceKvLink* transfer = find(peer)) transfer->released(peer, ticket);
  }

  void abandon(int peer) override {
    if (DeviceKvLink* transfer = find(peer)) transfer->abandon(peer);
  }

  std::vector<std::string> take_notes() override {
    std::vector<std::string> all;
    for (const auto& transfer : kinds_) {
      for (std::string& note : transfer->take_notes()) all.push_back(std::move(note));
    }
    return all;
  }

  bool busy() const override {
    for (const auto& transfer : kinds_) {
      if (transfer->busy()) return true;
    }
    return false;
  }

 private:
  DeviceKvLink* find(int peer) const {
    for (const auto& transfer : kinds_) {
      if (transfer->carries(peer)) return transfer.get();
    }
    return nullptr;
  }
  size_t index_of(int peer) const {
    for (size_t i = 0; i < kinds_.size(); ++i) {
      if (kinds_[i]->carries(peer)) return i;
    }
    DUET_ASSERT(false, "no device transfer carries rank {}", peer);
    return 0;
  }

  std::vector<std::unique_ptr<DeviceKvLink>> kinds_;
  std::map<std::pair<size_t, uint64_t>, uint64_t> ids_;  // (kind, its receipt) -> ours
  uint64_t next_ = 1;
};

}  // namespace duet
