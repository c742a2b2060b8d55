// The state machine of device payloads in flight (worker/transfer/device/device_receipts.h)
// and, over a loopback wire, the protocol a device transfer runs with it: the
// sender takes staging (worker/transfer/device/staging_ring.h) for each payload and sends a
// header; the receiver starts a receipt per header, receipts land in order,
// each landed payload's staging goes back to the sender; imports complete,
// fail or are cancelled at any point. Checked: no rows count after an
// import ended, no end is reported while a receipt of it is in flight,
// every staging region comes back, and the ring never hands out live bytes.
#include "worker/transfer/device/device_receipts.h"

#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "worker/transfer/device/staging_ring.h"

namespace duet {
namespace {

struct End {
  RequestId id;
  std::string how;
  bool operator==(const End&) const = default;
};

TEST(DeviceReceipts, RowsOfALiveImportCountWhenTheyLand) {
  DeviceReceipts<End> book;
  std::vector<End> ended;
  book.add(1, RequestId{7}, 3, 16);
  book.add(2, RequestId{7}, 3, 5);
  EXPECT_TRUE(book.pending(RequestId{7}));
  const auto first = book.finish(1, true, ended);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->id, RequestId{7});
  EXPECT_EQ(first->source, 3);
  EXPECT_EQ(first->n, 16);
  const auto second = book.finish(2, true, ended);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->n, 5);
  EXPECT_FALSE(book.pending(RequestId{7}));
  book.end(RequestId{7}, {RequestId{7}, "complete"}, ended);
  EXPECT_EQ(ended, (std::vector<End>{{RequestId{7}, "complete"}}));
  EXPECT_TRUE(book.empty());
}

TEST(DeviceReceipts, AnEndWaitsForTheLastReceiptInFlight) {
  DeviceReceipts<End> book;
  std::vector<End> ended;
  book.add(1, RequestId{1}, 2, 16);
  book.add(2, RequestId{1}, 2, 16);
  book.end(RequestId{1}, {RequestId{1}, "released"}, ended);
  EXPECT_TRUE(ended.empty());
  EXPECT_TRUE(book.holding());
  EXPECT_FALSE(book.finish(1, true, ended).has_value());  // over: its rows do not count
  EXPECT_TRUE(ended.empty());
  EXPECT_FALSE(book.finish(2, true, ended).has_value());
  EXPECT_EQ(ended, (std::vector<End>{{RequestId{1}, "released"}}));
  EXPECT_TRUE(book.empty());
}

TEST(DeviceReceipts, AFailedReceiptSaysSoAndUnknownReceiptsAreNobodys) {
  DeviceReceipts<End> book;
  std::vector<End> ended;
  book.add(5, RequestId{2}, 1, 8);
  const auto rows = book.finish(5, false, ended);
  ASSERT_TRUE(rows.has_value());
  EXPECT_FALSE(rows->ok);
  EXPECT_FALSE(book.finish(99, true, ended).has_value());  // a drained payload
  EXPECT_TRUE(ended.empty());
}

TEST(DeviceReceipts, TwoEndsOfOneImportComeBothInOrder) {
  DeviceReceipts<End> book;
  std::vector<End> ended;
  book.add(1, RequestId{3}, 1, 8);
  book.end(RequestId{3}, {RequestId{3}, "failed"}, ended);
  book.end(RequestId{3}, {RequestId{3}, "released"}, ended);
  EXPECT_TRUE(ended.empty());
  book.finish(1, true, ended);
  EXPECT_EQ(ended, (std::vector<End>{{RequestId{3}, "failed"}, {RequestId{3}, "released"}}));
}

// The loopback: one sender and one receiver, a wire of headers one way and
// acks the other, both in order; receipts land in order after a random
// delay; imports are cancelled or fail at random.
struct Header {
  RequestId id;
  size_t offset = 0;
  int64_t n = 0;
};

struct Import {
  int64_t expected = 0;
  int64_t received = 0;
  bool closing = false;  // the transfer ended it (its end may still be held)
  bool ended = false;    // its end was reported
};

TEST(DeviceReceiptsProtocol, LoopbackTrafficEndsCleanly) {
  std::mt19937 rng(11);
  constexpr size_t kRowBytes = 512;
  StagingRing staging(64 * kRowBytes, 256);
  std::map<size_t, size_t> live;  // sender staging in use: offset -> bytes
  std::deque<Header> wire;        // sender -> receiver
  std::deque<size_t> acks;        // receiver -> sender: offsets to free
  struct Landing {
    uint64_t receipt = 0;
    size_t offset = 0;
    int delay = 0;
  };
  std::deque<Landing> in_flight;  // the device transfer's receipts, landing in order
  DeviceReceipts<End> book;
  std::map<RequestId, Import> imports;
  std::map<RequestId, int64_t> to_send;  // rows the sender has yet to send
  std::vector<End> ended;
  uint64_t next_receipt = 1;
  int64_t counted_after_end = 0, stalls = 0;
  uint64_t next_id = 1;

  const auto deliver = [&](std::vector<End>& ends) {
    for (const End& end : ends) {
      ASSERT_FALSE(book.pending(end.id)) << "an end while its receipts are in flight";
      Import& import = imports.at(end.id);
      ASSERT_FALSE(import.ended) << "ended twice";
      import.ended = true;
      if (end.how == "complete") {
        EXPECT_EQ(import.received, import.expected);
      }
      ended.push_back(end);
    }
    ends.clear();
  };
  // The receiver takes the next header and starts a receipt for it (unless
  // its import ended: the payload is drained), landing after `delay` tries.
  const auto take_header = [&](int delay) {
    const Header h = wire.front();
    wire.pop_front();
    const uint64_t receipt = next_receipt++;
    if (!imports.at(h.id).closing) book.add(receipt, h.id, 0, h.n);  // else drained
    in_flight.push_back({receipt, h.offset, delay});
  };
  // The front receipt lands: its staging is acked, and its rows count, which
  // may complete the import.
  const auto land_front = [&](std::vector<End>& ends) {
    const auto rows = book.finish(in_flight.front().receipt, true, ends);
    acks.push_back(in_flight.front().offset);
    in_flight.pop_front();
    if (!rows) return;
    Import& import = imports.at(rows->id);
    if (import.closing) ++counted_after_end;
    import.received += rows->n;
    if (import.received == import.expected) {
      import.closing = true;
      book.end(rows->id, {rows->id, "complete"}, ends);
    }
  };
  // The sender frees the staging of the oldest ack.
  const auto free_acked = [&] {
    staging.release(acks.front());
    live.erase(acks.front());
    acks.pop_front();
  };

  for (int step = 0; step < 30000; ++step) {
    std::vector<End> ends;
    const unsigned action = rng() % 10;
    if (action == 0 && imports.size() < 2000) {  // a new import of 1..40 rows
      const RequestId id{next_id++};
      const int64_t rows = 1 + static_cast<int64_t>(rng() % 40);
      imports[id] = {rows, 0, false, false};
      to_send[id] = rows;
    } else if (action <= 3 && !to_send.empty()) {  // the sender sends a payload
      auto it = to_send.begin();
      std::advance(it, static_cast<long>(rng() % to_send.size()));
      const int64_t n = std::min<int64_t>(it->second, 1 + static_cast<int64_t>(rng() % 8));
      const std::optional<size_t> offset = staging.acquire(static_cast<size_t>(n) * kRowBytes);
      if (!offset) {
        ++stalls;  // full: it waits for acks
      } else {
        const size_t bytes = (static_cast<size_t>(n) * kRowBytes + 255) / 256 * 256;
        for (const auto& [o, b] : live) {
          ASSERT_TRUE(*offset + bytes <= o || o + b <= *offset) << "staging handed out twice";
        }
        live[*offset] = bytes;
        wire.push_back({it->first, *offset, n});
        if ((it->second -= n) == 0) to_send.erase(it);
      }
    } else if (action <= 5 && !wire.empty()) {
      take_header(static_cast<int>(rng() % 4));
    } else if (action <= 7 && !in_flight.empty()) {
      if (in_flight.front().delay-- > 0) continue;
      land_front(ends);
    } else if (action == 8 && !acks.empty()) {
      free_acked();
    } else if (action == 9 && !imports.empty()) {  // a cancel or a failure
      auto it = imports.begin();
      std::advance(it, static_cast<long>(rng() % imports.size()));
      if (!it->second.closing) {
        it->second.closing = true;
        book.end(it->first, {it->first, rng() % 2 ? "released" : "failed"}, ends);
        to_send.erase(it->first);  // the sender was told to stop
      }
    }
    deliver(ends);
  }
  // Drain everything.
  while (!wire.empty() || !in_flight.empty() || !acks.empty()) {
    std::vector<End> ends;
    if (!wire.empty()) {
      take_header(0);
    } else if (!in_flight.empty()) {
      land_front(ends);
    } else {
      free_acked();
    }
    deliver(ends);
  }
  EXPECT_EQ(counted_after_end, 0);
  EXPECT_TRUE(book.empty());
  EXPECT_TRUE(staging.empty());
  EXPECT_TRUE(live.empty());
  EXPECT_GT(stalls, 0) << "the ring never filled: the test did not exercise waiting";
  int64_t complete = 0, other = 0;
  for (const End& end : ended) (end.how == "complete" ? complete : other) += 1;
  EXPECT_GT(complete, 100);
  EXPECT_GT(other, 10);
  for (const auto& [id, import] : imports) {
    if (!to_send.contains(id)) {
      EXPECT_TRUE(import.ended) << "import " << id.value << " never ended";
    }
  }
}

}  // namespace
}  // namespace duet
