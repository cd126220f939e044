// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The process-wide ATen observer that attributes operators to modules.

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <array>
#include <memory>
#include <mutex>
#include <string_view>
#include <tuple>
#include <vector>

#include "torchdbg/attach/core.hpp"
#include "torchdbg/attach/observer_state.hpp"
#include "torchdbg/attach/operators.hpp"
#include "torchdbg/attach/pass_end.hpp"

namespace torchdbg::detail {

/// The process-wide ATen observer behind forward attachment. RecordFunction callbacks are
/// plain function pointers, so the attached sessions live in a registry here; the callback
/// is registered while at least one session wants forward outputs.
class ForwardObserver : private ObserverState {
 public:
  static ForwardObserver& instance() {
    static ForwardObserver o;
    return o;
  }

  /// Adds (`on`) or removes `core` from the sessions the observer serves. A detached core is
  /// never added: a manager listener racing with detach() on another thread cannot bring it
  /// back (detach clears `active` before it removes the core, both under this lock's order).
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
    if (on == present) return;
    std::atomic_store(&cores_, std::shared_ptr<const std::vector<std::shared_ptr<AttachCore>>>(next));
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
  /// `concurrent_forward`, or when some session's forward last ran on another thread than
  /// this pass (a forward there would go unobserved meanwhile).
  void pause_for_backward() {
    {
      // Not while another thread's forward may need it: a session asked for concurrent
      // forwards, or a session's last forward ran on another thread (two threads training
      // their own models).
      const std::uintptr_t me = thread_token();
      std::lock_guard<std::mutex> lock(mutex_);
      if (handle_ == 0 || paused_) return;
      const auto current = cores();
      for (const auto& c : *current)
        if (c->options.concurrent_forward() || c->forward_thread.load(std::memory_order_relaxed) != me) return;
    }
    // Back at the pass's end, also when the pass throws and LibTorch drops its callbacks.
    if (!queue_pass_end([] { instance().resume(); }, [] { instance().resume(); })) {
      return;  // not inside a running backward pass
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (handle_ == 0 || paused_) return;
    at::removeCallback(handle_);  // safe in a callback: running operators keep their snapshot
    handle_ = 0;
    paused_ = true;
  }

  /// The sessions served now (a snapshot: hold it for as long as it is used).
  std::shared_ptr<const std::vector<std::shared_ptr<AttachCore>>> cores() const {
    return std::atomic_load(&cores_);
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
    if (t.pending.core && (core == nullptr || t.pending.core.get() == core)) flush_pending(t);
  }

  /// Forgets this thread's pending output and derived tensors of `core` without delivering.
  static void discard(const AttachCore* core) {
    Tls& t = tls();
    if (t.pending.core.get() == core) t.pending = {};
    for (auto& o : t.outputs)
      if (o.core == core->id) o = {};
    for (auto& d : t.derived)
      if (d.core == core->id) d = {};
  }

 private:
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    Tls& t = tls();
    if (DeliveringScope::active()) return nullptr;
    // The autograd engine wraps each node it runs in "autograd::engine::evaluate_function: <node>"
    // (for the profiler), before the node's tensor pre-hooks: a pass whose first hook throws
    // (one on the loss) is seen starting too.
    static constexpr std::string_view kEngineNode = "autograd::engine::evaluate_function";
    const std::string_view name = fn.name();
    if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION || name.substr(0, kEngineNode.size()) == kEngineNode) {
      if (t.backward_depth == 0) {
        if (t.pending.core) flush_pending(t);
        // The next forward counts from 0: the sessions whose last call was made on this
        // thread (a backward pass on a device's autograd thread restarts none: set_step or
        // auto_step do).
        const auto cores = instance().cores();  // held: the loop must not outlive a temporary
        const std::uintptr_t me = thread_token();
        for (const auto& c : *cores) {
          if (c->forward_thread.load(std::memory_order_relaxed) != me) continue;
          c->reset_calls();
          // Its end is awaited even if the pass throws before any gradient arrives.
          if (c->forward_since_pass.load(std::memory_order_relaxed)) c->begin_pass();
        }
      }
      if (++t.backward_depth == 1) instance().pause_for_backward();
      return std::make_unique<OpCtx>();
    }
    if (t.backward_depth > 0 || t.skip_depth > 0) return nullptr;
    const auto cores = instance().cores();
    if (cores->empty()) return nullptr;
    const bool grad_mode = at::GradMode::is_enabled();
    // An in-place operator whose `self` is a module's own tensor updates state (optimizer
    // steps, running statistics); it is never a forward output.
    const std::string_view op_name = fn.name();
    const bool in_place = !op_name.empty() && op_name.back() == '_';
    // `x.view_as(weight)`: a parameter passed as a shape or dtype template does not make the
    // operator the module's. `zeros_like(weight)`, `weight.new_zeros(...)`: a fresh tensor
    // holding none of the parameter's values (an optimizer's state, `exp_avg`), neither the
    // module's output nor derived from its weights, even with the parameter as `self`.
    auto ends_with = [&](std::string_view suf) {
      return op_name.size() >= suf.size() && op_name.substr(op_name.size() - suf.size()) == suf;
    };
    const bool fresh_op = ends_with("_like") || op_name.substr(0, 10) == "aten::new_";
    const bool template_op = ends_with("_as");
    // The modules whose tensors this operator reads (several when weights are tied).
    std::array<Candidate, 8>& cands = t.candidates;
    std::size_t ncand = 0;
    const c10::TensorImpl* source = nullptr;  // the first module tensor read, for Weights
    TensorSet used;                           // every module tensor read
    const auto add_candidates = [&](std::size_t ci, const std::vector<std::size_t>& mods, bool direct) {
      for (const std::size_t m : mods) {
        std::size_t k = 0;
        while (k < ncand && !(cands[k].core == ci && cands[k].module == m)) ++k;
        if (k == ncand) {
          if (ncand == cands.size()) continue;
          cands[ncand++] = Candidate{ci, m, 0, 0};
        }
        ++(direct ? cands[k].direct : cands[k].derived);
      }
    };
    bool has_data = false;
    at::Tensor data_in;  // the first data input
    bool consumes_pending = false;
    std::size_t consumed_output = t.outputs.size();  // the slot of a remembered output it reads
    const c10::TensorImpl* pending_impl =
        t.pending.core && t.pending.out.defined() ? t.pending.out.unsafeGetTensorImpl() : nullptr;
    const auto note_consumed = [&](const c10::TensorImpl* impl) {
      if (impl == pending_impl) {
        consumes_pending = true;
      } else if (consumed_output == t.outputs.size()) {
        consumed_output = output_slot(t, impl);
      }
    };
    bool first_input = true;
    bool updates_owned = false;
    const at::ArrayRef<const c10::IValue> inputs = safe_inputs(fn);
    // An operator taking a parameter together with that parameter's own gradient is an
    // optimizer's (weight decay `grad + wd * p`, ...), whatever the grad mode.
    std::vector<const c10::TensorImpl*>& grads_of_owned = t.grads_of_owned;
    grads_of_owned.clear();
    for (const c10::IValue& v : inputs) {
      for_each_tensor(v, [&](const at::Tensor& x) {
        if (!x.defined() || !x.requires_grad()) return;
        for (const auto& c : *cores) {
          if (c->owner.count(x.unsafeGetTensorImpl()) && x.grad().defined()) {
            grads_of_owned.push_back(x.grad().unsafeGetTensorImpl());
          }
        }
      });
    }
    for (const c10::IValue& v : inputs) {
      for_each_tensor(v, [&](const at::Tensor& x) {
        const bool is_self = first_input;
        first_input = false;
        if (!x.defined()) return;
        if (template_op && !is_self) return;  // a shape/dtype template, not an operand
        const c10::TensorImpl* impl = x.unsafeGetTensorImpl();
        if (fresh_op) {  // only its shape and dtype are used
          note_consumed(impl);
          return;
        }
        for (std::size_t ci = 0; ci < cores->size(); ++ci) {
          const AttachCore& c = *(*cores)[ci];
          auto it = c.owner.find(impl);
          if (it != c.owner.end()) {
            if (!grad_mode && !c.options.no_grad_forward()) return;
            add_candidates(ci, it->second, /*direct=*/true);
            if (source == nullptr) source = impl;
            used.add(impl);
            updates_owned = updates_owned || (in_place && is_self);
            return;
          }
        }
        for (const auto& d : t.derived) {
          if (d.core != 0 && d.impl && d.impl->_unsafe_get_target() == impl && !d.impl->expired()) {
            for (std::size_t ci = 0; ci < cores->size(); ++ci) {
              const AttachCore& c = *(*cores)[ci];
              if (c.id != d.core) continue;
              auto it = c.owner.find(d.source);
              if (it == c.owner.end()) return;
              add_candidates(ci, it->second, /*direct=*/false);
              if (source == nullptr) source = d.source;
              used.add(d.source);
              return;
            }
          }
        }
        if (std::find(grads_of_owned.begin(), grads_of_owned.end(), impl) != grads_of_owned.end()) {
          updates_owned = true;  // an optimizer's arithmetic, not a forward
        }
        has_data = true;
        if (!data_in.defined()) data_in = x;
        note_consumed(impl);
      });
    }
    if (updates_owned) {
      auto ctx = std::make_unique<OpCtx>();
      ctx->kind = OpCtx::Update;
      ++t.skip_depth;
      return ctx;
    }
    if (ncand > 0) {
      // Tied tensors: the module whose kind fits the operator (an embedding lookup vs a
      // matmul), then the one whose own tensors the operator reads most (a bias outranks a
      // shared weight), then tensors derived from its own; among modules alike in all of
      // these, the one called least in this step, then the first registered.
      std::size_t best = 0;
      if (ncand > 1) {
        const AttachCore::Kind op_kind = AttachCore::kind_of_op(op_name);
        const auto rank = [&](const Candidate& c) {
          const AttachCore& core = *(*cores)[c.core];
          const std::size_t target = core.modules[c.module].forward_as;
          return std::make_tuple(AttachCore::kind_fit(core.modules[c.module].kind, op_kind), c.direct, c.derived,
                                 -static_cast<int64_t>(core.calls(target)), -static_cast<int64_t>(c.core),
                                 -static_cast<int64_t>(c.module));
        };
        for (std::size_t k = 1; k < ncand; ++k)
          if (rank(cands[k]) > rank(cands[best])) best = k;
      }
      const std::shared_ptr<AttachCore>& owner = (*cores)[cands[best].core];
      const std::size_t module = owner->modules[cands[best].module].forward_as;
      auto ctx = std::make_unique<OpCtx>();
      ctx->core = owner;
      ctx->module = module;
      if (!has_data) {
        ctx->kind = OpCtx::Weights;  // e.g. weight.t(): remember its output as the module's
        ctx->source = source;
      } else if (owner->modules[module].internal && cands[best].module == module) {
        ctx->kind = OpCtx::Internal;
        if (t.pending.core) flush_pending(t);  // what it consumes is delivered now
      } else {
        ctx->kind = OpCtx::Forward;
        if (owner->input_due.exchange(false) && data_in.is_floating_point()) {
          DeliveringScope scope;
          try {
            AttachCore::InputMoments in;
            if (owner->defers(data_in)) {
              in.packed = pack_moments(data_in.detach());  // no sync: comes with the batch
            } else {
              in.host = compute_moments(data_in.detach(), /*signs=*/false);  // the RMS only
            }
            ctx->input = std::move(in);
          } catch (...) {
          }
        }
        // The same module's operator on its pending output, reading module tensors the call
        // has not read yet, continues that call (`x @ w + b` as two operators); anything
        // else is a new call (`fc(a) + fc(b)`, `fc(fc(x))`), and the pending output is
        // delivered first.
        const bool continues = t.pending.core == owner && t.pending.module == module && consumes_pending &&
                               !used.meets(t.pending.used);
        ctx->used = used;
        if (t.pending.core && !continues) flush_pending(t);
      }
      ++t.skip_depth;
      return ctx;
    }
    // The module's pending output, as it returned it, is delivered now, and remembered.
    if (consumes_pending) consumed_output = flush_pending(t);
    if (consumed_output < t.outputs.size()) {
      const Derived seen = t.outputs[consumed_output];
      std::shared_ptr<AttachCore> core;
      for (const auto& c : *cores)
        if (c->id == seen.core) core = c;
      const std::size_t m = seen.module;
      const uint32_t call = seen.call;
      if (!core) return nullptr;
      if (!grad_mode && !core->options.no_grad_forward()) return nullptr;  // metrics, evaluation
      // An activation takes the output up, and every view of it (its output is delivered once
      // a call); a view or any other reader leaves it for an activation that comes later.
      if (core->options.activations() && FollowUpOps::find(fn.name()) >= 0) {
        for (auto& o : t.outputs)
          if (o.core == seen.core && o.module == m && o.call == call) o = {};
      }
      if (!fresh_op && is_alias_op(op_name)) {  // a view of it: an activation may follow
        auto ctx = std::make_unique<OpCtx>();
        ctx->kind = OpCtx::Alias;
        ctx->core = std::move(core);
        ctx->module = m;
        ctx->call = call;
        ++t.skip_depth;
        return ctx;
      }
      if (core->options.activations()) {
        const int op = FollowUpOps::find(fn.name());
        if (op >= 0) {
          auto ctx = std::make_unique<OpCtx>();
          ctx->kind = OpCtx::Activation;
          ctx->core = std::move(core);
          ctx->module = m;
          ctx->call = call;
          ctx->follow_up = op;
          ++t.skip_depth;
          return ctx;
        }
      }
      auto ctx = std::make_unique<OpCtx>();
      ctx->kind = OpCtx::Reader;
      ++t.skip_depth;
      return ctx;
    }
    return nullptr;
  }

  static void on_end(const at::RecordFunction& fn, at::ObserverContext* raw) {
    if (raw == nullptr) return;
    auto* ctx = static_cast<OpCtx*>(raw);
    Tls& t = tls();
    if (ctx->kind == OpCtx::Backward) {
      --t.backward_depth;
      return;
    }
    --t.skip_depth;
    if (ctx->kind == OpCtx::Update || ctx->kind == OpCtx::Internal || ctx->kind == OpCtx::Reader) return;
    at::Tensor out = first_output(fn);
    if (!out.defined()) return;
    try {
      switch (ctx->kind) {
        case OpCtx::Weights: {
          t.derived[t.next_derived] = Derived{ctx->core->id, ctx->module, 0, ctx->source, weak_of(out)};
          t.next_derived = (t.next_derived + 1) % t.derived.size();
          break;
        }
        case OpCtx::Forward: {
          Pending p;
          if (t.pending.core == ctx->core && t.pending.module == ctx->module) {  // the same call goes on
            p = std::move(t.pending);
            if (ctx->input) p.input = std::move(*ctx->input);
            for (std::size_t i = 0; i < ctx->used.size; ++i) p.used.add(ctx->used.items[i]);
          } else {
            p.used = ctx->used;
            p.core = ctx->core;
            p.module = ctx->module;
            p.call = ctx->core->next_call(ctx->module);
            ctx->core->forward_thread.store(thread_token(), std::memory_order_relaxed);
            // A new iteration after a pass that brought this session no gradient.
            if (p.call == 0 && ctx->core->no_gradient_pass.load(std::memory_order_relaxed) &&
                ctx->core->no_gradient_pass.exchange(false))
              ctx->core->warn_no_gradient();
            p.info = ctx->core->delivery_info(ctx->module, -1, p.call);
            p.input = ctx->input.value_or(AttachCore::InputMoments{});
          }
          p.out = std::move(out);
          t.pending = std::move(p);
          break;
        }
        case OpCtx::Alias:
          remember_output(t, Derived{ctx->core->id, ctx->module, ctx->call, nullptr, weak_of(out)});
          break;
        case OpCtx::Activation: {
          const auto f = ctx->core->delivery_info(ctx->module, ctx->follow_up, ctx->call);
          ctx->core->send(ctx->module, f->name, out, true, f->md);
          break;
        }
        default:
          break;
      }
    } catch (...) {
      // out of memory for a name: the delivery is lost, the operator is not
    }
  }

  static at::CallbackHandle add_callback() {
    return at::addGlobalCallback(
        at::RecordFunctionCallback(&ForwardObserver::on_start, &ForwardObserver::on_end)
            .needsInputs(true)
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  }

  mutable std::mutex mutex_;
  bool paused_ = false;  // removed for a running backward pass; resume() restores it
  std::shared_ptr<const std::vector<std::shared_ptr<AttachCore>>> cores_ =
      std::make_shared<const std::vector<std::shared_ptr<AttachCore>>>();
  at::CallbackHandle handle_ = 0;
};

}  // namespace torchdbg::detail
