// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/arg.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torchdbg/activation_visualizer.hpp"
#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/detail/mutex.hpp"
#include "torchdbg/detail/print.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/hook_condition.hpp"
#include "torchdbg/hook_config.hpp"
#include "torchdbg/hook_context.hpp"
#include "torchdbg/hook_manager/alerts.hpp"
#include "torchdbg/hook_manager/due.hpp"
#include "torchdbg/hook_manager/execution.hpp"
#include "torchdbg/hook_manager/registry.hpp"
#include "torchdbg/hook_manager/statistics.hpp"
#include "torchdbg/hook_manager/training_state.hpp"
#include "torchdbg/tensor_inspector.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg {

/// HookManager settings.
struct HookManagerOptions {
  TORCH_ARG(InspectorOptions, inspector);
  TORCH_ARG(VisualizerOptions, visualizer);
  /// Alerts kept in the alert log (a ring: the oldest is dropped).
  TORCH_ARG(std::size_t, alert_capacity) = 1000;
  /// Layer names whose pattern match each hook remembers (cleared when full).
  TORCH_ARG(std::size_t, layer_match_cache) = 4096;
  /// Statistics of large tensors read partly from a sample (StatsSampling; off by default):
  /// what hooks read (HookContext::stats, moment_stats) and attach's gradient norms.
  TORCH_ARG(StatsSampling, sampling);
};

/// A registry of hooks that a training loop drives.
///
/// ```cpp
/// torchdbg::HookManager hooks;
/// hooks.create_tensor_inspection_hook({"fc"});
/// hooks.create_alert_hook(HookCondition::loss_above(10.0), "loss exploded",
/// AlertSeverity::Critical); for (int64_t step = 0; step < n; ++step) {
///   hooks.set_step(step);
///   auto y = model->forward(x);
///   hooks.execute_hooks("fc1", y, /*is_forward=*/true);
///   if (hooks.is_paused()) break;  // the manager never blocks: the loop decides
/// }
/// ```
///
/// Hooks run by `HookConfig::priority` (higher first), then in registration order, a
/// prepended hook before those of its priority registered earlier. A hook whose layer patterns do not match the call's
/// layer, or that is disabled, is left out of the results; one that matches but whose
/// trigger is not due, or that reached max_executions, gives a skipped result. Nothing a
/// hook does escapes `execute_hooks`: exceptions, bad input and missing callbacks become
/// error results, are counted in HookStats and go to the error handler.
///
/// Pause contract: the PauseTraining action only sets the shared atomic flag
/// (`pause_flag()`); the manager never blocks or sleeps. The loop polls the flag between
/// steps, stops advancing while it is set, and calls `resume_training()` to clear it.
///
/// Thread safety: `HookManager` (std::mutex) may be used from any number of threads at once,
/// including `execute_hooks` from autograd threads and registration while hooks run; hooks
/// and callbacks run without any manager lock held, so they may call back into the manager.
/// `HookManagerSt` (NullMutex) is for a single thread.
///
/// The pieces (hook_manager/): the registry of hooks, callbacks and prefetches
/// (registry.hpp), which hooks are due (due.hpp), running them (execution.hpp), their counters
/// (statistics.hpp), alerts and the pause flag (alerts.hpp), the training state and its
/// listeners (training_state.hpp).
template <typename Mutex>
class BasicHookManager {
 public:
  using Callback = std::function<void(const HookContext&)>;
  using AlertSink = std::function<void(const Alert&)>;
  using ErrorHandler = std::function<void(const HookError&)>;
  using Results = std::vector<std::pair<HookId, HookResult>>;

  explicit BasicHookManager(HookManagerOptions options = {})
      : inspector(options.inspector()),
        visualizer(options.visualizer()),
        options_(checked(std::move(options))),
        log_(options_.alert_capacity()),
        executor_(registry_, log_, state_, inspector, visualizer, options_.sampling()) {}

  ~BasicHookManager();
  BasicHookManager(const BasicHookManager&) = delete;
  BasicHookManager& operator=(const BasicHookManager&) = delete;

  /// Statistics of inspected tensors; the loop may read it at any time.
  BasicTensorInspector<Mutex> inspector;
  /// Activation statistics, histograms and heatmaps; the loop may read it at any time.
  BasicActivationVisualizer<Mutex> visualizer;

  BasicTensorInspector<Mutex>& tensor_inspector() noexcept { return inspector; }
  BasicActivationVisualizer<Mutex>& activation_visualizer() noexcept { return visualizer; }

  // ---- registration ---------------------------------------------------------------------

  /// Registers a hook and returns its id. Throws torchdbg::Error naming an invalid layer
  /// pattern or a max_executions of 0.
  HookId register_hook(HookConfig config);

  /// Registers (or replaces) the callback that `HookAction::custom_callback(name)` calls.
  /// `reads`: CallbackStats::Moments when it reads only `HookContext::moment_stats()`, which
  /// lets attach skip the sign counts of the statistics it computes (see reads_sign_counts).
  void register_callback(std::string name, Callback callback,
                         CallbackStats reads = CallbackStats::Full);

  /// Whether a callback is registered under `name`.
  [[nodiscard]] bool has_callback(std::string_view name) const { return registry_.has_callback(name); }

  /// Removes a callback; false if none was registered under `name`.
  bool remove_callback(std::string_view name);

  /// Computes, where `tensor` lives and without a host sync, values a consumer will want when
  /// the tensor's hooks run; returns a 1-D tensor on the tensor's device (any real dtype), or
  /// an undefined tensor for none.
  using Prefetch = typename detail::HookRegistry<Mutex>::Prefetch;

  /// Registers (or replaces) prefetch `key`. A delivery that attach queues (StatsBatching)
  /// runs every prefetch when it is queued; the values come to the host in the step's one
  /// copy and reach the hooks as `HookContext::prefetched(key)`. Deliveries run at once get
  /// none, so a consumer must also work without them.
  void add_prefetch(std::string key, Prefetch fn) { registry_.add_prefetch(std::move(key), std::move(fn)); }

  /// Removes prefetch `key`; false if there was none.
  bool remove_prefetch(std::string_view key) { return registry_.remove_prefetch(key); }

  /// Runs every prefetch on `tensor` (attach calls this for a queued delivery): key and
  /// device tensor for each that produced one. One that throws is left out.
  [[nodiscard]] std::vector<std::pair<std::string, at::Tensor>> run_prefetches(
      std::string_view layer, const at::Tensor& tensor, bool is_forward, const Metadata& metadata) const {
    return registry_.run_prefetches(layer, tensor, is_forward, metadata);
  }

  /// Removes a hook and returns its configuration, or nullopt for an unknown id.
  std::optional<HookConfig> remove_hook(const HookId& id);

  /// Removes every hook (and with them their statistics).
  void clear_hooks();

  /// Enables or disables one hook; throws torchdbg::Error for an unknown id.
  void set_hook_enabled(const HookId& id, bool enabled);

  /// Enables or disables every hook at once (execute_hooks returns nothing while disabled).
  void set_enabled(bool enabled);
  [[nodiscard]] bool enabled() const noexcept { return enabled_.load(); }

  [[nodiscard]] std::optional<HookConfig> get_hook(const HookId& id) const { return registry_.get(id); }

  /// Every hook, in the order they run (priority, then registration; see HookConfig).
  [[nodiscard]] std::vector<std::pair<HookId, HookConfig>> get_all_hooks() const;

  [[nodiscard]] std::optional<HookStats> get_hook_stats(const HookId& id) const;

  [[nodiscard]] std::vector<std::pair<HookId, HookStats>> get_all_stats() const;

  [[nodiscard]] std::size_t hook_count() const { return registry_.snapshot()->size(); }

  /// Every forward call of layers matching `patterns`: TensorInspector statistics and
  /// ActivationVisualizer records.
  HookId create_tensor_inspection_hook(std::vector<std::string> patterns);

  /// Every backward call of layers matching `patterns`: gradient history with vanishing and
  /// exploding alerts.
  HookId create_gradient_tracking_hook(std::vector<std::string> patterns);

  /// An alert with `message` whenever `condition` holds (at most one per step).
  HookId create_alert_hook(HookCondition condition, std::string message,
                           AlertSeverity severity = AlertSeverity::Warning);

  // ---- observers of the manager (attached models) ----------------------------------------

  /// When a listener is called: just before or just after a change of which hooks are due
  /// (Before/After), or after `set_loss` (Loss) or `set_gradient_norm` (GradientNorm, which
  /// attached models report at the end of each backward pass with hooks due).
  /// Before/After: a change of which hooks are due (see add_listener); Loss: set_loss;
  /// GradientNorm: set_gradient_norm (an attached backward pass's norm); BackwardEnd:
  /// backward_ended (an attached backward pass ended, norms computed or not); BackwardFailed:
  /// backward_failed (an attached backward pass threw before its end).
  enum class Change { Before, After, Loss, GradientNorm, BackwardEnd, BackwardFailed };
  using Listener = std::function<void(Change)>;

  /// Calls `listener` (without locks held) just before and just after every change that can
  /// alter which hooks are due: set_step, set_enabled, registering, removing, enabling or
  /// clearing hooks. Attached models use it to deliver what belongs to the old state first and
  /// to switch their observers on only when a hook could fire. Returns an id for
  /// `remove_listener`.
  uint64_t add_listener(Listener listener) { return state_.add_listener(std::move(listener)); }
  void remove_listener(uint64_t id) { state_.remove_listener(id); }

  /// Whether some hook could fire for a call in this direction at `step`, judged without a
  /// tensor: false when every hook is disabled, exhausted, or due only in the other direction
  /// or at other steps. Conditional and layer-specific hooks count as possibly due.
  [[nodiscard]] bool may_fire(bool is_forward, int64_t step) const;

  /// Whether a hook that may fire for a call in this direction at `step` reads the sign
  /// counts of the statistics (zero/negative/positive counts, L1 norm, sparsity):
  /// inspect_tensor, record_activations and callbacks registered with CallbackStats::Full
  /// (the default, and any name not registered yet) do; track_gradients, alerts, snapshots
  /// and pauses do not. Attach computes the statistics it shares with the hooks with or
  /// without them accordingly. Either way every hook sees correct values: stats() computes
  /// what is missing (a second pass), so this only decides the cost.
  [[nodiscard]] bool reads_sign_counts(bool is_forward, int64_t step) const;

  // ---- training state -------------------------------------------------------------------

  /// Moves to `step`. A new step has no loss yet: the loss reported for the previous step is
  /// cleared (loss conditions are false until `set_loss`), so a forward pass never sees the
  /// last step's loss as its own.
  void set_step(int64_t step) { state_.set_step(step); }
  void set_loss(double loss) { state_.set_loss(loss); }
  /// An attached backward pass threw before its end (attach calls this; LibTorch drops the
  /// pass's final callbacks): listeners forget what they gathered for that pass, e.g. the
  /// health monitor its gradients, so the next pass is judged on its own.
  void backward_failed() { state_.notify(Change::BackwardFailed); }
  /// An attached backward pass ended (attach calls this after its norm, if any).
  void backward_ended() { state_.notify(Change::BackwardEnd); }

  void set_gradient_norm(double norm) { state_.set_gradient_norm(norm); }
  /// The gradient norm: in a GradientNorm listener, the one being reported on this thread
  /// (when several threads' passes end at once, state() may already hold another's);
  /// elsewhere, state().gradient_norm.
  [[nodiscard]] std::optional<double> reported_gradient_norm() const { return state_.reported_norm(); }
  /// Moves to step() + 1 as set_step does; concurrent calls (several threads' backward
  /// passes with `auto_step`) each move one step.
  void advance_step() { state_.advance(); }

  void set_memory_mb(double mb) { state_.set_memory_mb(mb); }
  [[nodiscard]] TrainingState state() const { return state_.state(); }
  [[nodiscard]] int64_t step() const { return state().step; }

  // ---- execution ------------------------------------------------------------------------

  /// Runs the hooks that match `layer_name` on `tensor` (any device, dtype and strides).
  /// Never throws for anything a hook does or for bad data: see the class comment.
  /// `precomputed`: statistics of `tensor` the caller already has (from compute_stats),
  /// used instead of computing them again; `prefetched`: the values of this manager's
  /// prefetches for `tensor` (see add_prefetch).
  Results execute_hooks(std::string_view layer_name, const at::Tensor& tensor, bool is_forward,
                        const Metadata& metadata = {}, const TensorStats* precomputed = nullptr,
                        const Prefetched* prefetched = nullptr);

  /// Raw-data form: `size` elements of T at `data` laid out with `shape`. A size/shape
  /// mismatch gives each matching hook an error result naming both.
  template <typename T>
  Results execute_hooks(std::string_view layer_name, const T* data, std::size_t size,
                        c10::IntArrayRef shape, bool is_forward, const Metadata& metadata = {}) {
    at::Tensor t;
    std::optional<std::string> input_error;
    try {
      t = tensor_view(data, size, shape);
    } catch (const std::exception& e) {
      input_error = e.what();
    }
    Results out;
    if (enabled_.load(std::memory_order_relaxed))
      executor_.run_all(layer_name, t, is_forward, metadata, input_error, nullptr, nullptr, &out);
    return out;
  }

  template <typename T>
  Results execute_hooks(std::string_view layer_name, const std::vector<T>& data,
                        c10::IntArrayRef shape, bool is_forward, const Metadata& metadata = {}) {
    return execute_hooks(layer_name, data.data(), data.size(), shape, is_forward, metadata);
  }

  // ---- pause ----------------------------------------------------------------------------

  /// The flag PauseTraining sets; share it with whatever polls between steps.
  [[nodiscard]] std::shared_ptr<std::atomic<bool>> pause_flag() const noexcept { return log_.pause_flag(); }
  [[nodiscard]] bool is_paused() const noexcept { return log_.pause_flag()->load(); }
  /// Why the current pause was raised (the first request wins until resumed).
  [[nodiscard]] std::optional<PauseInfo> pause_info() const { return log_.pause_info(); }
  /// Raises the pause flag from the loop or any thread.
  void pause_training(std::string reason);
  /// Raises the pause flag for a finding about `layer` at `step`, made by `source` (the
  /// health monitor pauses this way: pause_info() names the layer and "torchdbg.health").
  void pause_training(std::string reason, std::string layer, int64_t at_step, std::string source);
  /// Clears the pause flag and its reason.
  void resume_training() { log_.resume(); }

  // ---- alerts and errors ----------------------------------------------------------------

  /// The alert log, oldest first (bounded by alert_capacity).
  [[nodiscard]] std::vector<Alert> alerts() const { return log_.alerts(); }
  /// The options the manager was made with.
  [[nodiscard]] const HookManagerOptions& options() const noexcept { return options_; }

  /// Raises a warning that no hook made (torchdbg's own advice, e.g. attach noticing that no
  /// gradient arrives): an Alert with `hook_name` = `source`, at the current step, in the log
  /// and to the sink.
  void warn(std::string source, std::string message);

  /// Alerts raised since construction (or clear_alerts), including dropped ones.
  [[nodiscard]] uint64_t alert_count() const { return log_.count(); }
  void clear_alerts() { log_.clear(); }
  /// Also forwards every alert to `sink` (called without locks held; an exception from it
  /// becomes the hook's error result).
  void set_alert_sink(AlertSink sink) { log_.set_sink(std::move(sink)); }
  /// Called for each error result (without locks held; its own exceptions are swallowed).
  void set_error_handler(ErrorHandler handler) { log_.set_error_handler(std::move(handler)); }

 private:
  template <typename>
  friend class BasicAttachSession;  // delivers through run_checked without wanting results

  /// execute_hooks for a tensor without results when `out` is null (attach's deliveries).
  void run_checked(std::string_view layer, const at::Tensor& tensor, bool is_forward,
                   const Metadata& metadata, const TensorStats* precomputed,
                   const Prefetched* prefetched, Results* out, const detail::DeliveryFacts* facts = nullptr) {
    if (enabled_.load(std::memory_order_relaxed))
      executor_.run_checked(layer, tensor, is_forward, metadata, precomputed, prefetched, out, facts);
  }
  static HookManagerOptions checked(HookManagerOptions o) {
    if (o.sampling().stride() < 1)
      throw Error("torchdbg: HookManagerOptions::sampling stride must be at least 1, got " +
                  std::to_string(o.sampling().stride()));
    if (o.sampling().above() < 0)
      throw Error("torchdbg: HookManagerOptions::sampling above must be at least 0, got " +
                  std::to_string(o.sampling().above()));
    return o;
  }
  HookManagerOptions options_;
  detail::HookRegistry<Mutex> registry_;
  detail::AlertLog<Mutex> log_;
  using State = detail::StepState<Mutex, Change>;
  State state_;
  detail::HookExecutor<Mutex, State> executor_;
  std::atomic<bool> enabled_{true};
  /// Attach sessions with gradients on this manager (at most one: see BasicAttachSession).
  std::atomic<int> attached_{0};
};

#if TORCHDBG_DEFINITIONS

template <typename Mutex>
BasicHookManager<Mutex>::~BasicHookManager() = default;

template <typename Mutex>
auto BasicHookManager<Mutex>::register_hook(HookConfig config) -> HookId {
  auto e = detail::HookRegistry<Mutex>::make_entry(std::move(config), options_.layer_match_cache());
  state_.notify(Change::Before);
  const HookId id = registry_.add(e);
  state_.notify(Change::After);
  return id;
}

template <typename Mutex>
void BasicHookManager<Mutex>::register_callback(std::string name, Callback callback,
                                                CallbackStats reads) {
  if (name.empty()) throw Error("torchdbg: register_callback needs a non-empty name");
  if (!callback) throw Error("torchdbg: callback '" + name + "' is empty");
  state_.notify(Change::Before);
  registry_.set_callback(std::move(name), std::move(callback), reads);
  state_.notify(Change::After);
}

template <typename Mutex>
bool BasicHookManager<Mutex>::remove_callback(std::string_view name) {
  state_.notify(Change::Before);
  const bool removed = registry_.remove_callback(name);
  state_.notify(Change::After);
  return removed;
}

template <typename Mutex>
auto BasicHookManager<Mutex>::remove_hook(const HookId& id) -> std::optional<HookConfig> {
  state_.notify(Change::Before);
  auto removed = registry_.remove(id);
  state_.notify(Change::After);
  return removed;
}

template <typename Mutex>
void BasicHookManager<Mutex>::clear_hooks() {
  state_.notify(Change::Before);
  registry_.clear();
  state_.notify(Change::After);
}

template <typename Mutex>
void BasicHookManager<Mutex>::set_hook_enabled(const HookId& id, bool enabled) {
  if (!registry_.get(id)) throw Error("torchdbg: no hook with id " + id.to_string());
  state_.notify(Change::Before);
  registry_.set_enabled(id, enabled);
  state_.notify(Change::After);
}

template <typename Mutex>
void BasicHookManager<Mutex>::set_enabled(bool enabled) {
  state_.notify(Change::Before);
  enabled_.store(enabled);
  state_.notify(Change::After);
}

template <typename Mutex>
auto BasicHookManager<Mutex>::get_all_hooks() const -> std::vector<std::pair<HookId, HookConfig>> {
  std::vector<std::pair<HookId, HookConfig>> out;
  const auto hooks = registry_.snapshot();  // keeps the list alive for the loop
  for (const auto& e : *hooks) out.emplace_back(e->id, e->current_config());
  return out;
}

template <typename Mutex>
auto BasicHookManager<Mutex>::get_hook_stats(const HookId& id) const -> std::optional<HookStats> {
  const auto hooks = registry_.snapshot();
  for (const auto& e : *hooks)
    if (e->id == id) return e->counters.stats();
  return std::nullopt;
}

template <typename Mutex>
auto BasicHookManager<Mutex>::get_all_stats() const -> std::vector<std::pair<HookId, HookStats>> {
  std::vector<std::pair<HookId, HookStats>> out;
  const auto hooks = registry_.snapshot();
  for (const auto& e : *hooks) out.emplace_back(e->id, e->counters.stats());
  return out;
}

template <typename Mutex>
auto BasicHookManager<Mutex>::create_tensor_inspection_hook(std::vector<std::string> patterns)
    -> HookId {
  return register_hook(
      HookConfig()
          .name("tensor_inspection")
          .trigger(HookTrigger::every_forward())
          .actions({HookAction::inspect_tensor(), HookAction::record_activations()})
          .layer_patterns(std::move(patterns)));
}

template <typename Mutex>
auto BasicHookManager<Mutex>::create_gradient_tracking_hook(std::vector<std::string> patterns)
    -> HookId {
  return register_hook(HookConfig()
                           .name("gradient_tracking")
                           .trigger(HookTrigger::every_backward())
                           .actions({HookAction::track_gradients()})
                           .layer_patterns(std::move(patterns)));
}

template <typename Mutex>
auto BasicHookManager<Mutex>::create_alert_hook(HookCondition condition, std::string message,
                                                AlertSeverity severity) -> HookId {
  return register_hook(HookConfig()
                           .name("alert: " + message)
                           .trigger(HookTrigger::conditional(std::move(condition)))
                           .actions({HookAction::alert(std::move(message), severity)}));
}

template <typename Mutex>
bool BasicHookManager<Mutex>::may_fire(bool is_forward, int64_t step) const {
  if (!enabled_.load()) return false;
  const auto hooks = registry_.snapshot();
  return detail::any_may_fire<Mutex>(*hooks, is_forward, step);
}

template <typename Mutex>
bool BasicHookManager<Mutex>::reads_sign_counts(bool is_forward, int64_t step) const {
  if (!enabled_.load()) return false;
  const auto hooks = registry_.snapshot();
  return detail::reads_signs<Mutex>(*hooks, registry_, is_forward, step);
}

template <typename Mutex>
auto BasicHookManager<Mutex>::execute_hooks(std::string_view layer_name, const at::Tensor& tensor,
                                            bool is_forward, const Metadata& metadata,
                                            const TensorStats* precomputed,
                                            const Prefetched* prefetched) -> Results {
  Results out;
  run_checked(layer_name, tensor, is_forward, metadata, precomputed, prefetched, &out);
  return out;
}

template <typename Mutex>
void BasicHookManager<Mutex>::pause_training(std::string reason) {
  PauseInfo info;
  info.step = step();
  info.reason = std::move(reason);
  log_.request_pause(std::move(info));
}

template <typename Mutex>
void BasicHookManager<Mutex>::pause_training(std::string reason, std::string layer, int64_t at_step,
                                             std::string source) {
  PauseInfo info;
  info.step = at_step;
  info.layer = std::move(layer);
  info.hook_name = std::move(source);
  info.reason = std::move(reason);
  log_.request_pause(std::move(info));
}

template <typename Mutex>
void BasicHookManager<Mutex>::warn(std::string source, std::string message) {
  Alert al;
  al.step = step();
  al.hook_name = std::move(source);
  al.message = std::move(message);
  al.severity = AlertSeverity::Warning;
  log_.push(std::move(al));
}

#endif  // TORCHDBG_DEFINITIONS

/// Thread-safe hook manager (the default).
using HookManager = BasicHookManager<std::mutex>;
/// Single-thread hook manager: no locking.
using HookManagerSt = BasicHookManager<detail::NullMutex>;

TORCHDBG_EXTERN_TEMPLATE(class BasicHookManager<std::mutex>)
TORCHDBG_EXTERN_TEMPLATE(class BasicHookManager<detail::NullMutex>)
TORCHDBG_EXTERN_TEMPLATE(class detail::StepState<std::mutex, HookManager::Change>)
TORCHDBG_EXTERN_TEMPLATE(class detail::StepState<detail::NullMutex, HookManagerSt::Change>)
TORCHDBG_EXTERN_TEMPLATE(class detail::HookExecutor<std::mutex, detail::StepState<std::mutex, HookManager::Change>>)
TORCHDBG_EXTERN_TEMPLATE(
    class detail::HookExecutor<detail::NullMutex, detail::StepState<detail::NullMutex, HookManagerSt::Change>>)

/// One line: the step, the hooks in execution order with their executions (the first eight),
/// the alerts raised and whether training runs (running, paused, disabled), e.g.
/// `HookManager(step 12, 2 hooks ["tensor_inspection" (12 runs), "log" (12 runs, 1 error)],
/// 3 alerts, paused at step 12 in "fc2": "loss exploded")`. Per-hook figures: `fmt::format("{}", *hooks.get_hook_stats(id))`.
template <typename Mutex>
std::string to_string(const BasicHookManager<Mutex>& m) {
  std::string s = std::is_same_v<Mutex, detail::NullMutex> ? "HookManagerSt" : "HookManager";
  const auto hooks = m.get_all_hooks();
  const auto stats = m.get_all_stats();  // a hook registered between the two reads has none
  s += fmt::format("(step {}, ", m.step()) + detail::count(hooks.size(), "hook");
  if (!hooks.empty()) {
    s += " [";
    const std::size_t shown = std::min<std::size_t>(hooks.size(), 8);
    for (std::size_t i = 0; i < shown; ++i) {
      std::string figures;
      for (const auto& [id, st] : stats) {
        if (id != hooks[i].first) continue;
        figures = detail::count(st.executions, "run");
        if (st.errors) figures += ", " + detail::count(st.errors, "error");
      }
      if (!hooks[i].second.enabled()) figures += figures.empty() ? "disabled" : ", disabled";
      s += (i ? ", " : "") + detail::quoted(hooks[i].second.name()) + (figures.empty() ? "" : " (" + figures + ")");
    }
    if (hooks.size() > shown) s += fmt::format(", and {} more", hooks.size() - shown);
    s += "]";
  }
  const uint64_t alerts = m.alert_count();
  s += ", " + detail::count(alerts, "alert");
  if (!m.enabled()) s += ", disabled";
  if (const auto p = m.pause_info(); p && m.is_paused()) {
    s += fmt::format(", paused at step {}", p->step);
    if (!p->layer.empty()) s += " in " + detail::quoted(p->layer);
    if (!p->reason.empty()) s += ": " + detail::quoted(p->reason);
  } else if (m.is_paused()) {
    s += ", paused";
  } else if (m.enabled()) {
    s += ", running";
  }
  return s + ")";
}

namespace detail {
template <typename Mutex>
struct Printable<BasicHookManager<Mutex>> : std::true_type {};
}  // namespace detail

}  // namespace torchdbg
