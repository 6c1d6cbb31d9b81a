// Unit tests of the CPU scale-and-accumulate core: exact conversions, rounding,
// non-finite detection, and that splitting the flat range across threads covers
// every element exactly once.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "accumulate/accumulate.h"
#include "testing/check.h"

using namespace mbs::accumulate;

static void test_half_round_trip() {
  // Every half bit pattern converts to float and back unchanged (NaNs stay NaN).
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    const uint16_t back = f32_to_f16(f);
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) {
      MBS_CHECK(std::isnan(f));
      MBS_CHECK((back & 0x7c00u) == 0x7c00u && (back & 0x3ffu));
    } else {
      MBS_CHECK(back == h);
    }
  }
  MBS_CHECK(f16_to_f32(0x3c00) == 1.0f);
  MBS_CHECK(f16_to_f32(0x0001) == std::ldexp(1.0f, -24));
  MBS_CHECK(f32_to_f16(65520.0f) == 0x7c00);   // rounds up to inf
  MBS_CHECK(f32_to_f16(65519.0f) == 0x7bff);   // largest finite
  MBS_CHECK(f32_to_f16(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);  // tie -> even
  MBS_CHECK(f32_to_f16(std::ldexp(1.0f, -25)) == 0x0000);         // tie -> even (zero)
  MBS_CHECK(f32_to_f16(std::ldexp(3.0f, -26)) == 0x0001);
}

static void test_bf16_round_trip() {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = bf16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      MBS_CHECK(std::isnan(bf16_to_f32(f32_to_bf16(f))));
    } else {
      MBS_CHECK(f32_to_bf16(f) == h);
    }
  }
  MBS_CHECK(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);  // tie -> even
  MBS_CHECK(f32_to_bf16(1.0f + std::ldexp(3.0f, -8)) == 0x3f82);  // tie -> even (up)
}

static void test_accumulate_matches_double() {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  const int64_t n = 1003;
  std::vector<float> acc(n), grad(n);
  std::vector<double> ref(n);
  for (int64_t i = 0; i < n; ++i) {
    acc[i] = dist(rng);
    grad[i] = dist(rng);
    ref[i] = static_cast<double>(acc[i]) + 0.37 * static_cast<double>(grad[i]);
  }
  const bool bad = accumulate_span<DType::f32, DType::f32>(acc.data(), grad.data(), n, 0.37);
  MBS_CHECK(!bad);
  for (int64_t i = 0; i < n; ++i) MBS_CHECK(std::fabs(acc[i] - ref[i]) <= 1e-6 * (1 + std::fabs(ref[i])));
}

static void test_nonfinite_flag() {
  for (float poison : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()}) {
    for (int64_t pos : {0, 5, 16}) {
      std::vector<double> acc(17, 1.0);
      std::vector<uint16_t> grad(17, f32_to_bf16(2.0f));
      grad[pos] = f32_to_bf16(poison);
      MBS_CHECK(accumulate_span<DType::f64, DType::bf16>(acc.data(), grad.data(), 17, 0.5));
      MBS_CHECK(!std::isfinite(acc[pos]));  // propagates into the accumulator
      MBS_CHECK(acc[(pos + 1) % 17] == 2.0);
    }
  }
}

static void test_flat_split_covers_everything() {
  // Many tensors of odd sizes (including empty ones), split into ranges processed
  // concurrently: each element must receive exactly one scaled add.
  std::vector<std::vector<float>> accs, grads;
  std::vector<Pair> pairs;
  std::mt19937 rng(3);
  for (int t = 0; t < 257; ++t) {
    const int64_t n = (t % 5 == 0) ? 0 : static_cast<int64_t>(rng() % 300);
    accs.emplace_back(n, 1.0f);
    grads.emplace_back(n, 2.0f);
  }
  for (size_t t = 0; t < accs.size(); ++t)
    pairs.push_back({accs[t].data(), grads[t].data(), static_cast<int64_t>(accs[t].size()), DType::f32,
                     DType::f32});
  const FlatPairs flat(pairs);
  const int64_t total = flat.total();
  const int threads = 4;
  std::vector<std::thread> pool;
  for (int k = 0; k < threads; ++k) {
    pool.emplace_back([&, k] {
      const int64_t begin = total * k / threads, end = total * (k + 1) / threads;
      for (int64_t b = begin; b < end; b += 97) flat.run(b, std::min(end, b + 97), 0.25);
    });
  }
  for (auto& t : pool) t.join();
  for (const auto& a : accs)
    for (float v : a) MBS_CHECK(v == 1.5f);
}

// The kernel picked at run time for float32 (the hand-written AVX2 loop where the CPU has
// it) gives bit for bit what the portable loop gives, and the same non-finite flag, for
// every length around its 16-float step, at unaligned starts, with a poisoned element
// anywhere.
static void test_float32_kernel_matches_the_portable_loop() {
  std::mt19937 rng(11);
  std::normal_distribution<float> dist;
  const SpanFn picked = span_kernel(DType::f32, DType::f32);
  const float poisons[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN()};
  for (int64_t n = 0; n <= 70; ++n) {
    for (int64_t offset = 0; offset < 3; ++offset) {
      for (int64_t poison = -1; poison < n; ++poison) {
        std::vector<float> grad(n + offset), fast(n + offset), slow;
        for (auto& v : grad) v = dist(rng);
        for (auto& v : fast) v = dist(rng);
        if (poison >= 0) grad[offset + poison] = poisons[poison % 3];
        slow = fast;
        const bool fast_bad = picked(fast.data() + offset, grad.data() + offset, n, 0.3);
        const bool slow_bad = accumulate_span_default<DType::f32, DType::f32>(slow.data() + offset,
                                                                              grad.data() + offset, n, 0.3);
        MBS_CHECK(fast_bad == (poison >= 0) && slow_bad == fast_bad);
        MBS_CHECK(fast.empty() || std::memcmp(fast.data(), slow.data(), fast.size() * sizeof(float)) == 0);
      }
    }
  }
}

// Random values of dtype D (as its storage) and their exact float64 values.
template <DType D> typename Storage<D>::type make_random(std::mt19937& rng, double& exact) {
  std::normal_distribution<double> dist(0.0, 3.0);
  const double v = dist(rng);
  if constexpr (D == DType::f64) {
    exact = v;
    return v;
  } else if constexpr (D == DType::f32) {
    exact = static_cast<float>(v);
    return static_cast<float>(v);
  } else if constexpr (D == DType::bf16) {
    const uint16_t h = f32_to_bf16(static_cast<float>(v));
    exact = bf16_to_f32(h);
    return h;
  } else {
    const uint16_t h = f32_to_f16(static_cast<float>(v));
    exact = f16_to_f32(h);
    return h;
  }
}

// How close the picked kernel's sum of squares comes to the float64 reference: float32 grads
// into float32 on the AVX2 path square in float32, each lane summing 2 * kF32SquaresRun of them
// (within 2 * kF32SquaresRun * 2^-24 of each partial sum, then float64); the rest in float64.
template <DType A, DType G> double squares_rtol() {
#if MBS_HAVE_AVX2_CLONES
  if (A == DType::f32 && G == DType::f32 && cpu_has_avx2_fma()) return static_cast<double>(2 * kF32SquaresRun) * 0x1p-24;
#endif
  return 1e-13;
}

// The span with the sum of squares makes the very updates and flag of the span without it (the
// kernel picked at run time and the portable one), and its sum matches a float64 reference,
// for lengths around its 8-lane groups and 256-element tiles, with and without a poisoned grad.
template <DType A, DType G> void test_squares_span_pair() {
  std::mt19937 rng(static_cast<unsigned>(17 + 4 * static_cast<int>(A) + static_cast<int>(G)));
  const SquaresSpanFn picked = squares_span_kernel(A, G);
  const SpanFn plain = span_kernel(A, G);
  for (const int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 127, 128, 129, 255, 256, 257, 511, 1000, 4099}) {
    for (const int poison : {-1, 0, 1}) {
      std::vector<typename Storage<A>::type> acc(static_cast<size_t>(n));
      std::vector<typename Storage<G>::type> grad(static_cast<size_t>(n));
      double reference = 0.0;
      double ignored = 0.0;
      for (auto& a : acc) a = make_random<A>(rng, ignored);
      for (auto& g : grad) {
        double exact = 0.0;
        g = make_random<G>(rng, exact);
        reference += exact * exact;
      }
      if (poison >= 0 && n > 0) {
        double exact = 0.0;
        const size_t at = static_cast<size_t>(rng() % static_cast<uint64_t>(n));
        if constexpr (G == DType::f32 || G == DType::f64) {
          grad[at] = poison == 0 ? std::numeric_limits<typename Storage<G>::type>::infinity()
                                 : std::numeric_limits<typename Storage<G>::type>::quiet_NaN();
        } else {
          grad[at] = G == DType::bf16 ? f32_to_bf16(poison == 0 ? INFINITY : NAN) : f32_to_f16(poison == 0 ? INFINITY : NAN);
        }
        (void)exact;
      }
      auto want = acc;
      auto portable = acc;
      const bool want_bad = plain(want.data(), grad.data(), n, 0.375);
      double squares = 1.5;  // added to, not overwritten
      const bool bad = picked(acc.data(), grad.data(), n, 0.375, squares);
      double portable_squares = 1.5;
      const bool portable_bad =
          accumulate_span_squares_default<A, G>(portable.data(), grad.data(), n, 0.375, portable_squares);
      MBS_CHECK(bad == want_bad && portable_bad == want_bad && want_bad == (poison >= 0 && n > 0));
      MBS_CHECK(n == 0 || std::memcmp(acc.data(), want.data(), acc.size() * sizeof(acc[0])) == 0);
      MBS_CHECK(n == 0 || std::memcmp(portable.data(), want.data(), acc.size() * sizeof(acc[0])) == 0);
      if (want_bad) {
        MBS_CHECK(!std::isfinite(squares) && !std::isfinite(portable_squares));
        MBS_CHECK(poison != 1 || (std::isnan(squares) && std::isnan(portable_squares)));
      } else {
        MBS_CHECK(std::fabs((squares - 1.5) - reference) <= squares_rtol<A, G>() * reference);
        MBS_CHECK(std::fabs((portable_squares - 1.5) - reference) <= 1e-13 * reference);
      }
    }
  }
}

// The span with the squares of the accumulators as read too: the very updates of the plain span,
// the grads' sum as accumulate_span_squares makes it, the accumulators' (before the update)
// against a float64 reference, and the flag for an inf or NaN grad or accumulator.
template <DType A, DType G> void test_both_squares_pair() {
  std::mt19937 rng(static_cast<unsigned>(57 + 4 * static_cast<int>(A) + static_cast<int>(G)));
  const BothSquaresSpanFn picked = both_squares_kernel(A, G);
  const SpanFn plain = span_kernel(A, G);
  for (const int64_t n : {0, 1, 31, 32, 33, 127, 128, 129, 255, 256, 257, 1000, 4099}) {
    for (const int poison : {-1, 0, 1}) {  // none, an inf/NaN grad, an inf/NaN accumulator
      std::vector<typename Storage<A>::type> acc(static_cast<size_t>(n));
      std::vector<typename Storage<G>::type> grad(static_cast<size_t>(n));
      double acc_reference = 0.0;
      double grad_reference = 0.0;
      for (auto& a : acc) {
        double exact = 0.0;
        a = make_random<A>(rng, exact);
        acc_reference += exact * exact;
      }
      for (auto& g : grad) {
        double exact = 0.0;
        g = make_random<G>(rng, exact);
        grad_reference += exact * exact;
      }
      if (poison >= 0 && n > 0) {
        const size_t at = static_cast<size_t>(rng() % static_cast<uint64_t>(n));
        const bool nan = (rng() & 1u) != 0;
        if (poison == 0) {
          if constexpr (G == DType::f32 || G == DType::f64) {
            grad[at] = nan ? NAN : INFINITY;
          } else {
            grad[at] = G == DType::bf16 ? f32_to_bf16(nan ? NAN : INFINITY) : f32_to_f16(nan ? NAN : INFINITY);
          }
        } else {
          if constexpr (A == DType::f32 || A == DType::f64) {
            acc[at] = nan ? NAN : INFINITY;
          } else {
            acc[at] = A == DType::bf16 ? f32_to_bf16(nan ? NAN : INFINITY) : f32_to_f16(nan ? NAN : INFINITY);
          }
        }
      }
      auto want = acc;
      const bool grad_bad = plain(want.data(), grad.data(), n, 1.0);
      double squares = 1.5;
      double acc_squares = 0.5;
      const bool bad = picked(acc.data(), grad.data(), n, 1.0, squares, acc_squares);
      MBS_CHECK(bad == (poison >= 0 && n > 0) && grad_bad == (poison == 0 && n > 0));
      MBS_CHECK(n == 0 || std::memcmp(acc.data(), want.data(), acc.size() * sizeof(acc[0])) == 0 || poison == 1);
      if (poison < 0) {
        MBS_CHECK(std::fabs((squares - 1.5) - grad_reference) <= squares_rtol<A, G>() * grad_reference);
        MBS_CHECK(std::fabs((acc_squares - 0.5) - acc_reference) <= squares_rtol<A, G>() * acc_reference);
      } else if (n > 0) {
        MBS_CHECK(!std::isfinite(poison == 0 ? squares : acc_squares));
      }
    }
  }
}

static void test_both_squares_every_pair() {
  const DType all[] = {DType::f32, DType::f64, DType::bf16, DType::f16};
  for (const DType a : all) {
    for (const DType g : all) {
      dispatch_pair(a, g, [](auto ta, auto tg) { test_both_squares_pair<ta.value, tg.value>(); });
    }
  }
}

static void test_squares_span_every_pair() {
  const DType all[] = {DType::f32, DType::f64, DType::bf16, DType::f16};
  for (const DType a : all) {
    for (const DType g : all) {
      dispatch_pair(a, g, [](auto ta, auto tg) { test_squares_span_pair<ta.value, tg.value>(); });
    }
  }
}

// The read-only span (the squared norm of the sums and their check): the sum against the float64
// reference as the updating span's (the same loops), the flag for an inf or NaN element only -
// not for a finite float32 whose float32 square passes float32's range, whose sum is inf on the
// AVX2 path and exact on the portable one - and FlatPairs::read leaves every tensor as it was.
template <DType D> void test_read_squares() {
  std::mt19937 rng(static_cast<unsigned>(91 + static_cast<int>(D)));
  for (const int64_t n : {0, 1, 31, 32, 33, 127, 128, 129, 1000, 4099}) {
    for (const int poison : {-1, 0, 1, 2}) {
      std::vector<typename Storage<D>::type> x(static_cast<size_t>(n));
      double reference = 0.0;
      for (auto& v : x) {
        double exact = 0.0;
        v = make_random<D>(rng, exact);
        reference += exact * exact;
      }
      if (poison >= 0 && n > 0) {
        const size_t at = static_cast<size_t>(rng() % static_cast<uint64_t>(n));
        const float value = poison == 0 ? INFINITY : poison == 1 ? NAN : 1e20f;
        if (poison == 2 && D != DType::f32) continue;  // the float32 square's range: float32 only
        if constexpr (D == DType::f32 || D == DType::f64) {
          x[at] = static_cast<typename Storage<D>::type>(value);
        } else {
          x[at] = D == DType::bf16 ? f32_to_bf16(value) : f32_to_f16(value);
        }
      }
      const auto before = x;
      double squares = 0.25;  // added to, not overwritten
      const bool bad = read_squares_kernel(D)(x.data(), n, squares);
      double portable = 0.25;
      const bool portable_bad = span_squares_default<D>(x.data(), n, portable);
      MBS_CHECK(n == 0 || std::memcmp(x.data(), before.data(), x.size() * sizeof(x[0])) == 0);
      MBS_CHECK(bad == portable_bad && bad == (n > 0 && (poison == 0 || poison == 1)));
      if (bad) {
        MBS_CHECK(!std::isfinite(squares) && !std::isfinite(portable));
      } else if (poison == 2 && n > 0) {
        MBS_CHECK(std::isfinite(portable) && (std::isinf(squares) || squares == portable));
      } else {
        MBS_CHECK(std::fabs((squares - 0.25) - reference) <= squares_rtol<D, D>() * reference);
        MBS_CHECK(std::fabs((portable - 0.25) - reference) <= 1e-13 * reference);
      }
    }
  }
  std::vector<float> a(100, 2.0f);
  std::vector<typename Storage<D>::type> b(3000);
  double ignored = 0.0;
  for (auto& v : b) v = make_random<D>(rng, ignored);
  const auto b_before = b;
  const FlatPairs flat({{nullptr, a.data(), 100, DType::f32, DType::f32}, {nullptr, b.data(), 3000, D, D}});
  double whole = 0.0;
  double halves = 0.0;
  MBS_CHECK(!flat.read(0, flat.total(), whole));
  MBS_CHECK(!flat.read(0, 1500, halves) && !flat.read(1500, flat.total(), halves));
  double b_squares = 0.0;
  MBS_CHECK(!read_squares_kernel(D)(b.data(), 3000, b_squares));
  MBS_CHECK(std::fabs(whole - (400.0 + b_squares)) <= 1e-6 * whole && std::fabs(halves - whole) <= 1e-6 * whole);
  MBS_CHECK(std::memcmp(b.data(), b_before.data(), b.size() * sizeof(b[0])) == 0);
  for (const float v : a) MBS_CHECK(v == 2.0f);
}

static void test_read_squares_every_dtype() {
  const DType all[] = {DType::f32, DType::f64, DType::bf16, DType::f16};
  for (const DType d : all) dispatch_dtype(d, [](auto t) { test_read_squares<t.value>(); });
}

// FlatPairs with the sum: every element updated once and the sum over all pairs matches the
// reference however the range is split; one split run twice on the same data gives the same
// sum bit for bit (a fixed order of additions), and empty pairs add nothing.
static void test_flat_squares() {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist;
  std::vector<std::vector<float>> accs, grads;
  double reference = 0.0;
  for (int t = 0; t < 40; ++t) {
    const int64_t n = (t % 6 == 0) ? 0 : static_cast<int64_t>(rng() % 3000);
    accs.emplace_back(n, 0.0f);
    grads.emplace_back(n);
    for (auto& g : grads.back()) {
      g = dist(rng);
      reference += static_cast<double>(g) * g;
    }
  }
  std::vector<Pair> pairs;
  for (size_t t = 0; t < accs.size(); ++t)
    pairs.push_back({accs[t].data(), grads[t].data(), static_cast<int64_t>(accs[t].size()), DType::f32,
                     DType::f32});
  const FlatPairs flat(pairs);
  const auto split_sum = [&](int64_t step) {
    double total = 0.0;
    for (int64_t b = 0; b < flat.total(); b += step) {
      double part = 0.0;
      MBS_CHECK(!flat.run(b, std::min(flat.total(), b + step), 1.0, part));
      total += part;
    }
    return total;
  };
  const double a = split_sum(1000);
  const double b = split_sum(1000);
  const double c = split_sum(97);
  MBS_CHECK(std::memcmp(&a, &b, sizeof a) == 0);
  const double rtol = squares_rtol<DType::f32, DType::f32>();
  MBS_CHECK(std::fabs(a - reference) <= rtol * reference && std::fabs(c - reference) <= rtol * reference);
  for (size_t t = 0; t < accs.size(); ++t)
    for (size_t k = 0; k < accs[t].size(); ++k) MBS_CHECK(accs[t][k] == 3.0f * grads[t][k]);  // three passes of 1.0
  double nothing = 0.25;
  MBS_CHECK(!flat.run(5, 5, 1.0, nothing) && nothing == 0.25);
}

// dispatch_pair reaches each of the 16 (accumulator, grad) combinations with its own
// compile-time types, and refuses a value outside the enum.
static void test_dispatch_pair() {
  const DType all[] = {DType::f32, DType::f64, DType::bf16, DType::f16};
  for (const DType a : all) {
    for (const DType g : all) {
      const auto got = dispatch_pair(a, g, [](auto ta, auto tg) { return std::make_pair(ta.value, tg.value); });
      MBS_CHECK(got.first == a && got.second == g);
      MBS_CHECK(span_kernel(a, g) != nullptr);
      MBS_CHECK(squares_span_kernel(a, g) != nullptr);
    }
  }
  MBS_CHECK_THROWS(std::invalid_argument, dispatch_dtype(static_cast<DType>(7), [](auto) { return 0; }));
}

int main() {
  test_dispatch_pair();
  test_half_round_trip();
  test_bf16_round_trip();
  test_accumulate_matches_double();
  test_float32_kernel_matches_the_portable_loop();
  test_nonfinite_flag();
  test_flat_split_covers_everything();
  test_squares_span_every_pair();
  test_flat_squares();
  test_read_squares_every_dtype();
  test_both_squares_every_pair();
  std::puts("test_accumulate: ok");
  return 0;
}
