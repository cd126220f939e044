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
#include "torchdbg/detail/pattern.hpp"
#include "torchdbg/detail/ring_buffer.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/hook_condition.hpp"
#include "torchdbg/hook_config.hpp"
#include "torchdbg/hook_context.hpp"
#include "torchdbg/snapshot.hpp"
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
};

/// Why and where training was paused.
struct PauseInfo {
  int64_t step = 0;
  std::string layer;      ///< empty when paused by `pause_training(reason)`
  std::string hook_name;  ///< the hook, "torchdbg.health", or empty (`pause_training(reason)`)
  HookId hook_id;
  std::string reason;
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
        options_(std::move(options)),
        hooks_(std::make_shared<const HookList>()),
        alerts_(options_.alert_capacity()),
        pause_(std::make_shared<std::atomic<bool>>(false)) {}

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
  [[nodiscard]] bool has_callback(std::string_view name) const;

  /// Removes a callback; false if none was registered under `name`.
  bool remove_callback(std::string_view name);

  /// Computes, where `tensor` lives and without a host sync, values a consumer will want when
  /// the tensor's hooks run; returns a 1-D tensor on the tensor's device (any real dtype), or
  /// an undefined tensor for none.
  using Prefetch = std::function<at::Tensor(std::string_view layer, const at::Tensor& tensor,
                                            bool is_forward, const Metadata& metadata)>;

  /// Registers (or replaces) prefetch `key`. A delivery that attach queues (StatsBatching)
  /// runs every prefetch when it is queued; the values come to the host in the step's one
  /// copy and reach the hooks as `HookContext::prefetched(key)`. Deliveries run at once get
  /// none, so a consumer must also work without them.
  void add_prefetch(std::string key, Prefetch fn);

  /// Removes prefetch `key`; false if there was none.
  bool remove_prefetch(std::string_view key);

  /// Runs every prefetch on `tensor` (attach calls this for a queued delivery): key and
  /// device tensor for each that produced one. One that throws is left out.
  [[nodiscard]] std::vector<std::pair<std::string, at::Tensor>> run_prefetches(
      std::string_view layer, const at::Tensor& tensor, bool is_forward,
      const Metadata& metadata) const;

  /// Removes a hook and returns its configuration, or nullopt for an unknown id.
  std::optional<HookConfig> remove_hook(const HookId& id);

  /// Removes every hook (and with them their statistics).
  void clear_hooks();

  /// Enables or disables one hook; throws torchdbg::Error for an unknown id.
  void set_hook_enabled(const HookId& id, bool enabled);

  /// Enables or disables every hook at once (execute_hooks returns nothing while disabled).
  void set_enabled(bool enabled);
  [[nodiscard]] bool enabled() const noexcept { return enabled_.load(); }

  [[nodiscard]] std::optional<HookConfig> get_hook(const HookId& id) const;

  /// Every hook, in the order they run (priority, then registration; see HookConfig).
  [[nodiscard]] std::vector<std::pair<HookId, HookConfig>> get_all_hooks() const;

  [[nodiscard]] std::optional<HookStats> get_hook_stats(const HookId& id) const;

  [[nodiscard]] std::vector<std::pair<HookId, HookStats>> get_all_stats() const;

  [[nodiscard]] std::size_t hook_count() const { return snapshot()->size(); }

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
  uint64_t add_listener(Listener listener);
  void remove_listener(uint64_t id);

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
  void set_step(int64_t step);
  void set_loss(double loss);
  /// An attached backward pass threw before its end (attach calls this; LibTorch drops the
  /// pass's final callbacks): listeners forget what they gathered for that pass, e.g. the
  /// health monitor its gradients, so the next pass is judged on its own.
  void backward_failed() { notify(Change::BackwardFailed); }
  /// An attached backward pass ended (attach calls this after its norm, if any).
  void backward_ended() { notify(Change::BackwardEnd); }

  void set_gradient_norm(double norm);
  /// The gradient norm: in a GradientNorm listener, the one being reported on this thread
  /// (when several threads' passes end at once, state() may already hold another's);
  /// elsewhere, state().gradient_norm.
  [[nodiscard]] std::optional<double> reported_gradient_norm() const;
  /// Moves to step() + 1 as set_step does; concurrent calls (several threads' backward
  /// passes with `auto_step`) each move one step.
  void advance_step();

 private:
  template <typename Next>
  void change_step(Next next) {
    notify(Change::Before);
    {
      std::lock_guard<Mutex> lock(state_mutex_);
      const int64_t step = next(state_.step);
      if (state_.step != step) {
        state_.loss.reset();
        state_.loss_step.reset();
      }
      state_.step = step;
    }
    notify(Change::After);
  }
  static std::pair<const void*, double>& current();

 public:
  void set_memory_mb(double mb);
  [[nodiscard]] TrainingState state() const;
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
    run_all(layer_name, t, is_forward, metadata, input_error, nullptr, nullptr, &out);
    return out;
  }

  template <typename T>
  Results execute_hooks(std::string_view layer_name, const std::vector<T>& data,
                        c10::IntArrayRef shape, bool is_forward, const Metadata& metadata = {}) {
    return execute_hooks(layer_name, data.data(), data.size(), shape, is_forward, metadata);
  }

  // ---- pause ----------------------------------------------------------------------------

  /// The flag PauseTraining sets; share it with whatever polls between steps.
  [[nodiscard]] std::shared_ptr<std::atomic<bool>> pause_flag() const noexcept { return pause_; }
  [[nodiscard]] bool is_paused() const noexcept { return pause_->load(); }
  /// Why the current pause was raised (the first request wins until resumed).
  [[nodiscard]] std::optional<PauseInfo> pause_info() const;
  /// Raises the pause flag from the loop or any thread.
  void pause_training(std::string reason);
  /// Raises the pause flag for a finding about `layer` at `step`, made by `source` (the
  /// health monitor pauses this way: pause_info() names the layer and "torchdbg.health").
  void pause_training(std::string reason, std::string layer, int64_t at_step, std::string source);
  /// Clears the pause flag and its reason.
  void resume_training();

  // ---- alerts and errors ----------------------------------------------------------------

  /// The alert log, oldest first (bounded by alert_capacity).
  [[nodiscard]] std::vector<Alert> alerts() const;
  /// Raises a warning that no hook made (torchdbg's own advice, e.g. attach noticing that no
  /// gradient arrives): an Alert with `hook_name` = `source`, at the current step, in the log
  /// and to the sink.
  void warn(std::string source, std::string message);

  /// Alerts raised since construction (or clear_alerts), including dropped ones.
  [[nodiscard]] uint64_t alert_count() const;
  void clear_alerts();
  /// Also forwards every alert to `sink` (called without locks held; an exception from it
  /// becomes the hook's error result).
  void set_alert_sink(AlertSink sink);
  /// Called for each error result (without locks held; its own exceptions are swallowed).
  void set_error_handler(ErrorHandler handler);

 private:
  template <typename>
  friend class BasicAttachSession;  // delivers through run_checked without wanting results
  struct Entry {
    HookId id;
    HookConfig config;
    int64_t position = 0;  // among equal priorities: prepended hooks negative, appended positive
    std::vector<detail::Pattern> patterns;
    uint64_t limit = std::numeric_limits<uint64_t>::max();
    std::atomic<bool> enabled{true};
    std::atomic<uint64_t> claimed{0};
    std::atomic<uint64_t> executions{0}, errors{0}, skipped{0}, total_ns{0};
    std::atomic<int64_t> last_step{std::numeric_limits<int64_t>::min()};
    std::atomic<int64_t> last_alert_step{std::numeric_limits<int64_t>::min()};
    mutable Mutex cache_mutex;
    std::unordered_map<std::string, bool> match_cache;
    std::size_t cache_capacity = 4096;

    bool matches(std::string_view layer) {
      if (patterns.empty()) return true;
      std::lock_guard<Mutex> lock(cache_mutex);
      const std::string key(layer);
      auto it = match_cache.find(key);
      if (it != match_cache.end()) return it->second;
      bool hit = false;
      for (const auto& re : patterns) {
        if (re.search(key)) {
          hit = true;
          break;
        }
      }
      if (match_cache.size() >= cache_capacity) match_cache.clear();
      match_cache.emplace(key, hit);
      return hit;
    }

    /// Takes one of the `limit` executions; false when none is left.
    bool claim() {
      uint64_t cur = claimed.load();
      do {
        if (cur >= limit) return false;
      } while (!claimed.compare_exchange_weak(cur, cur + 1));
      return true;
    }

    HookStats stats() const {
      HookStats s;
      s.executions = executions.load();
      s.errors = errors.load();
      s.skipped = skipped.load();
      const int64_t ls = last_step.load();
      if (ls != std::numeric_limits<int64_t>::min()) s.last_step = ls;
      s.total_time_us = static_cast<double>(total_ns.load()) / 1000.0;
      return s;
    }
  };
  using HookList = std::vector<std::shared_ptr<Entry>>;
  using PrefetchList = std::vector<std::pair<std::string, Prefetch>>;

  static HookConfig current_config(const Entry& e);

  Entry* find_locked(const HookId& id) const;

  /// Whether a hook with config `c` sees calls in this direction (HookConfig::direction).
  static bool direction_matches(const HookConfig& c, bool is_forward) noexcept;

  /// Whether a hook with config `c` could fire for a call in this direction at `step`,
  /// judged without a tensor.
  static bool config_may_fire(const HookConfig& c, bool is_forward, int64_t step);

  /// Whether `t` could fire for a call in this direction at `step`, judged without a tensor.
  static bool trigger_may_fire(const HookTrigger& t, bool is_forward, int64_t step);

  bool reads_signs(const HookList& hooks, bool is_forward, int64_t step) const;

  std::shared_ptr<const HookList> snapshot() const;

  static std::string exception_text(const std::exception& e);

  /// Inspector key: the layer for forward data, "<layer>[.<parameter>]/grad" for gradients.
  static std::string inspection_key(const HookContext& ctx);

  static AlertSeverity severity_of(TensorAlertKind k) noexcept;

  /// execute_hooks for a tensor: checks it, then runs the hooks. `out` null: the results are
  /// not wanted (the attachment's deliveries), so skipped hooks build no message; counters,
  /// alerts and the error handler are the same.
  void run_checked(std::string_view layer, const at::Tensor& tensor, bool is_forward,
                   const Metadata& metadata, const TensorStats* precomputed,
                   const Prefetched* prefetched, Results* out);

  void run_all(std::string_view layer, const at::Tensor& tensor, bool is_forward,
               const Metadata& metadata, const std::optional<std::string>& input_error,
               const TensorStats* precomputed, const Prefetched* prefetched, Results* out);

  HookResult run_one(Entry& e, const HookContext& ctx,
                     const std::optional<std::string>& input_error, bool explain);

  HookResult fail(Entry& e, const HookContext& ctx, const std::string& message);

  /// Runs one action; returns a detail for the success message, throws on failure.
  std::string run_action(Entry& e, const HookAction& a, const HookContext& ctx);

  void add_alert(const Entry& e, const HookContext& ctx, AlertSeverity severity,
                 std::string message);

  /// Logs `al` (timed now) and hands it to the sink, without locks held.
  void push_alert(Alert al);

  void notify(Change change);

  void request_pause(PauseInfo info);

  HookManagerOptions options_;
  mutable Mutex mutex_;  // hooks_, callbacks_ and prefetches_
  std::shared_ptr<const HookList> hooks_;  // in execution order
  int64_t front_position_ = 0, back_position_ = 0;
  std::shared_ptr<const PrefetchList> prefetches_ = std::make_shared<const PrefetchList>();
  std::unordered_map<std::string, std::shared_ptr<const Callback>> callbacks_;
  std::unordered_set<std::string> moment_callbacks_;  // registered with CallbackStats::Moments
  std::atomic<bool> enabled_{true};
  /// Attach sessions with gradients on this manager (at most one: see BasicAttachSession).
  std::atomic<int> attached_{0};

  mutable Mutex state_mutex_;
  std::recursive_mutex advance_mutex_;  // advance_step's read and set_step, as one
  TrainingState state_;

  mutable Mutex listener_mutex_;
  uint64_t listener_seq_ = 0;
  std::shared_ptr<const std::vector<std::pair<uint64_t, Listener>>> listeners_ =
      std::make_shared<const std::vector<std::pair<uint64_t, Listener>>>();

  mutable Mutex alert_mutex_;  // alerts_, sinks, pause_info_
  detail::RingBuffer<Alert> alerts_;
  AlertSink alert_sink_;
  ErrorHandler error_handler_;
  std::shared_ptr<std::atomic<bool>> pause_;
  std::optional<PauseInfo> pause_info_;
};

#if TORCHDBG_DEFINITIONS

template <typename Mutex>
BasicHookManager<Mutex>::~BasicHookManager() = default;

template <typename Mutex>
auto BasicHookManager<Mutex>::register_hook(HookConfig config) -> HookId {
  auto e = std::make_shared<Entry>();
  for (const auto& p : config.layer_patterns()) {
    e->patterns.push_back(
        detail::compile_pattern(p, "layer pattern in hook '" + config.name() + "'"));
  }
  if (config.max_executions() && *config.max_executions() == 0) {
    throw Error("torchdbg: hook '" + config.name() + "' has max_executions 0 (it could never run)");
  }
  e->limit = config.max_executions().value_or(std::numeric_limits<uint64_t>::max());
  if (config.trigger().kind() == HookTrigger::Kind::Once)
    e->limit = std::min<uint64_t>(e->limit, 1);
  e->enabled.store(config.enabled());
  e->cache_capacity = options_.layer_match_cache();
  e->config = std::move(config);
  notify(Change::Before);
  {
    std::lock_guard<Mutex> lock(mutex_);
    do {
      e->id = HookId::generate();
    } while (find_locked(e->id) != nullptr);
    e->position = e->config.prepend() ? --front_position_ : ++back_position_;
    auto next = std::make_shared<HookList>(*hooks_);
    const auto runs_before = [](const std::shared_ptr<Entry>& a, const std::shared_ptr<Entry>& b) {
      if (a->config.priority() != b->config.priority())
        return a->config.priority() > b->config.priority();
      return a->position < b->position;
    };
    next->insert(std::upper_bound(next->begin(), next->end(), e, runs_before), e);
    hooks_ = std::move(next);
  }
  notify(Change::After);
  return e->id;
}

template <typename Mutex>
void BasicHookManager<Mutex>::register_callback(std::string name, Callback callback,
                                                CallbackStats reads) {
  if (name.empty()) throw Error("torchdbg: register_callback needs a non-empty name");
  if (!callback) throw Error("torchdbg: callback '" + name + "' is empty");
  notify(Change::Before);
  {
    std::lock_guard<Mutex> lock(mutex_);
    if (reads == CallbackStats::Moments) {
      moment_callbacks_.insert(name);
    } else {
      moment_callbacks_.erase(name);
    }
    callbacks_[std::move(name)] = std::make_shared<const Callback>(std::move(callback));
  }
  notify(Change::After);
}

template <typename Mutex>
bool BasicHookManager<Mutex>::has_callback(std::string_view name) const {
  std::lock_guard<Mutex> lock(mutex_);
  return callbacks_.count(std::string(name)) > 0;
}

template <typename Mutex>
bool BasicHookManager<Mutex>::remove_callback(std::string_view name) {
  notify(Change::Before);
  bool removed = false;
  {
    std::lock_guard<Mutex> lock(mutex_);
    moment_callbacks_.erase(std::string(name));
    removed = callbacks_.erase(std::string(name)) > 0;
  }
  notify(Change::After);
  return removed;
}

template <typename Mutex>
void BasicHookManager<Mutex>::add_prefetch(std::string key, Prefetch fn) {
  if (key.empty()) throw Error("torchdbg: add_prefetch needs a non-empty key");
  if (!fn) throw Error("torchdbg: prefetch '" + key + "' is empty");
  std::lock_guard<Mutex> lock(mutex_);
  auto next = std::make_shared<PrefetchList>();
  for (const auto& p : *prefetches_)
    if (p.first != key) next->push_back(p);
  next->emplace_back(std::move(key), std::move(fn));
  prefetches_ = std::move(next);
}

template <typename Mutex>
bool BasicHookManager<Mutex>::remove_prefetch(std::string_view key) {
  std::lock_guard<Mutex> lock(mutex_);
  auto next = std::make_shared<PrefetchList>();
  for (const auto& p : *prefetches_)
    if (p.first != key) next->push_back(p);
  const bool removed = next->size() != prefetches_->size();
  prefetches_ = std::move(next);
  return removed;
}

template <typename Mutex>
auto BasicHookManager<Mutex>::run_prefetches(std::string_view layer, const at::Tensor& tensor,
                                             bool is_forward, const Metadata& metadata) const
    -> std::vector<std::pair<std::string, at::Tensor>> {
  std::shared_ptr<const PrefetchList> list;
  {
    std::lock_guard<Mutex> lock(mutex_);
    list = prefetches_;
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [key, fn] : *list) {
    try {
      at::Tensor v = fn(layer, tensor, is_forward, metadata);
      if (v.defined()) out.emplace_back(key, v.reshape({-1}));
    } catch (...) {
    }
  }
  return out;
}

template <typename Mutex>
auto BasicHookManager<Mutex>::remove_hook(const HookId& id) -> std::optional<HookConfig> {
  std::optional<HookConfig> removed;
  notify(Change::Before);
  {
    std::lock_guard<Mutex> lock(mutex_);
    auto next = std::make_shared<HookList>();
    for (const auto& e : *hooks_) {
      if (e->id == id) {
        removed = current_config(*e);
      } else {
        next->push_back(e);
      }
    }
    if (removed) hooks_ = std::move(next);
  }
  notify(Change::After);
  return removed;
}

template <typename Mutex>
void BasicHookManager<Mutex>::clear_hooks() {
  notify(Change::Before);
  {
    std::lock_guard<Mutex> lock(mutex_);
    hooks_ = std::make_shared<const HookList>();
  }
  notify(Change::After);
}

template <typename Mutex>
void BasicHookManager<Mutex>::set_hook_enabled(const HookId& id, bool enabled) {
  if (!get_hook(id)) throw Error("torchdbg: no hook with id " + id.to_string());
  notify(Change::Before);
  {
    std::lock_guard<Mutex> lock(mutex_);
    Entry* e = find_locked(id);
    if (e != nullptr) e->enabled.store(enabled);
  }
  notify(Change::After);
}

template <typename Mutex>
void BasicHookManager<Mutex>::set_enabled(bool enabled) {
  notify(Change::Before);
  enabled_.store(enabled);
  notify(Change::After);
}

template <typename Mutex>
auto BasicHookManager<Mutex>::get_hook(const HookId& id) const -> std::optional<HookConfig> {
  std::lock_guard<Mutex> lock(mutex_);
  const Entry* e = find_locked(id);
  if (e == nullptr) return std::nullopt;
  return current_config(*e);
}

template <typename Mutex>
auto BasicHookManager<Mutex>::get_all_hooks() const -> std::vector<std::pair<HookId, HookConfig>> {
  std::vector<std::pair<HookId, HookConfig>> out;
  const auto hooks = snapshot();  // keeps the list alive for the loop
  for (const auto& e : *hooks) out.emplace_back(e->id, current_config(*e));
  return out;
}

template <typename Mutex>
auto BasicHookManager<Mutex>::get_hook_stats(const HookId& id) const -> std::optional<HookStats> {
  const auto hooks = snapshot();  // keeps the list alive for the loop
  for (const auto& e : *hooks)
    if (e->id == id) return e->stats();
  return std::nullopt;
}

template <typename Mutex>
auto BasicHookManager<Mutex>::get_all_stats() const -> std::vector<std::pair<HookId, HookStats>> {
  std::vector<std::pair<HookId, HookStats>> out;
  const auto hooks = snapshot();  // keeps the list alive for the loop
  for (const auto& e : *hooks) out.emplace_back(e->id, e->stats());
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
uint64_t BasicHookManager<Mutex>::add_listener(Listener listener) {
  std::lock_guard<Mutex> lock(listener_mutex_);
  const uint64_t id = ++listener_seq_;
  auto next = std::make_shared<std::vector<std::pair<uint64_t, Listener>>>(*listeners_);
  next->emplace_back(id, std::move(listener));
  listeners_ = std::move(next);
  return id;
}

template <typename Mutex>
void BasicHookManager<Mutex>::remove_listener(uint64_t id) {
  std::lock_guard<Mutex> lock(listener_mutex_);
  auto next = std::make_shared<std::vector<std::pair<uint64_t, Listener>>>();
  for (const auto& l : *listeners_)
    if (l.first != id) next->push_back(l);
  listeners_ = std::move(next);
}

template <typename Mutex>
bool BasicHookManager<Mutex>::may_fire(bool is_forward, int64_t step) const {
  if (!enabled_.load()) return false;
  const auto hooks = snapshot();  // keeps the list alive for the loop
  for (const auto& e : *hooks) {
    if (!e->enabled.load() || e->claimed.load() >= e->limit) continue;
    if (config_may_fire(e->config, is_forward, step)) return true;
  }
  return false;
}

template <typename Mutex>
bool BasicHookManager<Mutex>::reads_sign_counts(bool is_forward, int64_t step) const {
  if (!enabled_.load()) return false;
  const auto hooks = snapshot();
  return reads_signs(*hooks, is_forward, step);
}

template <typename Mutex>
void BasicHookManager<Mutex>::set_step(int64_t step) {
  change_step([step](int64_t) { return step; });
}

template <typename Mutex>
void BasicHookManager<Mutex>::set_loss(double loss) {
  {
    std::lock_guard<Mutex> lock(state_mutex_);
    state_.loss = loss;
    state_.loss_step = state_.step;
  }
  notify(Change::Loss);
}

template <typename Mutex>
void BasicHookManager<Mutex>::set_gradient_norm(double norm) {
  {
    std::lock_guard<Mutex> lock(state_mutex_);
    state_.gradient_norm = norm;
  }
  // The norm this thread reports, for its listeners (another thread's pass may end meanwhile).
  struct Reporting {
    Reporting(const void* m, double n) : saved(current()) { current() = {m, n}; }
    ~Reporting() { current() = saved; }
    std::pair<const void*, double> saved;
  } reporting(this, norm);
  notify(Change::GradientNorm);
}

template <typename Mutex>
auto BasicHookManager<Mutex>::reported_gradient_norm() const -> std::optional<double> {
  if (current().first == this) return current().second;
  return state().gradient_norm;
}

template <typename Mutex>
void BasicHookManager<Mutex>::advance_step() {
  std::lock_guard<std::recursive_mutex> lock(advance_mutex_);
  // The next step is read after the Before listeners, which may end a queued pass that
  // advances first (auto_step with StatsBatching::All).
  change_step([](int64_t current) { return current + 1; });
}

template <typename Mutex>
auto BasicHookManager<Mutex>::current() -> std::pair<const void*, double>& {
  thread_local std::pair<const void*, double> c{nullptr, 0.0};
  return c;
}

template <typename Mutex>
void BasicHookManager<Mutex>::set_memory_mb(double mb) {
  std::lock_guard<Mutex> lock(state_mutex_);
  state_.memory_mb = mb;
}

template <typename Mutex>
auto BasicHookManager<Mutex>::state() const -> TrainingState {
  std::lock_guard<Mutex> lock(state_mutex_);
  return state_;
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
auto BasicHookManager<Mutex>::pause_info() const -> std::optional<PauseInfo> {
  std::lock_guard<Mutex> lock(alert_mutex_);
  return pause_info_;
}

template <typename Mutex>
void BasicHookManager<Mutex>::pause_training(std::string reason) {
  PauseInfo info;
  info.step = step();
  info.reason = std::move(reason);
  request_pause(std::move(info));
}

template <typename Mutex>
void BasicHookManager<Mutex>::pause_training(std::string reason, std::string layer, int64_t at_step,
                                             std::string source) {
  PauseInfo info;
  info.step = at_step;
  info.layer = std::move(layer);
  info.hook_name = std::move(source);
  info.reason = std::move(reason);
  request_pause(std::move(info));
}

template <typename Mutex>
void BasicHookManager<Mutex>::resume_training() {
  std::lock_guard<Mutex> lock(alert_mutex_);
  pause_info_.reset();
  pause_->store(false);
}

template <typename Mutex>
auto BasicHookManager<Mutex>::alerts() const -> std::vector<Alert> {
  std::lock_guard<Mutex> lock(alert_mutex_);
  return alerts_.to_vector();
}

template <typename Mutex>
void BasicHookManager<Mutex>::warn(std::string source, std::string message) {
  Alert al;
  al.step = step();
  al.hook_name = std::move(source);
  al.message = std::move(message);
  al.severity = AlertSeverity::Warning;
  push_alert(std::move(al));
}

template <typename Mutex>
uint64_t BasicHookManager<Mutex>::alert_count() const {
  std::lock_guard<Mutex> lock(alert_mutex_);
  return alerts_.total_pushed();
}

template <typename Mutex>
void BasicHookManager<Mutex>::clear_alerts() {
  std::lock_guard<Mutex> lock(alert_mutex_);
  alerts_ = detail::RingBuffer<Alert>(options_.alert_capacity());
}

template <typename Mutex>
void BasicHookManager<Mutex>::set_alert_sink(AlertSink sink) {
  std::lock_guard<Mutex> lock(alert_mutex_);
  alert_sink_ = std::move(sink);
}

template <typename Mutex>
void BasicHookManager<Mutex>::set_error_handler(ErrorHandler handler) {
  std::lock_guard<Mutex> lock(alert_mutex_);
  error_handler_ = std::move(handler);
}

template <typename Mutex>
auto BasicHookManager<Mutex>::current_config(const Entry& e) -> HookConfig {
  HookConfig c = e.config;
  c.enabled(e.enabled.load());
  return c;
}

template <typename Mutex>
auto BasicHookManager<Mutex>::find_locked(const HookId& id) const -> Entry* {
  for (const auto& e : *hooks_)
    if (e->id == id) return e.get();
  return nullptr;
}

template <typename Mutex>
bool BasicHookManager<Mutex>::direction_matches(const HookConfig& c, bool is_forward) noexcept {
  switch (c.direction()) {
    case CallDirection::Forward:
      return is_forward;
    case CallDirection::Backward:
      return !is_forward;
    default:
      return true;
  }
}

template <typename Mutex>
bool BasicHookManager<Mutex>::config_may_fire(const HookConfig& c, bool is_forward, int64_t step) {
  return direction_matches(c, is_forward) && trigger_may_fire(c.trigger(), is_forward, step);
}

template <typename Mutex>
bool BasicHookManager<Mutex>::trigger_may_fire(const HookTrigger& t, bool is_forward,
                                               int64_t step) {
  switch (t.kind()) {
    case HookTrigger::Kind::EveryForward:
      return is_forward;
    case HookTrigger::Kind::EveryBackward:
      return !is_forward;
    case HookTrigger::Kind::EveryNSteps:
      return step % t.interval() == 0;
    default:
      return true;
  }
}

template <typename Mutex>
bool BasicHookManager<Mutex>::reads_signs(const HookList& hooks, bool is_forward,
                                          int64_t step) const {
  for (const auto& e : hooks) {
    if (!e->enabled.load() || e->claimed.load() >= e->limit) continue;
    if (!config_may_fire(e->config, is_forward, step)) continue;
    for (const auto& a : e->config.actions()) {
      if (a.kind == HookAction::Kind::InspectTensor ||
          a.kind == HookAction::Kind::RecordActivations)
        return true;
      if (a.kind == HookAction::Kind::CustomCallback) {
        std::lock_guard<Mutex> lock(mutex_);
        if (moment_callbacks_.count(a.text) == 0) return true;
      }
    }
  }
  return false;
}

template <typename Mutex>
auto BasicHookManager<Mutex>::snapshot() const -> std::shared_ptr<const HookList> {
  std::lock_guard<Mutex> lock(mutex_);
  return hooks_;
}

template <typename Mutex>
std::string BasicHookManager<Mutex>::exception_text(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

template <typename Mutex>
std::string BasicHookManager<Mutex>::inspection_key(const HookContext& ctx) {
  std::string key(ctx.layer_name());
  if (ctx.is_forward()) return key;
  if (auto p = ctx.metadata_value("parameter")) key += "." + std::string(*p);
  return key + "/grad";
}

template <typename Mutex>
auto BasicHookManager<Mutex>::severity_of(TensorAlertKind k) noexcept -> AlertSeverity {
  return (k == TensorAlertKind::NaN || k == TensorAlertKind::Inf) ? AlertSeverity::Error
                                                                  : AlertSeverity::Warning;
}

template <typename Mutex>
void BasicHookManager<Mutex>::run_checked(std::string_view layer, const at::Tensor& tensor,
                                          bool is_forward, const Metadata& metadata,
                                          const TensorStats* precomputed,
                                          const Prefetched* prefetched, Results* out) {
  std::optional<std::string> input_error;
  if (!tensor.defined()) {
    input_error = "torchdbg: execute_hooks got an undefined tensor";
  } else {
    try {
      detail::check_supported_dtype(tensor.scalar_type());
    } catch (const std::exception& e) {
      input_error = e.what();
    }
  }
  run_all(layer, tensor, is_forward, metadata, input_error, precomputed, prefetched, out);
}

template <typename Mutex>
void BasicHookManager<Mutex>::run_all(std::string_view layer, const at::Tensor& tensor,
                                      bool is_forward, const Metadata& metadata,
                                      const std::optional<std::string>& input_error,
                                      const TensorStats* precomputed, const Prefetched* prefetched,
                                      Results* out) {
  if (!enabled_.load(std::memory_order_relaxed)) return;
  const std::shared_ptr<const HookList> hooks = snapshot();
  if (hooks->empty()) return;
  HookContext ctx(layer, is_forward, state(), metadata, tensor, input_error ? nullptr : precomputed,
                  prefetched);
  // A hook reading moment_stats() first computes the sign counts too when a later one will
  // read stats(): one pass, not two.
  if ((precomputed == nullptr || !precomputed->sign_counts) && !input_error)
    ctx.sign_counts_wanted_ = reads_signs(*hooks, is_forward, ctx.step());
  for (const auto& e : *hooks) {
    if (!e->enabled.load(std::memory_order_relaxed)) continue;
    if (!direction_matches(e->config, is_forward)) continue;  // not this hook's calls
    bool match = false;
    try {
      match = e->matches(layer);
    } catch (const std::exception& ex) {
      HookResult r = fail(*e, ctx, "layer pattern: " + exception_text(ex));
      if (out) out->emplace_back(e->id, std::move(r));
      continue;
    }
    if (!match) continue;
    HookResult r = run_one(*e, ctx, input_error, out != nullptr);
    if (out) out->emplace_back(e->id, std::move(r));
  }
}

template <typename Mutex>
auto BasicHookManager<Mutex>::run_one(Entry& e, const HookContext& ctx,
                                      const std::optional<std::string>& input_error, bool explain)
    -> HookResult {
  if (input_error) return fail(e, ctx, *input_error);
  std::chrono::steady_clock::time_point t0;  // read only when the actions run
  bool executed = false;
  std::optional<HookResult> result;
  try {
    if (!e.config.trigger().is_due(ctx)) {
      result = HookResult::skipped(
          explain ? "trigger not due (" + e.config.trigger().describe() + ")" : std::string());
    } else if (!e.claim()) {
      result = HookResult::skipped(
          explain ? "max_executions (" + std::to_string(e.limit) + ") reached" : std::string());
    } else {
      executed = true;
      t0 = std::chrono::steady_clock::now();
      std::string details;
      for (const auto& action : e.config.actions()) {
        std::string d = run_action(e, action, ctx);
        if (!d.empty()) details += (details.empty() ? "" : "; ") + d;
      }
      result = HookResult::success(std::move(details));
    }
  } catch (const std::exception& ex) {
    result = HookResult::error(exception_text(ex));
  } catch (...) {
    result = HookResult::error("unknown exception");
  }
  if (executed) {
    const auto ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    e.total_ns.fetch_add(static_cast<uint64_t>(ns));
    e.executions.fetch_add(1);
    e.last_step.store(ctx.step());
  }
  if (result->is_skipped()) e.skipped.fetch_add(1);
  if (result->is_error()) return fail(e, ctx, result->message());
  return std::move(*result);
}

template <typename Mutex>
auto BasicHookManager<Mutex>::fail(Entry& e, const HookContext& ctx, const std::string& message)
    -> HookResult {
  e.errors.fetch_add(1);
  ErrorHandler handler;
  {
    std::lock_guard<Mutex> lock(alert_mutex_);
    handler = error_handler_;
  }
  if (handler) {
    try {
      handler(HookError{e.id, e.config.name(), std::string(ctx.layer_name()), ctx.step(), message});
    } catch (...) {
      // The handler is the last stop for errors; its own failure must not reach the loop.
    }
  }
  return HookResult::error(message);
}

template <typename Mutex>
std::string BasicHookManager<Mutex>::run_action(Entry& e, const HookAction& a,
                                                const HookContext& ctx) {
  using K = HookAction::Kind;
  switch (a.kind) {
    case K::InspectTensor: {
      const bool with_dist = inspector.should_sample_distribution();
      const TensorStats& s = with_dist
                                 ? ctx.stats_with_distribution(inspector.options().histogram_bins())
                                 : ctx.stats();
      const auto rec =
          inspector.record(inspection_key(ctx), s, ctx.step(), !ctx.is_forward(), &ctx.tensor());
      for (const auto& al : rec.alerts) add_alert(e, ctx, severity_of(al.kind), al.message);
      return {};
    }
    case K::TrackGradients: {
      for (const auto& al :
           inspector.track_gradient(inspection_key(ctx), ctx.moment_stats(), ctx.step()))
        add_alert(e, ctx, severity_of(al.kind), al.message);
      return {};
    }
    case K::RecordActivations: {
      visualizer.record(inspection_key(ctx), ctx.step(),
                        ctx.stats_with_distribution(visualizer.options().histogram_bins()),
                        ctx.tensor());
      return {};
    }
    case K::SaveSnapshot: {
      detail::ensure_directory(a.text);
      const std::string path =
          a.text + "/" + snapshot_file_name(ctx.layer_name(), ctx.step(), ctx.is_forward());
      save_snapshot(ctx.tensor(), path);
      return "saved " + path;
    }
    case K::Alert: {
      // One entry per hook and step: a loss condition would otherwise log once per layer.
      int64_t prev = e.last_alert_step.load();
      if (prev == ctx.step() || !e.last_alert_step.compare_exchange_strong(prev, ctx.step())) {
        return "alert already raised at step " + std::to_string(ctx.step());
      }
      add_alert(e, ctx, a.severity, a.text);
      return {};
    }
    case K::CustomCallback: {
      std::shared_ptr<const Callback> cb;
      {
        std::lock_guard<Mutex> lock(mutex_);
        auto it = callbacks_.find(a.text);
        if (it != callbacks_.end()) cb = it->second;
      }
      if (!cb) throw Error("torchdbg: no callback registered under '" + a.text + "'");
      (*cb)(ctx);
      return {};
    }
    case K::PauseTraining: {
      PauseInfo info;
      info.step = ctx.step();
      info.layer = std::string(ctx.layer_name());
      info.hook_name = e.config.name();
      info.hook_id = e.id;
      info.reason = a.text.empty() ? "hook '" + e.config.name() + "'" : a.text;
      request_pause(std::move(info));
      return "paused";
    }
  }
  return {};
}

template <typename Mutex>
void BasicHookManager<Mutex>::add_alert(const Entry& e, const HookContext& ctx,
                                        AlertSeverity severity, std::string message) {
  Alert al;
  al.step = ctx.step();
  al.layer = std::string(ctx.layer_name());
  al.hook_name = e.config.name();
  al.hook_id = e.id;
  al.message = std::move(message);
  al.severity = severity;
  push_alert(std::move(al));
}

template <typename Mutex>
void BasicHookManager<Mutex>::push_alert(Alert al) {
  al.time = std::chrono::system_clock::now();
  AlertSink sink;
  {
    std::lock_guard<Mutex> lock(alert_mutex_);
    alerts_.push(al);
    sink = alert_sink_;
  }
  if (sink) sink(al);
}

template <typename Mutex>
void BasicHookManager<Mutex>::notify(Change change) {
  std::shared_ptr<const std::vector<std::pair<uint64_t, Listener>>> ls;
  {
    std::lock_guard<Mutex> lock(listener_mutex_);
    ls = listeners_;
  }
  for (const auto& l : *ls) l.second(change);
}

template <typename Mutex>
void BasicHookManager<Mutex>::request_pause(PauseInfo info) {
  std::lock_guard<Mutex> lock(alert_mutex_);
  if (!pause_->load()) pause_info_ = std::move(info);
  pause_->store(true);
}

#endif  // TORCHDBG_DEFINITIONS

/// Thread-safe hook manager (the default).
using HookManager = BasicHookManager<std::mutex>;
/// Single-thread hook manager: no locking.
using HookManagerSt = BasicHookManager<detail::NullMutex>;

TORCHDBG_EXTERN_TEMPLATE(class BasicHookManager<std::mutex>)
TORCHDBG_EXTERN_TEMPLATE(class BasicHookManager<detail::NullMutex>)

/// One line: the step, the hooks in execution order with their executions (the first eight),
/// the alerts raised and whether training runs, e.g. `HookManager(step 12, 2 hooks
/// ["tensor_inspection" 12 runs, "log" 12 runs, 1 error], 3 alerts, paused at step 12 in
/// "fc2": "loss exploded")`. Per-hook figures: `fmt::format("{}", *hooks.get_hook_stats(id))`.
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
      s += (i ? ", " : "") + detail::quoted(hooks[i].second.name());
      for (const auto& [id, st] : stats) {
        if (id != hooks[i].first) continue;
        s += " " + detail::count(st.executions, "run");
        if (st.errors) s += ", " + detail::count(st.errors, "error");
      }
      if (!hooks[i].second.enabled()) s += " (disabled)";
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
  } else {
    s += ", running";
  }
  return s + ")";
}

namespace detail {
template <typename Mutex>
struct Printable<BasicHookManager<Mutex>> : std::true_type {};
}  // namespace detail

}  // namespace torchdbg
