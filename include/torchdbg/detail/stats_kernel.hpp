// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The one statistics kernel. Every torchdbg feature that needs numbers about a tensor comes
// through here: `compute_moments` makes one pass over the data for moments, extrema, norms
// and NaN/Inf/zero/sign counts; the distribution primitives (quantiles, histogram, central
// moments) run only when asked. CPU tensors are read in place (parallel for large tensors);
// tensors on other devices are reduced on their device into one packed float64 vector that
// comes to the host in a single copy.
//
// float32 (and half/bfloat16, widened block by block) is read in blocks of 2048 elements with
// GCC/Clang vector extensions: sums within a block in float around the block's first finite
// value (read again around the block's mean when that value lies far from it), blocks merged in
// double (Chan et al.). A block without NaN/Inf (the common case)
// takes an unmasked fast path, 16 lanes under AVX-512, 8 under AVX2+FMA and 4 otherwise,
// chosen at run time on x86-64; a block with NaN/Inf is read again by the masked exact path.
// A moments-only request (`signs` false) skips the zero/sign counts and the absolute sum in
// that fast path, which halves its vector operations (what gradient checks need: norms,
// mean, std, extrema, NaN/Inf). With sign counts, a block that follows one without negative
// values (ReLU, softmax, sigmoid outputs) counts zeros only, a third fewer operations; it
// is read again with every count when it holds a negative value after all.
// Measured against a double-precision loop: mean to ~1e-11, variance to ~1e-7 relative;
// counts and extrema exact. float64 and integer data use a scalar double loop.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "torchdbg/error.hpp"

namespace torchdbg::detail {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// Mergeable one-pass summary. Moments, extrema and norms cover finite values only;
/// NaN, +Inf and -Inf are counted separately.
struct Moments {
  int64_t count = 0;   // all elements
  int64_t finite = 0;  // finite elements
  int64_t nan = 0;
  int64_t pos_inf = 0;
  int64_t neg_inf = 0;
  int64_t zeros = 0;
  int64_t negatives = 0;  // finite and < 0
  int64_t positives = 0;  // finite and > 0
  double mean = 0.0;      // of finite values
  double m2 = 0.0;        // sum of squared deviations from `mean`, in units of 4^scale
  /// float64 values beyond about 2^400 or below 2^-400 in magnitude, whose squares overflow
  /// or underflow a double: `m2` holds the squared deviations of the values times 2^-scale
  /// (exact: a power of two). 0 for everything else.
  int scale = 0;
  double min = kInf;
  double max = -kInf;
  double abs_sum = 0.0;
  double abs_max = 0.0;
  /// Whether zeros, negatives, positives and abs_sum were computed (a moments-only request
  /// may skip them; see compute_moments).
  bool signs = true;

  /// The scale (see `scale`) that values of magnitude up to `amax` need: 0 from 2^-400 to
  /// 2^400, else the power of two that brings them to about 2^400 (2^-400).
  static int scale_for(double amax) noexcept {
    if (!(amax > 0.0) || !std::isfinite(amax)) return 0;
    const int e = std::ilogb(amax);
    return e > 400 ? e - 400 : e < -400 ? e + 400 : 0;
  }

  /// Chan et al.'s pairwise merge: exact for counts, numerically stable for the moments.
  void merge(const Moments& o) {
    count += o.count;
    nan += o.nan;
    pos_inf += o.pos_inf;
    neg_inf += o.neg_inf;
    zeros += o.zeros;
    negatives += o.negatives;
    positives += o.positives;
    if (o.finite > 0) {
      if (finite == 0) {
        mean = o.mean;
        m2 = o.m2;
        scale = o.scale;
      } else if (scale == 0 && o.scale == 0 && scale_for(std::max(abs_max, o.abs_max)) == 0) {
        const double n = static_cast<double>(finite + o.finite);
        const double delta = o.mean - mean;
        mean += delta * static_cast<double>(o.finite) / n;
        m2 +=
            o.m2 + delta * delta * static_cast<double>(finite) * static_cast<double>(o.finite) / n;
      } else {  // in the units of the larger values (the smaller ones' share may round away)
        const int s = scale_for(std::max(abs_max, o.abs_max));
        const double n = static_cast<double>(finite + o.finite);
        const double a = std::ldexp(mean, -s), b = std::ldexp(o.mean, -s), delta = b - a;
        mean = std::ldexp(a + delta * static_cast<double>(o.finite) / n, s);
        m2 = std::ldexp(m2, 2 * (scale - s)) + std::ldexp(o.m2, 2 * (o.scale - s)) +
             delta * delta * static_cast<double>(finite) * static_cast<double>(o.finite) / n;
        scale = s;
      }
      finite += o.finite;
    }
    min = std::min(min, o.min);
    max = std::max(max, o.max);
    abs_sum += o.abs_sum;
    abs_max = std::max(abs_max, o.abs_max);
    signs = signs && o.signs;
  }

  /// Population variance (ddof = 0) of the finite values; NaN when there are none (+Inf
  /// beyond a double's range: std_dev() has it).
  [[nodiscard]] double variance() const noexcept {
    return finite > 0 ? std::ldexp(std::max(0.0, m2 / static_cast<double>(finite)), 2 * scale) : kNaN;
  }
  /// Population standard deviation of the finite values; NaN when there are none.
  [[nodiscard]] double std_dev() const noexcept {
    return finite > 0 ? std::ldexp(std::sqrt(std::max(0.0, m2 / static_cast<double>(finite))), scale) : kNaN;
  }
  /// Sum of squares of the finite values (+Inf beyond a double's range: l2_norm() has it).
  [[nodiscard]] double sum_squares() const noexcept {
    return std::ldexp(scaled_sum_squares(), 2 * scale);
  }
  /// The L2 norm of the finite values: sqrt(sum_squares()) without its overflow.
  [[nodiscard]] double l2_norm() const noexcept {
    return std::ldexp(std::sqrt(std::max(0.0, scaled_sum_squares())), scale);
  }
  /// Root mean square of the finite values; NaN when there are none. Finite whenever the
  /// values are (an L2 norm beyond a double's range included).
  [[nodiscard]] double rms() const noexcept {
    if (finite == 0) return kNaN;
    const double mean_square = scaled_sum_squares() / static_cast<double>(finite);
    return std::ldexp(std::sqrt(std::max(0.0, mean_square)), scale);
  }

 private:
  /// Sum of squares of the finite values in units of 4^scale.
  [[nodiscard]] double scaled_sum_squares() const noexcept {
    const double ms = std::ldexp(mean, -scale);
    return m2 + static_cast<double>(finite) * ms * ms;
  }
};

template <typename T>
inline double as_double(T v) noexcept {
  if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>) {
    return static_cast<double>(static_cast<float>(v));
  } else {
    return static_cast<double>(v);
  }
}

template <typename T>
constexpr bool kMayBeNonFinite = !std::is_integral_v<T>;

/// One pass over `n` contiguous elements in double (the reference-precision path, used for
/// float64 and integer data).
template <typename T>
Moments accumulate(const T* p, int64_t n) {
  Moments m;
  m.count = n;
  // Sums are taken around a shift (the first finite value) so that large offsets do not
  // cancel catastrophically in the variance.
  double shift = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = as_double(p[i]);
    if (std::isfinite(v)) {
      shift = v;
      break;
    }
  }
  double s1 = 0.0, s2 = 0.0, abs_sum = 0.0, mn = kInf, mx = -kInf, amax = 0.0;
  int64_t fin = 0, nan = 0, pinf = 0, ninf = 0, zeros = 0, neg = 0, pos = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = as_double(p[i]);
    if constexpr (kMayBeNonFinite<T>) {
      if (!std::isfinite(v)) {
        nan += std::isnan(v) ? 1 : 0;
        pinf += v > 0 ? 1 : 0;
        ninf += v < 0 ? 1 : 0;
        continue;
      }
    }
    const double d = v - shift;
    const double a = std::fabs(v);
    s1 += d;
    s2 += d * d;
    abs_sum += a;
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    amax = a > amax ? a : amax;
    zeros += v == 0.0 ? 1 : 0;
    neg += v < 0.0 ? 1 : 0;
    pos += v > 0.0 ? 1 : 0;
    ++fin;
  }
  m.finite = fin;
  m.nan = nan;
  m.pos_inf = pinf;
  m.neg_inf = ninf;
  m.zeros = zeros;
  m.negatives = neg;
  m.positives = pos;
  if (fin > 0) {
    const double fn = static_cast<double>(fin);
    m.scale = Moments::scale_for(amax);
    if (m.scale != 0) {  // float64 squares that overflow or underflow: the sums again, scaled
      const double sh = std::ldexp(shift, -m.scale);
      s1 = s2 = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        const double v = as_double(p[i]);
        if (!std::isfinite(v)) continue;
        const double d = std::ldexp(v, -m.scale) - sh;
        s1 += d;
        s2 += d * d;
      }
      m.mean = std::ldexp(sh + s1 / fn, m.scale);
    } else {
      m.mean = shift + s1 / fn;
    }
    m.m2 = std::max(0.0, s2 - s1 * s1 / fn);
  }
  m.min = mn;
  m.max = mx;
  m.abs_sum = abs_sum;
  m.abs_max = amax;
  return m;
}

#if (defined(__GNUC__) || defined(__clang__)) && !defined(TORCHDBG_NO_SIMD)
#define TORCHDBG_HAVE_VECTOR_EXT 1
#if defined(__x86_64__)
#define TORCHDBG_X86_DISPATCH 1  // AVX-512 and AVX2 versions, chosen at run time
#endif
#endif

/// Elements summed in float before a merge in double.
constexpr int64_t kFloatBlock = 2048;

/// Float sums of one block, relative to `shift`.
struct FloatBlock {
  double s1 = 0, s2 = 0, abs_sum = 0;
  float min = INFINITY, max = -INFINITY;
  int64_t finite = 0, zeros = 0, negatives = 0, nan = 0, pos_inf = 0;
};

// The scalar helpers the vector kernels call are inlined into them, whatever the optimisation
// level the kernels and their callers are compiled at (see TORCHDBG_KERNEL_OPT).
#if defined(__GNUC__) || defined(__clang__)
#define TORCHDBG_KERNEL_INLINE __attribute__((always_inline)) inline
#else
#define TORCHDBG_KERNEL_INLINE inline
#endif

/// One finite value of a block's scalar tail (both paths), summed in double.
TORCHDBG_KERNEL_INLINE void add_finite(float v, float shift, FloatBlock& o) {
  const double d = static_cast<double>(v) - shift;
  o.s1 += d;
  o.s2 += d * d;
  // Comparisons rather than std::fabs/min/max: the library calls they are at -O0 would be
  // calls out of the kernels (v is finite here).
  o.abs_sum += v < 0.0f ? -v : v;
  o.min = v < o.min ? v : o.min;
  o.max = o.max < v ? v : o.max;
  ++o.finite;
  o.zeros += v == 0.0f ? 1 : 0;
  o.negatives += v < 0.0f ? 1 : 0;
}

/// Adds `n` floats one by one, sums in double (a block's scalar tail, or a whole block whose
/// float lane sums would not be exact).
TORCHDBG_KERNEL_INLINE void add_scalar(const float* p, int64_t n, float shift, FloatBlock& o) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = p[i];
    if (v >= -FLT_MAX && v <= FLT_MAX) {  // finite (std::fabs: see add_finite)
      add_finite(v, shift, o);
    } else {
      o.nan += v != v ? 1 : 0;
      o.pos_inf += v == INFINITY ? 1 : 0;
    }
  }
}

#if defined(TORCHDBG_HAVE_VECTOR_EXT)
/// How far ahead of its reads a kernel loop asks for the data (bytes): a tensor that comes
/// from memory, not cache, is read at about the rate the hardware's own prefetching allows with
/// the loop's arithmetic in between, which on the 2-core VMs of docs/performance.md was 60-70%
/// of what a plain sum reads; asking for each line 16 KiB ahead brings it close to that.
constexpr uintptr_t kPrefetchAhead = 16384;

/// Asks for the cache lines that hold [p, p + kBytes) shifted kPrefetchAhead bytes ahead. A
/// prefetch never faults, so the lines past a tensor's end are harmless; the address is
/// formed as an integer, not a pointer past the end.
template <std::size_t kBytes>
__attribute__((always_inline)) inline void prefetch_ahead(const float* p) noexcept {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) + kPrefetchAhead;
  for (std::size_t off = 0; off < kBytes; off += 64) __builtin_prefetch(reinterpret_cast<const void*>(a + off));
}

/// One vector lane's float sums, extrema and counts, added to a block's (both paths).
TORCHDBG_KERNEL_INLINE void add_lane(float s1, float s2, float ab, float mn, float mx, int32_t zeros,
                     int32_t negatives, FloatBlock& o) {
  o.s1 += s1;
  o.s2 += s2;
  o.abs_sum += ab;
  o.min = mn < o.min ? mn : o.min;  // std::min and std::max, without the calls (see add_finite)
  o.max = o.max < mx ? mx : o.max;
  o.zeros += zeros;
  o.negatives += negatives;
}

// Each width is used only where it is the CPU's native one: GCC splits wider vectors, and
// scalarises their selects.
typedef float TorchdbgV4f __attribute__((vector_size(16)));
typedef int32_t TorchdbgV4i __attribute__((vector_size(16)));
typedef float TorchdbgV8f __attribute__((vector_size(32)));
typedef int32_t TorchdbgV8i __attribute__((vector_size(32)));

typedef float TorchdbgV16f __attribute__((vector_size(64)));
typedef int32_t TorchdbgV16i __attribute__((vector_size(64)));
// Doubles, and the floats converted to them (column_deviations).
typedef float TorchdbgV2f __attribute__((vector_size(8)));
typedef double TorchdbgV2d __attribute__((vector_size(16)));
typedef double TorchdbgV4d __attribute__((vector_size(32)));
typedef double TorchdbgV8d __attribute__((vector_size(64)));

/// What float_block_finite_impl counts besides moments and extrema.
/// - kBlockMoments: nothing (zeros, negatives and abs_sum are left 0).
/// - kBlockSigns: zeros, negatives and the absolute sum.
/// - kBlockNonNegative: zeros only, for a block expected to hold no negative value (ReLU,
///   softmax and sigmoid outputs: about a third fewer vector operations than kBlockSigns).
///   negatives is 0 and abs_sum the sum; the block is refused (false) when it holds a
///   negative value after all, and the caller reads it again with kBlockSigns.
/// - kBlockSums: the sums only, without extrema (min/max stay +/-infinity but for the
///   scalar tail's values): the light pass of a sampled reading (sample_float).
enum BlockMode : int { kBlockMoments = 0, kBlockSigns = 1, kBlockNonNegative = 2, kBlockSums = 3 };

/// The common case, a block with no NaN/Inf and no float overflow, in about half the vector
/// operations of the exact path below: nothing is masked and NaN/Inf counts are known to be zero;
/// two vectors per iteration keep two independent chains per accumulator. The L1 norm comes
/// from the sum and the sum of the negative values (|v| summed = sum - 2 * negative sum), so
/// the negative compare serves two accumulators. Returns false, with `o` unspecified, when
/// the block holds a value it cannot handle; the caller then reads the block with the exact
/// path. Written once for any vector width (VF/VI: float and int32 vectors of the same lane
/// count); the wrappers below pick the width per CPU. kMode: see BlockMode.
template <typename VF, typename VI, int kMode>
__attribute__((always_inline)) inline bool float_block_finite_impl(const float* p, int64_t n,
                                                                   float shift, FloatBlock& o) {
  constexpr int64_t kLanes = sizeof(VF) / sizeof(float);
  // AVX-512 compares yield mask registers, and `mask ? acc + x : acc` is one masked add;
  // narrower ISAs get all-ones lanes, which are added directly.
  constexpr bool kMaskRegisters = sizeof(VF) == 64;
  const VF zero = {};
  const VI izero = {}, one = izero + 1;
  const VF sh = zero + shift;
  VF s1a = zero, s2a = zero, nsa = zero, mna = zero + INFINITY, mxa = zero - INFINITY;
  VF s1b = zero, s2b = zero, nsb = zero, mnb = mna, mxb = mxa;
  VI zera = izero, nega = izero, zerb = izero, negb = izero;
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    VF v, w;
    prefetch_ahead<2 * sizeof(VF)>(p + i);
    std::memcpy(&v, p + i, sizeof v);
    std::memcpy(&w, p + i + kLanes, sizeof w);
    const VF d = v - sh, e = w - sh;
    s1a += d;
    s1b += e;
    // A NaN or Inf (or an overflowing square) makes the square sums non-finite: checked once,
    // after the loop.
    s2a += d * d;
    s2b += e * e;
    if constexpr (kMode == kBlockSums) {
      // sums only: no extrema, no counts
    } else if constexpr (kMode == kBlockMoments) {
      // moments only: extrema, no sign or zero counts (about half the operations)
      const VF lo = v < w ? v : w, hi = v > w ? v : w;
      mna = lo < mna ? lo : mna;
      mxa = hi > mxa ? hi : mxa;
    } else if constexpr (kMode == kBlockNonNegative) {
      // zeros only: the minimum tells afterwards whether a negative value was there
      const VF lo = v < w ? v : w, hi = v > w ? v : w;
      mna = lo < mna ? lo : mna;
      mxa = hi > mxa ? hi : mxa;
      zera -= (v == zero) + (w == zero);
    } else if constexpr (kMaskRegisters) {
      mna = v < mna ? v : mna;
      mnb = w < mnb ? w : mnb;
      mxa = v > mxa ? v : mxa;
      mxb = w > mxb ? w : mxb;
      const VI zv = v == zero, zw = w == zero, nv = v < zero, nw = w < zero;
      zera = zv ? zera + one : zera;
      zerb = zw ? zerb + one : zerb;
      nega = nv ? nega + one : nega;
      negb = nw ? negb + one : negb;
      nsa = nv ? nsa + v : nsa;
      nsb = nw ? nsb + w : nsb;
    } else {
      // 16 vector registers: the two chains above would spill accumulators to the stack, and
      // a chain through memory costs a store-forward per iteration (a third of the speed on
      // AVX2). Only the sums keep two chains; extrema and counts take one op per vector.
      const VF lo = v < w ? v : w, hi = v > w ? v : w;
      mna = lo < mna ? lo : mna;
      mxa = hi > mxa ? hi : mxa;
      const VI nv = v < zero, nw = w < zero;
      zera -= (v == zero) + (w == zero);
      nega -= nv + nw;
      nsa += (VF)((VI)v & nv) + (VF)((VI)w & nw);
    }
  }
  const VF s1 = s1a + s1b, s2 = s2a + s2b, ns = nsa + nsb;
  const VI zer = zera + zerb, neg = nega + negb;
  const VF mn = mna < mnb ? mna : mnb, mx = mxa > mxb ? mxa : mxb;
  o = FloatBlock{};
  double neg_sum = 0.0;
  for (int64_t k = 0; k < kLanes; ++k) {
    if (!(s2[k] >= -FLT_MAX && s2[k] <= FLT_MAX) || !(ns[k] >= -FLT_MAX && ns[k] <= FLT_MAX)) return false;
    if (kMode == kBlockNonNegative && mn[k] < 0.0f) return false;
    add_lane(s1[k], s2[k], 0.0f, mn[k], mx[k], zer[k], neg[k], o);
    neg_sum += ns[k];
  }
  o.finite = i;
  o.abs_sum = kMode == kBlockMoments || kMode == kBlockSums ? 0.0 : o.s1 + static_cast<double>(i) * shift - 2.0 * neg_sum;
  for (; i < n; ++i) {
    if (!(p[i] >= -FLT_MAX && p[i] <= FLT_MAX)) return false;
    add_finite(p[i], shift, o);  // exact for the tail, negative values included
  }
  return true;
}

/// The exact path: every lane masked, NaN/Inf counted. Blocks holding NaN/Inf (or float
/// overflow) come here.
template <typename VF, typename VI>
__attribute__((always_inline)) inline void float_block_exact_impl(const float* p, int64_t n,
                                                                  float shift, FloatBlock& o) {
  constexpr int64_t kLanes = sizeof(VF) / sizeof(float);
  const VF zero = {};
  const VI izero = {};
  const VF inf = zero + INFINITY, ninf = -inf, sh = zero + shift, big = zero + FLT_MAX;
  const VI absmask = izero + 0x7fffffff, qnan = izero + 0x7fc00000;
  VF s1 = zero, s2 = zero, ab = zero, mn = inf, mx = ninf;
  VI fin = izero, zer = izero, neg = izero, nan = izero, pinf = izero;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    VF v;
    std::memcpy(&v, p + i, sizeof v);
    const VF a = (VF)((VI)v & absmask);
    const VI f = a <= big;  // all ones where finite
    const VF d = (VF)((VI)(v - sh) & f);
    s1 += d;
    s2 += d * d;
    ab += (VF)((VI)a & f);
    // Non-finite lanes become NaN, which never wins a comparison: `x < m ? x : m` is one
    // min instruction (nested selects are scalarised by GCC at some widths).
    const VF vn = (VF)((VI)v | (~f & qnan));
    mn = vn < mn ? vn : mn;
    mx = vn > mx ? vn : mx;
    fin -= f;
    zer -= (v == zero);
    neg -= (v < zero) & f;
    nan -= (v != v);
    pinf -= (v == inf);
  }
  o = FloatBlock{};
  for (int64_t k = 0; k < kLanes; ++k) {
    add_lane(s1[k], s2[k], ab[k], mn[k], mx[k], zer[k], neg[k], o);
    o.finite += fin[k];
    o.nan += nan[k];
    o.pos_inf += pinf[k];
  }
  add_scalar(p + i, n - i, shift, o);
}

/// Adds to `counts[u]` how many of `rows` rows of `units` contiguous floats have a value
/// above `threshold` in column u (per-unit activity of an [N, F] output). Columns go in
/// groups of four vectors whose counters stay in registers while the rows stream by; the
/// caller keeps `rows` below 2^31.
template <typename VF, typename VI>
__attribute__((always_inline)) inline void float_rows_above_impl(const float* p, int64_t rows,
                                                                 int64_t units, float threshold,
                                                                 int32_t* counts) {
  constexpr int64_t kLanes = sizeof(VF) / sizeof(float);
  const VF th = VF{} + threshold;
  int64_t u = 0;
  for (; u + 4 * kLanes <= units; u += 4 * kLanes) {
    VI a = {}, b = {}, c = {}, d = {};
    for (int64_t r = 0; r < rows; ++r) {
      const float* q = p + r * units + u;
      VF v0, v1, v2, v3;
      std::memcpy(&v0, q, sizeof v0);
      std::memcpy(&v1, q + kLanes, sizeof v1);
      std::memcpy(&v2, q + 2 * kLanes, sizeof v2);
      std::memcpy(&v3, q + 3 * kLanes, sizeof v3);
      a -= v0 > th;
      b -= v1 > th;
      c -= v2 > th;
      d -= v3 > th;
    }
    const VI* acc[4] = {&a, &b, &c, &d};
    for (int k = 0; k < 4; ++k)
      for (int64_t l = 0; l < kLanes; ++l) counts[u + k * kLanes + l] += (*acc[k])[l];
  }
  for (; u < units; ++u) {
    int32_t k = 0;
    for (int64_t r = 0; r < rows; ++r) k += p[r * units + u] > threshold ? 1 : 0;
    counts[u] += k;
  }
}

/// How many of `n` contiguous floats are above `threshold` (NaN never is): one channel of an
/// [N, C, H, W] output, for per-unit activity.
template <typename VF, typename VI>
__attribute__((always_inline)) inline int64_t float_count_above_impl(const float* p, int64_t n,
                                                                     float threshold) {
  constexpr int64_t kLanes = sizeof(VF) / sizeof(float);
  const VF th = VF{} + threshold;
  int64_t total = 0, i = 0;
  while (i + 4 * kLanes <= n) {
    VI a = {}, b = {}, c = {}, d = {};
    const int64_t limit = i + (int64_t{1} << 30);  // int32 lane counters never overflow
    for (; i + 4 * kLanes <= n && i < limit; i += 4 * kLanes) {
      VF v0, v1, v2, v3;
      prefetch_ahead<4 * sizeof(VF)>(p + i);
      std::memcpy(&v0, p + i, sizeof v0);
      std::memcpy(&v1, p + i + kLanes, sizeof v1);
      std::memcpy(&v2, p + i + 2 * kLanes, sizeof v2);
      std::memcpy(&v3, p + i + 3 * kLanes, sizeof v3);
      a -= v0 > th;
      b -= v1 > th;
      c -= v2 > th;
      d -= v3 > th;
    }
    const VI sum = (a + b) + (c + d);
    for (int64_t l = 0; l < kLanes; ++l) total += sum[l];
  }
  for (; i < n; ++i) total += p[i] > threshold ? 1 : 0;
  return total;
}

/// Per position i < n: adds to s1[i] and s2[i] (or, `fresh`, stores in them) the sums of
/// d = row[i] - first[i] and of d * d, in double, over `rows` rows of floats (row r at
/// `p + r * stride`), row by row (batch_spread's deviations from the first sample; it hands the
/// rows over in blocks). VH holds as many floats as VD doubles.
template <typename VH, typename VD>
__attribute__((always_inline)) inline void float_column_deviations_impl(const float* first, const float* p,
                                                                        int64_t rows, int64_t stride,
                                                                        int64_t n, bool fresh, double* s1,
                                                                        double* s2) {
  constexpr int64_t kLanes = sizeof(VD) / sizeof(double);
  static_assert(sizeof(VH) / sizeof(float) == kLanes, "as many floats as doubles");
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {  // two vectors: a whole line of each row
    VH h0, h1;
    std::memcpy(&h0, first + i, sizeof h0);
    std::memcpy(&h1, first + i + kLanes, sizeof h1);
    const VD f0 = __builtin_convertvector(h0, VD), f1 = __builtin_convertvector(h1, VD);
    VD a0 = {}, a1 = {}, b0 = {}, b1 = {};
    if (!fresh) {
      std::memcpy(&a0, s1 + i, sizeof a0);
      std::memcpy(&a1, s1 + i + kLanes, sizeof a1);
      std::memcpy(&b0, s2 + i, sizeof b0);
      std::memcpy(&b1, s2 + i + kLanes, sizeof b1);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* q = p + r * stride + i;
      std::memcpy(&h0, q, sizeof h0);
      std::memcpy(&h1, q + kLanes, sizeof h1);
      const VD d0 = __builtin_convertvector(h0, VD) - f0, d1 = __builtin_convertvector(h1, VD) - f1;
      a0 += d0;
      a1 += d1;
      b0 += d0 * d0;
      b1 += d1 * d1;
    }
    std::memcpy(s1 + i, &a0, sizeof a0);
    std::memcpy(s1 + i + kLanes, &a1, sizeof a1);
    std::memcpy(s2 + i, &b0, sizeof b0);
    std::memcpy(s2 + i + kLanes, &b1, sizeof b1);
  }
  for (; i < n; ++i) {
    double a = fresh ? 0.0 : s1[i], b = fresh ? 0.0 : s2[i];
    for (int64_t r = 0; r < rows; ++r) {
      const double d = static_cast<double>(p[r * stride + i]) - static_cast<double>(first[i]);
      a += d;
      b += d * d;
    }
    s1[i] = a;
    s2[i] = b;
  }
}

/// One vector width's kernels.
struct BlockKernels {
  const char* name;
  bool (*finite)(const float*, int64_t, float, FloatBlock&);
  bool (*finite_moments)(const float*, int64_t, float, FloatBlock&);  // no sign/zero counts
  bool (*finite_non_negative)(const float*, int64_t, float, FloatBlock&);  // kBlockNonNegative
  void (*exact)(const float*, int64_t, float, FloatBlock&);
  void (*rows_above)(const float*, int64_t, int64_t, float, int32_t*);
  int64_t (*count_above)(const float*, int64_t, float);
  bool (*finite_sums)(const float*, int64_t, float, FloatBlock&);  // kBlockSums
  void (*column_deviations)(const float*, const float*, int64_t, int64_t, int64_t, bool, double*, double*);
};

// GCC compiles the kernels at -O2 whatever the level of the code around them: built without
// optimisation (-O0: a Debug build) it keeps every vector value on the stack, and at -Og it
// reads 5 to 8 times slower than at -O0 (a 2048-float AVX-512 block 9.2 us at -O0 against
// 0.25 us at -O2 on an Intel Xeon VM); their results are then the same at every level. Clang
// has no such attribute (its -O0 kernels run about 3.5 times slower than at -O2).
#if defined(__GNUC__) && !defined(__clang__)
#define TORCHDBG_KERNEL_OPT __attribute__((optimize("O2")))
#else
#define TORCHDBG_KERNEL_OPT
#endif

// A wide kernel leaves the upper halves of the vector registers dirty. GCC clears them on the
// way out (vzeroupper) only at -O2 and above; below, every SSE instruction the caller runs next
// pays for the dirty state (count_above on 1536 floats: 265 ns a call at -O1 against 77 ns).
// The wide wrappers clear them themselves at every level.
#if defined(TORCHDBG_X86_DISPATCH)
#define TORCHDBG_KERNEL_LEAVE_WIDE() __builtin_ia32_vzeroupper()
#endif
#define TORCHDBG_KERNEL_LEAVE_BASELINE() ((void)0)

/// The kernels of one vector width compiled for one target: `<kernel>_<suffix>` functions.
/// `leave` runs after the kernel, before the wrapper returns. TORCHDBG_KERNEL_OPT comes before
/// the target: GCC 14 drops a target given before an optimize attribute.
#define TORCHDBG_DEFINE_KERNELS(suffix, target_attr, leave, VF, VI, VH, VD)                        \
  TORCHDBG_KERNEL_OPT target_attr inline bool block_finite_##suffix(const float* p, int64_t n,     \
                                                                    float shift, FloatBlock& o) {  \
    const bool ok = float_block_finite_impl<VF, VI, kBlockSigns>(p, n, shift, o);                  \
    leave();                                                                                       \
    return ok;                                                                                     \
  }                                                                                                \
  TORCHDBG_KERNEL_OPT target_attr inline bool block_moments_##suffix(const float* p, int64_t n,    \
                                                                     float shift, FloatBlock& o) { \
    const bool ok = float_block_finite_impl<VF, VI, kBlockMoments>(p, n, shift, o);                \
    leave();                                                                                       \
    return ok;                                                                                     \
  }                                                                                                \
  TORCHDBG_KERNEL_OPT target_attr inline bool block_non_negative_##suffix(                         \
      const float* p, int64_t n, float shift, FloatBlock& o) {                                     \
    const bool ok = float_block_finite_impl<VF, VI, kBlockNonNegative>(p, n, shift, o);            \
    leave();                                                                                       \
    return ok;                                                                                     \
  }                                                                                                \
  TORCHDBG_KERNEL_OPT target_attr inline void block_exact_##suffix(const float* p, int64_t n,      \
                                                                   float shift, FloatBlock& o) {   \
    float_block_exact_impl<VF, VI>(p, n, shift, o);                                                \
    leave();                                                                                       \
  }                                                                                                \
  TORCHDBG_KERNEL_OPT target_attr inline void rows_above_##suffix(                                 \
      const float* p, int64_t rows, int64_t units, float threshold, int32_t* counts) {             \
    float_rows_above_impl<VF, VI>(p, rows, units, threshold, counts);                              \
    leave();                                                                                       \
  }                                                                                                \
  TORCHDBG_KERNEL_OPT target_attr inline int64_t count_above_##suffix(const float* p, int64_t n,   \
                                                                      float threshold) {           \
    const int64_t c = float_count_above_impl<VF, VI>(p, n, threshold);                             \
    leave();                                                                                       \
    return c;                                                                                      \
  }                                                                                                \
  TORCHDBG_KERNEL_OPT target_attr inline bool block_sums_##suffix(const float* p, int64_t n,       \
                                                                  float shift, FloatBlock& o) {    \
    const bool ok = float_block_finite_impl<VF, VI, kBlockSums>(p, n, shift, o);                   \
    leave();                                                                                       \
    return ok;                                                                                     \
  }                                                                                                \
  TORCHDBG_KERNEL_OPT target_attr inline void column_deviations_##suffix(                          \
      const float* first, const float* p, int64_t rows, int64_t stride, int64_t n, bool fresh,     \
      double* s1, double* s2) {                                                                    \
    float_column_deviations_impl<VH, VD>(first, p, rows, stride, n, fresh, s1, s2);                \
    leave();                                                                                       \
  }

#if defined(TORCHDBG_X86_DISPATCH)
TORCHDBG_DEFINE_KERNELS(avx512, __attribute__((target("avx512f"))), TORCHDBG_KERNEL_LEAVE_WIDE,
                        TorchdbgV16f, TorchdbgV16i, TorchdbgV8f, TorchdbgV8d)
TORCHDBG_DEFINE_KERNELS(avx2, __attribute__((target("avx2,fma"))), TORCHDBG_KERNEL_LEAVE_WIDE,
                        TorchdbgV8f, TorchdbgV8i, TorchdbgV4f, TorchdbgV4d)
#endif
TORCHDBG_DEFINE_KERNELS(baseline, , TORCHDBG_KERNEL_LEAVE_BASELINE, TorchdbgV4f, TorchdbgV4i,
                        TorchdbgV2f, TorchdbgV2d)
#undef TORCHDBG_DEFINE_KERNELS
#undef TORCHDBG_KERNEL_LEAVE_BASELINE
#if defined(TORCHDBG_X86_DISPATCH)
#undef TORCHDBG_KERNEL_LEAVE_WIDE
#endif
#undef TORCHDBG_KERNEL_OPT

/// Every vector width this CPU can run, widest first: `block_kernels()` takes the first;
/// tests check them all.
inline std::vector<BlockKernels> block_kernel_variants() {
  std::vector<BlockKernels> out;
#if defined(TORCHDBG_X86_DISPATCH)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f"))
    out.push_back({"avx512f", &block_finite_avx512, &block_moments_avx512, &block_non_negative_avx512, &block_exact_avx512, &rows_above_avx512, &count_above_avx512, &block_sums_avx512, &column_deviations_avx512});
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    out.push_back({"avx2+fma", &block_finite_avx2, &block_moments_avx2, &block_non_negative_avx2, &block_exact_avx2, &rows_above_avx2, &count_above_avx2, &block_sums_avx2, &column_deviations_avx2});
#endif
  out.push_back({"baseline", &block_finite_baseline, &block_moments_baseline, &block_non_negative_baseline, &block_exact_baseline, &rows_above_baseline, &count_above_baseline, &block_sums_baseline, &column_deviations_baseline});
  return out;
}

/// The widest block readers the CPU has, chosen once: AVX-512, AVX2+FMA or the baseline.
inline const BlockKernels& block_kernels() {
  static const BlockKernels k = block_kernel_variants().front();
  return k;
}
#endif

/// Whether float lane sums of a block with finite values in [mn, mx] are as good as double
/// ones: the largest deviation's square times a lane's share of a block, and the absolute
/// sum, stay far below FLT_MAX, and a non-zero spread keeps its squares normal.
inline bool float_sums_exact(float mn, float mx) noexcept {
  const double spread = static_cast<double>(mx) - static_cast<double>(mn);
  const double amax = std::max(std::fabs(static_cast<double>(mn)), std::fabs(static_cast<double>(mx)));
  return spread <= 1e17 && amax <= 1e34 && (spread == 0.0 || spread >= 1e-14);
}

/// Whether sums about a shift (`s1` of the deviations, `s2` of their squares, over `n` values)
/// lose precision to cancellation in m2 = s2 - s1^2 / n: the mean is more than about three
/// standard deviations from the shift (m2 below a tenth of s2).
inline bool far_from_shift(double s1, double s2, double n) noexcept {
  return s2 > 0.0 && s2 - s1 * s1 / n < 0.1 * s2;
}

/// Moments of one block of at most kFloatBlock contiguous floats. `non_negative`: whether the
/// previous block had no negative value; updated for the next block. With sign counts, a
/// block after one without negative values is read in kBlockNonNegative mode first (read
/// again with every count when refused).
#if defined(TORCHDBG_HAVE_VECTOR_EXT)
inline Moments float_block_moments(const float* q, int64_t len, bool signs, bool& non_negative,
                                   const BlockKernels& k = block_kernels()) {
#else
inline Moments float_block_moments(const float* q, int64_t len, bool signs, bool& non_negative) {
#endif
  float shift = 0.0f;
  for (int64_t i = 0; i < len; ++i) {
    if (std::fabs(q[i]) <= FLT_MAX) {
      shift = q[i];
      break;
    }
  }
#if defined(TORCHDBG_HAVE_VECTOR_EXT)
  FloatBlock a;
  bool fast = false;
  const auto read = [&] {
    if (!signs) {
      fast = k.finite_moments(q, len, shift, a);
    } else {
      fast = (non_negative && k.finite_non_negative(q, len, shift, a)) || k.finite(q, len, shift, a);
    }
    if (!fast) k.exact(q, len, shift, a);  // NaN/Inf: everything, counts included
  };
  read();
  if (a.finite > 1 && far_from_shift(a.s1, a.s2, static_cast<double>(a.finite))) {
    // The first value lies far from the block's mean (an outlier first): the float sums
    // about it cancel. Read again about the mean they give.
    shift = static_cast<float>(static_cast<double>(shift) + a.s1 / static_cast<double>(a.finite));
    a = FloatBlock{};
    read();
  }
  if (a.finite > 0 && !float_sums_exact(a.min, a.max)) {
    // Float lanes would overflow (values near 1e18 and beyond, or of mixed sign near
    // FLT_MAX) or lose the squares of tiny deviations: this block is summed in double.
    a = FloatBlock{};
    add_scalar(q, len, shift, a);
    fast = false;  // every count is there
  }
  non_negative = a.negatives == 0;
  Moments m;
  m.count = len;
  m.finite = a.finite;
  m.nan = a.nan;
  m.pos_inf = a.pos_inf;
  m.neg_inf = len - a.finite - a.nan - a.pos_inf;
  m.signs = signs || !fast;
  if (m.signs) {
    m.zeros = a.zeros;
    m.negatives = a.negatives;
    m.positives = a.finite - a.negatives - a.zeros;
    m.abs_sum = a.abs_sum;
  }
  if (a.finite > 0) {
    const double fn = static_cast<double>(a.finite);
    m.mean = shift + a.s1 / fn;
    m.m2 = std::max(0.0, a.s2 - a.s1 * a.s1 / fn);
    m.min = a.min;
    m.max = a.max;
    m.abs_max = std::max(-m.min, m.max);
  }
  return m;
#else
  (void)signs;
  (void)non_negative;
  (void)shift;
  return accumulate(q, len);
#endif
}

/// Moments of contiguous float32 data, block by block. `signs` false: zero/negative/positive
/// counts and the absolute sum may be skipped (Moments::signs says whether they were).
/// `after_block(begin, length)` runs after each block's statistics, while the block is still
/// in the first-level cache (compute_moments_with_units counts it there).
template <typename AfterBlock>
Moments accumulate_float(const float* p, int64_t n, bool signs, AfterBlock&& after_block) {
  Moments total;
  bool non_negative = false;
  for (int64_t b = 0; b < n; b += kFloatBlock) {
    const int64_t len = std::min(kFloatBlock, n - b);
    total.merge(float_block_moments(p + b, len, signs, non_negative));
    after_block(b, len);
  }
  return total;
}

inline Moments accumulate_float(const float* p, int64_t n, bool signs = true) {
  return accumulate_float(p, n, signs, [](int64_t, int64_t) {});
}

/// Half and bfloat16: widened to float a block at a time, then the float path.
template <typename T>
Moments accumulate_widened(const T* p, int64_t n, bool signs) {
  float buf[kFloatBlock];
  Moments total;
  bool non_negative = false;
  for (int64_t b = 0; b < n; b += kFloatBlock) {
    const int64_t len = std::min(kFloatBlock, n - b);
    for (int64_t k = 0; k < len; ++k) buf[k] = static_cast<float>(p[b + k]);
    total.merge(float_block_moments(buf, len, signs, non_negative));
  }
  return total;
}

/// One pass over `n` contiguous elements of any supported type (`signs`: see
/// accumulate_float; float64 and integer data always get them).
template <typename T>
Moments accumulate_any(const T* p, int64_t n, bool signs = true) {
  if constexpr (std::is_same_v<T, float>) {
    return accumulate_float(p, n, signs);
  } else if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>) {
    return accumulate_widened(p, n, signs);
  } else {
    return accumulate(p, n);
  }
}

/// What a sampled reading (sample_float) estimated instead of reading every value.
struct SampleInfo {
  int64_t values = 0;  // values the full kernel read; 0: it read every value
};

/// Sum and sum of squares of the deviations from `shift` of `n` contiguous floats (`out[0]`,
/// `out[1]`): the full kernel's float sums without extrema or counts (kBlockSums: one
/// subtract, one add and one multiply-add per vector). False when a value is not finite or a
/// squared deviation overflows float.
inline bool float_sums(const float* p, int64_t n, float shift, double* out) {
  FloatBlock a;
#if defined(TORCHDBG_HAVE_VECTOR_EXT)
  if (!block_kernels().finite_sums(p, n, shift, a)) return false;
#else
  add_scalar(p, n, shift, a);
  if (a.finite != n) return false;
#endif
  out[0] = a.s1;
  out[1] = a.s2;
  return true;
}

/// Count, mean and m2 of one block of `len` finite floats from its sums about its first value
/// (float_sums): the full kernel's arithmetic without extrema or sign counts (read again about
/// its mean when its first value is far from it). A block whose deviations are too small for
/// float squares (RMS below 1e-14, or squares that are all 0 for values that differ), or that
/// may reach 1e17, is summed in double instead. False when a value is not finite (or a
/// squared deviation overflows float): nothing is set then.
inline bool light_block_moments(const float* q, int64_t len, Moments& m) {
  float c = q[0];
  if (!(std::fabs(c) <= FLT_MAX)) return false;
  double sums[2];
  if (!float_sums(q, len, c, sums)) return false;
  const double dn = static_cast<double>(len);
  if (far_from_shift(sums[0], sums[1], dn)) {  // an outlier first: again about the mean
    c = static_cast<float>(static_cast<double>(c) + sums[0] / dn);
    if (!float_sums(q, len, c, sums)) return false;
  }
  // As the full kernel: deviations that may reach 1e17 (squares summing beyond 1e34) and
  // deviations too small for float squares (RMS below 1e-14, or all squares 0 for values that
  // differ) are summed in double.
  bool redo = sums[1] > 1e34 || (sums[1] > 0.0 && sums[1] < 1e-28 * dn) ||
              far_from_shift(sums[0], sums[1], dn);
  for (int64_t i = 0; sums[1] == 0.0 && !redo && i < len; ++i) redo = q[i] != c;  // underflowed
  if (redo) {
    FloatBlock a;
    add_scalar(q, len, c, a);
    sums[0] = a.s1;
    sums[1] = a.s2;
  }
  m = Moments{};
  m.count = m.finite = len;
  m.mean = static_cast<double>(c) + sums[0] / dn;
  m.m2 = std::max(0.0, sums[1] - sums[0] * sums[0] / dn);
  m.signs = false;
  return true;
}

/// Process-wide count of sampled readings: each one picks its blocks afresh, so the steps of
/// a run read different parts of a tensor.
inline std::atomic<uint64_t>& sample_counter() {
  static std::atomic<uint64_t> c{0};
  return c;
}

/// splitmix64's finaliser: a well-mixed 64-bit hash.
inline uint64_t mix64(uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Values a sampled reading takes at most (16 MiB of float32): a larger tensor comes from
/// memory, not cache, and the full kernel already reads it at memory bandwidth (on a 2-core
/// AMD EPYC VM a sampled reading was slower there, 17 against 22 GB/s at 64 MiB, and about 1.5
/// times as fast as the full kernel up to 4 MiB in cache).
constexpr int64_t kMaxSampleValues = int64_t{1} << 22;

/// Groups a sampled reading needs at least (sample_float): fewer blocks read would make the
/// sign counts' estimates coarse.
constexpr int64_t kMinSampleGroups = 16;

/// Moments of `n` contiguous floats from a light pass over every block and a stratified sample
/// of blocks through the full kernel. The full blocks of kFloatBlock values go in groups of
/// `stride`: one block of each group, drawn by a hash of `seed` and the group, is read by the
/// full kernel; every other block gets its count, mean and m2 from light_block_moments; a
/// last, partial block is read in full. So counts of values, NaN and Inf, mean, m2 and the sum
/// of squares are those of a full reading (the same block arithmetic, merged in double);
/// zero/negative/positive counts and the absolute sum are the sampled blocks' weighted by
/// their groups' block counts (unbiased estimates); min/max those of the blocks read. `info`
/// gets the values the full kernel read. Returns false, with `out` and `info` untouched, when
/// any value is not finite (or a block's squared deviations overflow float), there would be
/// fewer than kMinSampleGroups groups, or `n` is above kMaxSampleValues: the caller then reads
/// every value.
inline bool sample_float(const float* p, int64_t n, bool signs, int64_t stride, uint64_t seed,
                         Moments& out, SampleInfo& info) {
  if (stride < 2 || n > kMaxSampleValues) return false;
  const int64_t full = n / kFloatBlock, tail = n - full * kFloatBlock;
  if (full / stride < kMinSampleGroups) return false;
  Moments exact;  // every block: counts, mean, m2
  double zeros = 0.0, negatives = 0.0, abs_sum = 0.0;
  double mn = kInf, mx = -kInf, amax = 0.0;
  bool all_signs = true;
  int64_t read = 0;
  bool non_negative = false;
  const auto take = [&](const Moments& m, double weight) {  // a block read in full
    exact.merge(m);
    zeros += weight * static_cast<double>(m.zeros);
    negatives += weight * static_cast<double>(m.negatives);
    abs_sum += weight * m.abs_sum;
    mn = std::min(mn, m.min);
    mx = std::max(mx, m.max);
    amax = std::max(amax, m.abs_max);
    all_signs = all_signs && m.signs;
    read += m.count;
  };
  for (int64_t g0 = 0; g0 < full; g0 += stride) {
    const int64_t g1 = std::min(full, g0 + stride);
    const auto draw = mix64(seed ^ mix64(static_cast<uint64_t>(g0)));
    const int64_t chosen = g0 + static_cast<int64_t>(draw % static_cast<uint64_t>(g1 - g0));
    for (int64_t b = g0; b < g1; ++b) {
      Moments m;
      if (b == chosen) {
        m = float_block_moments(p + b * kFloatBlock, kFloatBlock, signs, non_negative);
        if (m.finite != m.count) return false;
        take(m, static_cast<double>(g1 - g0));
      } else {
        if (!light_block_moments(p + b * kFloatBlock, kFloatBlock, m)) return false;
        exact.merge(m);
      }
    }
  }
  if (tail > 0) {
    const Moments m = float_block_moments(p + full * kFloatBlock, tail, signs, non_negative);
    if (m.finite != m.count) return false;
    take(m, 1.0);
  }
  Moments est = exact;
  est.min = mn;
  est.max = mx;
  est.abs_max = amax;
  est.signs = all_signs;
  if (all_signs) {
    est.zeros = std::clamp<int64_t>(std::llround(zeros), 0, n);
    est.negatives = std::clamp<int64_t>(std::llround(negatives), 0, n - est.zeros);
    est.positives = n - est.zeros - est.negatives;
    est.abs_sum = abs_sum;
  } else {
    est.zeros = est.negatives = est.positives = 0;
    est.abs_sum = 0.0;
  }
  out = est;
  info.values = read;
  return true;
}

/// Elements per parallel chunk; below this a tensor is read by one thread.
constexpr int64_t kParallelGrain = int64_t{1} << 18;

/// How many chunks read_in_chunks splits `n` elements into: one per intra-op thread, each of
/// kParallelGrain elements at least; 1 inside a parallel region.
inline int64_t parallel_chunks(int64_t n) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunks = std::min<int64_t>(threads, std::max<int64_t>(1, n / kParallelGrain));
  return chunks <= 1 || at::in_parallel_region() ? 1 : chunks;
}

/// The moments of `n` elements read as `chunks` chunks (parallel_chunks(n)) of equal size (the
/// last shorter) by the intra-op threads, merged in chunk order: deterministic for a given
/// thread count. `read(chunk, begin, end)` returns the moments of elements [begin, end).
template <typename ReadChunk>
Moments read_in_chunks(int64_t n, int64_t chunks, ReadChunk&& read) {
  if (chunks <= 1) return read(int64_t{0}, int64_t{0}, n);
  std::vector<Moments> partial(static_cast<std::size_t>(chunks));
  const int64_t per = (n + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t lo = c * per;
      const int64_t hi = std::min(n, lo + per);
      if (lo < hi) partial[static_cast<std::size_t>(c)] = read(c, lo, hi);
    }
  });
  Moments total;
  for (const auto& part : partial) total.merge(part);  // fixed order: deterministic
  return total;
}

template <typename T>
Moments accumulate_parallel(const T* p, int64_t n, bool signs = true) {
  return read_in_chunks(n, parallel_chunks(n),
                        [&](int64_t, int64_t lo, int64_t hi) { return accumulate_any(p + lo, hi - lo, signs); });
}

/// Throws torchdbg::Error naming the dtype when torchdbg cannot read it.
inline void check_supported_dtype(c10::ScalarType st) {
  switch (st) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
    case at::kBool:
      return;
    default:
      throw Error(std::string("torchdbg: unsupported dtype ") + c10::toString(st) +
                  " (supported: floating, integer and bool tensors)");
  }
}

/// Throws torchdbg::Error naming the dtype or the layout when torchdbg cannot read `t`:
/// strided and sparse COO tensors of the dtypes check_supported_dtype accepts are read; an
/// MKL-DNN or compressed sparse (CSR, CSC, BSR, BSC) tensor is named with the conversion that
/// makes it readable.
inline void check_readable(const at::Tensor& t) {
  check_supported_dtype(t.scalar_type());
  const auto layout = t.layout();
  if (layout == at::kStrided || layout == at::kSparse) return;
  throw Error("torchdbg: cannot read a tensor of layout " + c10::str(layout) +
              " (strided and sparse COO tensors are read: convert it with " +
              (layout == at::kMkldnn ? ".to_dense()" : ".to_sparse() or .to_dense()") + ")");
}

/// Calls f(static_cast<const T*>(nullptr)) with T the element type of `st`.
template <typename F>
decltype(auto) dispatch_dtype(c10::ScalarType st, F&& f) {
  check_supported_dtype(st);
  switch (st) {
    case at::kFloat:
      return f(static_cast<const float*>(nullptr));
    case at::kDouble:
      return f(static_cast<const double*>(nullptr));
    case at::kHalf:
      return f(static_cast<const c10::Half*>(nullptr));
    case at::kBFloat16:
      return f(static_cast<const c10::BFloat16*>(nullptr));
    case at::kByte:
      return f(static_cast<const uint8_t*>(nullptr));
    case at::kChar:
      return f(static_cast<const int8_t*>(nullptr));
    case at::kShort:
      return f(static_cast<const int16_t*>(nullptr));
    case at::kInt:
      return f(static_cast<const int32_t*>(nullptr));
    case at::kLong:
      return f(static_cast<const int64_t*>(nullptr));
    default:  // kBool: one byte, 0 or 1
      return f(static_cast<const uint8_t*>(nullptr));
  }
}

/// Number of packed values `pack_moments` produces: Moments's count, finite, nan, pos_inf,
/// neg_inf, zeros, negatives, positives, mean, m2, min, max, abs_sum, abs_max and scale.
constexpr int64_t kPackedMoments = 15;

/// The moments of a tensor on any device, reduced on that device and packed into a float64
/// vector of kPackedMoments values (still on the device: no host sync here).
inline at::Tensor pack_moments(const at::Tensor& t);

/// A tensor with its expanded dimensions removed: `base` holds each distinct element of `t`
/// once and every one stands `repeats` times in `t`.
struct Repeated {
  at::Tensor base;
  int64_t repeats = 1;
};

/// `t` with every dimension of stride 0 and size > 1 (an expanded one: `x.expand(...)`, a
/// broadcast) narrowed to size 1, except dimension `keep` (-1: none). Statistics of the
/// result, with counts and sums multiplied by `repeats`, are those of `t`, at the cost of the
/// result's size instead of `t`'s logical size. A negative view (`_neg_view()`, the imaginary
/// part of a conjugate) is resolved: its memory holds the values' negatives.
inline Repeated collapse_repeats(const at::Tensor& t, int64_t keep = -1) {
  Repeated r{t, 1};
  if (t.is_sparse()) return r;  // no strides: read through its values
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d == keep || t.stride(d) != 0 || t.size(d) <= 1) continue;
    r.repeats *= t.size(d);
    r.base = r.base.narrow(d, 0, 1);
  }
  if (r.base.is_neg()) r.base = r.base.resolve_neg();
  return r;
}

/// Moments of `repeats` copies of the data `m` summarises.
inline Moments repeated(Moments m, int64_t repeats) {
  if (repeats == 1) return m;
  for (int64_t* c : {&m.count, &m.finite, &m.nan, &m.pos_inf, &m.neg_inf, &m.zeros, &m.negatives, &m.positives})
    *c *= repeats;
  m.m2 *= static_cast<double>(repeats);  // scaled data stays below 2^800 + 63 bits
  m.abs_sum *= static_cast<double>(repeats);
  return m;
}

/// Elements a reader copies at most at once from a CPU tensor whose elements overlap in
/// memory (or that has no storage: autograd's efficient zeros), so reading it costs a fixed
/// amount of memory instead of its logical size.
constexpr int64_t kReadChunk = int64_t{1} << 20;

/// Whether `t` (on the CPU) is read in pieces: it is larger than kReadChunk and a contiguous
/// copy could be larger than its storage.
inline bool read_in_pieces(const at::Tensor& t) {
  if (t.numel() <= kReadChunk) return false;
  if (t._is_zerotensor()) return true;
  return !t.is_contiguous() && !t.is_non_overlapping_and_dense();
}

inline at::Tensor readable(const at::Tensor& t);

/// Calls `f(piece)` for consecutive contiguous pieces of the CPU tensor `t` that together
/// hold its elements in row-major order: one piece (read in place when contiguous) unless
/// `read_in_pieces(t)`, then pieces of at most kReadChunk elements.
template <typename F>
void for_each_piece(const at::Tensor& t, F&& f) {
  if (!read_in_pieces(t)) {
    f(readable(t));
    return;
  }
  if (t._is_zerotensor()) {
    const int64_t n = t.numel();
    const at::Tensor zeros = at::zeros({std::min(n, kReadChunk)}, t.options());
    for (int64_t off = 0; off < n; off += kReadChunk) f(zeros.narrow(0, 0, std::min(kReadChunk, n - off)));
    return;
  }
  // Rows of the first dimension, as many as fit a piece; a row larger than a piece is split
  // the same way along its own first dimension.
  const auto split = [&](const auto& self, const at::Tensor& x) -> void {
    if (x.numel() <= kReadChunk) {
      f(x.contiguous());
      return;
    }
    const int64_t rows = x.size(0), inner = x.numel() / rows;
    if (inner > kReadChunk) {
      for (int64_t i = 0; i < rows; ++i) self(self, x.select(0, i));
      return;
    }
    const int64_t per = kReadChunk / inner;
    for (int64_t i = 0; i < rows; i += per) f(x.narrow(0, i, std::min(per, rows - i)).contiguous());
  };
  split(split, t);
}

/// Calls `f(v)` with every element of the CPU tensor `t` as a double, in row-major order,
/// reading it piece by piece (for_each_piece).
template <typename F>
void for_each_value(const at::Tensor& t, F&& f) {
  for_each_piece(t, [&](const at::Tensor& c) {
    dispatch_dtype(c.scalar_type(), [&](auto tag) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
      const T* p = static_cast<const T*>(c.data_ptr());
      for (int64_t i = 0; i < c.numel(); ++i) f(as_double(p[i]));
      return 0;
    });
  });
}

/// The kPackedMoments columns of float64 data `x` (1-D, on any device) cut into segments:
/// one row per segment. `red` reduces float64 vectors laid out as `x`: `red.sum(v)`,
/// `red.min(v)`, `red.max(v)` give one value per segment; `red.counts(flags)` the number of
/// true elements of each bool vector per segment ([flags, segments], float64);
/// `red.spread(r)` repeats each segment's value over its elements; `red.count()` is each
/// segment's element count (float64). Every reduction of a delivery's moments on a device
/// goes through here, whole tensors and batches alike.
template <typename Reduce>
at::Tensor moments_rows(const at::Tensor& x, const Reduce& red) {
  const auto dopt = x.options();
  const at::Tensor finite = at::isfinite(x);
  const at::Tensor inf = at::full({}, kInf, dopt), zero = at::zeros({}, dopt), one = at::ones({}, dopt);
  const at::Tensor xf = at::where(finite, x, zero);
  const at::Tensor counts =
      red.counts({finite, at::isnan(x), at::isposinf(x), at::isneginf(x), x == 0, xf < 0, xf > 0});
  const at::Tensor lo = red.min(at::where(finite, x, inf)), hi = red.max(at::where(finite, x, -inf));
  at::Tensor abs_sum, abs_max;
  {
    const at::Tensor a = xf.abs();
    abs_sum = red.sum(a);
    abs_max = red.max(a);
  }
  // Mean and squared deviations of the finite values in units of 2^s, s = Moments::scale_for
  // of the largest magnitude (0 unless the squares of float64 values would overflow or
  // underflow: m2 comes in units of 4^s, as Moments::m2), shifted by their minimum and scaled
  // by a power of two near their range (all exact): a constant segment has no deviation at
  // all, and neither the sums nor the squares overflow or underflow from the values'
  // magnitude alone.
  const at::Tensor e = std::get<1>(at::frexp(abs_max)).to(at::kDouble) - 1.0;  // ilogb; 0 gives -1
  const at::Tensor s = at::where(e > 400.0, e - 400.0, at::where(e < -400.0, e + 400.0, zero));
  const at::Tensor unit = at::exp2(-s);  // 1 for s = 0: the same results as without units
  const at::Tensor shift = at::where(at::isfinite(lo), lo * unit, zero);
  const at::Tensor d = at::addcmul(-red.spread(shift), xf, red.spread(unit)) * finite;
  const at::Tensor range = red.max(d);
  const at::Tensor scale = at::exp2(at::floor(at::log2(at::where(range > 0, range, one))));
  const at::Tensor ds = d / red.spread(scale);
  const at::Tensor mean_s = red.sum(ds) / at::clamp_min(counts[0], 1.0);
  const at::Tensor dev = (ds - red.spread(mean_s)) * finite;
  const at::Tensor m2 = red.sum(dev * dev) * scale * scale;
  return at::stack({red.count(), counts[0], counts[1], counts[2], counts[3], counts[4], counts[5], counts[6],
                    (shift + mean_s * scale) / unit, m2, lo, hi, abs_sum, abs_max, s},
                   1);
}

/// moments_rows's reductions over a whole vector: one segment.
struct WholeReduce {
  at::Tensor count_;  // [1]: the vector's length
  at::Tensor sum(const at::Tensor& v) const { return v.sum().view({1}); }
  at::Tensor min(const at::Tensor& v) const { return v.min().view({1}); }
  at::Tensor max(const at::Tensor& v) const { return v.max().view({1}); }
  at::Tensor counts(const std::vector<at::Tensor>& flags) const {
    std::vector<at::Tensor> c;
    for (const at::Tensor& f : flags) c.push_back(f.sum(at::kDouble).view({1}));  // no float64 copy
    return at::stack(c);
  }
  at::Tensor spread(const at::Tensor& r) const { return r; }  // [1] broadcasts
  at::Tensor count() const { return count_; }
};

/// moments_rows's reductions over consecutive segments of the given lengths (all > 0, at
/// most 2^24 each).
struct SegmentReduce {
  int64_t n;
  at::Tensor lengths;  // int64 [segments], on the data's device
  at::Tensor segment(const at::Tensor& v, const char* how, const at::Tensor& lens) const {
    // unsafe: the lengths are ours and sum to the data's length (the checks would sync)
    return at::segment_reduce(v, how, lens, {}, {}, 0, /*unsafe=*/true);
  }
  at::Tensor sum(const at::Tensor& v) const { return segment(v, "sum", lengths); }
  at::Tensor min(const at::Tensor& v) const { return segment(v, "min", lengths); }
  at::Tensor max(const at::Tensor& v) const { return segment(v, "max", lengths); }
  at::Tensor counts(const std::vector<at::Tensor>& flags) const {
    // The flags end to end, one reduction; float32 counts up to 2^24 exactly.
    const auto k = static_cast<int64_t>(flags.size());
    return segment(at::cat(flags).to(at::kFloat), "sum", lengths.repeat({k})).view({k, -1}).to(at::kDouble);
  }
  at::Tensor spread(const at::Tensor& r) const { return at::repeat_interleave(r, lengths, 0, n); }
  at::Tensor count() const { return lengths.to(at::kDouble); }
};

inline at::Tensor pack_moments(const at::Tensor& t) {
  check_readable(t);
  const auto dopt = t.options().dtype(at::kDouble);
  const Repeated r = collapse_repeats(t);
  if (r.repeats > 1) {  // counts and sums scale with the copies; mean and extrema do not
    const double k = static_cast<double>(r.repeats);
    const at::Tensor scale = at::tensor(std::vector<double>{k, k, k, k, k, k, k, k, 1, k, 1, 1, k, 1, 1},
                                        at::TensorOptions().dtype(at::kDouble));
    return pack_moments(r.base) * scale.to(t.device());
  }
  if (t.numel() == 0) {
    auto out = at::zeros({kPackedMoments}, dopt);
    out[10] = kInf;
    out[11] = -kInf;
    return out;
  }
  const at::Tensor x = t.to(at::kDouble).reshape({-1});
  const WholeReduce whole{at::full({1}, static_cast<double>(x.numel()), dopt)};
  return moments_rows(x, whole).view({kPackedMoments});
}

/// Moments of many tensors reduced together on their device: `add` copies a tensor (one
/// kernel) and `reduce` computes every added tensor's row with a fixed number of kernels,
/// however many were added. For tensors of up to kMaxElements elements; not thread-safe.
class MomentsBatch {
 public:
  /// Largest tensor added: a segment is reduced by one block of threads on a GPU.
  static constexpr int64_t kMaxElements = int64_t{1} << 20;
  /// Elements held before the rows so far are reduced: bounds the copies' memory (32 MiB)
  /// and a reduction's temporaries (about 8 times that).
  static constexpr int64_t kMaxHeld = int64_t{1} << 22;

  /// Whether `t` (dense, non-empty, at most kMaxElements elements, on the CPU or a CUDA
  /// device: the backends with segment reductions) can be added.
  static bool accepts(const at::Tensor& t) {
    return !t.is_sparse() && t.numel() > 0 && t.numel() <= kMaxElements &&
           (t.device().is_cpu() || t.device().is_cuda());
  }
  /// Copies `t` (accepts(t)) and returns its row. When it throws, the batch is as it was.
  int64_t add(const at::Tensor& t) {
    check_readable(t);
    if (elements_ + t.numel() > kMaxHeld) reduce_held();
    at::Tensor copy = at::empty({t.numel()}, t.options().dtype(at::kDouble));
    copy.view(t.sizes()).copy_(t);
    if (lengths_.size() == lengths_.capacity()) lengths_.reserve(2 * lengths_.size() + 16);
    held_.push_back(std::move(copy));  // lengths_ has room: nothing below throws
    lengths_.push_back(t.numel());
    elements_ += t.numel();
    return rows_++;
  }
  [[nodiscard]] int64_t rows() const { return rows_; }
  /// Every added tensor's kPackedMoments doubles, row by row, in the order added: [rows, 15]
  /// on the tensors' device (no host sync). Empties the batch; needs rows() > 0.
  at::Tensor reduce() {
    reduce_held();
    at::Tensor out = done_.size() == 1 ? done_[0] : at::cat(done_);
    done_.clear();
    rows_ = 0;
    return out;
  }

 private:
  void reduce_held() {
    if (held_.empty()) return;
    const at::Tensor x = held_.size() == 1 ? held_[0] : at::cat(held_);
    const at::Tensor lens = at::tensor(lengths_, at::TensorOptions().dtype(at::kLong))
                                .to(x.device(), /*non_blocking=*/true);
    at::Tensor rows = moments_rows(x, SegmentReduce{x.numel(), lens});
    done_.push_back(std::move(rows));  // from here on nothing throws
    held_.clear();
    lengths_.clear();
    elements_ = 0;
  }
  std::vector<at::Tensor> held_;  // float64 copies not yet reduced
  std::vector<int64_t> lengths_;
  int64_t elements_ = 0;
  std::vector<at::Tensor> done_;  // reduced rows
  int64_t rows_ = 0;
};

/// Inverse of pack_moments for kPackedMoments host doubles (one row of a packed batch).
inline Moments unpack_moments(const double* v) {
  Moments m;
  m.count = static_cast<int64_t>(v[0]);
  m.finite = static_cast<int64_t>(v[1]);
  m.nan = static_cast<int64_t>(v[2]);
  m.pos_inf = static_cast<int64_t>(v[3]);
  m.neg_inf = static_cast<int64_t>(v[4]);
  m.zeros = static_cast<int64_t>(v[5]);
  m.negatives = static_cast<int64_t>(v[6]);
  m.positives = static_cast<int64_t>(v[7]);
  m.mean = m.finite > 0 ? v[8] : 0.0;
  m.m2 = v[9];
  m.min = v[10];
  m.max = v[11];
  m.abs_sum = v[12];
  m.abs_max = v[13];
  m.scale = static_cast<int>(v[14]);
  return m;
}

/// Inverse of pack_moments for a host copy of the packed vector.
inline Moments unpack_moments(const at::Tensor& packed_cpu) {
  const at::Tensor c = packed_cpu.to(at::kDouble).contiguous();
  return unpack_moments(c.data_ptr<double>());
}

/// `t` (a CPU tensor) as a contiguous tensor whose data can be read: an efficient zero tensor
/// (autograd's storage-less zeros) becomes real zeros.
inline at::Tensor readable(const at::Tensor& t) {
  if (t._is_zerotensor()) return at::zeros(t.sizes(), t.options());
  at::Tensor c = t.contiguous();
  if (c.numel() > 0 && c.data_ptr() == nullptr)
    throw Error("torchdbg: cannot read a tensor of " + std::to_string(c.numel()) + " elements without data");
  return c;
}

/// Whether compute_moments reads the CPU tensor `t` through its strides into a block buffer
/// instead of a contiguous copy: float32, half or bfloat16 data that is not contiguous and
/// small enough to be read by one thread (accumulate_parallel's single chunk), so the blocks
/// are the copy's blocks in the same order and the result is the copy's, bit for bit.
inline bool gather_moments(const at::Tensor& t) {
  const auto st = t.scalar_type();
  return (st == at::kFloat || st == at::kHalf || st == at::kBFloat16) && t.numel() > 0 &&
         t.numel() < 2 * kParallelGrain && t.dim() >= 1 && !t.is_contiguous() && !t._is_zerotensor();
}

/// Moments of a strided CPU tensor (gather_moments): its elements in row-major order,
/// kFloatBlock at a time, widened to float in a buffer on the stack; no allocation, no
/// operator call (a row of a batch-first sequence, `x.select(1, t)`, costs its elements only).
template <typename T>
Moments accumulate_gathered(const at::Tensor& t, bool signs) {
  const T* base = static_cast<const T*>(t.data_ptr());
  if (base == nullptr)
    throw Error("torchdbg: cannot read a tensor of " + std::to_string(t.numel()) + " elements without data");
  const int64_t nd = t.dim();
  const int64_t inner = t.size(nd - 1), step = t.stride(nd - 1);
  const int64_t rows = t.numel() / inner;
  c10::SmallVector<int64_t, 8> index(static_cast<std::size_t>(nd), 0);
  float buf[kFloatBlock];
  int64_t fill = 0, offset = 0;
  Moments total;
  bool non_negative = false;
  for (int64_t row = 0; row < rows; ++row) {
    const T* src = base + offset;
    for (int64_t j = 0; j < inner;) {
      const int64_t take = std::min(inner - j, kFloatBlock - fill);
      if constexpr (std::is_same_v<T, float>) {
        if (step == 1) {
          std::memcpy(buf + fill, src + j, static_cast<std::size_t>(take) * sizeof(float));
        } else {
          for (int64_t k = 0; k < take; ++k) buf[fill + k] = src[(j + k) * step];
        }
      } else {
        for (int64_t k = 0; k < take; ++k) buf[fill + k] = static_cast<float>(src[(j + k) * step]);
      }
      fill += take;
      j += take;
      if (fill == kFloatBlock) {
        total.merge(float_block_moments(buf, fill, signs, non_negative));
        fill = 0;
      }
    }
    for (int64_t d = nd - 2; d >= 0; --d) {  // the next row's offset
      const auto u = static_cast<std::size_t>(d);
      offset += t.stride(d);
      if (++index[u] < t.size(d)) break;
      offset -= t.stride(d) * t.size(d);
      index[u] = 0;
    }
  }
  if (fill > 0) total.merge(float_block_moments(buf, fill, signs, non_negative));
  return total;
}

/// The one-pass summary of any tensor. CPU tensors are read in place (a small strided float,
/// half or bfloat16 tensor through its strides, another strided one made contiguous first, an
/// overlapping one piece by piece); other devices reduce on the device and copy
/// kPackedMoments doubles back. Expanded dimensions are read once (collapse_repeats).
/// `signs` false: the zero/negative/positive counts and the absolute sum may be skipped
/// (float32, half and bfloat16 CPU data without NaN/Inf: about twice as fast);
/// Moments::signs says whether they are there.
inline Moments compute_moments(const at::Tensor& t, bool signs = true) {
  if (!t.defined()) throw Error("torchdbg: cannot compute statistics of an undefined tensor");
  check_readable(t);
  if (t.is_meta()) throw Error("torchdbg: cannot compute statistics of a meta tensor (it has no data)");
  if (t.is_sparse()) {  // the stored values (duplicates summed) and the implicit zeros
    const at::Tensor c = t.coalesce();
    Moments m = compute_moments(c._values(), signs);
    const int64_t implicit = t.numel() - c._values().numel();
    if (implicit > 0) {
      Moments z;
      z.count = z.finite = z.zeros = implicit;
      z.mean = z.m2 = z.min = z.max = z.abs_sum = z.abs_max = 0.0;
      m.merge(z);
    }
    return m;
  }
  if (!t.device().is_cpu()) return unpack_moments(pack_moments(t).to(at::kCPU));
  const Repeated r = collapse_repeats(t);
  if (gather_moments(r.base)) {
    const Moments g = r.base.scalar_type() == at::kFloat ? accumulate_gathered<float>(r.base, signs)
                      : r.base.scalar_type() == at::kHalf ? accumulate_gathered<c10::Half>(r.base, signs)
                                                           : accumulate_gathered<c10::BFloat16>(r.base, signs);
    return repeated(g, r.repeats);
  }
  Moments m;  // merging into the empty summary gives the first piece's own
  for_each_piece(r.base, [&](const at::Tensor& c) {
    m.merge(dispatch_dtype(c.scalar_type(), [&](auto tag) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
      return accumulate_parallel(static_cast<const T*>(c.data_ptr()), c.numel(), signs);
    }));
  });
  return repeated(m, r.repeats);
}

/// compute_moments, estimated from a sample (sample_float) for a contiguous float32 CPU
/// tensor of more than `above` values when `stride` > 1; `info.values` is 0 when every value
/// was read (another tensor, a NaN/Inf, too few blocks).
inline Moments compute_moments(const at::Tensor& t, bool signs, int64_t stride, int64_t above,
                               SampleInfo& info) {
  info = SampleInfo{};
  // With several threads the full kernel splits a large tensor between them: no sample then.
  const bool split = t.defined() && t.numel() >= 2 * kParallelGrain && at::get_num_threads() > 1 &&
                     !at::in_parallel_region();
  if (stride > 1 && !split && t.defined() && t.numel() > above && t.scalar_type() == at::kFloat &&
      t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && !t._is_zerotensor() &&
      !t.is_neg() && t.data_ptr() != nullptr) {
    const uint64_t seed = mix64(sample_counter().fetch_add(1, std::memory_order_relaxed));
    Moments m;
    if (sample_float(static_cast<const float*>(t.data_ptr()), t.numel(), signs, stride, seed, m, info))
      return m;
  }
  return compute_moments(t, signs);
}

/// The smallest float at or above `v`: for a float x, `x < float_at_or_above(v)` is exactly
/// `x < v` (a bound rounded to the nearest float could count a value on the wrong side).
inline float float_at_or_above(double v) noexcept {
  constexpr float kMax = std::numeric_limits<float>::max();
  if (!(v <= kMax)) return v > kMax ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  if (v < -kMax) return -kMax;
  float f = static_cast<float>(v);
  if (static_cast<double>(f) < v) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
}
/// The largest float at or below `v`: for a float x, `x > float_at_or_below(v)` is `x > v`.
inline float float_at_or_below(double v) noexcept {
  constexpr float kMax = std::numeric_limits<float>::max();
  if (!(v >= -kMax)) return v < -kMax ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  if (v > kMax) return kMax;
  float f = static_cast<float>(v);
  if (static_cast<double>(f) > v) f = std::nextafter(f, -std::numeric_limits<float>::infinity());
  return f;
}

/// count_outside reduced with tensor operators where `t` lives: a 1-element float64 tensor
/// on t's device (no host sync).
inline at::Tensor count_outside_on_device(const at::Tensor& t, double lo, double hi) {
  check_readable(t);
  const at::Tensor x = t.detach().to(at::kDouble);
  return (x < lo).logical_or(x > hi).sum().to(at::kDouble).reshape({1});
}

/// Elements of `t` below `lo` or above `hi` (NaN is neither): one pass, no allocation for
/// CPU tensors; other devices count on the device and copy one number back.
inline int64_t count_outside(const at::Tensor& t, double lo, double hi) {
  if (!t.defined()) throw Error("torchdbg: cannot count values of an undefined tensor");
  check_readable(t);
  if (t.numel() == 0) return 0;
  if (t.is_sparse()) {  // the stored values, and the implicit zeros when 0 is outside
    const at::Tensor c = t.coalesce();
    const int64_t implicit = t.numel() - c._values().numel();
    return count_outside(c._values(), lo, hi) + ((0.0 < lo || 0.0 > hi) ? implicit : 0);
  }
  const Repeated r = collapse_repeats(t);
  if (!t.device().is_cpu()) {
    return r.repeats * static_cast<int64_t>(count_outside_on_device(r.base, lo, hi).to(at::kCPU).item<double>());
  }
  int64_t count = 0;
  for_each_piece(r.base, [&](const at::Tensor& c) {
    dispatch_dtype(c.scalar_type(), [&](auto tag) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
      const T* p = static_cast<const T*>(c.data_ptr());
      const int64_t n = c.numel();
      if constexpr (std::is_same_v<T, float>) {
        const float flo = float_at_or_above(lo), fhi = float_at_or_below(hi);
        for (int64_t i = 0; i < n; ++i) count += (p[i] < flo) | (p[i] > fhi);
      } else {
        for (int64_t i = 0; i < n; ++i) {
          const double v = as_double(p[i]);
          count += (v < lo) | (v > hi);
        }
      }
      return 0;
    });
  });
  return r.repeats * count;
}

/// `dim` of a tensor of `t`'s rank made non-negative; throws torchdbg::Error naming it when
/// it does not exist.
inline int64_t unit_dim_of(const at::Tensor& t, int64_t dim) {
  if (t.dim() == 0)
    throw Error("torchdbg: a 0-d tensor has no unit dimension (dimension " + std::to_string(dim) + " asked)");
  const int64_t d = dim < 0 ? dim + t.dim() : dim;
  if (d < 0 || d >= t.dim())
    throw Error("torchdbg: unit dimension " + std::to_string(dim) + " out of range for a " +
                std::to_string(t.dim()) + "-d tensor");
  return d;
}

/// count_above_per_unit reduced with tensor operators where `t` lives: t.size(dim) float64
/// counts on t's device (no host sync).
inline at::Tensor count_above_per_unit_on_device(const at::Tensor& t, int64_t dim, double threshold) {
  check_readable(t);
  const int64_t d = unit_dim_of(t, dim);
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < t.dim(); ++i)
    if (i != d) dims.push_back(i);
  const at::Tensor above = t.detach().to(at::kDouble) > threshold;
  return (dims.empty() ? above : above.sum(dims)).to(at::kDouble);
}

/// For each index along `dim` (a unit: a feature or channel), how many elements of `t` are
/// above `threshold`; `per_unit` receives the number of elements each unit has (the samples).
inline std::vector<int64_t> count_above_per_unit(const at::Tensor& t, int64_t dim, double threshold,
                                                 int64_t& per_unit) {
  if (!t.defined()) throw Error("torchdbg: cannot count values of an undefined tensor");
  check_readable(t);
  if (t.is_meta()) throw Error("torchdbg: cannot count values of a meta tensor (it has no data)");
  if (t.is_sparse())
    throw Error("torchdbg: per-unit counts of a sparse tensor are not computed; pass t.to_dense()");
  const int64_t d = unit_dim_of(t, dim);
  const int64_t units = t.size(d);
  per_unit = units == 0 ? 0 : t.numel() / units;
  std::vector<int64_t> out(static_cast<std::size_t>(units), 0);
  if (t.numel() == 0) return out;
  // Expanded dimensions other than the unit one are counted once and multiplied; an expanded
  // unit dimension means every unit holds the same values: one is counted, and copied.
  Repeated r = collapse_repeats(t, d);
  const bool same_units = r.base.size(d) > 1 && r.base.stride(d) == 0;
  if (same_units) r.base = r.base.narrow(d, 0, 1);
  const auto finish = [&] {
    for (auto& k : out) k *= r.repeats;
    if (same_units) std::fill(out.begin(), out.end(), out[0]);
    return out;
  };
  if (!t.device().is_cpu()) {
    const at::Tensor counts = count_above_per_unit_on_device(r.base, d, threshold).to(at::kCPU).contiguous();
    for (int64_t u = 0; u < counts.numel(); ++u)
      out[static_cast<std::size_t>(u)] = static_cast<int64_t>(counts.data_ptr<double>()[u]);
    return finish();
  }
  if (read_in_pieces(r.base)) {  // overlapping: unit by unit, each read in pieces
    for (int64_t u = 0; u < r.base.size(d); ++u) {
      int64_t& k = out[static_cast<std::size_t>(u)];
      for_each_value(r.base.select(d, u), [&](double v) { k += v > threshold; });
    }
    return finish();
  }
  const at::Tensor c = readable(r.base);
  const int64_t cu = c.size(d);  // 1 when every unit is the same
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < d; ++i) outer *= c.size(i);
  for (int64_t i = d + 1; i < c.dim(); ++i) inner *= c.size(i);
  dispatch_dtype(c.scalar_type(), [&](auto tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    const T* p = static_cast<const T*>(c.data_ptr());
    if (inner == 1) {  // [N, F]: rows of units; a branch-free pass per row vectorizes
      std::vector<int32_t> row_counts(static_cast<std::size_t>(cu), 0);
#if defined(TORCHDBG_HAVE_VECTOR_EXT)
      if constexpr (std::is_same_v<T, float>) {
        const float ft = float_at_or_below(threshold);
        const auto& k = block_kernels();
        for (int64_t o = 0; o < outer; o += int64_t{1} << 30) {  // int32 counters
          const int64_t rows = std::min(outer - o, int64_t{1} << 30);
          k.rows_above(p + o * cu, rows, cu, ft, row_counts.data());
          for (int64_t u = 0; u < cu; ++u)
            out[static_cast<std::size_t>(u)] += row_counts[static_cast<std::size_t>(u)];
          std::fill(row_counts.begin(), row_counts.end(), 0);
        }
        return 0;
      }
#endif
      int64_t rows_in_batch = 0;
      for (int64_t o = 0; o < outer; ++o) {
        const T* row = p + o * cu;
        if constexpr (std::is_same_v<T, float>) {
          const float ft = float_at_or_below(threshold);
          for (int64_t u = 0; u < cu; ++u)
            row_counts[static_cast<std::size_t>(u)] += row[u] > ft;
        } else {
          for (int64_t u = 0; u < cu; ++u)
            row_counts[static_cast<std::size_t>(u)] += as_double(row[u]) > threshold;
        }
        if (++rows_in_batch == (int64_t{1} << 30)) {  // int32 counters: spill before overflow
          for (int64_t u = 0; u < cu; ++u)
            out[static_cast<std::size_t>(u)] += row_counts[static_cast<std::size_t>(u)];
          std::fill(row_counts.begin(), row_counts.end(), 0);
          rows_in_batch = 0;
        }
      }
      for (int64_t u = 0; u < cu; ++u)
        out[static_cast<std::size_t>(u)] += row_counts[static_cast<std::size_t>(u)];
      return 0;
    }
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t u = 0; u < cu; ++u) {
        const T* q = p + (o * cu + u) * inner;
        int64_t k = 0;
        if constexpr (std::is_same_v<T, float>) {
          const float ft = float_at_or_below(threshold);
#if defined(TORCHDBG_HAVE_VECTOR_EXT)
          k = block_kernels().count_above(q, inner, ft);  // [N, C, H, W]: a channel's plane
#else
          for (int64_t i = 0; i < inner; ++i) k += q[i] > ft;
#endif
        } else {
          for (int64_t i = 0; i < inner; ++i) k += as_double(q[i]) > threshold;
        }
        out[static_cast<std::size_t>(u)] += k;
      }
    }
    return 0;
  });
  return finish();
}

/// Units (along `dim`) whose values lie in runs shorter than this are counted apart from the
/// statistics: a call per run would cost more than the second read it saves.
constexpr int64_t kFusedUnitRun = 64;
/// Tensors of fewer values are counted apart too: one that fits the caches is read again from
/// them about as fast as the calls per run cost (0.9x to 1.04x below 1 MiB, 1.2x to 1.4x from
/// 2 MiB on, on the 2-core Intel Xeon VM).
constexpr int64_t kFusedUnitsFrom = int64_t{1} << 18;

/// Whether compute_moments_with_units reads `t` in one pass: a contiguous float32 CPU tensor
/// of kFusedUnitsFrom values or more, each unit's values along `dim` in runs of at least
/// kFusedUnitRun ([N, C, H, W] with H * W >= 64).
inline bool units_fusable(const at::Tensor& t, int64_t dim) {
  if (!t.defined() || !t.device().is_cpu() || t.scalar_type() != at::kFloat || t.layout() != at::kStrided ||
      !t.is_contiguous() || t.is_neg() || t._is_zerotensor() || t.numel() == 0 || t.data_ptr() == nullptr)
    return false;
  const int64_t d = unit_dim_of(t, dim);
  int64_t inner = 1;
  for (int64_t i = d + 1; i < t.dim(); ++i) inner *= t.size(i);
  return inner >= kFusedUnitRun && t.numel() >= kFusedUnitsFrom;
}

/// compute_moments(t, signs) of a tensor units_fusable(t, dim) accepts, and in the same pass,
/// per index along `dim`, how many values are above 0 (`counts`, resized to t.size(dim)): the
/// count_above_per_unit(t, dim, 0.0) of each block taken right after its statistics, while it
/// is in the first-level cache, so data that comes from memory comes once. The blocks and the
/// chunks the intra-op threads read are compute_moments' own: the moments are the same, bit
/// for bit; each chunk counts into counts of its own, added up after.
inline Moments compute_moments_with_units(const at::Tensor& t, bool signs, int64_t dim,
                                          std::vector<int64_t>& counts) {
  if (!units_fusable(t, dim))
    throw Error("torchdbg: compute_moments_with_units needs a contiguous float32 CPU tensor with runs of " +
                std::to_string(kFusedUnitRun) + " values per unit");
  const int64_t d = unit_dim_of(t, dim);
  const int64_t units = t.size(d);
  int64_t inner = 1;
  for (int64_t i = d + 1; i < t.dim(); ++i) inner *= t.size(i);
  const int64_t n = t.numel();
  const float* p = static_cast<const float*>(t.data_ptr());
  const auto width = static_cast<std::size_t>(units);
  const int64_t chunks = parallel_chunks(n);
  std::vector<int64_t> per_chunk(width * static_cast<std::size_t>(chunks), 0);
  const Moments m = read_in_chunks(n, chunks, [&](int64_t chunk, int64_t lo, int64_t hi) {
    int64_t* own = per_chunk.data() + static_cast<std::size_t>(chunk) * width;
    return accumulate_float(p + lo, hi - lo, signs, [&](int64_t b, int64_t len) {
      for (int64_t i = lo + b; i < lo + b + len;) {  // the block's runs, unit by unit
        const int64_t run = i / inner;
        const int64_t end = std::min((run + 1) * inner, lo + b + len);
#if defined(TORCHDBG_HAVE_VECTOR_EXT)
        const int64_t above = block_kernels().count_above(p + i, end - i, 0.0f);
#else
        int64_t above = 0;
        for (int64_t j = i; j < end; ++j) above += p[j] > 0.0f ? 1 : 0;
#endif
        own[run % units] += above;
        i = end;
      }
    });
  });
  counts.assign(width, 0);
  for (std::size_t c = 0; c < per_chunk.size(); ++c) counts[c % width] += per_chunk[c];
  return m;
}

/// The spread of `t` across its first dimension (the batch): the population standard
/// deviation of `t[b, ...] - mean_b t[:, ...]` over all elements, i.e. what is left of
/// `std(t)` once every position's mean over the batch is taken out. A bias, or any output
/// that is the same for every sample, has none. NaN when `t` has fewer than 2 dimensions,
/// fewer than 2 rows, or a NaN/Inf. CPU tensors are read once in place (sums per position
/// about the first row, in float64, 4096 positions at a time, again about each position's mean
/// where the first row lies far from it; an overlapping view is first copied whole); other
/// devices reduce there. float64 values of any finite magnitude: where their squares may have
/// overflowed or underflowed, their deviations from the first row are measured again scaled
/// by a power of two (exactly).
inline double batch_spread(const at::Tensor& t);

/// batch_spread without the scaling of float64 deviations.
inline double batch_spread_unscaled(const at::Tensor& t) {
  if (!t.defined()) throw Error("torchdbg: cannot compute the batch spread of an undefined tensor");
  check_readable(t);
  if (t.is_sparse() || t.is_meta() || t.dim() < 2 || t.size(0) < 2 || t.numel() == 0) return kNaN;
  if (t.stride(0) == 0) {  // every row is the same tensor: no spread, unless it holds NaN/Inf
    const Moments m = compute_moments(t.select(0, 0), /*signs=*/false);
    return m.finite == m.count ? 0.0 : kNaN;
  }
  const Repeated r = collapse_repeats(t, 0);  // a repeated position has the same spread
  if (!t.device().is_cpu()) {
    const at::Tensor x = r.base.detach().to(at::kDouble);
    return (x - x.mean(0, /*keepdim=*/true)).pow(2).mean().sqrt().to(at::kCPU).item<double>();
  }
  const at::Tensor c = readable(r.base);
  const int64_t rows = c.size(0), inner = c.numel() / rows;
  constexpr int64_t kChunk = 4096;
  // Per position of a chunk: the sums of its deviations and of their squares (set below:
  // never read before they are written).
  const std::size_t width = static_cast<std::size_t>(std::min(inner, kChunk));
  const std::unique_ptr<double[]> sums(new double[2 * width]);
  double* const s1 = sums.get();
  double* const s2 = s1 + width;
  std::unique_ptr<double[]> means;  // the chunk's per-position means, where it is read again
  std::unique_ptr<float[]> float_means;
  double within = 0.0;  // sum over positions of the squared deviations from their batch mean
  dispatch_dtype(c.scalar_type(), [&](auto tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    const T* p = static_cast<const T*>(c.data_ptr());
    for (int64_t lo = 0; lo < inner; lo += kChunk) {
      const int64_t n = std::min(kChunk, inner - lo);
      const T* first = p + lo;  // the shift: row 0's value at each position
#if defined(TORCHDBG_HAVE_VECTOR_EXT)
      constexpr bool vector_floats = std::is_same_v<T, float>;
#else
      constexpr bool vector_floats = false;
#endif
      // s1, s2 at each position: the sums of the deviations of rows [from, rows) from
      // `shift(i)` (`shift_floats` on the vector path) and of their squares.
      auto sum_about = [&](int64_t from, [[maybe_unused]] auto shift, [[maybe_unused]] const float* shift_floats) {
        if constexpr (vector_floats) {
#if defined(TORCHDBG_HAVE_VECTOR_EXT)
          // Rows in blocks: a pass over a block's rows at a few positions touches no more pages
          // than the TLB holds, however tall the tensor. The first block sets the sums.
          constexpr int64_t kRowBlock = 32;
          for (int64_t b = from; b < rows; b += kRowBlock)
            block_kernels().column_deviations(shift_floats, p + b * inner + lo, std::min(kRowBlock, rows - b),
                                              inner, n, /*fresh=*/b == from, s1, s2);
#endif
        } else {
          std::fill(s1, s1 + n, 0.0);
          std::fill(s2, s2 + n, 0.0);
          for (int64_t b = from; b < rows; ++b) {
            const T* q = p + b * inner + lo;
            for (int64_t i = 0; i < n; ++i) {
              const double d = as_double(q[i]) - shift(i);
              s1[i] += d;
              s2[i] += d * d;
            }
          }
        }
      };
      // Four running sums and no division: a loop bound by neither the adder's latency nor
      // the divider.
      const double inv_k = 1.0 / static_cast<double>(rows);
      // Where the first row lies far from a position's mean, s2 - s1^2 / rows cancels: a
      // position whose sum of squares is more than this many times its result has lost about
      // 1e-10 of it to rounding (sums of `rows` terms: about sqrt(rows) ulp), and the chunk is
      // summed again about its means.
      const double cancels = 9e5 / std::sqrt(static_cast<double>(rows));
      double part[4];
      auto reduce = [&] {  // the chunk's squared deviations from the means; whether it cancelled
        part[0] = part[1] = part[2] = part[3] = 0.0;
        bool cancelled = false;
        for (int64_t i = 0; i < n; ++i) {
          // a * inv_k first: a^2 / k is below s2, so it overflows only where s2 did (a^2 alone
          // can overflow while the spread is finite).
          const double a = s1[i];
          const double w = s2[i] - a * inv_k * a;
          cancelled |= w * cancels < s2[i];
          part[i & 3] += w < 0.0 ? 0.0 : w;  // rounding below 0 is none; NaN (from NaN/Inf) stays
        }
        return cancelled;
      };
      // Row 0 is the shift, so rows from 1 (rows >= 2).
      const float* first_floats = nullptr;
      if constexpr (vector_floats) first_floats = first;
      sum_about(1, [first](int64_t i) { return as_double(first[i]); }, first_floats);
      if (reduce()) {
        if (!means) means.reset(new double[width]);
        double* const m = means.get();
        for (int64_t i = 0; i < n; ++i) m[i] = as_double(first[i]) + s1[i] * inv_k;
        const float* mf = nullptr;
        if constexpr (vector_floats) {
          // The means rounded to float are a shift as good: the kernel again, every row.
          if (!float_means) float_means.reset(new float[width]);
          for (int64_t i = 0; i < n; ++i) float_means[i] = static_cast<float>(m[i]);
          mf = float_means.get();
        }
        sum_about(0, [m](int64_t i) { return m[i]; }, mf);
        (void)reduce();
      }
      within += (part[0] + part[1]) + (part[2] + part[3]);
    }
    return 0;
  });
  const double v = within / static_cast<double>(c.numel());
  return std::isfinite(v) ? std::sqrt(v) : kNaN;
}

/// `t * 2^k` for any k (2^k itself may not be a double).
inline at::Tensor times_power_of_two(const at::Tensor& t, int k) {
  at::Tensor out = t;
  for (; k > 1000; k -= 1000) out = out * std::ldexp(1.0, 1000);
  for (; k < -1000; k += 1000) out = out * std::ldexp(1.0, -1000);
  return out * std::ldexp(1.0, k);
}

inline double batch_spread(const at::Tensor& t) {
  const double v = batch_spread_unscaled(t);
  // float32 and narrower values cannot overflow or underflow float64 squares; float64 values
  // can where the result is NaN (or an overflow) or below about 1e-140.
  if (!(std::isnan(v) || v < 1e-140) || t.scalar_type() != at::kDouble || t.is_sparse() || t.is_meta() ||
      t.dim() < 2 || t.size(0) < 2 || t.numel() == 0 || t.stride(0) == 0)
    return v;
  // The deviations from the first row, scaled to at most 1.
  c10::NoGradGuard no_grad;
  const at::Tensor base = collapse_repeats(t, 0).base.detach();
  at::Tensor dev = base - base.narrow(0, 0, 1);
  double dmax = dev.abs().max().to(at::kCPU).item<double>();
  int halved = 0;
  if (std::isinf(dmax)) {  // finite values more than DBL_MAX apart (or an Inf, NaN below)
    dev = base * 0.5 - base.narrow(0, 0, 1) * 0.5;
    dmax = dev.abs().max().to(at::kCPU).item<double>();
    halved = 1;
  }
  if (!std::isfinite(dmax)) return kNaN;
  if (dmax == 0.0) return 0.0;
  int e = 0;
  std::frexp(dmax, &e);
  return std::ldexp(batch_spread_unscaled(times_power_of_two(dev, -e)), e + halved);
}

/// `collapse_repeats(t)` with its base on the CPU (copied from another device).
inline Repeated host_repeats(const at::Tensor& t) {
  Repeated r = collapse_repeats(t);
  if (!r.base.device().is_cpu()) r.base = r.base.to(at::kCPU);
  return r;
}

/// The finite values of a tensor as doubles, for the distribution primitives below (an
/// expanded tensor's values appear as often as they stand in it).
inline std::vector<double> finite_values(const at::Tensor& t) {
  if (t.is_sparse()) {  // the stored values (duplicates summed), then the implicit zeros
    const at::Tensor c = t.coalesce();
    std::vector<double> out = finite_values(c._values());
    out.resize(out.size() + static_cast<std::size_t>(t.numel() - c._values().numel()), 0.0);
    return out;
  }
  const Repeated r = host_repeats(t);
  std::vector<double> out;
  for_each_value(r.base, [&](double v) {
    if (std::isfinite(v)) out.push_back(v);
  });
  if (r.repeats > 1) {
    const std::size_t n = out.size();
    out.reserve(n * static_cast<std::size_t>(r.repeats));
    for (int64_t k = 1; k < r.repeats; ++k) out.insert(out.end(), out.begin(), out.begin() + static_cast<std::ptrdiff_t>(n));
  }
  return out;
}

/// The element of the CPU tensor `t` at row-major position `i`, read through its strides.
template <typename T>
T element_at(const at::Tensor& t, const T* base, int64_t i) {
  int64_t offset = 0;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    const int64_t size = t.size(d);
    offset += (i % size) * t.stride(d);
    i /= size;
  }
  return base[offset];
}

/// At most `cap` finite values of `t` as doubles: all of them when there are no more than
/// `cap` (`finite` is their count), else a uniform random sample of `cap` drawn with a fixed
/// seed (the same tensor gives the same sample).
inline std::vector<double> finite_sample(const at::Tensor& t, int64_t finite, int64_t cap) {
  if (finite <= cap) return finite_values(t);
  if (t.is_sparse()) {  // stored values and implicit zeros in their proportions
    const at::Tensor c = t.coalesce();
    const int64_t implicit = t.numel() - c._values().numel();
    const int64_t stored = finite - implicit;  // finite stored values
    const auto from_values = static_cast<int64_t>(
        std::llround(static_cast<double>(cap) * static_cast<double>(stored) / static_cast<double>(finite)));
    std::vector<double> out;
    if (from_values > 0) out = finite_sample(c._values(), stored, from_values);
    out.resize(out.size() + static_cast<std::size_t>(std::max<int64_t>(0, cap - from_values)), 0.0);
    return out;
  }
  // Each element of the collapsed base stands equally often in `t`: a uniform sample of the
  // base is one of `t`. An overlapping base is read through its strides, not copied.
  const Repeated r = host_repeats(t);
  if (r.base._is_zerotensor()) return std::vector<double>(static_cast<std::size_t>(cap), 0.0);
  const bool strided = read_in_pieces(r.base);
  const at::Tensor c = strided ? r.base : readable(r.base);
  return dispatch_dtype(c.scalar_type(), [&](auto tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    const T* p = static_cast<const T*>(c.data_ptr());
    const auto n = static_cast<uint64_t>(c.numel());
    std::vector<double> out;
    out.reserve(static_cast<std::size_t>(cap));
    uint64_t state = 0x9E3779B97F4A7C15ULL ^ n;  // splitmix64
    // Draws that land on NaN/Inf are retried, at most 64 draws per kept value in all.
    for (int64_t tries = 0; static_cast<int64_t>(out.size()) < cap && tries < 64 * cap; ++tries) {
      uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
      z ^= z >> 31;
      const auto i = static_cast<int64_t>(z % n);
      const double v = as_double(strided ? element_at(c, p, i) : p[i]);
      if (std::isfinite(v)) out.push_back(v);
    }
    return out;
  });
}

/// What one streaming pass over a tensor's finite values gives the distribution: histogram
/// counts over [lo, hi] (the last bin closed), central moments about `mean`, and the counts
/// outside [fence_lo, fence_hi] and farther than `sigma3` from `mean`.
/// Equal-width bins over [lo, hi] (hi > lo), reckoned in units of 2^unit, the magnitude of the
/// larger end: hi - lo and v - lo never overflow, however far apart the ends (float64 data near
/// +-DBL_MAX). Where unscaled arithmetic does not overflow the bins and edges are its own (a
/// power-of-two scale is exact).
struct HistogramBins {
  HistogramBins(int64_t bins, double lo, double hi)
      : bins_(bins), unit_(std::ilogb(std::max(std::fabs(lo), std::fabs(hi)))), hi_(hi),
        lo_(std::ldexp(lo, -unit_)), width_(std::ldexp(hi, -unit_) - lo_),
        per_(static_cast<double>(bins) / width_) {}
  /// The bin of a value in [lo, hi].
  [[nodiscard]] int64_t bin(double v) const {
    const auto b = static_cast<int64_t>((std::ldexp(v, -unit_) - lo_) * per_);
    return b >= bins_ ? bins_ - 1 : b;
  }
  /// Edge i of bins + 1: edge 0 is lo, edge `bins` is hi, exactly.
  [[nodiscard]] double edge(int64_t i) const {
    if (i >= bins_) return hi_;
    return std::ldexp(lo_ + width_ * static_cast<double>(i) / static_cast<double>(bins_), unit_);
  }
  /// The magnitude unit (2^unit) the values are reckoned in.
  [[nodiscard]] int unit() const noexcept { return unit_; }

 private:
  int64_t bins_;
  int unit_;
  double hi_, lo_, width_, per_;
};

struct DistributionPass {
  std::vector<int64_t> counts;
  double s2 = 0, s3 = 0, s4 = 0;  // central moment sums of the values in units of 2^unit
  int unit = 0;
  int64_t n = 0, outside_fences = 0, beyond_sigma3 = 0;
};
inline DistributionPass distribution_pass(const at::Tensor& t, int64_t bins, double lo, double hi,
                                          double mean, double fence_lo, double fence_hi, double sigma3) {
  if (t.is_sparse()) {  // the stored values, then each implicit zero
    const at::Tensor c = t.coalesce();
    DistributionPass d = distribution_pass(c._values(), bins, lo, hi, mean, fence_lo, fence_hi, sigma3);
    const int64_t z = t.numel() - c._values().numel();
    if (z > 0) {
      d.n += z;
      if (bins > 0 && hi > lo && 0.0 >= lo && 0.0 <= hi)
        d.counts[static_cast<std::size_t>(HistogramBins(bins, lo, hi).bin(0.0))] += z;
      const double dv = -std::ldexp(mean, -d.unit), d2 = dv * dv, k = static_cast<double>(z);
      d.s2 += k * d2;
      d.s3 += k * d2 * dv;
      d.s4 += k * d2 * d2;
      if (0.0 < fence_lo || 0.0 > fence_hi) d.outside_fences += z;
      if (std::fabs(dv) > std::ldexp(sigma3, -d.unit)) d.beyond_sigma3 += z;
    }
    return d;
  }
  const Repeated r = host_repeats(t);
  DistributionPass d;
  d.counts.assign(static_cast<std::size_t>(std::max<int64_t>(bins, 0)), 0);
  const bool binned = bins > 0 && hi > lo;
  const HistogramBins hist(binned ? bins : 1, binned ? lo : 0.0, binned ? hi : 1.0);
  // Deviations in units of 2^unit (the larger magnitude of lo and hi, which bound the mean): their
  // fourth powers stay within a double for float64 data of any magnitude.
  d.unit = std::ilogb(std::max({std::fabs(lo), std::fabs(hi), std::fabs(mean), DBL_MIN}));
  const double ms = std::ldexp(mean, -d.unit), sigma3_s = std::ldexp(sigma3, -d.unit);
  for_each_value(r.base, [&](double v) {
    if (!std::isfinite(v)) return;
    ++d.n;
    if (binned && v >= lo && v <= hi) ++d.counts[static_cast<std::size_t>(hist.bin(v))];
    const double dv = std::ldexp(v, -d.unit) - ms, d2 = dv * dv;
    d.s2 += d2;
    d.s3 += d2 * dv;
    d.s4 += d2 * d2;
    d.outside_fences += (v < fence_lo || v > fence_hi) ? 1 : 0;
    d.beyond_sigma3 += std::fabs(dv) > sigma3_s ? 1 : 0;
  });
  if (r.repeats > 1) {  // every distinct value stands `repeats` times
    const double k = static_cast<double>(r.repeats);
    for (auto& c : d.counts) c *= r.repeats;
    d.n *= r.repeats;
    d.outside_fences *= r.repeats;
    d.beyond_sigma3 *= r.repeats;
    d.s2 *= k;
    d.s3 *= k;
    d.s4 *= k;
  }
  return d;
}

/// Quantiles with linear interpolation between order statistics (torch.quantile's default)
/// for ascending `qs` in [0, 1]. Reorders `values`; NaN for each q when `values` is empty.
inline std::vector<double> quantiles(std::vector<double>& values, const std::vector<double>& qs) {
  std::vector<double> out(qs.size(), kNaN);
  if (values.empty()) return out;
  const auto n = static_cast<int64_t>(values.size());
  int64_t known_lo = 0;  // everything before this index is <= everything after it
  for (std::size_t i = 0; i < qs.size(); ++i) {
    const double pos = qs[i] * static_cast<double>(n - 1);
    const auto k = std::min<int64_t>(n - 1, static_cast<int64_t>(std::floor(pos)));
    const double frac = pos - static_cast<double>(k);
    if (k >= known_lo) {
      std::nth_element(values.begin() + known_lo, values.begin() + k, values.end());
      known_lo = k;
    }
    const double lo = values[static_cast<std::size_t>(k)];
    double hi = lo;
    if (frac > 0.0 && k + 1 < n) hi = *std::min_element(values.begin() + k + 1, values.end());
    out[i] = lo + frac * (hi - lo);
  }
  return out;
}

}  // namespace torchdbg::detail

#undef TORCHDBG_KERNEL_INLINE
