// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Which module's call an operator belongs to, for every session that sees it.

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <memory>
#include <string_view>
#include <tuple>
#include <vector>

#include "torchdbg/attach/core.hpp"
#include "torchdbg/attach/observer_state.hpp"
#include "torchdbg/attach/operators.hpp"

namespace torchdbg::detail {

/// Attribution of a forward operator: each session owning a tensor the operator reads decides
/// which of its modules' calls the operator belongs to (Decision), and each session whose
/// module output it reads decides whether it is an activation, a view or another reader.
/// Sessions attached to one model decide alike and each receives its own deliveries.
class Attribution : protected ObserverState {
 protected:
  using CoreList = std::vector<std::shared_ptr<AttachCore>>;

  /// What the sessions make of forward operator `fn` (null: nothing; no skip either).
  static std::unique_ptr<OpCtx> attribute(const at::RecordFunction& fn, Tls& t, const CoreList& cores) {
    const at::ArrayRef<const c10::IValue> inputs = safe_inputs(fn);
    // Most operators of a step (the loss's, the optimizer's, zero_grad's, the model's inner
    // arithmetic) read no tensor any session knows: nothing below would decide anything.
    if (!reads_known(inputs, t, cores)) return index_derived(fn.name(), inputs, t);
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
    // TransformerEncoderLayer's fused inference path: one operator over all its submodules'
    // weights, whose parts no name fits. Nothing inside it is delivered.
    if (op_name == "aten::_transformer_encoder_layer_fwd") {
      auto ctx = std::make_unique<OpCtx>();
      ctx->kind = OpCtx::Update;
      return ctx;
    }
    const bool fresh_op = ends_with("_like") || op_name.substr(0, 10) == "aten::new_";
    const bool template_op = ends_with("_as");
    // The modules whose tensors this operator reads (several when weights are tied, or when
    // several sessions attach to one model).
    std::vector<Candidate>& cands = t.candidates;
    cands.clear();
    t.reads.assign(cores.size(), CoreReads{});
    t.data.clear();
    const auto add_candidates = [&](std::size_t ci, const std::vector<std::size_t>& mods, bool direct) {
      for (const std::size_t m : mods) {
        std::size_t k = 0;
        while (k < cands.size() && !(cands[k].core == ci && cands[k].module == m)) ++k;
        if (k == cands.size()) cands.push_back(Candidate{ci, m, 0, 0});
        ++(direct ? cands[k].direct : cands[k].derived);
      }
    };
    const auto read = [&](std::size_t ci, const c10::TensorImpl* impl) {
      if (t.reads[ci].source == nullptr) t.reads[ci].source = impl;
      t.reads[ci].used.add(impl);
    };
    bool has_data = false;
    at::Tensor data_in;  // the first data input
    bool first_input = true;
    bool updates_owned = false;
    // An operator taking a parameter together with that parameter's own gradient is an
    // optimizer's (weight decay `grad + wd * p`, ...), whatever the grad mode.
    std::vector<const c10::TensorImpl*>& grads_of_owned = t.grads_of_owned;
    grads_of_owned.clear();
    for (const c10::IValue& v : inputs) {
      for_each_tensor(v, [&](const at::Tensor& x) {
        if (!x.defined() || !x.requires_grad()) return;
        for (const auto& c : cores) {
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
          t.data.push_back(impl);
          return;
        }
        bool module_tensor = false;
        for (std::size_t ci = 0; ci < cores.size(); ++ci) {
          const AttachCore& c = *cores[ci];
          const c10::TensorImpl* own = impl;
          auto it = c.owner.find(own);
          if (it == c.owner.end() && t.script_depth > 0 && (own = c.alias_of(x)) != nullptr) it = c.owner.find(own);
          if (it == c.owner.end()) continue;
          module_tensor = true;
          if (!grad_mode && !c.options.no_grad_forward()) continue;
          add_candidates(ci, it->second, /*direct=*/true);
          read(ci, own);
          updates_owned = updates_owned || (in_place && is_self);
        }
        if (module_tensor) return;
        for (const auto& d : t.derived) {
          if (d.core == 0 || !d.impl || d.impl->_unsafe_get_target() != impl || d.impl->expired()) continue;
          for (std::size_t ci = 0; ci < cores.size(); ++ci) {
            const AttachCore& c = *cores[ci];
            if (c.id != d.core) continue;
            module_tensor = true;
            if (!grad_mode && !c.options.no_grad_forward()) continue;  // as for its own tensors
            auto it = c.owner.find(d.source);
            if (it == c.owner.end()) continue;
            add_candidates(ci, it->second, /*direct=*/false);
            read(ci, d.source);
          }
        }
        if (module_tensor) return;
        if (std::find(grads_of_owned.begin(), grads_of_owned.end(), impl) != grads_of_owned.end()) {
          updates_owned = true;  // an optimizer's arithmetic, not a forward
        }
        has_data = true;
        if (!data_in.defined()) data_in = x;
        t.data.push_back(impl);
      });
    }
    if (updates_owned) {
      auto ctx = std::make_unique<OpCtx>();
      ctx->kind = OpCtx::Update;
      return ctx;
    }
    std::unique_ptr<OpCtx> ctx;
    const auto add = [&](Decision d) {
      if (!ctx) ctx = std::make_unique<OpCtx>();
      ctx->kind = OpCtx::Decided;
      ctx->add(std::move(d));
    };
    const auto reads_data = [&](const c10::TensorImpl* impl) {
      return impl != nullptr && std::find(t.data.begin(), t.data.end(), impl) != t.data.end();
    };
    // Sessions owning a tensor it reads: a module's operator. A call's pending output that no
    // session's operator continues is delivered first.
    std::vector<char>& keep = t.keep;
    keep.assign(t.pending.size(), 0);
    bool flush_others = false;
    for (std::size_t ci = 0; ci < cores.size() && !cands.empty(); ++ci) {
      // Tied tensors: the module whose kind fits the operator (an embedding lookup vs a
      // matmul), then the one whose own tensors the operator reads most (a bias outranks a
      // shared weight), then tensors derived from its own; among modules alike in all of
      // these, the one called least in this step, then the first registered.
      const AttachCore& core = *cores[ci];
      const AttachCore::Kind op_kind = AttachCore::kind_of_op(op_name);
      const auto rank = [&](const Candidate& c) {
        const std::size_t target = core.modules[c.module].forward_as;
        return std::make_tuple(AttachCore::kind_fit(core.modules[c.module].kind, op_kind), c.direct, c.derived,
                               -static_cast<int64_t>(core.calls(target)), -static_cast<int64_t>(c.module));
      };
      const Candidate* best = nullptr;
      for (std::size_t k = 0; k < cands.size(); ++k)
        if (cands[k].core == ci && (best == nullptr || rank(cands[k]) > rank(*best))) best = &cands[k];
      if (best == nullptr) continue;
      const std::shared_ptr<AttachCore>& owner = cores[ci];
      Decision d;
      d.core = owner;
      d.module = owner->modules[best->module].forward_as;
      if (!has_data) {
        d.kind = Decision::Weights;  // e.g. weight.t(): remember its output as the module's
        d.source = t.reads[ci].source;
      } else if (owner->modules[d.module].internal && best->module == d.module &&
                 op_name != "aten::_native_multi_head_attention") {  // the fused inference path: the output
        d.kind = Decision::Internal;  // what it consumes is delivered now
        flush_others = true;
        // The call's input is read here (MultiheadAttention's q/k/v projection), before the
        // operator that makes its output.
        if (!stashed_input(t, owner->id, d.module)) t.call_inputs.push_back(call_input(t, *owner, d.module, data_in));
      } else {
        d.kind = Decision::Forward;
        // The same module's operator on its pending output, reading module tensors the call
        // has not read yet, continues that call (`x @ w + b` as two operators); anything
        // else is a new call (`fc(a) + fc(b)`, `fc(fc(x))`).
        Pending* p = pending_of(t, owner.get());
        const bool continues = p != nullptr && p->module == d.module && p->out.defined() &&
                               reads_data(p->out.unsafeGetTensorImpl()) && !t.reads[ci].used.meets(p->used);
        if (continues) {
          keep[static_cast<std::size_t>(p - t.pending.data())] = 1;
        } else {
          flush_others = true;
          // A new call's data input: another delivery's output (its scale is known where it
          // was delivered), or a tensor whose moments are taken here (the model's input, noise,
          // a sum); the step's first call also reports the input's NaN and ±Inf.
          CallInput in;
          if (CallInput* stash = stashed_input(t, owner->id, d.module)) {
            in = std::move(*stash);
            *stash = std::move(t.call_inputs.back());
            t.call_inputs.pop_back();
          } else {
            in = call_input(t, *owner, d.module, data_in);
          }
          d.from = std::move(in.from);
          d.input = std::move(in.input);
        }
        d.used = t.reads[ci].used;
        if (owner->modules[d.module].batch_norm && (op_name == "aten::batch_norm" || op_name == "aten::_batch_norm_impl_index"))
          d.norm = capture_norm(*owner, d.module, inputs);
      }
      add(std::move(d));
    }
    if (flush_others)
      for (std::size_t i = 0; i < t.pending.size(); ++i)
        if (t.pending[i].core && !keep[i]) flush_pending(t, t.pending[i]);
    // Sessions whose module output it reads (pending, remembered, or a view of one).
    for (std::size_t ci = 0; ci < cores.size(); ++ci) {
      bool owns = false;
      for (std::size_t k = 0; k < cands.size() && !owns; ++k) owns = cands[k].core == ci;
      if (owns) continue;
      const std::shared_ptr<AttachCore>& core = cores[ci];
      std::size_t slot = t.outputs.size();
      // The module's pending output, as it returned it, is delivered now, and remembered.
      Pending* p = pending_of(t, core.get());
      if (p != nullptr && p->out.defined() && reads_data(p->out.unsafeGetTensorImpl())) {
        if (reshapes_pending(t, *core, *p, op_name, inputs)) {
          Decision d;
          d.core = core;
          d.kind = Decision::Reshape;
          d.module = p->module;
          d.call = p->call;
          d.follow_up = op_name == "aten::detach" ? 0 : 1;  // 0: the same values passed on
          add(std::move(d));
          continue;
        }
        slot = flush_pending(t, *p);
      }
      for (std::size_t i = 0; i < t.data.size() && slot == t.outputs.size(); ++i)
        slot = output_slot(t, core->id, t.data[i]);
      if (!grad_mode && !core->options.no_grad_forward()) continue;  // metrics, evaluation
      if (slot == t.outputs.size()) {
        // Data made from deliveries only, passed on (`drop(tok + pos)`, `(tok + pos) * s`), or
        // reduced from an activation's output (`tanh(enc(x)).mean(1)`; a view of one is
        // still that delivery, below).
        const bool reads_fed_data = !is_alias_op(op_name, t) && reads_fed(t, core->id);
        if (!fresh_op && (reads_made(t, core->id) || reads_fed_data) && made_from_deliveries(t, *core)) {
          Decision d;
          d.core = core;
          d.kind = Decision::Reader;
          d.made = true;
          add(std::move(d));
          continue;
        }
        // Other data written in place into data made from deliveries, or into a mask
        // (`q = pool(emb(ids)); q.add_(x)`): it holds that data now.
        if (in_place && data_in.defined() && !made_from_deliveries(t, *core)) {
          forget_written(t.mixed, core->id, data_in);
          forget_written(t.indexed, kIndexCore, data_in);
        }
        // Data made from deliveries concatenated with raw data (`cat({pool(emb(ids)), x})`)
        // before the model's input is taken: the raw data's moments go with it.
        if (!fresh_op && (reads_made(t, core->id) || reads_fed_data || reads_partial(t, core->id))) {
          if (auto raw = raw_part(t, *core, op_name, inputs)) {
            Decision d;
            d.core = core;
            d.kind = Decision::Reader;
            d.raw = std::move(raw);
            add(std::move(d));
            continue;
          }
        }
        // A view of an activation's delivered output (`relu(conv(x)).flatten(1)`) is still
        // that delivery, for the module call that reads it.
        if (fresh_op || !is_alias_op(op_name, t)) continue;
        std::size_t fed = t.fed.size();
        for (std::size_t i = 0; i < t.data.size() && fed == t.fed.size(); ++i) fed = fed_slot(t, core->id, t.data[i]);
        if (fed == t.fed.size()) continue;
        Decision d;
        d.core = core;
        d.kind = Decision::FedAlias;
        d.from = t.fed[fed].info;
        d.delivery = t.fed[fed].delivery;
        d.changed = changed_since(t.fed[fed]);
        add(std::move(d));
        continue;
      }
      const Derived seen = t.outputs[slot];
      const int op = core->options.activations() ? FollowUpOps::find(op_name) : -1;
      // An activation takes the output up, and every view of it (its output is delivered once
      // a call); a view or any other reader leaves it for an activation that comes later.
      if (op >= 0) {
        for (auto& o : t.outputs)
          if (o.core == seen.core && o.module == seen.module && o.call == seen.call) o = {};
      }
      Decision d;
      d.core = core;
      d.module = seen.module;
      d.call = seen.call;
      if (!fresh_op && is_alias_op(op_name, t)) {  // a view of it: an activation may follow
        d.kind = Decision::Alias;
        d.from = seen.info;
        d.delivery = seen.delivery;
        d.changed = changed_since(seen);
      } else if (op >= 0) {
        d.kind = Decision::Activation;
        d.follow_up = op;
        // Changed in place since delivered (`out += identity` before the ReLU, an action
        // mask's `masked_fill_(mask, -inf)` before `log_softmax`): the activation is still the
        // module's, of values user code changed (its "input_changed").
        d.changed = seen.impl && seen.version != kNoVersion &&
                    version_of(seen.impl->_unsafe_get_target()) != seen.version;
      } else {
        d.kind = Decision::Reader;
        d.made = made_from_deliveries(t, *core);
        if (!d.made && !fresh_op) d.raw = raw_part(t, *core, op_name, inputs);  // `cat({emb(ids), x})`
      }
      add(std::move(d));
    }
    return ctx;
  }

  /// Whether operator `op`, reading session `core`'s pending output `p`, is one of the
  /// reshapes Python's MultiheadAttention applies to its out_proj product before returning it
  /// (ModuleSpec::python_attention): `view` to (L, N, E), then `transpose` to (N, L, E) with
  /// `batch_first`, or `squeeze(1)` for an unbatched query (`inputs`: the operator's own). Inside TorchScript only; the graph
  /// executor's `detach` between subgraphs passes the output on at the same stage.
  static bool reshapes_pending(const Tls& t, const AttachCore& core, const Pending& p, std::string_view op,
                               at::ArrayRef<const c10::IValue> inputs) {
    if (t.script_depth == 0 || !core.modules[p.module].python_attention) return false;
    if (op == "aten::detach") return true;
    const int64_t dim = p.out.dim();
    if (p.reshaped == 0)
      return dim == 2 && (op == "aten::view" || op == "aten::reshape" || op == "aten::_unsafe_view" ||
                          op == "aten::_reshape_alias");
    if (p.reshaped == 1 && dim == 3) {
      if (op == "aten::transpose") return core.modules[p.module].batch_first;
      if (op == "aten::squeeze")  // squeeze(1), not a caller's squeeze(0) of one token
        return p.out.size(1) == 1 && inputs.size() == 2 && inputs[1].isInt() &&
               (inputs[1].toInt() == 1 || inputs[1].toInt() == -2);
    }
    return false;
  }
  /// At the end of a Reshape: `out` becomes the pending output when it is the reshape
  /// expected; anything else delivers the pending output as it was, and remembers `out` as a
  /// view of it.
  static void reshape_pending(Tls& t, const Decision& d, const at::Tensor& out) {
    Pending* p = pending_of(t, d.core.get());
    if (p == nullptr || p->module != d.module || p->call != d.call || !p->out.defined()) return;
    const at::Tensor& was = p->out;
    bool fits = false;
    uint8_t stage = p->reshaped;
    if (d.follow_up == 0) {  // a detached alias between subgraphs: the same stage
      fits = out.sizes() == was.sizes();
    } else if (p->reshaped == 0) {
      fits = out.dim() == 3 && out.size(0) * out.size(1) == was.size(0) && out.size(2) == was.size(1);
      stage = 1;
    } else if (p->reshaped == 1) {
      fits = (out.dim() == 3 && out.size(0) == was.size(1) && out.size(1) == was.size(0) && out.size(2) == was.size(2)) ||
             (out.dim() == 2 && was.size(1) == 1 && out.size(0) == was.size(0) && out.size(1) == was.size(2));
      stage = 2;
    }
    if (fits) {
      p->out = out;
      p->reshaped = stage;
      return;
    }
    const std::size_t slot = flush_pending(t, *p);
    if (slot == t.outputs.size()) return;
    const Derived seen = t.outputs[slot];
    remember_output(t, Derived{d.core->id, seen.module, seen.call, nullptr, weak_of(out), 0, seen.info, seen.delivery, 0, nullptr});
  }

  /// Whether operator `fn` reads a session's pending module output on this thread.
  static bool reads_pending(const at::RecordFunction& fn, const Tls& t) {
    bool any = false;
    for (const auto& p : t.pending) any = any || (p.core && p.out.defined());
    if (!any) return false;
    bool found = false;
    for (const c10::IValue& v : safe_inputs(fn)) {
      for_each_tensor(v, [&](const at::Tensor& x) {
        if (found || !x.defined()) return;
        for (const auto& p : t.pending)
          if (p.core && p.out.defined() && p.out.unsafeGetTensorImpl() == x.unsafeGetTensorImpl()) found = true;
      });
      if (found) return true;
    }
    return false;
  }

  /// At an Indexed operator's end: its output (unless boolean) joins Tls::indexed.
  static void finish_indexed(const at::RecordFunction& fn, Tls& t) {
    const at::Tensor out = first_output(fn);
    if (!out.defined() || out.scalar_type() == at::kBool) return;
    try {
      remember(t, t.indexed, Derived{kIndexCore, 0, 0, nullptr, weak_of(out), 0, nullptr, 0, 0, nullptr}, kOutputs);
    } catch (...) {
      // out of memory: the tensor counts as raw data, as before it was made
    }
  }

  /// At the operator's end: what each session decided is done with its output.
  static void finish(const at::RecordFunction& fn, OpCtx& ctx, Tls& t) {
    at::Tensor out;
    bool have_out = false;
    ctx.each([&](Decision& d) {
      if (d.kind == Decision::Internal) return;
      if (!have_out) {
        out = first_output(fn);
        have_out = true;
      }
      if (!out.defined()) return;
      try {
        switch (d.kind) {
          case Decision::Reader:
            if (d.made && out.is_floating_point())
              remember(t, t.mixed, Derived{d.core->id, 0, 0, nullptr, weak_of(out), 0, nullptr, 0, 0, nullptr}, kOutputs);
            else if (d.raw && out.is_floating_point())
              remember(t, t.partial, Derived{d.core->id, 0, 0, nullptr, weak_of(out), 0, nullptr, 0, 0, d.raw}, kOutputs);
            break;
          case Decision::Weights:
            remember(t, t.derived, Derived{d.core->id, d.module, 0, d.source, weak_of(out), 0, nullptr, 0, 0, nullptr}, kDerived);
            break;
          case Decision::Forward:
            forward_output(t, d, out);
            break;
          case Decision::Reshape:
            reshape_pending(t, d, out);
            break;
          case Decision::Alias: {
            const std::size_t slot =
                remember_output(t, Derived{d.core->id, d.module, d.call, nullptr, weak_of(out), 0, d.from, d.delivery, 0, nullptr});
            if (d.changed) t.outputs[slot].version = kNoVersion;  // a view of changed values
            break;
          }
          case Decision::FedAlias: {
            const std::size_t slot =
                remember(t, t.fed, Derived{d.core->id, 0, 0, nullptr, weak_of(out), 0, d.from, d.delivery, 0, nullptr}, kOutputs);
            if (d.changed) t.fed[slot].version = kNoVersion;
            break;
          }
          case Decision::Activation: {
            auto f = d.core->delivery_info(d.module, d.follow_up, d.call);
            if (d.changed) {
              Metadata md = f->md;
              md.emplace("input_changed", "1");
              d.core->send(d.module, f->name, out, true, md);
            } else {
              d.core->send(d.module, f->name, out, true, f->md);
            }
            remember(t, t.fed, Derived{d.core->id, d.module, d.call, nullptr, weak_of(out), 0, std::move(f), 0, 0, nullptr}, kOutputs);
            break;
          }
          default:
            break;
        }
      } catch (...) {
        // out of memory for a name: the delivery is lost, the operator is not
      }
    });
  }

 private:
  /// Whether any tensor among `inputs` is a session's module tensor (inside TorchScript, or a
  /// detached alias of one: ModuleTable::alias_of), or one this thread
  /// holds for a session: a pending output, a remembered output or weight view, an
  /// activation's delivered output. Without one, attribute() decides nothing.
  static bool reads_known(at::ArrayRef<const c10::IValue> inputs, const Tls& t, const CoreList& cores) {
    bool known = false;
    for (const c10::IValue& v : inputs) {
      for_each_tensor(v, [&](const at::Tensor& x) {
        if (known || !x.defined()) return;
        const c10::TensorImpl* impl = x.unsafeGetTensorImpl();
        for (const auto& c : cores)
          if (c->owner.count(impl) != 0 || (t.script_depth > 0 && c->alias_of(x) != nullptr)) {
            known = true;  // inside TorchScript, a detached alias of a module tensor too
            return;
          }
        known = held(t, impl);
      });
      if (known) return true;
    }
    return false;
  }
  static bool held(const Tls& t, const c10::TensorImpl* impl) {
    for (const auto& p : t.pending)
      if (p.core && p.out.defined() && p.out.unsafeGetTensorImpl() == impl) return true;
    for (const std::vector<Derived>* list : {&t.outputs, &t.derived, &t.fed, &t.mixed, &t.partial})
      for (const Derived& d : *list)
        if (d.core != 0 && d.impl && d.impl->_unsafe_get_target() == impl) return true;
    return false;
  }
  /// Whether the operator's data inputs include a tensor made from deliveries of `core`.
  static bool reads_made(const Tls& t, uint64_t core) {
    for (const c10::TensorImpl* impl : t.data)
      if (slot_of(t.mixed, core, impl) < t.mixed.size()) return true;
    return false;
  }
  /// Whether the operator's data inputs include a tensor of `core` mixed from deliveries and
  /// raw data (Tls::partial).
  static bool reads_partial(const Tls& t, uint64_t core) {
    if (t.partial.empty()) return false;
    for (const c10::TensorImpl* impl : t.data)
      if (slot_of(t.partial, core, impl) < t.partial.size()) return true;
    return false;
  }
  /// Where operator `op` concatenates data of session `core` made from deliveries
  /// (Tls::mixed, a delivery, or a concatenation so made before: Tls::partial) with raw
  /// floating data, before the step's model input is taken: the raw data's moments, those of
  /// every raw floating input and of the partial inputs' raw parts together (host tensors
  /// only: nothing on a device is read here). A view or a dropout of such a concatenation
  /// keeps them. Null for anything else: arithmetic on the mix (`emb(ids) + x`, a division
  /// by lengths, a scale, `nan_to_num`) makes data judged whole, as the call reads it.
  static std::shared_ptr<const Moments> raw_part(const Tls& t, const AttachCore& core, std::string_view op,
                                                 at::ArrayRef<const c10::IValue> inputs) {
    if (!core.input_due.load(std::memory_order_relaxed)) return nullptr;
    const bool joins = op == "aten::cat" || op == "aten::_cat" || op == "aten::concat" ||
                       op == "aten::concatenate" || op == "aten::stack" || op == "aten::hstack" ||
                       op == "aten::vstack" || op == "aten::column_stack" || op == "aten::dstack";
    const bool keeps = is_alias_op(op, t) || op == "aten::dropout" || op == "aten::feature_dropout" ||
                       op == "aten::alpha_dropout" || op == "aten::feature_alpha_dropout";
    if (!joins && !keeps) return nullptr;
    bool delivered = false, raw = false, ok = true;
    Moments sum;
    bool any_moments = false;
    std::vector<at::Tensor> raws;
    std::vector<const c10::TensorImpl*> seen;  // an operand passed twice (`x * x`) counts once
    for (const c10::IValue& v : inputs) {
      for_each_tensor(v, [&](const at::Tensor& x) {
        if (!ok || !x.defined() || !x.is_floating_point()) return;
        const c10::TensorImpl* impl = x.unsafeGetTensorImpl();
        if (std::find(t.data.begin(), t.data.end(), impl) == t.data.end()) return;  // a module tensor
        if (std::find(seen.begin(), seen.end(), impl) != seen.end()) return;
        seen.push_back(impl);
        const std::size_t p = slot_of(t.partial, core.id, impl);
        if (p < t.partial.size()) {
          delivered = true;
          if (t.partial[p].raw) {
            sum.merge(*t.partial[p].raw);
            any_moments = true;
          }
          return;
        }
        if (delivered_data(t, core, impl)) {
          delivered = true;
        } else if (slot_of(t.indexed, kIndexCore, impl) == t.indexed.size()) {
          if (!x.is_cpu() || core.defers(x)) ok = false;
          raw = true;
          raws.push_back(x);
        }
      });
    }
    if (!ok || !delivered || !(raw || any_moments) || (keeps && raw)) return nullptr;
    DeliveringScope scope;
    at::NoGradGuard no_grad;
    try {
      for (const at::Tensor& x : raws) {
        sum.merge(compute_moments(x.detach(), /*signs=*/false));
        any_moments = true;
      }
    } catch (...) {
      return nullptr;
    }
    if (!any_moments) return nullptr;
    return std::make_shared<const Moments>(sum);
  }
  /// Forgets the entries of `list` (Tls::mixed, Tls::indexed) of session `core` that share
  /// `self`'s storage: an operator wrote other data into it in place.
  static void forget_written(std::vector<Derived>& list, uint64_t core, const at::Tensor& self) {
    if (!self.defined() || !self.has_storage()) return;
    const void* storage = self.storage().unsafeGetStorageImpl();
    for (Derived& d : list) {
      if (d.core != core || !d.impl || d.impl->expired()) continue;
      const c10::TensorImpl* impl = d.impl->_unsafe_get_target();
      if (impl->has_storage() && impl->storage().unsafeGetStorageImpl() == storage) d = {};
    }
  }
  /// Whether the operator's data inputs include an activation's delivered output of `core`
  /// (Tls::fed).
  static bool reads_fed(const Tls& t, uint64_t core) {
    for (const c10::TensorImpl* impl : t.data)
      if (fed_slot(t, core, impl) < t.fed.size()) return true;
    return false;
  }
  /// Whether every floating data input of the operator is a delivery of `core` (pending, a
  /// module's or an activation's output, a view of one), made from deliveries only, or a
  /// mask or a length (Tls::indexed), with one delivery at least: then
  /// its output is made from deliveries, and a call reading it does not take the model's
  /// input. One raw floating input (`emb(ids) + x`) makes it the model's input still.
  static bool made_from_deliveries(const Tls& t, const AttachCore& core) {
    bool any = false;
    for (const c10::TensorImpl* impl : t.data) {
      if (impl == nullptr || !c10::isFloatingType(c10::typeMetaToScalarType(impl->dtype()))) continue;
      const bool known = delivered_data(t, core, impl);
      any = any || known;
      if (!known && slot_of(t.indexed, kIndexCore, impl) == t.indexed.size()) return false;
    }
    return any;
  }

  /// Whether `impl` is session `core`'s delivery (pending, a module's or an activation's
  /// output, a view of one) or data made from deliveries only (Tls::mixed).
  static bool delivered_data(const Tls& t, const AttachCore& core, const c10::TensorImpl* impl) {
    if (slot_of(t.outputs, core.id, impl) < t.outputs.size() || slot_of(t.fed, core.id, impl) < t.fed.size() ||
        slot_of(t.mixed, core.id, impl) < t.mixed.size())
      return true;
    for (const auto& p : t.pending)
      if (p.core.get() == &core && p.out.defined() && p.out.unsafeGetTensorImpl() == impl) return true;
    return false;
  }

  /// An operator that reads no session's tensor and makes a mask or a length: it reads only
  /// boolean tensors (`ids != 0`) and tensors made so (Tls::indexed: `(ids != 0).sum(1)`,
  /// its `to(kFloat)`), or makes constants (`ones`, `full`, `arange`, `zeros_like(ids)`).
  /// Its output (unless boolean) is remembered there at its end. Null for any other: integer
  /// data converted in the step (counts, pixels, `ids.to(kFloat)`) is data, and so is noise.
  static std::unique_ptr<OpCtx> index_derived(std::string_view op, at::ArrayRef<const c10::IValue> inputs,
                                              Tls& t) {
    static constexpr std::string_view kAten = "aten::";
    if (op.substr(0, kAten.size()) != kAten) return nullptr;
    const std::string_view name = op.substr(kAten.size());
    const auto constant = [&] {
      if (name.find("rand") != std::string_view::npos || name.find("normal") != std::string_view::npos ||
          name.find("bernoulli") != std::string_view::npos || name.find("empty") != std::string_view::npos)
        return false;  // noise is data; `empty` is filled by what follows (torch::tensor's copy)
      // (not `scalar_tensor`: `torch::tensor(x)` of a host value makes one)
      for (const std::string_view f : {"ones", "zeros", "full", "arange", "range", "linspace", "logspace", "eye",
                                       "ones_like", "zeros_like", "full_like", "new_ones", "new_zeros", "new_full"})
        if (name == f) return true;
      return false;
    };
    bool any = false, only = true;
    for (const c10::IValue& v : inputs) {
      for_each_tensor(v, [&](const at::Tensor& x) {
        if (!only || !x.defined()) return;
        any = true;
        if (x.scalar_type() == at::kBool) return;
        only = !t.indexed.empty() && slot_of(t.indexed, kIndexCore, x.unsafeGetTensorImpl()) < t.indexed.size();
      });
      if (!only) break;
    }
    // Most operators read floating data: one look at their name's ending then.
    const bool templated = name.size() > 5 && (name.substr(name.size() - 5) == "_like" || name.substr(0, 4) == "new_");
    if (any && !only && !templated) {
      // Data written in place into a mask's storage (`buf = zeros(...); buf.copy_(x)`) makes
      // it data.
      if (!t.indexed.empty() && !name.empty() && name.back() == '_' && !inputs.empty() && inputs[0].isTensor())
        forget_written(t.indexed, kIndexCore, inputs[0].toTensor());
      return nullptr;
    }
    if (!(any && only) && !constant()) return nullptr;
    auto ctx = std::make_unique<OpCtx>();
    ctx->kind = OpCtx::Indexed;
    return ctx;
  }

  /// Where a new call of module `m` of `core` takes its data input `x` from: another
  /// delivery's output, or the moments measured here (the step's first call: the model's
  /// input, with its NaN and ±Inf counted).
  static CallInput call_input(const Tls& t, AttachCore& core, std::size_t m, const at::Tensor& x) {
    CallInput in{core.id, m, nullptr, std::nullopt};
    if (x.defined()) in.from = delivered_as(t, core, x.unsafeGetTensorImpl());
    if (!in.from && x.defined() && x.is_floating_point()) {
      // The step's model input: its first call on floating data (not token ids), unless that
      // data was made from deliveries alone (`tok(ids) + pos(t)`).
      const bool made = slot_of(t.mixed, core.id, x.unsafeGetTensorImpl()) < t.mixed.size();
      const bool model_input = !made && core.input_due.exchange(false);
      in.input = input_moments(core, x, model_input);
      // Mixed from deliveries and raw data: the raw data is the model's input.
      const std::size_t p = slot_of(t.partial, core.id, x.unsafeGetTensorImpl());
      if (model_input && in.input && p < t.partial.size()) in.input->raw = t.partial[p].raw;
    }
    // Whether the rows of the input as the call reads it (a view of a delivery may put
    // another axis first) are alike: within 1e-4 of their largest magnitude, two rows at up to
    // 64 positions (no device sync: host tensors only).
    if (const auto alike = first_rows_alike(x, 0.0, 1e-4)) {
      if (!in.input) in.input.emplace();
      in.input->alike = alike;
    }
    return in;
  }
  /// A BatchNorm call's running statistics before it updates them (norm_stats.hpp).
  static std::optional<NormCapture> capture_norm(const AttachCore& core, std::size_t m,
                                                 at::ArrayRef<const c10::IValue> inputs) {
    int64_t tracked = -1;
    if (const auto& nbt = core.modules[m].batches_tracked) {
      const at::Tensor n(nbt->lock());
      if (!n.defined() || !n.is_cpu() || n.numel() != 1) return std::nullopt;
      switch (n.scalar_type()) {  // a model moved to another dtype may have converted it
        case at::kLong:
          tracked = *n.data_ptr<int64_t>();
          break;
        case at::kInt:
          tracked = *n.data_ptr<int32_t>();
          break;
        case at::kDouble:
          tracked = static_cast<int64_t>(*n.data_ptr<double>());
          break;
        case at::kFloat:
          tracked = static_cast<int64_t>(*n.data_ptr<float>());
          break;
        default:
          return std::nullopt;
      }
    }
    DeliveringScope scope;  // its copies are no forward operators
    return capture_batch_norm(inputs, tracked, core.norm_history(m));
  }
  static CallInput* stashed_input(Tls& t, uint64_t core, std::size_t m) {
    for (auto& c : t.call_inputs)
      if (c.core == core && c.module == m) return &c;
    return nullptr;
  }

  /// The moments of a module call's data input, on the host or packed on its device.
  static std::optional<AttachCore::InputMoments> input_moments(const AttachCore& core, const at::Tensor& x,
                                                               bool model_input) {
    DeliveringScope scope;
    at::NoGradGuard no_grad;  // a strided input's copy records no autograd node
    try {
      AttachCore::InputMoments in;
      in.model_input = model_input;
      if (core.defers(x)) {
        in.packed = pack_moments(x.detach());  // no sync: comes with the batch
      } else {
        in.host = compute_moments(x, /*signs=*/false);  // the RMS only; reads the data, records nothing
      }
      return in;
    } catch (...) {
      return std::nullopt;
    }
  }

  /// A module operator's output: the session's pending call goes on, or a new call begins.
  static void forward_output(Tls& t, Decision& d, at::Tensor out) {
    Pending* cur = pending_of(t, d.core.get());
    std::optional<NormError> norm;
    if (d.norm) {
      DeliveringScope scope;
      norm = batch_norm_error(*d.norm);
    }
    if (cur != nullptr && cur->module == d.module) {  // the same call goes on
      cur->reshaped = 0;
      if (d.input) cur->input = std::move(*d.input);
      if (norm) cur->input.norm = norm;
      for (std::size_t i = 0; i < d.used.size; ++i) cur->used.add(d.used.items[i]);
      cur->out = std::move(out);
      return;
    }
    if (cur != nullptr) flush_pending(t, *cur);
    Pending& p = cur != nullptr ? *cur : free_pending(t);
    p.used = d.used;
    p.core = d.core;
    p.module = d.module;
    p.call = d.core->next_call(d.module);
    d.core->forward_thread.store(thread_token(), std::memory_order_relaxed);
    if (std::find(t.forward_cores.begin(), t.forward_cores.end(), d.core->id) == t.forward_cores.end())
      t.forward_cores.push_back(d.core->id);
    // A new iteration after a pass that brought this session no gradient.
    if (p.call == 0 && d.core->no_gradient_pass.load(std::memory_order_relaxed) &&
        d.core->no_gradient_pass.exchange(false))
      d.core->warn_no_gradient();
    p.info = d.core->delivery_info(d.module, -1, p.call, d.from.get());
    p.input = d.input.value_or(AttachCore::InputMoments{});
    p.input.norm = norm;
    p.out = std::move(out);
  }
};

}  // namespace torchdbg::detail
