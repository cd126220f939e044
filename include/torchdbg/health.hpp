// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Health states of layers and of the loss, and the semantic events their transitions make.
//
// A HealthMonitor turns what the observer delivers (forward outputs, activations, parameter
// gradients and the loss) into per-layer states:
// * activation: normal, saturated, dead, anomalous (near-constant output, or an output whose
//   scale jumps far above its input's: an exploding activation), non-finite;
// * gradient: healthy, vanishing, exploding, non-finite (absolute thresholds, a threshold
//   relative to the step's largest layer gradient, and an adaptive per-layer baseline);
// * loss: healthy, diverging (NaN/Inf), spike, plateau.
// The monitor keeps the bookkeeping (per-layer windows and baselines, forward and backward
// order, events, incidents, pauses); what counts as unhealthy is decided by its rules
// (health_rules.hpp): the built-in ones, configured by HealthOptions, and any user rules
// (`HealthOptions::rules`, `add_rule`), whose findings become states, events and incidents the
// same way. Each transition, and the first observation of a layer that starts unhealthy, is a
// SemanticEvent; each onset of a failure is an Incident, the raw material of diagnose()
// (diagnosis.hpp). Layers are ordered by forward execution order as observed.
//
// ```cpp
// torchdbg::HookManager hooks;
// torchdbg::HealthMonitor health(torchdbg::HealthOptions().on_failure(torchdbg::OnFailure::Pause));
// auto h = health.install(hooks);          // feeds on every delivery and on set_step/set_loss
// auto session = torchdbg::attach(*model, hooks);
// ```

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/detail/mutex.hpp"
#include "torchdbg/detail/pattern.hpp"
#include "torchdbg/detail/ring_buffer.hpp"
#include "torchdbg/detail/stats_kernel.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/health_rules.hpp"
#include "torchdbg/hook_manager.hpp"
#include "torchdbg/tensor_stats.hpp"

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
  /// The delivery whose output is this call's data input, and its call in the step (attach's
  /// "input_from", "input_call"): the input's scale is that output's RMS, when the monitor
  /// observed it in this step.
  std::string_view input_from;
  int64_t input_call = -1;
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
  /// Norm above this: exploding.
  TORCH_ARG(double, exploding_norm) = 1e3;
  /// Norm above `gradient_jump` times the layer's baseline: exploding; below baseline /
  /// `gradient_collapse`: vanishing. Also the adjacent-layer ratio that marks where an
  /// explosion starts.
  TORCH_ARG(double, gradient_jump) = 100.0;
  TORCH_ARG(double, gradient_collapse) = 1e4;
  /// Healthy evaluations before a baseline (an EMA of log norm or of the gain) is used.
  TORCH_ARG(int64_t, baseline_warmup) = 5;
  TORCH_ARG(double, baseline_momentum) = 0.9;

  // ---- loss
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
  /// Rules evaluated after the built-in ones (health_rules.hpp): their findings become
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
          ExplodingGradientRuleOptions().norm(o.exploding_norm()).jump(o.gradient_jump())),
      std::make_shared<VanishingGradientRule>(VanishingGradientRuleOptions()
                                                  .norm(o.vanishing_norm())
                                                  .ratio(o.vanishing_ratio())
                                                  .collapse(o.gradient_collapse())),
      std::make_shared<LossDivergenceRule>(),
      std::make_shared<LossSpikeRule>(LossSpikeRuleOptions()
                                          .factor(o.loss_spike_factor())
                                          .window(o.loss_window())
                                          .floor(o.loss_spike_floor())),
      std::make_shared<LossPlateauRule>(
          LossPlateauRuleOptions().window(o.plateau_window()).tolerance(o.plateau_tolerance()))};
}

/// What a transition means.
enum class EventType {
  NonFiniteInput,   ///< the model's input (layer "input") held NaN/Inf
  InputScaleShift,  ///< the model's input's RMS jumped against its own history
  NonFiniteActivation,
  Saturation,
  DeadUnits,
  ActivationAnomaly,   ///< near-constant output, exploding activation or a user rule's finding
  NormStatsDrift,      ///< a BatchNorm's running statistics left its batches' (NormStatistics)
  NormWeightCollapse,  ///< a normalization layer's weight fell toward 0
  ActivationRecovered,
  NonFiniteGradient,
  VanishingGradient,
  ExplodingGradient,
  GradientAnomaly,  ///< a user rule's finding on a gradient
  GradientRecovered,
  LossDiverged,
  LossSpike,
  LossPlateau,
  LossAnomaly,  ///< a user rule's finding on the loss
  LossRecovered,
  TrainingPaused,
};

inline const char* to_string(EventType t) noexcept {
  switch (t) {
    case EventType::NonFiniteInput:
      return "non_finite_input";
    case EventType::InputScaleShift:
      return "input_scale_shift";
    case EventType::NonFiniteActivation:
      return "non_finite_activation";
    case EventType::Saturation:
      return "saturation";
    case EventType::DeadUnits:
      return "dead_units";
    case EventType::ActivationAnomaly:
      return "activation_anomaly";
    case EventType::NormStatsDrift:
      return "norm_stats_drift";
    case EventType::NormWeightCollapse:
      return "norm_weight_collapse";
    case EventType::ActivationRecovered:
      return "activation_recovered";
    case EventType::NonFiniteGradient:
      return "non_finite_gradient";
    case EventType::VanishingGradient:
      return "vanishing_gradient";
    case EventType::ExplodingGradient:
      return "exploding_gradient";
    case EventType::GradientRecovered:
      return "gradient_recovered";
    case EventType::LossDiverged:
      return "loss_diverged";
    case EventType::LossSpike:
      return "loss_spike";
    case EventType::LossPlateau:
      return "loss_plateau";
    case EventType::LossRecovered:
      return "loss_recovered";
    case EventType::GradientAnomaly:
      return "gradient_anomaly";
    case EventType::LossAnomaly:
      return "loss_anomaly";
    case EventType::TrainingPaused:
      return "training_paused";
  }
  return "?";
}

/// A health transition of a layer (or of the loss, layer "loss").
struct SemanticEvent {
  uint64_t id = 0;  ///< 1, 2, ... in the order the monitor emitted them
  EventType type = EventType::ActivationRecovered;
  std::string layer;
  int64_t step = 0;
  std::string from;  ///< previous state; "unobserved" on a layer's first observation
  std::string to;
  double confidence = 0.0;  ///< from the margin past the threshold and the persistence
  nlohmann::json metadata = nlohmann::json::object();  ///< the values behind the decision
  int rank = -1;  ///< the process that saw it (distributed runs); -1 when not distributed

  /// Warning or worse: a transition into an unhealthy state that is not merely informational.
  [[nodiscard]] bool is_alarm() const noexcept {
    if (auto it = metadata.find("expected");
        it != metadata.end() && it->is_boolean() && it->get<bool>())
      return false;  // HealthOptions::expected
    return type != EventType::ActivationRecovered && type != EventType::GradientRecovered &&
           type != EventType::LossRecovered && type != EventType::LossPlateau &&
           type != EventType::TrainingPaused;
  }
};

inline nlohmann::json to_json(const SemanticEvent& e) {
  nlohmann::json j = {{"id", e.id},
                      {"type", to_string(e.type)},
                      {"layer", e.layer},
                      {"step", e.step},
                      {"from", e.from},
                      {"to", e.to},
                      {"confidence", e.confidence},
                      {"metadata", e.metadata}};
  if (e.rank >= 0) j["rank"] = e.rank;
  return j;
}

/// The onset of a failure at one layer, kept updated while it persists.
struct Incident {
  FailureKind kind = FailureKind::NonFiniteOutput;
  std::string layer;   ///< the observed name ("fc2/tanh")
  std::string module;  ///< the responsible module ("fc2"): the name before the first '/'
  /// Onset: the step the failure began. Dead units are confirmed over a window of outputs;
  /// their onset is the first output of the inactive run, and `details["detected_step"]` the
  /// step that confirmed it.
  int64_t step = 0;
  int64_t last_step = 0;  ///< last evaluation still in that state
  Phase phase = Phase::Forward;
  int64_t order = 0;      ///< forward execution order of `module` (smaller: upstream)
  int64_t persisted = 1;  ///< consecutive evaluations in that state
  double confidence = 0.0;
  double margin = 0.0;  ///< how far past the threshold, 0..1 (the largest seen)
  /// The measured quantity (fraction, norm, gain, loss) at the onset; `details["last_value"]`
  /// holds it at `last_step`.
  double value = 0.0;
  double threshold = 0.0;        ///< what it was compared with
  std::vector<uint64_t> events;  ///< ids of the events behind it (the first few)
  nlohmann::json details = nlohmann::json::object();
  int rank = -1;
};

inline nlohmann::json to_json(const Incident& i) {
  nlohmann::json j = {{"kind", to_string(i.kind)},  {"layer", i.layer},
                      {"module", i.module},         {"step", i.step},
                      {"last_step", i.last_step},   {"phase", to_string(i.phase)},
                      {"order", i.order},           {"persisted", i.persisted},
                      {"confidence", i.confidence}, {"value", i.value},
                      {"threshold", i.threshold},   {"events", i.events},
                      {"details", i.details}};
  if (i.rank >= 0) j["rank"] = i.rank;
  return j;
}

/// The latest health of one observed layer.
struct LayerHealth {
  std::string name;
  std::string module;
  int64_t order = 0;  ///< position in forward execution order
  bool has_activation = false;
  bool has_gradient = false;
  ActivationHealth activation = ActivationHealth::Normal;
  GradientHealth gradient = GradientHealth::Healthy;
  int64_t activation_since = 0;  ///< step the current activation state began
  int64_t gradient_since = 0;
  int64_t last_step = 0;
  std::string activation_kind;  ///< "relu", "tanh", ... when known
  double rms = detail::kNaN;    ///< of the last output (finite values)
  double gain = detail::kNaN;   ///< output std / input RMS
  double saturated_fraction = detail::kNaN;
  double dead_fraction = detail::kNaN;
  double non_finite_fraction = 0.0;
  double gradient_norm = detail::kNaN;
  double gradient_baseline = detail::kNaN;
};

inline nlohmann::json to_json(const LayerHealth& l) {
  auto num = [](double v) -> nlohmann::json {
    return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json();
  };
  nlohmann::json j = {
      {"name", l.name}, {"module", l.module}, {"order", l.order}, {"last_step", l.last_step}};
  if (l.has_activation) {
    j["activation"] = {{"state", to_string(l.activation)},
                       {"since", l.activation_since},
                       {"kind", l.activation_kind},
                       {"rms", num(l.rms)},
                       {"gain", num(l.gain)},
                       {"saturated_fraction", num(l.saturated_fraction)},
                       {"dead_fraction", num(l.dead_fraction)},
                       {"non_finite_fraction", l.non_finite_fraction}};
  }
  if (l.has_gradient) {
    j["gradient"] = {{"state", to_string(l.gradient)},
                     {"since", l.gradient_since},
                     {"norm", num(l.gradient_norm)},
                     {"baseline", num(l.gradient_baseline)}};
  }
  return j;
}

/// Everything the diagnosis needs, copied out of a monitor at one moment.
struct HealthReport {
  int64_t step = 0;
  std::vector<LayerHealth> layers;    ///< in forward execution order
  std::vector<Incident> incidents;    ///< in onset order
  std::vector<SemanticEvent> events;  ///< the ring's contents, oldest first
  uint64_t events_total = 0;
  LossHealth loss = LossHealth::Healthy;
  std::optional<double> last_loss;
  int rank = -1;
};

/// What the monitor hands its step sinks when a step ends: the layers it observed in that step
/// (their state after the step), the events the step produced and the step's loss.
struct HealthStep {
  int64_t step = 0;
  std::optional<double> loss;
  std::vector<LayerHealth> layers;  ///< in forward execution order
  std::vector<SemanticEvent> events;
  LossHealth loss_health = LossHealth::Healthy;
};

namespace detail {

/// Confidence from how far past its threshold a value is (`margin`, 0..1) and for how many
/// consecutive evaluations it has held (`persisted` of `full`).
inline double evidence_confidence(double margin, int64_t persisted, int64_t full) noexcept {
  const double p = 1.0 - std::pow(0.5, static_cast<double>(persisted) /
                                           static_cast<double>(std::max<int64_t>(1, full)));
  const double m = clamp01(margin);
  return clamp01(1.0 - (1.0 - m) * (1.0 - p));
}

/// A number for JSON: null when NaN/Inf.
inline nlohmann::json json_num(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
}

}  // namespace detail

template <typename Mutex>
class BasicHealthMonitor;

/// The link between a monitor and a HookManager made by `install`: a hook, its callback and
/// prefetches, a manager listener, and the monitor's pause of that manager. Removes all of them
/// when destroyed or on `remove()` (waiting for a pause of that manager running on another
/// thread), so a monitor used after `remove()` never reaches the manager again. Movable.
template <typename Mutex, typename ManagerMutex>
class HealthInstallation {
 public:
  HealthInstallation() = default;
  HealthInstallation(BasicHookManager<ManagerMutex>* mgr, BasicHealthMonitor<Mutex>* monitor,
                     HookId hook, std::string callback, uint64_t listener, uint64_t pause_token)
      : mgr_(mgr),
        monitor_(monitor),
        hook_(std::move(hook)),
        callback_(std::move(callback)),
        listener_(listener),
        pause_token_(pause_token) {}
  HealthInstallation(const HealthInstallation&) = delete;
  HealthInstallation& operator=(const HealthInstallation&) = delete;
  HealthInstallation(HealthInstallation&& o) noexcept { *this = std::move(o); }
  HealthInstallation& operator=(HealthInstallation&& o) noexcept {
    if (this != &o) {
      remove();
      mgr_ = o.mgr_;
      monitor_ = o.monitor_;
      hook_ = std::move(o.hook_);
      callback_ = std::move(o.callback_);
      listener_ = o.listener_;
      pause_token_ = o.pause_token_;
      o.mgr_ = nullptr;
      o.monitor_ = nullptr;
    }
    return *this;
  }
  ~HealthInstallation() { remove(); }

  /// The manager's hook that feeds the monitor.
  [[nodiscard]] const HookId& hook_id() const noexcept { return hook_; }
  [[nodiscard]] bool installed() const noexcept { return mgr_ != nullptr; }

  void remove() noexcept;

 private:
  BasicHookManager<ManagerMutex>* mgr_ = nullptr;
  BasicHealthMonitor<Mutex>* monitor_ = nullptr;
  HookId hook_;
  std::string callback_;
  uint64_t listener_ = 0;
  uint64_t pause_token_ = 0;
};

#if TORCHDBG_DEFINITIONS

template <typename Mutex, typename ManagerMutex>
void HealthInstallation<Mutex, ManagerMutex>::remove() noexcept {
  if (mgr_ == nullptr) return;
  try {
    mgr_->remove_listener(listener_);
    (void)mgr_->remove_hook(hook_);
    (void)mgr_->remove_callback(callback_);
    (void)mgr_->remove_prefetch(callback_ + ".units");
    (void)mgr_->remove_prefetch(callback_ + ".saturation");
    if (monitor_ != nullptr) monitor_->release_pause_callback(pause_token_);
  } catch (...) {
  }
  mgr_ = nullptr;
  monitor_ = nullptr;
}

#endif  // TORCHDBG_DEFINITIONS

/// Per-layer health states, semantic events and failure incidents.
///
/// Feed it through `install(hooks)` (every forward output, activation and gradient the
/// manager executes hooks for, the loss from `set_loss`, step ends from `set_step` and
/// backward ends from `set_gradient_norm`), or directly with the observe_* calls.
///
/// Thread safety: every method may be called from any thread (autograd threads included);
/// one internal lock guards the state (the NullMutex alias drops it). The pause callback runs
/// without the lock held.
template <typename Mutex = std::mutex>
class BasicHealthMonitor {
 public:
  /// Called when `on_failure(Pause)` and a failure in `pause_on` starts: (step, layer, reason).
  using PauseFn = std::function<void(int64_t, const std::string&, const std::string&)>;

  explicit BasicHealthMonitor(HealthOptions options = {});
  ~BasicHealthMonitor();
  BasicHealthMonitor(const BasicHealthMonitor&) = delete;
  BasicHealthMonitor& operator=(const BasicHealthMonitor&) = delete;

  [[nodiscard]] const HealthOptions& options() const noexcept { return options_; }

  /// Connects the monitor to `hooks`; keep the result alive as long as it should watch, and
  /// destroy it (or call remove()) before the monitor or the manager.
  template <typename M>
  [[nodiscard]] HealthInstallation<Mutex, M> install(BasicHookManager<M>& hooks);

  /// Adds `rule` after the current ones; it judges every later observation.
  void add_rule(HealthRulePtr rule);
  /// Rule calls that threw (the rule judged nothing for that observation).
  [[nodiscard]] uint64_t rule_errors() const;
  /// The rules in evaluation order (the built-in ones first).
  [[nodiscard]] std::vector<std::string> rule_names() const;

  /// Called on a failure in `pause_on` when `on_failure(Pause)`, besides the pause of every
  /// manager the monitor is installed on (each installation pauses its own manager).
  void set_pause_callback(PauseFn fn);

  /// Takes back the manager pause an installation added (its `remove()` calls this). Waits
  /// for a pause of that manager running on another thread, so after it returns the manager
  /// may be destroyed.
  void release_pause_callback(uint64_t token);

  using StepSink = std::function<void(const HealthStep&)>;

  /// Calls `sink` (without the lock) with every finished step, in step order; returns an id
  /// for `remove_step_sink`. Exporters (report.hpp) are fed this way.
  uint64_t add_step_sink(StepSink sink);
  void remove_step_sink(uint64_t id);

  /// Finishes the current step now (judges pending gradients, hands it to the step sinks);
  /// call at the end of training. Observations of the same step afterwards start it again.
  void flush();

  // ---- observations ---------------------------------------------------------------------

  /// A forward output of `layer` at `step`; `stats`: its statistics if already computed.
  void observe_activation(std::string_view layer, const at::Tensor& output, int64_t step,
                          const ActivationInfo& info = {}, const TensorStats* stats = nullptr);

  /// A gradient of parameter `parameter` of module `layer` at `step`.
  void observe_gradient(std::string_view layer, std::string_view parameter, const at::Tensor& grad,
                        int64_t step, const TensorStats* stats = nullptr);

  /// The end of a backward pass: judges the gradients received since the last one.
  void end_backward();

  /// The loss of `step`.
  void observe_loss(int64_t step, double loss);

  /// Moves to `step`: what was pending for the previous step (gradients not yet judged) is
  /// judged first and the previous step goes to the step sinks.
  void set_step(int64_t step);

  // ---- queries --------------------------------------------------------------------------

  /// Every observed layer's latest health, in forward execution order.
  [[nodiscard]] std::vector<LayerHealth> layers() const;
  [[nodiscard]] std::optional<LayerHealth> layer(std::string_view name) const;
  [[nodiscard]] LossHealth loss_health() const;
  /// The event ring, oldest first.
  [[nodiscard]] std::vector<SemanticEvent> events() const;
  /// Events emitted so far (including those the ring dropped).
  [[nodiscard]] uint64_t event_count() const;
  /// Events that are alarms (SemanticEvent::is_alarm) emitted so far.
  [[nodiscard]] uint64_t alarm_count() const;
  [[nodiscard]] std::vector<Incident> incidents() const;
  /// Layer names beyond `max_layers` that were ignored.
  [[nodiscard]] uint64_t ignored_layers() const;
  /// A copy of everything diagnose() needs, taken now.
  [[nodiscard]] HealthReport report() const;
  /// The report taken at the moment the first failure in `pause_on` was detected.
  [[nodiscard]] std::optional<HealthReport> failure_report() const;
  /// The backward pass under way threw: forgets the gradients received since the last
  /// end_backward, so the next pass's are judged alone (install calls this on
  /// HookManager::backward_failed).
  void abandon_backward();

  /// Forgets all state, events and incidents (options stay).
  void reset();

 private:
  struct Layer {
    std::string name, module;
    std::string act_kind;  // activation that produced the output, or pre-activation kind
    bool pre_activation = false;
    bool gain_checked = true;  // false for activations, elementwise ops and normalization layers
    int64_t order = 0;
    bool order_from_forward = false;
    int64_t last_step = 0;
    // activation
    bool seen_fwd = false;
    ActivationHealth act = ActivationHealth::Normal;
    int64_t act_since = 0, act_persist = 0;
    int64_t act_step = 0;  // the step of the last judged output
    std::optional<std::size_t> act_incident;
    double rms = detail::kNaN, gain = detail::kNaN, sat_frac = detail::kNaN,
           dead_frac = detail::kNaN;
    int64_t rms_call = -1;  // the call (ActivationInfo::call) `rms` was measured on
    double nonfinite_frac = 0.0;
    double gain_base = detail::kNaN;
    int64_t gain_n = 0;
    double spread_gain = detail::kNaN;       // the gain on the output's spread across the batch
    double spread_base = detail::kNaN;       // and its baseline (updated with gain_base)
    double norm_weight_peak = detail::kNaN;  // a normalization's highest weight RMS so far
    double norm_stats_prev = detail::kNaN;   // its previous running statistics' error
    int64_t norm_stats_prev_step = 0;
    std::optional<FailureKind> act_found;  // the finding behind the current state
    std::vector<std::vector<int64_t>> unit_ring;
    std::vector<int64_t> sample_ring, step_ring;
    std::size_t unit_head = 0;
    int64_t dead_since = 0;  // the step of the first output of the dead units' inactive run
    // gradient
    bool seen_bwd = false;
    GradientHealth grad = GradientHealth::Healthy;
    int64_t grad_since = 0, grad_persist = 0;
    std::optional<std::size_t> grad_incident;
    bool g_touched = false;
    double g_sq = 0.0;
    int64_t g_nonfinite = 0, g_count = 0;
    int64_t bwd_arrival = 0;
    double g_norm = detail::kNaN;
    double g_log_base = detail::kNaN;
    int64_t g_base_n = 0;
  };

  using Pauses = std::vector<std::pair<std::string, std::string>>;

  static void validate(const HealthOptions& o);

  /// A manager's pause added by install; the slot's lock makes removal wait for a running call.
  struct PauseSlot {
    std::mutex mutex;
    PauseFn fn;
    bool live = true;
  };
  uint64_t add_install_pause(PauseFn fn);

  std::string callback_name() const;

  /// What attach's metadata tells about a forward output.
  static ActivationInfo activation_info(const Metadata& metadata);

  void on_hook(const HookContext& ctx);

  bool watched(std::string_view layer) const;

  std::size_t index_of(const Layer& L) const;

  /// The RMS of output `name`'s call `call` in `step`, when observed and finite.
  std::optional<double> output_rms(std::string_view name, int64_t call, int64_t step) const;

  Layer* layer_rec(std::string_view name);

  /// Finishes the previous step when `step` differs from it.
  void advance_to(int64_t step, Pauses& pauses, std::vector<HealthStep>& done);

  /// Packs the step that just ended for the sinks (only when someone listens).
  void finish_step(std::vector<HealthStep>& done);

  void deliver(const std::vector<HealthStep>& done);

  // ---- activations ----------------------------------------------------------------------

  void on_activation(Layer& L, const at::Tensor& y, const TensorStats& s, int64_t step,
                     const ActivationInfo& info, Pauses& pauses);

  /// The model's input as attach saw it on the step's first module output: NaN/Inf there is
  /// the data's failure (FailureKind::BadInput, layer "input"), and no layer is its origin.
  void on_input(const Layer& first, int64_t step, const ActivationInfo& info, Pauses& pauses);
  /// The model's input's RMS against its own baseline (HealthOptions::input_scale_jump).
  void on_input_scale(const Layer& first, int64_t step, const ActivationInfo& info, Pauses& pauses);

  /// An output's activation kind as the judgement sees it: from attach's metadata, or from
  /// `pre_activations` for a module output. `known == false`: the layer keeps its kind.
  struct Kind {
    std::string name;
    bool pre = false;
    bool known = false;
  };
  Kind kind_of(std::string_view layer, const ActivationInfo& info) const;

  static bool saturating_kind(const std::string& kind, bool pre);

  /// The values outside which an output of `kind` counts as saturated.
  std::pair<double, double> saturation_bounds(const std::string& k, bool pre) const;

  /// `prefetched`: the count of outside values when attach brought it with the step's batch.
  double saturated_fraction(const Layer& L, const at::Tensor& y, const TensorStats& s,
                            std::optional<double> prefetched) const;

  void push_units(Layer& L, std::vector<int64_t> counts, int64_t per_unit, int64_t step);

  /// The fraction of dead units over the window; `since`: the step of the oldest held output
  /// in which every one of them was inactive, in the unbroken run up to the newest (a
  /// failure that the window confirms only after a few outputs began there).
  double dead_fraction(const Layer& L, int64_t* since) const;

  // ---- gradients ------------------------------------------------------------------------

  void evaluate_gradients(Pauses& pauses);

  // ---- loss -----------------------------------------------------------------------------

  void on_loss(int64_t step, double loss, Pauses& pauses);

  // ---- events and incidents -------------------------------------------------------------

  uint64_t emit(SemanticEvent e);

  /// The new incident's index; none when the capacity is reached (the capacity keeps the
  /// earliest onsets, which matter most).
  std::optional<std::size_t> add_incident(FailureKind kind, const Layer& L, int64_t step,
                                          Phase phase, double margin, double value,
                                          double threshold, uint64_t event);

  /// Pauses on incident `idx` when its kind is in `pause_on` (call once its details are in).
  void pause_for(std::size_t idx, int64_t step, Pauses& pauses);

  /// Whether `layer` shows failures of `kind` by design (HealthOptions::expected).
  bool is_expected(FailureKind kind, std::string_view layer) const;

  /// The first finding of the rules for `sig` (`check` calls the rule's method for it). A rule
  /// that throws judges nothing and is counted in rule_errors().
  template <typename Signals, typename Check>
  std::optional<Finding> judge(const Signals& sig, Check check, const HealthRule*& by) {
    for (const auto& rule : rules_) {
      try {
        std::optional<Finding> f = check(*rule, sig);
        if (f) {
          by = rule.get();
          return f;
        }
      } catch (...) {
        ++rule_errors_;
      }
    }
    return std::nullopt;
  }

  /// A rule's finding becomes an incident (its onset backdated to `Finding::since`), with
  /// the rule's name and details.
  void record_finding(const Finding& f, const HealthRule& rule, const Layer& L, int64_t step,
                      Phase phase, uint64_t event, Pauses& pauses, std::optional<std::size_t>& slot,
                      const nlohmann::json* extra = nullptr);

  void update_incident(std::size_t i, int64_t step, double margin, int64_t persisted, double value);

  void run_pauses(int64_t step, const Pauses& pauses);

  // ---- snapshots ------------------------------------------------------------------------

  LayerHealth health_of(const Layer& L) const;

  std::vector<LayerHealth> layers_locked() const;

  HealthReport report_locked() const;

  static constexpr int64_t kUnordered = int64_t{1} << 40;
  // Gains up to this (an output no wider than its input) are not measured again on the
  // output's spread across the batch (never larger): ExplodingActivationRule's limits are at
  // least 2 unless configured lower.
  static constexpr double kGainSpreadFrom = 1.0;

  HealthOptions options_;
  std::vector<HealthRulePtr> rules_;
  uint64_t rule_errors_ = 0;
  std::vector<detail::Pattern> layer_patterns_;
  std::vector<std::pair<detail::Pattern, std::string>> pre_acts_;
  std::vector<std::pair<detail::Pattern, FailureKind>> expected_;

  mutable Mutex mutex_;
  std::vector<Layer> layers_;
  std::unordered_map<std::string, std::size_t> index_;
  std::size_t last_rec_ = 0;  // layer_rec's guess
  /// The prefetch keys install() registers, once (they name this monitor).
  const std::string units_key_ = callback_name() + ".units";
  const std::string saturation_key_ = callback_name() + ".saturation";
  std::vector<Incident> incidents_;
  uint64_t dropped_incidents_ = 0;
  detail::RingBuffer<SemanticEvent> events_;
  uint64_t event_seq_ = 0, alarms_ = 0, ignored_ = 0;

  bool have_step_ = false;
  int64_t cur_step_ = 0;
  int64_t fwd_seq_ = 0;
  std::optional<double> prev_rms_;
  bool fwd_nonfinite_ = false;
  bool input_bad_ = false;  // the last observed model input held NaN/Inf
  int64_t input_persist_ = 0;
  std::optional<std::size_t> input_incident_;
  /// The scale of each attached model's input (keyed by its first layer).
  struct InputScale {
    double log_base = detail::kNaN;  // EMA of log(RMS) over healthy steps
    double log_var = 0.0;            // EMA of its squared deviations
    std::vector<double> warmup;      // log(RMS) of the first steps: their median starts it
    int64_t last_step = -1;
    int64_t persist = 0;
    std::optional<std::size_t> incident;  // the shift going on
  };
  /// A shift must also be this many of the baseline's own standard deviations (log RMS).
  static constexpr double kInputScaleSigmas = 4.0;
  /// Inputs with fewer finite elements are not judged (one sample of a few features).
  static constexpr int64_t kInputScaleMinCount = 16;
  std::map<std::string, InputScale, std::less<>> input_scales_;
  int64_t bwd_arrivals_ = 0;
  bool bwd_nonfinite_ = false;
  bool grads_pending_ = false;
  std::vector<std::size_t> touched_;

  std::vector<double> losses_;
  std::optional<double> first_loss_, last_loss_;
  LossHealth loss_state_ = LossHealth::Healthy;
  int64_t loss_persist_ = 0;
  std::optional<std::size_t> loss_incident_;

  PauseFn pause_fn_;  // the user's (set_pause_callback)
  std::vector<std::pair<uint64_t, std::shared_ptr<PauseSlot>>> install_pauses_;
  uint64_t pause_seq_ = 0;
  std::optional<HealthReport> failure_report_;
  std::vector<std::pair<uint64_t, StepSink>> sinks_;
  uint64_t sink_seq_ = 0;
  uint64_t step_events_from_ = 0;
  std::optional<double> step_loss_;
};

#if TORCHDBG_DEFINITIONS

template <typename Mutex>
BasicHealthMonitor<Mutex>::~BasicHealthMonitor() = default;

template <typename Mutex>
template <typename M>
auto BasicHealthMonitor<Mutex>::install(BasicHookManager<M>& hooks)
    -> HealthInstallation<Mutex, M> {
  const std::string cb = callback_name();
  if (hooks.has_callback(cb))
    throw Error(
        "torchdbg: this HealthMonitor is already installed on this HookManager (callback '" + cb +
        "'); remove that installation first");
  hooks.register_callback(
      cb, [this](const HookContext& ctx) { on_hook(ctx); }, CallbackStats::Moments);
  // Queued device deliveries (attach's StatsBatching) bring the counts the judgement needs
  // in the step's one copy instead of a sync per layer.
  BasicHookManager<M>* owner = &hooks;
  auto due = [this, owner](std::string_view layer, bool is_forward) {
    return is_forward && watched(layer) && owner->step() % options_.interval() == 0;
  };
  hooks.add_prefetch(units_key_,
                     [this, due](std::string_view layer, const at::Tensor& t, bool fwd,
                                 const Metadata& md) -> at::Tensor {
                       if (!due(layer, fwd) || t.dim() == 0) return {};
                       const Kind k = kind_of(layer, activation_info(md));
                       if (!k.known || !detail::is_dead_capable(k.name)) return {};
                       return detail::count_above_per_unit_on_device(
                           t, t.dim() == 1 ? 0 : options_.unit_dim(), 0.0);
                     });
  hooks.add_prefetch(saturation_key_,
                     [this, due](std::string_view layer, const at::Tensor& t, bool fwd,
                                 const Metadata& md) -> at::Tensor {
                       if (!due(layer, fwd)) return {};
                       const Kind k = kind_of(layer, activation_info(md));
                       if (!k.known || !saturating_kind(k.name, k.pre)) return {};
                       const auto [lo, hi] = saturation_bounds(k.name, k.pre);
                       return detail::count_outside_on_device(t, lo, hi);
                     });
  HookConfig config = HookConfig()
                          .name("torchdbg.health")
                          .trigger(HookTrigger::every_n_steps(options_.interval()))
                          .actions({HookAction::custom_callback(cb)})
                          .layer_patterns(options_.layers());
  BasicHookManager<M>* mgr = &hooks;
  const uint64_t pause_token =
      add_install_pause([mgr](int64_t step, const std::string& layer, const std::string& reason) {
        mgr->pause_training(reason, layer, step, "torchdbg.health");
      });
  const uint64_t listener =
      hooks.add_listener([this, mgr](typename BasicHookManager<M>::Change change) {
        using Change = typename BasicHookManager<M>::Change;
        try {
          if (change == Change::After) {
            set_step(mgr->step());
          } else if (change == Change::Loss) {
            const TrainingState st = mgr->state();
            if (st.loss) observe_loss(st.loss_step.value_or(st.step), *st.loss);
          } else if (change == Change::GradientNorm || change == Change::BackwardEnd) {
            end_backward();  // once: the second finds nothing pending
          } else if (change == Change::BackwardFailed) {
            abandon_backward();
          }
        } catch (...) {
          // a listener must not throw into set_step/set_loss
        }
      });
  set_step(hooks.step());
  HookId id;
  try {
    id = hooks.register_hook(std::move(config));
  } catch (...) {
    hooks.remove_listener(listener);
    (void)hooks.remove_callback(cb);
    (void)hooks.remove_prefetch(units_key_);
    (void)hooks.remove_prefetch(saturation_key_);
    release_pause_callback(pause_token);
    throw;
  }
  return HealthInstallation<Mutex, M>(mgr, this, id, cb, listener, pause_token);
}

template <typename Mutex>
BasicHealthMonitor<Mutex>::BasicHealthMonitor(HealthOptions options)
    : options_(std::move(options)),
      events_(options_.event_capacity() == 0 ? 1 : options_.event_capacity()) {
  validate(options_);
  for (const auto& p : options_.layers())
    layer_patterns_.push_back(detail::compile_pattern(p, "health layer pattern"));
  for (const auto& [pattern, act] : options_.pre_activations()) {
    if (act != "tanh" && act != "sigmoid" && act != "relu")
      throw Error("torchdbg: pre_activations supports tanh, sigmoid and relu, got '" + act +
                  "' for '" + pattern + "'");
    pre_acts_.emplace_back(detail::compile_pattern(pattern, "pre_activations pattern"), act);
  }
  for (const auto& [pattern, kind] : options_.expected())
    expected_.emplace_back(detail::compile_pattern(pattern, "expected failure pattern"), kind);
  rules_ = builtin_health_rules(options_);
  for (std::size_t i = 0; i < options_.rules().size(); ++i) {
    if (!options_.rules()[i])
      throw Error("torchdbg: HealthOptions::rules[" + std::to_string(i) + "] is null");
    rules_.push_back(options_.rules()[i]);
  }
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::add_rule(HealthRulePtr rule) {
  if (!rule) throw Error("torchdbg: add_rule got a null rule");
  std::lock_guard<Mutex> lock(mutex_);
  rules_.push_back(std::move(rule));
}

template <typename Mutex>
uint64_t BasicHealthMonitor<Mutex>::rule_errors() const {
  std::lock_guard<Mutex> lock(mutex_);
  return rule_errors_;
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::rule_names() const -> std::vector<std::string> {
  std::lock_guard<Mutex> lock(mutex_);
  std::vector<std::string> out;
  for (const auto& r : rules_) out.push_back(r->name());
  return out;
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::set_pause_callback(PauseFn fn) {
  std::lock_guard<Mutex> lock(mutex_);
  pause_fn_ = std::move(fn);
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::release_pause_callback(uint64_t token) {
  std::shared_ptr<PauseSlot> slot;
  {
    std::lock_guard<Mutex> lock(mutex_);
    for (auto it = install_pauses_.begin(); it != install_pauses_.end(); ++it) {
      if (it->first != token) continue;
      slot = it->second;
      install_pauses_.erase(it);
      break;
    }
  }
  if (!slot) return;
  std::lock_guard<std::mutex> lock(slot->mutex);
  slot->live = false;
}

template <typename Mutex>
uint64_t BasicHealthMonitor<Mutex>::add_step_sink(StepSink sink) {
  std::lock_guard<Mutex> lock(mutex_);
  sinks_.emplace_back(++sink_seq_, std::move(sink));
  return sink_seq_;
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::remove_step_sink(uint64_t id) {
  std::lock_guard<Mutex> lock(mutex_);
  sinks_.erase(
      std::remove_if(sinks_.begin(), sinks_.end(), [&](const auto& s) { return s.first == id; }),
      sinks_.end());
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::flush() {
  Pauses pauses;
  std::vector<HealthStep> done;
  int64_t step = 0;
  {
    std::lock_guard<Mutex> lock(mutex_);
    step = cur_step_;
    if (!have_step_) return;
    evaluate_gradients(pauses);
    finish_step(done);
    have_step_ = false;
  }
  run_pauses(step, pauses);
  deliver(done);
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::observe_activation(std::string_view layer, const at::Tensor& output,
                                                   int64_t step, const ActivationInfo& info,
                                                   const TensorStats* stats) {
  if (!output.defined())
    throw Error("torchdbg: observe_activation got an undefined tensor for '" + std::string(layer) +
                "'");
  std::optional<TensorStats> own;
  if (stats == nullptr) {
    own = compute_stats(output, StatsOptions().sign_counts(false));  // not read here
    stats = &*own;
  }
  Pauses pauses;
  std::vector<HealthStep> done;
  {
    std::lock_guard<Mutex> lock(mutex_);
    if (!watched(layer)) return;
    advance_to(step, pauses, done);
    Layer* L = layer_rec(layer);
    if (L != nullptr) on_activation(*L, output, *stats, step, info, pauses);
  }
  run_pauses(step, pauses);
  deliver(done);
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::observe_gradient(std::string_view layer, std::string_view parameter,
                                                 const at::Tensor& grad, int64_t step,
                                                 const TensorStats* stats) {
  if (!grad.defined())
    throw Error("torchdbg: observe_gradient got an undefined tensor for '" + std::string(layer) +
                "'");
  std::optional<TensorStats> own;
  if (stats == nullptr) {
    own = compute_stats(grad, StatsOptions().sign_counts(false));  // not read here
    stats = &*own;
  }
  (void)parameter;
  Pauses pauses;
  std::vector<HealthStep> done;
  {
    std::lock_guard<Mutex> lock(mutex_);
    if (!watched(layer)) return;
    advance_to(step, pauses, done);
    Layer* L = layer_rec(layer);
    if (L != nullptr) {
      if (!L->g_touched) {
        L->g_touched = true;
        L->g_sq = 0.0;
        L->g_nonfinite = 0;
        L->g_count = 0;
        L->bwd_arrival = bwd_arrivals_++;
        touched_.push_back(index_of(*L));
      }
      L->g_sq += stats->l2_norm * stats->l2_norm;
      L->g_nonfinite += stats->nan_count + stats->inf_count;
      L->g_count += stats->numel;
      grads_pending_ = true;
    }
  }
  run_pauses(step, pauses);
  deliver(done);
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::end_backward() {
  Pauses pauses;
  int64_t step = 0;
  {
    std::lock_guard<Mutex> lock(mutex_);
    step = cur_step_;
    evaluate_gradients(pauses);
  }
  run_pauses(step, pauses);
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::observe_loss(int64_t step, double loss) {
  Pauses pauses;
  std::vector<HealthStep> done;
  {
    std::lock_guard<Mutex> lock(mutex_);
    advance_to(step, pauses, done);
    on_loss(step, loss, pauses);
  }
  run_pauses(step, pauses);
  deliver(done);
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::set_step(int64_t step) {
  Pauses pauses;
  std::vector<HealthStep> done;
  {
    std::lock_guard<Mutex> lock(mutex_);
    advance_to(step, pauses, done);
  }
  run_pauses(step, pauses);
  deliver(done);
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::layers() const -> std::vector<LayerHealth> {
  std::lock_guard<Mutex> lock(mutex_);
  return layers_locked();
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::layer(std::string_view name) const -> std::optional<LayerHealth> {
  std::lock_guard<Mutex> lock(mutex_);
  auto it = index_.find(std::string(name));
  if (it == index_.end()) return std::nullopt;
  return health_of(layers_[it->second]);
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::loss_health() const -> LossHealth {
  std::lock_guard<Mutex> lock(mutex_);
  return loss_state_;
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::events() const -> std::vector<SemanticEvent> {
  std::lock_guard<Mutex> lock(mutex_);
  return events_.to_vector();
}

template <typename Mutex>
uint64_t BasicHealthMonitor<Mutex>::event_count() const {
  std::lock_guard<Mutex> lock(mutex_);
  return event_seq_;
}

template <typename Mutex>
uint64_t BasicHealthMonitor<Mutex>::alarm_count() const {
  std::lock_guard<Mutex> lock(mutex_);
  return alarms_;
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::incidents() const -> std::vector<Incident> {
  std::lock_guard<Mutex> lock(mutex_);
  return incidents_;
}

template <typename Mutex>
uint64_t BasicHealthMonitor<Mutex>::ignored_layers() const {
  std::lock_guard<Mutex> lock(mutex_);
  return ignored_;
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::report() const -> HealthReport {
  std::lock_guard<Mutex> lock(mutex_);
  return report_locked();
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::failure_report() const -> std::optional<HealthReport> {
  std::lock_guard<Mutex> lock(mutex_);
  return failure_report_;
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::abandon_backward() {
  std::lock_guard<Mutex> lock(mutex_);
  for (const auto i : touched_) {
    Layer& L = layers_[i];
    L.g_touched = false;
    L.g_sq = 0.0;
    L.g_nonfinite = 0;
    L.g_count = 0;
  }
  touched_.clear();
  grads_pending_ = false;
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::reset() {
  std::lock_guard<Mutex> lock(mutex_);
  layers_.clear();
  index_.clear();
  incidents_.clear();
  events_.clear();
  event_seq_ = alarms_ = ignored_ = rule_errors_ = 0;
  touched_.clear();
  fwd_seq_ = 0;
  grads_pending_ = false;
  prev_rms_.reset();
  fwd_nonfinite_ = false;
  input_bad_ = false;
  input_persist_ = 0;
  input_incident_.reset();
  input_scales_.clear();
  losses_.clear();
  loss_state_ = LossHealth::Healthy;
  loss_persist_ = 0;
  loss_incident_.reset();
  last_loss_.reset();
  first_loss_.reset();
  failure_report_.reset();
  have_step_ = false;
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::validate(const HealthOptions& o) {
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
  detail::require_at_least<int64_t>(o.dead_window_samples(), 1,
                                    "HealthOptions::dead_window_samples");
  detail::require_at_least<int64_t>(o.dead_window(), 1, "HealthOptions::dead_window");
  detail::require_at_least<int64_t>(o.loss_window(), 2, "HealthOptions::loss_window");
  detail::require_at_least<int64_t>(o.plateau_window(), 4, "HealthOptions::plateau_window");
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
  positive(o.gradient_jump(), "gradient_jump");
  positive(o.gradient_collapse(), "gradient_collapse");
  positive(o.loss_spike_factor(), "loss_spike_factor");
  if (!(o.loss_spike_floor() >= 0.0))
    throw Error("torchdbg: HealthOptions::loss_spike_floor must be >= 0, got " +
                std::to_string(o.loss_spike_floor()));
  positive(o.plateau_tolerance(), "plateau_tolerance");
  if (o.sigmoid_low() >= o.sigmoid_high())
    throw Error("torchdbg: HealthOptions::sigmoid_low must be below sigmoid_high");
}

template <typename Mutex>
uint64_t BasicHealthMonitor<Mutex>::add_install_pause(PauseFn fn) {
  auto slot = std::make_shared<PauseSlot>();
  slot->fn = std::move(fn);
  std::lock_guard<Mutex> lock(mutex_);
  const uint64_t token = ++pause_seq_;
  install_pauses_.emplace_back(token, std::move(slot));
  return token;
}

template <typename Mutex>
std::string BasicHealthMonitor<Mutex>::callback_name() const {
  return "torchdbg.health." + std::to_string(reinterpret_cast<std::uintptr_t>(this));
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::activation_info(const Metadata& metadata) -> ActivationInfo {
  auto md = [&](std::string_view k) {
    auto it = metadata.find(k);
    return it == metadata.end() ? std::string_view{} : std::string_view(it->second);
  };
  ActivationInfo info{md("activation"), md("op"), md("module_type"), md("pre_activation"),
                      std::nullopt};
  info.input_from = md("input_from");
  const auto integer = [&](std::string_view k) -> std::optional<int64_t> {
    auto it = metadata.find(k);
    if (it == metadata.end()) return std::nullopt;
    try {
      return std::stoll(it->second);
    } catch (...) {
      return std::nullopt;
    }
  };
  info.call = integer("call");
  info.input_call = integer("input_call").value_or(-1);
  info.input_count = integer("input_count").value_or(-1);
  info.norm_samples = integer("norm_samples").value_or(0);
  std::optional<double> norm_momentum;
  for (auto [key, value] :
       {std::pair<const char*, std::optional<double>*>{"input_rms", &info.input_rms},
        std::pair<const char*, std::optional<double>*>{"std_less_bias", &info.std_less_bias},
        std::pair<const char*, std::optional<double>*>{"norm_stats_error", &info.norm_stats_error},
        std::pair<const char*, std::optional<double>*>{"norm_weight_rms", &info.norm_weight_rms},
        std::pair<const char*, std::optional<double>*>{"norm_momentum", &norm_momentum}}) {
    if (auto it = metadata.find(key); it != metadata.end()) {
      try {
        *value = std::stod(it->second);
      } catch (...) {
      }
    }
  }
  if (norm_momentum) info.norm_momentum = *norm_momentum;
  for (auto [key, count] : {std::pair<const char*, int64_t*>{"input_nan", &info.input_nan},
                            std::pair<const char*, int64_t*>{"input_inf", &info.input_inf}}) {
    if (auto it = metadata.find(key); it != metadata.end()) {
      try {
        *count = std::max<int64_t>(0, std::stoll(it->second));
        info.input_observed = true;
      } catch (...) {
      }
    }
  }
  return info;
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::on_hook(const HookContext& ctx) {
  if (ctx.is_forward()) {
    ActivationInfo info = activation_info(ctx.metadata());
    info.unit_counts = ctx.prefetched(units_key_);
    info.saturated_count = ctx.prefetched(saturation_key_);
    observe_activation(ctx.layer_name(), ctx.tensor(), ctx.step(), info, &ctx.moment_stats());
  } else {
    observe_gradient(ctx.layer_name(), ctx.metadata_value("parameter").value_or(std::string_view{}),
                     ctx.tensor(), ctx.step(), &ctx.moment_stats());
  }
}

template <typename Mutex>
bool BasicHealthMonitor<Mutex>::watched(std::string_view layer) const {
  if (layer_patterns_.empty()) return true;
  const std::string s(layer);
  for (const auto& re : layer_patterns_)
    if (re.search(s)) return true;
  return false;
}

template <typename Mutex>
std::size_t BasicHealthMonitor<Mutex>::index_of(const Layer& L) const {
  return static_cast<std::size_t>(&L - layers_.data());
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::output_rms(std::string_view name, int64_t call, int64_t step) const
    -> std::optional<double> {
  auto it = index_.find(std::string(name));
  if (it == index_.end()) return std::nullopt;
  const Layer& P = layers_[it->second];
  if (!P.seen_fwd || P.act_step != step || P.rms_call != call || P.nonfinite_frac > 0.0 ||
      !(P.rms > 0.0))
    return std::nullopt;
  return P.rms;
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::layer_rec(std::string_view name) -> Layer* {
  // Deliveries come in the same order every step: the last layer (a module's next
  // parameter) or the one after it is almost always the one asked for.
  for (const std::size_t i : {last_rec_, last_rec_ + 1}) {
    if (i < layers_.size() && layers_[i].name == name) {
      last_rec_ = i;
      return &layers_[i];
    }
  }
  const std::string key(name);
  auto it = index_.find(key);
  if (it != index_.end()) {
    last_rec_ = it->second;
    return &layers_[it->second];
  }
  if (layers_.size() >= options_.max_layers()) {
    ++ignored_;
    return nullptr;
  }
  Layer L;
  L.name = key;
  L.module = key.substr(0, key.find('/'));
  L.order = kUnordered + static_cast<int64_t>(layers_.size());
  index_.emplace(key, layers_.size());
  last_rec_ = layers_.size();
  layers_.push_back(std::move(L));
  return &layers_.back();
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::advance_to(int64_t step, Pauses& pauses,
                                           std::vector<HealthStep>& done) {
  if (have_step_ && step == cur_step_) return;
  if (have_step_) {
    evaluate_gradients(pauses);
    finish_step(done);
  }
  have_step_ = true;
  step_events_from_ = event_seq_;
  step_loss_.reset();
  cur_step_ = step;
  fwd_seq_ = 0;
  prev_rms_.reset();
  fwd_nonfinite_ = false;
  bwd_arrivals_ = 0;
  bwd_nonfinite_ = false;
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::finish_step(std::vector<HealthStep>& done) {
  if (sinks_.empty()) return;
  HealthStep h;
  h.step = cur_step_;
  h.loss = step_loss_;
  h.loss_health = loss_state_;
  for (const auto& L : layers_)
    if (L.last_step == cur_step_ && (L.seen_fwd || L.seen_bwd)) h.layers.push_back(health_of(L));
  std::stable_sort(h.layers.begin(), h.layers.end(),
                   [](const LayerHealth& a, const LayerHealth& b) { return a.order < b.order; });
  const uint64_t fresh = event_seq_ - step_events_from_;
  const std::size_t held = events_.size();
  const std::size_t n = static_cast<std::size_t>(std::min<uint64_t>(fresh, held));
  for (std::size_t i = held - n; i < held; ++i) h.events.push_back(events_.at(i));
  step_events_from_ = event_seq_;
  done.push_back(std::move(h));
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::deliver(const std::vector<HealthStep>& done) {
  if (done.empty()) return;
  std::vector<std::pair<uint64_t, StepSink>> sinks;
  {
    std::lock_guard<Mutex> lock(mutex_);
    sinks = sinks_;
  }
  for (const auto& h : done)
    for (const auto& [id, fn] : sinks) {
      try {
        fn(h);
      } catch (...) {
        // a sink's failure (a full disk) must not reach the training loop
      }
    }
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::on_activation(Layer& L, const at::Tensor& y, const TensorStats& s,
                                              int64_t step, const ActivationInfo& info,
                                              Pauses& pauses) {
  const std::string_view activation = info.activation, op = info.op, module_type = info.module_type;
  L.last_step = step;
  // Persistence counts steps: a module called several times in a step judges each call,
  // and its second call in the same state is no further evidence of persistence.
  const bool new_step = !L.seen_fwd || L.act_step != step;
  L.act_step = step;
  // Forward order: the position of the layer's output within the step (the module of an
  // activation takes the position of its first output).
  const int64_t pos = fwd_seq_++;
  if (!L.order_from_forward || L.order != pos) {
    L.order = pos;
    L.order_from_forward = true;
  }
  const Kind k = kind_of(L.name, info);
  if (k.known) {
    L.act_kind = k.name;
    L.pre_activation = k.pre;
  }
  // The gain is judged on module outputs that are not normalisations.
  L.gain_checked =
      activation.empty() && op.empty() && module_type.find("Norm") == std::string_view::npos;
  // Counts prefetched for this output hold when they were made for the kind judged here.
  const bool prefetch_valid = k.known && k.name == L.act_kind && k.pre == L.pre_activation;

  // ---- the measurements
  // The input's scale: measured by attach, the output it came from (observed in this
  // step, same call), or without attach's metadata the previous output.
  std::optional<double> in_rms;
  if (info.input_rms && *info.input_rms > 0.0) {
    in_rms = info.input_rms;
  } else if (!info.input_from.empty()) {
    in_rms = output_rms(info.input_from, info.input_call, step);
  } else if (!info.call) {
    in_rms = prev_rms_;
  }
  const double numel = static_cast<double>(s.numel);
  L.nonfinite_frac = numel > 0 ? static_cast<double>(s.nan_count + s.inf_count) / numel : 0.0;
  L.rms = s.finite_count > 0 ? std::sqrt(s.mean * s.mean + s.std * s.std) : detail::kNaN;
  L.rms_call = info.call.value_or(-1);
  prev_rms_ = (s.has_non_finite() || !(L.rms > 0.0)) ? std::optional<double>()
                                                     : std::optional<double>(L.rms);
  // The gain compares the output's spread with the input's scale: a shifted bias moves the
  // mean, not the spread, and is no explosion.
  L.gain = (L.gain_checked && in_rms && std::isfinite(s.std)) ? s.std / *in_rms : detail::kNaN;
  if (info.input_observed) on_input(L, step, info, pauses);
  // A NaN/Inf output is the step's origin only when nothing before it in the step (the
  // model's input included) was non-finite.
  const bool origin = s.has_non_finite() && !fwd_nonfinite_;
  if (s.has_non_finite()) fwd_nonfinite_ = true;

  // Dead units (ReLU family) are tracked on every delivery to fill the window.
  if (detail::is_dead_capable(L.act_kind) && y.dim() > 0) {
    const int64_t dim = y.dim() == 1 ? 0 : options_.unit_dim();
    int64_t per_unit = 0;
    try {
      std::vector<int64_t> counts;
      const int64_t units = y.size(detail::unit_dim_of(y, dim));
      if (prefetch_valid && info.unit_counts != nullptr &&
          static_cast<int64_t>(info.unit_counts->size()) == units) {
        for (double c : *info.unit_counts) counts.push_back(static_cast<int64_t>(c));
        per_unit = units == 0 ? 0 : y.numel() / units;
      } else {
        counts = detail::count_above_per_unit(y, dim, 0.0, per_unit);
      }
      push_units(L, std::move(counts), per_unit, step);
    } catch (const Error&) {
      // the unit dimension does not exist for this output: no dead-unit judgement
    }
    L.dead_frac = dead_fraction(L, &L.dead_since);
  }
  if (!s.has_non_finite() && saturating_kind(L.act_kind, L.pre_activation)) {
    L.sat_frac = saturated_fraction(
        L, y, s,
        prefetch_valid && info.saturated_count != nullptr && info.saturated_count->size() == 1
            ? std::optional<double>((*info.saturated_count)[0])
            : std::nullopt);
  }
  const bool base_ready = L.gain_n >= options_.baseline_warmup() && std::isfinite(L.gain_base);
  // Nor do the bias's differences between units (an output of small inputs is mostly its
  // bias), or an output the same for every sample: the gain is also measured on the output's
  // spread across the batch, with its own baseline. That spread is never above the whole
  // std, so the extra pass runs only where a gain limit could be crossed; below, the whole
  // std's gain stands for it (an upper bound) in its baseline.
  L.spread_gain = detail::kNaN;
  double batch_spread = detail::kNaN;
  if (L.gain > std::min(kGainSpreadFrom, options_.activation_gain()) && !s.has_non_finite()) {
    batch_spread = detail::batch_spread(y);
    L.spread_gain = batch_spread / *in_rms;
    // One sample: what varies besides the module's own bias (measured by attach).
    if (!std::isfinite(batch_spread) && y.dim() >= 2 && y.size(0) == 1 && info.std_less_bias &&
        std::isfinite(*info.std_less_bias))
      L.spread_gain = *info.std_less_bias / *in_rms;
  }
  // A normalization's output the same for every sample (its weight collapsed to 0) is
  // constant to the user: measured across the whole batch only where the first two samples'
  // outputs are alike (two rows read otherwise; CPU outputs, no device sync). Other modules
  // may be meant to give every sample the same output (a position embedding of expanded
  // ids): their spread across the batch judges only their gain.
  const bool normalization = module_type.find("Norm") != std::string_view::npos;
  if (normalization && !std::isfinite(batch_spread) && y.device().is_cpu() && !s.has_non_finite() &&
      y.dim() >= 2 && y.size(0) >= 2 && std::isfinite(L.rms)) {
    const double first_two = detail::batch_spread(y.narrow(0, 0, 2));
    if (first_two <= options_.constant_ratio() * L.rms) batch_spread = detail::batch_spread(y);
  }
  const bool spread_ready = base_ready && std::isfinite(L.spread_base);

  // ---- the rules
  ActivationSignals sig(y, s);
  sig.layer = L.name;
  sig.module = L.module;
  sig.step = step;
  sig.kind = L.act_kind;
  sig.pre_activation = L.pre_activation;
  sig.module_output = L.gain_checked;
  sig.rms = L.rms;
  sig.gain = L.gain;
  sig.gain_baseline = base_ready ? L.gain_base : detail::kNaN;
  sig.gain_spread = L.spread_gain;
  sig.batch_spread = normalization ? batch_spread : detail::kNaN;
  sig.gain_spread_baseline = spread_ready ? L.spread_base : detail::kNaN;
  sig.dead_fraction = detail::is_dead_capable(L.act_kind) ? L.dead_frac : detail::kNaN;
  sig.dead_since = std::min(step, L.dead_since);
  sig.dead_activity = options_.dead_activity();
  sig.saturated_fraction = saturating_kind(L.act_kind, L.pre_activation) && !s.has_non_finite()
                               ? L.sat_frac
                               : detail::kNaN;
  sig.origin = origin;
  if (info.norm_stats_error) {
    sig.norm_stats_error = *info.norm_stats_error;
    sig.norm_samples = info.norm_samples;
    sig.norm_momentum = info.norm_momentum;
    sig.norm_stats_previous = L.norm_stats_prev;
    sig.norm_stats_previous_step = L.norm_stats_prev_step;
    L.norm_stats_prev = *info.norm_stats_error;
    L.norm_stats_prev_step = step;
  }
  if (info.norm_weight_rms && std::isfinite(*info.norm_weight_rms)) {
    L.norm_weight_peak = std::isfinite(L.norm_weight_peak)
                             ? std::max(L.norm_weight_peak, *info.norm_weight_rms)
                             : *info.norm_weight_rms;
    sig.norm_weight_rms = *info.norm_weight_rms;
    sig.norm_weight_peak = L.norm_weight_peak;
  }
  const HealthRule* by = nullptr;
  const std::optional<Finding> found = judge(
      sig, [](HealthRule& r, const auto& x) { return r.check_activation(x); }, by);
  ActivationHealth state = ActivationHealth::Normal;
  if (found) {
    switch (found->kind) {
      case FailureKind::NonFiniteOutput:
        state = ActivationHealth::NonFinite;
        break;
      case FailureKind::DeadUnits:
        state = ActivationHealth::Dead;
        break;
      case FailureKind::Saturation:
        state = ActivationHealth::Saturated;
        break;
      default:
        state = ActivationHealth::Anomalous;
        break;
    }
  }
  if (state == ActivationHealth::Normal && std::isfinite(L.gain)) {
    const double m = options_.baseline_momentum();
    L.gain_base = std::isfinite(L.gain_base) ? m * L.gain_base + (1.0 - m) * L.gain : L.gain;
    ++L.gain_n;
    const double g = std::isfinite(L.spread_gain) ? L.spread_gain : L.gain;
    L.spread_base = std::isfinite(L.spread_base) ? m * L.spread_base + (1.0 - m) * g : g;
  }

  const ActivationHealth before = L.act;
  const bool first = !L.seen_fwd;
  L.seen_fwd = true;
  // A call that does not carry the measure behind the current finding (a BatchNorm's other
  // calls: eval, an operator on its weight outside the forward) neither confirms nor ends it.
  if (!found && !first &&
      ((L.act_found == FailureKind::NormStatistics && !info.norm_stats_error) ||
       (L.act_found == FailureKind::NormWeightCollapse && !info.norm_weight_rms)))
    return;
  // A finding of another kind in the same state (a collapsing weight at a layer whose running
  // statistics are already off) is a transition of its own; a weight near 0 and the constant
  // output it makes are one failure.
  const auto one_failure = [](FailureKind a, FailureKind b) {
    const auto collapse = [](FailureKind f) {
      return f == FailureKind::ConstantOutput || f == FailureKind::NormWeightCollapse;
    };
    return a == b || (collapse(a) && collapse(b));
  };
  const bool same =
      state == before && (!found || !L.act_found || one_failure(*L.act_found, found->kind));
  if (same && !first) {
    if (found) {
      if (new_step) ++L.act_persist;
      if (L.act_incident)
        update_incident(*L.act_incident, step, found->margin, L.act_persist, found->value);
    }
    return;
  }
  L.act = state;
  L.act_since = step;
  L.act_persist = 1;
  L.act_incident.reset();
  L.act_found = found ? std::optional<FailureKind>(found->kind) : std::nullopt;
  if (state == ActivationHealth::Normal && first) return;  // a healthy start is no event
  SemanticEvent e;
  e.type = state == ActivationHealth::Normal                     ? EventType::ActivationRecovered
           : state == ActivationHealth::NonFinite                ? EventType::NonFiniteActivation
           : state == ActivationHealth::Dead                     ? EventType::DeadUnits
           : state == ActivationHealth::Saturated                ? EventType::Saturation
           : found && found->kind == FailureKind::NormStatistics ? EventType::NormStatsDrift
           : found && found->kind == FailureKind::NormWeightCollapse ? EventType::NormWeightCollapse
                                                                     : EventType::ActivationAnomaly;
  e.layer = L.name;
  e.step = step;
  e.from = first ? "unobserved" : to_string(before);
  e.to = to_string(state);
  e.confidence =
      found ? detail::evidence_confidence(found->margin, 1, options_.persistence_steps()) : 1.0;
  e.metadata = {{"rms", detail::json_num(L.rms)}};
  if (std::isfinite(L.gain)) e.metadata["gain"] = L.gain;
  if (found) {
    for (const auto& [key, v] : found->details.items()) e.metadata[key] = v;
    if (!found->reason.empty()) e.metadata["reason"] = found->reason;
    if (is_expected(found->kind, L.name)) e.metadata["expected"] = true;
  }
  if (!L.act_kind.empty()) e.metadata["activation"] = L.act_kind;
  const uint64_t id = emit(std::move(e));
  if (found && found->incident)
    record_finding(*found, *by, L, step, Phase::Forward, id, pauses, L.act_incident);
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::on_input(const Layer& first, int64_t step,
                                         const ActivationInfo& info, Pauses& pauses) {
  const int64_t bad = info.input_nan + info.input_inf;
  if (bad == 0) {
    input_bad_ = false;
    input_incident_.reset();
    on_input_scale(first, step, info, pauses);
    return;
  }
  fwd_nonfinite_ = true;
  if (input_bad_) {  // still bad: the same incident goes on
    ++input_persist_;
    if (input_incident_)
      update_incident(*input_incident_, step, 1.0, input_persist_, static_cast<double>(bad));
    return;
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
  e.metadata = {{"nan", info.input_nan}, {"inf", info.input_inf}, {"first_layer", first.name}};
  const uint64_t id = emit(std::move(e));
  Layer pseudo;
  pseudo.name = pseudo.module = "input";
  pseudo.order = -1;  // before every layer
  input_incident_ = add_incident(FailureKind::BadInput, pseudo, step, Phase::Forward, 1.0,
                                 static_cast<double>(bad), 0.0, id);
  if (input_incident_) {  // not dropped at capacity
    Incident& inc = incidents_[*input_incident_];
    inc.details["nan"] = info.input_nan;
    inc.details["inf"] = info.input_inf;
    inc.details["first_layer"] = first.name;
    pause_for(*input_incident_, step, pauses);
  }
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::on_input_scale(const Layer& first, int64_t step,
                                               const ActivationInfo& info, Pauses& pauses) {
  const double jump = options_.input_scale_jump();
  if (!(jump > 1.0) || !info.input_rms || !(*info.input_rms > 0.0) ||
      !std::isfinite(*info.input_rms) ||
      (info.input_count >= 0 && info.input_count < kInputScaleMinCount))
    return;
  auto it = input_scales_.find(first.name);
  if (it == input_scales_.end()) {
    if (input_scales_.size() >= options_.max_layers()) return;
    it = input_scales_.emplace(first.name, InputScale{}).first;
  }
  InputScale& S = it->second;
  if (S.last_step == step) return;  // the step's first call only
  S.last_step = step;
  const double log_rms = std::log(*info.input_rms);
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
    if (S.incident) update_incident(*S.incident, step, margin, S.persist, ratio);
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
  e.metadata = {{"rms", *info.input_rms},
                {"baseline_rms", base_rms},
                {"ratio", ratio},
                {"first_layer", first.name}};
  const uint64_t id = emit(std::move(e));
  Layer pseudo;
  pseudo.name = pseudo.module = "input";
  pseudo.order = -1;  // before every layer
  S.incident =
      add_incident(FailureKind::BadInput, pseudo, step, Phase::Forward, margin, ratio, jump, id);
  if (S.incident) {  // not dropped at capacity
    Incident& inc = incidents_[*S.incident];
    inc.details["rms"] = *info.input_rms;
    inc.details["baseline_rms"] = base_rms;
    inc.details["ratio"] = ratio;
    inc.details["first_layer"] = first.name;
    pause_for(*S.incident, step, pauses);
  }
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::kind_of(std::string_view layer, const ActivationInfo& info) const
    -> Kind {
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

template <typename Mutex>
bool BasicHealthMonitor<Mutex>::saturating_kind(const std::string& kind, bool pre) {
  if (pre) return kind == "tanh" || kind == "sigmoid";
  return detail::is_saturating(kind);
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::saturation_bounds(const std::string& k, bool pre) const
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

template <typename Mutex>
double BasicHealthMonitor<Mutex>::saturated_fraction(const Layer& L, const at::Tensor& y,
                                                     const TensorStats& s,
                                                     std::optional<double> prefetched) const {
  if (s.numel == 0) return 0.0;
  double outside = 0.0;
  if (prefetched) {
    outside = *prefetched;
  } else {
    const auto [lo, hi] = saturation_bounds(L.act_kind, L.pre_activation);
    outside = static_cast<double>(detail::count_outside(y, lo, hi));
  }
  return outside / static_cast<double>(s.numel);
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::push_units(Layer& L, std::vector<int64_t> counts, int64_t per_unit,
                                           int64_t step) {
  const std::size_t w = static_cast<std::size_t>(options_.dead_window());
  if (!L.unit_ring.empty() && L.unit_ring.front().size() != counts.size()) {
    L.unit_ring.clear();  // the layer's width changed: start over
    L.sample_ring.clear();
    L.step_ring.clear();
    L.unit_head = 0;
  }
  if (L.unit_ring.size() < w) {
    L.unit_ring.push_back(std::move(counts));
    L.sample_ring.push_back(per_unit);
    L.step_ring.push_back(step);
  } else {
    L.unit_ring[L.unit_head] = std::move(counts);
    L.sample_ring[L.unit_head] = per_unit;
    L.step_ring[L.unit_head] = step;
    L.unit_head = (L.unit_head + 1) % w;
  }
}

template <typename Mutex>
double BasicHealthMonitor<Mutex>::dead_fraction(const Layer& L, int64_t* since) const {
  const std::size_t held = L.unit_ring.size();
  if (held == 0) return detail::kNaN;
  const std::size_t units = L.unit_ring.front().size();
  if (units == 0) return detail::kNaN;
  // Newest first until the window has enough samples.
  const std::size_t newest = (L.unit_head + held - 1) % held;
  std::vector<int64_t> active(units, 0);
  int64_t samples = 0;
  for (std::size_t k = 0; k < held && samples < options_.dead_window_samples(); ++k) {
    const std::size_t i = (newest + held - k) % held;
    samples += L.sample_ring[i];
    for (std::size_t u = 0; u < units; ++u) active[u] += L.unit_ring[i][u];
  }
  if (samples < options_.dead_window_samples()) return detail::kNaN;
  std::vector<std::size_t> dead;
  for (std::size_t u = 0; u < units; ++u)
    if (static_cast<double>(active[u]) < options_.dead_activity() * static_cast<double>(samples))
      dead.push_back(u);
  if (since != nullptr) {
    *since = L.step_ring[newest];
    for (std::size_t k = 0; k < held && !dead.empty(); ++k) {
      const std::size_t i = (newest + held - k) % held;
      const double limit = options_.dead_activity() * static_cast<double>(L.sample_ring[i]);
      bool inactive = true;
      for (const std::size_t u : dead)
        inactive = inactive && static_cast<double>(L.unit_ring[i][u]) <= limit;
      if (!inactive) break;
      *since = L.step_ring[i];
    }
  }
  return static_cast<double>(dead.size()) / static_cast<double>(units);
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::evaluate_gradients(Pauses& pauses) {
  if (!grads_pending_) return;
  grads_pending_ = false;
  const int64_t step = cur_step_;
  std::vector<std::size_t> mods = std::move(touched_);
  touched_.clear();
  double max_norm = 0.0;
  for (auto i : mods) {
    Layer& L = layers_[i];
    L.g_norm = std::sqrt(L.g_sq);
    if (!L.order_from_forward)
      L.order = kUnordered - L.bwd_arrival;  // backward runs output -> input
    if (L.g_nonfinite == 0 && std::isfinite(L.g_norm)) max_norm = std::max(max_norm, L.g_norm);
  }
  std::sort(mods.begin(), mods.end(),
            [&](std::size_t a, std::size_t b) { return layers_[a].order < layers_[b].order; });
  // The first non-finite gradient in backward order (arrival order) is the backward origin.
  std::optional<std::size_t> nf_origin;
  for (auto i : mods) {
    const Layer& L = layers_[i];
    if (L.g_nonfinite > 0 && (!nf_origin || L.bwd_arrival < layers_[*nf_origin].bwd_arrival))
      nf_origin = i;
  }
  for (std::size_t k = 0; k < mods.size(); ++k) {
    Layer& L = layers_[mods[k]];
    L.g_touched = false;
    L.last_step = std::max(L.last_step, step);
    // Adjacent ratio: upstream neighbour's norm over this layer's. Large where this layer
    // amplifies the backward signal (an explosion starts here).
    double amplification = detail::kNaN, usual_amplification = detail::kNaN;
    const bool base_ready = L.g_base_n >= options_.baseline_warmup() && std::isfinite(L.g_log_base);
    const double base = base_ready ? std::pow(10.0, L.g_log_base) : detail::kNaN;
    if (k > 0 && L.g_norm > 0.0 && std::isfinite(layers_[mods[k - 1]].g_norm)) {
      const Layer& up = layers_[mods[k - 1]];
      amplification = up.g_norm / L.g_norm;
      // The same ratio over its usual value (from both baselines): a uniformly scaled
      // backward pass amplifies nothing more than usual anywhere.
      if (base_ready && up.g_base_n >= options_.baseline_warmup() && std::isfinite(up.g_log_base))
        usual_amplification = amplification / std::pow(10.0, up.g_log_base - L.g_log_base);
    }
    GradientSignals sig;
    sig.layer = L.name;
    sig.step = step;
    sig.norm = L.g_norm;
    sig.non_finite = L.g_nonfinite;
    sig.count = L.g_count;
    sig.max_norm = max_norm;
    sig.baseline = base;
    sig.origin = nf_origin && *nf_origin == mods[k];
    const HealthRule* by = nullptr;
    const std::optional<Finding> found = judge(
        sig, [](HealthRule& r, const auto& x) { return r.check_gradient(x); }, by);
    GradientHealth state = GradientHealth::Healthy;
    if (found) {
      switch (found->kind) {
        case FailureKind::NonFiniteGradient:
          state = GradientHealth::NonFinite;
          break;
        case FailureKind::ExplodingGradient:
          state = GradientHealth::Exploding;
          break;
        case FailureKind::VanishingGradient:
          state = GradientHealth::Vanishing;
          break;
        default:
          state = GradientHealth::Anomalous;
          break;
      }
    }
    if (state == GradientHealth::Healthy && std::isfinite(L.g_norm) && L.g_norm > 0.0) {
      const double lg = std::log10(L.g_norm);
      const double m = options_.baseline_momentum();
      L.g_log_base = std::isfinite(L.g_log_base) ? m * L.g_log_base + (1.0 - m) * lg : lg;
      ++L.g_base_n;
    }
    const GradientHealth before = L.grad;
    const bool first = !L.seen_bwd;
    L.seen_bwd = true;
    if (state == before && !first) {
      if (found) {
        ++L.grad_persist;
        if (L.grad_incident)
          update_incident(*L.grad_incident, step, found->margin, L.grad_persist, found->value);
      }
      continue;
    }
    L.grad = state;
    L.grad_since = step;
    L.grad_persist = 1;
    L.grad_incident.reset();
    if (state == GradientHealth::Healthy && first) continue;
    SemanticEvent e;
    e.type = state == GradientHealth::Healthy     ? EventType::GradientRecovered
             : state == GradientHealth::NonFinite ? EventType::NonFiniteGradient
             : state == GradientHealth::Exploding ? EventType::ExplodingGradient
             : state == GradientHealth::Vanishing ? EventType::VanishingGradient
                                                  : EventType::GradientAnomaly;
    e.layer = L.name;
    e.step = step;
    e.from = first ? "unobserved" : to_string(before);
    e.to = to_string(state);
    e.confidence =
        found ? detail::evidence_confidence(found->margin, 1, options_.persistence_steps()) : 1.0;
    e.metadata = {{"norm", detail::json_num(L.g_norm)}};
    if (std::isfinite(amplification)) e.metadata["amplification"] = amplification;
    if (base_ready) e.metadata["baseline"] = base;
    if (max_norm > 0.0) e.metadata["relative_to_max"] = L.g_norm / max_norm;
    if (found) {
      for (const auto& [key, v] : found->details.items()) e.metadata[key] = v;
      if (!found->reason.empty()) e.metadata["reason"] = found->reason;
      if (is_expected(found->kind, L.name)) e.metadata["expected"] = true;
    }
    const uint64_t id = emit(std::move(e));
    if (found && found->incident) {
      nlohmann::json extra = nlohmann::json::object();
      if (std::isfinite(amplification)) extra["amplification"] = amplification;
      if (std::isfinite(usual_amplification)) extra["amplification_vs_usual"] = usual_amplification;
      record_finding(*found, *by, L, step, Phase::Backward, id, pauses, L.grad_incident, &extra);
    }
  }
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::on_loss(int64_t step, double loss, Pauses& pauses) {
  last_loss_ = loss;
  step_loss_ = loss;
  if (std::isfinite(loss) && !first_loss_) first_loss_ = std::fabs(loss);
  LossSignals sig(loss, losses_);
  sig.step = step;
  sig.first_loss = first_loss_.value_or(detail::kNaN);
  const HealthRule* by = nullptr;
  const std::optional<Finding> found = judge(
      sig, [](HealthRule& r, const auto& x) { return r.check_loss(x); }, by);
  if (std::isfinite(loss)) {
    losses_.push_back(loss);
    const std::size_t keep =
        static_cast<std::size_t>(std::max(options_.loss_window(), options_.plateau_window()));
    if (losses_.size() > 2 * keep)
      losses_.erase(losses_.begin(), losses_.end() - static_cast<std::ptrdiff_t>(keep));
  }
  LossHealth state = LossHealth::Healthy;
  if (found) {
    switch (found->kind) {
      case FailureKind::LossDivergence:
        state = LossHealth::Diverging;
        break;
      case FailureKind::LossSpike:
        state = LossHealth::Spike;
        break;
      case FailureKind::LossPlateau:
        state = LossHealth::Plateau;
        break;
      default:
        state = LossHealth::Anomalous;
        break;
    }
  }
  const LossHealth before = loss_state_;
  if (state == before) {
    if (found) {
      ++loss_persist_;
      if (loss_incident_)
        update_incident(*loss_incident_, step, found->margin, loss_persist_, found->value);
    }
    return;
  }
  loss_state_ = state;
  loss_persist_ = 1;
  loss_incident_.reset();
  SemanticEvent e;
  e.type = state == LossHealth::Healthy     ? EventType::LossRecovered
           : state == LossHealth::Diverging ? EventType::LossDiverged
           : state == LossHealth::Spike     ? EventType::LossSpike
           : state == LossHealth::Plateau   ? EventType::LossPlateau
                                            : EventType::LossAnomaly;
  e.layer = "loss";
  e.step = step;
  e.from = to_string(before);
  e.to = to_string(state);
  e.confidence =
      found ? detail::evidence_confidence(found->margin, 1, options_.persistence_steps()) : 1.0;
  e.metadata = {
      {"loss", std::isfinite(loss) ? nlohmann::json(loss) : nlohmann::json(std::to_string(loss))}};
  if (found) {
    for (const auto& [key, v] : found->details.items()) e.metadata[key] = v;
    if (!found->reason.empty()) e.metadata["reason"] = found->reason;
    if (is_expected(found->kind, "loss")) e.metadata["expected"] = true;
  }
  const uint64_t id = emit(std::move(e));
  if (found && found->incident) {
    Layer pseudo;
    pseudo.name = pseudo.module = "loss";
    pseudo.order = kUnordered * 2;
    record_finding(*found, *by, pseudo, step, Phase::Loss, id, pauses, loss_incident_);
  }
}

template <typename Mutex>
uint64_t BasicHealthMonitor<Mutex>::emit(SemanticEvent e) {
  e.id = ++event_seq_;
  if (e.is_alarm()) ++alarms_;
  const uint64_t id = e.id;
  events_.push(std::move(e));
  return id;
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::add_incident(FailureKind kind, const Layer& L, int64_t step,
                                             Phase phase, double margin, double value,
                                             double threshold, uint64_t event)
    -> std::optional<std::size_t> {
  if (incidents_.size() >= options_.incident_capacity()) {
    ++dropped_incidents_;
    return std::nullopt;
  }
  Incident inc;
  inc.kind = kind;
  inc.layer = L.name;
  inc.module = L.module;
  inc.step = inc.last_step = step;
  inc.phase = phase;
  inc.order = L.order;
  inc.confidence = detail::evidence_confidence(margin, 1, options_.persistence_steps());
  inc.margin = margin;
  inc.value = value;
  inc.threshold = threshold;
  inc.events.push_back(event);
  if (!L.act_kind.empty()) inc.details["activation"] = L.act_kind;
  incidents_.push_back(std::move(inc));
  return incidents_.size() - 1;
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::pause_for(std::size_t idx, int64_t step, Pauses& pauses) {
  const Incident& inc = incidents_[idx];
  if (options_.on_failure() != OnFailure::Pause ||
      std::find(options_.pause_on().begin(), options_.pause_on().end(), inc.kind) ==
          options_.pause_on().end())
    return;
  std::string what = to_string(inc.kind);
  if (inc.kind == FailureKind::Custom && inc.details.contains("label") &&
      inc.details["label"].is_string())
    what = inc.details["label"].get<std::string>();
  const std::string reason = "torchdbg health: " + what + " at '" + inc.layer + "' (step " +
                             std::to_string(inc.step) + ")";
  if (!failure_report_) failure_report_ = report_locked();
  SemanticEvent e;
  e.type = EventType::TrainingPaused;
  e.layer = inc.layer;
  e.step = step;
  e.from = "running";
  e.to = "paused";
  e.confidence = inc.confidence;
  e.metadata = {{"reason", reason}, {"kind", to_string(inc.kind)}};
  pauses.emplace_back(inc.layer, reason);
  emit(std::move(e));
}

template <typename Mutex>
bool BasicHealthMonitor<Mutex>::is_expected(FailureKind kind, std::string_view layer) const {
  for (const auto& [re, k] : expected_)
    if (k == kind && re.full_match(layer)) return true;
  return false;
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::record_finding(const Finding& f, const HealthRule& rule,
                                               const Layer& L, int64_t step, Phase phase,
                                               uint64_t event, Pauses& pauses,
                                               std::optional<std::size_t>& slot,
                                               const nlohmann::json* extra) {
  if (is_expected(f.kind, L.name)) return;  // by design: no incident, no pause
  const int64_t onset = f.since ? std::min(*f.since, step) : step;
  slot = add_incident(f.kind, L, onset, phase, f.margin, f.value, f.threshold, event);
  if (!slot) return;
  Incident& inc = incidents_[*slot];
  if (onset != step) {
    inc.last_step = step;
    inc.details["detected_step"] = step;
  }
  for (const auto& [key, v] : f.details.items()) inc.details[key] = v;
  if (!f.reason.empty()) inc.details["reason"] = f.reason;
  inc.details["rule"] = rule.name();
  if (extra) {
    for (const auto& [key, v] : extra->items()) inc.details[key] = v;
  }
  pause_for(*slot, step, pauses);
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::update_incident(std::size_t i, int64_t step, double margin,
                                                int64_t persisted, double value) {
  if (i >= incidents_.size()) return;
  Incident& inc = incidents_[i];
  inc.last_step = step;
  inc.persisted = persisted;
  inc.margin = std::max(inc.margin, margin);
  // `value` stays the onset's, which the descriptions quote with the onset step; the latest
  // evaluation's is `last_value` (at `last_step`).
  inc.details["last_value"] = value;
  inc.confidence = detail::evidence_confidence(inc.margin, persisted, options_.persistence_steps());
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::run_pauses(int64_t step, const Pauses& pauses) {
  if (pauses.empty()) return;
  PauseFn fn;
  std::vector<std::shared_ptr<PauseSlot>> slots;
  {
    std::lock_guard<Mutex> lock(mutex_);
    fn = pause_fn_;
    for (const auto& p : install_pauses_) slots.push_back(p.second);
  }
  for (const auto& [layer, reason] : pauses) {
    try {
      if (fn) fn(step, layer, reason);
    } catch (...) {
    }
    for (const auto& s : slots) {
      try {
        std::lock_guard<std::mutex> lock(s->mutex);  // removal waits for this call
        if (s->live) s->fn(step, layer, reason);
      } catch (...) {
      }
    }
  }
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::health_of(const Layer& L) const -> LayerHealth {
  LayerHealth h;
  h.name = L.name;
  h.module = L.module;
  h.order = L.order;
  h.has_activation = L.seen_fwd;
  h.has_gradient = L.seen_bwd;
  h.activation = L.act;
  h.gradient = L.grad;
  h.activation_since = L.act_since;
  h.gradient_since = L.grad_since;
  h.last_step = L.last_step;
  h.activation_kind = L.act_kind;
  h.rms = L.rms;
  h.gain = L.gain;
  h.saturated_fraction = L.sat_frac;
  h.dead_fraction = L.dead_frac;
  h.non_finite_fraction = L.nonfinite_frac;
  h.gradient_norm = L.g_norm;
  h.gradient_baseline = L.g_base_n > 0 ? std::pow(10.0, L.g_log_base) : detail::kNaN;
  return h;
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::layers_locked() const -> std::vector<LayerHealth> {
  std::vector<LayerHealth> out;
  out.reserve(layers_.size());
  for (const auto& L : layers_) out.push_back(health_of(L));
  std::stable_sort(out.begin(), out.end(),
                   [](const LayerHealth& a, const LayerHealth& b) { return a.order < b.order; });
  return out;
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::report_locked() const -> HealthReport {
  HealthReport r;
  r.step = cur_step_;
  r.layers = layers_locked();
  r.incidents = incidents_;
  // A module's order is the forward position of its first output (activations follow it).
  std::unordered_map<std::string, int64_t> module_order;
  for (const auto& L : layers_) {
    auto it = module_order.find(L.module);
    if (it == module_order.end() || L.order < it->second) module_order[L.module] = L.order;
  }
  for (auto& inc : r.incidents) {
    auto it = module_order.find(inc.module);
    if (it != module_order.end() && inc.module != "loss") inc.order = it->second;
  }
  r.events = events_.to_vector();
  r.events_total = event_seq_;
  r.loss = loss_state_;
  r.last_loss = last_loss_;
  return r;
}

#endif  // TORCHDBG_DEFINITIONS

/// Thread-safe health monitor (the default).
using HealthMonitor = BasicHealthMonitor<std::mutex>;
/// Single-thread health monitor: no locking.
using HealthMonitorSt = BasicHealthMonitor<detail::NullMutex>;

TORCHDBG_EXTERN_TEMPLATE(class BasicHealthMonitor<std::mutex>)
TORCHDBG_EXTERN_TEMPLATE(class BasicHealthMonitor<detail::NullMutex>)
TORCHDBG_EXTERN_TEMPLATE(class HealthInstallation<std::mutex, std::mutex>)
TORCHDBG_EXTERN_TEMPLATE(class HealthInstallation<std::mutex, detail::NullMutex>)
TORCHDBG_EXTERN_TEMPLATE(class HealthInstallation<detail::NullMutex, std::mutex>)
TORCHDBG_EXTERN_TEMPLATE(class HealthInstallation<detail::NullMutex, detail::NullMutex>)
TORCHDBG_EXTERN_TEMPLATE(HealthInstallation<std::mutex, std::mutex>
                             BasicHealthMonitor<std::mutex>::install(BasicHookManager<std::mutex>&))
TORCHDBG_EXTERN_TEMPLATE(
    HealthInstallation<std::mutex, detail::NullMutex> BasicHealthMonitor<std::mutex>::install(
        BasicHookManager<detail::NullMutex>&))
TORCHDBG_EXTERN_TEMPLATE(HealthInstallation<detail::NullMutex, std::mutex> BasicHealthMonitor<
                         detail::NullMutex>::install(BasicHookManager<std::mutex>&))
TORCHDBG_EXTERN_TEMPLATE(
    HealthInstallation<detail::NullMutex, detail::NullMutex>
        BasicHealthMonitor<detail::NullMutex>::install(BasicHookManager<detail::NullMutex>&))

}  // namespace torchdbg
