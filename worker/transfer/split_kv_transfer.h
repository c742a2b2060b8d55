// A rank's KV transfer in a cluster that instances may join while it serves
// (worker/transfer/kv_member_links.h): the transfer made at start-up (MPI or
// TCP) for the ranks of the mpirun job, and a TcpKvTransfer for the members,
// whose addresses start at the job's world size. Every call goes to the one
// that reaches its peer; one import comes from one prefill instance, so it
// lives in one of the two from start to end.
//
// Threads: as KvTransfer's.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <span>

#include "worker/transfer/kv_transfer_adapter.h"
#include "worker/transfer/tcp_kv_transfer.h"

namespace duet {

class SplitKvTransfer final : public KvTransfer {
 public:
  // `job` reaches ranks [0, world_size); `members` every other address.
  SplitKvTransfer(std::unique_ptr<KvTransferAdapter> job, std::unique_ptr<TcpKvTransfer> members,
                  int world_size);

  // The members' transfer (add_peer, as they join).
  TcpKvTransfer& members() { return *members_; }

  void set_handlers(Handlers handlers) override;
  void start_import(int prefill_leader, const PrefillOrder& order, ImportPlan plan) override;
  void expect_import(ImportPlan plan) override;
  void abort_import(RequestId id) override;
  void forget_imports(const KvCache& cache) override;
  void send_rows(int decode_rank, RequestId id, int64_t layer, int64_t pos0, int64_t n,
                 const KvCache& cache, std::span<const int32_t> block_table, int64_t head_offset,
                 const KvSource& heads) override;
  void send_handoff(int decode_peer, const KvHandoff& handoff) override;
  bool device_transfer(int peer) const override;
  void peers_lost(std::span<const Rank> ranks) override;
  Counters counters() const override;

 private:
  KvTransfer& route(int peer) const;
  // The import's transfer, remembered until its end (a handler's last call).
  void remember(RequestId id, KvTransfer& transfer, const KvCache* cache);
  void forget(RequestId id);

  const std::unique_ptr<KvTransferAdapter> job_;
  const std::unique_ptr<TcpKvTransfer> members_;
  const int world_size_;
  std::mutex mutex_;
  struct Route {
    KvTransfer* transfer = nullptr;
    const KvCache* cache = nullptr;
  };
  std::map<RequestId, Route> imports_;  // guarded by mutex_
};

}  // namespace duet
