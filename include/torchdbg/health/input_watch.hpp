// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The health monitor's watch on the model's input: NaN/Inf in it, and its scale against its
// own history (FailureKind::BadInput at layer "input"). Internal to the monitor.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/health/ledger.hpp"
#include "torchdbg/health/options.hpp"
#include "torchdbg/health/records.hpp"

namespace torchdbg::detail {

/// The model's input as attach saw it on the step's first module output of each attach
/// session (`first`: that layer's name). Not thread-safe: the monitor's lock guards it.
class InputWatch {
 public:
  explicit InputWatch(const HealthOptions& options) : options_(options) {}

  /// NaN/Inf in the input is the data's failure, and no layer is its origin: returns true
  /// then (what follows in the forward is its consequence). A finite input's scale is judged.
  /// `after_non_finite`: a layer's output before it in the step was non-finite (its NaN is
  /// that layer's, not judged); `after_failure`: or exploding (its scale is not judged).
  bool observe(std::string_view first, int64_t step, const ActivationInfo& info,
               HealthLedger& ledger, Pauses& pauses, bool after_non_finite = false,
               bool after_failure = false);
  void clear();

 private:
  /// The input's RMS against its own baseline (HealthOptions::input_scale_jump).
  void scale(std::string_view first, int64_t step, const ActivationInfo& info, HealthLedger& ledger,
             Pauses& pauses);

  /// The scale of each attached model's input (keyed by its first layer).
  struct InputScale {
    double log_base = kNaN;      // EMA of log(RMS) over healthy steps
    double log_var = 0.0;        // EMA of its squared deviations
    std::vector<double> warmup;  // log(RMS) of the first steps: their median starts it
    int64_t last_step = -1;
    int64_t persist = 0;
    std::optional<std::size_t> incident;  // the shift going on
  };
  /// A shift must also be this many of the baseline's own standard deviations (log RMS).
  static constexpr double kInputScaleSigmas = 4.0;
  /// Inputs with fewer finite elements are not judged (one sample of a few features).
  static constexpr int64_t kInputScaleMinCount = 16;

  const HealthOptions& options_;
  bool input_bad_ = false;  // the last observed model input held NaN/Inf
  int64_t input_persist_ = 0;
  std::optional<std::size_t> input_incident_;
  std::map<std::string, InputScale, std::less<>> input_scales_;
};

#if TORCHDBG_DEFINITIONS

TORCHDBG_INLINE bool InputWatch::observe(std::string_view first, int64_t step,
                                         const ActivationInfo& info, HealthLedger& ledger,
                                         Pauses& pauses, bool after_non_finite,
                                         bool after_failure) {
  const int64_t bad = info.input_nan + info.input_inf;
  if (bad == 0) {
    input_bad_ = false;
    input_incident_.reset();
    if (!after_failure) scale(first, step, info, ledger, pauses);
    return false;
  }
  if (after_non_finite) return true;
  if (input_bad_) {  // still bad: the same incident goes on
    ++input_persist_;
    if (input_incident_)
      ledger.update_incident(*input_incident_, step, 1.0, input_persist_, static_cast<double>(bad));
    return true;
  }
  input_bad_ = true;
  input_persist_ = 1;
  SemanticEvent e;
  e.type = EventType::NonFiniteInput;
  e.layer = "input";
  e.step = step;
  e.from = "finite";
  e.to = "non_finite";
  e.confidence = detail::evidence_confidence(1.0, 1, options_.persistence_steps());
  e.metadata = {
      {"nan", info.input_nan}, {"inf", info.input_inf}, {"first_layer", std::string(first)}};
  const uint64_t id = ledger.emit(std::move(e));
  const Subject pseudo{"input", "input", -1, {}};  // before every layer
  input_incident_ = ledger.add_incident(FailureKind::BadInput, pseudo, step, Phase::Forward, 1.0,
                                        static_cast<double>(bad), 0.0, id);
  if (input_incident_) {  // not dropped at capacity
    Incident& inc = ledger.incident(*input_incident_);
    inc.details["nan"] = info.input_nan;
    inc.details["inf"] = info.input_inf;
    inc.details["first_layer"] = std::string(first);
    ledger.pause_for(*input_incident_, step, pauses);
  }
  return true;
}

TORCHDBG_INLINE void InputWatch::scale(std::string_view first, int64_t step,
                                       const ActivationInfo& info, HealthLedger& ledger,
                                       Pauses& pauses) {
  const double jump = options_.input_scale_jump();
  // The raw data's scale where attach saw it mixed with what deliveries made.
  const std::optional<double>& rms = info.input_data_rms ? info.input_data_rms : info.input_rms;
  if (!(jump > 1.0) || !rms || !(*rms > 0.0) || !std::isfinite(*rms) ||
      (info.input_count >= 0 && info.input_count < kInputScaleMinCount))
    return;
  auto it = input_scales_.find(first);
  if (it == input_scales_.end()) {
    if (input_scales_.size() >= options_.max_layers()) return;
    it = input_scales_.emplace(first, InputScale{}).first;
  }
  InputScale& S = it->second;
  if (S.last_step == step) return;  // the step's first call only
  S.last_step = step;
  const double log_rms = std::log(*rms);
  const auto warmup = static_cast<std::size_t>(std::max<int64_t>(1, options_.baseline_warmup()));
  // The baseline starts at the first steps' median: one odd batch among them is no baseline.
  if (!std::isfinite(S.log_base)) {
    S.warmup.push_back(log_rms);
    if (S.warmup.size() < warmup) return;
    std::vector<double> v = S.warmup;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    S.log_base = v[v.size() / 2];
    S.log_var = 0.0;
    for (const double x : S.warmup) S.log_var += (x - S.log_base) * (x - S.log_base);
    S.log_var /= static_cast<double>(S.warmup.size());
    S.warmup.clear();
    return;
  }
  const double dev = log_rms - S.log_base;
  const double ratio = std::exp(dev);
  const bool shifted = std::fabs(dev) >= std::log(jump) &&
                       std::fabs(dev) >= kInputScaleSigmas * std::sqrt(S.log_var);
  if (!shifted) {  // the usual scale
    S.persist = 0;
    S.incident.reset();
    const double m = options_.baseline_momentum();
    S.log_base = m * S.log_base + (1.0 - m) * log_rms;
    S.log_var = m * S.log_var + (1.0 - m) * dev * dev;
    return;
  }
  const double margin = detail::decade_margin(ratio >= jump ? ratio : 1.0 / ratio, jump);
  if (S.persist > 0) {  // still shifted: the same incident goes on
    ++S.persist;
    if (S.incident) ledger.update_incident(*S.incident, step, margin, S.persist, ratio);
    // A scale kept this long is the data's new scale: the baseline starts again.
    if (S.persist >= 4 * static_cast<int64_t>(warmup)) {
      S = InputScale{};
      S.last_step = step;
    }
    return;
  }
  S.persist = 1;
  const double base_rms = std::exp(S.log_base);
  SemanticEvent e;
  e.type = EventType::InputScaleShift;
  e.layer = "input";
  e.step = step;
  e.from = "usual_scale";
  e.to = ratio >= jump ? "scaled_up" : "scaled_down";
  e.confidence = detail::evidence_confidence(margin, 1, options_.persistence_steps());
  e.metadata = {{"rms", *rms},
                {"baseline_rms", base_rms},
                {"ratio", ratio},
                {"first_layer", std::string(first)},
                {"mixed", info.input_data_rms.has_value()}};
  const uint64_t id = ledger.emit(std::move(e));
  const Subject pseudo{"input", "input", -1, {}};  // before every layer
  S.incident = ledger.add_incident(FailureKind::BadInput, pseudo, step, Phase::Forward, margin,
                                   ratio, jump, id);
  if (S.incident) {  // not dropped at capacity
    Incident& inc = ledger.incident(*S.incident);
    inc.details["rms"] = *rms;
    inc.details["baseline_rms"] = base_rms;
    inc.details["ratio"] = ratio;
    inc.details["first_layer"] = std::string(first);
    if (info.input_data_rms) inc.details["mixed"] = true;  // the raw part of what it read
    ledger.pause_for(*S.incident, step, pauses);
  }
}

TORCHDBG_INLINE void InputWatch::clear() {
  input_bad_ = false;
  input_persist_ = 0;
  input_incident_.reset();
  input_scales_.clear();
}

#endif  // TORCHDBG_DEFINITIONS

}  // namespace torchdbg::detail
