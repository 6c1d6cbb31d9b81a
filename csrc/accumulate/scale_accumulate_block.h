// One thread's share of one chunk of the CUDA scale_accumulate_ kernel:
// acc[i] <- acc[i] + scale * grad[i], flagging non-finite grads and, when asked, adding up
// the squares of the grads it reads (the sum of squares the op can return). Plain C++ that
// compiles for the device (csrc/ops/cuda/) and for a host emulation of the whole
// grid (csrc/accumulate/tests/test_multi_tensor.cpp), so the index arithmetic, the
// vector/scalar split and the alignment rules are tested on any machine.
//
// Memory access: each thread moves 16 elements per loop step (8 for fp64/fp64) as
// independent 16-byte vector loads of both operands (the narrower dtype sets the
// lane count, the wider one takes several 16-byte words), all issued before any
// arithmetic so that they are in flight together. The vector path starts at the first
// element where both tensors are 16-byte aligned; the elements before it, the tail
// after the last whole vector, and pieces whose two pointers can never be aligned
// together take a scalar path with the same number of loads in flight.
//
// Element types: float, double, or any 2-byte type for which the includer provides
// Convert<T, float> and Convert<T, double> (the device's bf16/fp16, the emulation's
// bit-pattern stand-ins).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "accumulate/multi_tensor.h"

namespace mbs::accumulate {

// T <-> the compute type C. The primary template covers float and double.
template <typename T, typename C> struct Convert {
  MBS_HOST_DEVICE static C to(T v) { return static_cast<C>(v); }
  MBS_HOST_DEVICE static T from(C v) { return static_cast<T>(v); }
};

// inf or NaN: an all-ones exponent (a bit test, immune to any math-flag folding).
MBS_HOST_DEVICE bool non_finite(float v) {
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(v);
#else
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
#endif
  return (bits & 0x7f800000u) == 0x7f800000u;
}
MBS_HOST_DEVICE bool non_finite(double v) {
#if defined(__CUDA_ARCH__)
  const auto bits = static_cast<uint64_t>(__double_as_longlong(v));
#else
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
#endif
  return (bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

// a * b + c, rounded once.
MBS_HOST_DEVICE float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
MBS_HOST_DEVICE double fma_rn(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// What a thread adds up besides its updates. NoSquares: nothing (the op without sq_norm;
// add() compiles away, so that kernel is the one without the feature). Squares<S>: the sum of
// the squares of the grads it reads, each converted to S (exact: a 16-bit float's square fits
// float's mantissa), squared and added with one rounding. A thread reads at most
// kChunk / kThreads + 2 grads (18) per block, so its float sum has a few roundings only; the
// block adds its threads' sums in float64.
struct NoSquares {
  template <typename G> MBS_HOST_DEVICE void add(G) {}
};
template <typename S> struct Squares {
  S value = S(0);
  template <typename G> MBS_HOST_DEVICE void add(G g) {
    const S v = Convert<G, S>::to(g);
    value = fma_rn(v, v, value);
  }
};

#if defined(__CUDA_ARCH__)
// *address += value atomically: the native float64 atomic from sm_60 on, a compare-and-swap
// loop before.
__device__ __forceinline__ void atomic_add(double* address, double value) {
#if __CUDA_ARCH__ >= 600
  atomicAdd(address, value);
#else
  auto* bits = reinterpret_cast<unsigned long long*>(address);
  unsigned long long seen = *bits;
  unsigned long long assumed;
  do {
    assumed = seen;
    seen = atomicCAS(bits, assumed, __double_as_longlong(__longlong_as_double(assumed) + value));
  } while (seen != assumed);
#endif
}
#endif

// L elements of T, a whole number of 16-byte words, loaded and stored as such.
template <typename T, int L> struct alignas(16) Vec {
  static_assert((sizeof(T) * L) % 16 == 0, "a vector must be whole 16-byte words");
  T v[L];
};

// SumSquares: also add the squares of the grads into *sq_norm (a separate kernel: the one
// without it is unchanged).
template <typename A, typename G, bool SumSquares = false> struct ScaleAccumulateBlock {
  // float64 math only for float64 accumulators, as on the CPU.
  using C = std::conditional_t<std::is_same_v<A, double>, double, float>;
  // Squares in float64 where a float64 is involved (a float64 grad as read, not as rounded to
  // float for a float32 accumulator), else in float.
  using S = std::conditional_t<std::is_same_v<A, double> || std::is_same_v<G, double>, double, float>;
  using Acc = A;
  using Grad = G;
  static constexpr bool kSumSquares = SumSquares;
  using Sum = std::conditional_t<SumSquares, Squares<S>, NoSquares>;

  static constexpr int kThreads = 256;
  static constexpr int kLanes = 16 / static_cast<int>(sizeof(A) < sizeof(G) ? sizeof(A) : sizeof(G));
  // Vectors per thread per loop step, all loaded before any is used: 4 x 16 bytes
  // of the narrower operand (16 elements; 8 for fp64/fp64), as many of the wider.
  static constexpr int kVecsPerThread = kLanes >= 4 ? 16 / kLanes : 4;
  static constexpr int kScalarsPerThread = 8;  // same idea on the scalar path
  static constexpr int64_t kChunk = 4096;      // elements per block
  static_assert(16 % sizeof(A) == 0 && 16 % sizeof(G) == 0, "element sizes must divide 16");
  static_assert(kChunk % (int64_t{kThreads} * kVecsPerThread * kLanes) == 0,
                "a chunk must be whole loop steps of the block");

  const void* scale_ptr;  // device scale (float or double), or null: use scale_value
  C scale_value;
  float* found_inf;
  void* sq_norm;  // float or double; written only when SumSquares
  bool scale_is_double;
  bool sq_norm_is_double;

  MBS_HOST_DEVICE C load_scale() const {
    if (scale_ptr == nullptr) return scale_value;
    return scale_is_double ? static_cast<C>(*static_cast<const double*>(scale_ptr))
                           : static_cast<C>(*static_cast<const float*>(scale_ptr));
  }

  // Called by one thread of a block in which some thread returned true.
  MBS_HOST_DEVICE void report_non_finite() const { *found_inf = 1.0f; }

  // Called once per block (SumSquares) by one thread with the block's sum of squares: an
  // atomic add on the device (blocks finish in any order), a plain one in the host emulation.
  MBS_HOST_DEVICE void report_squares(double block_sum) const {
#if defined(__CUDA_ARCH__)
    if (sq_norm_is_double) {
      atomic_add(static_cast<double*>(sq_norm), block_sum);
    } else {
      atomicAdd(static_cast<float*>(sq_norm), static_cast<float>(block_sum));
    }
#else
    if (sq_norm_is_double) {
      *static_cast<double*>(sq_norm) += block_sum;
    } else {
      *static_cast<float*>(sq_norm) += static_cast<float>(block_sum);
    }
#endif
  }

  // acc <- acc + s * g in C; flags a non-finite g (checked after conversion to C,
  // like the CPU kernel, so a float64 grad too large for float32 counts as inf); adds g's
  // square to sum.
  MBS_HOST_DEVICE static A update(A a, G g, C s, bool& bad, Sum& sum) {
    const C gc = Convert<G, C>::to(g);
    bad |= non_finite(gc);
    sum.add(g);
    return Convert<A, C>::from(fma_rn(s, gc, Convert<A, C>::to(a)));
  }

  // Smallest h in [0, kLanes) such that acc + h and grad + h are both 16-byte
  // aligned, or -1 when no such h exists (the offsets disagree modulo 16 bytes).
  MBS_HOST_DEVICE static int vector_head(const A* acc, const G* grad) {
    const auto a = reinterpret_cast<uintptr_t>(acc);
    const auto g = reinterpret_cast<uintptr_t>(grad);
    if (a % sizeof(A) != 0 || g % sizeof(G) != 0) return -1;  // the host rejects this; stay safe anyway
    constexpr int ma = 16 / static_cast<int>(sizeof(A));      // alignment period of acc, in elements
    constexpr int mg = 16 / static_cast<int>(sizeof(G));
    const int ha = static_cast<int>((16 - a % 16) % 16 / sizeof(A));  // in [0, ma)
    const int hg = static_cast<int>((16 - g % 16) % 16 / sizeof(G));  // in [0, mg)
    // ma and mg are powers of two; the longer period (= kLanes) decides, the
    // shorter one must agree with it.
    if (ma >= mg) return (ha % mg == hg) ? ha : -1;
    return (hg % ma == ha) ? hg : -1;
  }

  // L elements loaded and stored as one unit: the element itself, or a 16-byte vector.
  template <typename T, int L> using Unit = std::conditional_t<L == 1, T, Vec<T, L>>;

  MBS_HOST_DEVICE static void update_unit(A& a, G g, C s, bool& bad, Sum& sum) { a = update(a, g, s, bad, sum); }
  template <int L>
  MBS_HOST_DEVICE static void update_unit(Vec<A, L>& a, const Vec<G, L>& g, C s, bool& bad, Sum& sum) {
    MBS_UNROLL
    for (int l = 0; l < L; ++l) a.v[l] = update(a.v[l], g.v[l], s, bad, sum);
  }

  // This thread's units of `units` units of L elements from acc/grad (16-byte aligned
  // when L > 1), K independent loads of each operand per loop step, all issued before
  // any is used. units <= kChunk, so offsets fit an int.
  template <int L, int K>
  MBS_HOST_DEVICE static void strided_range(A* __restrict__ acc, const G* __restrict__ grad, int units, C s,
                                            int thread, bool& bad, Sum& sum) {
    using UA = Unit<A, L>;
    using UG = Unit<G, L>;
    UA* __restrict__ au = reinterpret_cast<UA*>(acc);
    const UG* __restrict__ gu = reinterpret_cast<const UG*>(grad);
    for (int base = 0; base < units; base += kThreads * K) {
      UA a[K];
      UG g[K];
      MBS_UNROLL
      for (int k = 0; k < K; ++k) {
        const int u = base + thread + k * kThreads;
        if (u < units) {
          a[k] = au[u];
          g[k] = gu[u];
        }
      }
      MBS_UNROLL
      for (int k = 0; k < K; ++k) {
        const int u = base + thread + k * kThreads;
        if (u < units) {
          update_unit(a[k], g[k], s, bad, sum);
          au[u] = a[k];
        }
      }
    }
  }

  // The few (< kLanes <= kThreads) elements [0, n) before or after the vectors.
  MBS_HOST_DEVICE static void scalar_few(A* acc, const G* grad, int n, C s, int thread, bool& bad, Sum& sum) {
    if (thread < n) acc[thread] = update(acc[thread], grad[thread], s, bad, sum);
  }

  // Thread `thread`'s share of chunk `chunk` of piece `slot`. Returns whether any of
  // its grads was non-finite, and adds the squares of the grads it read to `sum`; the
  // kernel ORs the flags and adds the sums over the block (block-wide barriers, so every
  // thread must get here).
  template <typename Meta>
  MBS_HOST_DEVICE bool operator()(const Meta& meta, int slot, uint32_t chunk, int thread, Sum& sum) const {
    const C s = load_scale();
    A* acc = static_cast<A*>(meta.addresses[0][slot]);
    const G* grad = static_cast<const G*>(meta.addresses[1][slot]);
    const int64_t n = meta.numel[slot];
    const int64_t begin = int64_t{chunk} * kChunk;  // < n by construction
    const int64_t end = begin + kChunk < n ? begin + kChunk : n;
    bool bad = false;

    const int head = vector_head(acc, grad);
    if (head < 0) {
      strided_range<1, kScalarsPerThread>(acc + begin, grad + begin, static_cast<int>(end - begin), s, thread, bad,
                                          sum);
      return bad;
    }
    // Vectors start at h, h + kLanes, ...; chunk c owns the vectors that start in
    // [c * kChunk + h, (c + 1) * kChunk + h). Chunk 0 also does the head [0, h), the
    // last chunk the tail [vec_end, n). Each element is written exactly once.
    const int64_t h = head < n ? head : n;
    const int64_t vec_end = h + (n - h) / kLanes * kLanes;
    const int64_t v_lo = begin + h;
    const int64_t v_hi = begin + kChunk + h < vec_end ? begin + kChunk + h : vec_end;
    if (chunk == 0) scalar_few(acc, grad, static_cast<int>(h), s, thread, bad, sum);
    if (v_lo < v_hi) {
      strided_range<kLanes, kVecsPerThread>(acc + v_lo, grad + v_lo, static_cast<int>((v_hi - v_lo) / kLanes), s,
                                            thread, bad, sum);
    }
    if (end == n) scalar_few(acc + vec_end, grad + vec_end, static_cast<int>(n - vec_end), s, thread, bad, sum);
    return bad;
  }
};

}  // namespace mbs::accumulate
