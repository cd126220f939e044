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
/// within a share of the step. Each step told (`begin_step` with a new step number) takes the
/// next position, whatever the numbers (epochs restarting, strides, a resumed run), once a
/// step had forward outputs judged (the first positions wait for one): the first
/// `kSkip` judge forward outputs as usual (first calls allocate; baselines warm up), the next
/// `kWindow` form the measuring window, whose middle `kOff` skip them (with, without, with:
/// work that recurs every few steps, such as a gradient accumulation's update, falls in both
/// groups alike, and slow drift cancels). A step's time runs from its `begin_step` to the next
/// one's, counted when steps went forward; it joins the times with or without forward outputs
/// by whether they were judged in it (an alert judges steps the window did not plan). At the
/// end of the window forward outputs are judged on every `n`-th position from there: 1 when
/// the median with is within the budget of the median without, else the smallest n that
/// brings their cost per step within it, at most kMaxInterval. A window with fewer than 3
/// times of either kind measures again.
///
/// Thread safety: begin_step and reset from one thread at a time (the monitor's lock, on the
/// thread that calls set_step); forward_due and interval from any thread, lock-free. A step's
/// answer is the same asked before its begin_step (as the next step) or after it.
class ForwardBudget {
 public:
  static constexpr int64_t kSkip = 10;
  static constexpr int64_t kWindow = 20;
  static constexpr int64_t kOffFrom = 7;  // positions [kOffFrom, kOffFrom + kOff) of the window skip
  static constexpr int64_t kOff = 6;
  static constexpr int64_t kMaxInterval = 10;

  /// `share` in (0, 1): what judging forward outputs may add to a step, relative to a step
  /// without them. 0: off (every step judged; begin_step does nothing).
  explicit ForwardBudget(double share) : share_(share) {}

  [[nodiscard]] bool enabled() const noexcept { return share_ > 0.0; }

  /// Whether the window plans forward outputs at `pos` (true before it and after it).
  [[nodiscard]] static bool planned(int64_t pos) noexcept {
    return pos < kOffFrom || pos >= kOffFrom + kOff;
  }

  /// Step `step` begins at `now_ns` (a steady clock's nanoseconds); `judged`: whether forward
  /// outputs were judged in the step told before. Returns true when this call chose the
  /// interval.
  bool begin_step(int64_t step, int64_t now_ns, bool judged) {
    if (!enabled()) return false;
    if (!told_.load(std::memory_order_relaxed)) {
      pos_.store(-kSkip, std::memory_order_relaxed);
      last_step_.store(step, std::memory_order_relaxed);
      told_.store(true, std::memory_order_release);
      last_ns_ = now_ns;
      return false;
    }
    const int64_t last = last_step_.load(std::memory_order_relaxed);
    if (step == last) {  // the same step told again: it begins now
      last_ns_ = now_ns;
      return false;
    }
    int64_t pos = pos_.load(std::memory_order_relaxed);
    if (pos == -kSkip && !judged) {
      // Nothing judged since the first step told (installed at the manager's step before a
      // run starting elsewhere, or no watched output yet): the warm-up starts here.
      last_step_.store(step, std::memory_order_relaxed);
      last_ns_ = now_ns;
      return false;
    }
    bool chose = false;
    if (!decided()) {
      if (step > last && pos >= 0 && pos < kWindow)
        (judged ? on_ : off_).push_back(static_cast<double>(now_ns - last_ns_));
      if (pos + 1 >= kWindow) {
        if (on_.size() >= 3 && off_.size() >= 3) {
          choose(pos + 1);
          chose = true;
        } else {
          pos = -1;  // too few times of one kind: this step starts the window again
          on_.clear();
          off_.clear();
        }
      }
    }
    // (A due check on another thread while set_step runs may see the old step or the new.)
    last_step_.store(step, std::memory_order_relaxed);
    pos_.store(pos + 1, std::memory_order_relaxed);
    last_ns_ = now_ns;
    return chose;
  }

  /// Whether forward outputs of `step` are due (alerts aside): `step` is the step told last,
  /// or the next one to be told.
  [[nodiscard]] bool forward_due(int64_t step) const noexcept {
    if (!enabled() || !told_.load(std::memory_order_acquire)) return true;
    int64_t pos = pos_.load(std::memory_order_relaxed);
    if (step != last_step_.load(std::memory_order_relaxed)) ++pos;
    const int64_t n = interval_.load(std::memory_order_relaxed);
    if (n > 0) return pos >= chosen_at_.load(std::memory_order_relaxed) &&
                      (pos - chosen_at_.load(std::memory_order_relaxed)) % n == 0;
    return planned(pos);  // before the window and after it too
  }

  /// The interval chosen; 0 while measuring.
  [[nodiscard]] int64_t interval() const noexcept { return interval_.load(std::memory_order_relaxed); }
  [[nodiscard]] bool decided() const noexcept { return interval() > 0; }
  /// (with - without) / without as measured (at least 0); nullopt until chosen.
  [[nodiscard]] std::optional<double> measured_share() const { return measured_; }
  /// The median step time without forward outputs judged, in ns; nullopt until chosen.
  [[nodiscard]] std::optional<double> step_ns() const { return step_ns_; }

  /// Measures again from the next step told (HealthMonitor::reset).
  void reset() {
    interval_.store(0, std::memory_order_relaxed);
    told_.store(false, std::memory_order_relaxed);
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
  static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const std::size_t k = v.size() / 2;
    return v.size() % 2 == 1 ? v[k] : 0.5 * (v[k - 1] + v[k]);
  }

  /// Chooses the interval, counted from position `at` (judged there).
  void choose(int64_t at) {
    const double on = median(on_), off = median(off_);
    measured_ = off > 0.0 ? std::max(0.0, (on - off) / off) : std::numeric_limits<double>::quiet_NaN();
    step_ns_ = off;
    chosen_at_.store(at, std::memory_order_relaxed);
    interval_.store(interval_for(*measured_, share_), std::memory_order_relaxed);
    on_.clear();
    off_.clear();
  }

  double share_;
  std::atomic<int64_t> interval_{0};
  std::atomic<int64_t> chosen_at_{0};  // the position the interval counts from
  std::atomic<bool> told_{false};      // a step was told since construction or reset
  std::atomic<int64_t> pos_{0};        // the position of the step told last
  std::atomic<int64_t> last_step_{0};  // the step told last
  int64_t last_ns_ = 0;
  std::vector<double> on_, off_;
  std::optional<double> measured_, step_ns_;
};

}  // namespace torchdbg::detail
