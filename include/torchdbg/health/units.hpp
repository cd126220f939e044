// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// What the health monitor knows of an output's units: the activation that made it (and so
// where it saturates), and the window of its units' recent activity (dead units). Internal to
// the monitor.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/detail/pattern.hpp"
#include "torchdbg/detail/stats_kernel.hpp"
#include "torchdbg/health/options.hpp"
#include "torchdbg/health/rules.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg::detail {

/// An output's activation kind (from attach's metadata or `HealthOptions::pre_activations`)
/// and the bounds outside which it counts as saturated. Immutable after construction: safe to
/// read from any thread.
class ActivationKinds {
 public:
  /// An output's activation kind as the judgement sees it. `known == false`: the layer keeps
  /// its kind.
  struct Kind {
    std::string name;
    bool pre = false;  ///< a pre-activation (a module output fed to `name`)
    bool known = false;
  };

  /// Compiles `pre_activations` (throws torchdbg::Error on a bad pattern or activation).
  explicit ActivationKinds(const HealthOptions& options);

  Kind kind_of(std::string_view layer, const ActivationInfo& info) const;
  static bool saturating(const std::string& kind, bool pre);
  /// The values outside which an output of `kind` counts as saturated.
  std::pair<double, double> saturation_bounds(const std::string& k, bool pre) const;
  /// The fraction of `y` outside them; `prefetched`: the count of outside values when attach
  /// brought it with the step's batch.
  double saturated_fraction(const std::string& kind, bool pre, const at::Tensor& y,
                            const TensorStats& s, std::optional<double> prefetched) const;

 private:
  const HealthOptions& options_;
  std::vector<std::pair<Pattern, std::string>> pre_acts_;
};

/// A layer's last outputs' per-unit counts of active values (above 0), with the samples and
/// the step of each: the dead-unit window (HealthOptions::dead_window outputs).
struct UnitWindow {
  std::vector<std::vector<int64_t>> unit_ring;
  std::vector<int64_t> sample_ring, step_ring;
  std::size_t unit_head = 0;
  /// Outputs pushed since the window last started over (the newest is number `pushed`).
  int64_t pushed = 0;
  /// Per unit: the number of the newest output in which it was active (above `activity` of
  /// that output's samples), 0 for none; what dead_fraction's `since` is found from.
  std::vector<int64_t> last_active;
  double activity = -1.0;

  /// One output's counts (`per_unit` values per unit); a change of width starts over.
  /// `activity`: HealthOptions::dead_activity.
  void push(std::vector<int64_t> counts, int64_t per_unit, int64_t step, std::size_t capacity,
            double activity);
  /// The fraction of units active in fewer than `activity` of the newest `window_samples`
  /// samples (NaN before there are that many); `since`: the step of the oldest held output
  /// in which every one of them was inactive, in the unbroken run up to the newest (a
  /// failure that the window confirms only after a few outputs began there).
  double dead_fraction(int64_t window_samples, double activity, int64_t* since);

 private:
  std::size_t index_of(int64_t number) const;  // the ring slot of held output `number`
  void mark_active(std::size_t slot, int64_t number);
  /// last_active again from every held output, for the threshold `active_above`.
  void rebuild(double active_above);
};

#if TORCHDBG_DEFINITIONS

TORCHDBG_INLINE ActivationKinds::ActivationKinds(const HealthOptions& options) : options_(options) {
  for (const auto& [pattern, act] : options_.pre_activations()) {
    if (act != "tanh" && act != "sigmoid" && act != "relu")
      throw Error("torchdbg: pre_activations supports tanh, sigmoid and relu, got '" + act +
                  "' for '" + pattern + "'");
    pre_acts_.emplace_back(compile_pattern(pattern, "pre_activations pattern"), act);
  }
}

TORCHDBG_INLINE auto ActivationKinds::kind_of(std::string_view layer,
                                              const ActivationInfo& info) const -> Kind {
  if (!info.activation.empty()) return {std::string(info.activation), false, true};
  if (!info.op.empty()) return {std::string(info.op), false, true};
  std::string pre(info.pre_activation);
  if (pre.empty()) {
    const std::string name(layer);
    for (const auto& [re, act] : pre_acts_)
      if (re.full_match(name)) pre = act;
  }
  if (!pre.empty()) return {pre, true, true};
  return {};
}

TORCHDBG_INLINE bool ActivationKinds::saturating(const std::string& kind, bool pre) {
  if (pre) return kind == "tanh" || kind == "sigmoid";
  return detail::is_saturating(kind);
}

TORCHDBG_INLINE auto ActivationKinds::saturation_bounds(const std::string& k, bool pre) const
    -> std::pair<double, double> {
  double lo = 0.0, hi = 0.0;
  if (pre) {
    const double t = k == "tanh"
                         ? std::atanh(options_.tanh_saturation())
                         : std::log(options_.sigmoid_high() / (1.0 - options_.sigmoid_high()));
    const double tl =
        k == "tanh" ? -t : std::log(options_.sigmoid_low() / (1.0 - options_.sigmoid_low()));
    lo = tl;
    hi = t;
  } else if (k == "tanh" || k == "softsign") {
    lo = -options_.tanh_saturation();
    hi = options_.tanh_saturation();
  } else if (k == "sigmoid") {
    lo = options_.sigmoid_low();
    hi = options_.sigmoid_high();
  } else if (k == "hardtanh") {
    lo = -1.0 + 1e-6;
    hi = 1.0 - 1e-6;
  } else {  // hardsigmoid
    lo = 1e-6;
    hi = 1.0 - 1e-6;
  }
  return {lo, hi};
}

TORCHDBG_INLINE double ActivationKinds::saturated_fraction(const std::string& kind, bool pre,
                                                           const at::Tensor& y,
                                                           const TensorStats& s,
                                                           std::optional<double> prefetched) const {
  if (s.numel == 0) return 0.0;
  double outside = 0.0;
  if (prefetched) {
    outside = *prefetched;
  } else {
    const auto [lo, hi] = saturation_bounds(kind, pre);
    outside = static_cast<double>(detail::count_outside(y, lo, hi));
  }
  return outside / static_cast<double>(s.numel);
}

TORCHDBG_INLINE void UnitWindow::push(std::vector<int64_t> counts, int64_t per_unit, int64_t step,
                                      std::size_t capacity, double active_above) {
  const std::size_t w = capacity;
  if (!unit_ring.empty() && unit_ring.front().size() != counts.size()) {
    unit_ring.clear();  // the layer's width changed: start over
    sample_ring.clear();
    step_ring.clear();
    unit_head = 0;
    pushed = 0;
  }
  if (pushed == 0) last_active.assign(counts.size(), 0);
  std::size_t slot = 0;
  if (unit_ring.size() < w) {
    slot = unit_ring.size();
    unit_ring.push_back(std::move(counts));
    sample_ring.push_back(per_unit);
    step_ring.push_back(step);
  } else {
    slot = unit_head;
    unit_ring[unit_head] = std::move(counts);
    sample_ring[unit_head] = per_unit;
    step_ring[unit_head] = step;
    unit_head = (unit_head + 1) % w;
  }
  ++pushed;
  if (active_above != activity) {
    rebuild(active_above);
  } else {
    mark_active(slot, pushed);
  }
}

TORCHDBG_INLINE void UnitWindow::rebuild(double active_above) {
  activity = active_above;
  std::fill(last_active.begin(), last_active.end(), 0);
  const int64_t held = static_cast<int64_t>(unit_ring.size());
  for (int64_t n = pushed - held + 1; n <= pushed; ++n) mark_active(index_of(n), n);
}

TORCHDBG_INLINE std::size_t UnitWindow::index_of(int64_t number) const {
  // The oldest held output is at slot 0 while the ring fills, then at unit_head.
  const std::size_t held = unit_ring.size();
  const std::size_t oldest = unit_head % held;
  const auto back = static_cast<std::size_t>(pushed - number);  // 0: the newest
  return (oldest + held - 1 - back) % held;
}

TORCHDBG_INLINE void UnitWindow::mark_active(std::size_t slot, int64_t number) {
  const double limit = activity * static_cast<double>(sample_ring[slot]);
  const std::vector<int64_t>& c = unit_ring[slot];
  for (std::size_t u = 0; u < c.size(); ++u)
    if (static_cast<double>(c[u]) > limit) last_active[u] = number;
}

TORCHDBG_INLINE double UnitWindow::dead_fraction(int64_t window_samples, double active_above,
                                                 int64_t* since) {
  const std::size_t held = unit_ring.size();
  if (held == 0) return detail::kNaN;
  const std::size_t units = unit_ring.front().size();
  if (units == 0) return detail::kNaN;
  // Newest first until the window has enough samples.
  const std::size_t newest = (unit_head + held - 1) % held;
  std::vector<int64_t> active(units, 0);
  int64_t samples = 0;
  for (std::size_t k = 0; k < held && samples < window_samples; ++k) {
    const std::size_t i = (newest + held - k) % held;
    samples += sample_ring[i];
    for (std::size_t u = 0; u < units; ++u) active[u] += unit_ring[i][u];
  }
  if (samples < window_samples) return detail::kNaN;
  if (active_above != activity) rebuild(active_above);
  std::size_t dead = 0;
  int64_t newest_active = 0;  // the newest output in which a dead unit was active
  for (std::size_t u = 0; u < units; ++u) {
    if (static_cast<double>(active[u]) < active_above * static_cast<double>(samples)) {
      ++dead;
      newest_active = std::max(newest_active, last_active[u]);
    }
  }
  if (since != nullptr) {
    // The unbroken inactive run: the held outputs after the newest with a dead unit active.
    *since = step_ring[newest];
    if (dead > 0) {
      const int64_t first = std::max(newest_active + 1, pushed - static_cast<int64_t>(held) + 1);
      if (first <= pushed) *since = step_ring[index_of(first)];
    }
  }
  return static_cast<double>(dead) / static_cast<double>(units);
}

#endif  // TORCHDBG_DEFINITIONS

}  // namespace torchdbg::detail
