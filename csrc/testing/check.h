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
