// RingCore: the slot/thread/queue logic of the streaming ring, free of torch and CUDA.
//
// A fixed number of slots and one background producer thread. For items 0..M-1 in
// order the producer waits until slot (item % slots) is free, calls
// produce(item, slot), and marks the slot ready. The consumer acquire()s items in
// the same order, uses the slot, and release()s it; only then may the producer
// refill that slot. An exception thrown by produce() is captured and rethrown by
// acquire() exactly where the consumer would have received that item; the
// producer stops there. stop() (also run by the destructor) wakes every waiter and
// joins the thread, even while the producer is blocked on a slot the consumer never
// releases.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

namespace mbs::ring_core {

// Balanced micro-batches: `rows` rows with micro-batch size m >= 1 make
// k = ceil(rows / m) micro-batches whose sizes differ by at most one; the first
// rows % k get rows / k + 1 rows. The same rule as mbs_ext.batch.split_sizes.
int64_t num_micro_batches(int64_t rows, int64_t m);
std::vector<int64_t> split_sizes(int64_t rows, int64_t m);
// [start, stop) of micro-batch `item` under that rule (O(1)).
std::pair<int64_t, int64_t> micro_batch_range(int64_t rows, int64_t m, int64_t item);

class RingCore {
 public:
  using Produce = std::function<void(int64_t item, int slot)>;

  struct Ticket {
    int64_t item;
    int slot;
  };

  // Starts the producer thread at once. slots >= 1, items >= 0.
  RingCore(int slots, int64_t items, Produce produce);
  ~RingCore();
  RingCore(const RingCore&) = delete;
  RingCore& operator=(const RingCore&) = delete;

  // Blocks until the next item (in order) is ready and hands out its slot; the
  // consumer now holds the slot until release(). Returns nullopt once all items
  // were handed out or after stop(). Rethrows the producer's exception when the
  // next item is the one whose produce() threw.
  std::optional<Ticket> acquire();
  // Like acquire() but never blocks: nullopt when the next item is not ready yet
  // (or failed: the failure surfaces in the next acquire()).
  std::optional<Ticket> try_acquire();
  // Returns a held slot to the producer.
  void release(int slot);
  // Stops the producer (it finishes a produce() call in progress) and joins it.
  // Idempotent; acquire() returns nullopt afterwards.
  void stop();

  int slots() const { return static_cast<int>(state_.size()); }
  int64_t items() const { return items_; }
  int64_t delivered() const { return next_.load(std::memory_order_relaxed); }
  // Total seconds the producer spent inside produce() / the consumer spent blocked in acquire().
  double produce_seconds() const { return static_cast<double>(produce_ns_.load()) * 1e-9; }
  double wait_seconds() const { return static_cast<double>(wait_ns_.load()) * 1e-9; }

 private:
  enum class SlotState : uint8_t { kFree, kFilling, kReady, kHeld };

  void run();
  std::optional<Ticket> take_locked(int64_t item);  // mu_ held, next item is ready

  const int64_t items_;
  const Produce produce_;
  std::mutex mu_;
  std::condition_variable producer_cv_;  // a slot became free, or stop
  std::condition_variable consumer_cv_;  // a slot became ready, an error, or stop
  std::vector<SlotState> state_;
  std::vector<int64_t> slot_item_;
  bool stop_ = false;
  std::exception_ptr error_;
  int64_t error_item_ = -1;
  std::atomic<int64_t> next_{0};  // next item the consumer takes (written under mu_)
  std::atomic<int64_t> produce_ns_{0};
  std::atomic<int64_t> wait_ns_{0};
  std::mutex join_mu_;  // serializes concurrent stop() calls around join()
  std::thread thread_;
};

}  // namespace mbs::ring_core
