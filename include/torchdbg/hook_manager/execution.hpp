// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Running the manager's hooks on one call (hook_manager.hpp): matching, triggers, execution
// budgets, the actions, and what becomes of every exception.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "torchdbg/activation_visualizer.hpp"
#include "torchdbg/detail/atomic_file.hpp"
#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/hook_config.hpp"
#include "torchdbg/hook_context.hpp"
#include "torchdbg/hook_manager/alerts.hpp"
#include "torchdbg/hook_manager/due.hpp"
#include "torchdbg/hook_manager/registry.hpp"
#include "torchdbg/snapshot.hpp"
#include "torchdbg/tensor_inspector.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg {
namespace detail {

/// Runs a manager's hooks on one call: the hooks whose direction and patterns match, in
/// execution order, each giving a result; nothing a hook does escapes (exceptions, bad input
/// and missing callbacks become counted error results handed to the error handler). Thread
/// safety: `run` may be called from any number of threads at once; it holds no lock while
/// hooks run. `State` gives the training state (`state()`: a TrainingState).
template <typename Mutex, typename State>
class HookExecutor {
 public:
  using Results = std::vector<std::pair<HookId, HookResult>>;
  using Entry = HookEntry<Mutex>;

  HookExecutor(HookRegistry<Mutex>& registry, AlertLog<Mutex>& log, const State& state,
               BasicTensorInspector<Mutex>& inspector, BasicActivationVisualizer<Mutex>& visualizer,
               StatsSampling sampling = {})
      : registry_(registry),
        log_(log),
        state_(state),
        inspector_(inspector),
        visualizer_(visualizer),
        sampling_(sampling) {}

  /// Checks `tensor` (defined, a supported dtype), then runs the hooks. `out` null: the
  /// results are not wanted (attach's deliveries), so skipped hooks build no message;
  /// counters, alerts and the error handler are the same.
  /// `facts`: attach's measurements of a forward delivery, read as numbers by the health
  /// monitor and written into the metadata for a hook that reads it (HookContext::metadata).
  void run_checked(std::string_view layer, const at::Tensor& tensor, bool is_forward,
                   const Metadata& metadata, const TensorStats* precomputed,
                   const Prefetched* prefetched, Results* out, const DeliveryFacts* facts = nullptr);

  /// Runs the hooks; with `input_error` every matching hook gets it as its error result.
  void run_all(std::string_view layer, const at::Tensor& tensor, bool is_forward,
               const Metadata& metadata, const std::optional<std::string>& input_error,
               const TensorStats* precomputed, const Prefetched* prefetched, Results* out,
               const DeliveryFacts* facts = nullptr);

 private:
  HookResult run_one(Entry& e, const HookContext& ctx, const std::optional<std::string>& input_error,
                     bool explain);
  HookResult fail(Entry& e, const HookContext& ctx, const std::string& message);
  /// Runs one action; returns a detail for the success message, throws on failure.
  std::string run_action(Entry& e, const HookAction& a, const HookContext& ctx);
  void add_alert(const Entry& e, const HookContext& ctx, AlertSeverity severity, std::string message);

  static std::string exception_text(const std::exception& e);
  /// Inspector key: the layer for forward data, "<layer>[.<parameter>]/grad" for gradients.
  static std::string inspection_key(const HookContext& ctx);
  static AlertSeverity severity_of(TensorAlertKind k) noexcept {
    return (k == TensorAlertKind::NaN || k == TensorAlertKind::Inf) ? AlertSeverity::Error : AlertSeverity::Warning;
  }

  HookRegistry<Mutex>& registry_;
  AlertLog<Mutex>& log_;
  const State& state_;
  BasicTensorInspector<Mutex>& inspector_;
  BasicActivationVisualizer<Mutex>& visualizer_;
  const StatsSampling sampling_;  // HookManagerOptions::sampling
};

#if TORCHDBG_DEFINITIONS

template <typename Mutex, typename State>
void HookExecutor<Mutex, State>::run_checked(std::string_view layer, const at::Tensor& tensor, bool is_forward,
                                      const Metadata& metadata, const TensorStats* precomputed,
                                      const Prefetched* prefetched, Results* out, const DeliveryFacts* facts) {
  std::optional<std::string> input_error;
  if (!tensor.defined()) {
    input_error = "torchdbg: execute_hooks got an undefined tensor";
  } else {
    try {
      check_readable(tensor);
    } catch (const std::exception& e) {
      input_error = e.what();
    }
  }
  run_all(layer, tensor, is_forward, metadata, input_error, precomputed, prefetched, out, facts);
}

template <typename Mutex, typename State>
void HookExecutor<Mutex, State>::run_all(std::string_view layer, const at::Tensor& tensor, bool is_forward,
                                  const Metadata& metadata, const std::optional<std::string>& input_error,
                                  const TensorStats* precomputed, const Prefetched* prefetched,
                                  Results* out, const DeliveryFacts* facts) {
  const auto hooks = registry_.snapshot();  // keeps the list alive for the loop
  if (hooks->empty()) return;
  HookContext ctx(layer, is_forward, state_.state(), metadata, tensor, input_error ? nullptr : precomputed,
                  prefetched);
  ctx.sampling_ = sampling_;
  if (facts != nullptr && !facts->empty()) ctx.facts_ = facts;
  // A hook reading moment_stats() first computes the sign counts too when a later one will
  // read stats(): one pass, not two.
  if ((precomputed == nullptr || !precomputed->sign_counts) && !input_error)
    ctx.sign_counts_wanted_ = reads_signs<Mutex>(*hooks, registry_, is_forward, ctx.step());
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

template <typename Mutex, typename State>
HookResult HookExecutor<Mutex, State>::run_one(Entry& e, const HookContext& ctx,
                                        const std::optional<std::string>& input_error, bool explain) {
  if (input_error) return fail(e, ctx, *input_error);
  std::chrono::steady_clock::time_point t0;  // read only when the actions run
  bool executed = false;
  std::optional<HookResult> result;
  try {
    if (!e.config.trigger().is_due(ctx)) {
      result = HookResult::skipped(explain ? "trigger not due (" + e.config.trigger().describe() + ")"
                                           : std::string());
    } else if (!e.claim()) {
      result = HookResult::skipped(explain ? "max_executions (" + std::to_string(e.limit) + ") reached"
                                           : std::string());
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
  if (executed) e.counters.executed(std::chrono::steady_clock::now() - t0, ctx.step());
  if (result->is_skipped()) e.counters.skipped.fetch_add(1);
  if (result->is_error()) return fail(e, ctx, result->message());
  return std::move(*result);
}

template <typename Mutex, typename State>
HookResult HookExecutor<Mutex, State>::fail(Entry& e, const HookContext& ctx, const std::string& message) {
  e.counters.errors.fetch_add(1);
  log_.report(HookError{e.id, e.config.name(), std::string(ctx.layer_name()), ctx.step(), message});
  return HookResult::error(message);
}

template <typename Mutex, typename State>
std::string HookExecutor<Mutex, State>::run_action(Entry& e, const HookAction& a, const HookContext& ctx) {
  using K = HookAction::Kind;
  switch (a.kind) {
    case K::InspectTensor: {
      const bool with_dist = inspector_.should_sample_distribution();
      const TensorStats& s =
          with_dist ? ctx.stats_with_distribution(inspector_.options().histogram_bins()) : ctx.stats();
      const auto rec = inspector_.record(inspection_key(ctx), s, ctx.step(), !ctx.is_forward(), &ctx.tensor());
      for (const auto& al : rec.alerts) add_alert(e, ctx, severity_of(al.kind), al.message);
      return {};
    }
    case K::TrackGradients: {
      for (const auto& al : inspector_.track_gradient(inspection_key(ctx), ctx.moment_stats(), ctx.step()))
        add_alert(e, ctx, severity_of(al.kind), al.message);
      return {};
    }
    case K::RecordActivations: {
      visualizer_.record(inspection_key(ctx), ctx.step(),
                         ctx.stats_with_distribution(visualizer_.options().histogram_bins()), ctx.tensor());
      return {};
    }
    case K::SaveSnapshot: {
      ensure_directory(a.text);
      const std::string path = a.text + "/" + snapshot_file_name(ctx.layer_name(), ctx.step(), ctx.is_forward());
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
      const auto cb = registry_.callback(a.text);
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
      log_.request_pause(std::move(info));
      return "paused";
    }
  }
  return {};
}

template <typename Mutex, typename State>
void HookExecutor<Mutex, State>::add_alert(const Entry& e, const HookContext& ctx, AlertSeverity severity,
                                    std::string message) {
  Alert al;
  al.step = ctx.step();
  al.layer = std::string(ctx.layer_name());
  al.hook_name = e.config.name();
  al.hook_id = e.id;
  al.message = std::move(message);
  al.severity = severity;
  log_.push(std::move(al));
}

template <typename Mutex, typename State>
std::string HookExecutor<Mutex, State>::exception_text(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

template <typename Mutex, typename State>
std::string HookExecutor<Mutex, State>::inspection_key(const HookContext& ctx) {
  std::string key(ctx.layer_name());
  if (ctx.is_forward()) return key;
  if (auto p = ctx.metadata_value("parameter")) key += "." + std::string(*p);
  return key + "/grad";
}

#endif  // TORCHDBG_DEFINITIONS

}  // namespace detail
}  // namespace torchdbg
