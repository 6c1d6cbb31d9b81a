// Unit tests of the streaming ring core: in-order exactly-once delivery, no slot
// reuse while the consumer holds it, error propagation, prompt stop with a blocked
// producer, many rings created and destroyed, and a randomized stress run.
#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "testing/check.h"
#include "ring/core/ring_core.h"

using mbs::ring_core::RingCore;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Per-slot payload with guards that detect the producer writing a held slot.
struct Slots {
  explicit Slots(int n) : value(n), held(n) {
    for (auto& h : held) h.store(false);
  }
  std::vector<std::atomic<int64_t>> value;
  std::vector<std::atomic<bool>> held;
  std::atomic<int> violations{0};
};

void test_order_exactly_once() {
  for (int nslots : {1, 2, 3, 5}) {
    for (int64_t items : {0, 1, 2, 7, 100}) {
      Slots s(nslots);
      std::atomic<int64_t> produced{0};
      RingCore ring(nslots, items, [&](int64_t item, int slot) {
        if (s.held[slot].load()) s.violations.fetch_add(1);
        s.value[slot].store(item * 10 + 3);
        produced.fetch_add(1);
      });
      int64_t expect = 0;
      while (auto t = ring.acquire()) {
        MBS_CHECK(t->item == expect);
        MBS_CHECK(t->slot == static_cast<int>(expect % nslots));
        s.held[t->slot].store(true);
        MBS_CHECK(s.value[t->slot].load() == expect * 10 + 3);
        s.held[t->slot].store(false);
        ring.release(t->slot);
        ++expect;
      }
      MBS_CHECK(expect == items);
      MBS_CHECK(ring.delivered() == items);
      MBS_CHECK(!ring.acquire().has_value());
      ring.stop();
      MBS_CHECK(produced.load() == items);
      MBS_CHECK(s.violations.load() == 0);
    }
  }
}

void test_no_reuse_while_held() {
  // The consumer holds every slot for a while (and several at once); the producer
  // must never touch a held slot, and never run more than `slots` items ahead.
  const int nslots = 3;
  const int64_t items = 60;
  Slots s(nslots);
  std::atomic<int64_t> max_ahead{0};
  std::atomic<int64_t> consumed{0};
  RingCore ring(nslots, items, [&](int64_t item, int slot) {
    if (s.held[slot].load()) s.violations.fetch_add(1);
    const int64_t ahead = item - consumed.load();
    int64_t prev = max_ahead.load();
    while (ahead > prev && !max_ahead.compare_exchange_weak(prev, ahead)) {
    }
    s.value[slot].store(item);
  });
  std::vector<RingCore::Ticket> holding;
  while (auto t = ring.acquire()) {
    MBS_CHECK(!s.held[t->slot].load());
    s.held[t->slot].store(true);
    MBS_CHECK(s.value[t->slot].load() == t->item);
    holding.push_back(*t);
    if (holding.size() == 2 || t->item == items - 1) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      for (auto& h : holding) {
        MBS_CHECK(s.value[h.slot].load() == h.item);  // not overwritten while held
        s.held[h.slot].store(false);
        ring.release(h.slot);
        consumed.store(h.item + 1);
      }
      holding.clear();
    }
  }
  MBS_CHECK(ring.delivered() == items);
  MBS_CHECK(s.violations.load() == 0);
  MBS_CHECK(max_ahead.load() <= nslots);
}

void test_try_acquire() {
  std::atomic<bool> gate{false};
  RingCore ring(2, 3, [&](int64_t item, int) {
    if (item == 1) {
      while (!gate.load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
  auto a = ring.acquire();
  MBS_CHECK(a && a->item == 0);
  MBS_CHECK(!ring.try_acquire().has_value());  // item 1 is still being produced
  gate.store(true);
  std::optional<RingCore::Ticket> b;
  while (!(b = ring.try_acquire())) std::this_thread::yield();
  MBS_CHECK(b->item == 1 && b->slot == 1);
  ring.release(a->slot);
  ring.release(b->slot);
  auto c = ring.acquire();
  MBS_CHECK(c && c->item == 2);
  ring.release(c->slot);
  MBS_CHECK(!ring.acquire().has_value());
  MBS_CHECK(!ring.try_acquire().has_value());
}

void test_release_errors() {
  RingCore ring(2, 1, [](int64_t, int) {});
  MBS_CHECK_THROWS(std::logic_error, ring.release(0));  // not held
  MBS_CHECK_THROWS(std::logic_error, ring.release(7));
  MBS_CHECK_THROWS(std::invalid_argument, RingCore(0, 1, [](int64_t, int) {}));
}

void test_error_propagation() {
  for (int64_t fail_at : {0, 1, 4, 9}) {
    std::atomic<int64_t> calls{0};
    RingCore ring(2, 10, [&](int64_t item, int) {
      calls.fetch_add(1);
      if (item == fail_at) throw std::runtime_error("boom at item " + std::to_string(item));
    });
    int64_t got = 0;
    std::string message;
    try {
      while (auto t = ring.acquire()) {
        MBS_CHECK(t->item == got);
        ++got;
        ring.release(t->slot);
      }
    } catch (const std::runtime_error& e) {
      message = e.what();
    }
    MBS_CHECK(got == fail_at);  // every item before the failing one arrived
    MBS_CHECK(message == "boom at item " + std::to_string(fail_at));
    // Asking again rethrows the same error, it does not skip the failed item.
    bool again = false;
    try {
      ring.acquire();
    } catch (const std::runtime_error& e) {
      again = std::string(e.what()) == message;
    }
    MBS_CHECK(again);
    MBS_CHECK(!ring.try_acquire().has_value());
    ring.stop();
    MBS_CHECK(calls.load() == fail_at + 1);  // the producer stopped at the failure
  }
}

void test_early_stop_blocked_producer() {
  // The consumer takes one item and never releases; the producer fills the other
  // slot and blocks. stop() must still return promptly.
  std::atomic<int64_t> produced{0};
  auto ring = std::make_unique<RingCore>(2, 1000, [&](int64_t, int) { produced.fetch_add(1); });
  auto t = ring->acquire();
  MBS_CHECK(t && t->item == 0);
  while (produced.load() < 2) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  MBS_CHECK(produced.load() == 2);
  const auto t0 = Clock::now();
  ring->stop();
  MBS_CHECK(seconds_since(t0) < 1.0);
  MBS_CHECK(!ring->acquire().has_value());
  ring.reset();  // destructor after stop is fine

  // Destroying without stop() and without ever acquiring, producer blocked.
  const auto t1 = Clock::now();
  {
    RingCore r(2, 1000, [](int64_t, int) {});
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  MBS_CHECK(seconds_since(t1) < 1.0);
}

void test_stop_wakes_waiting_consumer() {
  // A consumer blocked in acquire() (producer slow) is woken by stop() from another thread.
  std::atomic<bool> release_producer{false};
  RingCore ring(2, 5, [&](int64_t, int) {
    while (!release_producer.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  std::atomic<bool> returned{false};
  std::thread consumer([&] {
    auto t = ring.acquire();
    MBS_CHECK(!t.has_value());
    returned.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  MBS_CHECK(!returned.load());
  std::thread stopper([&] { ring.stop(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  release_producer.store(true);  // lets the in-flight produce() call finish
  stopper.join();
  consumer.join();
  MBS_CHECK(returned.load());
  MBS_CHECK(ring.wait_seconds() > 0.0);
}

void test_many_rings() {
  for (int round = 0; round < 300; ++round) {
    const int nslots = 2 + round % 3;
    RingCore ring(nslots, 50, [](int64_t, int) {});
    const int take = round % 7;  // sometimes stop before taking anything
    for (int i = 0; i < take; ++i) {
      auto t = ring.acquire();
      MBS_CHECK(t && t->item == i);
      if (i + 1 < take || round % 2 == 0) ring.release(t->slot);  // sometimes keep the last one
    }
  }
  // Several rings running at once, each with its own consumer thread.
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      std::vector<int64_t> out(2, -1);
      RingCore ring(2, 200, [&](int64_t item, int slot) { out[slot] = item * (k + 1); });
      int64_t expect = 0;
      while (auto t = ring.acquire()) {
        if (t->item != expect || out[t->slot] != expect * (k + 1)) failures.fetch_add(1);
        ++expect;
        ring.release(t->slot);
      }
      if (expect != 200) failures.fetch_add(1);
    });
  }
  for (auto& t : threads) t.join();
  MBS_CHECK(failures.load() == 0);
}

void test_stress_random_delays() {
  std::mt19937 rng(1234);
  for (int round = 0; round < 20; ++round) {
    const int nslots = 2 + static_cast<int>(rng() % 4);
    const int64_t items = 1 + static_cast<int64_t>(rng() % 300);
    const unsigned seed = static_cast<unsigned>(rng());
    Slots s(nslots);
    std::vector<int64_t> payload(static_cast<size_t>(nslots), -1);  // guarded by the ring protocol
    std::mt19937 prod_rng(seed);
    RingCore ring(nslots, items, [&](int64_t item, int slot) {
      if (s.held[slot].load()) s.violations.fetch_add(1);
      if (prod_rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(prod_rng() % 300));
      payload[slot] = item;
    });
    std::mt19937 cons_rng(seed + 1);
    int64_t expect = 0;
    // Early stop in some rounds.
    const int64_t stop_at = (round % 3 == 0) ? static_cast<int64_t>(cons_rng() % items) : items;
    while (expect < stop_at) {
      auto t = (cons_rng() % 2) ? ring.acquire() : ring.try_acquire();
      if (!t) continue;
      MBS_CHECK(t->item == expect);
      s.held[t->slot].store(true);
      MBS_CHECK(payload[t->slot] == expect);
      if (cons_rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(cons_rng() % 300));
      MBS_CHECK(payload[t->slot] == expect);
      s.held[t->slot].store(false);
      ring.release(t->slot);
      ++expect;
    }
    ring.stop();
    MBS_CHECK(s.violations.load() == 0);
    MBS_CHECK(ring.produce_seconds() >= 0.0);
  }
}

}  // namespace

int main() {
  test_order_exactly_once();
  test_no_reuse_while_held();
  test_try_acquire();
  test_release_errors();
  test_error_propagation();
  test_early_stop_blocked_producer();
  test_stop_wakes_waiting_consumer();
  test_many_rings();
  test_stress_random_delays();
  return 0;
}
