// The web console's live stream queue (server/web/event_queue.h): bounded by events and by bytes,
// drained a bounded write at a time, sealed by a refusal. Pure logic, with threads.
#include "server/web/event_queue.h"

#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"

namespace trainyard::web {
namespace {

// "event: E\ndata: D\n\n": the bytes one event holds in the queue.
size_t EventBytes(const std::string& event, const std::string& data) {
  return event.size() + data.size() + 16;
}

// A producer waits while the queue holds its bytes cap (a browser reading slowly held up to
// 20,000 events of any size: some 640 MiB of 16 KiB log lines), and goes on once the reader takes.
TEST(EventQueueTest, AProducerWaitsWhileTheQueueHoldsItsBytes) {
  const std::string data(1000, 'x');
  const size_t each = EventBytes("log", data);
  EventQueue queue(/*max_events=*/1000, /*max_bytes=*/3 * each, /*max_take=*/each);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(queue.Push("log", data));
  EXPECT_EQ(queue.bytes(), 3 * each);
  absl::Notification pushed;
  std::thread producer([&] {
    EXPECT_TRUE(queue.Push("log", data));
    pushed.Notify();
  });
  EXPECT_TRUE(queue.AwaitWaitingProducers(1, absl::Seconds(20)));
  EXPECT_FALSE(pushed.HasBeenNotified());
  std::string out;
  EXPECT_TRUE(queue.Take(&out, absl::Seconds(1)));
  EXPECT_EQ(out.size(), each) << "a take is bounded: one event of max_take";
  EXPECT_TRUE(pushed.WaitForNotificationWithTimeout(absl::Seconds(20)));
  producer.join();
  EXPECT_EQ(queue.bytes(), 3 * each);
}

// A take moves at most max_take bytes, but always one event, however large.
TEST(EventQueueTest, ATakeMovesAtMostItsBytesButAlwaysOneEvent) {
  EventQueue queue(1000, 1 << 20, /*max_take=*/100);
  ASSERT_TRUE(queue.Push("log", std::string(500, 'a')));
  ASSERT_TRUE(queue.Push("log", "b"));
  ASSERT_TRUE(queue.Push("log", "c"));
  std::string out;
  ASSERT_TRUE(queue.Take(&out, absl::Seconds(1)));
  EXPECT_EQ(out, "event: log\ndata: " + std::string(500, 'a') + "\n\n");
  out.clear();
  ASSERT_TRUE(queue.Take(&out, absl::Seconds(1)));
  EXPECT_EQ(out, "event: log\ndata: b\n\nevent: log\ndata: c\n\n");
  EXPECT_EQ(queue.bytes(), 0u);
}

// Sealed with a refusal: it is the last event the reader takes, a producer waiting for room is
// let go with false, and nothing pushed later is queued.
TEST(EventQueueTest, ASealedQueueEndsWithItsRefusal) {
  EventQueue queue(/*max_events=*/2, 1 << 20, 1 << 20);
  ASSERT_TRUE(queue.Push("log", "1"));
  ASSERT_TRUE(queue.Push("log", "2"));
  bool waiting_push = true;
  std::thread producer([&] { waiting_push = queue.Push("log", "3"); });
  EXPECT_TRUE(queue.AwaitWaitingProducers(1, absl::Seconds(20)));
  queue.Seal("refused", "{}");
  producer.join();
  EXPECT_FALSE(waiting_push);
  EXPECT_FALSE(queue.Push("end", "{}"));
  std::string out;
  EXPECT_FALSE(queue.Take(&out, absl::Seconds(1))) << "drained and ended: nothing more comes";
  EXPECT_EQ(out, "event: log\ndata: 1\n\nevent: log\ndata: 2\n\nevent: refused\ndata: {}\n\n");
}

// A refusal after the end (the job ended, then a recheck failed) is not queued: the end was said.
TEST(EventQueueTest, NoRefusalFollowsTheEnd) {
  EventQueue queue;
  ASSERT_TRUE(queue.Push("end", "{}"));
  queue.End();
  queue.Seal("refused", "{}");
  std::string out;
  EXPECT_FALSE(queue.Take(&out, absl::Seconds(1)));
  EXPECT_EQ(out, "event: end\ndata: {}\n\n");
}

// Ended with events still queued past one take: the reader is told to come back for them.
TEST(EventQueueTest, AnEndedQueueIsReadToItsLastEvent) {
  EventQueue queue(1000, 1 << 20, /*max_take=*/10);
  ASSERT_TRUE(queue.Push("log", "first"));
  ASSERT_TRUE(queue.Push("end", "{}"));
  queue.End();
  std::string out;
  EXPECT_TRUE(queue.Take(&out, absl::Seconds(1)));
  EXPECT_EQ(out, "event: log\ndata: first\n\n");
  out.clear();
  EXPECT_FALSE(queue.Take(&out, absl::Seconds(1)));
  EXPECT_EQ(out, "event: end\ndata: {}\n\n");
}

}  // namespace
}  // namespace trainyard::web
