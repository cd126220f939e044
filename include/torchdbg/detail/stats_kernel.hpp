// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The one statistics kernel. Every torchdbg feature that needs numbers about a tensor comes
// through here: `compute_moments` makes one pass over the data for moments, extrema, norms
// and NaN/Inf/zero/sign counts; the distribution primitives (quantiles, histogram, central
// moments) run only when asked. CPU tensors are read in place by a typed loop (parallel for
// large tensors); tensors on other devices are reduced on their device into one packed
// float64 vector that comes to the host in a single copy.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
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
  double m2 = 0.0;        // sum of squared deviations from `mean`
  double min = kInf;
  double max = -kInf;
  double abs_sum = 0.0;
  double abs_max = 0.0;

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
      } else {
        const double n = static_cast<double>(finite + o.finite);
        const double delta = o.mean - mean;
        mean += delta * static_cast<double>(o.finite) / n;
        m2 += o.m2 + delta * delta * static_cast<double>(finite) * static_cast<double>(o.finite) / n;
      }
      finite += o.finite;
    }
    min = std::min(min, o.min);
    max = std::max(max, o.max);
    abs_sum += o.abs_sum;
    abs_max = std::max(abs_max, o.abs_max);
  }

  /// Population variance (ddof = 0) of the finite values; NaN when there are none.
  [[nodiscard]] double variance() const noexcept {
    return finite > 0 ? std::max(0.0, m2 / static_cast<double>(finite)) : kNaN;
  }
  /// Sum of squares of the finite values, for the L2 norm.
  [[nodiscard]] double sum_squares() const noexcept {
    return m2 + static_cast<double>(finite) * mean * mean;
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

/// One pass over `n` contiguous elements.
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
    m.mean = shift + s1 / fn;
    m.m2 = std::max(0.0, s2 - s1 * s1 / fn);
  }
  m.min = mn;
  m.max = mx;
  m.abs_sum = abs_sum;
  m.abs_max = amax;
  return m;
}

/// Elements per parallel chunk; below this a tensor is read by one thread.
constexpr int64_t kParallelGrain = int64_t{1} << 18;

template <typename T>
Moments accumulate_parallel(const T* p, int64_t n) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunks = std::min<int64_t>(threads, std::max<int64_t>(1, n / kParallelGrain));
  if (chunks <= 1 || at::in_parallel_region()) return accumulate(p, n);
  std::vector<Moments> partial(static_cast<std::size_t>(chunks));
  const int64_t per = (n + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t lo = c * per;
      const int64_t hi = std::min(n, lo + per);
      if (lo < hi) partial[static_cast<std::size_t>(c)] = accumulate(p + lo, hi - lo);
    }
  });
  Moments total;
  for (const auto& part : partial) total.merge(part);  // fixed order: deterministic
  return total;
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

/// Calls f(static_cast<const T*>(nullptr)) with T the element type of `st`.
template <typename F>
decltype(auto) dispatch_dtype(c10::ScalarType st, F&& f) {
  check_supported_dtype(st);
  switch (st) {
    case at::kFloat: return f(static_cast<const float*>(nullptr));
    case at::kDouble: return f(static_cast<const double*>(nullptr));
    case at::kHalf: return f(static_cast<const c10::Half*>(nullptr));
    case at::kBFloat16: return f(static_cast<const c10::BFloat16*>(nullptr));
    case at::kByte: return f(static_cast<const uint8_t*>(nullptr));
    case at::kChar: return f(static_cast<const int8_t*>(nullptr));
    case at::kShort: return f(static_cast<const int16_t*>(nullptr));
    case at::kInt: return f(static_cast<const int32_t*>(nullptr));
    case at::kLong: return f(static_cast<const int64_t*>(nullptr));
    default:  // kBool: one byte, 0 or 1
      return f(static_cast<const uint8_t*>(nullptr));
  }
}

/// Number of packed values `pack_moments` produces.
constexpr int64_t kPackedMoments = 14;

/// The moments of a tensor on any device, reduced on that device and packed into a float64
/// vector of kPackedMoments values (still on the device: no host sync here).
inline at::Tensor pack_moments(const at::Tensor& t) {
  check_supported_dtype(t.scalar_type());
  const auto dopt = t.options().dtype(at::kDouble);
  if (t.numel() == 0) {
    auto out = at::zeros({kPackedMoments}, dopt);
    out[10] = kInf;
    out[11] = -kInf;
    return out;
  }
  const at::Tensor x = t.to(at::kDouble);
  const at::Tensor finite = at::isfinite(x);
  const at::Tensor fin_d = finite.to(at::kDouble);
  const at::Tensor n_fin = fin_d.sum();
  const at::Tensor xf = at::where(finite, x, at::zeros({}, dopt));
  const at::Tensor mean = xf.sum() / at::clamp_min(n_fin, 1.0);
  const at::Tensor dev = (xf - mean) * fin_d;
  const at::Tensor inf = at::full({}, kInf, dopt);
  const at::Tensor absx = xf.abs();
  std::vector<at::Tensor> parts = {
      at::full({}, static_cast<double>(t.numel()), dopt),
      n_fin,
      at::isnan(x).sum().to(at::kDouble),
      at::isposinf(x).sum().to(at::kDouble),
      at::isneginf(x).sum().to(at::kDouble),
      (x == 0).sum().to(at::kDouble),
      (xf < 0).sum().to(at::kDouble),
      (xf > 0).sum().to(at::kDouble),
      mean,
      (dev * dev).sum(),
      at::where(finite, x, inf).min(),
      at::where(finite, x, -inf).max(),
      absx.sum(),
      absx.max(),
  };
  return at::stack(parts);
}

/// Inverse of pack_moments for a host copy of the packed vector.
inline Moments unpack_moments(const at::Tensor& packed_cpu) {
  const at::Tensor c = packed_cpu.to(at::kDouble).contiguous();
  const double* v = c.data_ptr<double>();
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
  return m;
}

/// The one-pass summary of any tensor. CPU tensors are read in place (a strided tensor is
/// first made contiguous); other devices reduce on the device and copy 14 doubles back.
inline Moments compute_moments(const at::Tensor& t) {
  if (!t.defined()) throw Error("torchdbg: cannot compute statistics of an undefined tensor");
  check_supported_dtype(t.scalar_type());
  if (!t.device().is_cpu()) return unpack_moments(pack_moments(t).to(at::kCPU));
  const at::Tensor c = t.contiguous();
  return dispatch_dtype(c.scalar_type(), [&](auto tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    return accumulate_parallel(static_cast<const T*>(c.data_ptr()), c.numel());
  });
}

/// The finite values of a tensor as doubles, for the distribution primitives below.
inline std::vector<double> finite_values(const at::Tensor& t) {
  const at::Tensor c = t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
  return dispatch_dtype(c.scalar_type(), [&](auto tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    const T* p = static_cast<const T*>(c.data_ptr());
    std::vector<double> out;
    out.reserve(static_cast<std::size_t>(c.numel()));
    for (int64_t i = 0; i < c.numel(); ++i) {
      const double v = as_double(p[i]);
      if (std::isfinite(v)) out.push_back(v);
    }
    return out;
  });
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

/// Equal-width histogram of `values` over [lo, hi] (the last bin is closed on the right);
/// values outside the range are not counted.
inline std::vector<int64_t> histogram(const std::vector<double>& values, int64_t bins, double lo,
                                      double hi) {
  std::vector<int64_t> counts(static_cast<std::size_t>(bins), 0);
  if (bins <= 0 || !(hi > lo)) return counts;
  const double scale = static_cast<double>(bins) / (hi - lo);
  for (double v : values) {
    if (v < lo || v > hi) continue;
    auto b = static_cast<int64_t>((v - lo) * scale);
    if (b >= bins) b = bins - 1;
    ++counts[static_cast<std::size_t>(b)];
  }
  return counts;
}

/// Second, third and fourth central moments (population) about `mean`.
struct CentralMoments {
  double m2 = kNaN, m3 = kNaN, m4 = kNaN;
};
inline CentralMoments central_moments(const std::vector<double>& values, double mean) {
  CentralMoments c;
  if (values.empty()) return c;
  double s2 = 0, s3 = 0, s4 = 0;
  for (double v : values) {
    const double d = v - mean;
    const double d2 = d * d;
    s2 += d2;
    s3 += d2 * d;
    s4 += d2 * d2;
  }
  const auto n = static_cast<double>(values.size());
  c.m2 = s2 / n;
  c.m3 = s3 / n;
  c.m4 = s4 / n;
  return c;
}

}  // namespace torchdbg::detail
