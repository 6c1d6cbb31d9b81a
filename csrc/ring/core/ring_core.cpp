#include "ring/core/ring_core.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "ring/core/clock.h"
#include "ring/core/thread_name.h"

namespace mbs::ring_core {

int64_t num_micro_batches(int64_t rows, int64_t m) {
  if (rows < 0) throw std::invalid_argument("num_micro_batches: rows must be >= 0");
  if (m < 1) throw std::invalid_argument("num_micro_batches: micro-batch size must be >= 1");
  return rows / m + (rows % m != 0 ? 1 : 0);
}

std::pair<int64_t, int64_t> micro_batch_range(int64_t rows, int64_t m, int64_t item) {
  const int64_t k = num_micro_batches(rows, m);
  if (item < 0 || item >= k) throw std::out_of_range("micro_batch_range: item out of range");
  const int64_t base = rows / k, extra = rows % k;
  const int64_t start = item * base + std::min(item, extra);
  return {start, start + base + (item < extra ? 1 : 0)};
}

std::vector<int64_t> split_sizes(int64_t rows, int64_t m) {
  const int64_t k = num_micro_batches(rows, m);
  std::vector<int64_t> sizes(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) sizes[static_cast<size_t>(i)] = rows / k + (i < rows % k ? 1 : 0);
  return sizes;
}

RingCore::RingCore(int slots, int64_t items, Produce produce)
    : items_(items), produce_(std::move(produce)) {
  if (slots < 1) throw std::invalid_argument("RingCore: slots must be >= 1");
  if (items < 0) throw std::invalid_argument("RingCore: items must be >= 0");
  if (!produce_) throw std::invalid_argument("RingCore: produce callback is empty");
  state_.assign(static_cast<size_t>(slots), SlotState::kFree);
  slot_item_.assign(static_cast<size_t>(slots), -1);
  thread_ = std::thread([this] {
    name_this_thread(kProducerThreadName);
    run();
  });
}

RingCore::~RingCore() { stop(); }

void RingCore::run() {
  const int64_t nslots = static_cast<int64_t>(state_.size());
  for (int64_t item = 0; item < items_; ++item) {
    const int slot = static_cast<int>(item % nslots);
    {
      std::unique_lock<std::mutex> lock(mu_);
      producer_cv_.wait(lock, [&] { return stop_ || state_[slot] == SlotState::kFree; });
      if (stop_) return;
      state_[slot] = SlotState::kFilling;
    }
    std::exception_ptr err;
    const auto t0 = Clock::now();
    try {
      produce_(item, slot);
    } catch (...) {
      err = std::current_exception();
    }
    produce_ns_.fetch_add(ns_since(t0), std::memory_order_relaxed);
    const bool failed = static_cast<bool>(err);
    {
      // The error moves into error_ under the lock; this thread keeps no reference to it.
      std::lock_guard<std::mutex> lock(mu_);
      if (failed) {
        state_[slot] = SlotState::kFree;
        error_ = std::move(err);
        error_item_ = item;
      } else {
        state_[slot] = SlotState::kReady;
        slot_item_[slot] = item;
      }
    }
    consumer_cv_.notify_all();
    if (failed) return;
  }
}

std::optional<RingCore::Ticket> RingCore::take_locked(int64_t item) {
  const int slot = static_cast<int>(item % static_cast<int64_t>(state_.size()));
  state_[slot] = SlotState::kHeld;
  next_.store(item + 1, std::memory_order_relaxed);
  return Ticket{item, slot};
}

std::optional<RingCore::Ticket> RingCore::acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  const int64_t item = next_.load(std::memory_order_relaxed);
  if (stop_ || item >= items_) return std::nullopt;
  const int slot = static_cast<int>(item % static_cast<int64_t>(state_.size()));
  auto ready = [&] {
    return stop_ || (state_[slot] == SlotState::kReady && slot_item_[slot] == item) ||
           (error_ && error_item_ == item);
  };
  if (!ready()) {
    const auto t0 = Clock::now();
    // Timed waits: the wait is measured, and a lost wake-up could never hang us.
    while (!consumer_cv_.wait_for(lock, std::chrono::milliseconds(100), ready)) {
    }
    wait_ns_.fetch_add(ns_since(t0), std::memory_order_relaxed);
  }
  if (stop_) return std::nullopt;
  if (error_ && error_item_ == item) std::rethrow_exception(error_);
  return take_locked(item);
}

std::optional<RingCore::Ticket> RingCore::try_acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t item = next_.load(std::memory_order_relaxed);
  if (stop_ || item >= items_) return std::nullopt;
  const int slot = static_cast<int>(item % static_cast<int64_t>(state_.size()));
  if (state_[slot] != SlotState::kReady || slot_item_[slot] != item) return std::nullopt;
  return take_locked(item);
}

void RingCore::release(int slot) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (slot < 0 || slot >= static_cast<int>(state_.size()) || state_[slot] != SlotState::kHeld) {
      throw std::logic_error("RingCore::release: slot is not held by the consumer");
    }
    state_[slot] = SlotState::kFree;
    slot_item_[slot] = -1;
  }
  producer_cv_.notify_all();
}

void RingCore::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  producer_cv_.notify_all();
  consumer_cv_.notify_all();
  std::lock_guard<std::mutex> join_lock(join_mu_);
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

}  // namespace mbs::ring_core
