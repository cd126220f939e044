// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/arg.h>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "torchdbg/detail/bounded_map.hpp"
#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/detail/mutex.hpp"
#include "torchdbg/detail/ring_buffer.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg {

/// TensorInspector settings; every threshold lives here.
///
/// ```cpp
/// TensorInspector insp(InspectorOptions().history_capacity(32).sample_rate(0.1));
/// ```
struct InspectorOptions {
  /// Records kept per tensor name (a ring: the oldest is dropped).
  TORCH_ARG(std::size_t, history_capacity) = 100;
  /// Tensor names tracked at once; past it the name seen first is evicted.
  TORCH_ARG(std::size_t, max_names) = 1024;
  /// Fraction of inspections that also compute the distribution (quantiles, histogram,
  /// skewness, kurtosis, outliers), spread evenly: 0.1 is every tenth inspection.
  TORCH_ARG(double, sample_rate) = 1.0;
  TORCH_ARG(int64_t, histogram_bins) = 50;
  /// An alert when max |x| over the finite values exceeds this.
  TORCH_ARG(double, extreme_magnitude) = 1e6;
  /// Gradient L2 norm below this (and > 0 elements) raises a vanishing-gradient alert.
  TORCH_ARG(double, vanishing_gradient_norm) = 1e-7;
  /// Gradient L2 norm above this raises an exploding-gradient alert.
  TORCH_ARG(double, exploding_gradient_norm) = 1e3;
  /// Keep a detached CPU copy of the latest tensor per name, for `compare(name, name)`.
  TORCH_ARG(bool, keep_latest_tensor) = false;
};

enum class TensorAlertKind { NaN, Inf, ExtremeMagnitude, VanishingGradient, ExplodingGradient };

inline const char* to_string(TensorAlertKind k) noexcept {
  switch (k) {
    case TensorAlertKind::NaN:
      return "nan";
    case TensorAlertKind::Inf:
      return "inf";
    case TensorAlertKind::ExtremeMagnitude:
      return "extreme_magnitude";
    case TensorAlertKind::VanishingGradient:
      return "vanishing_gradient";
    case TensorAlertKind::ExplodingGradient:
      return "exploding_gradient";
  }
  return "?";
}

/// A finding about one inspected tensor.
struct TensorAlert {
  TensorAlertKind kind;
  std::string name;
  int64_t step = 0;
  double value = 0.0;  ///< the count or norm that crossed the threshold
  std::string message;
};

/// One inspection: statistics plus the alerts they raised.
struct InspectionRecord {
  int64_t step = 0;
  bool is_gradient = false;
  TensorStats stats;
  std::vector<TensorAlert> alerts;
};

/// One point of a gradient's history (`track_gradient`).
struct GradientRecord {
  int64_t step = 0;
  double l2_norm = 0.0;
  double linf_norm = 0.0;
  double mean = 0.0;
  double std = 0.0;
  int64_t non_finite = 0;
};

/// Element-wise comparison of two tensors, over the pairs where both values are finite.
/// With different element counts only the match flags are meaningful (metrics NaN).
struct TensorComparison {
  bool shape_match = false;
  bool dtype_match = false;
  int64_t compared = 0;  ///< pairs with both values finite
  int64_t skipped = 0;   ///< pairs with a NaN or Inf
  double mse = detail::kNaN;
  double mae = detail::kNaN;
  double max_abs_diff = detail::kNaN;
  double cosine_similarity = detail::kNaN;  ///< NaN when either side is all zeros
  double pearson = detail::kNaN;            ///< NaN when either side is constant
};

/// Compares two tensors of any device/dtype/strides, computed from the data in double.
inline TensorComparison compare_tensors(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined())
    throw Error("torchdbg: compare_tensors got an undefined tensor");
  detail::check_readable(a);
  detail::check_readable(b);
  TensorComparison c;
  c.shape_match = a.sizes() == b.sizes();
  c.dtype_match = a.scalar_type() == b.scalar_type();
  if (a.numel() != b.numel()) return c;
  const at::Tensor x = a.detach().to(at::kCPU, at::kDouble).contiguous().reshape(-1);
  const at::Tensor y = b.detach().to(at::kCPU, at::kDouble).contiguous().reshape(-1);
  const double* px = x.data_ptr<double>();
  const double* py = y.data_ptr<double>();
  const int64_t n = x.numel();
  double sx = 0, sy = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(px[i]) || !std::isfinite(py[i])) {
      ++c.skipped;
      continue;
    }
    sx += px[i];
    sy += py[i];
    ++c.compared;
  }
  if (c.compared == 0) return c;
  const double cn = static_cast<double>(c.compared);
  const double mx = sx / cn, my = sy / cn;
  double sq = 0, ab = 0, mab = 0, dot = 0, nx = 0, ny = 0, cov = 0, vx = 0, vy = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(px[i]) || !std::isfinite(py[i])) continue;
    const double d = px[i] - py[i];
    sq += d * d;
    ab += std::fabs(d);
    mab = std::max(mab, std::fabs(d));
    dot += px[i] * py[i];
    nx += px[i] * px[i];
    ny += py[i] * py[i];
    cov += (px[i] - mx) * (py[i] - my);
    vx += (px[i] - mx) * (px[i] - mx);
    vy += (py[i] - my) * (py[i] - my);
  }
  c.mse = sq / cn;
  c.mae = ab / cn;
  c.max_abs_diff = mab;
  if (nx > 0 && ny > 0) c.cosine_similarity = dot / (std::sqrt(nx) * std::sqrt(ny));
  if (vx > 0 && vy > 0) c.pearson = cov / (std::sqrt(vx) * std::sqrt(vy));
  return c;
}

/// Totals over everything an inspector holds.
struct InspectorSummary {
  std::size_t tensors_tracked = 0;
  uint64_t inspections = 0;
  uint64_t alerts = 0;
  std::vector<std::pair<std::string, InspectionRecord>> latest;  ///< by name, sorted

  /// A text table (fmt): one row per tensor with its latest statistics.
  [[nodiscard]] std::string to_string() const {
    std::string out = fmt::format("{} tensors, {} inspections, {} alerts\n", tensors_tracked,
                                  inspections, alerts);
    out += fmt::format("{:<32} {:>6} {:>11} {:>11} {:>11} {:>11} {:>6} {:>6}\n", "name", "step",
                       "mean", "std", "min", "max", "nan", "inf");
    for (const auto& [name, r] : latest) {
      const auto& s = r.stats;
      out += fmt::format("{:<32} {:>6} {:>11.4g} {:>11.4g} {:>11.4g} {:>11.4g} {:>6} {:>6}\n", name,
                         r.step, s.mean, s.std, s.min, s.max, s.nan_count, s.inf_count);
    }
    return out;
  }
};

/// Records statistics of named tensors with a bounded history per name and raises alerts
/// (NaN, Inf, extreme magnitude, vanishing/exploding gradient norms).
///
/// Thread safety: with `std::mutex` (TensorInspector) every method may be called from any
/// thread; `TensorInspectorSt` (NullMutex) is for one thread only.
template <typename Mutex>
class BasicTensorInspector {
 public:
  explicit BasicTensorInspector(InspectorOptions options = {});

  [[nodiscard]] const InspectorOptions& options() const noexcept { return options_; }

  /// Computes and records the statistics of `t` under `name`.
  InspectionRecord inspect(std::string_view name, const at::Tensor& t, int64_t step = 0,
                           bool is_gradient = false);

  /// Raw-data form of `inspect`: `size` elements of T laid out with `shape`.
  template <typename T>
  InspectionRecord inspect(std::string_view name, const T* data, std::size_t size,
                           c10::IntArrayRef shape, int64_t step = 0, bool is_gradient = false) {
    return inspect(name, tensor_view(data, size, shape), step, is_gradient);
  }

  /// Whether the next inspection should include the distribution (advances the sampler).
  bool should_sample_distribution();

  /// Records statistics computed elsewhere (the manager computes them once per call).
  /// `tensor` is kept (detached CPU copy) only when `keep_latest_tensor` is on.
  InspectionRecord record(std::string_view name, TensorStats stats, int64_t step, bool is_gradient,
                          const at::Tensor* tensor = nullptr);

  /// Adds a point to `name`'s gradient history and returns the alerts it raises
  /// (non-finite values, vanishing or exploding L2 norm).
  std::vector<TensorAlert> track_gradient(std::string_view name, const TensorStats& stats,
                                          int64_t step);

  /// The alerts the thresholds give for these statistics (records nothing).
  [[nodiscard]] std::vector<TensorAlert> alerts_for(std::string_view name, const TensorStats& s,
                                                    int64_t step, bool is_gradient) const;

  [[nodiscard]] std::optional<InspectionRecord> latest(std::string_view name) const;

  /// Records of `name`, oldest first (empty for an unknown name).
  [[nodiscard]] std::vector<InspectionRecord> history(std::string_view name) const;

  [[nodiscard]] std::vector<GradientRecord> gradient_history(std::string_view name) const;

  /// Tracked names, in the order they were first seen.
  [[nodiscard]] std::vector<std::string> names() const;

  /// Compares the latest kept tensors of two names (needs `keep_latest_tensor(true)`).
  [[nodiscard]] TensorComparison compare(std::string_view a, std::string_view b) const;

  [[nodiscard]] InspectorSummary summary() const;

  /// Forgets every record, kept tensor and counter.
  void clear();

 private:
  struct Entry {
    explicit Entry(std::size_t cap) : records(cap), gradients(cap) {}
    detail::RingBuffer<InspectionRecord> records;
    detail::RingBuffer<GradientRecord> gradients;
    at::Tensor latest_tensor;
  };

  Entry& entry(std::string_view name);

  at::Tensor kept(std::string_view name) const;

  InspectorOptions options_;
  mutable Mutex mutex_;
  detail::BoundedMap<Entry> entries_;
  uint64_t inspections_ = 0;
  uint64_t alerts_ = 0;
  double sample_acc_ = 0.0;
};

#if TORCHDBG_DEFINITIONS

template <typename Mutex>
BasicTensorInspector<Mutex>::BasicTensorInspector(InspectorOptions options)
    : options_(std::move(options)), entries_(options_.max_names()) {
  if (options_.history_capacity() == 0)
    throw Error("torchdbg: history_capacity must be >= 1, got 0");
  if (options_.max_names() == 0) throw Error("torchdbg: max_names must be >= 1, got 0");
  if (!(options_.sample_rate() >= 0.0 && options_.sample_rate() <= 1.0)) {
    throw Error(
        fmt::format("torchdbg: sample_rate must be in [0, 1], got {}", options_.sample_rate()));
  }
  if (options_.histogram_bins() < 1) {
    throw Error(
        fmt::format("torchdbg: histogram_bins must be >= 1, got {}", options_.histogram_bins()));
  }
}

template <typename Mutex>
auto BasicTensorInspector<Mutex>::inspect(std::string_view name, const at::Tensor& t, int64_t step,
                                          bool is_gradient) -> InspectionRecord {
  TensorStats s = compute_stats(t);
  if (should_sample_distribution()) add_distribution(s, t, options_.histogram_bins());
  return record(name, std::move(s), step, is_gradient, &t);
}

template <typename Mutex>
bool BasicTensorInspector<Mutex>::should_sample_distribution() {
  std::lock_guard<Mutex> lock(mutex_);
  sample_acc_ += options_.sample_rate();
  if (sample_acc_ >= 1.0 - 1e-12) {
    sample_acc_ -= 1.0;
    return true;
  }
  return false;
}

template <typename Mutex>
auto BasicTensorInspector<Mutex>::record(std::string_view name, TensorStats stats, int64_t step,
                                         bool is_gradient, const at::Tensor* tensor)
    -> InspectionRecord {
  InspectionRecord r;
  r.step = step;
  r.is_gradient = is_gradient;
  r.stats = std::move(stats);
  r.alerts = alerts_for(name, r.stats, step, is_gradient);
  at::Tensor keep;
  if (options_.keep_latest_tensor() && tensor != nullptr && tensor->defined()) {
    keep = tensor->detach().to(at::kCPU).clone();
  }
  std::lock_guard<Mutex> lock(mutex_);
  Entry& e = entry(name);
  e.records.push(r);
  if (keep.defined()) e.latest_tensor = std::move(keep);
  ++inspections_;
  alerts_ += r.alerts.size();
  return r;
}

template <typename Mutex>
auto BasicTensorInspector<Mutex>::track_gradient(std::string_view name, const TensorStats& stats,
                                                 int64_t step) -> std::vector<TensorAlert> {
  std::vector<TensorAlert> alerts = alerts_for(name, stats, step, /*is_gradient=*/true);
  std::lock_guard<Mutex> lock(mutex_);
  Entry& e = entry(name);
  e.gradients.push(GradientRecord{step, stats.l2_norm, stats.linf_norm, stats.mean, stats.std,
                                  stats.nan_count + stats.inf_count});
  alerts_ += alerts.size();
  return alerts;
}

template <typename Mutex>
auto BasicTensorInspector<Mutex>::alerts_for(std::string_view name, const TensorStats& s,
                                             int64_t step, bool is_gradient) const
    -> std::vector<TensorAlert> {
  std::vector<TensorAlert> out;
  const std::string_view n = name;  // copied only into an alert
  if (s.nan_count > 0) {
    out.push_back({TensorAlertKind::NaN, std::string(n), step, static_cast<double>(s.nan_count),
                   fmt::format("'{}' has {} NaN of {} values", n, s.nan_count, s.numel)});
  }
  if (s.inf_count > 0) {
    out.push_back({TensorAlertKind::Inf, std::string(n), step, static_cast<double>(s.inf_count),
                   fmt::format("'{}' has {} Inf of {} values", n, s.inf_count, s.numel)});
  }
  if (s.finite_count > 0 && s.linf_norm > options_.extreme_magnitude()) {
    out.push_back({TensorAlertKind::ExtremeMagnitude, std::string(n), step, s.linf_norm,
                   fmt::format("'{}' max |x| = {:.4g} exceeds {:.4g}", n, s.linf_norm,
                               options_.extreme_magnitude())});
  }
  if (is_gradient && s.finite_count > 0) {
    if (s.l2_norm < options_.vanishing_gradient_norm()) {
      out.push_back({TensorAlertKind::VanishingGradient, std::string(n), step, s.l2_norm,
                     fmt::format("gradient '{}' L2 norm {:.4g} below {:.4g} (vanishing)", n,
                                 s.l2_norm, options_.vanishing_gradient_norm())});
    } else if (s.l2_norm > options_.exploding_gradient_norm()) {
      out.push_back({TensorAlertKind::ExplodingGradient, std::string(n), step, s.l2_norm,
                     fmt::format("gradient '{}' L2 norm {:.4g} above {:.4g} (exploding)", n,
                                 s.l2_norm, options_.exploding_gradient_norm())});
    }
  }
  return out;
}

template <typename Mutex>
auto BasicTensorInspector<Mutex>::latest(std::string_view name) const
    -> std::optional<InspectionRecord> {
  std::lock_guard<Mutex> lock(mutex_);
  const Entry* e = entries_.find(name);
  if (e == nullptr || e->records.empty()) return std::nullopt;
  return e->records.back();
}

template <typename Mutex>
auto BasicTensorInspector<Mutex>::history(std::string_view name) const
    -> std::vector<InspectionRecord> {
  std::lock_guard<Mutex> lock(mutex_);
  const Entry* e = entries_.find(name);
  return e ? e->records.to_vector() : std::vector<InspectionRecord>{};
}

template <typename Mutex>
auto BasicTensorInspector<Mutex>::gradient_history(std::string_view name) const
    -> std::vector<GradientRecord> {
  std::lock_guard<Mutex> lock(mutex_);
  const Entry* e = entries_.find(name);
  return e ? e->gradients.to_vector() : std::vector<GradientRecord>{};
}

template <typename Mutex>
auto BasicTensorInspector<Mutex>::names() const -> std::vector<std::string> {
  std::lock_guard<Mutex> lock(mutex_);
  return entries_.names();
}

template <typename Mutex>
auto BasicTensorInspector<Mutex>::compare(std::string_view a, std::string_view b) const
    -> TensorComparison {
  at::Tensor ta, tb;
  {
    std::lock_guard<Mutex> lock(mutex_);
    ta = kept(a);
    tb = kept(b);
  }
  return compare_tensors(ta, tb);
}

template <typename Mutex>
auto BasicTensorInspector<Mutex>::summary() const -> InspectorSummary {
  std::lock_guard<Mutex> lock(mutex_);
  InspectorSummary s;
  s.tensors_tracked = entries_.size();
  s.inspections = inspections_;
  s.alerts = alerts_;
  entries_.for_each([&](const std::string& name, const Entry& e) {
    if (!e.records.empty()) s.latest.emplace_back(name, e.records.back());
  });
  std::sort(s.latest.begin(), s.latest.end(),
            [](const auto& x, const auto& y) { return x.first < y.first; });
  return s;
}

template <typename Mutex>
void BasicTensorInspector<Mutex>::clear() {
  std::lock_guard<Mutex> lock(mutex_);
  entries_.clear();
  inspections_ = 0;
  alerts_ = 0;
  sample_acc_ = 0.0;
}

template <typename Mutex>
auto BasicTensorInspector<Mutex>::entry(std::string_view name) -> Entry& {
  return entries_.get_or_create(name, [&] { return Entry(options_.history_capacity()); });
}

template <typename Mutex>
auto BasicTensorInspector<Mutex>::kept(std::string_view name) const -> at::Tensor {
  if (!options_.keep_latest_tensor()) {
    throw Error("torchdbg: compare(\"" + std::string(name) +
                "\", ...) needs InspectorOptions().keep_latest_tensor(true)");
  }
  const Entry* e = entries_.find(name);
  if (e == nullptr || !e->latest_tensor.defined()) {
    throw Error("torchdbg: no tensor recorded under '" + std::string(name) + "'");
  }
  return e->latest_tensor;
}

#endif  // TORCHDBG_DEFINITIONS

using TensorInspector = BasicTensorInspector<std::mutex>;
using TensorInspectorSt = BasicTensorInspector<detail::NullMutex>;

TORCHDBG_EXTERN_TEMPLATE(class BasicTensorInspector<std::mutex>)
TORCHDBG_EXTERN_TEMPLATE(class BasicTensorInspector<detail::NullMutex>)

}  // namespace torchdbg
