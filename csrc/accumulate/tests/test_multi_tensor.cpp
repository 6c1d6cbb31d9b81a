// Host emulation of the CUDA scale_accumulate_ kernel: the launch plan
// (accumulate/multi_tensor.h) and the per-thread work (accumulate/scale_accumulate_block.h)
// are the code the GPU runs, executed here block by block and thread by thread.
//
// Within a block, threads share nothing but the final OR of their flags, and no two
// threads of any block touch the same element (which these tests check), so running
// them one after another gives what the GPU gives. Under AddressSanitizer+UBSan a
// stray index or a misaligned 16-byte vector access fails the run; guard bytes around
// every tensor catch writes that stay inside an allocation.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "accumulate/accumulate.h"
#include "accumulate/scale_accumulate_block.h"
#include "testing/check.h"

namespace mbs::accumulate {

// Bit-pattern stand-ins for the device's bf16 and fp16, converted with the CPU
// kernel's exact round-to-nearest-even conversions.
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
template <> struct Convert<Bf16, float> {
  static float to(Bf16 v) { return bf16_to_f32(v.bits); }
  static Bf16 from(float v) { return Bf16{f32_to_bf16(v)}; }
};
template <> struct Convert<Bf16, double> {
  static double to(Bf16 v) { return bf16_to_f32(v.bits); }
};
template <> struct Convert<F16, float> {
  static float to(F16 v) { return f16_to_f32(v.bits); }
  static F16 from(float v) { return F16{f32_to_f16(v)}; }
};
template <> struct Convert<F16, double> {
  static double to(F16 v) { return f16_to_f32(v.bits); }
};

}  // namespace mbs::accumulate

using namespace mbs::accumulate;

namespace {

// The device's PairListMeta: 4 KB of kernel arguments (CUDA < 13), and 32 KB.
using SmallMeta = TensorListMeta<2, 168>;
using LargeMeta = TensorListMeta<2, 1344>;
static_assert(sizeof(SmallMeta) + sizeof(ScaleAccumulateBlock<double, double, true>) <= 4096 &&
                  sizeof(LargeMeta) + sizeof(ScaleAccumulateBlock<double, double, true>) <= 32764,
              "metadata over the argument limit");

// What the kernel does for one launch, one block and one thread at a time: the block ORs
// its threads' flags and (kSumSquares) adds their sums in float64, reported once per block.
template <typename Meta, typename Op>
void emulate_launch(const Meta& meta, uint32_t blocks, const Op& op) {
  MBS_CHECK(meta.slots >= 1 && meta.slots <= Meta::kMaxSlots);
  MBS_CHECK(blocks == meta.chunk_end[meta.slots - 1]);
  for (uint32_t block = 0; block < blocks; ++block) {
    const int slot = meta.slot_of(block);
    bool flagged = false;
    double block_sum = 0.0;
    for (int thread = 0; thread < Op::kThreads; ++thread) {
      typename Op::Sum sum{};
      flagged |= op(meta, slot, meta.chunk_in_slot(slot, block), thread, sum);
      if constexpr (Op::kSumSquares) block_sum += static_cast<double>(sum.value);
    }
    if constexpr (Op::kSumSquares) op.report_squares(block_sum);
    if (flagged) op.report_non_finite();
  }
}

// Independent reference conversions (not the Convert traits under test).
float ref_to_f(float v) { return v; }
float ref_to_f(double v) { return static_cast<float>(v); }
float ref_to_f(Bf16 v) { return bf16_to_f32(v.bits); }
float ref_to_f(F16 v) { return f16_to_f32(v.bits); }
double ref_to_d(float v) { return v; }
double ref_to_d(double v) { return v; }
double ref_to_d(Bf16 v) { return bf16_to_f32(v.bits); }
double ref_to_d(F16 v) { return f16_to_f32(v.bits); }
template <typename T> T ref_from_f(float v);
template <> float ref_from_f<float>(float v) { return v; }
template <> Bf16 ref_from_f<Bf16>(float v) { return Bf16{f32_to_bf16(v)}; }
template <> F16 ref_from_f<F16>(float v) { return F16{f32_to_f16(v)}; }

template <typename T> T make_value(double v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    return static_cast<T>(v);
  } else {
    return ref_from_f<T>(static_cast<float>(v));
  }
}

// acc + s * g as the kernel must compute it: float64 math for a float64 accumulator,
// float otherwise, one rounding in the fused multiply-add, then into A.
template <typename A, typename G> A reference(A a, G g, double s) {
  if constexpr (std::is_same_v<A, double>) {
    return std::fma(s, ref_to_d(g), a);
  } else {
    return ref_from_f<A>(std::fma(static_cast<float>(s), ref_to_f(g), ref_to_f(a)));
  }
}

template <typename A, typename G> bool reference_non_finite(G g) {
  if constexpr (std::is_same_v<A, double>) {
    return !std::isfinite(ref_to_d(g));
  } else {
    return !std::isfinite(ref_to_f(g));
  }
}

// One allocation per tensor: `offset` elements, the tensor, then guard elements.
// Everything outside the tensor holds random bytes that must stay as they were.
template <typename T> struct Buffer {
  static constexpr size_t kGuard = 24;
  unsigned char* base = nullptr;
  size_t bytes = 0;
  size_t offset = 0;
  int64_t n = 0;
  std::vector<unsigned char> before;  // the whole allocation before the run

  Buffer(int64_t n_, size_t offset_, std::mt19937_64& rng) : offset(offset_), n(n_) {
    bytes = ((offset + static_cast<size_t>(n) + kGuard) * sizeof(T) + 63) / 64 * 64;
    base = static_cast<unsigned char*>(std::aligned_alloc(64, bytes));
    MBS_CHECK(base != nullptr);
    for (size_t i = 0; i < bytes; ++i) base[i] = static_cast<unsigned char>(rng());
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept
      : base(o.base), bytes(o.bytes), offset(o.offset), n(o.n), before(std::move(o.before)) {
    o.base = nullptr;
  }
  ~Buffer() { std::free(base); }

  T* data() const { return reinterpret_cast<T*>(base + offset * sizeof(T)); }
  void snapshot() { before.assign(base, base + bytes); }
  bool outside_unchanged() const {
    const size_t lo = offset * sizeof(T);
    const size_t hi = lo + static_cast<size_t>(n) * sizeof(T);
    return std::memcmp(base, before.data(), lo) == 0 && std::memcmp(base + hi, before.data() + hi, bytes - hi) == 0;
  }
  bool all_unchanged() const { return std::memcmp(base, before.data(), bytes) == 0; }
};

enum class ScaleKind { value, float_ptr, double_ptr };

struct Case {
  std::vector<int64_t> numels;
  std::vector<size_t> acc_offsets;   // elements before each accumulator
  std::vector<size_t> grad_offsets;  // elements before each grad
  int64_t max_piece = kMaxPieceElements;
  ScaleKind scale_kind = ScaleKind::value;
  double scale = 0.75;
  int bad_tensor = -1;  // a tensor holding one non-finite grad, or -1
};

// The tensors of case `c`, filled at random (one poisoned grad when c.bad_tensor asks),
// each snapshotted for the guard-byte checks. Returns whether a grad is non-finite.
template <typename A, typename G>
bool fill_case(const Case& c, std::mt19937_64& rng, std::vector<Buffer<A>>& accs, std::vector<Buffer<G>>& grads) {
  std::normal_distribution<double> normal(0.0, 1.0);
  bool expect_bad = false;
  for (size_t i = 0; i < c.numels.size(); ++i) {
    accs.emplace_back(c.numels[i], c.acc_offsets[i], rng);
    grads.emplace_back(c.numels[i], c.grad_offsets[i], rng);
    for (int64_t k = 0; k < c.numels[i]; ++k) {
      accs[i].data()[k] = make_value<A>(normal(rng) * 4.0);
      grads[i].data()[k] = make_value<G>(normal(rng));
    }
    if (static_cast<int>(i) == c.bad_tensor && c.numels[i] > 0) {
      const int64_t at = static_cast<int64_t>(rng() % static_cast<uint64_t>(c.numels[i]));
      const double poison[] = {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                               std::numeric_limits<double>::quiet_NaN(), 1e300};
      grads[i].data()[at] = make_value<G>(poison[rng() % 4]);
    }
    for (int64_t k = 0; k < c.numels[i]; ++k) expect_bad |= reference_non_finite<A>(grads[i].data()[k]);
    accs[i].snapshot();
    grads[i].snapshot();
  }
  return expect_bad;
}

// Every accumulator element equals the reference bit for bit; nothing outside the
// tensors changed, and grads are left alone.
template <typename A, typename G>
void check_case(const Case& c, const std::vector<Buffer<A>>& accs, const std::vector<Buffer<G>>& grads,
                const std::vector<std::vector<A>>& expected) {
  for (size_t i = 0; i < accs.size(); ++i) {
    MBS_CHECK(accs[i].outside_unchanged());
    MBS_CHECK(grads[i].all_unchanged());
    for (int64_t k = 0; k < c.numels[i]; ++k) {
      if (std::memcmp(&accs[i].data()[k], &expected[i][static_cast<size_t>(k)], sizeof(A)) != 0) {
        std::fprintf(stderr, "tensor %zu of %zu (n=%lld, acc offset %zu, grad offset %zu), element %lld differs\n", i,
                     accs.size(), static_cast<long long>(c.numels[i]), c.acc_offsets[i], c.grad_offsets[i],
                     static_cast<long long>(k));
        MBS_CHECK(false);
      }
    }
  }
}

// Where the emulated kernel puts the sum of squares: nowhere (the kernel without it), a
// float64 or a float32.
enum class Squares { none, f64, f32 };

// The sum of squares the kernel added to 0.5 against the float64 reference: untouched without
// it; non-finite exactly when the reference is; else within the float roundings of the
// threads' partial sums (at most 18 terms each, relative 2^-24 per term) and, for a float32
// output, one float rounding per block.
template <Squares Q> void check_squares(double reference, double sq_f64, float sq_f32) {
  if constexpr (Q == Squares::none) {
    MBS_CHECK(sq_f64 == 0.5 && sq_f32 == 0.5f);
  } else {
    const double got = Q == Squares::f64 ? sq_f64 - 0.5 : static_cast<double>(sq_f32) - 0.5;
    MBS_CHECK((Q == Squares::f64 ? sq_f32 == 0.5f : sq_f64 == 0.5));  // only the one asked for
    if (!std::isfinite(reference)) {
      MBS_CHECK(!std::isfinite(got));
      return;
    }
    const double tolerance = (Q == Squares::f64 ? 2e-6 : 1e-4) * reference;
    if (!(std::fabs(got - reference) <= tolerance)) {
      std::fprintf(stderr, "sum of squares %.17g, reference %.17g\n", got, reference);
      MBS_CHECK(false);
    }
  }
}

// Runs `c` through the emulated kernel and checks every element against the
// reference, the flag, the guard bytes and that grads are left alone; with a sum of
// squares asked for, the same updates bit for bit and the sum against a float64
// reference. Returns the number of launches.
template <typename A, typename G, typename Meta = SmallMeta, Squares Q = Squares::none>
int run_case(const Case& c, std::mt19937_64& rng) {
  using Op = ScaleAccumulateBlock<A, G, Q != Squares::none>;
  const size_t count = c.numels.size();
  std::vector<Buffer<A>> accs;
  std::vector<Buffer<G>> grads;
  const bool expect_bad = fill_case(c, rng, accs, grads);
  std::vector<std::vector<A>> expected(count);
  for (size_t i = 0; i < count; ++i) {
    for (int64_t k = 0; k < c.numels[i]; ++k) {
      expected[i].push_back(reference(accs[i].data()[k], grads[i].data()[k], c.scale));
    }
  }

  const float scale_f = static_cast<float>(c.scale);
  const double scale_d = c.scale;
  float found_inf = 0.0f;
  Op op{};
  op.scale_ptr = c.scale_kind == ScaleKind::value       ? nullptr
                 : c.scale_kind == ScaleKind::float_ptr ? static_cast<const void*>(&scale_f)
                                                        : static_cast<const void*>(&scale_d);
  op.scale_value = static_cast<typename Op::C>(c.scale);
  op.scale_is_double = c.scale_kind == ScaleKind::double_ptr;
  op.found_inf = &found_inf;
  // Starts non-zero: the op adds to what is there.
  double sq_f64 = 0.5;
  float sq_f32 = 0.5f;
  op.sq_norm = Q == Squares::f32 ? static_cast<void*>(&sq_f32) : static_cast<void*>(&sq_f64);
  op.sq_norm_is_double = Q == Squares::f64;
  double expected_squares = 0.0;  // independent: every grad widened to float64, squared, summed in order
  for (size_t i = 0; i < count; ++i) {
    for (int64_t k = 0; k < c.numels[i]; ++k) {
      const double g = ref_to_d(grads[i].data()[k]);
      expected_squares += g * g;
    }
  }

  std::vector<std::array<void*, 2>> addresses;
  for (size_t i = 0; i < count; ++i) addresses.push_back({accs[i].data(), grads[i].data()});
  int launches = 0;
  for_each_launch<Meta>(
      addresses, c.numels, {int64_t{sizeof(A)}, int64_t{sizeof(G)}}, Op::kChunk,
      [&](const Meta& meta, uint32_t blocks) {
        ++launches;
        emulate_launch(meta, blocks, op);
      },
      c.max_piece);
  check_case(c, accs, grads, expected);
  MBS_CHECK(found_inf == (expect_bad ? 1.0f : 0.0f));
  check_squares<Q>(expected_squares, sq_f64, sq_f32);
  return launches;
}

// Sizes around every boundary the kernel has: lanes, threads, loop steps, chunks.
int64_t pick_numel(std::mt19937_64& rng) {
  static const int64_t edges[] = {0,    1,    2,    3,    5,    7,    8,    9,     15,    16,   17,
                                  255,  256,  257,  1023, 1024, 2047, 2048, 2049,  4095,  4096, 4097,
                                  4099, 8191, 8192, 8195, 12285, 12288, 12291, 20000, 40961};
  if (rng() % 3 != 0) return edges[rng() % (sizeof edges / sizeof edges[0])];
  return static_cast<int64_t>(rng() % 30000);
}

template <typename A, typename G> void test_pair(std::mt19937_64& rng) {
  // Every alignment of both operands, with the sizes above.
  for (int round = 0; round < 24; ++round) {
    Case c;
    const size_t count = 1 + rng() % 12;
    for (size_t i = 0; i < count; ++i) {
      c.numels.push_back(pick_numel(rng));
      c.acc_offsets.push_back(rng() % (16 / sizeof(A) + 1));
      c.grad_offsets.push_back(rng() % (16 / sizeof(G) + 1));
    }
    c.scale_kind = static_cast<ScaleKind>(round % 3);
    c.scale = round % 4 == 0 ? -1.5 : 0.3125;
    if (round % 5 == 1) c.bad_tensor = static_cast<int>(rng() % count);
    // Cut tensors into pieces of a few chunks (not a whole number of chunks, nor of
    // vectors after an unaligned head) so the piece logic runs on small data.
    if (round % 6 == 2) c.max_piece = 4096 * 2 + 16;
    // The kernel without the sum, and with it into either output dtype (same updates).
    switch (round % 3) {
      case 0: run_case<A, G>(c, rng); break;
      case 1: run_case<A, G, SmallMeta, Squares::f64>(c, rng); break;
      default: run_case<A, G, SmallMeta, Squares::f32>(c, rng); break;
    }
  }
}

// The sum of squares over tensors that are all empty is nothing (0 added), in one or no
// launch; grads at the dtype's extremes square without overflow where float64 holds them.
template <typename A, typename G> void test_squares_edges(std::mt19937_64& rng) {
  Case empty;
  empty.numels = {0, 0, 0};
  empty.acc_offsets = {0, 1, 0};
  empty.grad_offsets = {1, 0, 0};
  MBS_CHECK((run_case<A, G, SmallMeta, Squares::f64>(empty, rng)) == 0);
  Case one;
  one.numels = {1, 4099};
  one.acc_offsets = {0, 1};
  one.grad_offsets = {1, 0};
  run_case<A, G, SmallMeta, Squares::f64>(one, rng);
}

// A float64 grad into a float32 accumulator is squared as read, in float64, not as rounded
// to the accumulator's float: 1e100 (inf in float, so flagged) squares to 1e200; 1e200
// squares to inf in float64 too.
void test_squares_of_a_large_float64_grad() {
  std::vector<double> grad = {1e200, 2.0};
  std::vector<float> acc = {0.0f, 0.0f};
  using Op = ScaleAccumulateBlock<float, double, true>;
  float found_inf = 0.0f;
  double sq = 0.0;
  Op op{};
  op.scale_value = 1.0f;
  op.found_inf = &found_inf;
  op.sq_norm = &sq;
  op.sq_norm_is_double = true;
  std::vector<std::array<void*, 2>> addresses = {{acc.data(), grad.data()}};
  for_each_launch<SmallMeta>(addresses, {2}, {4, 8}, Op::kChunk,
                             [&](const SmallMeta& meta, uint32_t blocks) { emulate_launch(meta, blocks, op); });
  MBS_CHECK(found_inf == 1.0f);  // inf as float: flagged
  MBS_CHECK(std::isinf(sq));     // (1e200)^2 overflows float64 too
  std::vector<double> small = {1e100, 2.0};
  sq = 0.0;
  found_inf = 0.0f;
  acc = {0.0f, 0.0f};
  addresses = {{acc.data(), small.data()}};
  for_each_launch<SmallMeta>(addresses, {2}, {4, 8}, Op::kChunk,
                             [&](const SmallMeta& meta, uint32_t blocks) { emulate_launch(meta, blocks, op); });
  MBS_CHECK(sq == 1e200 && found_inf == 1.0f);  // squared in float64, flagged as float
}

void test_all_pairs(std::mt19937_64& rng) {
  test_pair<float, float>(rng);
  test_pair<float, double>(rng);
  test_pair<float, Bf16>(rng);
  test_pair<float, F16>(rng);
  test_pair<double, float>(rng);
  test_pair<double, double>(rng);
  test_pair<double, Bf16>(rng);
  test_pair<double, F16>(rng);
  test_pair<Bf16, float>(rng);
  test_pair<Bf16, double>(rng);
  test_pair<Bf16, Bf16>(rng);
  test_pair<Bf16, F16>(rng);
  test_pair<F16, float>(rng);
  test_pair<F16, double>(rng);
  test_pair<F16, Bf16>(rng);
  test_pair<F16, F16>(rng);
  test_squares_edges<float, float>(rng);
  test_squares_edges<double, Bf16>(rng);
  test_squares_edges<F16, double>(rng);
  test_squares_edges<Bf16, F16>(rng);
}

// More tensors than one launch holds: the list continues in further launches, and
// empty tensors take no slot.
template <typename Meta> void test_many_tensors(std::mt19937_64& rng, int count) {
  Case c;
  for (int i = 0; i < count; ++i) {
    c.numels.push_back(i % 7 == 3 ? 0 : 16 + (i * 97) % 300);
    c.acc_offsets.push_back(0);
    c.grad_offsets.push_back(static_cast<size_t>(i % 3));
  }
  const int64_t empty = std::count(c.numels.begin(), c.numels.end(), int64_t{0});
  const int64_t slots = static_cast<int64_t>(c.numels.size()) - empty;
  const int launches = run_case<float, Bf16, Meta, Squares::f64>(c, rng);
  MBS_CHECK(launches == (slots + Meta::kMaxSlots - 1) / Meta::kMaxSlots);
}

// Exactly one launch's worth of pieces takes one launch; one more takes two.
template <typename Meta> void test_full_launch(std::mt19937_64& rng) {
  for (const int extra : {0, 1}) {
    Case c;
    for (int i = 0; i < Meta::kMaxSlots + extra; ++i) {
      c.numels.push_back(1 + i % 37);
      c.acc_offsets.push_back(0);
      c.grad_offsets.push_back(static_cast<size_t>(i % 2));
    }
    MBS_CHECK(run_case<float, F16, Meta>(c, rng) == 1 + extra);
  }
}

// The plan at the real piece size (2^31 elements), on addresses that are never
// touched: where each piece starts, how long it is, how many chunks it has.
void test_plan_at_full_piece_size() {
  constexpr int64_t P = kMaxPieceElements;
  constexpr int64_t kChunk = 4096;
  char* const a = reinterpret_cast<char*>(uintptr_t{1} << 40);
  char* const g = reinterpret_cast<char*>(uintptr_t{1} << 44);
  const std::vector<int64_t> numels = {P - 1, P, P + 1, 3 * P + 4099, 7};
  std::vector<std::array<void*, 2>> addresses;
  for (size_t i = 0; i < numels.size(); ++i) addresses.push_back({a + (i << 36), g + (i << 36)});
  struct Piece {
    size_t tensor;
    int64_t offset;
    int64_t n;
  };
  std::vector<Piece> want;
  for (size_t i = 0; i < numels.size(); ++i) {
    for (int64_t off = 0; off < numels[i]; off += P) want.push_back({i, off, std::min(P, numels[i] - off)});
  }
  size_t seen = 0;
  for_each_launch<SmallMeta>(addresses, numels, {4, 2}, kChunk, [&](const SmallMeta& meta, uint32_t blocks) {
    uint32_t chunks = 0;
    for (int s = 0; s < meta.slots; ++s, ++seen) {
      MBS_CHECK(seen < want.size());
      const Piece& w = want[seen];
      MBS_CHECK(meta.addresses[0][s] == a + (w.tensor << 36) + w.offset * 4);
      MBS_CHECK(meta.addresses[1][s] == g + (w.tensor << 36) + w.offset * 2);
      MBS_CHECK(meta.numel[s] == static_cast<uint32_t>(w.n));
      chunks += static_cast<uint32_t>((w.n + kChunk - 1) / kChunk);
      MBS_CHECK(meta.chunk_end[s] == chunks);
    }
    MBS_CHECK(blocks == chunks);
  });
  MBS_CHECK(seen == want.size() && want.size() == 9);
}

// A tensor longer than a piece is cut at multiples of the piece size, and the pieces
// of one tensor may straddle launches.
void test_pieces(std::mt19937_64& rng) {
  Case c;
  for (int i = 0; i < 170; ++i) {
    c.numels.push_back(i == 150 ? 5 * 4096 + 37 : 40);
    c.acc_offsets.push_back(i == 150 ? 1 : 0);
    c.grad_offsets.push_back(i == 150 ? 3 : 0);
  }
  c.max_piece = 4096 + 16;
  c.bad_tensor = 150;
  run_case<float, float>(c, rng);
  run_case<float, float, SmallMeta, Squares::f32>(c, rng);
}

// The binary search agrees with a linear scan for every block of random plans.
template <typename Meta> void test_slot_of(std::mt19937_64& rng) {
  for (int round = 0; round < 200; ++round) {
    Meta meta{};
    meta.slots = 1 + static_cast<int>(rng() % Meta::kMaxSlots);
    uint32_t total = 0;
    for (int s = 0; s < meta.slots; ++s) {
      total += 1 + static_cast<uint32_t>(rng() % (round % 2 ? 3 : 40));
      meta.chunk_end[s] = total;
    }
    int expected = 0;
    for (uint32_t block = 0; block < total; ++block) {
      while (meta.chunk_end[expected] <= block) ++expected;
      MBS_CHECK(meta.slot_of(block) == expected);
      const uint32_t start = expected == 0 ? 0u : meta.chunk_end[expected - 1];
      MBS_CHECK(meta.chunk_in_slot(expected, block) == block - start);
    }
  }
}

// The plan refuses what it cannot cover instead of launching it.
void test_plan_rejects_bad_input() {
  float x = 0.0f;
  const auto noop = [](const SmallMeta&, uint32_t) { MBS_CHECK(false); };
  const auto throws = [&](const std::vector<std::array<void*, 2>>& a, const std::vector<int64_t>& n,
                          std::array<int64_t, 2> bytes, int64_t chunk, int64_t piece) {
    try {
      for_each_launch<SmallMeta>(a, n, bytes, chunk, noop, piece);
    } catch (const std::invalid_argument&) {
      return true;
    }
    return false;
  };
  const std::vector<std::array<void*, 2>> one = {{&x, &x}};
  MBS_CHECK(throws(one, {}, {4, 4}, 4096, kMaxPieceElements));         // lengths differ
  MBS_CHECK(throws(one, {-1}, {4, 4}, 4096, kMaxPieceElements));       // negative count
  MBS_CHECK(throws(one, {1}, {4, 4}, 0, kMaxPieceElements));           // no chunk
  MBS_CHECK(throws(one, {1}, {4, 4}, 4096, 4100));                     // piece not a multiple of 16
  MBS_CHECK(throws(one, {1}, {4, 4}, 4096, kMaxPieceElements * 2));    // piece over 2^31
  MBS_CHECK(throws(one, {1}, {3, 4}, 4096, kMaxPieceElements));        // element size
  MBS_CHECK(throws(one, {1}, {4, 4}, 1, kMaxPieceElements));           // grid over 2^31 blocks
  int calls = 0;
  for_each_launch<SmallMeta>(one, {0}, {4, 4}, 4096, [&](const SmallMeta&, uint32_t) { ++calls; });
  MBS_CHECK(calls == 0);  // nothing to do: no launch
}

}  // namespace

int main() {
  std::mt19937_64 rng(20261123);
  test_slot_of<SmallMeta>(rng);
  test_slot_of<LargeMeta>(rng);
  test_plan_rejects_bad_input();
  test_all_pairs(rng);
  test_many_tensors<SmallMeta>(rng, 500);
  test_many_tensors<LargeMeta>(rng, 3000);
  test_full_launch<SmallMeta>(rng);
  test_full_launch<LargeMeta>(rng);
  test_plan_at_full_piece_size();
  test_pieces(rng);
  test_squares_of_a_large_float64_grad();
  std::puts("test_multi_tensor: ok");
  return 0;
}
