// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// HealthOptions::activation_budget: how often the health monitor judges forward outputs,
// chosen from step times measured with and without them. Internal to the monitor.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace torchdbg::detail {

/// Measures what judging forward outputs adds to a step and picks the interval that keeps it
/// within a share of the step. From the first step it is told of, `kSkip` steps judge forward
/// outputs as usual (first calls allocate; baselines warm up); the next `2 * kSamples` steps
/// judge them on every other step, and the step times (from one `begin_step` to the next, of
/// consecutive steps) give the medians with (`on`) and without (`off`). At the step after,
/// forward outputs are judged every `n`-th step: 1 when (on - off) / off is within the budget,
/// else the smallest n that brings that cost per step within it, at most kMaxInterval. A
/// window with fewer than 3 times of either kind (steps skipped, restarted) measures again.
/// Steps are counted one by one (as HookTrigger::every_n_steps counts them): where they never
/// follow each other, nothing is measured and forward outputs are judged on every step.
///
/// Thread safety: begin_step from one thread at a time (the monitor's lock); forward_due and
/// interval from any thread, lock-free.
class ForwardBudget {
 public:
  static constexpr int64_t kSkip = 10;
  static constexpr int64_t kSamples = 10;
  static constexpr int64_t kMaxInterval = 10;

  /// `share` in (0, 1): what judging forward outputs may add to a step, relative to a step
  /// without them. 0: off (every step judged; begin_step does nothing).
  explicit ForwardBudget(double share) : share_(share) {}

  [[nodiscard]] bool enabled() const noexcept { return share_ > 0.0; }

  /// Step `step` begins at `now_ns` (a steady clock's nanoseconds). Returns true when this
  /// call chose the interval.
  bool begin_step(int64_t step, int64_t now_ns) {
    if (!enabled()) return false;
    const bool consecutive =
        have_last_ && last_step_ < std::numeric_limits<int64_t>::max() && step == last_step_ + 1;
    if (!consecutive && have_last_ && step < last_step_ && !decided()) window_at(step, kSkip);  // restarted
    if (!have_last_) window_at(step, kSkip);
    bool chose = false;
    const int64_t from = from_.load(std::memory_order_relaxed);
    if (!decided()) {
      // The step that just ended: last_step_, measured if it lay in the window.
      if (consecutive && last_step_ >= from && last_step_ < from + 2 * kSamples)
        ((last_step_ - from) % 2 == 0 ? on_ : off_).push_back(static_cast<double>(now_ns - last_ns_));
      if (step >= from + 2 * kSamples) {
        if (on_.size() >= 3 && off_.size() >= 3) {
          choose();
          chose = true;
        } else {
          window_at(step, 0);  // too few times: measure from this step again
        }
      }
    }
    have_last_ = true;
    last_step_ = step;
    last_ns_ = now_ns;
    return chose;
  }

  /// Whether forward outputs of `step` are judged (alerts aside).
  [[nodiscard]] bool forward_due(int64_t step) const noexcept {
    if (!enabled()) return true;
    const int64_t n = interval_.load(std::memory_order_relaxed);
    if (n > 0) return step % n == 0;
    const int64_t from = from_.load(std::memory_order_relaxed);
    if (step < from || step - from >= 2 * kSamples) return true;
    return (step - from) % 2 == 0;
  }

  /// The interval chosen; 0 while measuring (forward outputs judged on every other step of
  /// the window, every step before it).
  [[nodiscard]] int64_t interval() const noexcept { return interval_.load(std::memory_order_relaxed); }
  [[nodiscard]] bool decided() const noexcept { return interval() > 0; }
  /// (on - off) / off as measured; nullopt until chosen.
  [[nodiscard]] std::optional<double> measured_share() const { return measured_; }
  /// The median step time without forward outputs judged, in ns; nullopt until chosen.
  [[nodiscard]] std::optional<double> step_ns() const { return step_ns_; }

  /// Measures again from the next step told (HealthMonitor::reset).
  void reset() {
    interval_.store(0, std::memory_order_relaxed);
    from_.store(std::numeric_limits<int64_t>::max(), std::memory_order_relaxed);
    have_last_ = false;
    on_.clear();
    off_.clear();
    measured_.reset();
    step_ns_.reset();
  }

  /// The interval for a measured cost `share` of a step and a budget: 1 within the budget,
  /// else ceil(share / budget) up to kMaxInterval.
  [[nodiscard]] static int64_t interval_for(double share, double budget) noexcept {
    if (!(share > budget)) return 1;  // NaN: measured nothing to save
    const double n = std::ceil(share / budget);
    return n >= static_cast<double>(kMaxInterval) ? kMaxInterval : std::max<int64_t>(2, static_cast<int64_t>(n));
  }

 private:
  void window_at(int64_t step, int64_t skip) {
    const int64_t from = step > std::numeric_limits<int64_t>::max() - skip - 2 * kSamples
                             ? std::numeric_limits<int64_t>::max() - 2 * kSamples
                             : step + skip;
    from_.store(from, std::memory_order_relaxed);
    on_.clear();
    off_.clear();
  }

  static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const std::size_t k = v.size() / 2;
    return v.size() % 2 == 1 ? v[k] : 0.5 * (v[k - 1] + v[k]);
  }

  void choose() {
    const double on = median(on_), off = median(off_);
    measured_ = off > 0.0 ? (on - off) / off : std::numeric_limits<double>::quiet_NaN();
    step_ns_ = off;
    interval_.store(interval_for(*measured_, share_), std::memory_order_relaxed);
  }

  double share_;
  std::atomic<int64_t> interval_{0};
  std::atomic<int64_t> from_{std::numeric_limits<int64_t>::max()};
  bool have_last_ = false;
  int64_t last_step_ = 0;
  int64_t last_ns_ = 0;
  std::vector<double> on_, off_;
  std::optional<double> measured_, step_ns_;
};

}  // namespace torchdbg::detail
