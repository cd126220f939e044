// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The Reporter gathers what a run produces into StepRecords and hands them to its exporters:
// per-layer statistics from the HookManager's deliveries, health, events and loss from a
// HealthMonitor's finished steps (or the manager's own step changes without one).
//
// ```cpp
// torchdbg::Reporter reporter;
// reporter.add_exporter(std::make_shared<torchdbg::JsonlExporter>("run.jsonl"));
// reporter.add_exporter(std::make_shared<torchdbg::HtmlExporter>("report.html"));
// auto fed = reporter.install(hooks, &health);
// ... train ...
// reporter.finish(torchdbg::make_summary(hooks, health));
// ```

#include <torch/arg.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "torchdbg/detail/pattern.hpp"
#include "torchdbg/diagnosis.hpp"
#include "torchdbg/exporters/exporter.hpp"
#include "torchdbg/health.hpp"
#include "torchdbg/hook_manager.hpp"

namespace torchdbg {

struct ReporterOptions {
  /// Record statistics every `interval` steps (the reporter's hook is every_n_steps).
  TORCH_ARG(int64_t, interval) = 1;
  /// Regexes (searched) of the layer names to record; empty: all.
  TORCH_ARG(std::vector<std::string>, layers);
  /// Forward outputs also get a histogram every `histogram_interval` steps (0: never).
  TORCH_ARG(int64_t, histogram_interval) = 50;
  TORCH_ARG(int64_t, histogram_bins) = 30;
  /// Deliveries kept per step at most (the rest are counted in `dropped_records`).
  TORCH_ARG(std::size_t, max_records_per_step) = 8192;
};

/// What `install` set up; removes it when destroyed. Movable.
class ReporterInstallation {
 public:
  ReporterInstallation() = default;
  explicit ReporterInstallation(std::function<void()> undo) : undo_(std::move(undo)) {}
  ReporterInstallation(const ReporterInstallation&) = delete;
  ReporterInstallation& operator=(const ReporterInstallation&) = delete;
  ReporterInstallation(ReporterInstallation&& o) noexcept : undo_(std::move(o.undo_)) {
    o.undo_ = nullptr;
  }
  ReporterInstallation& operator=(ReporterInstallation&& o) noexcept {
    if (this != &o) {
      remove();
      undo_ = std::move(o.undo_);
      o.undo_ = nullptr;
    }
    return *this;
  }
  ~ReporterInstallation() { remove(); }
  void remove() noexcept {
    if (!undo_) return;
    try {
      undo_();
    } catch (...) {
    }
    undo_ = nullptr;
  }

 private:
  std::function<void()> undo_;
};

/// Collects StepRecords and writes them to every exporter. An exporter that throws (an
/// unwritable file) is counted in `exporter_errors()` and never reaches the training loop.
///
/// Thread safety: every method may be called from any thread (one lock; exporters are called
/// under it, so they see steps in order).
template <typename Mutex = std::mutex>
class BasicReporter {
 public:
  explicit BasicReporter(ReporterOptions options = {}) : options_(std::move(options)) {
    detail::require_at_least<int64_t>(options_.interval(), 1, "ReporterOptions::interval");
    detail::require_at_least<int64_t>(options_.histogram_interval(), 0,
                                      "ReporterOptions::histogram_interval");
    detail::require_at_least<int64_t>(options_.histogram_bins(), 1,
                                      "ReporterOptions::histogram_bins");
    for (const auto& p : options_.layers())
      (void)detail::compile_pattern(p,
                                    "reporter layer pattern");  // a bad regex fails here, by name
  }
  BasicReporter(const BasicReporter&) = delete;
  BasicReporter& operator=(const BasicReporter&) = delete;

  void add_exporter(std::shared_ptr<Exporter> exporter) {
    if (!exporter) throw Error("torchdbg: add_exporter got a null exporter");
    std::lock_guard<Mutex> lock(mutex_);
    exporters_.push_back(std::move(exporter));
  }

  /// Records every delivery of `hooks` (every `interval` steps). With `health`, steps end
  /// when the monitor finishes them (with their health, events and loss); without, when the
  /// manager's step changes. An attached backward pass that throws drops the records made
  /// since the last pass ended (see drop_failed_pass). Keep the result alive while recording
  /// and destroy it before the reporter, the manager or the monitor.
  template <typename M, typename HM = std::mutex>
  [[nodiscard]] ReporterInstallation install(BasicHookManager<M>& hooks,
                                             BasicHealthMonitor<HM>* health = nullptr) {
    const std::string cb =
        "torchdbg.report." + std::to_string(reinterpret_cast<std::uintptr_t>(this));
    if (hooks.has_callback(cb))
      throw Error("torchdbg: this Reporter is already installed on this HookManager (callback '" + cb +
                  "'); remove that installation first");
    hooks.register_callback(cb, [this](const HookContext& ctx) { on_hook(ctx); });
    BasicHookManager<M>* mgr = &hooks;
    uint64_t listener = 0, sink = 0;
    const bool steps_from_health = health != nullptr;
    if (steps_from_health) sink = health->add_step_sink([this](const HealthStep& h) { end_step(h.step, &h); });
    listener = hooks.add_listener([this, mgr, steps_from_health](typename BasicHookManager<M>::Change change) {
      using Change = typename BasicHookManager<M>::Change;
      try {
        if (change == Change::BackwardEnd) {
          end_pass();
        } else if (change == Change::BackwardFailed) {
          drop_failed_pass();
        } else if (steps_from_health) {
          return;  // steps end and losses come with the monitor's steps
        } else if (change == Change::Before) {
          before_step_.store(mgr->step());
        } else if (change == Change::After) {
          const int64_t before = before_step_.load();
          if (mgr->step() != before) end_step(before);
        } else if (change == Change::Loss) {
          const TrainingState st = mgr->state();
          if (st.loss) record_loss(st.loss_step.value_or(st.step), *st.loss);
        }
      } catch (...) {
      }
    });
    HookId id = hooks.register_hook(HookConfig()
                                        .name("torchdbg.report")
                                        .trigger(HookTrigger::every_n_steps(options_.interval()))
                                        .actions({HookAction::custom_callback(cb)})
                                        .layer_patterns(options_.layers()));
    return ReporterInstallation([mgr, health, id, cb, listener, sink] {
      (void)mgr->remove_hook(id);
      (void)mgr->remove_callback(cb);
      if (listener != 0) mgr->remove_listener(listener);
      if (health != nullptr && sink != 0) health->remove_step_sink(sink);
    });
  }

  // ---- manual feeding (install does this) -----------------------------------------------

  void record(int64_t step, LayerRecord r) {
    std::lock_guard<Mutex> lock(mutex_);
    StepRecord& s = pending(step);
    if (s.layers.size() >= options_.max_records_per_step()) {
      ++dropped_;
      return;
    }
    s.layers.push_back(std::move(r));
  }
  void record_loss(int64_t step, double loss) {
    std::lock_guard<Mutex> lock(mutex_);
    pending(step).loss = loss;
  }
  /// An attached backward pass ended: what has been recorded so far is kept.
  void end_pass() {
    std::lock_guard<Mutex> lock(mutex_);
    for (const auto& [step, r] : pending_) kept_[step] = r.layers.size();
  }
  /// An attached backward pass threw (HookManager::backward_failed): the records made since
  /// the last pass ended (that iteration's forward outputs and the gradients it delivered)
  /// are dropped, so the step is reported as its successful pass saw it.
  void drop_failed_pass() {
    std::lock_guard<Mutex> lock(mutex_);
    for (auto& [step, r] : pending_) {
      const auto k = kept_.find(step);
      const std::size_t keep = k == kept_.end() ? 0 : k->second;
      if (r.layers.size() > keep) r.layers.resize(keep);
    }
  }
  /// Writes step `step` (with the monitor's view of it when given) to every exporter.
  void end_step(int64_t step, const HealthStep* health = nullptr) {
    std::lock_guard<Mutex> lock(mutex_);
    StepRecord r;
    auto it = pending_.find(step);
    if (it != pending_.end()) {
      r = std::move(it->second);
      pending_.erase(it);
    }
    kept_.erase(step);
    r.step = step;
    if (health != nullptr) {
      if (health->loss) r.loss = health->loss;
      r.health = health->layers;
      r.events = health->events;
      r.loss_health = health->loss_health;
    }
    // Steps before this one that never ended (no monitor step for them) go out first.
    while (!pending_.empty() && pending_.begin()->first < step) {
      StepRecord old = std::move(pending_.begin()->second);
      pending_.erase(pending_.begin());
      write_locked(old);
    }
    if (r.layers.empty() && r.health.empty() && r.events.empty() && !r.loss) return;
    write_locked(r);
  }
  /// Writes what is pending, then `summary`, to every exporter, and flushes them.
  void finish(const RunSummary& summary) {
    std::lock_guard<Mutex> lock(mutex_);
    while (!pending_.empty()) {
      StepRecord old = std::move(pending_.begin()->second);
      pending_.erase(pending_.begin());
      write_locked(old);
    }
    for (auto& e : exporters_) {
      guarded([&] { e->write_summary(summary); });
      guarded([&] { e->flush(); });
    }
  }
  void flush() {
    std::lock_guard<Mutex> lock(mutex_);
    for (auto& e : exporters_) guarded([&] { e->flush(); });
  }

  [[nodiscard]] uint64_t steps_written() const {
    std::lock_guard<Mutex> lock(mutex_);
    return written_;
  }
  [[nodiscard]] uint64_t exporter_errors() const {
    std::lock_guard<Mutex> lock(mutex_);
    return errors_;
  }
  [[nodiscard]] std::string last_error() const {
    std::lock_guard<Mutex> lock(mutex_);
    return last_error_;
  }
  [[nodiscard]] uint64_t dropped_records() const {
    std::lock_guard<Mutex> lock(mutex_);
    return dropped_;
  }

 private:
  void on_hook(const HookContext& ctx) {
    LayerRecord r;
    r.layer = std::string(ctx.layer_name());
    r.forward = ctx.is_forward();
    if (auto p = ctx.metadata_value("parameter")) r.parameter = std::string(*p);
    const int64_t hi = options_.histogram_interval();
    const bool hist = r.forward && hi > 0 && ctx.step() % hi == 0;
    r.stats = hist ? ctx.stats_with_distribution(options_.histogram_bins()) : ctx.stats();
    record(ctx.step(), std::move(r));
  }

  StepRecord& pending(int64_t step) {
    auto it = pending_.find(step);
    if (it != pending_.end()) return it->second;
    if (pending_.size() >= kMaxPending) {  // a step that never ended: write it rather than grow
      StepRecord old = std::move(pending_.begin()->second);
      pending_.erase(pending_.begin());
      write_locked(old);
    }
    StepRecord& r = pending_[step];
    r.step = step;
    return r;
  }

  void write_locked(StepRecord& r) {
    kept_.erase(r.step);
    double sq = 0.0;
    bool any = false;
    for (const auto& l : r.layers) {
      if (l.forward) continue;
      sq += l.stats.l2_norm * l.stats.l2_norm;
      any = true;
    }
    if (any) r.gradient_norm = std::sqrt(sq);
    for (auto& e : exporters_) guarded([&] { e->write_step(r); });
    ++written_;
  }

  template <typename F>
  void guarded(F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      ++errors_;
      last_error_ = e.what();
    } catch (...) {
      ++errors_;
      last_error_ = "unknown exception";
    }
  }

  static constexpr std::size_t kMaxPending = 4;
  ReporterOptions options_;
  mutable Mutex mutex_;
  std::vector<std::shared_ptr<Exporter>> exporters_;
  std::map<int64_t, StepRecord> pending_;
  /// Per pending step, the records made before the last attached backward pass ended.
  std::map<int64_t, std::size_t> kept_;
  uint64_t written_ = 0, errors_ = 0, dropped_ = 0;
  std::string last_error_;
  std::atomic<int64_t> before_step_{0};  // written by the manager's listener, any thread
};

using Reporter = BasicReporter<std::mutex>;

/// The end-of-run summary: finishes the monitor's last step (so the reporter writes it), then
/// takes its diagnosis, layer health and the manager's alerts.
template <typename M, typename HM>
[[nodiscard]] RunSummary make_summary(BasicHookManager<M>& hooks, BasicHealthMonitor<HM>& health,
                                      std::size_t max_alerts = 200) {
  health.flush();
  RunSummary s;
  const HealthReport r = health.report();
  s.last_step = r.step;
  s.diagnosis = diagnose(r);
  s.layers = r.layers;
  s.events_total = r.events_total;
  auto alerts = hooks.alerts();
  s.alerts_total = hooks.alert_count();
  if (alerts.size() > max_alerts)
    alerts.erase(alerts.begin(), alerts.end() - static_cast<std::ptrdiff_t>(max_alerts));
  s.alerts = std::move(alerts);
  return s;
}

}  // namespace torchdbg
