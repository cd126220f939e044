// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// A session's shared state: delivery to the manager, queued device deliveries, and the end
// of each backward pass (defined in core_passes.hpp, with the gradient entry).

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "torchdbg/attach/deferred.hpp"
#include "torchdbg/attach/delivery_names.hpp"
#include "torchdbg/attach/modules.hpp"
#include "torchdbg/attach/norm_stats.hpp"
#include "torchdbg/attach/options.hpp"
#include "torchdbg/attach/pass_end.hpp"
#include "torchdbg/attach/pass_ledger.hpp"
#include "torchdbg/detail/rows_alike.hpp"
#include "torchdbg/detail/text.hpp"
#include "torchdbg/hook_context.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg::detail {

/// The moments of a module call's data input, reported as "input_rms": on the host, or packed
/// on the input's device (not synced yet). `model_input`: the step's first call, whose
/// input's NaN and ±Inf counts are reported too. `norm`: a BatchNorm's training call, its
/// running statistics' error against the batch ("norm_stats_error", "norm_samples").
struct InputMoments {
  std::optional<Moments> host;
  /// Whether a host input's rows 0 and 1 are alike ("input_alike", first_rows_alike within
  /// 1e-4 of their largest magnitude), for any call's data input; nullopt: not told.
  std::optional<bool> alike;
  at::Tensor packed;
  bool model_input = false;
  /// The model's input mixed from deliveries and raw data (ObserverState::Tls::partial): the
  /// raw data's moments, whose NaN/Inf counts and RMS are the input's ("input_data_rms").
  std::shared_ptr<const Moments> raw;
  std::optional<NormError> norm;
};

/// State shared by a session, its gradient hooks and the forward observer. Held by
/// shared_ptr so that a hook still running while the session detaches finds it alive.
class AttachCore : public ModuleTable, public std::enable_shared_from_this<AttachCore> {
 public:
  static uint64_t next_id() {
    static std::atomic<uint64_t> n{0};
    return ++n;
  }

  /// Unique in the process (never reused, unlike an address): what thread-local state that
  /// outlives a session names it by.
  const uint64_t id = next_id();
  AttachOptions options;

  /// Once every module is added (ModuleTable::finish_modules): the call counters.
  void finish() {
    finish_modules();
    calls_ = std::make_unique<std::atomic<uint32_t>[]>(modules.size());
    norm_history_ = std::make_unique<NormHistory[]>(modules.size());
    for (std::size_t i = 0; i < modules.size(); ++i) calls_[i].store(0);
    std::size_t total = 0;
    for (const auto& mod : modules) {
      param_base_.push_back(total);
      total += mod.params.size();
    }
    hooked_.resize(total);
  }
  /// The step the call counters belong to.
  std::atomic<int64_t> calls_step{std::numeric_limits<int64_t>::min()};
  /// Module `m`'s last BatchNorm training call (norm_stats.hpp).
  [[nodiscard]] NormHistory& norm_history(std::size_t m) const { return norm_history_[m]; }
  /// Calls of module `m` seen since the step (or the backward pass) began.
  [[nodiscard]] uint32_t calls(std::size_t m) const { return calls_[m].load(std::memory_order_relaxed); }
  /// The index of a new call of module `m` in this step: 0 for its first.
  uint32_t next_call(std::size_t m) { return calls_[m].fetch_add(1, std::memory_order_relaxed); }
  /// A new step or backward pass: calls count from 0 again.
  void reset_calls() {
    for (std::size_t i = 0; i < modules.size(); ++i) calls_[i].store(0, std::memory_order_relaxed);
  }

  std::atomic<bool> active{true};
  /// The thread whose forward made this session's last new call (ForwardObserver's token).
  std::atomic<std::uintptr_t> forward_thread{0};
  /// The thread that last began a step of this session's manager (its set_step), 0 before.
  std::atomic<std::uintptr_t> step_thread{0};
  std::atomic<bool> forward_due{false};
  std::atomic<bool> backward_due{false};
  /// Whether a hook due for gradients reads sign counts (BasicHookManager::reads_sign_counts):
  /// the gradient statistics computed here for the norms are shared with the hooks.
  std::atomic<bool> gradient_signs{true};
  /// Set at each step change: the next module output also reports the RMS of its data input
  /// (the model's input), so the first layer's gain is known too.
  std::atomic<bool> input_due{true};
  std::atomic<uint64_t> forward_deliveries{0};
  std::atomic<uint64_t> backward_deliveries{0};
  /// Backward passes with hooks due that threw before their end (their norm is not reported).
  std::atomic<uint64_t> failed_passes{0};
  /// Copies that brought queued statistics to the host (one per device per flush).
  std::atomic<uint64_t> host_transfers{0};
  /// The manager's HookManagerOptions::sampling, for the gradient statistics computed here.
  StatsSampling sampling;

  std::function<void(std::string_view, const at::Tensor&, bool, const Metadata&, const TensorStats*,
                     const Prefetched*, const DeliveryFacts*)>
      deliver;
  /// The manager's prefetches for a delivery being queued (BasicHookManager::run_prefetches).
  std::function<std::vector<std::pair<std::string, at::Tensor>>(std::string_view, const at::Tensor&, bool,
                                                                const Metadata&)>
      prefetch;
  std::function<void(double)> report_gradient_norm;
  std::function<void()> report_failed_pass;
  std::function<void()> advance_step;

  /// Whether a delivery of `t` is queued for the step's batch rather than run at once.
  [[nodiscard]] bool defers(const at::Tensor& t) const {
    if (t.is_sparse()) return false;  // its values are coalesced and read at once
    switch (options.batching()) {
      case StatsBatching::PerDelivery:
        return false;
      case StatsBatching::Device:
        return !t.device().is_cpu();
      default:
        return true;
    }
  }

  using InputMoments = detail::InputMoments;

  /// Sends one tensor to the manager, or queues it (see StatsBatching); never throws.
  /// What is measured about a forward delivery (its input's RMS, ...) travels as numbers
  /// (DeliveryFacts) beside `base_md`, which is copied only for a queued delivery.
  void send(std::size_t module, std::string_view name, const at::Tensor& t, bool is_forward,
            const Metadata& base_md, const TensorStats* precomputed = nullptr, InputMoments input = {},
            std::shared_ptr<PassLedger::Pass> pass = nullptr) {
    if (!active.load()) return;
    if (is_forward) {
      note_order(module);
      forward_deliveries.fetch_add(1);
      forward_since_pass.store(true, std::memory_order_relaxed);
    } else {
      backward_deliveries.fetch_add(1);
    }
    DeliveringScope scope;  // the statistics' operators and the hooks' are not forward outputs
    DeliveryFacts facts;
    try {
      if (input.host) add_input_rms(facts, *input.host, input.model_input, input.raw.get());
      if (input.alike) facts.input_alike = *input.alike;
      if (is_forward) {
        add_std_less_bias(module, t, base_md, facts);
        add_norm_signals(module, base_md, input.norm, facts);
      }
    } catch (...) {
    }
    if (precomputed == nullptr && defers(t)) {
      if (pass) passes_.hold(*pass);  // its norm waits for this square
      try {
        Metadata md = base_md;
        facts.add_to(md);
        DeferredQueue::Item d{module, std::string(name), t, is_forward, std::move(md), {}, input.packed, {}, pass,
                              input.model_input};
        if (prefetch) d.extras = prefetch(name, t, is_forward, d.md);
        if (deferred_.push(std::move(d), options.max_deferred())) flush_deferred();
        return;
      } catch (...) {
        // could not reduce on the device: deliver at once, the hooks compute what they need
        if (pass && passes_.release(*pass)) finish_pass(*pass);
      }
    }
    try {
      if (input.packed.defined())
        add_input_rms(facts, unpack_moments(input.packed.to(at::kCPU)), input.model_input);
      deliver(name, t, is_forward, base_md, precomputed, nullptr, facts.empty() ? nullptr : &facts);
    } catch (...) {
      // execute_hooks turns hook failures into results; anything else (bad_alloc) is
      // dropped rather than thrown into an operator or the autograd engine.
    }
  }

  /// Brings every queued delivery's statistics to the host (one copy per device) and runs
  /// their hooks in arrival order; never throws.
  void flush_deferred() {
    DeferredQueue::Batch batch = deferred_.take();
    if (batch.items.empty()) return;
    DeliveringScope scope;
    std::vector<DeferredQueue::Fetched> fetched = DeferredQueue::fetch(batch, host_transfers);
    for (std::size_t i = 0; i < batch.items.size(); ++i) {
      DeferredQueue::Item& d = batch.items[i];
      try {
        std::optional<TensorStats> s;
        if (fetched[i].stats) s = stats_from_moments(*fetched[i].stats, d.tensor);
        DeliveryFacts facts;
        if (fetched[i].input) add_input_rms(facts, *fetched[i].input, d.model_input);
        if (d.pass && s && options.gradient_norms()) passes_.add(*d.pass, d.module, s->l2_norm * s->l2_norm);
        if (active.load())
          deliver(d.name, d.tensor, d.is_forward, d.md, s ? &*s : nullptr, &fetched[i].extras,
                  facts.empty() ? nullptr : &facts);
      } catch (...) {
      }
      // The last queued gradient of a pass that ended while another thread flushed it.
      if (d.pass && passes_.release(*d.pass)) finish_pass(*d.pass);
    }
    deferred_.recycle(batch);
  }

  void on_grad(std::size_t m, std::size_t param, const at::Tensor& g);
  static std::pair<const AttachCore*, const std::vector<std::pair<std::string, double>>*>& reporting() {
    thread_local std::pair<const AttachCore*, const std::vector<std::pair<std::string, double>>*> r{nullptr,
                                                                                                     nullptr};
    return r;
  }
  /// Delivers gradient `g` of module `m`'s parameter `param` and counts it toward `pass`'s
  /// norms (when gradient hooks are due); on_grad and observe_gradients call it.
  void take_gradient(std::size_t m, std::size_t param, const at::Tensor& g,
                     const std::shared_ptr<PassLedger::Pass>& pass);
  /// A pass for gradients handed over (observe_gradients); end it with end_handed_pass.
  std::shared_ptr<PassLedger::Pass> open_handed_pass() {
    bool opened = false;
    return passes_.open(nullptr, modules.size(), &opened);
  }
  /// Ends a pass whose gradients were handed over: norms, auto_step.
  void end_handed_pass(PassLedger::Pass& pass) {
    passes_.note_gradient(pass);
    on_backward_end(pass);
  }
  /// Whether a tensor hook delivered `g` itself as the gradient of parameter `param` of
  /// module `m`: LibTorch 2.x runs leaf tensor hooks for torch::autograd::grad too, and the
  /// tensors it returns, handed over again (observe_gradients), are not delivered twice.
  [[nodiscard]] bool delivered_by_hook(std::size_t m, std::size_t param, const at::Tensor& g) const {
    std::lock_guard<std::mutex> lock(hooked_mutex_);
    const auto& h = hooked_[param_base_[m] + param];
    return h && !h->expired() && h->_unsafe_get_target() == g.unsafeGetTensorImpl();
  }
  std::atomic<bool> warned_no_gradient{false};

  [[nodiscard]] std::vector<std::string> execution_order() const {
    std::lock_guard<std::mutex> lock(order_mutex_);
    std::vector<std::string> out;
    for (auto i : order_) out.push_back(modules[i].name);
    return out;
  }
  /// The last pass's module norms; in the manager's listeners while a pass is reported, that
  /// pass's (another thread's pass may end meanwhile).
  [[nodiscard]] std::vector<std::pair<std::string, double>> gradient_norms() const {
    if (reporting().first == this) return *reporting().second;
    std::lock_guard<std::mutex> lock(norms_mutex_);
    return last_norms_;
  }

  /// A forward delivery's name and metadata (DeliveryNames).
  std::shared_ptr<const DeliveryInfo> delivery_info(std::size_t module, int op, uint32_t call,
                                                    const DeliveryInfo* from = nullptr) {
    return names_.get(*this, module, op, call, from);
  }

 private:
  /// The data input's "input_rms" and, for the model's input, its "input_nan" and "input_inf"
  /// counts: those of `raw`, the raw data mixed into it, when given (with its RMS as
  /// "input_data_rms").
  static void add_input_rms(DeliveryFacts& f, const Moments& m, bool model_input, const Moments* raw = nullptr) {
    if (model_input) {
      const Moments& data = raw != nullptr ? *raw : m;
      DeliveryFacts::set<int64_t>(f.input_nan, data.nan);
      DeliveryFacts::set<int64_t>(f.input_inf, data.pos_inf + data.neg_inf);
      DeliveryFacts::set<int64_t>(f.input_count, data.finite);
      if (raw != nullptr && raw->finite > 0) DeliveryFacts::set(f.input_data_rms, raw->rms());
    }
    if (m.finite <= 0) return;
    DeliveryFacts::set(f.input_rms, m.rms());
  }

  /// A batch of one has no spread across the batch to tell a module's bias from what its
  /// weights make of the input: its output's std with the module's own `bias` parameter taken
  /// out ("std_less_bias"), for host tensors (no device sync). The bias is per channel (dim 1)
  /// of a Conv, per feature (the last dim) of any other module (a Linear, a custom dense layer).
  void add_std_less_bias(std::size_t module, const at::Tensor& t, const Metadata& base_md,
                         DeliveryFacts& facts) const {
    if (module >= modules.size() || !t.defined() || t.dim() < 2 || t.size(0) != 1 || !t.is_cpu() ||
        !t.is_floating_point() || base_md.count("activation") != 0 || base_md.count("op") != 0)
      return;
    const Module& mod = modules[module];
    if (mod.kind == Kind::Embedding || mod.type_name.find("Norm") != std::string::npos) return;
    const bool conv = mod.kind == Kind::Conv;
    for (const Param& p : mod.params) {
      if (p.name != "bias") continue;
      const at::Tensor bias(p.impl.lock());
      const int64_t channels = conv ? t.size(1) : t.size(-1);
      if (!bias.defined() || bias.dim() != 1 || bias.numel() != channels || !bias.is_cpu()) return;
      std::vector<int64_t> shape(static_cast<std::size_t>(t.dim()), 1);
      shape[conv ? 1 : shape.size() - 1] = channels;
      at::NoGradGuard no_grad;
      const Moments m = compute_moments(t.detach() - bias.detach().view(shape), /*signs=*/false);
      if (m.finite != m.count || m.finite == 0) return;
      DeliveryFacts::set(facts.std_less_bias, m.std_dev());
      return;
    }
  }

  /// A normalization module's own output: its weight's RMS ("norm_weight_rms", a host weight
  /// of any shape; 1 for a normalization without parameters) and, for a BatchNorm's training call, the running statistics' error.
  void add_norm_signals(std::size_t module, const Metadata& base_md, const std::optional<NormError>& norm,
                        DeliveryFacts& facts) const {
    if (module >= modules.size() || base_md.count("activation") != 0 || base_md.count("op") != 0) return;
    const Module& mod = modules[module];
    if (mod.type_name.find("Norm") == std::string::npos) return;
    if (norm) {
      DeliveryFacts::set(facts.norm_stats_error, norm->error);
      DeliveryFacts::set<int64_t>(facts.norm_samples, norm->samples);
      DeliveryFacts::set(facts.norm_momentum, norm->momentum);
    }
    bool weighted = false;
    for (const Param& p : mod.params) {
      const at::Tensor w(p.impl.lock());
      if (!w.defined()) continue;
      weighted = true;
      if (p.name != "weight") continue;
      if (w.numel() == 0 || !w.is_cpu() || !w.is_floating_point()) return;
      const Moments m = compute_moments(w.detach(), /*signs=*/false);
      if (m.finite == m.count) DeliveryFacts::set(facts.norm_weight_rms, m.rms());
      return;
    }
    // No parameters (elementwise_affine false, InstanceNorm's default): the normalized input
    // passes as with a weight of ones.
    if (!weighted) DeliveryFacts::set(facts.norm_weight_rms, 1.0);
  }

  void note_order(std::size_t m) {
    std::lock_guard<std::mutex> lock(order_mutex_);
    if (seen_.size() < modules.size()) seen_.assign(modules.size(), 0);
    if (!seen_[m]) {
      seen_[m] = 1;
      order_.push_back(m);
    }
  }

  /// `pass` ended: its queued statistics (gradients' included, one copy per device), its norms,
  /// auto_step; nothing when none of its gradients were this session's.
  void on_backward_end(PassLedger::Pass& pass);

  /// Reports `pass`'s norms, its end, and steps (auto_step).
  void finish_pass(PassLedger::Pass& pass);

 public:
  /// The first backward node of a pass on the thread whose forward made this session's last
  /// call (ForwardObserver), or its first gradient (on_grad): the end of the pass is awaited, so
  /// a pass that throws before any gradient arrives is noticed too (and counted by every
  /// session whose forward ran on that thread since its last pass).
  /// Returns the pass (null when nothing waits for its end: no hook due, no auto_step).
  std::shared_ptr<PassLedger::Pass> begin_pass();
  /// Forward deliveries since the last pass ended (begin_pass is called for such sessions).
  std::atomic<bool> forward_since_pass{false};
  /// A pass ended with forward deliveries before it and no gradient (torch::autograd::grad).
  std::atomic<bool> no_gradient_pass{false};
  std::function<void()> report_pass_end;
  std::function<void(const std::string&)> warn;
  /// Raises the one-time warning that no gradient arrives (see observe_gradients).
  void warn_no_gradient() {
    if (!options.backward() || !backward_due.load() || warned_no_gradient.exchange(true) || !warn) return;
    try {
      warn("a backward pass ran after forward outputs were delivered and no gradient arrived; gradients "
           "taken with torch::autograd::grad run no tensor hook: hand them over with "
           "session.observe_gradients(params, grads) (warned once)");
    } catch (...) {
    }
  }

 private:

  /// The pass threw: what it queued is delivered (those gradients were computed), its partial
  /// norms are dropped, the step does not advance, and the next pass starts afresh.
  void on_backward_failed(PassLedger::Pass& pass) noexcept;

  mutable std::mutex order_mutex_;
  std::vector<std::size_t> order_;
  std::vector<char> seen_;
  PassLedger passes_;
  mutable std::mutex norms_mutex_;
  std::vector<std::pair<std::string, double>> last_norms_;  // of the last pass that ended
  std::vector<std::size_t> param_base_;                      // module -> its first parameter's slot
  mutable std::mutex hooked_mutex_;
  std::vector<std::optional<WeakImpl>> hooked_;  // per parameter: the gradient a hook delivered last
  DeliveryNames names_;
  std::unique_ptr<std::atomic<uint32_t>[]> calls_;
  std::unique_ptr<NormHistory[]> norm_history_;
  DeferredQueue deferred_;
};

}  // namespace torchdbg::detail

#include "torchdbg/attach/core_passes.hpp"  // the definitions of the pass ends and the gradient entry
