// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Health rules: what counts as dead, saturated, exploding, vanishing or diverging.
//
// A HealthMonitor (health/monitor.hpp) measures what the training loop delivers — an output's
// RMS, its gain over its input, the fraction of dead units over a window, the saturated
// fraction, a layer's gradient norm and its baseline, the recent losses — and hands those
// signals to its rules. A rule looks at one signal and returns a Finding when something is
// wrong; the monitor turns findings into states, semantic events, incidents, pauses and,
// through diagnose(), hypotheses. The built-in rules below are the defaults; a user rule
// derives from HealthRule and is added with `HealthOptions::rules` or
// `HealthMonitor::add_rule`.
//
// ```cpp
// // Flags module outputs whose mean drifts far from zero.
// struct MeanDrift : torchdbg::HealthRule {
//   std::string name() const override { return "mean_drift"; }
//   std::optional<torchdbg::Finding> check_activation(const torchdbg::ActivationSignals& s) override {
//     if (!s.module_output || !(std::fabs(s.stats.mean) > 3.0 * s.stats.std)) return std::nullopt;
//     return torchdbg::Finding::custom("mean_drift", std::fabs(s.stats.mean) / s.stats.std, 3.0,
//                                      "output mean far from zero");
//   }
// };
// torchdbg::HealthMonitor health(torchdbg::HealthOptions().rules({std::make_shared<MeanDrift>()}));
// ```
//
// Rules are called under the monitor's lock, one at a time, in order (built-in rules first);
// the first finding for an observation decides its state. A rule used by several monitors
// must be thread-safe itself.

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "torchdbg/detail/text.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg {

/// What went wrong, for incidents and diagnosis hypotheses.
enum class FailureKind {
  BadInput,             ///< the model's input (the data) held NaN/Inf, or its scale jumped
  NonFiniteOutput,      ///< a layer's output became NaN/Inf while its input was finite
  NonFiniteGradient,    ///< the first NaN/Inf gradient in backward order
  ExplodingActivation,  ///< a layer's output scale jumps far above its input's
  ExplodingGradient,
  VanishingGradient,
  DeadUnits,
  Saturation,
  ConstantOutput,  ///< a layer's output is (nearly) the same value everywhere
  /// a BatchNorm's running mean/variance far from its batches' (eval mode would normalize
  /// with other statistics than training does)
  NormStatistics,
  NormWeightCollapse,  ///< a normalization layer's weight fell toward 0 against its own peak
  LossDivergence,  ///< NaN/Inf loss, or one growing steadily by orders of magnitude
  LossSpike,
  LossPlateau,
  Custom,  ///< a user rule's finding (its label and reason are in the incident's details)
};

inline const char* to_string(FailureKind k) noexcept {
  switch (k) {
    case FailureKind::BadInput:
      return "bad_input";
    case FailureKind::NonFiniteOutput:
      return "non_finite_output";
    case FailureKind::NonFiniteGradient:
      return "non_finite_gradient";
    case FailureKind::ExplodingActivation:
      return "exploding_activation";
    case FailureKind::ExplodingGradient:
      return "exploding_gradient";
    case FailureKind::VanishingGradient:
      return "vanishing_gradient";
    case FailureKind::DeadUnits:
      return "dead_units";
    case FailureKind::Saturation:
      return "saturation";
    case FailureKind::ConstantOutput:
      return "constant_output";
    case FailureKind::NormStatistics:
      return "norm_statistics";
    case FailureKind::NormWeightCollapse:
      return "norm_weight_collapse";
    case FailureKind::LossDivergence:
      return "loss_divergence";
    case FailureKind::LossSpike:
      return "loss_spike";
    case FailureKind::LossPlateau:
      return "loss_plateau";
    case FailureKind::Custom:
      return "custom";
  }
  return "?";
}

/// How serious a failure kind is: 2 breaks training, 1 degrades it, 0 is informational.
/// A user rule's finding (Custom) is 1.
inline int failure_tier(FailureKind k) noexcept {
  switch (k) {
    case FailureKind::ConstantOutput:
    case FailureKind::NormStatistics:  // training goes on; evaluation suffers
    case FailureKind::LossSpike:
    case FailureKind::Custom:
      return 1;
    case FailureKind::LossPlateau:
      return 0;
    default:
      return 2;
  }
}

namespace detail {

/// `v` within [0, 1]; NaN (a rule's undefined margin) is 0.
inline double clamp01(double v) noexcept { return !(v > 0.0) ? 0.0 : (v > 1.0 ? 1.0 : v); }

/// log10(a / b) mapped to 0..1 by x / (x + 0.5): 0 at the threshold, 0.67 one decade past.
inline double decade_margin(double a, double b) noexcept {
  if (!(a > 0.0) || !(b > 0.0)) return 1.0;
  const double x = std::log10(a / b);
  return x <= 0.0 ? 0.0 : x / (x + 0.5);
}

/// (value - threshold) over the room above the threshold, for fractions.
inline double fraction_margin(double value, double threshold) noexcept {
  return (value - threshold) / std::max(1e-12, 1.0 - threshold);
}

/// Activations whose units can die (output 0 for every input below a threshold).
inline bool is_dead_capable(std::string_view act) noexcept {
  return act == "relu" || act == "relu6" || act == "threshold";
}
/// Activations with bounded outputs that saturate.
inline bool is_saturating(std::string_view act) noexcept {
  return act == "tanh" || act == "sigmoid" || act == "hardtanh" || act == "hardsigmoid" ||
         act == "softsign";
}

inline std::string fmt_num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

}  // namespace detail

/// What the monitor measured about one forward output (a module's output or the activation
/// applied to it). NaN: not measured for this output.
struct ActivationSignals {
  ActivationSignals(const at::Tensor& output_, const TensorStats& stats_) : output(output_), stats(stats_) {}
  std::string_view layer;   ///< "fc1/relu"
  std::string_view module;  ///< "fc1"
  int64_t step = 0;
  const at::Tensor& output;
  const TensorStats& stats;  ///< numel, finite/NaN/Inf counts, mean, std, min, max
  std::string_view kind;     ///< the activation that produced it ("relu", "tanh"), if known
  bool pre_activation = false;  ///< the output is the input of `kind` (pre_activations)
  /// A module's output that is not a normalization's: its gain is judged.
  bool module_output = false;
  double rms = std::nan("");
  double gain = std::nan("");           ///< output std over its input's RMS
  double gain_baseline = std::nan("");  ///< EMA of the layer's healthy gains once warmed up
  /// The output's spread across the batch (each position's batch mean, a bias among it,
  /// taken out) over its input's RMS, where `gain` is above 1 and there is a batch; else NaN.
  double gain_spread = std::nan("");
  double gain_spread_baseline = std::nan("");  ///< EMA of the healthy spread gains once warmed up
  /// An embedding's output (its call had no input scale: token ids): `gain` and
  /// `gain_baseline` are its std and the EMA of its healthy ones, judged on a jump only.
  bool unscaled_gain = false;
  /// The output's spread across the batch where it tells whether the output is the same for
  /// every sample: a normalization layer's CPU output whose first two samples are alike, or
  /// a module's (not an activation's) whose first two samples are alike at a few positions
  /// while those of its data input differ (a Linear whose weight was zeroed); else NaN.
  double batch_spread = std::nan("");
  double dead_fraction = std::nan("");  ///< ReLU family, once the window holds enough samples
  int64_t dead_since = 0;  ///< the first step of the dead units' unbroken inactive run
  double dead_activity = 0.0;              ///< a unit is dead when active in fewer than this
  double saturated_fraction = std::nan("");  ///< saturating kinds
  /// A BatchNorm's training call (attach's "norm_stats_error"): the RMS over channels of how
  /// far its eval-mode output would be from this training-mode output, in units of the
  /// normalized output (0: the running statistics are the batch's); NaN where not measured
  /// (eval mode, no running statistics, device batches, the running statistics' warm-up).
  double norm_stats_error = std::nan("");
  int64_t norm_samples = 0;     ///< the batch's samples behind `norm_stats_error`
  double norm_momentum = 0.1;   ///< the momentum the running statistics are updated with
  /// The layer's previous `norm_stats_error` and its step (NaN: none).
  double norm_stats_previous = std::nan("");
  int64_t norm_stats_previous_step = 0;
  /// A normalization layer's weight RMS (attach's "norm_weight_rms") and the highest seen for
  /// the layer so far (this one included); NaN: not measured.
  double norm_weight_rms = std::nan("");
  double norm_weight_peak = std::nan("");
  /// A non-finite output with every earlier value of the step (the model's input included)
  /// finite: the step's origin.
  bool origin = false;
  /// Steps in which the output (or a normalization's weight) has been exactly 0 since the
  /// layer's first call; 0 once it was not.
  int64_t zero_steps = 0;
  int64_t zero_since = 0;  ///< the first of those steps
  /// ... for at most `HealthOptions::baseline_warmup` steps: a module zero-initialized on
  /// purpose whose weights have yet to move (LoRA's B, a zero convolution, the last
  /// normalization of a residual branch).
  bool zero_initialized = false;
  /// The call's data input is exactly 0 (attach's `input_rms`): nothing reaches the module.
  bool input_zero = false;
};

/// One module's gradient in one backward pass: the L2 norm over its parameters' gradients.
struct GradientSignals {
  std::string_view layer;
  int64_t step = 0;
  double norm = std::nan("");
  int64_t non_finite = 0;  ///< NaN/Inf gradient elements
  int64_t count = 0;       ///< gradient elements
  double max_norm = 0.0;   ///< the step's largest finite layer norm
  double baseline = std::nan("");  ///< EMA (in log10) of its healthy norms once warmed up
  /// The same EMA from the layer's first healthy norm on, warm-up or not (NaN before it).
  double recent = std::nan("");
  /// The first non-finite gradient in backward order: the backward origin.
  bool origin = false;
  /// A module zero-initialized on purpose (ActivationSignals::zero_initialized) produced an
  /// output in this step: an exactly-zero gradient is its doing. With
  /// HealthOptions::activation_interval above 1, on a step whose outputs are not judged: one
  /// was in its warm-up at the last judged forward, or no forward has been judged yet.
  bool zero_initialized_in_step = false;
  /// The module's gradient was once exactly 0 behind such a module: it sits behind a gate
  /// (LoRA's A, a residual branch, an adaLN-Zero block) and grows with the gate's weights, so a
  /// nonzero norm is judged against its own history only.
  bool gated = false;
  /// The first step of the current run of exactly-zero gradients (-1: the norm is not 0).
  int64_t zero_since = -1;
};

/// The loss of one step with the recent finite losses before it (oldest first; at least the
/// last max(loss_window, plateau_window) of them).
struct LossSignals {
  LossSignals(double loss_, const std::vector<double>& history_) : loss(loss_), history(history_) {}
  int64_t step = 0;
  double loss;
  const std::vector<double>& history;
  double first_loss = std::nan("");  ///< |the first finite loss|
};

/// A rule's verdict on one signal.
struct Finding {
  FailureKind kind = FailureKind::Custom;
  double value = 0.0;      ///< the measured quantity
  double threshold = 0.0;  ///< what it was compared with
  double margin = 0.0;     ///< how far past the threshold, 0..1 (drives confidence)
  std::string reason;      ///< a short text for the event
  /// Extra numbers for the event's metadata and the incident's details.
  nlohmann::json details = nlohmann::json::object();
  /// When the failure began, if before the observation that confirmed it.
  std::optional<int64_t> since;
  /// false: a state and an event, but no incident (a consequence, e.g. a non-finite output
  /// whose input was already non-finite).
  bool incident = true;

  /// A user rule's finding: `label` names what failed ("mean_drift"); the margin comes from
  /// how far `value` is past `threshold` in decades (either direction).
  static Finding custom(std::string label, double value, double threshold, std::string reason) {
    Finding f;
    f.kind = FailureKind::Custom;
    f.value = value;
    f.threshold = threshold;
    f.margin = value >= threshold ? detail::decade_margin(value, threshold)
                                  : detail::decade_margin(threshold, value);
    f.reason = std::move(reason);
    f.details["label"] = std::move(label);
    return f;
  }
};

/// A health rule. Override the checks for the signals it judges; each returns a Finding when
/// the signal is unhealthy. Called under the monitor's lock, in rule order: a rule must not
/// call back into its monitor.
class HealthRule {
 public:
  virtual ~HealthRule() = default;
  /// A short identifier ("dead_units"), kept in the incident's details as "rule".
  [[nodiscard]] virtual std::string name() const = 0;
  virtual std::optional<Finding> check_activation(const ActivationSignals& /*s*/) { return std::nullopt; }
  virtual std::optional<Finding> check_gradient(const GradientSignals& /*s*/) { return std::nullopt; }
  virtual std::optional<Finding> check_loss(const LossSignals& /*s*/) { return std::nullopt; }
};

using HealthRulePtr = std::shared_ptr<HealthRule>;

// ---- built-in activation rules ------------------------------------------------------------

/// NaN/Inf in an output: a NonFiniteOutput incident when it is the step's origin.
class NonFiniteOutputRule : public HealthRule {
 public:
  std::string name() const override { return "non_finite_output"; }
  std::optional<Finding> check_activation(const ActivationSignals& s) override {
    if (s.stats.nan_count + s.stats.inf_count == 0) return std::nullopt;
    Finding f;
    f.kind = FailureKind::NonFiniteOutput;
    const double numel = static_cast<double>(s.stats.numel);
    f.value = numel > 0 ? static_cast<double>(s.stats.nan_count + s.stats.inf_count) / numel : 0.0;
    f.margin = 0.9 + 0.1 * f.value;
    f.details = {{"nan", s.stats.nan_count}, {"inf", s.stats.inf_count}, {"origin", s.origin}};
    f.reason = s.origin ? "first non-finite output of the step (every earlier value of the step was finite)"
                        : "non-finite input";
    f.incident = s.origin;
    return f;
  }
};

struct DeadUnitsRuleOptions {
  /// A layer is dead when more than this fraction of its units are.
  TORCH_ARG(double, fraction) = 0.5;
};

/// ReLU-family units active in fewer than `dead_activity` of the window's samples.
class DeadUnitsRule : public HealthRule {
 public:
  explicit DeadUnitsRule(DeadUnitsRuleOptions o = {}) : o_(o) {}
  std::string name() const override { return "dead_units"; }
  std::optional<Finding> check_activation(const ActivationSignals& s) override {
    if (!(s.dead_fraction > o_.fraction())) return std::nullopt;
    Finding f;
    f.kind = FailureKind::DeadUnits;
    f.value = s.dead_fraction;
    f.threshold = o_.fraction();
    f.margin = detail::fraction_margin(f.value, f.threshold);
    f.details = {{"dead_fraction", f.value}};
    f.reason = "units active in fewer than " + detail::fmt_num(s.dead_activity * 100.0) + "% of samples";
    if (s.dead_since < s.step) {
      f.since = s.dead_since;
      f.details["since"] = s.dead_since;
    }
    return f;
  }
  [[nodiscard]] const DeadUnitsRuleOptions& options() const noexcept { return o_; }

 private:
  DeadUnitsRuleOptions o_;
};

struct SaturationRuleOptions {
  /// A layer is saturated when more than this fraction of its outputs are.
  TORCH_ARG(double, fraction) = 0.25;
};

/// Saturating activations (tanh, sigmoid, ...) past their bounds.
class SaturationRule : public HealthRule {
 public:
  explicit SaturationRule(SaturationRuleOptions o = {}) : o_(o) {}
  std::string name() const override { return "saturation"; }
  std::optional<Finding> check_activation(const ActivationSignals& s) override {
    if (!(s.saturated_fraction > o_.fraction())) return std::nullopt;
    Finding f;
    f.kind = FailureKind::Saturation;
    f.value = s.saturated_fraction;
    f.threshold = o_.fraction();
    f.margin = detail::fraction_margin(f.value, f.threshold);
    f.details = {{"saturated_fraction", f.value}};
    f.reason = std::string(s.kind) +
               (s.pre_activation ? " pre-activation beyond its saturation bound" : " output saturated");
    return f;
  }
  [[nodiscard]] const SaturationRuleOptions& options() const noexcept { return o_; }

 private:
  SaturationRuleOptions o_;
};

struct ExplodingActivationRuleOptions {
  /// Output spread across the batch above this multiple of its input's RMS is an
  /// explosion (an output that is mostly its bias, under small inputs, is not amplified by
  /// its weights; the whole std is judged where there is no batch or the gain is below 1)...
  TORCH_ARG(double, gain) = 10.0;
  /// ...unless the layer's own healthy gains (its baseline, once known) reach it: then the
  /// limit is this multiple of the baseline (a classifier head whose logits grow as it learns).
  TORCH_ARG(double, tolerance) = 3.0;
  /// A jump to this multiple of the baseline is an explosion at any gain above `min_gain`.
  TORCH_ARG(double, jump) = 10.0;
  TORCH_ARG(double, min_gain) = 2.0;
  /// An embedding's output (no input scale: token ids) whose std jumps to this multiple of
  /// its own history. Its std also moves with what the batch holds (the share of padding,
  /// a bag's size) and as a small initialization first learns: only a jump this far counts.
  TORCH_ARG(double, unscaled_jump) = 100.0;
};

/// A module output whose spread jumps far above its input's scale.
class ExplodingActivationRule : public HealthRule {
 public:
  explicit ExplodingActivationRule(ExplodingActivationRuleOptions o = {}) : o_(o) {}
  std::string name() const override { return "exploding_activation"; }
  std::optional<Finding> check_activation(const ActivationSignals& s) override {
    if (!s.module_output || !std::isfinite(s.gain)) return std::nullopt;
    if (s.unscaled_gain) {
      // No input to compare with: the output's std against its own history.
      if (!(s.gain_baseline > 0.0) || !(s.gain > o_.unscaled_jump() * s.gain_baseline)) return std::nullopt;
      Finding f;
      f.kind = FailureKind::ExplodingActivation;
      f.value = s.gain / s.gain_baseline;
      f.threshold = o_.unscaled_jump();
      f.margin = detail::decade_margin(f.value, f.threshold);
      f.details = {{"std", s.gain}, {"usual_std", s.gain_baseline}, {"measure", "std_jump"}};
      f.reason = "output std " + detail::fmt_num(f.value) + "x its usual (no input scale)";
      return f;
    }
    // With the layer's own healthy gain known: a head whose logits grew as it learned may
    // exceed `gain` up to `tolerance` times its history, and a jump of `jump` times its
    // history is an explosion even below `gain`.
    const auto limit_of = [&](double baseline) {
      return std::isfinite(baseline) ? std::min(std::max(o_.gain(), o_.tolerance() * baseline),
                                                std::max(o_.min_gain(), o_.jump() * baseline))
                                     : o_.gain();
    };
    // An output that is mostly its bias (less than half of its std varies between samples,
    // in its history once known: small inputs) is judged on its spread across the batch
    // instead. Its whole std grows with the bias (in healthy training from zero-initialised
    // biases, several times in a few steps): there only a `jump` over its history counts, as
    // weights blown up on an input alike for every sample give.
    // A batch of one has no spread across the batch: its spread is the std with the module's
    // own bias taken out (attach's std_less_bias, a Linear's or Conv's), always the measure;
    // without it, only a `jump` over the layer's history counts.
    const bool one_sample = s.output.defined() && s.output.dim() >= 2 && s.output.size(0) == 1;
    const bool history = std::isfinite(s.gain_baseline) && std::isfinite(s.gain_spread_baseline);
    const bool spread = std::isfinite(s.gain_spread) &&
                        (one_sample || (history ? s.gain_spread_baseline < 0.5 * s.gain_baseline
                                                : s.gain_spread < 0.5 * s.gain));
    if (one_sample && !spread && !std::isfinite(s.gain_baseline)) return std::nullopt;
    double gain = spread ? s.gain_spread : s.gain;
    double baseline = spread ? s.gain_spread_baseline : s.gain_baseline;
    double limit = one_sample && !spread ? std::max(o_.min_gain(), o_.jump() * s.gain_baseline) : limit_of(baseline);
    bool whole = !spread;
    if (spread && !one_sample && std::isfinite(s.gain_baseline)) {
      const double jump_limit = std::max(o_.min_gain(), o_.jump() * s.gain_baseline);
      if (s.gain > jump_limit && !(gain / limit >= s.gain / jump_limit)) {
        gain = s.gain;
        baseline = s.gain_baseline;
        limit = jump_limit;
        whole = true;
      }
    }
    if (!(gain > limit)) return std::nullopt;
    Finding f;
    f.kind = FailureKind::ExplodingActivation;
    f.value = gain;
    f.threshold = limit;
    f.margin = detail::decade_margin(gain, limit);
    f.details = {{"gain", gain}};
    if (std::isfinite(baseline)) f.details["gain_baseline"] = baseline;
    f.details["measure"] = whole ? "std" : one_sample ? "std_less_bias" : "batch_spread";
    f.reason = std::string(whole        ? "output std "
                           : one_sample ? "output std without its bias "
                                        : "output spread across the batch ") +
               detail::fmt_num(gain) + "x its input's RMS";
    return f;
  }
  [[nodiscard]] const ExplodingActivationRuleOptions& options() const noexcept { return o_; }

 private:
  ExplodingActivationRuleOptions o_;
};

struct ConstantOutputRuleOptions {
  /// Output std, or its spread across the batch, below this fraction of its RMS (with >= 2
  /// elements, or samples): near-constant.
  TORCH_ARG(double, ratio) = 1e-6;
  /// A normalization's output the same for every sample is its doing only where its weight
  /// RMS is below this fraction of the output's RMS (the output is its bias); with a weight
  /// that passes the normalized input on (attach reports 1 for a normalization without one),
  /// the samples were alike before it (a vectorised environment's copies reset together) and
  /// nothing is reported. A weight RMS not known (no attach metadata): judged as constant.
  TORCH_ARG(double, norm_weight_ratio) = 1e-3;
};

/// An output that is (nearly) one value everywhere, or the same for every sample of the batch
/// where `batch_spread` is measured (a normalization whose weight collapsed to 0 outputs its
/// bias for every input, ConstantOutputRuleOptions::norm_weight_ratio; a Linear or Conv
/// whose weight was zeroed, its bias, for an input that varies). A ReLU-family output that is all zero is left to the dead-units rule
/// (its window confirms it), and a module zero-initialized on purpose
/// (ActivationSignals::zero_initialized) to its warm-up: still exactly 0 after it, it is stuck.
class ConstantOutputRule : public HealthRule {
 public:
  explicit ConstantOutputRule(ConstantOutputRuleOptions o = {}) : o_(o) {}
  std::string name() const override { return "constant_output"; }
  std::optional<Finding> check_activation(const ActivationSignals& s) override {
    const TensorStats& st = s.stats;
    if (detail::is_dead_capable(s.kind) && !(s.rms > 0.0)) return std::nullopt;
    if (s.zero_initialized) return std::nullopt;  // constant by construction, for now
    if (!(st.numel >= 2 && st.finite_count == st.numel && std::isfinite(s.rms))) return std::nullopt;
    const bool everywhere = st.std <= o_.ratio() * s.rms;
    if (!everywhere && !(s.batch_spread <= o_.ratio() * s.rms)) return std::nullopt;
    if (!everywhere && std::isfinite(s.norm_weight_rms) && !(s.norm_weight_rms < o_.norm_weight_ratio() * s.rms))
      return std::nullopt;  // the normalized input was alike across the batch
    const double spread = everywhere ? st.std : s.batch_spread;
    Finding f;
    f.kind = FailureKind::ConstantOutput;
    f.value = s.rms > 0.0 ? spread / s.rms : 0.0;
    f.threshold = o_.ratio();
    f.margin = f.value > 0.0 ? detail::decade_margin(f.threshold, f.value) : 1.0;
    f.details = {{"std", st.std}};
    if (!everywhere) {
      f.details["batch_spread"] = s.batch_spread;
      if (std::isfinite(s.norm_weight_rms)) f.details["weight_rms"] = s.norm_weight_rms;
    }
    f.reason = everywhere ? "near-constant output" : "the same output for every sample";
    if (s.input_zero && !(s.rms > 0.0)) {
      f.details["input_zero"] = true;
      f.reason = "exactly 0: its input is exactly 0 (nothing reaches it)";
    } else if (s.zero_steps > 0) {
      f.details["zero_steps"] = s.zero_steps;
      f.since = s.zero_since;  // exactly 0 from then on
      f.reason = (everywhere ? "exactly 0 since its first call, " : "the same output for every sample since its first call, ") +
                 std::to_string(s.zero_steps) +
                 " steps: a zero-initialized module whose weights do not move (frozen, or no "
                 "gradient reaches them)";
    }
    return f;
  }
  [[nodiscard]] const ConstantOutputRuleOptions& options() const noexcept { return o_; }

 private:
  ConstantOutputRuleOptions o_;
};

struct NormStatisticsRuleOptions {
  /// The running statistics' error (ActivationSignals::norm_stats_error) above which they are
  /// off: an eval-mode output a whole standard deviation away from the training-mode one.
  TORCH_ARG(double, limit) = 1.0;
  /// ... and above this many times the error that sampling alone makes (a batch's mean and
  /// variance scatter around the running ones, which scatter too: sqrt(1.5 / samples x
  /// (1 + m / (2 - m))) for momentum m).
  TORCH_ARG(double, noise_factor) = 4.0;
  /// Batches with fewer samples are not judged.
  TORCH_ARG(int64_t, min_samples) = 4;
};

/// A BatchNorm whose running mean and variance are far from the statistics of the batches it
/// normalizes in training: the model in eval mode computes something else than it was
/// trained to (frozen or stale running statistics, a momentum of 0, buffers loaded from
/// another model). Judged from the running statistics' warm-up on (1% weight left to their
/// initial values), on two calls in a row (one batch far out is sampling, not staleness); the
/// finding dates from the first. Running statistics a NaN batch poisoned are infinitely off.
class NormStatisticsRule : public HealthRule {
 public:
  explicit NormStatisticsRule(NormStatisticsRuleOptions o = {}) : o_(o) {}
  std::string name() const override { return "norm_statistics"; }
  std::optional<Finding> check_activation(const ActivationSignals& s) override {
    if (std::isnan(s.norm_stats_error) || s.norm_samples < std::max<int64_t>(o_.min_samples(), 2))
      return std::nullopt;
    const double m = std::clamp(s.norm_momentum, 0.0, 1.0);
    const double noise = std::sqrt(1.5 / static_cast<double>(s.norm_samples) * (1.0 + m / (2.0 - m)));
    const double limit = std::max(o_.limit(), o_.noise_factor() * noise);
    if (!(s.norm_stats_error > limit && s.norm_stats_previous > limit)) return std::nullopt;
    Finding f;
    f.kind = FailureKind::NormStatistics;
    f.value = s.norm_stats_error;
    f.threshold = limit;
    f.margin = detail::decade_margin(f.value, f.threshold);
    f.details = {{"norm_stats_error", s.norm_stats_error}, {"samples", s.norm_samples}};
    f.since = s.norm_stats_previous_step;
    f.reason = "running statistics " + detail::fmt_num(s.norm_stats_error) +
               " standard deviations (RMS over channels) from the batch's: eval mode normalizes "
               "differently";
    return f;
  }
  [[nodiscard]] const NormStatisticsRuleOptions& options() const noexcept { return o_; }

 private:
  NormStatisticsRuleOptions o_;
};

struct NormWeightCollapseRuleOptions {
  /// A normalization layer's weight RMS below this fraction of the highest it had: collapsed.
  TORCH_ARG(double, fraction) = 0.1;
  /// Output spread below this fraction of its RMS is left to the constant-output rule.
  TORCH_ARG(double, constant_ratio) = 1e-6;
};

/// A normalization layer (BatchNorm, LayerNorm, GroupNorm, ...) whose weight shrank toward 0
/// against its own history (weight decay on norm weights, a destructive update): the layer
/// passes less and less of its input on, and the gradients before it fade. Once its output is
/// the same for every sample, the constant-output rule reports it.
class NormWeightCollapseRule : public HealthRule {
 public:
  explicit NormWeightCollapseRule(NormWeightCollapseRuleOptions o = {}) : o_(o) {}
  std::string name() const override { return "norm_weight_collapse"; }
  std::optional<Finding> check_activation(const ActivationSignals& s) override {
    if (!std::isfinite(s.norm_weight_rms) || !(s.norm_weight_peak > 0.0)) return std::nullopt;
    const double ratio = s.norm_weight_rms / s.norm_weight_peak;
    if (!(ratio < o_.fraction())) return std::nullopt;
    if (s.stats.numel >= 2 &&
        (s.stats.std <= o_.constant_ratio() * s.rms || s.batch_spread <= o_.constant_ratio() * s.rms))
      return std::nullopt;  // constant already
    Finding f;
    f.kind = FailureKind::NormWeightCollapse;
    f.value = ratio;
    f.threshold = o_.fraction();
    f.margin = ratio > 0.0 ? detail::decade_margin(f.threshold, ratio) : 1.0;
    f.details = {{"weight_rms", s.norm_weight_rms}, {"peak_weight_rms", s.norm_weight_peak}};
    f.reason = "weight RMS " + detail::fmt_num(s.norm_weight_rms) + ", " + detail::fmt_num(100.0 * ratio) +
               "% of its peak " + detail::fmt_num(s.norm_weight_peak);
    return f;
  }
  [[nodiscard]] const NormWeightCollapseRuleOptions& options() const noexcept { return o_; }

 private:
  NormWeightCollapseRuleOptions o_;
};

// ---- built-in gradient rules --------------------------------------------------------------

/// NaN/Inf in a layer's gradient: a NonFiniteGradient incident at the backward origin.
class NonFiniteGradientRule : public HealthRule {
 public:
  std::string name() const override { return "non_finite_gradient"; }
  std::optional<Finding> check_gradient(const GradientSignals& s) override {
    if (s.non_finite == 0 && std::isfinite(s.norm)) return std::nullopt;
    Finding f;
    f.kind = FailureKind::NonFiniteGradient;
    f.value = s.count > 0 ? static_cast<double>(s.non_finite) / static_cast<double>(s.count) : 1.0;
    f.margin = 0.9 + 0.1 * f.value;
    f.details = {{"non_finite", s.non_finite}, {"origin", s.origin}};
    f.incident = s.origin;
    return f;
  }
};

struct ExplodingGradientRuleOptions {
  /// Norm above this, and above `growth` times the layer's recent norms (GradientSignals::
  /// recent, an EMA from its first healthy norm on): exploding. A norm large from the layer's
  /// first step on and steady, or growing as slowly as its weights (a regression on
  /// unnormalised targets), is the loss's scale, not an explosion.
  TORCH_ARG(double, norm) = 1e3;
  TORCH_ARG(double, growth) = 10.0;
  /// Norm above this multiple of the layer's baseline: exploding.
  TORCH_ARG(double, jump) = 100.0;
};

class ExplodingGradientRule : public HealthRule {
 public:
  explicit ExplodingGradientRule(ExplodingGradientRuleOptions o = {}) : o_(o) {}
  std::string name() const override { return "exploding_gradient"; }
  std::optional<Finding> check_gradient(const GradientSignals& s) override {
    const double grown = std::isfinite(s.recent) ? std::max(o_.norm(), o_.growth() * s.recent) : detail::kInf;
    const double jumped = std::isfinite(s.baseline) ? o_.jump() * s.baseline : detail::kInf;
    const double threshold = std::min(grown, jumped);
    if (!(s.norm > threshold)) return std::nullopt;
    Finding f;
    f.kind = FailureKind::ExplodingGradient;
    f.value = s.norm;
    f.threshold = threshold;
    f.margin = detail::decade_margin(s.norm, f.threshold);
    if (std::isfinite(s.recent)) f.details = {{"recent", s.recent}};
    return f;
  }
  [[nodiscard]] const ExplodingGradientRuleOptions& options() const noexcept { return o_; }

 private:
  ExplodingGradientRuleOptions o_;
};

struct VanishingGradientRuleOptions {
  /// Norm below this: vanishing.
  TORCH_ARG(double, norm) = 1e-7;
  /// Norm below this fraction of the step's largest layer norm: vanishing.
  TORCH_ARG(double, ratio) = 1e-4;
  /// Norm below the layer's baseline divided by this: vanishing.
  TORCH_ARG(double, collapse) = 1e4;
};

class VanishingGradientRule : public HealthRule {
 public:
  explicit VanishingGradientRule(VanishingGradientRuleOptions o = {}) : o_(o) {}
  std::string name() const override { return "vanishing_gradient"; }
  std::optional<Finding> check_gradient(const GradientSignals& s) override {
    // Nothing flows back through a module zero-initialized on purpose until its weights move.
    if (s.norm == 0.0 && s.zero_initialized_in_step) return std::nullopt;
    const bool base = std::isfinite(s.baseline);
    const bool own_history_only = s.gated && s.norm > 0.0;
    if (own_history_only ? !(base && s.norm < s.baseline / o_.collapse())
                         : !(s.norm < o_.norm() || s.norm < o_.ratio() * s.max_norm ||
                             (base && s.norm < s.baseline / o_.collapse())))
      return std::nullopt;
    Finding f;
    f.kind = FailureKind::VanishingGradient;
    f.value = s.norm;
    f.threshold = own_history_only ? s.baseline / o_.collapse()
                                   : std::max({o_.norm(), o_.ratio() * s.max_norm,
                                               base ? s.baseline / o_.collapse() : 0.0});
    if (s.zero_since >= 0) f.since = s.zero_since;  // exactly 0 since then
    if (s.gated) f.details["gated"] = true;
    f.margin = s.norm > 0.0 ? detail::decade_margin(f.threshold, s.norm) : 1.0;
    return f;
  }
  [[nodiscard]] const VanishingGradientRuleOptions& options() const noexcept { return o_; }

 private:
  VanishingGradientRuleOptions o_;
};

// ---- built-in loss rules ------------------------------------------------------------------

namespace detail {
/// Throws unless `v` is 0 (off) or above 1 (a growth factor), naming `what` and `v` exactly.
inline void require_growth_factor(double v, const char* what) {
  if (!(v == 0.0 || v > 1.0))
    throw Error(std::string("torchdbg: ") + what + " must be 0 (off) or > 1, got " + number_text(v));
}
/// Throws unless `v` >= 0 (NaN fails), naming `what` and `v` exactly.
inline void require_non_negative(double v, const char* what) {
  if (!(v >= 0.0)) throw Error(std::string("torchdbg: ") + what + " must be >= 0, got " + number_text(v));
}
}  // namespace detail

struct LossDivergenceRuleOptions {
  /// With `growth` above 1, a finite loss above `growth` times the lowest of the last `window`
  /// losses and above `floor` times the first diverges when it rose on at least `rising` of
  /// its last `rising_of` steps (that share of them from the fourth loss on), or stayed above
  /// that threshold on all of them: steady growth, such as a learning rate just past the
  /// stable limit gives, never jumps far enough over the recent mean to be a spike.
  /// `growth` 0 (the default) judges NaN/Inf losses only: losses that rise by design (an RL
  /// value loss as returns grow, a distillation loss from a near-perfect start, a loss summed
  /// over a growing batch) grow by orders of magnitude too.
  TORCH_ARG(double, growth) = 0.0;
  TORCH_ARG(int64_t, window) = 100;
  TORCH_ARG(double, floor) = 10.0;
  TORCH_ARG(int64_t, rising) = 9;
  TORCH_ARG(int64_t, rising_of) = 12;
};

/// A NaN/Inf loss, or (`LossDivergenceRuleOptions::growth`) a finite one that has grown
/// steadily by orders of magnitude. Losses that are 0 or negative in the window (a sparse
/// reward, a log-likelihood, a critic's score) have no scale to grow from and are judged only
/// for NaN/Inf.
class LossDivergenceRule : public HealthRule {
 public:
  explicit LossDivergenceRule(LossDivergenceRuleOptions o = {}) : o_(o) {
    detail::require_growth_factor(o_.growth(), "LossDivergenceRuleOptions::growth");
    detail::require_non_negative(o_.floor(), "LossDivergenceRuleOptions::floor");
    if (o_.window() < 2 || o_.rising_of() < 2 || o_.rising() < 0 || o_.rising() > o_.rising_of())
      throw Error("torchdbg: LossDivergenceRuleOptions needs window >= 2, rising_of >= 2 and "
                  "0 <= rising <= rising_of, got window " + std::to_string(o_.window()) +
                  ", rising " + std::to_string(o_.rising()) + " of " + std::to_string(o_.rising_of()));
  }
  std::string name() const override { return "loss_divergence"; }
  std::optional<Finding> check_loss(const LossSignals& s) override {
    if (!std::isfinite(s.loss)) {
      Finding f;
      f.kind = FailureKind::LossDivergence;
      f.value = s.loss;
      f.margin = 1.0;
      return f;
    }
    // From the fourth loss on: the last rising_of steps, or as many as there were.
    const std::size_t n = s.history.size();
    const std::size_t steps = std::min(n, static_cast<std::size_t>(o_.rising_of()));
    if (!(o_.growth() > 0.0) || steps < 3 || !(s.loss > 0.0)) return std::nullopt;
    // The floor first: it is one comparison, and a healthy loss is below it every step.
    if (std::isfinite(s.first_loss) && !(s.loss > o_.floor() * s.first_loss)) return std::nullopt;
    const std::size_t window = static_cast<std::size_t>(o_.window());
    const std::size_t from = n > window ? n - window : 0;
    std::size_t low = from;
    for (std::size_t i = from; i < n; ++i) {
      if (!(s.history[i] > 0.0)) return std::nullopt;
      if (s.history[i] < s.history[low]) low = i;
    }
    const double threshold = o_.growth() * s.history[low];
    if (!(s.loss > threshold)) return std::nullopt;
    int64_t rose = s.loss > s.history[n - 1] ? 1 : 0;
    bool sustained = true;
    for (std::size_t i = n - steps; i < n; ++i) {
      if (i > n - steps) rose += s.history[i] > s.history[i - 1] ? 1 : 0;
      sustained = sustained && s.history[i] > threshold;
    }
    // rose / steps >= rising / rising_of, in integers
    if (!sustained && rose * o_.rising_of() < o_.rising() * static_cast<int64_t>(steps)) return std::nullopt;
    Finding f;
    f.kind = FailureKind::LossDivergence;
    f.value = s.loss;
    f.threshold = threshold;
    f.margin = detail::decade_margin(s.loss, threshold);
    f.details = {{"growth", s.loss / s.history[low]},
                 {"lowest", s.history[low]},
                 {"losses_since_lowest", static_cast<int64_t>(n - low)},
                 {"rising", rose},
                 {"rising_of", static_cast<int64_t>(steps)},
                 {"sustained", sustained}};
    return f;
  }
  [[nodiscard]] const LossDivergenceRuleOptions& options() const noexcept { return o_; }

 private:
  LossDivergenceRuleOptions o_;
};

struct LossSpikeRuleOptions {
  /// Loss above this multiple of the mean of the last `window` losses: spike.
  TORCH_ARG(double, factor) = 10.0;
  TORCH_ARG(int64_t, window) = 20;
  /// The mean is taken as at least this fraction of the first loss: near convergence one hard
  /// batch is 10x a tiny mean, and a spike there must also reach the untrained loss's level.
  TORCH_ARG(double, floor) = 0.1;
};

/// A jump over the recent mean, from the second loss on: with few losses the mean is rough,
/// but a jump of `factor` over it is no noise (a destructive first update).
class LossSpikeRule : public HealthRule {
 public:
  explicit LossSpikeRule(LossSpikeRuleOptions o = {}) : o_(o) {}
  std::string name() const override { return "loss_spike"; }
  std::optional<Finding> check_loss(const LossSignals& s) override {
    const std::size_t n = s.history.size();
    if (!std::isfinite(s.loss) || n == 0) return std::nullopt;
    const std::size_t window = static_cast<std::size_t>(o_.window());
    const std::size_t from = n > window ? n - window : 0;
    double mean = 0.0;
    for (std::size_t i = from; i < n; ++i) mean += s.history[i];
    mean /= static_cast<double>(n - from);
    const double ref = std::isfinite(s.first_loss) ? std::max(mean, o_.floor() * s.first_loss) : mean;
    if (!(s.loss > o_.factor() * ref)) return std::nullopt;
    Finding f;
    f.kind = FailureKind::LossSpike;
    f.value = s.loss;
    f.threshold = o_.factor() * ref;
    f.margin = detail::decade_margin(s.loss, f.threshold);
    f.details = {{"recent_mean", mean}};
    return f;
  }
  [[nodiscard]] const LossSpikeRuleOptions& options() const noexcept { return o_; }

 private:
  LossSpikeRuleOptions o_;
};

struct LossPlateauRuleOptions {
  /// Relative improvement between the halves of the last `window` losses below `tolerance`.
  TORCH_ARG(int64_t, window) = 200;
  TORCH_ARG(double, tolerance) = 1e-3;
};

class LossPlateauRule : public HealthRule {
 public:
  explicit LossPlateauRule(LossPlateauRuleOptions o = {}) : o_(o) {}
  std::string name() const override { return "loss_plateau"; }
  std::optional<Finding> check_loss(const LossSignals& s) override {
    const std::size_t n = s.history.size(), pw = static_cast<std::size_t>(o_.window());
    if (!std::isfinite(s.loss) || n + 1 < pw) return std::nullopt;
    // The window is the last pw - 1 losses of the history and this one: its first half's
    // mean against its second's.
    const std::size_t from = n + 1 - pw, half = pw / 2;
    const double* h = s.history.data() + from;
    double a = sum_of(h, half);
    double b = sum_of(h + half, pw - 1 - half) + s.loss;
    a /= static_cast<double>(half);
    b /= static_cast<double>(pw - half);
    const double rel = (a - b) / std::max(std::fabs(a), 1e-12);
    if (!(std::fabs(rel) < o_.tolerance())) return std::nullopt;
    Finding f;
    f.kind = FailureKind::LossPlateau;
    f.value = rel;
    f.threshold = o_.tolerance();
    f.margin = 1.0 - std::fabs(rel) / o_.tolerance();
    f.details = {{"relative_improvement", rel}};
    return f;
  }
  [[nodiscard]] const LossPlateauRuleOptions& options() const noexcept { return o_; }

 private:
  /// Four partial sums: not one chain of dependent additions (it runs every step).
  static double sum_of(const double* v, std::size_t n) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    std::size_t i = 0;
    for (; i + 4 <= n; i += 4) {
      s0 += v[i];
      s1 += v[i + 1];
      s2 += v[i + 2];
      s3 += v[i + 3];
    }
    for (; i < n; ++i) s0 += v[i];
    return (s0 + s1) + (s2 + s3);
  }
  LossPlateauRuleOptions o_;
};

}  // namespace torchdbg
