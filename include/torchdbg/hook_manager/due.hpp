// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Which hooks are due (hook_manager.hpp), judged without a tensor: by direction, trigger and
// step, for the manager's may_fire / reads_sign_counts and for each execute_hooks call.

#include <cstdint>

#include "torchdbg/hook_config.hpp"
#include "torchdbg/hook_manager/registry.hpp"

namespace torchdbg {
namespace detail {

/// Whether a hook with config `c` sees calls in this direction (HookConfig::direction).
inline bool direction_matches(const HookConfig& c, bool is_forward) noexcept {
  switch (c.direction()) {
    case CallDirection::Forward:
      return is_forward;
    case CallDirection::Backward:
      return !is_forward;
    default:
      return true;
  }
}

/// Whether `t` could fire for a call in this direction at `step`, judged without a tensor:
/// on_steps asks its predicate (one that throws: possibly due); conditional, layer-specific
/// and once triggers count as possibly due.
inline bool trigger_may_fire(const HookTrigger& t, bool is_forward, int64_t step) {
  switch (t.kind()) {
    case HookTrigger::Kind::EveryForward:
      return is_forward;
    case HookTrigger::Kind::EveryBackward:
      return !is_forward;
    case HookTrigger::Kind::EveryNSteps:
      return step % t.interval() == 0;
    case HookTrigger::Kind::OnSteps:
      // A predicate that throws counts as possibly due: the call's own check (execute_hooks)
      // turns the exception into the hook's error result.
      try {
        return t.accepts_step(step);
      } catch (...) {
        return true;
      }
    default:
      return true;
  }
}

/// Whether a hook with config `c` could fire for a call in this direction at `step`.
inline bool config_may_fire(const HookConfig& c, bool is_forward, int64_t step) {
  return direction_matches(c, is_forward) && trigger_may_fire(c.trigger(), is_forward, step);
}

/// Whether some live hook of `hooks` could fire for such a call.
template <typename Mutex>
bool any_may_fire(const typename HookRegistry<Mutex>::List& hooks, bool is_forward, int64_t step) {
  for (const auto& e : hooks) {
    if (e->live() && config_may_fire(e->config, is_forward, step)) return true;
  }
  return false;
}

/// Whether a live hook of `hooks` that could fire for such a call reads the sign counts:
/// inspect_tensor, record_activations, and callbacks not registered as moment readers.
template <typename Mutex>
bool reads_signs(const typename HookRegistry<Mutex>::List& hooks, const HookRegistry<Mutex>& registry,
                 bool is_forward, int64_t step) {
  for (const auto& e : hooks) {
    if (!e->live() || !config_may_fire(e->config, is_forward, step)) continue;
    for (const auto& a : e->config.actions()) {
      if (a.kind == HookAction::Kind::InspectTensor || a.kind == HookAction::Kind::RecordActivations)
        return true;
      if (a.kind == HookAction::Kind::CustomCallback && !registry.reads_moments_only(a.text)) return true;
    }
  }
  return false;
}

}  // namespace detail
}  // namespace torchdbg
