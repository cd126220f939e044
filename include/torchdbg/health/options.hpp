// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The health monitor's options and the states it reports (health/monitor.hpp).

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/health/rules.hpp"
#include "torchdbg/hook_context.hpp"

namespace torchdbg {

enum class ActivationHealth { Normal, Saturated, Dead, Anomalous, NonFinite };
/// `Anomalous`: a user rule's finding (FailureKind::Custom).
enum class GradientHealth { Healthy, Vanishing, Exploding, NonFinite, Anomalous };
enum class LossHealth { Healthy, Diverging, Spike, Plateau, Anomalous };

inline const char* to_string(ActivationHealth h) noexcept {
  switch (h) {
    case ActivationHealth::Normal:
      return "normal";
    case ActivationHealth::Saturated:
      return "saturated";
    case ActivationHealth::Dead:
      return "dead";
    case ActivationHealth::Anomalous:
      return "anomalous";
    case ActivationHealth::NonFinite:
      return "non_finite";
  }
  return "?";
}
inline const char* to_string(GradientHealth h) noexcept {
  switch (h) {
    case GradientHealth::Healthy:
      return "healthy";
    case GradientHealth::Vanishing:
      return "vanishing";
    case GradientHealth::Exploding:
      return "exploding";
    case GradientHealth::NonFinite:
      return "non_finite";
    case GradientHealth::Anomalous:
      return "anomalous";
  }
  return "?";
}
inline const char* to_string(LossHealth h) noexcept {
  switch (h) {
    case LossHealth::Healthy:
      return "healthy";
    case LossHealth::Diverging:
      return "diverging";
    case LossHealth::Spike:
      return "spike";
    case LossHealth::Plateau:
      return "plateau";
    case LossHealth::Anomalous:
      return "anomalous";
  }
  return "?";
}

/// Where in a step something was seen, in the order a training step runs: the forward pass,
/// then the loss, then the backward pass.
enum class Phase { Forward, Loss, Backward };

inline const char* to_string(Phase p) noexcept {
  switch (p) {
    case Phase::Forward:
      return "forward";
    case Phase::Loss:
      return "loss";
    case Phase::Backward:
      return "backward";
  }
  return "?";
}

/// What is known about a forward output besides the tensor (attach fills it from metadata).
struct ActivationInfo {
  std::string_view
      activation;  ///< the function that produced it ("relu", "tanh"); empty for a module output
  std::string_view op;              ///< an elementwise op that produced it ("log")
  std::string_view module_type;     ///< the module's class ("torch::nn::BatchNorm2dImpl")
  std::string_view pre_activation;  ///< the unobserved activation this output feeds ("tanh")
  /// RMS of this call's data input when attach measured it ("input_rms": an input no
  /// delivery produced, such as the model's input or noise).
  std::optional<double> input_rms;
  /// The RMS of the raw data in the model's input, where attach saw it mixed with data made
  /// from deliveries (`cat({pool(emb(ids)), x})`: x's; "input_data_rms"): the input's scale.
  std::optional<double> input_data_rms;
  /// The delivery whose output is this call's data input, and its call in the step (attach's
  /// "input_from", "input_call"): the input's scale is that output's RMS, when the monitor
  /// observed it in this step.
  std::string_view input_from;
  int64_t input_call = -1;
  /// Whether the rows of this call's data input measured by attach (`input_rms`) were alike
  /// (attach's "input_alike": rows 0 and 1 at a few positions); nullopt: not looked at.
  std::optional<bool> input_alike;
  /// The module's call in the step (attach's "call"); unset for outputs not from attach,
  /// whose input scale is then taken as the previous output's (a plain sequential model).
  std::optional<int64_t> call;
  /// NaN and ±Inf elements of the model's input, on the step's first module output (attach's
  /// "input_nan"/"input_inf"); `input_observed` when the input was looked at at all.
  int64_t input_nan = 0;
  int64_t input_inf = 0;
  bool input_observed = false;
  /// Finite elements of the model's input (attach's "input_count"); -1: not known.
  int64_t input_count = -1;
  /// An activation of a module output that user code changed in place after its delivery
  /// (attach's "input_changed": `out += identity`, `masked_fill_(mask, -inf)`): a NaN/Inf in
  /// it may be that code's, on purpose (an action mask), and is not the step's origin.
  bool input_changed = false;
  /// A batch of one's output std with its Linear's or Conv's bias taken out (attach's
  /// "std_less_bias"): what its weights made of the input, judged instead of the spread
  /// across the batch that one sample lacks.
  std::optional<double> std_less_bias;
  /// A BatchNorm's training call: its running statistics' error against the batch, and the
  /// batch's samples (attach's "norm_stats_error", "norm_samples"; see
  /// ActivationSignals::norm_stats_error).
  std::optional<double> norm_stats_error;
  int64_t norm_samples = 0;
  double norm_momentum = 0.1;  ///< the update's momentum ("norm_momentum")
  /// A normalization layer's weight RMS (attach's "norm_weight_rms").
  std::optional<double> norm_weight_rms;
  /// Elements above 0 per index of the unit dimension, reduced where the tensor lives when
  /// attach queued it (`install`'s prefetch); null: the monitor counts them itself.
  const std::vector<double>* unit_counts = nullptr;
  /// The same counts read by the hook call with the output's statistics
  /// (HookContext::units_above_zero); null: counted here.
  const std::vector<int64_t>* units_above_zero = nullptr;
  /// Elements outside the saturation bounds, prefetched the same way; null: counted here.
  const std::vector<double>* saturated_count = nullptr;
};

/// What the monitor does when a failure listed in `HealthOptions::pause_on` starts.
enum class OnFailure { Record, Pause };

/// (layer regex, activation) pairs: see HealthOptions::pre_activations.
using PreActivations = std::vector<std::pair<std::string, std::string>>;
/// (layer regex, failure) pairs: see HealthOptions::expected.
using ExpectedFailures = std::vector<std::pair<std::string, FailureKind>>;

/// Thresholds and capacities of the health monitor, with defaults in one place.
///
/// ```cpp
/// HealthOptions().saturated_fraction(0.3).dead_window(4).on_failure(OnFailure::Pause)
/// ```
struct HealthOptions {
  /// Evaluate every `interval` steps (the monitor's hook is every_n_steps(interval)).
  TORCH_ARG(int64_t, interval) = 1;
  /// Of the steps the monitor evaluates, judge forward outputs (activations) on every
  /// `activation_interval`-th: every `interval * activation_interval` steps. Gradients keep
  /// `interval`, and the loss is judged at every `set_loss`. Above 1 the operator observer
  /// attach needs for forward outputs is registered on those steps only: on a small model it
  /// is most of the fixed cost per step (docs/performance.md, "Fixed cost per step"), while a
  /// NaN, an explosion or a vanishing gradient is still caught on its step. What shows only
  /// in activations (dead units, saturation, a layer's gain) is seen up to
  /// `interval * activation_interval - 1` steps late, or the step after a gradient or the
  /// loss showed it (`alert_steps`); diagnose() then places it where they did, unless an
  /// update there could have caused it (docs/health.md, "Judging less often").
  ///
  /// ```cpp
  /// HealthOptions().activation_interval(10)  // gradients every step, activations every 10th
  /// ```
  TORCH_ARG(int64_t, activation_interval) = 1;
  /// With `activation_interval` above 1: after a step where a rule found something (a
  /// gradient, the loss or an output; a plateau aside), forward outputs are judged on every
  /// evaluated step of the next `alert_steps`, so what a gradient or the loss shows first is
  /// followed into the activations the step after. 0: only on the fixed steps.
  TORCH_ARG(int64_t, alert_steps) = 10;
  /// Judge forward outputs on as many steps as keeps what they add to a step within this share
  /// of it (0 < share < 1; 0: off). The monitor measures that in the run: after its first 10
  /// steps, 20 steps skip forward outputs on 6 in their middle, and the median time of the
  /// steps whose outputs were judged is set against that of the others; from then on outputs
  /// are judged on every n-th step, n the smallest that brings their cost per step within the
  /// budget (1 where they cost less, at most 10). Steps count as `set_step` calls with a new
  /// step number. Gradients and the loss are judged on every step, and `alert_steps` applies as
  /// with `activation_interval`. HealthReport::activation_interval and activation_cost say what
  /// was chosen and measured. Needs `interval` and `activation_interval` at 1.
  ///
  /// ```cpp
  /// HealthOptions().activation_budget(0.1)  // activations may add 10% to a step
  /// ```
  TORCH_ARG(double, activation_budget) = 0.0;
  /// Regexes (searched in layer names) of the layers to watch; empty: all.
  TORCH_ARG(std::vector<std::string>, layers);

  // ---- activations
  /// The dimension that holds units (features/channels): 1 for [N, C, ...] and [N, F].
  TORCH_ARG(int64_t, unit_dim) = 1;
  /// tanh (and softsign) outputs with |y| above this are saturated.
  TORCH_ARG(double, tanh_saturation) = 0.97;
  /// sigmoid outputs below `sigmoid_low` or above `sigmoid_high` are saturated.
  TORCH_ARG(double, sigmoid_low) = 0.01;
  TORCH_ARG(double, sigmoid_high) = 0.99;
  /// A layer is saturated when more than this fraction of its outputs are.
  TORCH_ARG(double, saturated_fraction) = 0.25;
  /// A ReLU-family unit is dead when active (> 0) in fewer than this fraction of the samples
  /// of the window: the layer's most recent outputs covering at least `dead_window_samples`
  /// samples per unit (at most `dead_window` outputs are kept).
  TORCH_ARG(double, dead_activity) = 0.01;
  /// A layer is dead when more than this fraction of its units are.
  TORCH_ARG(double, dead_fraction) = 0.5;
  TORCH_ARG(int64_t, dead_window_samples) = 64;
  TORCH_ARG(int64_t, dead_window) = 16;
  /// Output std below this fraction of its RMS (with >= 2 elements): near-constant.
  TORCH_ARG(double, constant_ratio) = 1e-6;
  /// The model's input (the data) whose RMS is this many times above, or below 1/this of,
  /// its own baseline, and beyond 4 of the baseline's standard deviations, is bad data
  /// (FailureKind::BadInput, layer "input"): unnormalized or rescaled batches. The baseline
  /// starts at the median of the first `baseline_warmup` steps, then follows healthy steps;
  /// a scale kept for 4 x `baseline_warmup` steps becomes the new one. Each attach session's
  /// input (its step's first call on floating data, 16 elements or more) has its own
  /// baseline. 0 turns the check off.
  TORCH_ARG(double, input_scale_jump) = 10.0;
  /// A BatchNorm whose running statistics are this far from its batch's (the eval-mode
  /// output's RMS error in normalized units, over channels; also above 4x its sampling noise)
  /// has stale running statistics (FailureKind::NormStatistics, NormStatisticsRule).
  TORCH_ARG(double, norm_stats_limit) = 1.0;
  /// A normalization layer whose weight RMS fell below this fraction of the highest it had
  /// has a collapsing weight (FailureKind::NormWeightCollapse, NormWeightCollapseRule).
  TORCH_ARG(double, norm_weight_collapse) = 0.1;
  /// Output std above this multiple of its input's RMS: an exploding activation
  /// (normalization layers excepted); an output that is mostly its bias (small inputs) is
  /// judged on its spread across the batch instead (ExplodingActivationRule). Once the
  /// layer's gain baseline (an EMA of its healthy gains) is known, the limit is
  /// min(max(this, 3 x baseline), max(2, 10 x baseline)): a layer whose healthy gain grew may
  /// exceed it, and a 10x jump over the history counts below it (ExplodingActivationRuleOptions).
  TORCH_ARG(double, activation_gain) = 10.0;
  /// Layers (regex, whole name) whose observed output is the pre-activation of an
  /// unobserved activation ("tanh", "sigmoid" or "relu"): bounds are applied to the
  /// pre-activation (|x| > atanh(tanh_saturation), ...). Metadata {"pre_activation": "tanh"}
  /// on a delivery does the same.
  TORCH_ARG(PreActivations, pre_activations);

  // ---- gradients (per layer: the L2 norm over the layer's parameters)
  /// Norm below this: vanishing.
  TORCH_ARG(double, vanishing_norm) = 1e-7;
  /// Norm below this fraction of the step's largest layer norm: vanishing.
  TORCH_ARG(double, vanishing_ratio) = 1e-4;
  /// Norm above this and `exploding_growth` times the layer's recent norms (an EMA):
  /// exploding. A layer's first norm is not judged by it, nor a large norm that stays steady
  /// or grows slowly (the gradients of a regression on unnormalised targets).
  TORCH_ARG(double, exploding_norm) = 1e3;
  TORCH_ARG(double, exploding_growth) = 10.0;
  /// Norm above `gradient_jump` times the layer's baseline: exploding; below baseline /
  /// `gradient_collapse`: vanishing. Also the adjacent-layer ratio that marks where an
  /// explosion starts.
  TORCH_ARG(double, gradient_jump) = 100.0;
  TORCH_ARG(double, gradient_collapse) = 1e4;
  /// Healthy evaluations before a baseline (an EMA of log norm or of the gain) is used.
  TORCH_ARG(int64_t, baseline_warmup) = 5;
  TORCH_ARG(double, baseline_momentum) = 0.9;

  // ---- loss
  /// With `loss_growth` above 1 (e.g. 100), a finite loss above `loss_growth` times the lowest
  /// of the last `loss_growth_window` losses and above `loss_growth_floor` times the first,
  /// risen on 9 of its last 12 steps or above that on all of them, diverges
  /// (LossDivergenceRuleOptions). 0, the default: NaN/Inf losses only, since losses that rise
  /// by design (RL value losses, distillation from a near-perfect start) grow so too.
  TORCH_ARG(double, loss_growth) = 0.0;
  TORCH_ARG(int64_t, loss_growth_window) = 100;
  TORCH_ARG(double, loss_growth_floor) = 10.0;
  /// Loss above `loss_spike_factor` times the mean of the last `loss_window` losses: spike.
  TORCH_ARG(double, loss_spike_factor) = 10.0;
  /// That mean is taken as at least this fraction of the first loss (LossSpikeRuleOptions).
  TORCH_ARG(double, loss_spike_floor) = 0.1;
  TORCH_ARG(int64_t, loss_window) = 20;
  /// Relative improvement between the halves of the last `plateau_window` losses below
  /// `plateau_tolerance`: plateau.
  TORCH_ARG(int64_t, plateau_window) = 200;
  TORCH_ARG(double, plateau_tolerance) = 1e-3;

  // ---- rules
  /// Rules evaluated after the built-in ones (health/rules.hpp): their findings become
  /// states, events and incidents like the built-in rules' (FailureKind::Custom, or a
  /// built-in kind). The built-in rules take their thresholds from the options above.
  TORCH_ARG(std::vector<HealthRulePtr>, rules);

  /// Failures that layers show by design, each (layer regex, whole name; kind): a GAN
  /// generator's tanh output saturates to make images in [-1, 1].
  ///
  /// ```cpp
  /// HealthOptions().expected({{"generator\\.out/tanh", FailureKind::Saturation}})
  /// ```
  ///
  /// The layer's state is still tracked and reported, and its events carry
  /// {"expected": true}; they are no alarms, and no incident or pause comes of them.
  TORCH_ARG(ExpectedFailures, expected);

  // ---- events, confidence, policy
  /// Consecutive evaluations in a state after which persistence counts fully in confidence.
  TORCH_ARG(int64_t, persistence_steps) = 3;
  TORCH_ARG(std::size_t, event_capacity) = 10000;
  TORCH_ARG(std::size_t, incident_capacity) = 4096;
  /// Layers tracked at most (further names are counted in `ignored_layers`).
  TORCH_ARG(std::size_t, max_layers) = 4096;
  TORCH_ARG(OnFailure, on_failure) = OnFailure::Record;
  TORCH_ARG(std::vector<FailureKind>, pause_on) = std::vector<FailureKind>{
      FailureKind::BadInput,          FailureKind::NonFiniteOutput,
      FailureKind::NonFiniteGradient, FailureKind::ExplodingActivation,
      FailureKind::ExplodingGradient, FailureKind::LossDivergence};
};

/// The built-in rules with the thresholds in `o`, in the order they are evaluated: an
/// output's non-finite values, dead units, saturation, an exploding activation, a constant
/// output, a normalization's collapsing weight, a BatchNorm's stale running statistics; a
/// gradient's non-finite values, explosion, vanishing; the loss's divergence,
/// spike, plateau.
inline std::vector<HealthRulePtr> builtin_health_rules(const HealthOptions& o) {
  return {
      std::make_shared<NonFiniteOutputRule>(),
      std::make_shared<DeadUnitsRule>(DeadUnitsRuleOptions().fraction(o.dead_fraction())),
      std::make_shared<SaturationRule>(SaturationRuleOptions().fraction(o.saturated_fraction())),
      std::make_shared<ExplodingActivationRule>(
          ExplodingActivationRuleOptions().gain(o.activation_gain())),
      std::make_shared<ConstantOutputRule>(ConstantOutputRuleOptions().ratio(o.constant_ratio())),
      std::make_shared<NormWeightCollapseRule>(NormWeightCollapseRuleOptions()
                                                   .fraction(o.norm_weight_collapse())
                                                   .constant_ratio(o.constant_ratio())),
      std::make_shared<NormStatisticsRule>(NormStatisticsRuleOptions().limit(o.norm_stats_limit())),
      std::make_shared<NonFiniteGradientRule>(),
      std::make_shared<ExplodingGradientRule>(
          ExplodingGradientRuleOptions()
                                                  .norm(o.exploding_norm())
                                                  .growth(o.exploding_growth())
                                                  .jump(o.gradient_jump())),
      std::make_shared<VanishingGradientRule>(VanishingGradientRuleOptions()
                                                  .norm(o.vanishing_norm())
                                                  .ratio(o.vanishing_ratio())
                                                  .collapse(o.gradient_collapse())),
      std::make_shared<LossDivergenceRule>(LossDivergenceRuleOptions()
                                               .growth(o.loss_growth())
                                               .window(o.loss_growth_window())
                                               .floor(o.loss_growth_floor())),
      std::make_shared<LossSpikeRule>(LossSpikeRuleOptions()
                                          .factor(o.loss_spike_factor())
                                          .window(o.loss_window())
                                          .floor(o.loss_spike_floor())),
      std::make_shared<LossPlateauRule>(
          LossPlateauRuleOptions().window(o.plateau_window()).tolerance(o.plateau_tolerance()))};
}

namespace detail {

/// Throws torchdbg::Error naming the first option out of its range.
TORCHDBG_INLINE void validate(const HealthOptions& o);

/// What attach's metadata tells about a forward output (its prefetched counts aside).
/// `facts`, attach's measurements of the delivery, fill what `metadata` does not hold (a key
/// present there wins, as in HookContext::metadata).
TORCHDBG_INLINE ActivationInfo activation_info(const Metadata& metadata, const DeliveryFacts* facts = nullptr);

#if TORCHDBG_DEFINITIONS

TORCHDBG_INLINE void validate(const HealthOptions& o) {
  auto positive = [](double v, const char* name) {
    if (!(v > 0.0))
      throw Error(std::string("torchdbg: HealthOptions::") + name + " must be > 0, got " +
                  std::to_string(v));
  };
  auto fraction = [](double v, const char* name) {
    if (!(v >= 0.0 && v <= 1.0))
      throw Error(std::string("torchdbg: HealthOptions::") + name + " must be in [0, 1], got " +
                  std::to_string(v));
  };
  detail::require_at_least<int64_t>(o.interval(), 1, "HealthOptions::interval");
  detail::require_at_least<int64_t>(o.activation_interval(), 1, "HealthOptions::activation_interval");
  if (o.activation_interval() > std::numeric_limits<int64_t>::max() / o.interval())
    throw Error("torchdbg: HealthOptions::activation_interval " + std::to_string(o.activation_interval()) +
                " times interval " + std::to_string(o.interval()) + " overflows int64");
  detail::require_at_least<int64_t>(o.alert_steps(), 0, "HealthOptions::alert_steps");
  if (!(o.activation_budget() >= 0.0 && o.activation_budget() < 1.0))
    throw Error("torchdbg: HealthOptions::activation_budget must be in [0, 1), got " +
                std::to_string(o.activation_budget()));
  if (o.activation_budget() > 0.0 && (o.interval() != 1 || o.activation_interval() != 1))
    throw Error("torchdbg: HealthOptions::activation_budget " + std::to_string(o.activation_budget()) +
                " chooses how often forward outputs are judged: it needs interval 1 and "
                "activation_interval 1, got " + std::to_string(o.interval()) + " and " +
                std::to_string(o.activation_interval()));
  detail::require_at_least<int64_t>(o.dead_window_samples(), 1,
                                    "HealthOptions::dead_window_samples");
  detail::require_at_least<int64_t>(o.dead_window(), 1, "HealthOptions::dead_window");
  detail::require_at_least<int64_t>(o.loss_window(), 2, "HealthOptions::loss_window");
  detail::require_at_least<int64_t>(o.plateau_window(), 4, "HealthOptions::plateau_window");
  detail::require_at_least<int64_t>(o.loss_growth_window(), 2, "HealthOptions::loss_growth_window");
  detail::require_growth_factor(o.loss_growth(), "HealthOptions::loss_growth");
  detail::require_non_negative(o.loss_growth_floor(), "HealthOptions::loss_growth_floor");
  detail::require_at_least<int64_t>(o.persistence_steps(), 1, "HealthOptions::persistence_steps");
  if (o.event_capacity() == 0)
    throw Error("torchdbg: HealthOptions::event_capacity must be >= 1, got 0");
  if (o.max_layers() == 0) throw Error("torchdbg: HealthOptions::max_layers must be >= 1, got 0");
  fraction(o.tanh_saturation(), "tanh_saturation");
  fraction(o.sigmoid_low(), "sigmoid_low");
  fraction(o.sigmoid_high(), "sigmoid_high");
  fraction(o.saturated_fraction(), "saturated_fraction");
  fraction(o.dead_activity(), "dead_activity");
  fraction(o.dead_fraction(), "dead_fraction");
  fraction(o.baseline_momentum(), "baseline_momentum");
  fraction(o.norm_weight_collapse(), "norm_weight_collapse");
  positive(o.norm_stats_limit(), "norm_stats_limit");
  positive(o.activation_gain(), "activation_gain");
  if (!(o.input_scale_jump() == 0.0 || o.input_scale_jump() > 1.0))
    throw Error("torchdbg: HealthOptions::input_scale_jump must be 0 (off) or > 1, got " +
                std::to_string(o.input_scale_jump()));
  positive(o.vanishing_ratio(), "vanishing_ratio");
  positive(o.exploding_norm(), "exploding_norm");
  if (!(o.exploding_growth() > 1.0))
    throw Error("torchdbg: HealthOptions::exploding_growth must be > 1, got " +
                std::to_string(o.exploding_growth()));
  positive(o.gradient_jump(), "gradient_jump");
  positive(o.gradient_collapse(), "gradient_collapse");
  positive(o.loss_spike_factor(), "loss_spike_factor");
  detail::require_non_negative(o.loss_spike_floor(), "HealthOptions::loss_spike_floor");
  positive(o.plateau_tolerance(), "plateau_tolerance");
  if (o.sigmoid_low() >= o.sigmoid_high())
    throw Error("torchdbg: HealthOptions::sigmoid_low must be below sigmoid_high");
}

TORCHDBG_INLINE ActivationInfo activation_info(const Metadata& metadata, const DeliveryFacts* facts) {
  // One pass over the (few) entries; numbers parse with from_chars, and only what it does not
  // take whole (a leading '+' or space a user wrote) goes through stod/stoll.
  const auto integer = [](const std::string& v) -> std::optional<int64_t> {
    int64_t x = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (ec == std::errc() && end == v.data() + v.size()) return x;
    try {
      return std::stoll(v);
    } catch (...) {
      return std::nullopt;
    }
  };
  const auto real = [](const std::string& v) -> std::optional<double> {
    double x = 0.0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (ec == std::errc() && end == v.data() + v.size()) return x;
    try {
      return std::stod(v);
    } catch (...) {
      return std::nullopt;
    }
  };
  ActivationInfo info;
  std::optional<double> norm_momentum;
  // The measured keys the metadata holds (its entry wins over `facts`).
  enum : unsigned { kRms = 1, kDataRms = 2, kCount = 4, kSamples = 8, kAlike = 16, kLessBias = 32, kStatsError = 64,
                    kWeightRms = 128, kMomentum = 256, kNan = 512, kInf = 1024 };
  unsigned held = 0;
  for (const auto& [key, value] : metadata) {
    const std::string_view k = key;
    if (facts != nullptr) {
      held |= k == "input_rms" ? kRms : k == "input_data_rms" ? kDataRms : k == "input_count" ? kCount
            : k == "norm_samples" ? kSamples : k == "input_alike" ? kAlike : k == "std_less_bias" ? kLessBias
            : k == "norm_stats_error" ? kStatsError : k == "norm_weight_rms" ? kWeightRms
            : k == "norm_momentum" ? kMomentum : k == "input_nan" ? kNan : k == "input_inf" ? kInf : 0u;
    }
    if (k == "activation") {
      info.activation = value;
    } else if (k == "op") {
      info.op = value;
    } else if (k == "module_type") {
      info.module_type = value;
    } else if (k == "pre_activation") {
      info.pre_activation = value;
    } else if (k == "input_from") {
      info.input_from = value;
    } else if (k == "call") {
      info.call = integer(value);
    } else if (k == "input_call") {
      info.input_call = integer(value).value_or(-1);
    } else if (k == "input_changed") {
      info.input_changed = value == "1";
    } else if (k == "input_count") {
      info.input_count = integer(value).value_or(-1);
    } else if (k == "norm_samples") {
      info.norm_samples = integer(value).value_or(0);
    } else if (k == "input_rms") {
      if (auto x = real(value)) info.input_rms = x;
    } else if (k == "input_data_rms") {
      if (auto x = real(value)) info.input_data_rms = x;
    } else if (k == "input_alike") {
      if (value == "1" || value == "0") info.input_alike = value == "1";
    } else if (k == "std_less_bias") {
      if (auto x = real(value)) info.std_less_bias = x;
    } else if (k == "norm_stats_error") {
      if (auto x = real(value)) info.norm_stats_error = x;
    } else if (k == "norm_weight_rms") {
      if (auto x = real(value)) info.norm_weight_rms = x;
    } else if (k == "norm_momentum") {
      if (auto x = real(value)) norm_momentum = x;
    } else if (k == "input_nan" || k == "input_inf") {
      if (auto x = integer(value)) {
        (k == "input_nan" ? info.input_nan : info.input_inf) = std::max<int64_t>(0, *x);
        info.input_observed = true;
      }
    }
  }
  if (facts != nullptr) {
    const DeliveryFacts& f = *facts;
    const auto take = [&](unsigned key, auto& slot, const auto& v) {
      if ((held & key) == 0 && v) slot = v;
    };
    take(kRms, info.input_rms, f.input_rms);
    take(kDataRms, info.input_data_rms, f.input_data_rms);
    take(kAlike, info.input_alike, f.input_alike);
    take(kLessBias, info.std_less_bias, f.std_less_bias);
    take(kStatsError, info.norm_stats_error, f.norm_stats_error);
    take(kWeightRms, info.norm_weight_rms, f.norm_weight_rms);
    take(kMomentum, norm_momentum, f.norm_momentum);
    if ((held & kCount) == 0 && f.input_count) info.input_count = *f.input_count;
    if ((held & kSamples) == 0 && f.norm_samples) info.norm_samples = *f.norm_samples;
    if ((held & kNan) == 0 && f.input_nan) {
      info.input_nan = std::max<int64_t>(0, *f.input_nan);
      info.input_observed = true;
    }
    if ((held & kInf) == 0 && f.input_inf) {
      info.input_inf = std::max<int64_t>(0, *f.input_inf);
      info.input_observed = true;
    }
  }
  if (norm_momentum) info.norm_momentum = *norm_momentum;
  return info;
}

#endif  // TORCHDBG_DEFINITIONS

}  // namespace detail

}  // namespace torchdbg
