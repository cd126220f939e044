// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "torchdbg/detail/delivery_facts.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg {

/// Free-form key/value pairs passed with `execute_hooks` (e.g. {"parameter", "weight"}).
using Metadata = std::map<std::string, std::string, std::less<>>;

/// Values reduced from a queued tensor where it lives, by the prefetches registered with
/// BasicHookManager::add_prefetch, and brought to the host with the step's batch: key ->
/// values.
using Prefetched = std::map<std::string, std::vector<double>, std::less<>>;

template <typename Mutex>
class BasicHookManager;

/// What a callback reads of the statistics (BasicHookManager::register_callback): `Full`
/// (HookContext::stats, the default) or only `Moments` (HookContext::moment_stats).
enum class CallbackStats { Full, Moments };

/// The training state the loop reported through `set_step`/`set_loss`/... . A value never
/// reported is empty, and conditions on it are false.
struct TrainingState {
  int64_t step = 0;
  std::optional<double> loss;          ///< of the current step: cleared when the step changes
  std::optional<int64_t> loss_step;  ///< the step at which `loss` was reported
  std::optional<double> gradient_norm;
  std::optional<double> memory_mb;
};

class HookContext;

namespace detail {
template <typename Mutex, typename State>
class HookExecutor;
/// The metadata as the caller passed it, without the entries of delivery_facts().
inline const Metadata& base_metadata(const HookContext& ctx) noexcept;
/// What attach measured about this forward delivery, as numbers (null for other calls).
inline const DeliveryFacts* delivery_facts(const HookContext& ctx) noexcept;
}  // namespace detail

/// What a hook sees during one `execute_hooks` call: the layer, direction, training state,
/// metadata and the tensor. Statistics are computed once, on first use, and shared by every
/// hook of the call. Not thread-safe (each call has its own context), except that
/// `metadata()` and `metadata_value()` may be read from several threads at once.
class HookContext {
 public:
  /// `precomputed`, when given, is the caller's statistics of `tensor` (used instead of a
  /// second pass over the data); `prefetched`, the values its prefetches brought.
  HookContext(std::string_view layer_name, bool is_forward, TrainingState state,
              const Metadata& metadata, const at::Tensor& tensor,
              const TensorStats* precomputed = nullptr, const Prefetched* prefetched = nullptr)
      : layer_name_(layer_name),
        is_forward_(is_forward),
        state_(std::move(state)),
        metadata_(metadata),
        tensor_(tensor),
        prefetched_(prefetched),
        precomputed_(precomputed) {}

  [[nodiscard]] std::string_view layer_name() const noexcept { return layer_name_; }
  [[nodiscard]] bool is_forward() const noexcept { return is_forward_; }
  [[nodiscard]] int64_t step() const noexcept { return state_.step; }
  [[nodiscard]] const TrainingState& state() const noexcept { return state_; }
  [[nodiscard]] std::optional<double> loss() const noexcept { return state_.loss; }
  [[nodiscard]] std::optional<double> gradient_norm() const noexcept {
    return state_.gradient_norm;
  }
  [[nodiscard]] std::optional<double> memory_mb() const noexcept { return state_.memory_mb; }
  /// The delivery's metadata (attach's keys: docs/attach.md). May be read from several
  /// threads at once.
  [[nodiscard]] const Metadata& metadata() const noexcept {
    if (facts_ == nullptr) return metadata_;
    // Attach's measured entries, written out once, for the first reader.
    std::call_once(merged_once_, [this] {
      try {
        Metadata md = metadata_;
        facts_->add_to(md);
        merged_ = std::move(md);
      } catch (...) {
        // out of memory: the caller's metadata without them
      }
    });
    return merged_ ? *merged_ : metadata_;
  }
  /// The observed tensor (for raw-data calls, a view of the caller's memory valid only
  /// during the call).
  [[nodiscard]] const at::Tensor& tensor() const noexcept { return tensor_; }

  /// The value for `key` in the metadata, if present.
  [[nodiscard]] std::optional<std::string_view> metadata_value(std::string_view key) const {
    const Metadata& md = metadata();
    auto it = md.find(key);
    if (it == md.end()) return std::nullopt;
    return std::string_view(it->second);
  }

  /// The values prefetch `key` computed for this tensor, or null when there are none (the
  /// delivery was not queued, or the prefetch declined it).
  [[nodiscard]] const std::vector<double>* prefetched(std::string_view key) const {
    if (prefetched_ == nullptr) return nullptr;
    auto it = prefetched_->find(key);
    return it == prefetched_->end() ? nullptr : &it->second;
  }

  /// One-pass statistics of the tensor, computed on first use (for a large tensor, sign
  /// counts and extrema from a sample of its blocks when the manager samples:
  /// HookManagerOptions::sampling).
  [[nodiscard]] const TensorStats& stats() const {
    if (stats_ && stats_->sign_counts) return *stats_;
    if (precomputed_ != nullptr && precomputed_->sign_counts) return *precomputed_;
    stats_ = compute_stats(tensor_, StatsOptions().sampling(sampling_));
    return *stats_;
  }

  /// Statistics that may lack the sign counts (zero/negative/positive counts, L1 norm,
  /// sparsity: -1 or NaN when `sign_counts` is false): counts, NaN/Inf, mean, std, min,
  /// max, L2 and L-infinity norms. What gradient checks read; on float32 CPU data about half
  /// the work of stats() when nothing was computed yet. Statistics already at hand (from
  /// stats(), or the caller's) are returned as they are.
  ///
  /// ```cpp
  /// hooks.register_callback("grad_norm", [](const HookContext& ctx) {
  ///   log(ctx.layer_name(), ctx.moment_stats().l2_norm);
  /// }, CallbackStats::Moments);
  /// ```
  [[nodiscard]] const TensorStats& moment_stats() const {
    if (stats_) return *stats_;
    if (precomputed_ != nullptr && (precomputed_->sign_counts || !sign_counts_wanted_)) return *precomputed_;
    stats_ = compute_stats(tensor_, StatsOptions().sign_counts(sign_counts_wanted_).sampling(sampling_));
    return *stats_;
  }

  /// For each index along `dim` (a unit: a feature, a channel), how many of the tensor's
  /// values are above 0 (NaN never is), computed on first use for each `dim`; the vector lives
  /// as long as the context. When the statistics are not computed yet, the manager does not
  /// sample (HookManagerOptions::sampling), and the tensor is a contiguous float32 CPU one of
  /// 2^18 values or more whose units hold runs of 64 values or more ([N, C, H, W] outputs with
  /// H * W >= 64), the counts and moment_stats() come from one pass over the data (split
  /// between the intra-op threads as moment_stats() alone would be): a hook that reads both
  /// asks for these first. Throws torchdbg::Error when `dim` does not exist or the tensor has no data.
  ///
  /// ```cpp
  /// const auto& active = ctx.units_above_zero(1);  // per channel of a ReLU's output
  /// const double rms = ctx.moment_stats().l2_norm;  // from the same read
  /// ```
  [[nodiscard]] const std::vector<int64_t>& units_above_zero(int64_t dim) const {
    if (!tensor_.defined()) throw Error("torchdbg: cannot count values of an undefined tensor");
    const int64_t d = detail::unit_dim_of(tensor_, dim);
    if (auto it = units_.find(d); it != units_.end()) return it->second;
    std::vector<int64_t> counts;
    const bool have_moments =
        stats_ || (precomputed_ != nullptr && (precomputed_->sign_counts || !sign_counts_wanted_));
    if (!have_moments && sampling_.stride() <= 1 && detail::units_fusable(tensor_, d)) {
      stats_ = stats_from_moments(detail::compute_moments_with_units(tensor_, sign_counts_wanted_, d, counts),
                                  tensor_);
    } else {
      int64_t per_unit = 0;
      counts = detail::count_above_per_unit(tensor_, d, 0.0, per_unit);
    }
    return units_.emplace(d, std::move(counts)).first->second;
  }

  /// Statistics with the distribution part, computed on first use (reusing the summary when
  /// it read every value).
  [[nodiscard]] const TensorStats& stats_with_distribution(int64_t histogram_bins) const {
    // The caller's statistics are not ours to extend: they are copied first.
    const auto whole = [](const TensorStats& s) { return s.sign_counts && s.sampled_count == 0; };
    if (!stats_ || !whole(*stats_)) {
      stats_ = precomputed_ != nullptr && whole(*precomputed_) ? *precomputed_ : compute_stats(tensor_);
    }
    const TensorStats& s = *stats_;
    if (!s.distribution || distribution_bins_ != histogram_bins) {
      add_distribution(*stats_, tensor_, histogram_bins);
      distribution_bins_ = histogram_bins;
    }
    return *stats_;
  }

 private:
  template <typename, typename>
  friend class detail::HookExecutor;  // sets sign_counts_wanted_ and facts_
  friend const Metadata& detail::base_metadata(const HookContext& ctx) noexcept;
  friend const detail::DeliveryFacts* detail::delivery_facts(const HookContext& ctx) noexcept;

  std::string_view layer_name_;
  bool is_forward_;
  TrainingState state_;
  const Metadata& metadata_;
  const detail::DeliveryFacts* facts_ = nullptr;  // attach's measurements of a forward delivery
  mutable std::once_flag merged_once_;
  mutable std::optional<Metadata> merged_;  // metadata_ with facts_ written in (metadata())
  const at::Tensor& tensor_;
  const Prefetched* prefetched_;
  const TensorStats* precomputed_;  // the caller's, valid during the call
  mutable std::optional<TensorStats> stats_;
  mutable int64_t distribution_bins_ = 0;
  mutable std::map<int64_t, std::vector<int64_t>> units_;  // units_above_zero, by dimension
  bool sign_counts_wanted_ = false;  // a later hook will read stats(): moment_stats() computes them
  StatsSampling sampling_;           // the manager's
};

namespace detail {
inline const Metadata& base_metadata(const HookContext& ctx) noexcept { return ctx.metadata_; }
inline const DeliveryFacts* delivery_facts(const HookContext& ctx) noexcept { return ctx.facts_; }
}  // namespace detail

}  // namespace torchdbg
