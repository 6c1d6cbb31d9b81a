// The one steady clock of the ring core and the ring (durations in nanoseconds).
#pragma once

#include <chrono>
#include <cstdint>

namespace mbs::ring_core {

using Clock = std::chrono::steady_clock;

inline int64_t ns_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

}  // namespace mbs::ring_core
