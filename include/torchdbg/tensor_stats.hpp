// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <ATen/ATen.h>
#include <c10/core/ScalarTypeToTypeMeta.h>
#include <c10/util/ArrayRef.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h before fmt 11)
#include <nlohmann/json.hpp>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "torchdbg/detail/print.hpp"
#include "torchdbg/detail/stats_kernel.hpp"
#include "torchdbg/error.hpp"

namespace torchdbg {

/// Statistics of large tensors from one light pass and a sample of blocks, for a cost below
/// a full reading (off by default: every value goes through the full kernel).
///
/// A contiguous float32 CPU tensor of more than `above` values, whose blocks of 2048 values
/// make at least 16 groups of `stride` blocks, and of at most 2^22 values (16 MiB: a larger
/// one comes from memory, where the full kernel already runs at memory bandwidth), is read so:
/// one block of each group, drawn afresh on every reading, goes through the full kernel; every
/// other block gets only its sum and sum of squares about its first value (three vector
/// operations per 16 values, where the full kernel takes five to nine); a last, partial block
/// is read in full. So numel, NaN/Inf and finite counts, mean, std and the L2 norm are those of
/// a full reading (the same block arithmetic), while zero/negative/positive counts, sparsity
/// and the L1 norm are unbiased estimates from the blocks read (each weighted by its group),
/// and min, max and the L-infinity norm are those of the blocks read: a lone extreme value
/// shows there only when its block is drawn (it always shows in std and the L2 norm).
/// A tensor holding NaN/Inf, or whose squared deviations overflow float (spreads near 1e19),
/// is read in full, and so is one the full kernel would split between several intra-op
/// threads (2^19 values and more with at::get_num_threads() > 1). TensorStats::sampled_count
/// is the number of values the full kernel read, 0 when it read them all.
///
/// ```cpp
/// torchdbg::HookManager hooks(torchdbg::HookManagerOptions().sampling(
///     torchdbg::StatsSampling().stride(8)));  // tensors of 262144 values and more
/// ```
struct StatsSampling {
  /// One block in this many goes through the full kernel; 1 reads every value with it.
  TORCH_ARG(int64_t, stride) = 1;
  /// Tensors of at most this many values are read whole (and any of fewer than
  /// 16 * stride * 2048).
  TORCH_ARG(int64_t, above) = int64_t{1} << 15;
};

/// What `compute_stats` computes beyond the one-pass summary.
///
/// ```cpp
/// auto s = torchdbg::compute_stats(t, torchdbg::StatsOptions().distribution(true).histogram_bins(32));
/// ```
struct StatsOptions {
  /// Also compute quantiles, histogram, skewness, kurtosis and outlier counts (a second pass
  /// over a host copy of the finite values).
  TORCH_ARG(bool, distribution) = false;
  /// Number of equal-width histogram bins over [min, max] of the finite values.
  TORCH_ARG(int64_t, histogram_bins) = 50;
  /// Quantiles are exact up to this many finite values and come from a uniform sample of
  /// this many beyond (histogram, moments and outlier counts are always exact).
  TORCH_ARG(int64_t, max_quantile_values) = int64_t{1} << 20;
  /// false: zero/negative/positive counts, the L1 norm and sparsity may be skipped
  /// (TensorStats::sign_counts says whether they were). On float32, half and bfloat16 CPU
  /// data this halves the kernel's work; norms, mean, std, extrema and NaN/Inf counts are
  /// the same as with them.
  TORCH_ARG(bool, sign_counts) = true;
  /// Estimate the summary of large tensors from a sample (StatsSampling); ignored when
  /// `distribution` is set.
  TORCH_ARG(StatsSampling, sampling);
};

/// The distribution part of TensorStats, over finite values only.
struct Distribution {
  std::vector<double> bin_edges;    ///< histogram_bins + 1 edges, ascending
  std::vector<int64_t> bin_counts;  ///< histogram_bins counts; they sum to finite_count
  double p5 = detail::kNaN, p25 = detail::kNaN, p50 = detail::kNaN, p75 = detail::kNaN,
         p95 = detail::kNaN, p99 = detail::kNaN;
  double skewness = detail::kNaN;         ///< population skewness g1
  double excess_kurtosis = detail::kNaN;  ///< population kurtosis minus 3
  int64_t iqr_outliers = 0;     ///< outside [p25 - 1.5 IQR, p75 + 1.5 IQR]
  int64_t sigma3_outliers = 0;  ///< |x - mean| > 3 std
  /// Finite values the quantiles were computed from: all of them, or a uniform sample of
  /// StatsOptions::max_quantile_values (rank error about 1/sqrt of it) when there are more.
  int64_t quantile_values = 0;
};

/// Statistics of one tensor.
///
/// Conventions: moments, extrema, norms and the median cover the finite values only; NaN and
/// +/-Inf are counted apart. `std` is the population standard deviation
/// (torch.std(unbiased=false)). With no finite value (an empty tensor, or all NaN/Inf) mean,
/// std, min, max and median are NaN while counts and norms are 0. `sparsity` is
/// zero_count / numel, NaN for an empty tensor. `median` is NaN unless the distribution was
/// computed. Statistics computed without sign counts (StatsOptions::sign_counts(false),
/// HookContext::moment_stats) have zero/negative/positive counts of -1 and an L1 norm and
/// sparsity of NaN, unless `sign_counts` is true.
struct TensorStats {
  std::vector<int64_t> shape;
  std::string dtype;   ///< c10's name: "Float", "Half", "Long", ...
  std::string device;  ///< "cpu", "cuda:0", ...
  int64_t numel = 0;
  int64_t bytes = 0;
  int64_t finite_count = 0;
  int64_t nan_count = 0;
  int64_t inf_count = 0;  ///< pos_inf_count + neg_inf_count
  int64_t pos_inf_count = 0;
  int64_t neg_inf_count = 0;
  int64_t zero_count = 0;
  int64_t negative_count = 0;
  int64_t positive_count = 0;
  double mean = detail::kNaN;
  double std = detail::kNaN;
  double min = detail::kNaN;
  double max = detail::kNaN;
  double median = detail::kNaN;
  double l1_norm = 0.0;
  double l2_norm = 0.0;
  double linf_norm = 0.0;
  double sparsity = detail::kNaN;
  /// Whether zero/negative/positive counts, l1_norm and sparsity were computed.
  bool sign_counts = true;
  /// Values the full kernel read when the tensor was sampled (StatsSampling: the sign counts,
  /// L1 norm, sparsity and extrema are then estimates); 0 when it read every value.
  int64_t sampled_count = 0;
  std::optional<Distribution> distribution;

  [[nodiscard]] bool has_non_finite() const noexcept { return nan_count + inf_count > 0; }
};

/// One line, e.g. `TensorStats(Float [32, 10] cpu, mean 0.01234, std 1.02, min -3.1, max 2.9,
/// nan 0, inf 0)`; an empty tensor prints "empty" instead of the moments.
inline std::string to_string(const TensorStats& st) {
  std::string s = "TensorStats(" + st.dtype + " [" + fmt::format("{}", fmt::join(st.shape, ", ")) + "] " + st.device;
  if (st.numel == 0) return s + ", empty)";
  return s + fmt::format(", mean {}, std {}, min {}, max {}, nan {}, inf {})", detail::num(st.mean),
                         detail::num(st.std), detail::num(st.min), detail::num(st.max), st.nan_count, st.inf_count);
}

namespace detail {
template <>
struct Printable<TensorStats> : std::true_type {};
}  // namespace detail

/// Builds TensorStats (without distribution) from the kernel's summary.
inline TensorStats stats_from_moments(const detail::Moments& m, const at::Tensor& t) {
  TensorStats s;
  s.shape = t.sizes().vec();
  s.dtype = c10::toString(t.scalar_type());
  s.device = t.device().str();
  s.numel = t.numel();
  s.bytes = t.numel() * static_cast<int64_t>(t.element_size());
  s.finite_count = m.finite;
  s.nan_count = m.nan;
  s.pos_inf_count = m.pos_inf;
  s.neg_inf_count = m.neg_inf;
  s.inf_count = m.pos_inf + m.neg_inf;
  s.sign_counts = m.signs;
  s.zero_count = m.signs ? m.zeros : -1;
  s.negative_count = m.signs ? m.negatives : -1;
  s.positive_count = m.signs ? m.positives : -1;
  if (m.finite > 0) {
    s.mean = m.mean;
    s.std = m.std_dev();
    s.min = m.min;
    s.max = m.max;
  }
  s.l1_norm = m.signs ? m.abs_sum : detail::kNaN;
  s.l2_norm = m.l2_norm();
  s.linf_norm = m.abs_max;
  if (s.numel > 0 && m.signs) s.sparsity = static_cast<double>(m.zeros) / static_cast<double>(s.numel);
  return s;
}

/// Adds the distribution to `s`, reading the data of `t` again (`s` must hold the summary of
/// `t`): the histogram, shape moments and outlier counts in one exact pass over the finite
/// values; the quantiles from at most `max_quantile_values` of them (a seeded uniform sample
/// beyond that; Distribution::quantile_values says how many).
inline void add_distribution(TensorStats& s, const at::Tensor& t, int64_t histogram_bins,
                             int64_t max_quantile_values = int64_t{1} << 20) {
  if (histogram_bins < 1) {
    throw Error("torchdbg: histogram_bins must be at least 1, got " +
                std::to_string(histogram_bins));
  }
  detail::require_at_least<int64_t>(max_quantile_values, 1, "StatsOptions::max_quantile_values");
  Distribution d;
  std::vector<double> sample = detail::finite_sample(t, s.finite_count, max_quantile_values);
  d.quantile_values = static_cast<int64_t>(sample.size());
  const auto q = detail::quantiles(sample, {0.05, 0.25, 0.5, 0.75, 0.95, 0.99});
  sample = {};
  d.p5 = q[0];
  d.p25 = q[1];
  d.p50 = q[2];
  d.p75 = q[3];
  d.p95 = q[4];
  d.p99 = q[5];
  s.median = d.p50;
  if (s.finite_count == 0) {
    d.bin_counts.assign(static_cast<std::size_t>(histogram_bins), 0);
    s.distribution = std::move(d);
    return;
  }
  // A constant tensor gets one unit-wide range around its value, as torch.histc does; where 1
  // is below the value's precision (beyond 2^53), the neighbouring doubles.
  double lo = s.min, hi = s.max;
  if (!(hi > lo)) {
    lo -= 1.0;
    hi += 1.0;
    if (!(hi > lo)) {
      lo = std::nextafter(s.min, -detail::kInf);
      hi = std::nextafter(s.max, detail::kInf);
      if (!std::isfinite(lo)) lo = s.min;
      if (!std::isfinite(hi)) hi = s.max;
    }
  }
  d.bin_edges.resize(static_cast<std::size_t>(histogram_bins) + 1);
  const detail::HistogramBins bins(histogram_bins, lo, hi);
  for (int64_t i = 0; i <= histogram_bins; ++i) d.bin_edges[static_cast<std::size_t>(i)] = bins.edge(i);
  const double iqr = d.p75 - d.p25;
  const auto pass = detail::distribution_pass(t, histogram_bins, lo, hi, s.mean, d.p25 - 1.5 * iqr,
                                              d.p75 + 1.5 * iqr, 3.0 * s.std);
  d.bin_counts = pass.counts;
  const double n = static_cast<double>(pass.n), m2 = pass.s2 / n;
  if (m2 > 0.0) {
    d.skewness = (pass.s3 / n) / std::pow(m2, 1.5);
    d.excess_kurtosis = (pass.s4 / n) / (m2 * m2) - 3.0;
  }
  d.iqr_outliers = pass.outside_fences;
  d.sigma3_outliers = pass.beyond_sigma3;
  s.distribution = std::move(d);
}

/// Statistics of a tensor of any device, dtype and strides. Throws torchdbg::Error for an
/// undefined tensor or an unsupported dtype (complex, quantized).
inline TensorStats compute_stats(const at::Tensor& t, const StatsOptions& options = {}) {
  // The distribution's consumers (reports, the visualizer) read the counts too.
  const bool signs = options.sign_counts() || options.distribution();
  const StatsSampling& sampling = options.sampling();
  if (sampling.stride() < 1)
    throw Error("torchdbg: StatsSampling::stride must be at least 1, got " + std::to_string(sampling.stride()));
  if (sampling.above() < 0)
    throw Error("torchdbg: StatsSampling::above must be at least 0, got " + std::to_string(sampling.above()));
  if (sampling.stride() > 1 && !options.distribution()) {
    detail::SampleInfo info;
    TensorStats s = stats_from_moments(detail::compute_moments(t, signs, sampling.stride(), sampling.above(), info), t);
    s.sampled_count = info.values;
    return s;
  }
  TensorStats s = stats_from_moments(detail::compute_moments(t, signs), t);
  if (options.distribution()) add_distribution(s, t, options.histogram_bins(), options.max_quantile_values());
  return s;
}

/// Product of `shape`; throws torchdbg::Error naming a negative dimension.
inline int64_t shape_numel(c10::IntArrayRef shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw Error("torchdbg: negative dimension " + std::to_string(d) + " in shape " +
                           c10::str(shape));
    n *= d;
  }
  return n;
}

/// A CPU tensor viewing `size` elements at `data` with `shape` (no copy); throws
/// torchdbg::Error when the element count and the shape disagree.
template <typename T>
at::Tensor tensor_view(const T* data, std::size_t size, c10::IntArrayRef shape) {
  const int64_t need = shape_numel(shape);
  if (need != static_cast<int64_t>(size)) {
    throw Error("torchdbg: data has " + std::to_string(size) + " elements but shape " +
                c10::str(shape) + " needs " + std::to_string(need));
  }
  if (size > 0 && data == nullptr) throw Error("torchdbg: data pointer is null");
  const auto st = c10::CppTypeToScalarType<T>::value;
  detail::check_supported_dtype(st);
  return at::from_blob(const_cast<T*>(data), shape, at::TensorOptions().dtype(st));
}

/// Statistics of raw data: `size` elements of T at `data`, laid out with `shape`.
/// T: float, double, c10::Half, c10::BFloat16, bool or an integer type.
template <typename T>
TensorStats compute_stats(const T* data, std::size_t size, c10::IntArrayRef shape,
                          const StatsOptions& options = {}) {
  return compute_stats(tensor_view(data, size, shape), options);
}

inline void to_json(nlohmann::json& j, const Distribution& d) {
  j = nlohmann::json{{"bin_edges", d.bin_edges}, {"bin_counts", d.bin_counts},
                     {"p5", d.p5},               {"p25", d.p25},
                     {"p50", d.p50},             {"p75", d.p75},
                     {"p95", d.p95},             {"p99", d.p99},
                     {"skewness", d.skewness},   {"excess_kurtosis", d.excess_kurtosis},
                     {"iqr_outliers", d.iqr_outliers}, {"sigma3_outliers", d.sigma3_outliers},
                     {"quantile_values", d.quantile_values}};
}

/// JSON form of TensorStats; NaN values, and sign counts not computed, become null.
inline void to_json(nlohmann::json& j, const TensorStats& s) {
  j = nlohmann::json{{"shape", s.shape},
                     {"dtype", s.dtype},
                     {"device", s.device},
                     {"numel", s.numel},
                     {"bytes", s.bytes},
                     {"finite_count", s.finite_count},
                     {"nan_count", s.nan_count},
                     {"inf_count", s.inf_count},
                     {"pos_inf_count", s.pos_inf_count},
                     {"neg_inf_count", s.neg_inf_count},
                     {"zero_count", s.zero_count},
                     {"negative_count", s.negative_count},
                     {"positive_count", s.positive_count},
                     {"mean", s.mean},
                     {"std", s.std},
                     {"min", s.min},
                     {"max", s.max},
                     {"median", s.median},
                     {"l1_norm", s.l1_norm},
                     {"l2_norm", s.l2_norm},
                     {"linf_norm", s.linf_norm},
                     {"sparsity", s.sparsity}};
  if (!s.sign_counts) {  // not computed: null, like NaN
    for (const char* k : {"zero_count", "negative_count", "positive_count"}) j[k] = nullptr;
  }
  if (s.sampled_count > 0) j["sampled_count"] = s.sampled_count;
  if (s.distribution) j["distribution"] = *s.distribution;
}

}  // namespace torchdbg
