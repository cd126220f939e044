// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// A ranked root-cause diagnosis from a HealthReport.
//
// Every incident (the onset of a failure at a layer) is linked to the incident that explains
// it, by temporal precedence (step, then forward -> loss -> backward within a step, then
// forward order) and by what can cause what:
//   NaN/Inf in the model's input (bad data) -> non-finite values -> loss divergence
//   exploding activation/gradient  -> non-finite values -> loss divergence
//   dead units / saturation / constant output at or downstream of a layer -> vanishing
//     gradient at that layer
//   a large update (exploding gradient, loss spike) -> dead units, saturation later
//   a layer that begins to saturate, die or stall in a step's forward -> exploding
//     gradients of that step
//   an exploding activation -> dead units, saturation, constant output and exploding
//     activations downstream of it in the same forward pass
//   a constant layer, or one nearly all dead or saturated (still in that state) -> an
//     exploding activation downstream: the gain over a collapsed input
// A cause must still be going on, or have ended at most two steps before what it explains.
//   dead units or a constant output upstream -> dead units, constant output downstream
//   an exploding activation feeding a saturating activation is that layer's saturation.
// Incidents that nothing explains are root causes; each becomes a hypothesis whose causal
// chain lists what it explains, a finding that persisted or came back once with its span.
// Hypotheses are ranked by severity (the worst tier in the chain), then acute failures
// (explosions, NaN) before persisting states (saturation, dead units), then onset (step,
// phase, then forward order; backward order for gradients), then confidence. One sort and one sweep
// with ordered lookups: O(E log E) for E incidents.
// With forward outputs judged every few steps (HealthOptions::activation_interval), a layer's
// finding after unjudged steps is first placed in the forward of the earliest of them where a
// gradient or the loss broke, unless what broke there could have caused it through an update
// (detail::place_unobserved_onsets).
//
// ```cpp
// auto d = torchdbg::diagnose(health);
// if (!d.healthy()) std::cout << d.summary() << "\n" << d.to_mermaid();
// ```

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/detail/print.hpp"
#include "torchdbg/health.hpp"

namespace torchdbg {

/// One link of a causal chain: an incident that a hypothesis explains (or the root itself).
struct CausalLink {
  FailureKind kind = FailureKind::NonFiniteOutput;
  std::string layer;
  int64_t step = 0;
  Phase phase = Phase::Forward;
  int rank = -1;
  /// In a hypothesis's chain, a finding that came back (or persisted) is listed once: the
  /// last step it was seen and how many incidents it stands for.
  int64_t last_step = 0;
  int64_t occurrences = 1;
};

/// Failures that break training at once (values explode or turn non-finite), as opposed to
/// states a layer can sit in for long (dead, saturated, constant, vanishing, plateau).
inline bool is_acute(FailureKind k) noexcept {
  switch (k) {
    case FailureKind::BadInput:
    case FailureKind::NonFiniteOutput:
    case FailureKind::NonFiniteGradient:
    case FailureKind::ExplodingActivation:
    case FailureKind::ExplodingGradient:
    case FailureKind::LossDivergence:
    case FailureKind::LossSpike:
      return true;
    default:
      return false;
  }
}

/// A ranked explanation of what went wrong.
struct Hypothesis {
  FailureKind kind = FailureKind::NonFiniteOutput;
  std::string layer;     ///< the responsible module ("fc2"); "loss" for a loss-only finding
  std::string observed;  ///< the observation that showed it ("fc2/tanh")
  int64_t step = 0;      ///< onset
  std::string description;
  double confidence = 0.0;
  std::vector<SemanticEvent> evidence;   ///< events behind the root and what it explains
  std::vector<CausalLink> causal_chain;  ///< the root first, then its consequences in time order
  int rank = -1;                         ///< the process where it started (distributed runs)

  /// Severity: the worst failure_tier of the root and what it explains (a constant output
  /// that stops the gradient upstream of it breaks training like the vanishing it causes).
  [[nodiscard]] int tier() const noexcept {
    int t = failure_tier(kind);
    for (const auto& c : causal_chain) t = std::max(t, failure_tier(c.kind));
    return t;
  }
  /// Whether the root or what it explains is acute (is_acute); a loss spike that a state (a
  /// saturation, dead units) explains does not make it so: a GAN's or an RL run's loss swings
  /// while its discriminator or policy saturates, and training goes on.
  [[nodiscard]] bool acute() const noexcept {
    if (is_acute(kind)) return true;
    for (const auto& c : causal_chain)
      if (is_acute(c.kind) && c.kind != FailureKind::LossSpike) return true;
    return false;
  }
};

inline nlohmann::json to_json(const CausalLink& c) {
  nlohmann::json j = {{"kind", to_string(c.kind)},
                      {"layer", c.layer},
                      {"step", c.step},
                      {"last_step", std::max(c.step, c.last_step)},
                      {"occurrences", c.occurrences},
                      {"phase", to_string(c.phase)}};
  if (c.rank >= 0) j["rank"] = c.rank;
  return j;
}

inline nlohmann::json to_json(const Hypothesis& h) {
  nlohmann::json ev = nlohmann::json::array();
  for (const auto& e : h.evidence) ev.push_back(to_json(e));
  nlohmann::json chain = nlohmann::json::array();
  for (const auto& c : h.causal_chain) chain.push_back(to_json(c));
  nlohmann::json j = {{"kind", to_string(h.kind)},
                      {"layer", h.layer},
                      {"observed", h.observed},
                      {"step", h.step},
                      {"description", h.description},
                      {"confidence", h.confidence},
                      {"evidence", ev},
                      {"causal_chain", chain}};
  if (h.rank >= 0) j["rank"] = h.rank;
  return j;
}

/// The ranked hypotheses and the causal graph behind them.
struct Diagnosis {
  int64_t step = 0;                    ///< the report's step
  std::vector<Hypothesis> hypotheses;  ///< best first
  /// The causal graph: every incident as a node, (cause, effect) edges between node indices.
  std::vector<CausalLink> nodes;
  std::vector<std::pair<std::size_t, std::size_t>> edges;
  std::vector<std::size_t> roots;  ///< node index of each hypothesis, in hypothesis order
  std::size_t layers_observed = 0;

  /// No hypothesis of tier 1 or 2 (a plateau alone is not a failure).
  [[nodiscard]] bool healthy() const noexcept;
  [[nodiscard]] const Hypothesis* top() const noexcept;

  /// A plain-English paragraph for terminals and reports.
  [[nodiscard]] std::string summary() const;

  /// The causal graph as a Mermaid flowchart.
  [[nodiscard]] std::string to_mermaid() const;

  /// The causal graph in Graphviz DOT.
  [[nodiscard]] std::string to_dot() const;

  [[nodiscard]] nlohmann::json to_json() const;

  static std::string node_label(const CausalLink& c);

 private:
  static std::string pct(double v);
  static std::string describe_link(const CausalLink& c);
};

/// One line, e.g. `Hypothesis(exploding_gradient at "fc2", step 20, confidence 0.95, explains
/// 3 findings)`; the observation when it is not the layer itself, a rank when distributed.
inline std::string to_string(const Hypothesis& h) {
  std::string s = std::string("Hypothesis(") + to_string(h.kind) + " at " + detail::quoted(h.layer);
  if (!h.observed.empty() && h.observed != h.layer) s += " (observed " + detail::quoted(h.observed) + ")";
  s += fmt::format(", step {}, confidence {}", h.step, detail::num(h.confidence));
  const std::size_t explained = h.causal_chain.empty() ? 0 : h.causal_chain.size() - 1;
  if (explained > 0) s += ", explains " + detail::count(explained, "finding");
  if (h.rank >= 0) s += fmt::format(", rank {}", h.rank);
  return s + ")";
}

/// One line: the step, the layers observed and the verdict, then up to three hypotheses best
/// first, e.g. `Diagnosis(step 25, 9 layers, 2 hypotheses: exploding_gradient at "fc2" from
/// step 20 (confidence 0.95); loss_spike at "loss" from step 21 (confidence 0.6))`, or
/// `Diagnosis(step 25, 9 layers, healthy)`. `summary()` is the paragraph for people.
inline std::string to_string(const Diagnosis& d) {
  std::string s = fmt::format("Diagnosis(step {}, ", d.step) + detail::count(d.layers_observed, "layer") + ", ";
  if (d.healthy()) {
    s += "healthy";
    if (!d.hypotheses.empty()) s += ", " + detail::count(d.hypotheses.size(), "note");
    return s + ")";
  }
  s += fmt::format("{} hypothes{}: ", d.hypotheses.size(), d.hypotheses.size() > 1 ? "es" : "is");
  const std::size_t shown = std::min<std::size_t>(d.hypotheses.size(), 3);
  for (std::size_t i = 0; i < shown; ++i) {
    const auto& h = d.hypotheses[i];
    s += fmt::format("{}{} at {} from step {} (confidence {})", i ? "; " : "", to_string(h.kind),
                     detail::quoted(h.layer), h.step, detail::num(h.confidence));
  }
  if (d.hypotheses.size() > shown) s += fmt::format("; and {} more", d.hypotheses.size() - shown);
  return s + ")";
}

namespace detail {
template <>
struct Printable<Hypothesis> : std::true_type {};
template <>
struct Printable<Diagnosis> : std::true_type {};
}  // namespace detail

#if TORCHDBG_DEFINITIONS

TORCHDBG_INLINE bool Diagnosis::healthy() const noexcept {
  for (const auto& h : hypotheses)
    if (h.tier() > 0) return false;
  return true;
}

TORCHDBG_INLINE auto Diagnosis::top() const noexcept -> const Hypothesis* {
  return hypotheses.empty() ? nullptr : &hypotheses.front();
}

TORCHDBG_INLINE std::string Diagnosis::summary() const {
  if (healthy()) {
    std::string s = "No failure detected up to step " + std::to_string(step) + " across " +
                    std::to_string(layers_observed) + " observed layers.";
    for (const auto& h : hypotheses) s += " Note: " + h.description;
    return s;
  }
  const auto& first = hypotheses.front();
  std::string s = "Most likely cause" +
                  (first.rank >= 0 ? " (rank " + std::to_string(first.rank) + ")" : std::string()) +
                  ": " + first.description;
  const auto& chain = hypotheses.front().causal_chain;
  if (chain.size() > 1) {
    s += " It explains " + std::to_string(chain.size() - 1) + " later finding" +
         (chain.size() > 2 ? "s" : "") + ": ";
    const std::size_t shown = std::min<std::size_t>(chain.size(), 6);
    for (std::size_t i = 1; i < shown; ++i) {
      s += (i > 1 ? ", " : "") + describe_link(chain[i]);
    }
    if (chain.size() > shown) s += " and " + std::to_string(chain.size() - shown) + " more";
    s += ".";
  }
  if (hypotheses.size() > 1) {
    s += " Other hypotheses:";
    const std::size_t shown = std::min<std::size_t>(hypotheses.size(), 4);
    for (std::size_t i = 1; i < shown; ++i) {
      const auto& h = hypotheses[i];
      s += " (" + std::to_string(i + 1) + ") " + std::string(to_string(h.kind)) + " at '" +
           h.layer + "' from step " + std::to_string(h.step) + ", confidence " + pct(h.confidence) +
           ";";
    }
    s.back() = '.';
  }
  return s;
}

TORCHDBG_INLINE std::string Diagnosis::to_mermaid() const {
  std::string s = "graph LR\n";
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    std::string label = node_label(nodes[i]);
    for (char& c : label)
      if (c == '"') c = '\'';
    s += "  n" + std::to_string(i) + "[\"" + label + "\"]\n";
  }
  for (const auto& [a, b] : edges)
    s += "  n" + std::to_string(a) + " --> n" + std::to_string(b) + "\n";
  for (std::size_t r = 0; r < roots.size(); ++r)
    s += "  style n" + std::to_string(roots[r]) +
         (r == 0 ? " stroke-width:3px,stroke:#c00\n" : " stroke-width:2px\n");
  return s;
}

TORCHDBG_INLINE std::string Diagnosis::to_dot() const {
  std::string s = "digraph torchdbg_diagnosis {\n  rankdir=LR;\n  node [shape=box];\n";
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    std::string label;
    for (char c : node_label(nodes[i])) {
      if (c == '"' || c == '\\') label += '\\';
      label += c;
    }
    const bool root = std::find(roots.begin(), roots.end(), i) != roots.end();
    s += "  n" + std::to_string(i) + " [label=\"" + label + "\"" +
         (root ? ", penwidth=2, color=red" : "") + "];\n";
  }
  for (const auto& [a, b] : edges)
    s += "  n" + std::to_string(a) + " -> n" + std::to_string(b) + ";\n";
  return s + "}\n";
}

TORCHDBG_INLINE auto Diagnosis::to_json() const -> nlohmann::json {
  nlohmann::json hs = nlohmann::json::array();
  for (const auto& h : hypotheses) hs.push_back(torchdbg::to_json(h));
  nlohmann::json ns = nlohmann::json::array();
  for (const auto& n : nodes) ns.push_back(torchdbg::to_json(n));
  nlohmann::json es = nlohmann::json::array();
  for (const auto& [a, b] : edges) es.push_back({a, b});
  return {{"step", step}, {"healthy", healthy()}, {"summary", summary()}, {"hypotheses", hs},
          {"nodes", ns},  {"edges", es},          {"roots", roots}};
}

TORCHDBG_INLINE std::string Diagnosis::node_label(const CausalLink& c) {
  std::string s =
      std::string(to_string(c.kind)) + " @ " + c.layer + " (step " + std::to_string(c.step) + ")";
  if (c.rank >= 0) s += " rank " + std::to_string(c.rank);
  return s;
}

TORCHDBG_INLINE std::string Diagnosis::pct(double v) {
  char b[16];
  std::snprintf(b, sizeof b, "%.0f%%", v * 100.0);
  return b;
}

TORCHDBG_INLINE std::string Diagnosis::describe_link(const CausalLink& c) {
  std::string k = to_string(c.kind);
  std::replace(k.begin(), k.end(), '_', ' ');
  std::string when = c.last_step > c.step
                         ? "steps " + std::to_string(c.step) + " to " + std::to_string(c.last_step)
                         : "step " + std::to_string(c.step);
  if (c.occurrences > 1) when += ", " + std::to_string(c.occurrences) + " times";
  return k + " at '" + c.layer + "' (" + when + ")";
}

namespace detail {

TORCHDBG_INLINE std::string num3(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g", v);
  return b;
}

TORCHDBG_INLINE std::string describe_root(const Incident& i, std::size_t related) {
  const std::string at = "'" + i.module + "'";
  const std::string step = std::to_string(i.step);
  auto pct = [](double v) { return num3(v * 100.0) + "%"; };
  switch (i.kind) {
    case FailureKind::BadInput: {
      const auto count = [&](const char* k) {
        return i.details.contains(k) ? i.details[k].get<int64_t>() : int64_t{0};
      };
      if (i.details.contains("ratio")) {  // a scale shift (HealthOptions::input_scale_jump)
        const double r = i.details["ratio"].get<double>();
        std::string s = "the model's input at step " + step + " has an RMS of " +
                        num3(i.details.value("rms", 0.0)) + ", " +
                        (r >= 1.0 ? num3(r) + "x above" : num3(1.0 / r) + "x below") +
                        " its usual " + num3(i.details.value("baseline_rms", 0.0));
        if (i.last_step > i.step) s += " (until step " + std::to_string(i.last_step) + ")";
        if (i.details.contains("first_layer"))
          s += i.details.value("mixed", false)
                   ? ", in the raw data that '" + i.details["first_layer"].get<std::string>() +
                         "', the first layer, read mixed with values the model made"
                   : ", as '" + i.details["first_layer"].get<std::string>() + "', the first layer, saw it";
        return s + ": the data (unnormalized or rescaled), not a layer, is the origin.";
      }
      const int64_t nan = count("nan"), inf = count("inf");
      std::string held;
      if (nan > 0) held = std::to_string(nan) + " NaN value" + (nan == 1 ? "" : "s");
      if (inf > 0)
        held += (held.empty() ? "" : " and ") + std::to_string(inf) + " infinite value" +
                (inf == 1 ? "" : "s");
      std::string s = "the model's input at step " + step + " held " + held;
      if (i.details.contains("first_layer"))
        s += " before '" + i.details["first_layer"].get<std::string>() +
             "', the first layer, saw it";
      return s + ": the data, not a layer, is the origin.";
    }
    case FailureKind::NonFiniteOutput: {
      std::string s = at + " produced the first non-finite output at step " + step + " (" +
                      pct(i.value) + " NaN/Inf) while every earlier value of the step was finite";
      if (i.layer != i.module)
        s += ": '" + i.layer.substr(i.module.size() + 1) + "' applied to its output";
      return s + ".";
    }
    case FailureKind::NonFiniteGradient:
      return "the first non-finite gradient in backward order appeared at " + at + " at step " +
             step + " while the forward pass was finite.";
    case FailureKind::ExplodingActivation:
      if (i.details.value("measure", std::string()) == "std_jump")
        return "the output of " + at + " jumped to " + num3(i.value) + "x its usual std at step " + step +
               " (" + num3(i.details.value("std", 0.0)) + " against " + num3(i.details.value("usual_std", 0.0)) +
               ", limit " + num3(i.threshold) + "x): its weights blew up (its input, token ids, has no scale "
               "to compare with).";
      if (i.details.value("from_first_step", false))
        return at + " amplifies its input " + num3(i.value) + "x (limit " + num3(i.threshold) +
               "x) from its first step, " + step +
               ": its weights are too large from the start (their initialization, or the values they were "
               "loaded with; an embedding used as the output head keeps the embedding's scale).";
      return at + " amplifies its input " + num3(i.value) + "x at step " + step + " (limit " +
             num3(i.threshold) + "x): its weights make activations, and then gradients, explode.";
    case FailureKind::ExplodingGradient: {
      std::string s = "the gradient norm of " + at + " reached " + num3(i.value) + " at step " +
                      step + " (limit " + num3(i.threshold) + ")";
      if (i.details.contains("amplification"))
        s += "; the layer upstream has " + num3(i.details["amplification"].get<double>()) +
             "x its norm";
      return s + ".";
    }
    case FailureKind::VanishingGradient:
      if (related > 1)
        return "gradients vanish toward the input: " + std::to_string(related) +
               " layers fall below the limit at step " + step + ", the smallest at " + at +
               " (norm " + num3(i.value) +
               "), with no dead or saturated layer downstream to blame: depth and small activation "
               "derivatives shrink "
               "the backward signal layer by layer.";
      return "the gradient of " + at + " vanished at step " + step + " (norm " + num3(i.value) +
             ", limit " + num3(i.threshold) + ").";
    case FailureKind::DeadUnits:
      return pct(i.value) + " of the units after " + at +
             (i.details.contains("activation")
                  ? " (" + i.details["activation"].get<std::string>() + ")"
                  : std::string()) +
             " are dead from step " + step +
             ": its pre-activation is negative for almost every sample (a large negative bias "
             "or a destructive update), so no gradient flows through them.";
    case FailureKind::Saturation:
      return pct(i.value) + " of '" + i.layer + "' is saturated from step " + step + ": " + at +
             " feeds it values so large that the activation's derivative vanishes (weights too "
             "large for " +
             (i.details.contains("activation") ? i.details["activation"].get<std::string>()
                                               : std::string("the activation")) +
             ").";
    case FailureKind::ConstantOutput:
      if (i.details.contains("zero_steps") && i.details["zero_steps"].is_number_integer())
        return "'" + i.layer + "' has output exactly 0 since its first call (" +
               std::to_string(i.details["zero_steps"].get<int64_t>()) + " steps from step " + step +
               "): a zero-initialized module whose weights do not move (frozen, or no gradient "
               "reaches them), so nothing flows through it.";
      if (i.details.contains("input_zero"))
        return "'" + i.layer + "' outputs exactly 0 from step " + step +
               ": its input is exactly 0, so nothing reaches it (and no gradient reaches its "
               "weights).";
      return "'" + i.layer + "' outputs a (nearly) constant value from step " + step + ".";
    case FailureKind::NormStatistics:
      return "the running statistics of " + at + " are " + num3(i.value) +
             " standard deviations (RMS over channels) away from its batches' at step " + step +
             (i.last_step > i.step ? " (until step " + std::to_string(i.last_step) + ")"
                                   : std::string()) +
             ": in eval mode it normalizes with other statistics than in training (a momentum of "
             "0, "
             "frozen or stale buffers, buffers loaded from another model), so evaluation computes "
             "something the model was not trained on.";
    case FailureKind::NormWeightCollapse:
      return "the weight of " + at + " fell to " + pct(i.value) + " of its peak (RMS " +
             num3(i.details.value("weight_rms", 0.0)) + " against " +
             num3(i.details.value("peak_weight_rms", 0.0)) + ") at step " + step +
             ": the normalization passes almost nothing of its input on, and the gradients before "
             "it "
             "fade (weight decay on normalization weights, or a destructive update).";
    case FailureKind::LossDivergence:
      if (i.details.contains("growth"))
        return "the loss grew " + num3(i.details.value("growth", 0.0)) + "x over its last " +
               std::to_string(i.details.value("losses_since_lowest", int64_t{0})) +
               " losses to " + num3(i.value) + " at step " + step + " (from " +
               num3(i.details.value("lowest", 0.0)) + "), rising on " +
               std::to_string(i.details.value("rising", int64_t{0})) + " of its last " +
               std::to_string(i.details.value("rising_of", int64_t{0})) +
               " steps: training diverges steadily (a learning rate just past the stable limit "
               "is the usual cause).";
      if (i.details.value("forward_unjudged", false))
        return "the loss became non-finite at step " + step +
               ", a step whose forward outputs were not judged (activation_interval): its batch, "
               "a layer's output or the loss inputs may have caused it.";
      return "the loss became non-finite at step " + step +
             " before any layer showed a problem (check the loss inputs and labels).";
    case FailureKind::LossSpike:
      return "the loss spiked to " + num3(i.value) + " at step " + step + " (limit " +
             num3(i.threshold) + ").";
    case FailureKind::LossPlateau:
      return "the loss has plateaued by step " + step + " (relative improvement " + num3(i.value) +
             ").";
    case FailureKind::Custom: {
      const auto text = [&](const char* k) {
        return i.details.contains(k) && i.details[k].is_string() ? i.details[k].get<std::string>()
                                                                 : std::string();
      };
      const std::string label = text("label"), rule = text("rule"), reason = text("reason");
      std::string s = (label.empty() ? std::string("a user rule's finding") : label) + " at '" +
                      i.layer + "' from step " + step;
      if (!reason.empty()) s += ": " + reason;
      s += " (value " + num3(i.value) + ", limit " + num3(i.threshold);
      if (!rule.empty()) s += ", rule '" + rule + "'";
      return s + ").";
    }
  }
  return {};
}

}  // namespace detail

#endif  // TORCHDBG_DEFINITIONS

/// The ranked diagnosis of a report (see the header comment for the rules).
TORCHDBG_INLINE Diagnosis diagnose(const HealthReport& report);

#if TORCHDBG_DEFINITIONS
namespace detail {
/// Forward outputs judged every few steps (HealthOptions::activation_interval): a finding in
/// them whose onset follows unjudged steps (`details["unobserved_from"]`) may have begun on any
/// of those. When a gradient or the loss broke on one of them (a plateau, a long-window
/// statistic, and a user rule's finding aside) and nothing there could have caused the finding
/// through an update (an exploding or non-finite gradient, a loss spike or divergence), the
/// finding is placed in the forward of the first such step, where it comes before what it
/// explains; `details["observed_step"]` keeps the step it was seen. Non-finite outputs stay
/// where seen (after a non-finite update every layer is non-finite), and so does the input (a
/// batch is that batch). Empty when nothing moves.
TORCHDBG_INLINE std::vector<Incident> place_unobserved_onsets(const std::vector<Incident>& inc) {
  using K = FailureKind;
  std::vector<Incident> out;
  // Gradient and loss incidents by step, with how many of them could act through an update.
  std::vector<std::pair<int64_t, bool>> broke;
  for (const Incident& y : inc)
    if (y.phase != Phase::Forward && y.kind != K::LossPlateau && y.kind != K::Custom)
      broke.emplace_back(y.step, y.kind == K::ExplodingGradient || y.kind == K::NonFiniteGradient ||
                                     y.kind == K::LossSpike || y.kind == K::LossDivergence);
  std::sort(broke.begin(), broke.end());
  std::vector<std::size_t> updates(broke.size() + 1, 0);  // prefix counts
  for (std::size_t k = 0; k < broke.size(); ++k) updates[k + 1] = updates[k] + (broke[k].second ? 1 : 0);
  const auto at_step = [&](int64_t step) {
    return static_cast<std::size_t>(
        std::lower_bound(broke.begin(), broke.end(), std::make_pair(step, false)) - broke.begin());
  };
  for (std::size_t i = 0; i < inc.size(); ++i) {
    const Incident& x = inc[i];
    const auto u = x.details.find("unobserved_from");
    if (u == x.details.end() || !u->is_number_integer() || x.phase != Phase::Forward ||
        x.kind == K::NonFiniteOutput || x.kind == K::Custom || x.kind == K::BadInput)
      continue;
    const std::size_t lo = at_step(u->get<int64_t>()), hi = at_step(x.step);
    if (lo >= hi) continue;  // nothing broke in between
    if (updates[hi] > updates[lo]) continue;  // an update in between could have caused it
    const int64_t first_step = broke[lo].first;
    if (out.empty()) out = inc;
    out[i].details["observed_step"] = x.step;
    out[i].step = first_step;
  }
  return out;
}
}  // namespace detail

TORCHDBG_INLINE Diagnosis diagnose(const HealthReport& report) {
  using K = FailureKind;
  Diagnosis d;
  d.step = report.step;
  d.layers_observed = report.layers.size();
  const std::vector<Incident> placed = detail::place_unobserved_onsets(report.incidents);
  const std::vector<Incident>& inc = placed.empty() ? report.incidents : placed;
  auto link_of = [](const Incident& i) {
    return CausalLink{i.kind, i.layer, i.step, i.phase, i.rank, std::max(i.step, i.last_step), 1};
  };
  const std::size_t n = inc.size();
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    if (inc[a].step != inc[b].step) return inc[a].step < inc[b].step;
    if (inc[a].phase != inc[b].phase) return inc[a].phase < inc[b].phase;
    return inc[a].order < inc[b].order;
  });
  std::vector<std::optional<std::size_t>> cause(n);

  // An exploding activation whose own activation saturates (same module, same or next step)
  // is that saturation's evidence.
  {
    std::map<std::pair<std::string, int64_t>, std::size_t> saturation;
    for (std::size_t i = 0; i < n; ++i)
      if (inc[i].kind == K::Saturation)
        saturation.emplace(std::make_pair(inc[i].module, inc[i].step), i);
    for (std::size_t i = 0; i < n; ++i) {
      if (inc[i].kind != K::ExplodingActivation) continue;
      for (int64_t ds : {0, 1}) {
        auto it = saturation.find({inc[i].module, inc[i].step + ds});
        if (it != saturation.end()) {
          cause[i] = it->second;
          break;
        }
      }
    }
  }

  // The sweep: what has been seen so far, by kind and by forward order.
  std::optional<std::size_t> first_any, first_layer_failure, last_acute_layer_failure;
  std::map<int64_t, std::size_t> layer_failure_in_step;  // the first layer failure of each step
  std::map<K, std::size_t> first_of;
  std::map<int64_t, std::size_t>
      blockers;  // dead/saturated/constant/collapsed incidents by forward order (first per order)
  std::map<int64_t, std::size_t> vanishing_group;  // step -> root vanishing incident of that step
  std::map<int64_t, std::size_t> exploding_group;  // step -> root exploding-gradient incident
  // A cause must still be going on, or have ended at most kRecent steps before the incident
  // it explains (an explosion at step 0 that stopped there explains no NaN at step 30).
  constexpr int64_t kRecent = 2;
  int64_t now = 0;  // the step of the incident the sweep is at
  std::map<K, std::size_t> last_of;
  auto earliest = [&](std::initializer_list<K> kinds, bool strictly_before,
                      int64_t step) -> std::optional<std::size_t> {
    std::optional<std::size_t> best;
    for (K k : kinds) {
      for (const auto* seen_of : {&first_of, &last_of}) {
        auto it = seen_of->find(k);
        if (it == seen_of->end()) continue;
        const Incident& c = inc[it->second];
        if (strictly_before && c.step >= step) continue;
        if (std::max(c.step, c.last_step) < now - kRecent) continue;
        if (!best || c.step < inc[*best].step) best = it->second;
      }
    }
    return best;
  };
  // Exploding-gradient origin per step: the largest amplification (where the backward signal
  // jumps; over its usual value when both layers have gradient baselines), else the most
  // downstream exploding layer.
  std::map<int64_t, std::size_t> explode_origin;
  for (std::size_t i = 0; i < n; ++i) {
    if (inc[i].kind != K::ExplodingGradient) continue;
    auto it = explode_origin.find(inc[i].step);
    if (it == explode_origin.end()) {
      explode_origin[inc[i].step] = i;
    } else {
      const std::size_t j = it->second;
      const char* key = inc[i].details.contains("amplification_vs_usual") &&
                                inc[j].details.contains("amplification_vs_usual")
                            ? "amplification_vs_usual"
                            : "amplification";
      auto amp = [&](std::size_t k) {
        return inc[k].details.contains(key) ? inc[k].details[key].get<double>() : 0.0;
      };
      const double ai = amp(i), aj = amp(j);
      const double jump = 10.0;
      if ((ai >= jump || aj >= jump) ? ai > aj : inc[i].order > inc[j].order) it->second = i;
    }
  }

  // The most upstream exploding activation of each step so far (the sweep runs in forward
  // order within a step): it explains dead, saturated or constant layers downstream of it in
  // the same forward pass.
  std::map<int64_t, std::size_t> explode_act_in_step;
  // The first dead, saturated or constant layer that began in each step's forward.
  std::map<int64_t, std::size_t> fresh_forward;
  // A normalization's collapsing weight at the same module, begun by the step: what its
  // output's other findings come from.
  std::map<std::string, std::size_t> collapsed_norm;
  // The first layer that began to pass nothing on (a collapsed weight, a constant output) in
  // each step's forward.
  std::map<int64_t, std::size_t> collapsed_in_step;
  // The first zero-initialized module found stuck at 0 (its constant output's `zero_steps`).
  std::optional<std::size_t> stuck_zero;
  auto collapse_at = [&](const Incident& x) -> std::optional<std::size_t> {
    auto it = collapsed_norm.find(x.module);
    if (it == collapsed_norm.end() || inc[it->second].step > x.step) return std::nullopt;
    return it->second;
  };
  auto upstream_explosion = [&](const Incident& x) -> std::optional<std::size_t> {
    auto it = explode_act_in_step.find(x.step);
    if (it == explode_act_in_step.end() || x.phase != Phase::Forward ||
        inc[it->second].order >= x.order ||
        inc[it->second].module ==
            x.module)  // a module's own explosion and saturation: the pre-pass
      return std::nullopt;
    return it->second;
  };

  for (std::size_t pos = 0; pos < n; ++pos) {
    const std::size_t i = order[pos];
    const Incident& x = inc[i];
    now = x.step;
    if (!cause[i]) {
      std::optional<std::size_t> c;
      switch (x.kind) {
        case K::BadInput:  // the data: nothing in the model explains it
        case K::Custom:    // a user rule: what causes it is not known here
          break;
        case K::NonFiniteOutput:
          c = earliest({K::BadInput, K::ExplodingActivation, K::ExplodingGradient, K::LossSpike,
                        K::NonFiniteGradient, K::NonFiniteOutput},
                       true, x.step);
          break;
        case K::NonFiniteGradient:
          c = earliest({K::BadInput, K::NonFiniteOutput, K::LossDivergence}, false, x.step + 1);
          if (!c)
            c = earliest({K::ExplodingActivation, K::ExplodingGradient, K::NonFiniteGradient}, true,
                         x.step);
          if (!c) c = earliest({K::ExplodingActivation, K::ExplodingGradient}, false, x.step + 1);
          break;
        case K::ExplodingGradient: {
          c = earliest({K::ExplodingActivation, K::LossSpike}, false, x.step + 1);
          // A layer that began to saturate (or die, or stall) in this step's forward: one
          // destructive update shows there first (a discriminator whose output saturates
          // sends the generator exploding gradients).
          if (!c) {
            auto it = fresh_forward.find(x.step);
            if (it != fresh_forward.end()) c = it->second;
          }
          if (!c) {
            auto it = explode_origin.find(x.step);
            if (it != explode_origin.end() && it->second != i) c = it->second;
          }
          // A normalization whose weight collapsed: its own weight's gradient (d loss / d w
          // no longer shrinks with w) and what flows through it.
          if (!c) c = collapse_at(x);
          break;
        }
        case K::VanishingGradient: {
          // Behind a gate (a zero-initialized module) stuck at 0, wherever it is in the forward.
          if (x.details.contains("gated") && stuck_zero && inc[*stuck_zero].step <= x.step)
            c = stuck_zero;
          auto b = blockers.lower_bound(x.order);
          if (!c && b != blockers.end()) c = b->second;
          if (!c) {
            auto g = vanishing_group.find(x.step);
            if (g != vanishing_group.end()) c = g->second;
          }
          break;
        }
        case K::DeadUnits:
        case K::Saturation:
          c = earliest({K::ExplodingActivation, K::ExplodingGradient, K::LossSpike}, true, x.step);
          if (!c) c = upstream_explosion(x);
          if (!c && x.kind == K::DeadUnits && !blockers.empty() &&
              blockers.begin()->first < x.order &&
              (inc[blockers.begin()->second].kind == K::DeadUnits ||
               inc[blockers.begin()->second].kind == K::ConstantOutput ||
               inc[blockers.begin()->second].kind == K::NormWeightCollapse))
            c = blockers.begin()->second;
          // Its own module's output the same for every sample (a weight zeroed, its bias
          // left): the units the bias keeps below 0 (or in a tail) follow from it.
          if (!c) {
            const auto own = blockers.find(x.order);
            if (own != blockers.end() && inc[own->second].kind == K::ConstantOutput &&
                inc[own->second].module == x.module && inc[own->second].step <= x.step)
              c = own->second;
          }
          break;
        case K::ConstantOutput:
          if (!blockers.empty() && blockers.begin()->first < x.order) c = blockers.begin()->second;
          if (!c) c = collapse_at(x);  // the weight that shrank to 0 makes it constant
          if (!c) c = upstream_explosion(x);
          break;
        case K::NormStatistics:
          // The batch's statistics jumped (an explosion upstream, a destructive update): the
          // running ones lag behind by design.
          c = earliest({K::ExplodingActivation, K::ExplodingGradient, K::LossSpike}, true, x.step);
          if (!c) c = upstream_explosion(x);
          if (!c) c = collapse_at(x);
          break;
        case K::NormWeightCollapse:
          break;  // what the optimizer does to the weight: a root
        case K::ExplodingActivation:
          c = earliest({K::ExplodingGradient, K::LossSpike}, true, x.step);
          // Layers downstream of an explosion in the same forward pass amplify what it
          // made (every layer after one destructive update): one root.
          if (!c) c = upstream_explosion(x);
          // A dead, saturated or constant layer upstream, still in that state: the input it
          // leaves is collapsed, and a gain over it means nothing.
          for (auto b = blockers.lower_bound(x.order); !c && b != blockers.begin();) {
            --b;
            const Incident& y = inc[b->second];
            const bool collapsed = y.kind == K::ConstantOutput || y.kind == K::NormWeightCollapse ||
                                   y.value >= 0.9;  // nearly all saturated or dead
            if (y.phase == Phase::Forward && y.last_step >= x.step && collapsed) c = b->second;
          }
          break;
        case K::LossDivergence:
        case K::LossSpike:
        case K::LossPlateau:
          // A sudden loss failure: the latest acute layer failure up to it, else a layer
          // failure that began in its step (what broke the loss now); a plateau, or nothing
          // of the kind: the first layer failure (a state the model has been in).
          if (x.kind != K::LossPlateau && last_acute_layer_failure)
            c = last_acute_layer_failure;
          else if (x.kind != K::LossPlateau && collapsed_in_step.count(x.step))
            c = collapsed_in_step[x.step];  // a layer that stopped passing its input on
          else if (x.kind != K::LossPlateau && layer_failure_in_step.count(x.step))
            c = layer_failure_in_step[x.step];
          else if (first_layer_failure && inc[*first_layer_failure].step <= x.step)
            c = first_layer_failure;
          break;
      }
      // Bad data (NaN/Inf, or a scale far from its own history) going on explains what the
      // model does with it in that step and after: no layer is the origin.
      if (x.kind != K::BadInput && x.kind != K::Custom && x.kind != K::LossPlateau) {
        if (const auto bad_data = earliest({K::BadInput}, false, x.step + 1)) c = bad_data;
      }
      // Never a cycle (an explosion the pre-pass gave to its own saturation).
      for (std::optional<std::size_t> j = c; j; j = cause[*j]) {
        if (*j == i) {
          c.reset();
          break;
        }
      }
      cause[i] = c;
    }
    // Record i for later incidents.
    if (!first_of.count(x.kind)) first_of[x.kind] = i;
    last_of[x.kind] = i;
    if (!first_any) first_any = i;
    if (x.module != "loss" && failure_tier(x.kind) == 2 && !first_layer_failure)
      first_layer_failure = i;
    if (x.module != "loss" && failure_tier(x.kind) == 2 && is_acute(x.kind))
      last_acute_layer_failure = i;
    if (x.module != "loss" && failure_tier(x.kind) == 2 && !layer_failure_in_step.count(x.step))
      layer_failure_in_step[x.step] = i;
    // A module and its activation share one order: a normalization's collapsing weight takes
    // the place of the dead or saturated units after it, which it explains.
    // A zero-initialized module stuck at 0 blocks only what is gated behind it (stuck_zero): a
    // LoRA branch or a residual branch runs beside the path the rest of the gradient takes.
    const bool stuck = x.kind == K::ConstantOutput && x.details.contains("zero_steps");
    if ((x.kind == K::DeadUnits || x.kind == K::Saturation ||
         (x.kind == K::ConstantOutput && !stuck) || x.kind == K::NormWeightCollapse) &&
        (!blockers.count(x.order) ||
         (x.kind == K::NormWeightCollapse && inc[blockers[x.order]].kind != K::NormWeightCollapse)))
      blockers[x.order] = i;
    if (x.kind == K::NormWeightCollapse && !collapsed_norm.count(x.module))
      collapsed_norm[x.module] = i;
    if (stuck && !stuck_zero) stuck_zero = i;
    if ((x.kind == K::NormWeightCollapse || x.kind == K::ConstantOutput) &&
        x.phase == Phase::Forward && !collapsed_in_step.count(x.step))
      collapsed_in_step[x.step] = i;
    if (x.kind == K::VanishingGradient && !cause[i] && !vanishing_group.count(x.step))
      vanishing_group[x.step] = i;
    if (x.kind == K::ExplodingActivation && x.phase == Phase::Forward &&
        !explode_act_in_step.count(x.step))
      explode_act_in_step[x.step] = i;
    if ((x.kind == K::DeadUnits || x.kind == K::Saturation || x.kind == K::ConstantOutput) &&
        x.phase == Phase::Forward && !fresh_forward.count(x.step))
      fresh_forward[x.step] = i;
    (void)exploding_group;
  }

  // Roots of chains (follow causes to the top; the graph is acyclic because causes precede).
  auto root_of = [&](std::size_t i) {
    std::size_t guard = 0;
    while (cause[i] && guard++ < n) i = *cause[i];
    return i;
  };

  // Vanishing by depth: the group's root is the input-most layer of the group.
  std::map<std::size_t, std::vector<std::size_t>>
      members;  // root -> incidents it explains (incl. itself)
  for (std::size_t i = 0; i < n; ++i) members[root_of(i)].push_back(i);

  // Graph nodes and edges.
  d.nodes.reserve(n);
  for (std::size_t i = 0; i < n; ++i) d.nodes.push_back(link_of(inc[i]));
  for (std::size_t i = 0; i < n; ++i)
    if (cause[i]) d.edges.emplace_back(*cause[i], i);

  std::unordered_map<uint64_t, const SemanticEvent*> event_by_id;
  for (const auto& e : report.events) event_by_id[e.id] = &e;

  struct Ranked {
    Hypothesis h;
    std::size_t node;
    Phase phase;
    int64_t order;
  };
  std::vector<Ranked> ranked;
  std::map<std::tuple<K, std::string, bool>, std::size_t>
      seen;  // (kind, module, acute) -> ranked index
  // Roots in onset order (not the report's order): a recurrence joins the earliest.
  for (const std::size_t root : order) {
    auto found = members.find(root);
    if (found == members.end() || cause[root]) continue;
    const std::vector<std::size_t>& group = found->second;
    const Incident& r = inc[root];
    std::size_t shown = root;
    std::size_t related = 1;
    if (r.kind == K::VanishingGradient) {
      related = 0;
      for (auto g : group) {
        if (inc[g].kind != K::VanishingGradient) continue;
        ++related;
        if (inc[g].order < inc[shown].order) shown = g;
      }
    }
    const Incident& s = inc[shown];
    // A recurrence joins the hypothesis made for the same failure at the same module, unless
    // it explains an acute failure the first did not (a sigmoid that saturated now and then,
    // and later saturates because its layer exploded): that is a finding of its own.
    bool group_acute = false;
    for (auto g : group) group_acute = group_acute || is_acute(inc[g].kind);
    auto key = std::make_tuple(r.kind, s.module, group_acute);
    std::vector<std::size_t> sorted = group;
    std::sort(sorted.begin(), sorted.end(), [&](std::size_t a, std::size_t b) {
      if (inc[a].step != inc[b].step) return inc[a].step < inc[b].step;
      if (inc[a].phase != inc[b].phase) return inc[a].phase < inc[b].phase;
      return inc[a].order < inc[b].order;
    });
    auto it = seen.find(key);
    if (it != seen.end()) {  // a recurrence of a hypothesis already made: more evidence for it
      Hypothesis& h = ranked[it->second].h;
      for (auto g : sorted) h.causal_chain.push_back(link_of(inc[g]));
      h.confidence = 1.0 - (1.0 - h.confidence) * 0.9;
      continue;
    }
    Hypothesis h;
    h.kind = r.kind;
    h.layer = s.module;
    h.observed = s.layer;
    h.step = r.step;
    h.rank = r.rank;
    h.description = detail::describe_root(s, related);
    if (const auto observed_at = s.details.find("observed_step");
        observed_at != s.details.end() && observed_at->is_number_integer())
      h.description += " Seen at step " + std::to_string(observed_at->get<int64_t>()) +
                       ", the first judged forward after what the gradients or the loss "
                       "showed at step " + std::to_string(s.step) +
                       " (outputs judged every few steps: HealthOptions::activation_interval or "
                       "activation_budget).";
    // Confidence: the root's own evidence, raised a little by every consequence it explains.
    const double explained = static_cast<double>(group.size() - 1);
    h.confidence = detail::clamp01(1.0 - (1.0 - std::max(r.confidence, s.confidence)) *
                                             std::pow(0.92, explained));
    for (auto g : sorted) {
      h.causal_chain.push_back(link_of(inc[g]));
      for (auto id : inc[g].events) {
        auto e = event_by_id.find(id);
        if (e != event_by_id.end() && h.evidence.size() < 64) h.evidence.push_back(*e->second);
      }
    }
    // The root first in the chain.
    auto rootpos =
        std::find_if(h.causal_chain.begin(), h.causal_chain.end(), [&](const CausalLink& c) {
          return c.layer == r.layer && c.kind == r.kind && c.step == r.step;
        });
    if (rootpos != h.causal_chain.end()) std::rotate(h.causal_chain.begin(), rootpos, rootpos + 1);
    seen[key] = ranked.size();
    ranked.push_back({std::move(h), root, r.phase, r.order});
  }
  // A finding that persisted or came back is one link with its span (the first, root or
  // not, keeps its place).
  for (auto& r : ranked) {
    std::vector<CausalLink> chain;
    std::map<std::tuple<K, std::string, int>, std::size_t> at;
    for (auto& c : r.h.causal_chain) {
      auto [it, fresh] = at.emplace(std::make_tuple(c.kind, c.layer, c.rank), chain.size());
      if (fresh) {
        chain.push_back(std::move(c));
      } else {
        CausalLink& same = chain[it->second];
        if (it->second > 0) same.step = std::min(same.step, c.step);  // the root keeps its onset
        same.last_step = std::max({same.last_step, c.step, c.last_step});
        same.occurrences += c.occurrences;
      }
    }
    r.h.causal_chain = std::move(chain);
  }
  // Severity first; among failures alike in severity, one that breaks training at once (an
  // explosion, NaN) before a state that began earlier and persists (an output tanh that
  // saturates by design), unless that state explains it; then onset.
  std::stable_sort(ranked.begin(), ranked.end(), [](const Ranked& a, const Ranked& b) {
    if (a.h.tier() != b.h.tier()) return a.h.tier() > b.h.tier();
    if (a.h.acute() != b.h.acute()) return a.h.acute();
    if (a.h.step != b.h.step) return a.h.step < b.h.step;
    if (a.phase != b.phase) return a.phase < b.phase;
    // Within a step, the order things happened: forward order, and backward (reverse) order
    // for gradients.
    if (a.order != b.order)
      return a.phase == Phase::Backward ? a.order > b.order : a.order < b.order;
    return a.h.confidence > b.h.confidence;
  });
  for (auto& r : ranked) {
    d.roots.push_back(r.node);
    d.hypotheses.push_back(std::move(r.h));
  }
  return d;
}

#endif  // TORCHDBG_DEFINITIONS

/// The diagnosis of a monitor's current state.
template <typename Mutex>
[[nodiscard]] Diagnosis diagnose(const BasicHealthMonitor<Mutex>& monitor) {
  return diagnose(monitor.report());
}

}  // namespace torchdbg
