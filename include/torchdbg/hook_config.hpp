// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "torchdbg/detail/print.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/hook_condition.hpp"

namespace torchdbg {

/// A hook's identity: 128 random bits, printed like a UUID (version 4 layout).
struct HookId {
  uint64_t hi = 0;
  uint64_t lo = 0;

  /// A fresh random id (never the nil id).
  static HookId generate() {
    thread_local std::mt19937_64 rng = [] {
      std::random_device rd;
      std::seed_seq seq{rd(), rd(), rd(), rd(), rd(), rd()};
      return std::mt19937_64(seq);
    }();
    HookId id{rng(), rng()};
    id.hi = (id.hi & ~uint64_t{0xF000}) | uint64_t{0x4000};        // version 4
    id.lo = (id.lo & ~(uint64_t{0x3} << 62)) | (uint64_t{0x2} << 62);  // RFC 4122 variant
    return id;
  }

  [[nodiscard]] bool is_nil() const noexcept { return hi == 0 && lo == 0; }
  /// "xxxxxxxx-xxxx-4xxx-yxxx-xxxxxxxxxxxx".
  [[nodiscard]] std::string to_string() const {
    char buf[37];
    std::snprintf(buf, sizeof buf, "%08x-%04x-%04x-%04x-%012llx",
                  static_cast<unsigned>(hi >> 32), static_cast<unsigned>((hi >> 16) & 0xFFFF),
                  static_cast<unsigned>(hi & 0xFFFF), static_cast<unsigned>(lo >> 48),
                  static_cast<unsigned long long>(lo & 0xFFFFFFFFFFFFULL));
    return buf;
  }
  friend bool operator==(const HookId& a, const HookId& b) noexcept {
    return a.hi == b.hi && a.lo == b.lo;
  }
  friend bool operator!=(const HookId& a, const HookId& b) noexcept { return !(a == b); }
  friend bool operator<(const HookId& a, const HookId& b) noexcept {
    return a.hi != b.hi ? a.hi < b.hi : a.lo < b.lo;
  }
  friend std::ostream& operator<<(std::ostream& os, const HookId& id) {
    return os << id.to_string();
  }
};

/// Which calls a hook sees: forward outputs, gradients or both (see HookConfig::direction).
enum class CallDirection { Both, Forward, Backward };

/// When a hook fires.
///
/// ```cpp
/// HookTrigger::every_n_steps(10);     // steps 0, 10, 20, ... (forward and backward calls)
/// HookTrigger::conditional(HookCondition::loss_above(5.0));
/// ```
class HookTrigger {
 public:
  enum class Kind {
    EveryForward,
    EveryBackward,
    EveryNSteps,
    Once,
    LayerSpecific,
    Conditional,
    OnSteps
  };

  /// Every forward call (`is_forward == true`).
  static HookTrigger every_forward() { return HookTrigger(Kind::EveryForward); }
  /// Every backward call (`is_forward == false`).
  static HookTrigger every_backward() { return HookTrigger(Kind::EveryBackward); }
  /// Calls whose step is a multiple of `n` (n >= 1).
  static HookTrigger every_n_steps(int64_t n) {
    if (n <= 0) throw Error("torchdbg: every_n_steps needs n >= 1, got " + std::to_string(n));
    HookTrigger t(Kind::EveryNSteps);
    t.interval_ = n;
    return t;
  }
  /// The first matching call only, over the hook's lifetime.
  static HookTrigger once() { return HookTrigger(Kind::Once); }
  /// Calls for exactly these layer names (whole-name equality, not regex).
  static HookTrigger layer_specific(std::vector<std::string> layers) {
    if (layers.empty()) throw Error("torchdbg: layer_specific needs at least one layer name");
    HookTrigger t(Kind::LayerSpecific);
    t.layers_ = std::move(layers);
    return t;
  }
  /// Calls for which `condition` holds.
  static HookTrigger conditional(HookCondition condition) {
    HookTrigger t(Kind::Conditional);
    t.condition_ = std::move(condition);
    return t;
  }
  /// Calls whose step `accepts` says yes to. Unlike a condition, it is judged from the step
  /// alone, so HookManager::may_fire asks it too and an attached model's operator observer is
  /// registered only on the steps it accepts. It is called from any thread, on every
  /// set_step and every due check: keep it cheap (an atomic read) and thread-safe; an
  /// exception from it propagates. `description` is what describe() shows.
  ///
  /// ```cpp
  /// auto until = std::make_shared<std::atomic<int64_t>>(-1);
  /// HookTrigger::on_steps([until](int64_t s) { return s % 100 == 0 || s <= until->load(); },
  ///                       "every 100 steps and while alert");
  /// ```
  static HookTrigger on_steps(std::function<bool(int64_t)> accepts, std::string description) {
    if (!accepts) throw Error("torchdbg: on_steps needs a callable, got an empty one");
    HookTrigger t(Kind::OnSteps);
    t.steps_ = std::make_shared<const std::function<bool(int64_t)>>(std::move(accepts));
    t.description_ = std::move(description);
    return t;
  }

  [[nodiscard]] Kind kind() const noexcept { return kind_; }
  [[nodiscard]] int64_t interval() const noexcept { return interval_; }
  [[nodiscard]] const std::vector<std::string>& layers() const noexcept { return layers_; }
  [[nodiscard]] const std::optional<HookCondition>& condition() const noexcept {
    return condition_;
  }

  /// Whether the trigger fires for `ctx` (`once` always says yes; the manager enforces the
  /// single execution). A custom condition's exception propagates.
  [[nodiscard]] bool is_due(const HookContext& ctx) const {
    switch (kind_) {
      case Kind::EveryForward: return ctx.is_forward();
      case Kind::EveryBackward: return !ctx.is_forward();
      case Kind::EveryNSteps: return ctx.step() % interval_ == 0;
      case Kind::Once: return true;
      case Kind::LayerSpecific:
        for (const auto& l : layers_)
          if (l == ctx.layer_name()) return true;
        return false;
      case Kind::Conditional: return condition_->evaluate(ctx);
      case Kind::OnSteps: return (*steps_)(ctx.step());
    }
    return false;
  }
  /// Whether an on_steps trigger accepts `step` (true for every other kind).
  [[nodiscard]] bool accepts_step(int64_t step) const {
    return kind_ != Kind::OnSteps || (*steps_)(step);
  }

  [[nodiscard]] std::string describe() const {
    switch (kind_) {
      case Kind::EveryForward: return "every forward";
      case Kind::EveryBackward: return "every backward";
      case Kind::EveryNSteps: return "every " + std::to_string(interval_) + " steps";
      case Kind::Once: return "once";
      case Kind::LayerSpecific: {
        std::string s = "layers {";
        for (std::size_t i = 0; i < layers_.size(); ++i) s += (i ? ", " : "") + layers_[i];
        return s + "}";
      }
      case Kind::Conditional: return "when " + condition_->describe();
      case Kind::OnSteps: return "on steps: " + description_;
    }
    return "?";
  }

 private:
  explicit HookTrigger(Kind k) : kind_(k) {}
  Kind kind_;
  int64_t interval_ = 0;
  std::vector<std::string> layers_;
  std::optional<HookCondition> condition_;
  std::shared_ptr<const std::function<bool(int64_t)>> steps_;
  std::string description_;
};

/// How serious an alert is.
enum class AlertSeverity { Info, Warning, Error, Critical };

inline const char* to_string(AlertSeverity s) noexcept {
  switch (s) {
    case AlertSeverity::Info: return "info";
    case AlertSeverity::Warning: return "warning";
    case AlertSeverity::Error: return "error";
    case AlertSeverity::Critical: return "critical";
  }
  return "?";
}

/// One entry of the manager's alert log.
struct Alert {
  int64_t step = 0;
  std::string layer;
  std::string hook_name;  ///< the hook that raised it
  HookId hook_id;
  std::string message;
  AlertSeverity severity = AlertSeverity::Warning;
  std::chrono::system_clock::time_point time;
};

/// What a hook does when it fires. Actions run in the order given; the first that fails
/// ends the hook's execution with an error result.
struct HookAction {
  enum class Kind {
    InspectTensor,      ///< TensorInspector records the tensor's statistics and raises alerts
    TrackGradients,     ///< gradient norm history + vanishing/exploding alerts
    RecordActivations,  ///< ActivationVisualizer records statistics, histogram and heatmap
    SaveSnapshot,       ///< writes the tensor (torch.save format) into `text` (a directory)
    Alert,              ///< logs `text` with `severity`
    CustomCallback,     ///< calls the callback registered under `text`
    PauseTraining,      ///< raises the pause flag; `text` is the reason
  };
  Kind kind = Kind::InspectTensor;
  std::string text;
  AlertSeverity severity = AlertSeverity::Warning;

  static HookAction inspect_tensor() { return {Kind::InspectTensor, {}, {}}; }
  static HookAction track_gradients() { return {Kind::TrackGradients, {}, {}}; }
  static HookAction record_activations() { return {Kind::RecordActivations, {}, {}}; }
  /// Snapshot files go to `directory` (created on first use).
  static HookAction save_snapshot(std::string directory) {
    if (directory.empty()) throw Error("torchdbg: save_snapshot needs a directory");
    return {Kind::SaveSnapshot, std::move(directory), {}};
  }
  static HookAction alert(std::string message, AlertSeverity severity = AlertSeverity::Warning) {
    return {Kind::Alert, std::move(message), severity};
  }
  /// Calls the callback registered with `register_callback(name, ...)`; resolved when the
  /// hook fires, so a missing name is an error result naming it.
  static HookAction custom_callback(std::string name) {
    if (name.empty()) throw Error("torchdbg: custom_callback needs a callback name");
    return {Kind::CustomCallback, std::move(name), {}};
  }
  static HookAction pause_training(std::string reason = "") {
    return {Kind::PauseTraining, std::move(reason), {}};
  }

  [[nodiscard]] std::string describe() const {
    switch (kind) {
      case Kind::InspectTensor: return "inspect_tensor";
      case Kind::TrackGradients: return "track_gradients";
      case Kind::RecordActivations: return "record_activations";
      case Kind::SaveSnapshot: return "save_snapshot(" + text + ")";
      case Kind::Alert: return std::string("alert(") + to_string(severity) + ": " + text + ")";
      case Kind::CustomCallback: return "custom_callback(" + text + ")";
      case Kind::PauseTraining: return "pause_training";
    }
    return "?";
  }
};

/// A hook's configuration, in LibTorch's options-builder style.
///
/// ```cpp
/// hooks.register_hook(HookConfig()
///     .name("fc snapshots")
///     .trigger(HookTrigger::every_n_steps(100))
///     .actions({HookAction::save_snapshot("snapshots")})
///     .layer_patterns({"^fc[0-9]+$"}));
/// ```
struct HookConfig {
  TORCH_ARG(std::string, name) = "hook";
  TORCH_ARG(HookTrigger, trigger) = HookTrigger::every_forward();
  TORCH_ARG(std::vector<HookAction>, actions);
  TORCH_ARG(bool, enabled) = true;
  /// The hook stops firing after this many executions (skipped results afterwards).
  TORCH_ARG(std::optional<uint64_t>, max_executions);
  /// Regexes (RE2 syntax: Perl's without back-references or look-around) searched anywhere
  /// in the layer name (unanchored: use `^...$` for whole names). Empty: every layer. An
  /// invalid pattern is rejected by `register_hook`. Matching is linear in the name's length
  /// for any pattern; each layer name is matched once per hook and then cached.
  TORCH_ARG(std::vector<std::string>, layer_patterns);
  /// Forward: the hook sees forward calls only; Backward: gradient calls only; Both (the
  /// default): every call its trigger accepts. Calls of the other direction are not the
  /// hook's, as layers its patterns do not match (no result, not counted as skipped), and
  /// `may_fire` and `reads_sign_counts` leave the hook out for them. With a step trigger:
  /// `.trigger(HookTrigger::every_n_steps(10)).direction(CallDirection::Forward)` inspects
  /// forward outputs every 10th step without also running on that step's gradients.
  TORCH_ARG(CallDirection, direction) = CallDirection::Both;
  /// Execution order: a hook with a higher priority runs before one with a lower priority;
  /// hooks of equal priority run in registration order (see prepend). A replacing hook's
  /// effect is seen by every hook after it, so `.priority(10)` puts a hook ahead of the
  /// default 0 and `.priority(-10)` behind it.
  TORCH_ARG(int, priority) = 0;
  /// Runs before the hooks of the same priority registered so far, as PyTorch's and tdhook's
  /// `prepend=True`: of several prepended hooks the latest runs first.
  TORCH_ARG(bool, prepend) = false;

 public:
  HookConfig& add_action(HookAction a) {
    actions_.push_back(std::move(a));
    return *this;
  }
};

/// The outcome of one hook for one `execute_hooks` call.
class HookResult {
 public:
  enum class Status { Success, Error, Skipped };

  /// `detail` carries extra information, e.g. the snapshot path written.
  static HookResult success(std::string detail = "") {
    return HookResult(Status::Success, std::move(detail));
  }
  static HookResult error(std::string message) { return HookResult(Status::Error, std::move(message)); }
  static HookResult skipped(std::string reason) {
    return HookResult(Status::Skipped, std::move(reason));
  }

  [[nodiscard]] Status status() const noexcept { return status_; }
  [[nodiscard]] bool ok() const noexcept { return status_ == Status::Success; }
  [[nodiscard]] bool is_error() const noexcept { return status_ == Status::Error; }
  [[nodiscard]] bool is_skipped() const noexcept { return status_ == Status::Skipped; }
  /// The error message, skip reason or success detail.
  [[nodiscard]] const std::string& message() const noexcept { return message_; }

 private:
  HookResult(Status s, std::string m) : status_(s), message_(std::move(m)) {}
  Status status_;
  std::string message_;
};

/// Per-hook counters. Times are wall-clock (steady clock) over the hook's executions.
struct HookStats {
  uint64_t executions = 0;  ///< times the trigger fired and the actions ran (errors included)
  uint64_t errors = 0;      ///< error results (throwing actions, bad input, missing callbacks)
  uint64_t skipped = 0;     ///< skipped results (trigger not due, max_executions reached)
  std::optional<int64_t> last_step;  ///< step of the last execution
  double total_time_us = 0.0;        ///< summed execution time, microseconds
  [[nodiscard]] double mean_time_us() const noexcept {
    return executions ? total_time_us / static_cast<double>(executions) : 0.0;
  }
};

/// One line: name, trigger, actions, then the settings that differ from the defaults, e.g.
/// `HookConfig("fc snapshots", every 100 steps, [inspect_tensor, save_snapshot(out)],
/// patterns ["^fc[0-9]+$"], forward, max 10)`; text from the user is escaped.
inline std::string to_string(const HookConfig& c) {
  std::string s = "HookConfig(" + detail::quoted(c.name()) + ", " + detail::escaped(c.trigger().describe()) + ", [";
  for (std::size_t i = 0; i < c.actions().size(); ++i)
    s += (i ? ", " : "") + detail::escaped(c.actions()[i].describe());
  s += "]";
  if (!c.layer_patterns().empty()) {
    s += ", patterns [";
    for (std::size_t i = 0; i < c.layer_patterns().size(); ++i)
      s += (i ? ", " : "") + detail::quoted(c.layer_patterns()[i]);
    s += "]";
  }
  if (c.direction() == CallDirection::Forward) s += ", forward";
  if (c.direction() == CallDirection::Backward) s += ", backward";
  if (c.max_executions()) s += ", max " + std::to_string(*c.max_executions());
  if (c.priority() != 0) s += ", priority " + std::to_string(c.priority());
  if (c.prepend()) s += ", prepend";
  if (!c.enabled()) s += ", disabled";
  return s + ")";
}

/// One line, e.g. `HookStats(12 executions, 1 error, 3 skipped, last step 11, 1.234 ms,
/// 102.8 us each)`; "never ran" without executions.
inline std::string to_string(const HookStats& st) {
  std::string s = "HookStats(" + detail::count(st.executions, "execution") + ", " +
                  detail::count(st.errors, "error") + fmt::format(", {} skipped", st.skipped);
  if (!st.last_step) return s + ", never ran)";
  return s + fmt::format(", last step {}, {} ms, {} us each)", *st.last_step, detail::num(st.total_time_us / 1000.0),
                         detail::num(st.mean_time_us()));
}

namespace detail {
template <>
struct Printable<HookConfig> : std::true_type {};
template <>
struct Printable<HookStats> : std::true_type {};
}  // namespace detail

/// Passed to the manager's error handler for each error result.
struct HookError {
  HookId hook_id;
  std::string hook_name;
  std::string layer;
  int64_t step = 0;
  std::string message;
};

}  // namespace torchdbg

template <>
struct std::hash<torchdbg::HookId> {
  std::size_t operator()(const torchdbg::HookId& id) const noexcept {
    return std::hash<uint64_t>()(id.hi ^ (id.lo * 0x9E3779B97F4A7C15ULL));
  }
};
