#include "ring/core/worker_pool.h"

#include "ring/core/thread_name.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace mbs::ring_core {

WorkerPool::WorkerPool(int threads) {
  if (threads < 1) throw std::invalid_argument("WorkerPool: threads must be >= 1");
  workers_.reserve(static_cast<size_t>(threads - 1));
  try {
    for (int i = 0; i + 1 < threads; ++i) workers_.emplace_back([this, i] {
      name_this_thread(kStagingThreadName);
      run(static_cast<size_t>(i));
    });
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
    throw;
  }
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void WorkerPool::run(size_t worker) {
  uint64_t seen = 0;
  for (;;) {
    const Chunk* fn = nullptr;
    std::pair<int64_t, int64_t> range{0, 0};
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (worker + 1 >= chunks_.size()) continue;  // no chunk for this worker this time
      fn = fn_;
      range = chunks_[worker + 1];
    }
    std::exception_ptr err;
    try {
      (*fn)(range.first, range.second);
    } catch (...) {
      err = std::current_exception();
    }
    {
      // Hand the error over and drop this thread's reference while holding the lock: the last
      // reference then goes away on the thread that rethrows it, never here after that thread has
      // read the message (exception_ptr counts references inside the uninstrumented C++ runtime,
      // where ThreadSanitizer cannot see the ordering).
      std::lock_guard<std::mutex> lock(mu_);
      if (err && !error_) error_ = std::move(err);
      err = nullptr;
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }
}

void WorkerPool::parallel_for(int64_t n, int64_t min_chunk, const Chunk& fn) {
  if (n <= 0) return;
  min_chunk = std::max<int64_t>(min_chunk, 1);
  const int64_t parts = std::clamp<int64_t>(n / min_chunk, 1, threads());
  if (parts == 1) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  std::vector<std::pair<int64_t, int64_t>> chunks;
  chunks.reserve(static_cast<size_t>(parts));
  const int64_t base = n / parts, extra = n % parts;
  int64_t begin = 0;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t len = base + (p < extra ? 1 : 0);
    chunks.emplace_back(begin, begin + len);
    begin += len;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    chunks_ = chunks;
    fn_ = &fn;
    error_ = nullptr;
    pending_ = static_cast<size_t>(parts - 1);
    ++generation_;
  }
  work_cv_.notify_all();
  std::exception_ptr err;
  try {
    fn(chunks[0].first, chunks[0].second);
  } catch (...) {
    err = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  fn_ = nullptr;
  if (!err) err = error_;
  error_ = nullptr;
  lock.unlock();
  if (err) std::rethrow_exception(err);
}

void copy_rows(WorkerPool& pool, void* dst, const void* src, int64_t row_bytes, int64_t src_stride,
               const int64_t* idx, int64_t n) {
  if (n <= 0 || row_bytes <= 0) return;
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  // At least ~256 KiB per chunk: smaller pieces cost more in hand-over than they gain.
  const int64_t min_rows = std::max<int64_t>(1, (int64_t{256} << 10) / row_bytes);
  if (idx == nullptr && src_stride == row_bytes) {  // one contiguous block: split it by bytes
    const int64_t total = n * row_bytes;
    const int64_t block = int64_t{256} << 10;
    pool.parallel_for((total + block - 1) / block, 1, [&](int64_t b, int64_t e) {
      const int64_t lo = b * block, hi = std::min(total, e * block);
      std::memcpy(out + lo, in + lo, static_cast<size_t>(hi - lo));
    });
    return;
  }
  pool.parallel_for(n, min_rows, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t row = idx ? idx[r] : r;
      std::memcpy(out + r * row_bytes, in + row * src_stride, static_cast<size_t>(row_bytes));
    }
  });
}

}  // namespace mbs::ring_core
