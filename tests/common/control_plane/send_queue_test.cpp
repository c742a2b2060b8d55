// SendQueue (common/control_plane/send_queue.h), the order in which the control
// channel's communication thread posts every send of a process: control
// messages ahead of queued KV payloads, payloads per destination in order
// and within their window.
#include "common/control_plane/send_queue.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace duet {
namespace {

struct Message {
  int destination = 0;
  SendLane lane = SendLane::kControl;
  std::vector<std::byte> bytes;
  std::string name;
};

Message control(int destination, std::string name) {
  return {destination, SendLane::kControl, std::vector<std::byte>(80), std::move(name)};
}
Message payload(int destination, size_t bytes, std::string name) {
  return {destination, SendLane::kBulk, std::vector<std::byte>(bytes), std::move(name)};
}

std::vector<std::string> take(SendQueue<Message>& queue) {
  std::vector<Message> posted;
  queue.take(posted);
  std::vector<std::string> names;
  for (const Message& message : posted) names.push_back(message.name);
  return names;
}

constexpr size_t kKiB = 1024;

TEST(SendQueue, AControlMessageQueuedAfterManyLargePayloadsIsPostedFirst) {
  SendQueue<Message> queue(64 * kKiB);
  for (int i = 0; i < 100; ++i) queue.push(payload(2, 4 * kKiB, "payload"));
  queue.push(control(2, "cancel"));
  const std::vector<std::string> posted = take(queue);
  ASSERT_EQ(posted.size(), 17u);  // the cancel and a window's worth of payloads
  EXPECT_EQ(posted[0], "cancel");
  // Later control messages still pass the 84 payloads waiting for the window.
  queue.push(control(2, "handoff"));
  EXPECT_EQ(take(queue), std::vector<std::string>{"handoff"});
}

TEST(SendQueue, EachLaneKeepsItsOrderPerDestination) {
  SendQueue<Message> queue(64 * kKiB);
  queue.push(control(1, "header 1"));
  queue.push(payload(1, 100, "payload 1"));
  queue.push(control(2, "order"));
  queue.push(control(1, "header 2"));
  queue.push(payload(1, 100, "payload 2"));
  EXPECT_EQ(take(queue),
            (std::vector<std::string>{"header 1", "order", "header 2", "payload 1", "payload 2"}));
  EXPECT_TRUE(take(queue).empty());
}

TEST(SendQueue, PayloadsWaitForTheirDestinationsWindow) {
  SendQueue<Message> queue(10);
  queue.push(payload(1, 6, "a"));
  queue.push(payload(1, 4, "b"));
  queue.push(payload(1, 1, "c"));
  EXPECT_EQ(take(queue), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(queue.bulk_in_flight());
  queue.sent(1, 4);
  EXPECT_EQ(take(queue), std::vector<std::string>{"c"});
  queue.sent(1, 6);
  queue.sent(1, 1);
  EXPECT_FALSE(queue.bulk_in_flight());
}

TEST(SendQueue, APayloadLargerThanTheWindowGoesAlone) {
  SendQueue<Message> queue(10);
  queue.push(payload(1, 4, "small"));
  queue.push(payload(1, 25, "large"));
  queue.push(payload(1, 4, "after"));
  EXPECT_EQ(take(queue), std::vector<std::string>{"small"});
  queue.sent(1, 4);
  EXPECT_EQ(take(queue), std::vector<std::string>{"large"});
  EXPECT_TRUE(take(queue).empty());
  queue.sent(1, 25);
  EXPECT_EQ(take(queue), std::vector<std::string>{"after"});
}

TEST(SendQueue, ADestinationThatTakesNothingHoldsUpOnlyItsOwnPayloads) {
  SendQueue<Message> queue(10);
  queue.push(payload(3, 10, "to the dead rank"));
  queue.push(payload(3, 10, "stuck"));
  EXPECT_EQ(take(queue), std::vector<std::string>{"to the dead rank"});  // never sent()
  queue.push(payload(1, 10, "elsewhere"));
  queue.push(control(3, "heartbeat"));
  EXPECT_EQ(take(queue), (std::vector<std::string>{"heartbeat", "elsewhere"}));
}

TEST(SendQueue, QueuedMessagesCanBeCountedAndDropped) {
  SendQueue<Message> queue(10);
  queue.push(control(1, "mine"));
  queue.push(payload(1, 10, "mine"));
  queue.push(payload(1, 10, "mine"));
  queue.push(control(2, "theirs"));
  const auto mine = [](const Message& message) { return message.name == "mine"; };
  EXPECT_EQ(queue.count_if(mine), 3u);
  EXPECT_EQ(queue.erase_if(mine), 3u);
  EXPECT_EQ(queue.count_if(mine), 0u);
  EXPECT_EQ(take(queue), std::vector<std::string>{"theirs"});
}

}  // namespace
}  // namespace duet
