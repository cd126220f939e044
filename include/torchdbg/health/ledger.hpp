// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The health monitor's ledger: its semantic events, incidents, how long each state has held,
// and which findings pause training. Internal to the monitor.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/detail/pattern.hpp"
#include "torchdbg/detail/ring_buffer.hpp"
#include "torchdbg/health/options.hpp"
#include "torchdbg/health/records.hpp"
#include "torchdbg/health/rules.hpp"

namespace torchdbg::detail {

/// What an event or incident is about: a layer, or the pseudo-layers "input" and "loss".
struct Subject {
  std::string_view name, module;
  int64_t order = 0;
  std::string_view activation;  ///< the layer's activation kind, if any
};

/// The course of one health state: the step it began, for how many steps it has held, and the
/// incident it is (none for a healthy state or an expected failure).
struct Track {
  int64_t since = 0;
  int64_t persist = 0;
  std::optional<int64_t> counted;  ///< the last step `persist` counted
  std::optional<std::size_t> incident;
};

/// (layer, reason) of each pause a step's observations call for; run without the lock.
using Pauses = std::vector<std::pair<std::string, std::string>>;

/// The event ring (bounded by `event_capacity`), the incidents (up to `incident_capacity`:
/// the earliest onsets, which matter most), and the report taken at the first pausing
/// failure. Not thread-safe: the monitor's lock guards it.
class HealthLedger {
 public:
  /// `snapshot`: the monitor's report, taken when the first failure pauses.
  HealthLedger(const HealthOptions& options, std::function<HealthReport()> snapshot);

  uint64_t emit(SemanticEvent e);

  /// The event of a state's change: its confidence, and `found`'s details and reason on top of
  /// `metadata` (and "expected" where the failure is by design).
  SemanticEvent event(EventType type, const Subject& who, int64_t step, std::string from,
                      std::string to, const std::optional<Finding>& found,
                      nlohmann::json metadata) const;

  /// One more judgement of a state: in the same state (`same`), a finding persists (counted
  /// once per step, however many calls judge it) and its incident follows it; returns false.
  /// Otherwise the track starts again at `step` and the caller emits the transition; returns
  /// true.
  bool advance(Track& t, bool same, const std::optional<Finding>& found, int64_t step);

  /// The new incident's index; none when the capacity is reached.
  std::optional<std::size_t> add_incident(FailureKind kind, const Subject& who, int64_t step,
                                          Phase phase, double margin, double value,
                                          double threshold, uint64_t event);
  Incident& incident(std::size_t i) { return incidents_[i]; }

  /// A rule's finding becomes an incident (its onset backdated to `Finding::since`), with
  /// the rule's name, its details and `extra`; it pauses when its kind is in `pause_on`.
  void record_finding(const Finding& f, const HealthRule& rule, const Subject& who, int64_t step,
                      Phase phase, uint64_t event, Pauses& pauses, std::optional<std::size_t>& slot,
                      const nlohmann::json* extra = nullptr);

  void update_incident(std::size_t i, int64_t step, double margin, int64_t persisted, double value);

  /// Pauses on incident `idx` when its kind is in `pause_on` (call once its details are in).
  void pause_for(std::size_t idx, int64_t step, Pauses& pauses);

  /// Whether `layer` shows failures of `kind` by design (HealthOptions::expected).
  bool is_expected(FailureKind kind, std::string_view layer) const;

  [[nodiscard]] const std::vector<Incident>& incidents() const noexcept { return incidents_; }
  [[nodiscard]] const RingBuffer<SemanticEvent>& events() const noexcept { return events_; }
  [[nodiscard]] uint64_t event_count() const noexcept { return event_seq_; }
  [[nodiscard]] uint64_t alarm_count() const noexcept { return alarms_; }
  [[nodiscard]] const std::optional<HealthReport>& failure_report() const noexcept {
    return failure_report_;
  }
  void clear();

 private:
  const HealthOptions& options_;
  std::function<HealthReport()> snapshot_;
  std::vector<std::pair<Pattern, FailureKind>> expected_;
  std::vector<Incident> incidents_;
  uint64_t dropped_incidents_ = 0;
  RingBuffer<SemanticEvent> events_;
  uint64_t event_seq_ = 0, alarms_ = 0;
  std::optional<HealthReport> failure_report_;
};

#if TORCHDBG_DEFINITIONS

TORCHDBG_INLINE HealthLedger::HealthLedger(const HealthOptions& options,
                                           std::function<HealthReport()> snapshot)
    : options_(options),
      snapshot_(std::move(snapshot)),
      events_(options.event_capacity() == 0 ? 1 : options.event_capacity()) {
  for (const auto& [pattern, kind] : options_.expected())
    expected_.emplace_back(compile_pattern(pattern, "expected failure pattern"), kind);
}

TORCHDBG_INLINE uint64_t HealthLedger::emit(SemanticEvent e) {
  e.id = ++event_seq_;
  if (e.is_alarm()) ++alarms_;
  const uint64_t id = e.id;
  events_.push(std::move(e));
  return id;
}

TORCHDBG_INLINE SemanticEvent HealthLedger::event(EventType type, const Subject& who, int64_t step,
                                                  std::string from, std::string to,
                                                  const std::optional<Finding>& found,
                                                  nlohmann::json metadata) const {
  SemanticEvent e;
  e.type = type;
  e.layer = std::string(who.name);
  e.step = step;
  e.from = std::move(from);
  e.to = std::move(to);
  e.confidence = found ? evidence_confidence(found->margin, 1, options_.persistence_steps()) : 1.0;
  e.metadata = std::move(metadata);
  if (found) {
    for (const auto& [key, v] : found->details.items()) e.metadata[key] = v;
    if (!found->reason.empty()) e.metadata["reason"] = found->reason;
    if (is_expected(found->kind, who.name)) e.metadata["expected"] = true;
  }
  return e;
}

TORCHDBG_INLINE bool HealthLedger::advance(Track& t, bool same, const std::optional<Finding>& found,
                                           int64_t step) {
  if (same) {
    if (found) {
      if (t.counted != step) ++t.persist;
      t.counted = step;
      if (t.incident) update_incident(*t.incident, step, found->margin, t.persist, found->value);
    }
    return false;
  }
  t.since = step;
  t.persist = 1;
  t.counted = step;
  t.incident.reset();
  return true;
}

TORCHDBG_INLINE auto HealthLedger::add_incident(FailureKind kind, const Subject& who, int64_t step,
                                                Phase phase, double margin, double value,
                                                double threshold, uint64_t event)
    -> std::optional<std::size_t> {
  if (incidents_.size() >= options_.incident_capacity()) {
    ++dropped_incidents_;
    return std::nullopt;
  }
  Incident inc;
  inc.kind = kind;
  inc.layer = std::string(who.name);
  inc.module = std::string(who.module);
  inc.step = inc.last_step = step;
  inc.phase = phase;
  inc.order = who.order;
  inc.confidence = detail::evidence_confidence(margin, 1, options_.persistence_steps());
  inc.margin = margin;
  inc.value = value;
  inc.threshold = threshold;
  inc.events.push_back(event);
  if (!who.activation.empty()) inc.details["activation"] = std::string(who.activation);
  incidents_.push_back(std::move(inc));
  return incidents_.size() - 1;
}

TORCHDBG_INLINE void HealthLedger::pause_for(std::size_t idx, int64_t step, Pauses& pauses) {
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
  if (!failure_report_) failure_report_ = snapshot_();
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

TORCHDBG_INLINE bool HealthLedger::is_expected(FailureKind kind, std::string_view layer) const {
  for (const auto& [re, k] : expected_)
    if (k == kind && re.full_match(layer)) return true;
  return false;
}

TORCHDBG_INLINE void HealthLedger::record_finding(const Finding& f, const HealthRule& rule,
                                                  const Subject& who, int64_t step, Phase phase,
                                                  uint64_t event, Pauses& pauses,
                                                  std::optional<std::size_t>& slot,
                                                  const nlohmann::json* extra) {
  if (is_expected(f.kind, who.name)) return;  // by design: no incident, no pause
  const int64_t onset = f.since ? std::min(*f.since, step) : step;
  slot = add_incident(f.kind, who, onset, phase, f.margin, f.value, f.threshold, event);
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

TORCHDBG_INLINE void HealthLedger::update_incident(std::size_t i, int64_t step, double margin,
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

TORCHDBG_INLINE void HealthLedger::clear() {
  incidents_.clear();
  events_.clear();
  event_seq_ = alarms_ = 0;
  failure_report_.reset();
}

#endif  // TORCHDBG_DEFINITIONS

}  // namespace torchdbg::detail
