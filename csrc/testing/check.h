// A tiny assertion helper for the torch-free unit tests (ctest) (no test framework needed).
#pragma once

#include <cstdio>
#include <cstdlib>

#define MBS_CHECK(...)                                                        \
  do {                                                                        \
    if (!(__VA_ARGS__)) {                                                       \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #__VA_ARGS__); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

// Checks that `statement` throws an exception of type `exception`.
#define MBS_CHECK_THROWS(exception, ...)                                      \
  do {                                                                        \
    bool mbs_threw = false;                                                   \
    try {                                                                     \
      __VA_ARGS__;                                                            \
    } catch (const exception&) {                                              \
      mbs_threw = true;                                                       \
    }                                                                         \
    MBS_CHECK(mbs_threw);                                                     \
  } while (0)
