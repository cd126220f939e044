// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The health monitor: what the observer delivers goes through its core (health/core.hpp)
// under one lock; its installation on a HookManager; the step sinks and pause callbacks.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/detail/mutex.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/health/core.hpp"
#include "torchdbg/health/options.hpp"
#include "torchdbg/health/pauses.hpp"
#include "torchdbg/health/records.hpp"
#include "torchdbg/health/rules.hpp"
#include "torchdbg/hook_manager.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg {

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
                     HookId hook, std::optional<HookId> activation_hook, std::string callback,
                     uint64_t listener, uint64_t pause_token)
      : mgr_(mgr),
        monitor_(monitor),
        hook_(std::move(hook)),
        activation_hook_(std::move(activation_hook)),
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
      activation_hook_ = std::move(o.activation_hook_);
      callback_ = std::move(o.callback_);
      listener_ = o.listener_;
      pause_token_ = o.pause_token_;
      o.mgr_ = nullptr;
      o.monitor_ = nullptr;
    }
    return *this;
  }
  ~HealthInstallation() { remove(); }

  /// The manager's hook that feeds the monitor (forward outputs too, unless
  /// HealthOptions::activation_interval is above 1 or activation_budget is set).
  [[nodiscard]] const HookId& hook_id() const noexcept { return hook_; }
  /// With HealthOptions::activation_interval above 1 or activation_budget, the hook that feeds
  /// forward outputs ("torchdbg.health.activations", every `interval * activation_interval`
  /// steps, or on those the budget chooses) while hook_id()'s feeds gradients only; otherwise
  /// empty.
  [[nodiscard]] const std::optional<HookId>& activation_hook_id() const noexcept {
    return activation_hook_;
  }
  [[nodiscard]] bool installed() const noexcept { return mgr_ != nullptr; }

  void remove() noexcept;

 private:
  friend class BasicHealthMonitor<Mutex>;
  /// Connects `monitor` to `hooks` (BasicHealthMonitor::install).
  static HealthInstallation connect(BasicHealthMonitor<Mutex>& monitor,
                                    BasicHookManager<ManagerMutex>& hooks);

  BasicHookManager<ManagerMutex>* mgr_ = nullptr;
  BasicHealthMonitor<Mutex>* monitor_ = nullptr;
  HookId hook_;
  std::optional<HookId> activation_hook_;
  std::string callback_;
  uint64_t listener_ = 0;
  uint64_t pause_token_ = 0;
};

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
  using PauseFn = detail::PauseCallbacks::PauseFn;

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
  [[nodiscard]] uint64_t rule_errors() const {
    return query([](const detail::HealthCore& c) { return c.rule_errors(); });
  }
  /// The rules in evaluation order (the built-in ones first).
  [[nodiscard]] std::vector<std::string> rule_names() const;

  /// Called on a failure in `pause_on` when `on_failure(Pause)`, besides the pause of every
  /// manager the monitor is installed on (each installation pauses its own manager).
  void set_pause_callback(PauseFn fn) { pauses_.set(std::move(fn)); }

  /// Takes back the manager pause an installation added (its `remove()` calls this). Waits
  /// for a pause of that manager running on another thread, so after it returns the manager
  /// may be destroyed.
  void release_pause_callback(uint64_t token) { pauses_.release(token); }

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
  [[nodiscard]] std::vector<LayerHealth> layers() const {
    return query([](const detail::HealthCore& c) { return c.signals().layers(); });
  }
  [[nodiscard]] std::optional<LayerHealth> layer(std::string_view name) const;
  [[nodiscard]] LossHealth loss_health() const {
    return query([](const detail::HealthCore& c) { return c.loss_health(); });
  }
  /// The event ring, oldest first.
  [[nodiscard]] std::vector<SemanticEvent> events() const {
    return query([](const detail::HealthCore& c) { return c.ledger().events().to_vector(); });
  }
  /// Events emitted so far (including those the ring dropped).
  [[nodiscard]] uint64_t event_count() const {
    return query([](const detail::HealthCore& c) { return c.ledger().event_count(); });
  }
  /// Events that are alarms (SemanticEvent::is_alarm) emitted so far.
  [[nodiscard]] uint64_t alarm_count() const {
    return query([](const detail::HealthCore& c) { return c.ledger().alarm_count(); });
  }
  [[nodiscard]] std::vector<Incident> incidents() const {
    return query([](const detail::HealthCore& c) { return c.ledger().incidents(); });
  }
  /// Layer names beyond `max_layers` that were ignored.
  [[nodiscard]] uint64_t ignored_layers() const {
    return query([](const detail::HealthCore& c) { return c.signals().ignored(); });
  }
  /// A copy of everything diagnose() needs, taken now.
  [[nodiscard]] HealthReport report() const {
    return query([](const detail::HealthCore& c) { return c.report(); });
  }
  /// The report taken at the moment the first failure in `pause_on` was detected.
  [[nodiscard]] std::optional<HealthReport> failure_report() const {
    return query([](const detail::HealthCore& c) { return c.ledger().failure_report(); });
  }
  /// The backward pass under way threw: forgets the gradients received since the last
  /// end_backward, so the next pass's are judged alone (install calls this on
  /// HookManager::backward_failed).
  void abandon_backward() {
    query([](detail::HealthCore& c) { c.abandon_backward(); });
  }

  /// Forgets all state, events and incidents (options stay).
  void reset() {
    query([](detail::HealthCore& c) { c.clear(); });
  }

 private:
  template <typename, typename>
  friend class HealthInstallation;
  using Layer = detail::HealthLayer;
  using Pauses = detail::Pauses;

  std::string callback_name() const;

  void on_hook(const HookContext& ctx);

  /// `f(core_)` under the lock.
  template <typename F>
  auto query(F f) const {
    std::lock_guard<Mutex> lock(mutex_);
    return f(core_);
  }
  template <typename F>
  auto query(F f) {
    std::lock_guard<Mutex> lock(mutex_);
    return f(core_);
  }

  /// Runs `f(pauses, done)` under the lock; it returns the step its pauses are at. Then, without
  /// the lock, the pauses it called for and the step sinks of the steps it finished.
  template <typename F>
  void judged(F f);

  /// Finishes the previous step when `step` differs from it.
  void advance_to(int64_t step, Pauses& pauses, std::vector<HealthStep>& done);

  /// Packs the step that just ended for the sinks (only when someone listens).
  void finish_step(std::vector<HealthStep>& done);

  void deliver(const std::vector<HealthStep>& done);

  HealthOptions options_;
  mutable Mutex mutex_;
  detail::HealthCore core_;
  /// The prefetch keys install() registers, once (they name this monitor).
  const std::string units_key_ = callback_name() + ".units";
  const std::string saturation_key_ = callback_name() + ".saturation";

  detail::PauseCallbacks pauses_;
  std::vector<std::pair<uint64_t, StepSink>> sinks_;
  uint64_t sink_seq_ = 0;
  uint64_t step_events_from_ = 0;
};

#if TORCHDBG_DEFINITIONS

template <typename Mutex, typename ManagerMutex>
void HealthInstallation<Mutex, ManagerMutex>::remove() noexcept {
  if (mgr_ == nullptr) return;
  try {
    mgr_->remove_listener(listener_);
    (void)mgr_->remove_hook(hook_);
    if (activation_hook_) (void)mgr_->remove_hook(*activation_hook_);
    (void)mgr_->remove_callback(callback_);
    (void)mgr_->remove_prefetch(callback_ + ".units");
    (void)mgr_->remove_prefetch(callback_ + ".saturation");
    if (monitor_ != nullptr) monitor_->release_pause_callback(pause_token_);
  } catch (...) {
  }
  mgr_ = nullptr;
  monitor_ = nullptr;
}

template <typename Mutex, typename ManagerMutex>
auto HealthInstallation<Mutex, ManagerMutex>::connect(BasicHealthMonitor<Mutex>& monitor,
                                                      BasicHookManager<ManagerMutex>& hooks)
    -> HealthInstallation {
  BasicHealthMonitor<Mutex>* const m = &monitor;
  const detail::HealthSignals* const signals = &monitor.core_.signals();
  const HealthOptions* const options = &monitor.options_;
  const std::string cb = monitor.callback_name();
  if (hooks.has_callback(cb))
    throw Error(
        "torchdbg: this HealthMonitor is already installed on this HookManager (callback '" + cb +
        "'); remove that installation first");
  hooks.register_callback(
      cb, [m](const HookContext& ctx) { m->on_hook(ctx); }, CallbackStats::Moments);
  // Queued device deliveries (attach's StatsBatching) bring the counts the judgement needs
  // in the step's one copy instead of a sync per layer.
  BasicHookManager<ManagerMutex>* owner = &hooks;
  const int64_t forward_every = options->interval() * options->activation_interval();
  // Forward outputs are judged every `forward_every` steps (or on those activation_budget
  // chooses), and on every evaluated step while a finding keeps the monitor alert
  // (HealthOptions::alert_steps).
  const detail::HealthCore* const core = &monitor.core_;
  auto forward_step = [core](int64_t s) { return core->forward_due(s); };
  auto due = [signals, owner, forward_step](std::string_view layer, bool is_forward) {
    return is_forward && signals->watched(layer) && forward_step(owner->step());
  };
  hooks.add_prefetch(monitor.units_key_,
                     [signals, options, due](std::string_view layer, const at::Tensor& t, bool fwd,
                                             const Metadata& md) -> at::Tensor {
                       if (!due(layer, fwd) || t.dim() == 0) return {};
                       const auto k = signals->kinds().kind_of(layer, detail::activation_info(md));
                       if (!k.known || !detail::is_dead_capable(k.name)) return {};
                       return detail::count_above_per_unit_on_device(
                           t, t.dim() == 1 ? 0 : options->unit_dim(), 0.0);
                     });
  hooks.add_prefetch(monitor.saturation_key_,
                     [signals, due](std::string_view layer, const at::Tensor& t, bool fwd,
                                    const Metadata& md) -> at::Tensor {
                       if (!due(layer, fwd)) return {};
                       const auto k = signals->kinds().kind_of(layer, detail::activation_info(md));
                       if (!k.known || !detail::ActivationKinds::saturating(k.name, k.pre))
                         return {};
                       const auto [lo, hi] = signals->kinds().saturation_bounds(k.name, k.pre);
                       return detail::count_outside_on_device(t, lo, hi);
                     });
  // One hook for both directions; with activation_interval above 1, gradients on this one
  // and forward outputs on a second, so the forward's observer is needed on fewer steps.
  const bool budget = options->activation_budget() > 0.0;
  const bool split = forward_every != options->interval() || budget;
  HookConfig config = HookConfig()
                          .name("torchdbg.health")
                          .trigger(HookTrigger::every_n_steps(options->interval()))
                          .direction(split ? CallDirection::Backward : CallDirection::Both)
                          .actions({HookAction::custom_callback(cb)})
                          .layer_patterns(options->layers());
  BasicHookManager<ManagerMutex>* mgr = &hooks;
  const uint64_t pause_token =
      monitor.pauses_.add([mgr](int64_t step, const std::string& layer, const std::string& reason) {
        mgr->pause_training(reason, layer, step, "torchdbg.health");
      });
  const uint64_t listener =
      hooks.add_listener([m, mgr](typename BasicHookManager<ManagerMutex>::Change change) {
        using Change = typename BasicHookManager<ManagerMutex>::Change;
        try {
          if (change == Change::After) {
            m->set_step(mgr->step());
          } else if (change == Change::Loss) {
            const TrainingState st = mgr->state();
            if (st.loss) m->observe_loss(st.loss_step.value_or(st.step), *st.loss);
          } else if (change == Change::GradientNorm || change == Change::BackwardEnd) {
            m->end_backward();  // once: the second finds nothing pending
          } else if (change == Change::BackwardFailed) {
            m->abandon_backward();
          }
        } catch (...) {
          // a listener must not throw into set_step/set_loss
        }
      });
  monitor.set_step(hooks.step());
  HookId id;
  std::optional<HookId> activation_id;
  try {
    id = hooks.register_hook(std::move(config));
    if (split)
      activation_id = hooks.register_hook(HookConfig()
                                              .name("torchdbg.health.activations")
                                              .trigger(HookTrigger::on_steps(
                                                  forward_step,
                                                  (budget ? std::string("as activation_budget chooses")
                                                          : "every " + std::to_string(forward_every) + " steps") +
                                                      (options->alert_steps() > 0 ? ", and while alert" : "")))
                                              .direction(CallDirection::Forward)
                                              .actions({HookAction::custom_callback(cb)})
                                              .layer_patterns(options->layers()));
  } catch (...) {
    if (!id.is_nil()) (void)hooks.remove_hook(id);
    hooks.remove_listener(listener);
    (void)hooks.remove_callback(cb);
    (void)hooks.remove_prefetch(monitor.units_key_);
    (void)hooks.remove_prefetch(monitor.saturation_key_);
    monitor.release_pause_callback(pause_token);
    throw;
  }
  return HealthInstallation(mgr, m, id, activation_id, cb, listener, pause_token);
}

template <typename Mutex>
BasicHealthMonitor<Mutex>::BasicHealthMonitor(HealthOptions options)
    : options_(std::move(options)), core_(options_) {}

template <typename Mutex>
BasicHealthMonitor<Mutex>::~BasicHealthMonitor() = default;

template <typename Mutex>
template <typename M>
auto BasicHealthMonitor<Mutex>::install(BasicHookManager<M>& hooks)
    -> HealthInstallation<Mutex, M> {
  return HealthInstallation<Mutex, M>::connect(*this, hooks);
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::add_rule(HealthRulePtr rule) {
  if (!rule) throw Error("torchdbg: add_rule got a null rule");
  std::lock_guard<Mutex> lock(mutex_);
  core_.add_rule(std::move(rule));
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::rule_names() const -> std::vector<std::string> {
  std::lock_guard<Mutex> lock(mutex_);
  std::vector<std::string> out;
  for (const auto& r : core_.rules()) out.push_back(r->name());
  return out;
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
  judged([this](Pauses& pauses, std::vector<HealthStep>& done) {
    if (!core_.has_step()) return core_.step();
    core_.settle_activations(pauses);
    core_.gradients(pauses);
    finish_step(done);
    core_.end_step();
    return core_.step();
  });
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
  judged([&](Pauses& pauses, std::vector<HealthStep>& done) {
    if (!core_.signals().watched(layer)) return step;
    advance_to(step, pauses, done);
    Layer* L = core_.signals().layer_rec(layer);
    if (L != nullptr) core_.activation(*L, output, *stats, step, info, pauses);
    return step;
  });
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
  judged([&](Pauses& pauses, std::vector<HealthStep>& done) {
    if (!core_.signals().watched(layer)) return step;
    advance_to(step, pauses, done);
    Layer* L = core_.signals().layer_rec(layer);
    if (L != nullptr) core_.gradient(*L, *stats);
    return step;
  });
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::end_backward() {
  judged([this](Pauses& pauses, std::vector<HealthStep>&) {
    core_.gradients(pauses);
    return core_.step();
  });
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::observe_loss(int64_t step, double loss) {
  judged([&](Pauses& pauses, std::vector<HealthStep>& done) {
    advance_to(step, pauses, done);
    core_.loss(step, loss, pauses);
    return step;
  });
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::set_step(int64_t step) {
  judged([&](Pauses& pauses, std::vector<HealthStep>& done) {
    advance_to(step, pauses, done);
    return step;
  });
}

template <typename Mutex>
template <typename F>
void BasicHealthMonitor<Mutex>::judged(F f) {
  Pauses pauses;
  std::vector<HealthStep> done;
  int64_t step = 0;
  {
    std::lock_guard<Mutex> lock(mutex_);
    step = f(pauses, done);
  }
  pauses_.run(step, pauses);
  deliver(done);
}

template <typename Mutex>
auto BasicHealthMonitor<Mutex>::layer(std::string_view name) const -> std::optional<LayerHealth> {
  std::lock_guard<Mutex> lock(mutex_);
  const Layer* L = core_.signals().find(name);
  if (L == nullptr) return std::nullopt;
  return L->health();
}

template <typename Mutex>
std::string BasicHealthMonitor<Mutex>::callback_name() const {
  return "torchdbg.health." + std::to_string(reinterpret_cast<std::uintptr_t>(this));
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::on_hook(const HookContext& ctx) {
  if (ctx.is_forward()) {
    ActivationInfo info = detail::activation_info(detail::base_metadata(ctx), detail::delivery_facts(ctx));
    info.unit_counts = ctx.prefetched(units_key_);
    info.saturated_count = ctx.prefetched(saturation_key_);
    // A dead-capable output's per-unit activity read with its statistics, in one pass.
    const at::Tensor& y = ctx.tensor();
    if (info.unit_counts == nullptr && y.defined() && y.dim() > 0 && y.device().is_cpu() &&
        core_.signals().watched(ctx.layer_name())) {
      const auto k = core_.signals().kinds().kind_of(ctx.layer_name(), info);
      if (k.known && detail::is_dead_capable(k.name)) {
        try {
          // Only where one pass reads both: elsewhere the monitor counts them as before,
          // without the context keeping a copy.
          const int64_t dim = y.dim() == 1 ? 0 : options_.unit_dim();
          if (detail::units_fusable(y, dim)) info.units_above_zero = &ctx.units_above_zero(dim);
        } catch (const Error&) {
          // no such unit dimension: the monitor finds that out itself
        }
      }
    }
    observe_activation(ctx.layer_name(), y, ctx.step(), info, &ctx.moment_stats());
  } else {
    observe_gradient(ctx.layer_name(), ctx.metadata_value("parameter").value_or(std::string_view{}),
                     ctx.tensor(), ctx.step(), &ctx.moment_stats());
  }
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::advance_to(int64_t step, Pauses& pauses,
                                           std::vector<HealthStep>& done) {
  if (core_.has_step() && step == core_.step()) return;
  if (core_.has_step()) {
    core_.settle_activations(pauses);
    core_.gradients(pauses);
    finish_step(done);
  }
  step_events_from_ = core_.ledger().event_count();
  core_.begin_step(step);
}

template <typename Mutex>
void BasicHealthMonitor<Mutex>::finish_step(std::vector<HealthStep>& done) {
  if (sinks_.empty()) return;
  const detail::HealthSignals& signals = core_.signals();
  HealthStep h;
  h.step = core_.step();
  h.loss = signals.step_loss();
  h.loss_health = core_.loss_health();
  for (const auto& L : signals.records())
    if (L.last_step == h.step && (L.seen_fwd || L.seen_bwd)) h.layers.push_back(L.health());
  std::stable_sort(h.layers.begin(), h.layers.end(),
                   [](const LayerHealth& a, const LayerHealth& b) { return a.order < b.order; });
  const auto& events = core_.ledger().events();
  const uint64_t fresh = core_.ledger().event_count() - step_events_from_;
  const std::size_t held = events.size();
  const std::size_t n = static_cast<std::size_t>(std::min<uint64_t>(fresh, held));
  for (std::size_t i = held - n; i < held; ++i) h.events.push_back(events.at(i));
  step_events_from_ = core_.ledger().event_count();
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
