// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The health monitor's judgement of each observation, without its lock and callbacks: the
// signals a layer shows (health/signals.hpp) go to the rules (health/rules.hpp), and their
// findings become states, events and incidents in the ledger (health/ledger.hpp). Internal to
// the monitor.

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/health/budget.hpp"
#include "torchdbg/health/gradients.hpp"
#include "torchdbg/health/input_watch.hpp"
#include "torchdbg/health/ledger.hpp"
#include "torchdbg/health/options.hpp"
#include "torchdbg/health/records.hpp"
#include "torchdbg/health/rules.hpp"
#include "torchdbg/health/signals.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg::detail {

/// One monitor's state and judgement: the current step, the signals, the rules, the input
/// watch, the ledger and the loss's state. Not thread-safe: the monitor's lock guards it.
class HealthCore {
 public:
  using Layer = HealthLayer;

  /// Validates `options` and compiles its patterns (throws torchdbg::Error on a bad one); the
  /// rules are the built-in ones, then `options.rules()`.
  explicit HealthCore(const HealthOptions& options);
  HealthCore(const HealthCore&) = delete;  // the ledger's snapshot points at this one
  HealthCore& operator=(const HealthCore&) = delete;

  // ---- steps
  [[nodiscard]] bool has_step() const noexcept { return have_step_; }
  [[nodiscard]] int64_t step() const noexcept { return cur_step_; }
  /// `step` begins: the step's forward and backward bookkeeping starts again.
  void begin_step(int64_t step);
  /// The current step is over (flush): the next observation begins one again.
  void end_step() noexcept { have_step_ = false; }
  /// The current step's forward outputs are all in: a layer called several times in it whose
  /// finding from an earlier step none of its calls had recovers at this step.
  void settle_activations(Pauses& pauses);

  // ---- observations (the caller holds the monitor's lock)
  /// A forward output of `L` (and, with attach's metadata, the model's input it came from).
  void activation(Layer& L, const at::Tensor& y, const TensorStats& s, int64_t step,
                  const ActivationInfo& info, Pauses& pauses);
  /// A gradient of one of `L`'s parameters.
  void gradient(Layer& L, const TensorStats& s) { grads_.add(L, signals_.index_of(L), s); }
  /// Judges the gradients received since the last backward pass was judged.
  void gradients(Pauses& pauses);
  /// The backward pass under way threw: its gradients are forgotten.
  void abandon_backward() { grads_.abandon(signals_.records()); }
  void loss(int64_t step, double loss, Pauses& pauses);

  /// Whether forward outputs of `step` are judged beyond the fixed steps: with
  /// HealthOptions::activation_interval above 1, within alert_steps after a finding. Any
  /// thread, without the monitor's lock (set_step asks it through the monitor's hook).
  [[nodiscard]] bool alert_covers(int64_t step) const noexcept {
    return step >= alert_from_.load(std::memory_order_relaxed) &&
           step <= alert_until_.load(std::memory_order_relaxed);
  }
  /// Whether forward outputs of `step` are judged: on the steps of interval *
  /// activation_interval (or those HealthOptions::activation_budget chose), and on the
  /// evaluated steps alert_covers. Any thread, without the monitor's lock.
  [[nodiscard]] bool forward_due(int64_t step) const noexcept {
    const int64_t every = options_.interval();
    if (budget_.enabled()) return budget_.forward_due(step) || alert_covers(step);
    return step % (every * options_.activation_interval()) == 0 || (step % every == 0 && alert_covers(step));
  }
  /// Whether forward outputs may go unjudged on some evaluated steps (activation_interval
  /// above 1, or activation_budget while it measures or once it chose more than 1).
  [[nodiscard]] bool sparse_forward() const noexcept { return sparse_forward_; }

  // ---- rules
  void add_rule(HealthRulePtr rule) { rules_.push_back(std::move(rule)); }
  [[nodiscard]] const std::vector<HealthRulePtr>& rules() const noexcept { return rules_; }
  [[nodiscard]] uint64_t rule_errors() const noexcept { return rule_errors_; }

  // ---- state
  HealthSignals& signals() noexcept { return signals_; }
  [[nodiscard]] const HealthSignals& signals() const noexcept { return signals_; }
  [[nodiscard]] const HealthLedger& ledger() const noexcept { return ledger_; }
  [[nodiscard]] LossHealth loss_health() const noexcept { return loss_state_; }
  /// A copy of everything diagnose() needs.
  [[nodiscard]] HealthReport report() const;
  /// Forgets all state, events and incidents (options and rules stay).
  void clear();

 private:
  void judge_activation(Layer& L, const at::Tensor& y, const TensorStats& s, int64_t step,
                        const ActivationInfo& info, Pauses& pauses);
  /// `L`'s forward state becomes `state` at `step` (`found`: the finding behind it, by rule
  /// `by`; the ledger's track already advanced): its event, and the incident a finding opens.
  void enter_activation_state(Layer& L, ActivationHealth state, const std::optional<Finding>& found,
                              const HealthRule* by, int64_t step, bool first, Pauses& pauses);

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

  /// A layer or the loss entered a failure state in the current step (not the same finding
  /// confirmed again: a lasting one would judge every step): forward outputs are judged on the
  /// next alert_steps.
  void raise_alert(const std::optional<Finding>& found) noexcept {
    if (!found || found->kind == FailureKind::LossPlateau || !sparse_forward_ ||
        options_.alert_steps() == 0 || cur_step_ == std::numeric_limits<int64_t>::max())
      return;
    const int64_t until = cur_step_ > std::numeric_limits<int64_t>::max() - options_.alert_steps()
                              ? std::numeric_limits<int64_t>::max()
                              : cur_step_ + options_.alert_steps();
    // A window reaching this step goes on; otherwise one starts after this step (this step's
    // forward is over or already due: a step's due calls do not change within it). `from`
    // first: a reader between the two stores sees no step covered.
    const int64_t from = alert_from_.load(std::memory_order_relaxed);
    const int64_t last = alert_until_.load(std::memory_order_relaxed);
    if (!(from <= cur_step_ + 1 && last >= cur_step_)) {
      alert_from_.store(cur_step_ + 1, std::memory_order_relaxed);
      alert_until_.store(until, std::memory_order_relaxed);
    } else {
      alert_until_.store(std::max(until, last), std::memory_order_relaxed);
    }
  }

  /// Tells the signals and this core whether forward outputs may go unjudged (sparse_forward).
  void set_sparse_forward(bool sparse) {
    sparse_forward_ = sparse;
    signals_.set_sparse_forward(sparse);
  }

  const HealthOptions& options_;
  std::vector<HealthRulePtr> rules_;
  uint64_t rule_errors_ = 0;
  ForwardBudget budget_;
  bool sparse_forward_ = false;
  // begin_step calls (each a new step: the monitor calls it once a step), and the one a forward
  // output was judged in last (activation_budget's times are grouped by it).
  uint64_t step_seq_ = 0;
  uint64_t judged_seq_ = 0;
  bool have_judged_ = false;
  // The last steps whose outputs were judged, oldest first (activation_interval above 1).
  static constexpr std::size_t kForwardSteps = 64;
  std::deque<int64_t> fwd_steps_;
  std::atomic<int64_t> alert_from_{std::numeric_limits<int64_t>::max()};
  std::atomic<int64_t> alert_until_{std::numeric_limits<int64_t>::min()};
  HealthSignals signals_;
  GradientTracker grads_;
  HealthLedger ledger_;
  InputWatch input_;
  bool have_step_ = false;
  int64_t cur_step_ = 0;
  LossHealth loss_state_ = LossHealth::Healthy;
  Track loss_track_;
};

#if TORCHDBG_DEFINITIONS

namespace health_core {
TORCHDBG_INLINE const HealthOptions& validated(const HealthOptions& o) {
  validate(o);
  return o;
}
}  // namespace health_core

TORCHDBG_INLINE HealthCore::HealthCore(const HealthOptions& options)
    : options_(health_core::validated(options)),
      rules_(builtin_health_rules(options_)),
      budget_(options_.activation_budget()),
      signals_(options_),
      grads_(options_),
      ledger_(options_, [this] { return report(); }),
      input_(options_) {
  set_sparse_forward(options_.activation_interval() > 1 || budget_.enabled());
  for (std::size_t i = 0; i < options_.rules().size(); ++i) {
    if (!options_.rules()[i])
      throw Error("torchdbg: HealthOptions::rules[" + std::to_string(i) + "] is null");
    rules_.push_back(options_.rules()[i]);
  }
}

TORCHDBG_INLINE void HealthCore::begin_step(int64_t step) {
  if (step < cur_step_) {  // steps restarted (an epoch counted from 0): no alert carries over
    alert_from_.store(std::numeric_limits<int64_t>::max(), std::memory_order_relaxed);
    alert_until_.store(std::numeric_limits<int64_t>::min(), std::memory_order_relaxed);
  }
  if (budget_.enabled()) {
    const auto now = std::chrono::steady_clock::now().time_since_epoch();
    const bool judged = have_judged_ && judged_seq_ == step_seq_;  // in the step before
    if (budget_.begin_step(step, std::chrono::duration_cast<std::chrono::nanoseconds>(now).count(), judged))
      set_sparse_forward(budget_.interval() > 1);
  }
  ++step_seq_;
  have_step_ = true;
  cur_step_ = step;
  signals_.begin_step();
  grads_.begin_step();
}

TORCHDBG_INLINE void HealthCore::activation(Layer& L, const at::Tensor& y, const TensorStats& s,
                                            int64_t step, const ActivationInfo& info,
                                            Pauses& pauses) {
  have_judged_ = true;
  judged_seq_ = step_seq_;
  if (!sparse_forward_) return judge_activation(L, y, s, step, info, pauses);
  if (fwd_steps_.empty() || fwd_steps_.back() != step) {
    if (!fwd_steps_.empty() && step < fwd_steps_.back()) fwd_steps_.clear();  // steps restarted
    fwd_steps_.push_back(step);
    if (fwd_steps_.size() > kForwardSteps) fwd_steps_.pop_front();
  }
  const std::size_t known = ledger_.incidents().size();
  judge_activation(L, y, s, step, info, pauses);
  // Outputs judged every few steps: what this forward finds may have begun on any step since
  // the outputs before its onset were judged (diagnose() weighs that against what gradients
  // and the loss showed in between).
  for (std::size_t i = known; i < ledger_.incidents().size(); ++i) {
    Incident& inc = ledger_.incident(i);
    if (inc.phase != Phase::Forward) continue;
    auto it = std::lower_bound(fwd_steps_.begin(), fwd_steps_.end(), inc.step);
    if (it == fwd_steps_.begin()) continue;  // nothing judged before it that we remember
    const int64_t before = *std::prev(it);
    if (inc.step - before > options_.interval()) inc.details["unobserved_from"] = before + 1;
  }
}

TORCHDBG_INLINE void HealthCore::judge_activation(Layer& L, const at::Tensor& y,
                                                  const TensorStats& s, int64_t step,
                                                  const ActivationInfo& info, Pauses& pauses) {
  // The model's input as attach saw it with this output: NaN/Inf there is the data's failure,
  // and no output after it in the step is an origin. Where it mixes outputs of layers that
  // ran before it (`cat({pool(emb(ids)), dense})`), their NaN or explosion in this step is
  // theirs: its NaN is not judged after a non-finite output, nor its scale after either.
  if (info.input_observed &&
      input_.observe(L.name, step, info, ledger_, pauses, signals_.forward_non_finite(),
                     signals_.forward_non_finite() || signals_.forward_exploding()))
    signals_.mark_forward_non_finite();
  bool new_step = false;
  const ActivationSignals sig = signals_.measure_activation(L, y, s, step, info, new_step);
  const bool grad_on = at::GradMode::is_enabled();
  if (new_step) {
    L.act_calls_prev = L.act_calls;
    L.act_calls = 0;
  }
  if (grad_on) L.act_calls_most = std::max(L.act_calls_most, ++L.act_calls);
  const HealthRule* by = nullptr;
  std::optional<Finding> found = judge(
      sig, [](HealthRule& r, const auto& x) { return r.check_activation(x); }, by);
  // An amplification from the layer's first step on (its first output, or a tied head's call
  // after its lookup) is its weights' initial scale or the values they were loaded with, not
  // something training did.
  if (!L.seen_fwd) L.first_act_step = step;
  if (found && found->kind == FailureKind::ExplodingActivation && L.first_act_step == step)
    found->details["from_first_step"] = true;
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
  if (state == ActivationHealth::Normal) signals_.learn_activation(L);
  if (found && found->kind == FailureKind::ExplodingActivation) signals_.mark_forward_exploding();

  const ActivationHealth before = L.act;
  const bool first = !L.seen_fwd;
  L.seen_fwd = true;
  // A call that does not carry the measure behind the current finding (a BatchNorm's other
  // calls: eval, an operator on its weight outside the forward; a tied embedding's lookup
  // while its output head's call is exploding, and the other way round) neither confirms
  // nor ends it.
  // A layer called several times a step in training (a recurrent cell's time steps, a
  // discriminator on real and generated batches) has the finding for the step when any of
  // those calls has it: from its second step on, a call without it neither confirms nor ends
  // it after a call of the step that had it, nor, once the layer has made several calls in a
  // step, before one (settle_activations ends it with the step when none had it). Outputs
  // made with gradients off (evaluation, inference, whose batches a step number need not tell
  // apart) are judged each on its own: what they find is not held, and what they confirm of a
  // training finding does not keep it past a step whose training calls had it not.
  const bool training_finding = L.act_found && L.act_found_grad && grad_on;
  const bool counted_now = L.act_trained == step;  // a training call of this step had it
  const bool held = training_finding && (counted_now ? L.act_calls_prev > 0 : L.act_calls_most > 1);
  if (held && !found && !counted_now) L.act_deferred = step;
  if (!found && !first &&
      (held || (L.act_found == FailureKind::NormStatistics && !info.norm_stats_error) ||
       (L.act_found == FailureKind::NormWeightCollapse && !info.norm_weight_rms) ||
       (L.act_found == FailureKind::ExplodingActivation && L.act_found_unscaled != L.unscaled)))
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
  const bool same = !first && state == before &&
                    (!found || !L.act_found || one_failure(*L.act_found, found->kind));
  if (found && grad_on) {
    L.act_trained = step;
    if (same) L.act_found_grad = true;  // a training call confirms it
  }
  if (!ledger_.advance(L.act_track, same, found, step)) return;
  enter_activation_state(L, state, found, by, step, first, pauses);
}

TORCHDBG_INLINE void HealthCore::enter_activation_state(Layer& L, ActivationHealth state,
                                                        const std::optional<Finding>& found,
                                                        const HealthRule* by, int64_t step, bool first,
                                                        Pauses& pauses) {
  const ActivationHealth before = L.act;
  raise_alert(found);
  L.act = state;
  L.act_found = found ? std::optional<FailureKind>(found->kind) : std::nullopt;
  L.act_found_unscaled = found && L.unscaled;
  L.act_found_grad = found && at::GradMode::is_enabled();
  L.act_deferred.reset();
  if (state == ActivationHealth::Normal && first) return;  // a healthy start is no event
  const EventType type =
      state == ActivationHealth::Normal                         ? EventType::ActivationRecovered
      : state == ActivationHealth::NonFinite                    ? EventType::NonFiniteActivation
      : state == ActivationHealth::Dead                         ? EventType::DeadUnits
      : state == ActivationHealth::Saturated                    ? EventType::Saturation
      : found && found->kind == FailureKind::NormStatistics     ? EventType::NormStatsDrift
      : found && found->kind == FailureKind::NormWeightCollapse ? EventType::NormWeightCollapse
                                                                : EventType::ActivationAnomaly;
  nlohmann::json metadata = {{"rms", json_num(L.rms)}};
  if (std::isfinite(L.gain)) metadata["gain"] = L.gain;
  SemanticEvent e = ledger_.event(type, L.subject(), step, first ? "unobserved" : to_string(before),
                                  to_string(state), found, std::move(metadata));
  if (!L.act_kind.empty()) e.metadata["activation"] = L.act_kind;
  const uint64_t id = ledger_.emit(std::move(e));
  if (found && found->incident && by != nullptr)
    ledger_.record_finding(*found, *by, L.subject(), step, Phase::Forward, id, pauses,
                           L.act_track.incident);
}

TORCHDBG_INLINE void HealthCore::settle_activations(Pauses& pauses) {
  if (!have_step_) return;
  for (Layer& L : signals_.records()) {
    if (!L.act_deferred || *L.act_deferred != cur_step_) continue;
    L.act_deferred.reset();
    if (!L.act_found || L.act_trained == cur_step_) continue;  // a training call of the step had it
    ledger_.advance(L.act_track, false, std::nullopt, cur_step_);
    enter_activation_state(L, ActivationHealth::Normal, std::nullopt, nullptr, cur_step_, false, pauses);
  }
}

TORCHDBG_INLINE void HealthCore::gradients(Pauses& pauses) {
  if (!grads_.pending()) return;
  const int64_t step = cur_step_;
  std::vector<Layer>& layers = signals_.records();
  GradientTracker::GradientPass pass = grads_.begin(layers, step);
  const auto zero_init = signals_.zero_initialized_in_step(step);
  pass.zero_initialized_in_step = zero_init == HealthSignals::ZeroInit::Yes;
  pass.forward_unknown = zero_init == HealthSignals::ZeroInit::Unknown;
  for (std::size_t k = 0; k < pass.mods.size(); ++k) {
    Layer& L = layers[pass.mods[k]];
    const GradientTracker::GradientMeasure g = grads_.measure(layers, pass, k);
    const HealthRule* by = nullptr;
    const std::optional<Finding> found = judge(
        g.sig, [](HealthRule& r, const auto& x) { return r.check_gradient(x); }, by);
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
    if (state == GradientHealth::Healthy) grads_.learn(L);
    const GradientHealth before = L.grad;
    const bool first = !L.seen_bwd;
    L.seen_bwd = true;
    if (!ledger_.advance(L.grad_track, !first && state == before, found, step)) continue;
    raise_alert(found);
    L.grad = state;
    if (state == GradientHealth::Healthy && first) continue;
    const EventType type = state == GradientHealth::Healthy     ? EventType::GradientRecovered
                           : state == GradientHealth::NonFinite ? EventType::NonFiniteGradient
                           : state == GradientHealth::Exploding ? EventType::ExplodingGradient
                           : state == GradientHealth::Vanishing ? EventType::VanishingGradient
                                                                : EventType::GradientAnomaly;
    nlohmann::json metadata = {{"norm", json_num(L.g_norm)}};
    if (std::isfinite(g.amplification)) metadata["amplification"] = g.amplification;
    if (g.base_ready) metadata["baseline"] = g.sig.baseline;
    if (pass.max_norm > 0.0) metadata["relative_to_max"] = L.g_norm / pass.max_norm;
    const uint64_t id = ledger_.emit(ledger_.event(type, L.subject(), step,
                                                   first ? "unobserved" : to_string(before),
                                                   to_string(state), found, std::move(metadata)));
    if (found && found->incident) {
      nlohmann::json extra = nlohmann::json::object();
      if (std::isfinite(g.amplification)) extra["amplification"] = g.amplification;
      if (std::isfinite(g.usual_amplification))
        extra["amplification_vs_usual"] = g.usual_amplification;
      ledger_.record_finding(*found, *by, L.subject(), step, Phase::Backward, id, pauses,
                             L.grad_track.incident, &extra);
    }
  }
}

TORCHDBG_INLINE void HealthCore::loss(int64_t step, double loss, Pauses& pauses) {
  const LossSignals sig = signals_.measure_loss(step, loss);
  const HealthRule* by = nullptr;
  std::optional<Finding> found = judge(
      sig, [](HealthRule& r, const auto& x) { return r.check_loss(x); }, by);
  // Outputs judged every few steps: whether this step's were (diagnose() says nothing of the
  // layers' outputs of a step that had none judged).
  if (found && sparse_forward_ && (fwd_steps_.empty() || fwd_steps_.back() != step))
    found->details["forward_unjudged"] = true;
  signals_.learn_loss(loss);
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
  if (!ledger_.advance(loss_track_, state == before, found, step)) return;
  raise_alert(found);
  loss_state_ = state;
  const EventType type = state == LossHealth::Healthy     ? EventType::LossRecovered
                         : state == LossHealth::Diverging ? EventType::LossDiverged
                         : state == LossHealth::Spike     ? EventType::LossSpike
                         : state == LossHealth::Plateau   ? EventType::LossPlateau
                                                          : EventType::LossAnomaly;
  const Subject who{"loss", "loss", HealthLayer::kUnordered * 2, {}};  // after every layer
  nlohmann::json metadata = {
      {"loss", std::isfinite(loss) ? nlohmann::json(loss) : nlohmann::json(std::to_string(loss))}};
  const uint64_t id = ledger_.emit(ledger_.event(type, who, step, to_string(before),
                                                 to_string(state), found, std::move(metadata)));
  if (found && found->incident)
    ledger_.record_finding(*found, *by, who, step, Phase::Loss, id, pauses, loss_track_.incident);
}

TORCHDBG_INLINE HealthReport HealthCore::report() const {
  HealthReport r;
  r.step = cur_step_;
  r.layers = signals_.layers();
  r.incidents = ledger_.incidents();
  // A module's order is the forward position of its first output (activations follow it).
  std::unordered_map<std::string, int64_t> module_order;
  for (const auto& L : signals_.records()) {
    auto it = module_order.find(L.module);
    if (it == module_order.end() || L.order < it->second) module_order[L.module] = L.order;
  }
  for (auto& inc : r.incidents) {
    auto it = module_order.find(inc.module);
    if (it != module_order.end() && inc.module != "loss") inc.order = it->second;
  }
  r.events = ledger_.events().to_vector();
  r.events_total = ledger_.event_count();
  r.loss = loss_state_;
  r.last_loss = signals_.last_loss();
  r.activation_interval = budget_.enabled() ? budget_.interval() : options_.activation_interval();
  r.activation_cost = budget_.measured_share();
  return r;
}

TORCHDBG_INLINE void HealthCore::clear() {
  signals_.clear();
  grads_.clear();
  ledger_.clear();
  input_.clear();
  rule_errors_ = 0;
  loss_state_ = LossHealth::Healthy;
  loss_track_ = Track{};
  have_step_ = false;
  alert_from_.store(std::numeric_limits<int64_t>::max());
  alert_until_.store(std::numeric_limits<int64_t>::min());
  fwd_steps_.clear();
  budget_.reset();
  have_judged_ = false;
  set_sparse_forward(options_.activation_interval() > 1 || budget_.enabled());
}

#endif  // TORCHDBG_DEFINITIONS

}  // namespace torchdbg::detail
