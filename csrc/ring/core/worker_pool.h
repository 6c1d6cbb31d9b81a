// WorkerPool: a small, fixed set of threads owned by one ring, for staging copies.
//
// Why its own pool: staging parallelism must be the ring's choice, not a side effect
// of torch's intra-op thread count (torch.set_num_threads), and the copies are plain
// memcpy / row-gather loops on raw pointers, so no torch is needed here.
//
// parallel_for(n, fn) splits [0, n) into at most threads() contiguous chunks; the
// calling thread runs the first chunk itself and workers the others. It returns
// once every chunk is done; the first exception thrown by any chunk is rethrown in
// the caller. One parallel_for at a time per pool (calls are serialized).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mbs::ring_core {

class WorkerPool {
 public:
  using Chunk = std::function<void(int64_t begin, int64_t end)>;

  // threads >= 1 (the caller counts as one; threads - 1 workers are started).
  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs fn over [0, n) in chunks of at least min_chunk items.
  void parallel_for(int64_t n, int64_t min_chunk, const Chunk& fn);

 private:
  void run(size_t worker);

  std::mutex call_mu_;  // one parallel_for at a time
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const Chunk* fn_ = nullptr;
  std::vector<std::pair<int64_t, int64_t>> chunks_;  // chunk i+1 goes to worker i
  uint64_t generation_ = 0;
  size_t pending_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> workers_;
};

// Copies n rows of row_bytes each from src (rows src_stride bytes apart) to the
// contiguous dst; with idx (n entries), row r of dst is src row idx[r]. Rows are
// split across the pool. Indices must already be in range (checked by the caller).
void copy_rows(WorkerPool& pool, void* dst, const void* src, int64_t row_bytes, int64_t src_stride,
               const int64_t* idx, int64_t n);

}  // namespace mbs::ring_core
