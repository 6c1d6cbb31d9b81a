// Unit tests of the staging pool and the balanced split: every item of a
// parallel_for runs exactly once, errors surface in the caller, copy_rows equals a
// serial reference (contiguous, strided and gathered), pools are created and
// destroyed many times, and the split matches the documented rule.
#include <atomic>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ring/core/ring_core.h"
#include "testing/check.h"
#include "ring/core/worker_pool.h"

using mbs::ring_core::WorkerPool;

namespace {

void test_split_sizes() {
  MBS_CHECK((mbs::ring_core::split_sizes(10, 4) == std::vector<int64_t>{4, 3, 3}));
  MBS_CHECK((mbs::ring_core::split_sizes(8, 4) == std::vector<int64_t>{4, 4}));
  MBS_CHECK((mbs::ring_core::split_sizes(1, 5) == std::vector<int64_t>{1}));
  MBS_CHECK(mbs::ring_core::split_sizes(0, 3).empty());
  for (int64_t rows = 1; rows < 200; ++rows) {
    for (int64_t m = 1; m < rows + 3; ++m) {
      const auto sizes = mbs::ring_core::split_sizes(rows, m);
      const int64_t k = (rows + m - 1) / m;
      MBS_CHECK(static_cast<int64_t>(sizes.size()) == k);
      MBS_CHECK(std::accumulate(sizes.begin(), sizes.end(), int64_t{0}) == rows);
      int64_t start = 0;
      for (int64_t i = 0; i < k; ++i) {
        const int64_t size = sizes[static_cast<size_t>(i)];
        MBS_CHECK(size <= m && size >= sizes.back() && size - sizes.back() <= 1);
        MBS_CHECK(size == rows / k + (i < rows % k ? 1 : 0));
        const auto range = mbs::ring_core::micro_batch_range(rows, m, i);
        MBS_CHECK(range.first == start && range.second == start + size);
        start += size;
      }
    }
  }
  MBS_CHECK_THROWS(std::invalid_argument, mbs::ring_core::split_sizes(5, 0));
}

void test_exactly_once() {
  for (int threads : {1, 2, 3, 8}) {
    WorkerPool pool(threads);
    MBS_CHECK(pool.threads() == threads);
    for (int64_t n : {0, 1, 2, 7, 1000}) {
      for (int64_t min_chunk : {1, 3, 100}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        for (auto& h : hits) h.store(0);
        pool.parallel_for(n, min_chunk, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)].fetch_add(1);
        });
        for (auto& h : hits) MBS_CHECK(h.load() == 1);
      }
    }
  }
}

void test_errors_surface() {
  WorkerPool pool(4);
  for (int64_t fail_at : {0, 5, 99}) {
    std::string message;
    try {
      pool.parallel_for(100, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          if (i == fail_at) throw std::runtime_error("boom " + std::to_string(i));
        }
      });
    } catch (const std::runtime_error& e) {
      message = e.what();
    }
    MBS_CHECK(message == "boom " + std::to_string(fail_at));
    std::atomic<int64_t> sum{0};  // the pool still works afterwards
    pool.parallel_for(100, 1, [&](int64_t b, int64_t e) { sum.fetch_add(e - b); });
    MBS_CHECK(sum.load() == 100);
  }
}

void test_copy_rows() {
  std::mt19937 rng(7);
  for (int threads : {1, 2, 4}) {
    WorkerPool pool(threads);
    for (int64_t row_bytes : {1, 3, 64, 300000}) {
      const int64_t rows = 37, stride = row_bytes + 5;
      std::vector<unsigned char> src(static_cast<size_t>(rows * stride));
      for (auto& b : src) b = static_cast<unsigned char>(rng());
      // contiguous rows 4..20
      {
        const int64_t n = 16;
        std::vector<unsigned char> dst(static_cast<size_t>(n * row_bytes));
        std::vector<unsigned char> contiguous(src.begin(), src.begin() + rows * row_bytes);
        mbs::ring_core::copy_rows(pool, dst.data(), contiguous.data() + 4 * row_bytes, row_bytes, row_bytes, nullptr, n);
        MBS_CHECK(std::memcmp(dst.data(), contiguous.data() + 4 * row_bytes, static_cast<size_t>(n * row_bytes)) == 0);
      }
      // strided rows and a gather with repeats
      std::vector<int64_t> idx(50);
      for (auto& i : idx) i = static_cast<int64_t>(rng() % rows);
      for (const int64_t* ix : {static_cast<const int64_t*>(nullptr), static_cast<const int64_t*>(idx.data())}) {
        const int64_t n = ix ? 50 : rows;
        std::vector<unsigned char> dst(static_cast<size_t>(n * row_bytes));
        mbs::ring_core::copy_rows(pool, dst.data(), src.data(), row_bytes, stride, ix, n);
        for (int64_t r = 0; r < n; ++r) {
          const int64_t s = ix ? ix[r] : r;
          MBS_CHECK(std::memcmp(dst.data() + r * row_bytes, src.data() + s * stride, static_cast<size_t>(row_bytes)) == 0);
        }
      }
    }
  }
}

void test_many_pools() {
  for (int round = 0; round < 200; ++round) {
    WorkerPool pool(1 + round % 4);
    std::atomic<int64_t> sum{0};
    if (round % 3) pool.parallel_for(10, 1, [&](int64_t b, int64_t e) { sum.fetch_add(e - b); });
    MBS_CHECK(sum.load() == (round % 3 ? 10 : 0));
  }
}

}  // namespace

int main() {
  test_split_sizes();
  test_exactly_once();
  test_errors_surface();
  test_copy_rows();
  test_many_pools();
  return 0;
}
