// Several DeviceKvChannels behind one (a rank with CUDA IPC peers on its own
// host and NCCL peers on others): each call goes to the channel that carries
// its peer, and receipts are renumbered so that two channels' never clash.
// Plain C++; threads as DeviceKvChannel.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/error.h"
#include "worker/device_kv_channel.h"

namespace duet {

class DeviceKvChannels final : public DeviceKvChannel {
 public:
  // Channels that carry disjoint sets of peers.
  explicit DeviceKvChannels(std::vector<std::unique_ptr<DeviceKvChannel>> channels)
      : channels_(std::move(channels)) {}

  bool carries(int peer) const override { return find(peer) != nullptr; }

  std::optional<DeviceRowsTicket> send(int peer, const KvLayout& layout, const DeviceKv& kv,
                                       int64_t layer, std::span<const int32_t> block_table,
                                       int64_t pos0, int64_t n, KvHeads heads) override {
    DeviceKvChannel* channel = find(peer);
    if (channel == nullptr) return std::nullopt;
    return channel->send(peer, layout, kv, layer, block_table, pos0, n, heads);
  }

  uint64_t receive(int peer, const DeviceRowsTicket& ticket, const KvLayout& layout,
                   const DeviceKv* kv, std::span<const int32_t> block_table, int64_t layer,
                   int64_t pos0, int64_t n, KvHeads heads) override {
    const size_t index = index_of(peer);
    const uint64_t own =
        channels_[index]->receive(peer, ticket, layout, kv, block_table, layer, pos0, n, heads);
    const uint64_t id = next_++;
    ids_[{index, own}] = id;
    return id;
  }

  std::vector<Done> poll() override {
    std::vector<Done> all;
    for (size_t i = 0; i < channels_.size(); ++i) {
      for (Done done : channels_[i]->poll()) {
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
    if (DeviceKvChannel* channel = find(peer)) channel->released(peer, ticket);
  }

  void abandon(int peer) override {
    if (DeviceKvChannel* channel = find(peer)) channel->abandon(peer);
  }

  std::vector<std::string> take_notes() override {
    std::vector<std::string> all;
    for (const auto& channel : channels_) {
      for (std::string& note : channel->take_notes()) all.push_back(std::move(note));
    }
    return all;
  }

  bool busy() const override {
    for (const auto& channel : channels_) {
      if (channel->busy()) return true;
    }
    return false;
  }

 private:
  DeviceKvChannel* find(int peer) const {
    for (const auto& channel : channels_) {
      if (channel->carries(peer)) return channel.get();
    }
    return nullptr;
  }
  size_t index_of(int peer) const {
    for (size_t i = 0; i < channels_.size(); ++i) {
      if (channels_[i]->carries(peer)) return i;
    }
    DUET_ASSERT(false, "no device channel carries rank {}", peer);
    return 0;
  }

  std::vector<std::unique_ptr<DeviceKvChannel>> channels_;
  std::map<std::pair<size_t, uint64_t>, uint64_t> ids_;  // (channel, its receipt) -> ours
  uint64_t next_ = 1;
};

}  // namespace duet
