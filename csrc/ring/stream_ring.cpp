#include "ring/stream_ring.h"

#include <ATen/ops/empty_strided.h>
#include <ATen/ops/index_select.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <string>
#include <utility>

#include "ring/core/clock.h"

namespace mbs {

namespace {

using ring_core::Clock;
using ring_core::ns_since;

// Defensive checks only: mbs_ext.ring validates the batch with the messages users see.
int64_t rows_of(const std::vector<at::Tensor>& leaves) {
  TORCH_CHECK_VALUE(!leaves.empty(), "StreamRing: batch must contain at least one tensor");
  const int64_t n = leaves[0].defined() && leaves[0].dim() >= 1 ? leaves[0].size(0) : -1;
  for (size_t k = 0; k < leaves.size(); ++k) {
    const at::Tensor& t = leaves[k];
    TORCH_CHECK_VALUE(t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && t.dim() >= 1 &&
                          t.size(0) == n,
                      "StreamRing: batch tensor ", k, " is not a dense CPU tensor with ", n, " rows");
  }
  TORCH_CHECK_VALUE(n > 0, "StreamRing: batch has 0 rows");
  return n;
}

at::Tensor checked_indices(const std::optional<at::Tensor>& indices, int64_t rows) {
  if (!indices.has_value() || !indices->defined()) return at::Tensor();
  const at::Tensor& idx = *indices;
  TORCH_CHECK_VALUE(idx.device().is_cpu() && idx.dim() == 1 && idx.numel() > 0 &&
                        (idx.scalar_type() == at::kLong || idx.scalar_type() == at::kInt),
                    "StreamRing: indices must be a non-empty 1-d int64 CPU tensor");
  // A private copy: the gather reads rows by raw pointer long after this check, so the
  // caller's tensor (a reused shuffle buffer, say) must not be able to change under it.
  at::Tensor out = idx.to(at::kLong).clone(at::MemoryFormat::Contiguous);
  // One range check, whatever the caller did.
  const auto* p = out.const_data_ptr<int64_t>();
  const auto [lo, hi] = std::minmax_element(p, p + out.numel());
  TORCH_CHECK_INDEX(*lo >= 0 && *hi < rows, "StreamRing: indices must lie in [0, ", rows, "), got [", *lo, ", ",
                    *hi, "]");
  return out;
}

// Strides for a staged micro-batch of `t`'s rows (dim 0 any length). When each row of `t`
// (all dims but 0) is one gap-free block of memory, in whatever dimension order, the staged
// rows keep that order and sit one after the other: a row is then copied with one memcpy,
// and a channels_last image batch arrives channels_last. Otherwise: contiguous, empty when
// rows cannot be copied as blocks (a lazy conjugate or negative bit, a quantized tensor, a
// negative row stride, rows that are not dense).
std::vector<int64_t> block_row_strides(const at::Tensor& t) {
  if (t.is_conj() || t.is_neg() || t.is_quantized() || t.stride(0) < 0) return {};
  const auto row_sizes = t.sizes().slice(1);
  const auto row_strides = t.strides().slice(1);
  // A metadata-only tensor of one row's layout asks torch's own density rule.
  if (!at::empty_strided(row_sizes, row_strides, at::TensorOptions().dtype(t.scalar_type()).device(at::kMeta))
           .is_non_overlapping_and_dense()) {
    return {};
  }
  std::vector<int64_t> strides{std::max<int64_t>(c10::multiply_integers(row_sizes), 1)};
  strides.insert(strides.end(), row_strides.begin(), row_strides.end());
  return strides;
}

// Whether `t`'s rows are blocks laid one after the other (block_row_strides' layout), so
// that any run of rows is itself dense and can be copied to the device in one piece.
bool rows_adjacent(const at::Tensor& t, const std::vector<int64_t>& block_strides) {
  return !block_strides.empty() && (t.size(0) <= 1 || t.stride(0) == block_strides[0]);
}

// Rethrows a staging failure with the micro-batch it concerns, keeping the error class.
[[noreturn]] void rethrow_with_context(int64_t item, size_t leaf) {
  const std::string where = "StreamRing worker, micro-batch " + std::to_string(item) + ", batch tensor " +
                            std::to_string(leaf) + ": ";
  try {
    throw;
  } catch (const c10::IndexError& e) {
    TORCH_CHECK_INDEX(false, where, e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    TORCH_CHECK_VALUE(false, where, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    TORCH_CHECK_TYPE(false, where, e.what_without_backtrace());
  } catch (const c10::OutOfMemoryError& e) {  // stays an out-of-memory error for step's back-off
    TORCH_CHECK_WITH(OutOfMemoryError, false, where, e.what_without_backtrace());
  } catch (const std::bad_alloc& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, where, e.what());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, where, e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, where, e.what());
  }
}

// One line on the exception in flight, for the error later next() calls raise.
std::string describe_current_exception() noexcept {
  try {
    std::string what;
    try {
      throw;
    } catch (const c10::Error& e) {
      what = e.what_without_backtrace();
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    const size_t cut = what.find('\n');
    if (cut != std::string::npos) what.resize(cut);
    return what.empty() ? std::string("unknown error") : what;
  } catch (...) {  // out of memory for the message itself: a short literal needs no allocation
    return std::string("unknown error");
  }
}

// Tensors of our own over the caller's storage: staging reads sizes, strides and data
// pointers long after they were checked, so an in-place resize_ or set_ on the caller's
// tensor objects must not change what this stream reads (its storage stays alive here).
std::vector<at::Tensor> aliases(std::vector<at::Tensor> leaves) {
  for (auto& t : leaves) t = t.alias();
  return leaves;
}

}  // namespace

RingIterator::RingIterator(c10::Device device, int slots, std::vector<at::Tensor> leaves, int64_t micro_batch_size,
                           std::optional<at::Tensor> indices, std::shared_ptr<RingStats> stats,
                           std::shared_ptr<HostBufferPool> pool, std::shared_ptr<ring_core::WorkerPool> workers)
    : leaves_(aliases(std::move(leaves))),
      micro_batch_size_(micro_batch_size),
      indices_(checked_indices(indices, rows_of(leaves_))),
      total_rows_(indices_.defined() ? indices_.numel() : rows_of(leaves_)),
      items_(ring_core::num_micro_batches(total_rows_, std::max<int64_t>(micro_batch_size, 1))),
      stats_(std::move(stats)),
      workers_(std::move(workers)) {
  TORCH_CHECK_VALUE(micro_batch_size >= 1, "StreamRing: micro_batch_size must be >= 1, got ", micro_batch_size);
  TORCH_CHECK_VALUE(slots >= 2, "StreamRing: slots must be >= 2, got ", slots);
  if (device.is_cuda()) {
    transfer_ = make_cuda_transfer(device, slots);
  } else {
    TORCH_CHECK_VALUE(device.is_cpu(), "StreamRing: device must be cpu or cuda, got ", device);
    transfer_ = make_host_transfer(pool);
  }
  // Buffers in flight: the slots, the one enqueued ahead, the one in use and the one being dropped.
  pool->cache_at_least(leaves_.size() * (static_cast<size_t>(slots) + 3));
  // Per leaf, once per stream: how its rows are staged, and whether the transfer reads them
  // in place (asking a CUDA ring whether memory is pinned costs a driver query).
  block_strides_.reserve(leaves_.size());
  in_place_.reserve(leaves_.size());
  for (const at::Tensor& leaf : leaves_) {
    block_strides_.push_back(block_row_strides(leaf));
    in_place_.push_back(!indices_.defined() && rows_adjacent(leaf, block_strides_.back()) &&
                        !transfer_->needs_staging(leaf));
  }
  staged_.resize(static_cast<size_t>(slots));
  stats_->planned.store(items_);
  core_ = std::make_unique<ring_core::RingCore>(slots, items_, [this](int64_t item, int slot) { stage(item, slot); });
}

RingIterator::~RingIterator() {
  try {
    close();
  } catch (...) {  // never throw from a destructor
  }
}

void RingIterator::stage(int64_t item, int slot) {
  const auto t0 = Clock::now();
  c10::AutoGradMode no_grad(false);
  const auto [start, stop] = ring_core::micro_batch_range(total_rows_, micro_batch_size_, item);
  const int64_t len = stop - start;
  transfer_->wait_copied(slot);  // nothing reads the slot's staging memory any more
  std::vector<at::Tensor> out;
  out.reserve(leaves_.size());
  int64_t bytes = 0, staged = 0;
  for (size_t k = 0; k < leaves_.size(); ++k) {
    const at::Tensor& src = leaves_[k];
    try {
      if (in_place_[k]) {  // read by the transfer itself
        out.push_back(src.narrow(0, start, len));
        bytes += static_cast<int64_t>(out.back().nbytes());
        continue;
      }
      at::Tensor dst = transfer_->staging_buffer(slot, k, staged_layout(k, len), src.scalar_type());
      const int64_t* idx = indices_.defined() ? indices_.const_data_ptr<int64_t>() + start : nullptr;
      if (!block_strides_[k].empty()) {  // one memcpy per row, in the source's order within a row
        const int64_t elem = static_cast<int64_t>(src.element_size());
        const int64_t row_bytes = (len > 0 ? dst.numel() / len : 0) * elem;
        const char* base = static_cast<const char*>(src.const_data_ptr());
        if (!idx) base += start * src.stride(0) * elem;
        ring_core::copy_rows(*workers_, dst.mutable_data_ptr(), base, row_bytes, src.stride(0) * elem, idx, len);
      } else if (idx) {  // rare layouts: torch's own kernels
        at::index_select_out(dst, src, 0, indices_.narrow(0, start, len));
      } else {
        dst.copy_(src.narrow(0, start, len));
      }
      bytes += static_cast<int64_t>(dst.nbytes());
      staged += static_cast<int64_t>(dst.nbytes());
      out.push_back(std::move(dst));
    } catch (...) {
      stats_->stage_ns.fetch_add(ns_since(t0));
      rethrow_with_context(item, k);
    }
  }
  staged_[static_cast<size_t>(slot)] = std::move(out);
  stats_->bytes.fetch_add(bytes);
  stats_->staged_bytes.fetch_add(staged);
  stats_->stage_ns.fetch_add(ns_since(t0));
}

std::optional<std::vector<at::Tensor>> RingIterator::next() {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable_locked();
  if (closed_) return std::nullopt;
  std::optional<Ticket> ticket;  // stays empty when a copy is pending
  if (!pending_) {
    ticket = next_ticket();
    if (!ticket) {
      close_locked();
      return std::nullopt;
    }
  }
  // From here on a failure is the consumer's (allocating or copying on the device):
  // every micro-batch in flight is dropped safely for its memory and the stream ends.
  std::optional<DeviceBatch> batch;
  try {
    batch = pending_ ? take_pending() : take(*ticket);
    copy_ahead();
    transfer_->deliver(*batch);
    prepare_next(pending_ ? pending_->item + 1 : batch->item + 1);
  } catch (...) {
    end_with_error(batch);
    throw;
  }
  record_position(batch->item);
  stats_->micro_batches.fetch_add(1);
  return std::move(batch->tensors);
}

void RingIterator::check_usable_locked() const {
  TORCH_CHECK(!superseded_,
              "StreamRing: this stream was closed because a new stream was started on the same ring. A ring "
              "streams one batch at a time, and a MicroBatchStreamer (or mbs_ext.step, per model) keeps one "
              "ring: give each thread or nested call its own streamer, or pass ring=StreamRing(...)");
  TORCH_CHECK(failed_.empty(), "StreamRing: this stream ended with an error earlier: ", failed_);
}

// The next micro-batch's ticket: the one held back after an out-of-memory error copying
// ahead, else the core's (blocks for the worker); nullopt after the last micro-batch.
std::optional<RingIterator::Ticket> RingIterator::next_ticket() {
  if (held_) return std::exchange(held_, std::nullopt);
  std::optional<Ticket> ticket;
  try {
    ticket = core_->acquire();  // a worker failure surfaces here, at its micro-batch, and stays
  } catch (...) {
    record_wait();
    throw;
  }
  record_wait();
  return ticket;
}

// Enqueues the copy of a staged micro-batch and gives its slot back to the worker.
DeviceBatch RingIterator::take(const Ticket& ticket) {
  auto& staged = staged_[static_cast<size_t>(ticket.slot)];
  DeviceBatch batch = transfer_->enqueue(ticket.item, ticket.slot, staged);  // staged stays until the copy is enqueued
  staged.clear();  // before release: from then on the worker may refill the slot
  try {
    core_->release(ticket.slot);  // the worker waits for the copy out of it before refilling it
  } catch (...) {
    drop(batch);  // its copy is enqueued: free its memory only behind it
    throw;
  }
  return batch;
}

DeviceBatch RingIterator::take_pending() {
  DeviceBatch batch = std::move(*pending_);
  pending_.reset();
  return batch;
}

// Overlap: when the following micro-batch is staged already, start its copy now.
// Optional, like the reservation: out of memory here leaves it staged, to be copied
// on the next call, and stops copying ahead for the rest of the stream (each such
// error costs the allocator a device-wide release of its cache).
void RingIterator::copy_ahead() {
  if (!copy_ahead_) return;
  auto ahead = core_->try_acquire();
  if (!ahead) return;
  try {
    pending_ = take(*ahead);
  } catch (const c10::OutOfMemoryError&) {
    held_ = ahead;
    copy_ahead_ = false;
    reserve_ahead_ = false;
  }
}

// A consumer-side failure: the batch in hand and every one in flight are dropped, the
// stream closes, and later next() calls raise with what went wrong.
void RingIterator::end_with_error(std::optional<DeviceBatch>& batch) noexcept {
  if (batch) drop(*batch);
  try {
    close_locked();
  } catch (...) {  // the failure in flight is the one to report
  }
  failed_ = describe_current_exception();  // never throws
}

void RingIterator::record_position(int64_t item) {
  std::lock_guard<std::mutex> pos(pos_mu_);
  index_ = item;
  rows_ = ring_core::micro_batch_range(total_rows_, micro_batch_size_, item);
}

void RingIterator::record_wait() {
  stats_->wait_ns.store(static_cast<int64_t>(core_->wait_seconds() * 1e9));
}

int64_t RingIterator::index() const {
  std::lock_guard<std::mutex> pos(pos_mu_);
  return index_;
}

std::pair<int64_t, int64_t> RingIterator::rows() const {
  std::lock_guard<std::mutex> pos(pos_mu_);
  return rows_;
}

HostLayout RingIterator::staged_layout(size_t leaf, int64_t rows) const {
  HostLayout layout;
  layout.sizes.assign(leaves_[leaf].sizes().begin(), leaves_[leaf].sizes().end());
  layout.sizes[0] = rows;
  const std::vector<int64_t>& block = block_strides_[leaf];
  if (block.empty()) {
    const auto contiguous = c10::contiguous_strides(layout.sizes);
    layout.strides.assign(contiguous.begin(), contiguous.end());
  } else {
    layout.strides = block;
  }
  return layout;
}

void RingIterator::prepare_next(int64_t item) {
  if (!reserve_ahead_ || item >= items_) return;
  const auto [start, stop] = ring_core::micro_batch_range(total_rows_, micro_batch_size_, item);
  try {
    // What stage() will hand over for this item: views of in-place leaves, staged layouts
    // (metadata only) of the others.
    std::vector<at::Tensor> like;
    like.reserve(leaves_.size());
    for (size_t k = 0; k < leaves_.size(); ++k) {
      const at::TensorOptions meta = at::TensorOptions().dtype(leaves_[k].scalar_type()).device(at::kMeta);
      if (in_place_[k]) {
        like.push_back(leaves_[k].narrow(0, start, stop - start));
      } else {
        const HostLayout layout = staged_layout(k, stop - start);
        like.push_back(at::empty_strided(layout.sizes, layout.strides, meta));
      }
    }
    transfer_->prepare(item, static_cast<int>(item % core_->slots()), like);
  } catch (const c10::OutOfMemoryError&) {
    // The reservation is optional: enqueue allocates when the micro-batch's turn comes.
    // Reserving stops for the rest of the stream: under tight memory every attempt would
    // cost the allocator's out-of-memory recovery (a device-wide release of its cache).
    reserve_ahead_ = false;
  }
}

void RingIterator::drop(DeviceBatch& batch) noexcept {
  try {
    transfer_->discard(batch);
  } catch (...) {
    // Not even the wait for its copy could be enqueued (a failing device). Keep the
    // memory rather than free it under a copy that may still write it (no allocation).
    for (auto& t : batch.tensors) (void)t.unsafeReleaseTensorImpl();
  }
  batch.tensors.clear();
}

void RingIterator::close_locked() {
  if (closed_) return;
  closed_ = true;
  core_->stop();  // joins the worker
  record_wait();
  if (pending_) {
    DeviceBatch batch = std::move(*pending_);
    pending_.reset();
    drop(batch);
  }
  held_.reset();
  transfer_->release_reserved();
  for (auto& s : staged_) s.clear();
}

void RingIterator::close() {
  std::lock_guard<std::mutex> lock(mu_);
  close_locked();
}

void RingIterator::supersede() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!closed_) superseded_ = true;
  close_locked();
}

bool RingIterator::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

StreamRing::StreamRing(c10::Device device, int slots, int staging_threads)
    : device_(device),
      slots_(slots),
      stats_(std::make_shared<RingStats>()),
      pool_(std::make_shared<HostBufferPool>(static_cast<size_t>(slots) + 3)) {
  TORCH_CHECK_VALUE(slots >= 2, "StreamRing: slots must be >= 2, got ", slots);
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), "StreamRing: device must be cpu or cuda, got ", device);
  TORCH_CHECK_VALUE(staging_threads >= 1 && staging_threads <= 256,
                    "StreamRing: staging_threads must be in [1, 256], got ", staging_threads);
  workers_ = std::make_shared<ring_core::WorkerPool>(staging_threads);
}

StreamRing::~StreamRing() {
  try {
    close();
  } catch (...) {
  }
}

std::shared_ptr<RingIterator> StreamRing::open(std::vector<at::Tensor> leaves, int64_t micro_batch_size,
                                               std::optional<at::Tensor> indices) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto previous = current_.lock()) previous->supersede();
  auto stats = std::make_shared<RingStats>();
  auto stream = std::make_shared<RingIterator>(device_, slots_, std::move(leaves), micro_batch_size,
                                               std::move(indices), stats, pool_, workers_);
  stats_ = std::move(stats);
  current_ = stream;
  return stream;
}

std::shared_ptr<RingStats> StreamRing::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void StreamRing::close() {
  std::shared_ptr<RingIterator> previous;
  {
    std::lock_guard<std::mutex> lock(mu_);
    previous = current_.lock();
    current_.reset();
  }
  if (previous) previous->close();
}

}  // namespace mbs
