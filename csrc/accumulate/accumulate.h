// Torch-free core of the CPU scale-and-accumulate kernel.
//
// Kept free of torch so that the exact arithmetic (dtype conversions, rounding,
// non-finite detection, the split of work across the whole element set) can be
// unit-tested with ctest under AddressSanitizer/UBSan and ThreadSanitizer.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "accumulate/dtype.h"

#if defined(__GNUC__)
#define MBS_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define MBS_ALWAYS_INLINE inline
#endif

// The baseline x86-64 build only has 128-bit SSE2; an AVX2 clone of each loop is
// picked at run time when the CPU has AVX2 and FMA (same arithmetic: no FMA contraction),
// with a hand-written float32 loop below.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MBS_HAVE_AVX2_CLONES 1
#else
#define MBS_HAVE_AVX2_CLONES 0
#endif
#if MBS_HAVE_AVX2_CLONES
#include <immintrin.h>
#endif

namespace mbs::accumulate {

MBS_ALWAYS_INLINE float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
MBS_ALWAYS_INLINE uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

MBS_ALWAYS_INLINE float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays a quiet NaN with its sign. Branch-free so the
// accumulate loops vectorize.
MBS_ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// Exact for every half value: normals and subnormals go through one multiply by
// 2^112 (the exponent-bias difference), inf/NaN keep an all-ones exponent.
MBS_ALWAYS_INLINE float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7fffu;
  const uint32_t shifted = magnitude << 13;
  const uint32_t finite = f32_to_bits(bits_to_f32(shifted) * 0x1p112f);
  const uint32_t special = shifted | 0x7f800000u;
  return bits_to_f32((magnitude >= 0x7c00u ? special : finite) | sign);
}

// Round to nearest even, overflow to inf, subnormals rounded correctly.
// All three cases are computed and selected, so the loops stay branch-free.
MBS_ALWAYS_INLINE uint16_t f32_to_f16(float value) {
  const uint32_t all = f32_to_bits(value);
  const uint32_t sign = (all >> 16) & 0x8000u;
  const uint32_t u = all & 0x7fffffffu;
  // >= 2^16: inf, or a quiet NaN.
  const uint32_t special = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  // Below the smallest normal half (2^-14): adding 0.5 lets the FPU round the
  // 10-bit subnormal mantissa for us.
  const uint32_t subnormal = f32_to_bits(bits_to_f32(u) + 0.5f) - 0x3f000000u;
  // Normal: rebias the exponent (-112 << 23) and round to nearest even.
  const uint32_t normal = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
  const uint32_t out = u >= 0x47800000u ? special : (u < 0x38800000u ? subnormal : normal);
  return static_cast<uint16_t>(out | sign);
}

template <DType D> struct Storage;
template <> struct Storage<DType::f32> { using type = float; };
template <> struct Storage<DType::f64> { using type = double; };
template <> struct Storage<DType::bf16> { using type = uint16_t; };
template <> struct Storage<DType::f16> { using type = uint16_t; };

// Math type: float64 only when the accumulator is float64.
template <DType A> struct Compute { using type = float; };
template <> struct Compute<DType::f64> { using type = double; };

template <DType D, typename C> MBS_ALWAYS_INLINE C load(const typename Storage<D>::type* p) {
  if constexpr (D == DType::bf16) return static_cast<C>(bf16_to_f32(*p));
  else if constexpr (D == DType::f16) return static_cast<C>(f16_to_f32(*p));
  else return static_cast<C>(*p);
}

template <DType D, typename C> MBS_ALWAYS_INLINE void store(typename Storage<D>::type* p, C v) {
  if constexpr (D == DType::bf16) *p = f32_to_bf16(static_cast<float>(v));
  else if constexpr (D == DType::f16) *p = f32_to_f16(static_cast<float>(v));
  else *p = static_cast<typename Storage<D>::type>(v);
}

// acc[i] += scale * grad[i] for i in [0, n); returns true when a grad element is
// inf or NaN (g - g is 0 exactly for finite g). The flag is an integer OR, not a
// float sum, so the compiler may vectorize the loop without reassociating math.
template <DType A, DType G>
MBS_ALWAYS_INLINE bool accumulate_span(void* acc_raw, const void* grad_raw, int64_t n, double scale) {
  using C = typename Compute<A>::type;
  auto* __restrict__ acc = static_cast<typename Storage<A>::type*>(acc_raw);
  const auto* __restrict__ grad = static_cast<const typename Storage<G>::type*>(grad_raw);
  const C s = static_cast<C>(scale);
  unsigned bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const C g = load<G, C>(grad + i);
    bad |= static_cast<unsigned>((g - g) != C(0));
    store<A, C>(acc + i, load<A, C>(acc + i) + s * g);
  }
  return bad != 0;
}

// The sum of squares runs in lanes: independent float64 partial sums kept in two 4-wide
// vectors (GCC/Clang vector extensions, one AVX register each in the AVX2 clone, two SSE2
// registers otherwise), grad i of a group of 8 going to lane i. A single running sum would be
// a serial chain the compiler may not reorder (nor vectorize); the lanes are added up in a
// fixed order, so a span's sum is the same on every run.
using Lanes = double __attribute__((vector_size(32)));
using Floats4 = float __attribute__((vector_size(16)));

// The lanes added in a fixed order: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
MBS_ALWAYS_INLINE double add_lanes(const Lanes& lo, const Lanes& hi) {
  return ((lo[0] + lo[1]) + (lo[2] + lo[3])) + ((hi[0] + hi[1]) + (hi[2] + hi[3]));
}

// A grad as read, exactly: float64 grads as they are, the others as float (a bf16/fp16 value
// widens exactly).
template <DType G> using Wide = std::conditional_t<G == DType::f64, double, float>;
template <DType G> using Wide4 = std::conditional_t<G == DType::f64, Lanes, Floats4>;

// Elements per tile of accumulate_span_squares: small enough that the tile's grads are still
// in L1 when they are squared (read from memory once), large enough to amortize the loop setup.
constexpr int64_t kSquaresTile = 256;

// accumulate_span, and adds to `squares` the sum over the span of grad[i]^2: the grads as
// read (unscaled), widened exactly to float64 and squared there (a float32, bf16 or fp16
// square is exact in float64; a float64 one rounds once), summed in float64 lanes. A
// non-finite grad makes the sum inf or NaN; the returned flag and every update are
// accumulate_span's, bit for bit (it runs as it is, tile by tile).
//
// One pass over memory, in tiles: accumulate_span updates a tile, then the tile's grads, now
// in L1, are squared into a buffer (an elementwise loop the compiler vectorizes, conversions
// included) and the buffer is added into the lanes 8 at a time. A loop that squares and adds
// as it updates keeps the compiler from vectorizing the conversions (4-5x slower for bf16).
template <DType A, DType G>
MBS_ALWAYS_INLINE bool accumulate_span_squares(void* acc_raw, const void* grad_raw, int64_t n, double scale,
                                               double& squares) {
  const auto* grad = static_cast<const typename Storage<G>::type*>(grad_raw);
  auto* acc = static_cast<typename Storage<A>::type*>(acc_raw);
  bool bad = false;
  Lanes lo = {0.0, 0.0, 0.0, 0.0};
  Lanes hi = lo;
  double tail = 0.0;
  alignas(32) double squared[kSquaresTile];
  for (int64_t start = 0; start < n; start += kSquaresTile) {
    const int64_t m = n - start < kSquaresTile ? n - start : kSquaresTile;
    bad |= accumulate_span<A, G>(acc + start, grad + start, m, scale);
    const auto* __restrict__ g = grad + start;
    for (int64_t j = 0; j < m; ++j) {
      const double w = load<G, double>(g + j);
      squared[j] = w * w;
    }
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
      Lanes a;
      Lanes b;
      std::memcpy(&a, squared + j, sizeof a);
      std::memcpy(&b, squared + j + 4, sizeof b);
      lo += a;
      hi += b;
    }
    for (; j < m; ++j) tail += squared[j];
  }
  squares += add_lanes(lo, hi) + tail;
  return bad;
}

// The sum of the squares of x[0, n) added to `squares` (each element widened exactly to
// float64, squared and summed in float64 lanes, as accumulate_span_squares does with its grads),
// and whether an element is inf or NaN: a read of the accumulated sums that gives their squared
// norm and their non-finite check at once.
template <DType D> MBS_ALWAYS_INLINE bool span_squares(const void* raw, int64_t n, double& squares) {
  const auto* x = static_cast<const typename Storage<D>::type*>(raw);
  unsigned bad = 0;
  Lanes lo = {0.0, 0.0, 0.0, 0.0};
  Lanes hi = lo;
  double tail = 0.0;
  alignas(32) double squared[kSquaresTile];
  for (int64_t start = 0; start < n; start += kSquaresTile) {
    const int64_t m = n - start < kSquaresTile ? n - start : kSquaresTile;
    const auto* __restrict__ v = x + start;
    for (int64_t j = 0; j < m; ++j) {
      const double w = load<D, double>(v + j);
      bad |= static_cast<unsigned>((w - w) != 0.0);
      squared[j] = w * w;
    }
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
      Lanes a;
      Lanes b;
      std::memcpy(&a, squared + j, sizeof a);
      std::memcpy(&b, squared + j + 4, sizeof b);
      lo += a;
      hi += b;
    }
    for (; j < m; ++j) tail += squared[j];
  }
  squares += add_lanes(lo, hi) + tail;
  return bad != 0;
}

// accumulate_span_squares, and adds to `acc_squares` the sum of the squares of the
// accumulators as read, before the update (widened exactly to float64, as span_squares takes
// them), flagging an inf or NaN among them too: the first addition into a sum that is still
// one micro-batch's gradient as it was taken gives that gradient's squares in the same pass.
// Tile by tile: a tile's accumulators are squared, then updated while still in L1.
template <DType A, DType G>
MBS_ALWAYS_INLINE bool accumulate_span_both(void* acc_raw, const void* grad_raw, int64_t n, double scale,
                                            double& squares, double& acc_squares) {
  auto* acc = static_cast<typename Storage<A>::type*>(acc_raw);
  const auto* grad = static_cast<const typename Storage<G>::type*>(grad_raw);
  bool bad = false;
  for (int64_t start = 0; start < n; start += kSquaresTile) {
    const int64_t m = n - start < kSquaresTile ? n - start : kSquaresTile;
    bad |= span_squares<A>(acc + start, m, acc_squares);
    bad |= accumulate_span_squares<A, G>(acc + start, grad + start, m, scale, squares);
  }
  return bad;
}

using SpanFn = bool (*)(void*, const void*, int64_t, double);
// The same with the sum of squares of the grads added to the last argument.
using SquaresSpanFn = bool (*)(void*, const void*, int64_t, double, double&);

// The same without updating anything: the sum of squares of a span and its non-finite flag.
using ReadSquaresFn = bool (*)(const void*, int64_t, double&);
// With the squares of the accumulators as read as well (the last argument).
using BothSquaresSpanFn = bool (*)(void*, const void*, int64_t, double, double&, double&);

template <DType A, DType G> bool accumulate_span_default(void* acc, const void* grad, int64_t n, double s) {
  return accumulate_span<A, G>(acc, grad, n, s);
}
template <DType A, DType G>
bool accumulate_span_squares_default(void* acc, const void* grad, int64_t n, double s, double& squares) {
  return accumulate_span_squares<A, G>(acc, grad, n, s, squares);
}

template <DType D> bool span_squares_default(const void* x, int64_t n, double& squares) {
  return span_squares<D>(x, n, squares);
}
template <DType A, DType G>
bool accumulate_span_both_default(void* acc, const void* grad, int64_t n, double s, double& squares,
                                  double& acc_squares) {
  return accumulate_span_both<A, G>(acc, grad, n, s, squares, acc_squares);
}

#if MBS_HAVE_AVX2_CLONES
template <DType A, DType G>
__attribute__((target("avx2"))) bool accumulate_span_avx2(void* acc, const void* grad, int64_t n, double s) {
  return accumulate_span<A, G>(acc, grad, n, s);
}
template <DType A, DType G>
__attribute__((target("avx2"))) bool accumulate_span_squares_avx2(void* acc, const void* grad, int64_t n, double s,
                                                                  double& squares) {
  return accumulate_span_squares<A, G>(acc, grad, n, s, squares);
}
template <DType D>
__attribute__((target("avx2"))) bool span_squares_avx2(const void* x, int64_t n, double& squares) {
  return span_squares<D>(x, n, squares);
}
template <DType A, DType G>
__attribute__((target("avx2"))) bool accumulate_span_both_avx2(void* acc, const void* grad, int64_t n, double s,
                                                               double& squares, double& acc_squares) {
  return accumulate_span_both<A, G>(acc, grad, n, s, squares, acc_squares);
}

// float32 into float32, the case a full-precision model spends its accumulation in. On one
// thread the pass is bound by how many loads the core keeps in flight, so every instruction
// in the loop counts: the compiler's vector code for the flag above widens a compare per
// element (about 10% of a pass), an OR of the bits of g - g costs two instructions per
// vector (3-4%). Here the flag is one fused multiply-add per vector, bad = g * 0 + bad,
// which stays +-0 for finite g and turns NaN for inf or NaN. The accumulation itself is the
// scalar loop's multiply then add: contraction into a fused multiply-add is switched off here
// (GCC would otherwise fuse the intrinsics once FMA is enabled), and the last few elements run
// in the portable loop, so the result is bit for bit the same.
template <>
__attribute__((target("avx2,fma"), optimize("fp-contract=off"))) inline bool
accumulate_span_avx2<DType::f32, DType::f32>(void* acc_raw, const void* grad_raw, int64_t n, double scale) {
  auto* acc = static_cast<float*>(acc_raw);
  const auto* grad = static_cast<const float*>(grad_raw);
  const __m256 s = _mm256_set1_ps(static_cast<float>(scale));
  const __m256 zero = _mm256_setzero_ps();
  __m256 bad0 = zero;
  __m256 bad1 = zero;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 g0 = _mm256_loadu_ps(grad + i);
    const __m256 g1 = _mm256_loadu_ps(grad + i + 8);
    bad0 = _mm256_fmadd_ps(g0, zero, bad0);
    bad1 = _mm256_fmadd_ps(g1, zero, bad1);
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_mul_ps(s, g0)));
    _mm256_storeu_ps(acc + i + 8, _mm256_add_ps(_mm256_loadu_ps(acc + i + 8), _mm256_mul_ps(s, g1)));
  }
  const bool tail_bad = accumulate_span_default<DType::f32, DType::f32>(acc + i, grad + i, n - i, scale);
  const __m256 bad = _mm256_add_ps(bad0, bad1);
  return tail_bad || _mm256_movemask_ps(_mm256_cmp_ps(bad, zero, _CMP_NEQ_UQ)) != 0;
}

// The float32 loop above with the sum of squares, taken in float32 as the CUDA kernel takes
// them per thread: each vector of 8 grads squares into its own float32 accumulator by a fused
// multiply-add (no widening per element: the widening conversions cost more than the pass
// itself). A run of kF32SquaresRun groups of 32 grads fills four accumulators, added in pairs
// and widened into four float64 ones, and the next run starts again: each float32 lane sums at
// most 2 * kF32SquaresRun = 8 squares (relative error within 8 * 2^-24, 5e-7) and everything
// beyond it is float64. Four accumulators, so that the multiply-adds' latency does not bound a
// pass over memory that is not in cache. The squares are the non-finite flag as well, with no
// instruction of its own: an inf or NaN grad makes its run's sum inf or NaN, and only such a run
// (rare) is read again to tell an inf or NaN grad from a finite one whose float32 square passes
// float32's range (|g| above about 1.8e19: the sum is then inf, as on CUDA, and the flag stays
// clear). Squares below float32's range (|g| under about 1e-19) count as about 0. The lanes are
// added in a fixed order, then the tail (the portable loop, exact).
constexpr int64_t kF32SquaresRun = 4;

// Whether a float32 in g[0, n) is inf or NaN (the rare second read of a run above).
inline bool any_nonfinite_f32(const float* g, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(g[i])) return true;
  }
  return false;
}

// One run's float32 partial sums (four accumulators of 8 lanes) into four float64 accumulators
// of 4; true when a partial sum is inf or NaN (x - x is NaN exactly there).
__attribute__((target("avx2,fma"), optimize("fp-contract=off"))) inline bool widen_run(
    const __m256 (&sq)[4], __m256d (&wide)[4]) {
  const __m256 lo = _mm256_add_ps(sq[0], sq[1]);
  const __m256 hi = _mm256_add_ps(sq[2], sq[3]);
  wide[0] = _mm256_add_pd(wide[0], _mm256_cvtps_pd(_mm256_castps256_ps128(lo)));
  wide[1] = _mm256_add_pd(wide[1], _mm256_cvtps_pd(_mm256_extractf128_ps(lo, 1)));
  wide[2] = _mm256_add_pd(wide[2], _mm256_cvtps_pd(_mm256_castps256_ps128(hi)));
  wide[3] = _mm256_add_pd(wide[3], _mm256_cvtps_pd(_mm256_extractf128_ps(hi, 1)));
  const __m256 probe = _mm256_add_ps(_mm256_sub_ps(lo, lo), _mm256_sub_ps(hi, hi));
  return _mm256_movemask_ps(_mm256_cmp_ps(probe, _mm256_setzero_ps(), _CMP_NEQ_UQ)) != 0;
}

__attribute__((target("avx2,fma"))) inline double add_wide(const __m256d (&wide)[4]) {
  return add_lanes(Lanes(wide[0]), Lanes(wide[1])) + add_lanes(Lanes(wide[2]), Lanes(wide[3]));
}

// The loop itself, for every use: with `acc` it also makes accumulate_span's updates (the
// scalar loop's multiply then add, bit for bit); with acc null it only reads (span_squares);
// with AccToo it also sums the squares of the accumulators as read, before the update, into
// `acc_squares` (accumulate_span_both), the same way.
template <bool AccToo>
__attribute__((target("avx2,fma"), optimize("fp-contract=off"))) inline bool f32_squares_avx2(
    float* acc, const float* grad, int64_t n, double scale, double& squares, double* acc_squares) {
  const __m256 s = _mm256_set1_ps(static_cast<float>(scale));
  const __m256 zero = _mm256_setzero_ps();
  bool bad = false;
  __m256d wide[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  __m256d acc_wide[4] = {wide[0], wide[1], wide[2], wide[3]};
  int64_t i = 0;
  while (i + 32 <= n) {
    const int64_t run_start = i;
    __m256 sq[4] = {zero, zero, zero, zero};
    __m256 acc_sq[4] = {zero, zero, zero, zero};
    for (int64_t run = 0; run < kF32SquaresRun && i + 32 <= n; ++run, i += 32) {
      for (int v = 0; v < 4; ++v) {
        const __m256 g = _mm256_loadu_ps(grad + i + 8 * v);
        sq[v] = _mm256_fmadd_ps(g, g, sq[v]);
        if (acc != nullptr) {
          const __m256 a = _mm256_loadu_ps(acc + i + 8 * v);
          if constexpr (AccToo) acc_sq[v] = _mm256_fmadd_ps(a, a, acc_sq[v]);
          _mm256_storeu_ps(acc + i + 8 * v, _mm256_add_ps(a, _mm256_mul_ps(s, g)));
        }
      }
    }
    // Only a run whose float32 sum is inf or NaN is read again (rare): an inf or NaN element,
    // or a finite one past float32's square range. The accumulators were updated meanwhile,
    // but an inf or NaN accumulator stays inf or NaN through the update.
    if (widen_run(sq, wide)) bad = bad || any_nonfinite_f32(grad + run_start, i - run_start);
    if constexpr (AccToo) {
      if (widen_run(acc_sq, acc_wide)) bad = bad || any_nonfinite_f32(acc + run_start, i - run_start);
    }
  }
  double tail = 0.0;
  bool tail_bad;
  if constexpr (AccToo) {
    double acc_tail = 0.0;
    tail_bad = accumulate_span_both_default<DType::f32, DType::f32>(acc + i, grad + i, n - i, scale, tail, acc_tail);
    *acc_squares += add_wide(acc_wide) + acc_tail;
  } else {
    tail_bad = acc != nullptr ? accumulate_span_squares_default<DType::f32, DType::f32>(acc + i, grad + i, n - i,
                                                                                      scale, tail)
                              : span_squares_default<DType::f32>(grad + i, n - i, tail);
  }
  squares += add_wide(wide) + tail;
  return bad || tail_bad;
}

template <>
inline bool accumulate_span_squares_avx2<DType::f32, DType::f32>(void* acc, const void* grad, int64_t n,
                                                                 double scale, double& squares) {
  return f32_squares_avx2<false>(static_cast<float*>(acc), static_cast<const float*>(grad), n, scale, squares,
                                 nullptr);
}

template <> inline bool span_squares_avx2<DType::f32>(const void* x, int64_t n, double& squares) {
  return f32_squares_avx2<false>(nullptr, static_cast<const float*>(x), n, 0.0, squares, nullptr);
}

template <>
inline bool accumulate_span_both_avx2<DType::f32, DType::f32>(void* acc, const void* grad, int64_t n, double scale,
                                                              double& squares, double& acc_squares) {
  return f32_squares_avx2<true>(static_cast<float*>(acc), static_cast<const float*>(grad), n, scale, squares,
                                &acc_squares);
}
#endif

// AVX2 and FMA: the float32 loop's flag is a fused multiply-add (Intel's and AMD's AVX2 CPUs
// have FMA as well, but a virtual machine may show one without the other).
inline bool cpu_has_avx2_fma() {
#if MBS_HAVE_AVX2_CLONES
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

template <DType A, DType G> SpanFn pick_span_kernel() {
#if MBS_HAVE_AVX2_CLONES
  if (cpu_has_avx2_fma()) return &accumulate_span_avx2<A, G>;
#endif
  return &accumulate_span_default<A, G>;
}

inline SpanFn span_kernel(DType acc, DType grad) {
  return dispatch_pair(acc, grad, [](auto a, auto g) { return pick_span_kernel<a.value, g.value>(); });
}

template <DType A, DType G> SquaresSpanFn pick_squares_span_kernel() {
#if MBS_HAVE_AVX2_CLONES
  if (cpu_has_avx2_fma()) return &accumulate_span_squares_avx2<A, G>;
#endif
  return &accumulate_span_squares_default<A, G>;
}

inline SquaresSpanFn squares_span_kernel(DType acc, DType grad) {
  return dispatch_pair(acc, grad, [](auto a, auto g) { return pick_squares_span_kernel<a.value, g.value>(); });
}

template <DType A, DType G> BothSquaresSpanFn pick_both_squares_kernel() {
#if MBS_HAVE_AVX2_CLONES
  if (cpu_has_avx2_fma()) return &accumulate_span_both_avx2<A, G>;
#endif
  return &accumulate_span_both_default<A, G>;
}

inline BothSquaresSpanFn both_squares_kernel(DType acc, DType grad) {
  return dispatch_pair(acc, grad, [](auto a, auto g) { return pick_both_squares_kernel<a.value, g.value>(); });
}

template <DType D> ReadSquaresFn pick_read_squares_kernel() {
#if MBS_HAVE_AVX2_CLONES
  if (cpu_has_avx2_fma()) return &span_squares_avx2<D>;
#endif
  return &span_squares_default<D>;
}

inline ReadSquaresFn read_squares_kernel(DType d) {
  return dispatch_dtype(d, [](auto t) { return pick_read_squares_kernel<t.value>(); });
}

struct Pair {
  void* acc;
  const void* grad;
  int64_t numel;
  DType acc_dtype;
  DType grad_dtype;
};

// The whole set of pairs seen as one flat range of elements, so that parallel
// work splits evenly however the elements are distributed over tensors.
class FlatPairs {
 public:
  explicit FlatPairs(std::vector<Pair> pairs) : pairs_(std::move(pairs)) {
    starts_.reserve(pairs_.size() + 1);
    int64_t total = 0;
    for (const auto& p : pairs_) {
      starts_.push_back(total);
      total += p.numel;
    }
    starts_.push_back(total);
  }

  int64_t total() const { return starts_.back(); }

  // Processes flat elements [begin, end); returns true if a non-finite grad was seen.
  bool run(int64_t begin, int64_t end, double scale) const {
    return for_spans(begin, end, [&](const Pair& p, void* acc, const void* grad, int64_t n) {
      return span_kernel(p.acc_dtype, p.grad_dtype)(acc, grad, n, scale);
    });
  }

  // run(), and adds to `squares` the sum of the squares of the grads in [begin, end), summed
  // in float64 span by span in a fixed order: the same range gives the same sum every time.
  bool run(int64_t begin, int64_t end, double scale, double& squares) const {
    return for_spans(begin, end, [&](const Pair& p, void* acc, const void* grad, int64_t n) {
      return squares_span_kernel(p.acc_dtype, p.grad_dtype)(acc, grad, n, scale, squares);
    });
  }

  // run() with the sum of squares, and the squares of the accumulators as read (before the
  // update) added to `acc_squares`; the flag covers inf or NaN accumulators too.
  bool run(int64_t begin, int64_t end, double scale, double& squares, double& acc_squares) const {
    return for_spans(begin, end, [&](const Pair& p, void* acc, const void* grad, int64_t n) {
      return both_squares_kernel(p.acc_dtype, p.grad_dtype)(acc, grad, n, scale, squares, acc_squares);
    });
  }

  // The squares of the grads in [begin, end) added to `squares` (as run() adds them) and their
  // non-finite flag, without updating anything: pairs whose grads are the tensors to read
  // (their accumulators are not touched, and may be null).
  bool read(int64_t begin, int64_t end, double& squares) const {
    return for_spans(begin, end, [&](const Pair& p, void*, const void* grad, int64_t n) {
      return read_squares_kernel(p.grad_dtype)(grad, n, squares);
    });
  }

 private:
  // span(pair, acc, grad, n) over the parts of the pairs that [begin, end) covers, in order;
  // returns the OR of what the calls return.
  template <typename Span> bool for_spans(int64_t begin, int64_t end, Span&& span) const {
    if (begin >= end) return false;
    // First pair whose range contains `begin` (skipping empty pairs).
    auto it = std::upper_bound(starts_.begin(), starts_.end() - 1, begin);
    size_t idx = static_cast<size_t>(it - starts_.begin()) - 1;
    bool bad = false;
    while (begin < end && idx < pairs_.size()) {
      const Pair& p = pairs_[idx];
      const int64_t lo = begin - starts_[idx];
      const int64_t hi = std::min(end, starts_[idx + 1]) - starts_[idx];
      if (hi > lo) {
        auto* acc = p.acc == nullptr ? nullptr : static_cast<char*>(p.acc) + lo * element_size(p.acc_dtype);
        const auto* grad = static_cast<const char*>(p.grad) + lo * element_size(p.grad_dtype);
        bad |= span(p, acc, grad, hi - lo);
        begin = starts_[idx] + hi;
      }
      ++idx;
    }
    return bad;
  }

  std::vector<Pair> pairs_;
  std::vector<int64_t> starts_;
};

}  // namespace mbs::accumulate
