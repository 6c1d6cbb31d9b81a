// The OS name of the ring's own threads, so tools that list a process's threads (top -H,
// py-spy, gdb, /proc/<pid>/task/*/comm) and the tests tell them from torch's and Python's.
#pragma once

#if defined(__linux__)
#include <pthread.h>
#endif

namespace mbs::ring_core {

// Names the calling thread; at most 15 characters (Linux's limit). Does nothing elsewhere.
inline void name_this_thread(const char* name) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), name);
#else
  (void)name;
#endif
}

// The names, one place for the C++ side (mbs_ext.diagnostics repeats them for Python).
inline constexpr const char* kProducerThreadName = "mbs_ext ring";
inline constexpr const char* kStagingThreadName = "mbs_ext stage";

}  // namespace mbs::ring_core
