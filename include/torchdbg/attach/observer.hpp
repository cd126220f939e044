// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The process-wide ATen observer that attributes operators to modules.

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string_view>
#include <tuple>
#include <vector>

#include "torchdbg/attach/attribution.hpp"
#include "torchdbg/attach/core.hpp"
#include "torchdbg/attach/observer_state.hpp"
#include "torchdbg/attach/pass_end.hpp"

namespace torchdbg::detail {

/// The process-wide ATen observer behind forward attachment. RecordFunction callbacks are
/// plain function pointers, so the attached sessions live in a registry here; the callback
/// is registered while at least one session wants forward outputs.
class ForwardObserver : private Attribution {
 public:
  static ForwardObserver& instance() {
    static ForwardObserver o;
    return o;
  }

  /// Adds (`on`) or removes `core` from the sessions the observer serves. A detached core is
  /// never added: a manager listener racing with detach() on another thread cannot bring it
  /// back (detach clears `active` before it removes the core, both under this lock's order).
  /// A core added while a backward pass has the callback off, or a step begun (`on`) on
  /// another thread than that pass's, puts it back at once.
  void set(const std::shared_ptr<AttachCore>& core, bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    on = on && core->active.load();
    auto next = std::make_shared<std::vector<std::shared_ptr<AttachCore>>>();
    bool present = false;
    const auto current = cores();
    for (const auto& c : *current) {
      if (c == core) {
        present = true;
        if (!on) continue;
      }
      next->push_back(c);
    }
    if (on && !present) next->push_back(core);
    if (on && paused_ && (!present || thread_token() != paused_by_)) {
      // A session begins, or a step begins (set() runs at each step change) on another thread
      // than the backward pass that took the callback off: its forward must be seen.
      paused_ = false;
      if (handle_ == 0) handle_ = add_callback();
    }
    if (on == present) return;
    std::atomic_store(&cores_, std::shared_ptr<const std::vector<std::shared_ptr<AttachCore>>>(next));
    generation_.fetch_add(1, std::memory_order_release);  // after the store: a reader sees it
    if (!next->empty() && handle_ == 0 && !paused_) {
      handle_ = add_callback();
    } else if (next->empty()) {
      if (handle_ != 0) at::removeCallback(handle_);
      handle_ = 0;
      paused_ = false;
    }
  }

  /// Called at the first backward node of a pass: removes the ATen callback until the pass
  /// ends (an autograd final callback puts it back). While registered, RecordFunction boxes
  /// every operator's inputs and outputs, backward and optimizer included: about 2% of an
  /// MLP step here, for operators the observer ignores. Not done when a session asked for
  /// `concurrent_forward`, or when some session's forward last ran, or its manager's last
  /// step began, on another thread than this pass (a forward there would go unobserved
  /// meanwhile).
  void pause_for_backward() {
    // Not while another thread's forward may need it: a session asked for concurrent
    // forwards, or a session's last forward ran on another thread, or its steps begin on
    // another thread (two threads training their own models, one of them also run once on
    // this thread: a check before training). Under the lock.
    const std::uintptr_t me = thread_token();
    const auto may_pause = [&] {
      if (handle_ == 0 || paused_) return false;
      const auto current = cores();
      for (const auto& c : *current) {
        const std::uintptr_t stepped = c->step_thread.load(std::memory_order_relaxed);
        if (c->options.concurrent_forward() || c->forward_thread.load(std::memory_order_relaxed) != me ||
            (stepped != 0 && stepped != me))
          return false;
      }
      return true;
    };
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!may_pause()) return;
    }
    // Back at the pass's end, also when the pass throws and LibTorch drops its callbacks.
    if (!queue_pass_end([] { instance().resume(); }, [] { instance().resume(); })) {
      return;  // not inside a running backward pass
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!may_pause()) return;  // a session came meanwhile (set())
    at::removeCallback(handle_);  // safe in a callback: running operators keep their snapshot
    handle_ = 0;
    paused_ = true;
    paused_by_ = me;
  }

  /// Notes that `core`'s manager began a step on this thread (AttachCore::step_thread).
  static void stepped_here(AttachCore& core) { core.step_thread.store(thread_token(), std::memory_order_relaxed); }

  /// The sessions served now (a snapshot: hold it for as long as it is used).
  std::shared_ptr<const std::vector<std::shared_ptr<AttachCore>>> cores() const {
    return std::atomic_load(&cores_);
  }

  /// The sessions served now, as this thread's cached snapshot: refreshed when set() changed
  /// them since this thread last looked (an atomic load per operator, no shared_ptr copy).
  static const std::vector<std::shared_ptr<AttachCore>>& sessions(Tls& t) {
    const uint64_t g = instance().generation_.load(std::memory_order_acquire);
    if (g != t.sessions_generation) {
      t.sessions = instance().cores();
      t.sessions_generation = g;
      t.sessions_no_grad = std::any_of(t.sessions->begin(), t.sessions->end(),
                                       [](const auto& c) { return c->options.no_grad_forward(); });
    }
    return *t.sessions;
  }

  /// Puts the callback back after a backward pass (if some session still wants it).
  void resume() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!paused_) return;
    paused_ = false;
    if (!cores()->empty() && handle_ == 0) handle_ = add_callback();
  }

  /// Whether the ATen callback is registered now.
  [[nodiscard]] bool registered() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return handle_ != 0;
  }

  /// Delivers this thread's pending output of `core` (all cores when null).
  static void flush(const AttachCore* core = nullptr) {
    Tls& t = tls();
    if (core == nullptr) {
      flush_all(t);
    } else if (Pending* p = pending_of(t, core)) {
      flush_pending(t, *p);
    }
  }

  /// Forgets this thread's pending output and derived tensors of `core` without delivering.
  static void discard(const AttachCore* core) {
    Tls& t = tls();
    if (Pending* p = pending_of(t, core)) *p = {};
    for (auto& o : t.outputs)
      if (o.core == core->id) o = {};
    for (auto& d : t.derived)
      if (d.core == core->id) d = {};
    for (auto& d : t.fed)
      if (d.core == core->id) d = {};
    for (auto& d : t.mixed)
      if (d.core == core->id) d = {};
    for (auto& d : t.partial)
      if (d.core == core->id) d = {};
    t.call_inputs.erase(std::remove_if(t.call_inputs.begin(), t.call_inputs.end(),
                                       [&](const CallInput& c) { return c.core == core->id; }),
                        t.call_inputs.end());
  }

 private:
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    Tls& t = tls();
    if (DeliveringScope::active()) return nullptr;
    if (fn.scope() == at::RecordScope::TORCHSCRIPT_FUNCTION) {  // a TorchScript model's forward
      ++t.script_depth;
      auto ctx = std::make_unique<OpCtx>();
      ctx->kind = OpCtx::Script;
      ctx->script_depth = &t.script_depth;
      return ctx;
    }
    // The autograd engine wraps each node it runs in "autograd::engine::evaluate_function: <node>"
    // (for the profiler), before the node's tensor pre-hooks: a pass whose first hook throws
    // (one on the loss) is seen starting too.
    static constexpr std::string_view kEngineNode = "autograd::engine::evaluate_function";
    const std::string_view name = fn.name();
    if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION || name.substr(0, kEngineNode.size()) == kEngineNode) {
      if (t.backward_depth == 0) {
        flush_all(t);
        t.call_inputs.clear();  // a call begun inside and never ended
        // The next forward counts from 0: the sessions whose last call was made on this
        // thread (a backward pass on a device's autograd thread restarts none: set_step or
        // auto_step do).
        const auto cores = instance().cores();  // held: the loop must not outlive a temporary
        const std::uintptr_t me = thread_token();
        for (const auto& c : *cores) {
          if (c->forward_thread.load(std::memory_order_relaxed) == me) c->reset_calls();
          // A session whose forward ran on this thread since its last pass here: the end is
          // awaited even if the pass throws before any gradient arrives.
          if (std::find(t.forward_cores.begin(), t.forward_cores.end(), c->id) != t.forward_cores.end())
            c->begin_pass();
        }
        t.forward_cores.clear();
      }
      if (++t.backward_depth == 1) instance().pause_for_backward();
      return std::make_unique<OpCtx>();
    }
    if (t.skip_depth > 0) t.inner_ops.count();
    if (t.backward_depth > 0 || t.skip_depth > 0) return nullptr;
    const auto& cores = sessions(t);  // held by `t` while it is read
    if (cores.empty()) return nullptr;
    // With gradients off (an optimizer's step, evaluation, metrics) no session decides
    // anything unless one observes no-grad forwards, or the operator reads a pending output
    // (delivered before the operator may change it).
    if (!t.sessions_no_grad && !at::GradMode::is_enabled() && !reads_pending(fn, t)) return nullptr;
    std::unique_ptr<OpCtx> ctx = attribute(fn, t, cores);
    if (ctx) {
      ++t.skip_depth;  // what runs inside it is its own
      ctx->quiet_inside = quiet_inside(fn);
    }
    return ctx;
  }

  /// Turns RecordFunction off on this thread for what runs inside a decided operator, when
  /// this observer is the only callback that would see it (no profiler or other observer
  /// loses anything): those operators are the decided one's own and never looked at, and
  /// while a callback is registered each of them takes the dispatcher's slow path and has its
  /// inputs boxed. A composite operator runs many (`gru_cell` about 60 a call). Turning it
  /// off and on copies LibTorch's thread-local RecordFunction state (about 2.5K instructions
  /// each way in 1.13), so only an operator that ran at least `kQuietFrom` operators inside
  /// it the last time it was decided on this thread gets it.
  static bool quiet_inside(const at::RecordFunction& fn) {
    Tls& t = tls();
    const void* key = fn.name();  // the schema's name: stable for the operator's lifetime
    t.inner_ops.begin(key);
    if (t.inner_ops.last(key) < kQuietFrom || at::hasThreadLocalCallbacks() || !at::isRecordFunctionEnabled())
      return false;
    const auto callbacks = at::getStepCallbacksUnlessEmpty(fn.scope());
    if (!callbacks || callbacks->callbacks_.size() != 1) return false;
    at::enableRecordFunction(false);
    return true;
  }
  static constexpr uint32_t kQuietFrom = 4;

  static void on_end(const at::RecordFunction& fn, at::ObserverContext* raw) {
    if (raw == nullptr) return;
    auto* ctx = static_cast<OpCtx*>(raw);
    Tls& t = tls();
    if (ctx->kind == OpCtx::Backward) {
      --t.backward_depth;
      return;
    }
    if (ctx->kind == OpCtx::Script) {
      --*ctx->script_depth;
      return;
    }
    --t.skip_depth;
    if (ctx->quiet_inside) {
      at::enableRecordFunction(true);
    } else {
      t.inner_ops.end(fn.name());
    }
    if (ctx->kind == OpCtx::Decided) finish(fn, *ctx, t);
    if (ctx->kind == OpCtx::Indexed) finish_indexed(fn, t);
  }

  static at::CallbackHandle add_callback() {
    return at::addGlobalCallback(
        at::RecordFunctionCallback(&ForwardObserver::on_start, &ForwardObserver::on_end)
            .needsInputs(true)
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                     at::RecordScope::TORCHSCRIPT_FUNCTION}));
  }

  mutable std::mutex mutex_;
  bool paused_ = false;  // removed for a running backward pass; resume() restores it
  std::uintptr_t paused_by_ = 0;  // the thread of that pass
  std::shared_ptr<const std::vector<std::shared_ptr<AttachCore>>> cores_ =
      std::make_shared<const std::vector<std::shared_ptr<AttachCore>>>();
  at::CallbackHandle handle_ = 0;
  std::atomic<uint64_t> generation_{1};  // changes with cores_; Tls::sessions_generation 0 is stale
};

}  // namespace torchdbg::detail
