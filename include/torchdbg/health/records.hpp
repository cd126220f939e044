// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// What the health monitor reports: semantic events, incidents, layer states, reports of a run
// and of a step (health/monitor.hpp).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "torchdbg/detail/print.hpp"
#include "torchdbg/health/options.hpp"
#include "torchdbg/health/rules.hpp"

namespace torchdbg {

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

/// One line, e.g. `Incident(exploding_gradient at "fc2", steps 20-23, value 1.2e+04,
/// threshold 100, confidence 0.95)` (`at "fc2/tanh" (module "fc2")` when they differ; a rank
/// when distributed).
inline std::string to_string(const Incident& i) {
  std::string s = std::string("Incident(") + to_string(i.kind) + " at " + detail::quoted(i.layer);
  if (!i.module.empty() && i.module != i.layer) s += " (module " + detail::quoted(i.module) + ")";
  s += i.last_step > i.step ? fmt::format(", steps {}-{}", i.step, i.last_step) : fmt::format(", step {}", i.step);
  s += fmt::format(", value {}, threshold {}, confidence {}", detail::num(i.value), detail::num(i.threshold),
                   detail::num(i.confidence));
  if (i.rank >= 0) s += fmt::format(", rank {}", i.rank);
  return s + ")";
}

/// One line, e.g. `LayerHealth("fc1/relu", order 1, activation dying since 5 (relu, rms 0.12,
/// gain 1.3, dead 0.42), gradient healthy since 0 (norm 0.003))`; a part not observed is left
/// out, values not measured print "nan".
inline std::string to_string(const LayerHealth& l) {
  std::string s = "LayerHealth(" + detail::quoted(l.name) + fmt::format(", order {}", l.order);
  if (!l.module.empty() && l.module != l.name) s += ", module " + detail::quoted(l.module);
  if (l.has_activation) {
    s += fmt::format(", activation {} since {} (", to_string(l.activation), l.activation_since);
    if (!l.activation_kind.empty()) s += detail::escaped(l.activation_kind) + ", ";
    s += fmt::format("rms {}, gain {}", detail::num(l.rms), detail::num(l.gain));
    if (std::isfinite(l.saturated_fraction)) s += ", saturated " + detail::num(l.saturated_fraction);
    if (std::isfinite(l.dead_fraction)) s += ", dead " + detail::num(l.dead_fraction);
    if (l.non_finite_fraction > 0) s += ", non-finite " + detail::num(l.non_finite_fraction);
    s += ")";
  }
  if (l.has_gradient) {
    s += fmt::format(", gradient {} since {} (norm {})", to_string(l.gradient), l.gradient_since,
                     detail::num(l.gradient_norm));
  }
  return s + ")";
}

namespace detail {
template <>
struct Printable<Incident> : std::true_type {};
template <>
struct Printable<LayerHealth> : std::true_type {};
}  // namespace detail

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
  /// Forward outputs are judged on every this-many evaluated steps
  /// (HealthOptions::activation_interval, or what activation_budget chose; 0 while it measures).
  int64_t activation_interval = 1;
  /// With HealthOptions::activation_budget, once measured: what judging forward outputs added
  /// to a step, relative to a step without them (0.4: 40%).
  std::optional<double> activation_cost;
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

}  // namespace torchdbg
