// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The forward observer's per-thread state and helpers.

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchdbg/attach/core.hpp"
#include "torchdbg/attach/operators.hpp"

namespace torchdbg::detail {

/// The forward observer's thread-local state and the operator helpers it uses: which module
/// outputs are pending on this thread (one per session), the outputs and weight views it
/// remembers, and the context an operator's start hands to its end.
class ObserverState {
 protected:
  /// A few tensor identities (the module tensors one call reads); beyond capacity, the
  /// extra ones are not remembered.
  struct TensorSet {
    std::array<const c10::TensorImpl*, 8> items{};
    std::size_t size = 0;
    void add(const c10::TensorImpl* p) {
      if (!contains(p) && size < items.size()) items[size++] = p;
    }
    [[nodiscard]] bool contains(const c10::TensorImpl* p) const {
      return std::find(items.begin(), items.begin() + static_cast<std::ptrdiff_t>(size), p) !=
             items.begin() + static_cast<std::ptrdiff_t>(size);
    }
    [[nodiscard]] bool meets(const TensorSet& o) const {
      for (std::size_t i = 0; i < size; ++i)
        if (o.contains(items[i])) return true;
      return false;
    }
  };
  struct Pending {
    std::shared_ptr<AttachCore> core;
    std::size_t module = 0;
    uint32_t call = 0;  // the module's call index in the step
    std::shared_ptr<const DeliveryInfo> info;  // the delivery's name and metadata
    TensorSet used;  // the module's tensors its operators read so far in this call
    at::Tensor out;
    AttachCore::InputMoments input;
    /// Python's MultiheadAttention: how many of its forward's own reshapes of the product
    /// (view, then transpose or squeeze) `out` has gone through (Decision::Reshape).
    uint8_t reshaped = 0;
  };
  struct Derived {
    uint64_t core = 0;  // AttachCore::id; 0: empty
    std::size_t module = 0;  // alias: the module whose output it views
    uint32_t call = 0;       // alias: that output's call
    /// Weights: the module-registered tensor this one is derived from (`weight.t()`).
    const c10::TensorImpl* source = nullptr;
    std::optional<WeakImpl> impl;
    uint64_t seq = 0;  // when remembered: the oldest of a session is forgotten first
    std::shared_ptr<const DeliveryInfo> info;  // outputs, fed: the delivery it is (a view of)
    uint64_t delivery = 0;  // outputs, fed: which delivery (a view keeps its source's)
    uint32_t version = 0;   // the tensor's version when remembered (in-place changes since)
    /// Tls::partial: the moments of the raw data mixed in (host values).
    std::shared_ptr<const Moments> raw;
  };
  /// A module an operator's tensors point to: through tensors it registered itself (direct)
  /// or through tensors derived from them (`weight.t()`).
  struct Candidate {
    std::size_t core = 0;  // index in the observer's list of sessions
    std::size_t module = 0;
    int direct = 0;
    int derived = 0;
  };
  /// What an operator reads of one session's tensors.
  struct CoreReads {
    TensorSet used;                           // every module tensor of it read
    const c10::TensorImpl* source = nullptr;  // the first, for Weights
  };
  /// Where a module call's data input came from (Decision::from, Decision::input).
  struct CallInput {
    uint64_t core = 0;
    std::size_t module = 0;
    std::shared_ptr<const DeliveryInfo> from;
    std::optional<AttachCore::InputMoments> input;
  };
  /// How many operators ran inside each decided operator the last time (keyed by its name's
  /// address, which the operator's schema owns), for ForwardObserver::quiet_inside. Bounded:
  /// a new operator beyond kSize replaces the oldest entry.
  class InnerOps {
   public:
    void begin(const void* key) {
      running_ = 0;
      key_ = key;
    }
    void count() { ++running_; }
    void end(const void* key) {
      if (key != key_) return;
      key_ = nullptr;
      for (auto& e : entries_)
        if (e.first == key) {
          e.second = running_;
          return;
        }
      entries_[next_] = {key, running_};
      next_ = (next_ + 1) % kSize;
    }
    [[nodiscard]] uint32_t last(const void* key) const {
      for (const auto& e : entries_)
        if (e.first == key) return e.second;
      return 0;
    }

   private:
    static constexpr std::size_t kSize = 32;
    std::array<std::pair<const void*, uint32_t>, kSize> entries_{};
    std::size_t next_ = 0;
    const void* key_ = nullptr;
    uint32_t running_ = 0;
  };

  struct Tls {
    int backward_depth = 0;
    int skip_depth = 0;
    /// TorchScript functions begun on this thread and not ended (RecordScope::
    /// TORCHSCRIPT_FUNCTION). Atomic: a function that waits on a `torch.jit.fork` future ends
    /// on the thread that resumes it, which counts it down here.
    std::atomic<int> script_depth{0};
    InnerOps inner_ops;
    /// The output of each session's module call not delivered yet (its operators may go on:
    /// `x @ w + b`); several sessions attached to one model each have theirs.
    std::vector<Pending> pending;
    /// Recent module outputs already delivered, and views of them (`fc(x).view(...)`,
    /// `.transpose(...)`): an activation applied to one later, whatever ran in between, is
    /// still "<module>/<activation>". Up to kOutputs a session; its oldest is forgotten first.
    std::vector<Derived> outputs;
    /// Tensors derived from a module's weights alone (`weight.t()`), up to kDerived a session.
    std::vector<Derived> derived;
    /// Activations' outputs delivered, and views of them, up to kOutputs a session: a module
    /// call reading one is told where its input came from ("input_from").
    std::vector<Derived> fed;
    /// Outputs of other operators reading a module's delivered output (`tok(ids) + pos(t)`),
    /// up to kOutputs a session: a module call reading one does not take the model's input.
    std::vector<Derived> mixed;
    /// Concatenations of such data with raw data (`cat({pool(emb(ids)), x})`, and views or
    /// dropouts of one) made before the step's model input was taken, up to kOutputs a
    /// session, with the raw data's moments (Derived::raw): a call reading one takes the
    /// model's input, and the input's NaN/Inf counts and scale are the raw data's, not those of
    /// what the deliveries add (a sum over a sequence whose length changes from batch to batch).
    std::vector<Derived> partial;
    /// Masks and lengths: tensors made from boolean ones or constants alone
    /// (`(ids != 0).to(kFloat)`, `(ids != 0).sum(1)`, `ones({b, t}).masked_fill(ids == 0, 0)`,
    /// and what operators make of those alone), the kOutputs latest, under kIndexCore: they
    /// hold no data of their own, so a delivery masked or divided by one (a masked mean over
    /// token embeddings) is still made from deliveries.
    std::vector<Derived> indexed;
    /// The input of a call whose first operators are internal (MultiheadAttention's q/k/v
    /// projection), until the operator that makes its output.
    std::vector<CallInput> call_inputs;
    uint64_t seq = 0;
    /// Sessions that made a call on this thread since a backward pass last began here.
    std::vector<uint64_t> forward_cores;
    /// The observed sessions as this thread last read them, and the observer's generation
    /// then (ForwardObserver::sessions): one atomic load per operator instead of a shared_ptr
    /// copy. Held until the thread's next operator after a change.
    std::shared_ptr<const std::vector<std::shared_ptr<AttachCore>>> sessions;
    uint64_t sessions_generation = 0;  // 0: never read
    bool sessions_no_grad = false;     // some session observes no-grad forwards
    // on_start's scratch, kept allocated
    std::vector<const c10::TensorImpl*> grads_of_owned;
    std::vector<Candidate> candidates;
    std::vector<char> keep;  // per pending output: an operator continues its call
    std::vector<CoreReads> reads;                   // per session
    std::vector<const c10::TensorImpl*> data;       // the data inputs (and templates' tensors)
  };
  /// What one session makes of an operator.
  /// Forward: an operator of a module's call; its output becomes the call's pending output.
  /// Weights: an operator on a module's tensors alone (`weight.t()`); its output is remembered.
  /// Internal: a step inside a module's forward that is not its output (Module::internal).
  /// Activation: a follow-up operator on a module's output ("<module>/<op>").
  /// Alias: a view-like operator on a module's output; its output joins Tls::outputs.
  /// Reader: another operator reading a remembered module output (a loss, dropout, a copy).
  /// FedAlias: a view-like operator on an activation's delivered output; its output joins
  /// Tls::fed.
  /// Reshape: Python's MultiheadAttention reshaping its pending output before it returns it
  /// (Attribution::reshapes_pending); its output becomes the pending output.
  struct Decision {
    enum Kind { Forward, Weights, Internal, Activation, Alias, Reader, FedAlias, Reshape } kind = Reader;
    std::shared_ptr<AttachCore> core;
    std::size_t module = 0;
    uint32_t call = 0;                        // Activation, Alias: the call of the module's output
    const c10::TensorImpl* source = nullptr;  // Weights
    TensorSet used;                           // Forward: the module tensors it reads
    int follow_up = -1;                       // Activation: index in FollowUpOps; Reshape: 0 a detach
    std::optional<AttachCore::InputMoments> input;
    /// Forward: the delivery whose output is the call's data input; Alias, FedAlias: the
    /// delivery it views.
    std::shared_ptr<const DeliveryInfo> from;
    uint64_t delivery = 0;  // Alias, FedAlias: the delivery it views (Derived::delivery)
    bool changed = false;   // Alias, FedAlias: what it views changed in place since delivered;
                            // Activation: its input did
    std::optional<NormCapture> norm;  // Forward: a BatchNorm's running statistics before its update
    bool made = false;  // Reader: its floating data inputs are all deliveries (or made from them)
    std::shared_ptr<const Moments> raw;  // Reader: it joins deliveries with raw data (Tls::partial)
  };
  /// Backward: an autograd node. Update: an in-place update of a module's own tensor or an
  /// optimizer's arithmetic. Decided: what each session that sees the operator makes of it.
  /// The operators an Update or Decided one runs inside (`mul_` calling `mul` with a wrapped
  /// scalar, cross_entropy's log_softmax) are its own and not looked at.
  struct OpCtx : at::ObserverContext {
    /// Indexed: an operator making a mask, a length or a constant (Attribution::
    /// index_derived); its output joins Tls::indexed.
    enum Kind { Backward, Update, Decided, Script, Indexed } kind = Backward;
    bool quiet_inside = false;  // RecordFunction is off on this thread until it ends
    std::atomic<int>* script_depth = nullptr;  // Script: the count of the thread it began on
    Decision first;              // the first session's
    std::vector<Decision> more;  // further sessions' (several attached to one model)
    std::size_t count = 0;
    void add(Decision d) {
      if (count++ == 0) {
        first = std::move(d);
      } else {
        more.push_back(std::move(d));
      }
    }
    template <typename F>
    void each(F&& f) {
      if (count > 0) f(first);
      for (auto& d : more) f(d);
    }
  };

  static constexpr std::size_t kOutputs = 8;
  static constexpr std::size_t kDerived = 16;
  /// Tls::indexed's entries' session id (no session's: ids count from 1).
  static constexpr uint64_t kIndexCore = ~uint64_t{0};

  static Tls& tls() {
    thread_local Tls t;
    return t;
  }

  /// A view-like operator (is_view_like_op): a module's output seen through it is still that
  /// module's.
  static bool is_alias_op(std::string_view op) { return is_view_like_op(op); }
  /// is_alias_op, and inside TorchScript `aten::detach` too: the graph executor hands a
  /// differentiable subgraph detached aliases of its inputs (one module's output goes to the
  /// activation after it through one).
  static bool is_alias_op(std::string_view op, const Tls& t) {
    return is_alias_op(op) || (t.script_depth > 0 && op == "aten::detach");
  }

  /// Session `core`'s pending output on this thread, or null.
  static Pending* pending_of(Tls& t, const AttachCore* core) {
    for (auto& p : t.pending)
      if (p.core.get() == core && core != nullptr) return &p;
    return nullptr;
  }
  /// A free pending slot for a new call.
  static Pending& free_pending(Tls& t) {
    for (auto& p : t.pending)
      if (!p.core) return p;
    return t.pending.emplace_back();
  }
  /// Delivers every pending output on this thread.
  static void flush_all(Tls& t) {
    for (auto& p : t.pending)
      if (p.core) flush_pending(t, p);
  }
  /// Delivers the pending output `which` and remembers it among Tls::outputs; returns its slot
  /// there (outputs.size() when nothing was pending).
  static std::size_t flush_pending(Tls& t, Pending& which) {
    Pending p = std::move(which);
    which = {};
    if (!p.core || !p.out.defined() || !p.info) return t.outputs.size();
    const std::size_t slot =
        remember_output(t, Derived{p.core->id, p.module, p.call, nullptr, weak_of(p.out), 0, p.info, 0, 0, nullptr});
    p.core->send(p.module, p.info->name, p.out, true, p.info->md, nullptr, std::move(p.input));
    return slot;
  }
  static std::size_t remember_output(Tls& t, Derived d) { return remember(t, t.outputs, std::move(d), kOutputs); }
  /// Puts `d` into `list`, forgetting its session's oldest entry when it holds `per_session`
  /// of them; returns its slot.
  static std::size_t remember(Tls& t, std::vector<Derived>& list, Derived d, std::size_t per_session) {
    d.seq = ++t.seq;
    if (d.delivery == 0) d.delivery = d.seq;
    if (d.impl) d.version = version_of(d.impl->_unsafe_get_target());
    std::size_t n = 0, oldest = list.size(), free = list.size();
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (list[i].core == 0) {
        if (free == list.size()) free = i;
      } else if (list[i].core == d.core) {
        ++n;
        if (oldest == list.size() || list[i].seq < list[oldest].seq) oldest = i;
      }
    }
    const std::size_t slot = n >= per_session ? oldest : free;
    if (slot == list.size()) {
      list.push_back(std::move(d));
    } else {
      list[slot] = std::move(d);
    }
    return slot;
  }
  /// The slot of `list` (Tls::outputs, Tls::fed) holding session `core`'s tensor `impl`, or
  /// list.size().
  static std::size_t slot_of(const std::vector<Derived>& list, uint64_t core, const c10::TensorImpl* impl) {
    for (std::size_t i = 0; i < list.size(); ++i) {
      const Derived& o = list[i];
      if (o.core == core && o.impl && o.impl->_unsafe_get_target() == impl && !o.impl->expired()) return i;
    }
    return list.size();
  }
  static std::size_t output_slot(const Tls& t, uint64_t core, const c10::TensorImpl* impl) {
    return slot_of(t.outputs, core, impl);
  }
  static std::size_t fed_slot(const Tls& t, uint64_t core, const c10::TensorImpl* impl) {
    return slot_of(t.fed, core, impl);
  }
  /// The delivery of session `core` that `impl` is, or is a view of: its pending output, a
  /// remembered module output, or an activation's delivered output; null when none.
  /// Null also when the tensor changed in place since it was delivered (`y += x`), or when
  /// a later delivery has the same name and call (a backward pass restarted the counts and the
  /// module ran again): the name would point at other values.
  static std::shared_ptr<const DeliveryInfo> delivered_as(const Tls& t, const AttachCore& core,
                                                          const c10::TensorImpl* impl) {
    for (const auto& p : t.pending)
      if (p.core.get() == &core && p.out.defined() && p.out.unsafeGetTensorImpl() == impl) return p.info;
    const Derived* e = nullptr;
    const std::size_t slot = output_slot(t, core.id, impl);
    if (slot < t.outputs.size()) {
      e = &t.outputs[slot];
    } else if (const std::size_t fed = fed_slot(t, core.id, impl); fed < t.fed.size()) {
      e = &t.fed[fed];
    }
    if (e == nullptr || !e->info || changed_since(*e)) return nullptr;
    const DeliveryInfo* base = e->info->base;
    const auto newer = [&](const Derived& o) {
      return o.core == core.id && o.info && o.info->base == base && o.delivery > e->delivery;
    };
    for (const auto& p : t.pending)
      if (p.core.get() == &core && p.info && p.info->base == base) return nullptr;
    for (const auto& o : t.outputs)
      if (newer(o)) return nullptr;
    for (const auto& o : t.fed)
      if (newer(o)) return nullptr;
    return e->info;
  }
  static constexpr uint32_t kNoVersion = 0xffffffffu;
  /// Whether the tensor remembered in `d` changed in place since (or has no version).
  static bool changed_since(const Derived& d) {
    return !d.impl || d.version == kNoVersion || version_of(d.impl->_unsafe_get_target()) != d.version;
  }
  /// A tensor's version counter (inference tensors have none: kNoVersion).
  static uint32_t version_of(const c10::TensorImpl* impl) {
    try {
      return impl->version_counter().current_version();
    } catch (...) {
      return kNoVersion;
    }
  }

  /// This thread's token (AttachCore::forward_thread): unique among live threads.
  static std::uintptr_t thread_token() { return reinterpret_cast<std::uintptr_t>(&tls()); }

  static at::ArrayRef<const c10::IValue> safe_inputs(const at::RecordFunction& fn) {
#ifndef NDEBUG
    const_cast<at::RecordFunction&>(fn).*record_function_inputs_valid() = true;  // see above
#endif
    try {
      return own_values(fn, fn.inputs(), /*returns=*/false);
    } catch (...) {
      return {};
    }
  }

  /// The operator's own values among `all`. The TorchScript interpreter runs an operator on
  /// its whole stack, and RecordFunction shows that stack (Dispatcher::callBoxed): values a
  /// loop carries sit below the operator's arguments, and below its results. Inside
  /// TorchScript the operator's own are the last of them, as many as its schema names.
  static at::ArrayRef<const c10::IValue> own_values(const at::RecordFunction& fn,
                                                     at::ArrayRef<const c10::IValue> all, bool returns) {
    if (tls().script_depth == 0) return all;
    // Arity by operator (the schema's name string, one per overload): read once per thread.
    thread_local std::unordered_map<const void*, std::pair<std::size_t, std::size_t>> arity;
    auto it = arity.find(fn.name());
    if (it == arity.end()) {
      const auto schema = fn.operator_schema();
      const std::size_t unknown = std::numeric_limits<std::size_t>::max();
      it = arity
               .emplace(fn.name(), schema ? std::make_pair(schema->arguments().size(), schema->returns().size())
                                          : std::make_pair(unknown, unknown))
               .first;
    }
    const std::size_t n = returns ? it->second.second : it->second.first;
    return n < all.size() ? all.slice(all.size() - n) : all;
  }

  template <typename F>
  static void for_each_tensor(const c10::IValue& v, F&& f) {
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isTensorList()) {
      const std::vector<at::Tensor> list = v.toTensorList().vec();
      for (const at::Tensor& t : list) f(t);
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef())
        if (e.isTensor()) f(e.toTensor());
    } else if (v.isTuple()) {
      const auto& tuple = v.toTupleRef();
      for (const c10::IValue& e : tuple.elements())
        if (e.isTensor()) f(e.toTensor());
    }
  }

  static at::Tensor first_output(const at::RecordFunction& fn) {
    const std::vector<c10::IValue>& all = fn.outputs();
    const auto outs = own_values(fn, at::ArrayRef<const c10::IValue>(all.data(), all.size()), /*returns=*/true);
    if (outs.empty()) return {};
    at::Tensor first;
    for_each_tensor(outs.front(), [&](const at::Tensor& t) {
      if (!first.defined()) first = t;
    });
    return first;
  }
};

}  // namespace torchdbg::detail
