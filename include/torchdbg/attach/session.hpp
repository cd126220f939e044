// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// AttachSession and attach(): what a user holds.

#include <torch/nn/module.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torchdbg/attach/module_spec.hpp"
#include "torchdbg/attach/options.hpp"
#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/hook_manager.hpp"

#if TORCHDBG_DEFINITIONS
#include "torchdbg/attach/core.hpp"
#include "torchdbg/attach/gradient_tap.hpp"
#include "torchdbg/attach/observer.hpp"
#include "torchdbg/detail/pattern.hpp"
#else
namespace torchdbg::detail {
class AttachCore;
class GradientTap;
}  // namespace torchdbg::detail
#endif

namespace torchdbg {

/// An attachment of a HookManager to a model; detaches (removing every tensor hook, the
/// observer and the manager listener) when destroyed or on `detach()`. Movable, not copyable.
/// A manager has at most one session that attaches gradients (`AttachOptions::backward`, the
/// default): its gradient norm and `auto_step` count one backward pass, so a second such
/// `attach` to the same manager throws torchdbg::Error. To watch several models with one
/// manager (a GAN's generator and discriminator), attach a module that holds them all
/// (`register_module` each). Forward-only sessions (`backward(false)`, e.g. with
/// `no_grad_forward(true)` for evaluation passes) may be added beside it.
/// The manager must outlive the session; the model need not (a session outliving its model
/// is safe, and so is a model destroyed after detaching).
///
/// Thread safety: `detach()` and the queries may be called from any thread, also while a
/// forward or backward pass runs; callbacks already running finish, later ones do nothing.
template <typename Mutex>
class BasicAttachSession {
 public:
  BasicAttachSession(torch::nn::Module& model, BasicHookManager<Mutex>& hooks,
                     AttachOptions options);
  /// Attaches to the modules `modules` describes, root first: what attach() builds from a
  /// `torch::nn::Module`, or from a `torch::jit::Module` (torchdbg/jit.hpp).
  BasicAttachSession(const std::vector<detail::ModuleSpec>& modules, BasicHookManager<Mutex>& hooks,
                     AttachOptions options);

  BasicAttachSession(const BasicAttachSession&) = delete;
  BasicAttachSession& operator=(const BasicAttachSession&) = delete;
  BasicAttachSession(BasicAttachSession&& o) noexcept;
  BasicAttachSession& operator=(BasicAttachSession&& o) noexcept {
    if (this != &o) {
      detach();
      hooks_ = o.hooks_;
      core_ = std::move(o.core_);
      listener_ = o.listener_;
      taps_ = std::move(o.taps_);
      o.hooks_ = nullptr;
    }
    return *this;
  }
  ~BasicAttachSession();

  /// Removes every hook and observer this session installed; idempotent.
  void detach() noexcept;

  [[nodiscard]] bool attached() const noexcept;

  /// Dotted names of the attached modules ("root" for the model itself), in module order.
  [[nodiscard]] std::vector<std::string> module_names() const;

  /// Attached modules in the order their forward outputs were first seen.
  [[nodiscard]] std::vector<std::string> execution_order() const;

  /// Per-module gradient L2 norms of the last backward pass that had hooks due. In a
  /// manager's GradientNorm or BackwardEnd listener, those of the pass being reported on that
  /// thread (with several threads training, another pass may end meanwhile; read the global
  /// norm there with HookManager::reported_gradient_norm()).
  [[nodiscard]] std::vector<std::pair<std::string, double>> gradient_norms() const;

  /// Forward outputs and gradients delivered so far.
  [[nodiscard]] uint64_t forward_deliveries() const noexcept;
  [[nodiscard]] uint64_t backward_deliveries() const noexcept;
  /// Backward passes that threw (a tensor hook, a custom Function, anomaly mode) while this
  /// session waited for their end. Such a pass reports no gradient norm and does not advance
  /// the step; the gradients it delivered before it threw were delivered; the next pass is
  /// observed as if it had not happened.
  [[nodiscard]] uint64_t failed_backward_passes() const noexcept;

  /// Delivers the calling thread's last module output now if it has not been consumed yet
  /// (e.g. after an inference-only forward whose result is not used by another operator),
  /// then brings every queued delivery's statistics to the host and runs their hooks.
  void flush();

  /// Hands over gradients no tensor hook saw, such as those `torch::autograd::grad` returns
  /// on LibTorch 1.x (2.x runs the hooks for it: a tensor a hook delivered is skipped, so the
  /// same code is right on both):
  /// `grads[i]` is delivered as the gradient of `params[i]` (under its module, with
  /// {"parameter": name}, counted in the norms), then the pass ends as a backward pass does
  /// (norms reported, `auto_step`). An undefined gradient is skipped (`allow_unused`), whatever
  /// its tensor. Throws torchdbg::Error, delivering nothing, when the lists differ in length, a
  /// defined gradient's tensor is not a parameter this session attaches gradients of, a
  /// gradient's shape is not its parameter's, or a parameter comes twice. Without it, a
  /// backward pass that follows forward deliveries and brings no gradient raises a one-time
  /// warning alert at the next pass or step change.
  ///
  /// ```cpp
  /// auto grads = torch::autograd::grad({loss}, params);
  /// session.observe_gradients(params, grads);
  /// ```
  void observe_gradients(const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& grads);

  /// Copies that brought queued statistics to the host: one per device per flush (normally
  /// one per step), never one per delivery.
  [[nodiscard]] uint64_t host_transfers() const noexcept;

 private:
  /// The module and parameter index under which `p`'s gradient is delivered.
  [[nodiscard]] std::optional<std::pair<std::size_t, std::size_t>> gradient_slot(
      const at::Tensor& p) const;

  static void update(const std::shared_ptr<detail::AttachCore>& c, BasicHookManager<Mutex>& mgr);

  BasicHookManager<Mutex>* hooks_;
  std::shared_ptr<detail::AttachCore> core_;
  uint64_t listener_ = 0;
  std::vector<std::shared_ptr<detail::GradientTap>> taps_;  // subscribed to for gradients
};

#if TORCHDBG_DEFINITIONS

template <typename Mutex>
BasicAttachSession<Mutex>::BasicAttachSession(torch::nn::Module& model,
                                              BasicHookManager<Mutex>& hooks, AttachOptions options)
    : BasicAttachSession(detail::ModuleTable::specs_of(model), hooks, std::move(options)) {}

template <typename Mutex>
BasicAttachSession<Mutex>::BasicAttachSession(const std::vector<detail::ModuleSpec>& modules,
                                              BasicHookManager<Mutex>& hooks, AttachOptions options)
    : hooks_(&hooks), core_(std::make_shared<detail::AttachCore>()) {
  detail::require_at_least<int64_t>(options.max_deferred(), 1, "AttachOptions::max_deferred");
  std::vector<detail::Pattern> patterns;
  for (const auto& p : options.patterns())
    patterns.push_back(detail::compile_pattern(p, "attach pattern"));
  const bool gradients = options.backward();
  if (gradients && hooks.attached_.fetch_add(1) != 0) {
    hooks.attached_.fetch_sub(1);
    throw Error(
        "torchdbg: attach: this HookManager already has a session attaching gradients; one per "
        "manager keeps its gradient norm and auto_step to one backward pass. Attach a module "
        "that holds every model (register_module each), detach the other session first, use "
        "a second manager, or attach this one with AttachOptions().backward(false)");
  }
  struct Release {  // gives the place back when the constructor fails below
    BasicHookManager<Mutex>* m;
    ~Release() {
      if (m != nullptr) m->attached_.fetch_sub(1);
    }
  } release{gradients ? &hooks : nullptr};
  core_->options = std::move(options);
  // MultiheadAttention applies its out_proj child's weights in its own forward: those
  // operators produce the attention module's output, also when out_proj is not selected.
  std::vector<std::size_t> attention;  // indices in `modules` of the attached attention modules
  for (const detail::ModuleSpec& spec : modules) {
    if (!patterns.empty()) {
      bool hit = false;
      for (const auto& re : patterns) hit = hit || re.match_prefix(spec.name);
      if (!hit) continue;
    }
    if (!core_->add_module(spec, /*hidden=*/false)) continue;
    if (spec.attention) attention.push_back(core_->modules.size() - 1);
  }
  for (const std::size_t mha : attention) {
    const std::string child =
        core_->modules[mha].name == "root" ? "out_proj" : core_->modules[mha].name + ".out_proj";
    std::size_t idx = core_->modules.size();
    for (std::size_t i = 0; i < core_->modules.size(); ++i)
      if (core_->modules[i].name == child) idx = i;
    if (idx == core_->modules.size()) {
      const auto spec = std::find_if(modules.begin(), modules.end(),
                                     [&](const detail::ModuleSpec& m) { return m.name == child; });
      if (spec == modules.end() || !core_->add_module(*spec, /*hidden=*/true)) continue;
    }
    core_->modules[idx].forward_as = mha;
    core_->modules[mha].internal = true;
  }
  core_->finish();
  BasicHookManager<Mutex>* mgr = hooks_;
  core_->sampling = mgr->options().sampling();
  core_->deliver = [mgr](std::string_view layer, const at::Tensor& t, bool fwd, const Metadata& md,
                         const TensorStats* stats, const Prefetched* extra, const detail::DeliveryFacts* facts) {
    mgr->run_checked(layer, t, fwd, md, stats, extra, /*out=*/nullptr, facts);
  };
  core_->prefetch = [mgr](std::string_view layer, const at::Tensor& t, bool fwd,
                          const Metadata& md) { return mgr->run_prefetches(layer, t, fwd, md); };
  core_->report_gradient_norm = [mgr](double n) { mgr->set_gradient_norm(n); };
  core_->report_failed_pass = [mgr] { mgr->backward_failed(); };
  core_->report_pass_end = [mgr] { mgr->backward_ended(); };
  core_->warn = [mgr](const std::string& message) {
    mgr->warn("torchdbg.attach", "step " + std::to_string(mgr->step()) + ": " + message);
  };
  core_->advance_step = [mgr] { mgr->advance_step(); };
  if (core_->options.backward()) {
    for (std::size_t m = 0; m < core_->modules.size(); ++m) {
      auto& params = core_->modules[m].params;
      if (core_->modules[m].hidden) continue;
      for (std::size_t i = 0; i < params.size(); ++i) {
        auto& p = params[i];
        at::Tensor t(p.impl.lock());
        if (!t.defined() || !t.requires_grad()) continue;
        // A tied tensor's gradient (the sum over its uses) comes once, under the module
        // that registered it first.
        if (core_->owner.at(t.unsafeGetTensorImpl()).front() != m) continue;
        auto tap = detail::GradientTap::of(t);
        tap->subscribe({core_, m, i});
        taps_.push_back(std::move(tap));
      }
    }
  }
  std::weak_ptr<detail::AttachCore> weak = core_;
  try {
    listener_ = hooks_->add_listener([weak, mgr](typename BasicHookManager<Mutex>::Change change) {
      auto c = weak.lock();
      if (!c) return;
      using Change = typename BasicHookManager<Mutex>::Change;
      if (change == Change::Before) {
        detail::ForwardObserver::flush(c.get());  // an output pending under the old state
        c->flush_deferred();                      // and what is queued, under the old step
        if (c->no_gradient_pass.exchange(false)) c->warn_no_gradient();
      } else if (change == Change::After) {
        update(c, *mgr);
      }
    });
    update(core_, *hooks_);
  } catch (...) {  // nothing stays attached
    core_->active.store(false);
    for (const auto& tap : taps_) tap->unsubscribe(core_.get());
    if (listener_ != 0) hooks_->remove_listener(listener_);
    detail::ForwardObserver::instance().set(core_, false);
    throw;
  }
  release.m = nullptr;  // attached: detach() gives the place back
}

template <typename Mutex>
BasicAttachSession<Mutex>::BasicAttachSession(BasicAttachSession&& o) noexcept
    : hooks_(o.hooks_),
      core_(std::move(o.core_)),
      listener_(o.listener_),
      taps_(std::move(o.taps_)) {
  o.hooks_ = nullptr;
}

template <typename Mutex>
BasicAttachSession<Mutex>::~BasicAttachSession() {
  detach();
}

template <typename Mutex>
void BasicAttachSession<Mutex>::detach() noexcept {
  if (!core_ || !core_->active.load()) return;
  core_->flush_deferred();  // queued deliveries run before the hooks go
  if (!core_->active.exchange(false)) return;
  if (core_->options.backward()) hooks_->attached_.fetch_sub(1);
  try {
    hooks_->remove_listener(listener_);
    detail::ForwardObserver::instance().set(core_, false);
    detail::ForwardObserver::discard(core_.get());
    // Unsubscribed, not removed: a pass running on another thread may be calling the taps.
    for (const auto& tap : taps_) tap->unsubscribe(core_.get());
    taps_.clear();
  } catch (...) {
  }
}

template <typename Mutex>
bool BasicAttachSession<Mutex>::attached() const noexcept {
  return core_ && core_->active.load();
}

template <typename Mutex>
auto BasicAttachSession<Mutex>::module_names() const -> std::vector<std::string> {
  std::vector<std::string> out;
  for (const auto& m : core_->modules)
    if (!m.hidden) out.push_back(m.name);
  return out;
}

template <typename Mutex>
auto BasicAttachSession<Mutex>::execution_order() const -> std::vector<std::string> {
  return core_->execution_order();
}

template <typename Mutex>
auto BasicAttachSession<Mutex>::gradient_norms() const
    -> std::vector<std::pair<std::string, double>> {
  return core_->gradient_norms();
}

template <typename Mutex>
uint64_t BasicAttachSession<Mutex>::forward_deliveries() const noexcept {
  return core_->forward_deliveries.load();
}

template <typename Mutex>
uint64_t BasicAttachSession<Mutex>::backward_deliveries() const noexcept {
  return core_->backward_deliveries.load();
}

template <typename Mutex>
uint64_t BasicAttachSession<Mutex>::failed_backward_passes() const noexcept {
  return core_->failed_passes.load();
}

template <typename Mutex>
void BasicAttachSession<Mutex>::flush() {
  detail::ForwardObserver::flush(core_.get());
  core_->flush_deferred();
}

template <typename Mutex>
void BasicAttachSession<Mutex>::observe_gradients(const std::vector<at::Tensor>& params,
                                                  const std::vector<at::Tensor>& grads) {
  if (params.size() != grads.size())
    throw Error("torchdbg: observe_gradients got " + std::to_string(params.size()) +
                " parameters and " + std::to_string(grads.size()) + " gradients");
  std::vector<std::pair<std::size_t, std::size_t>> where(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!grads[i].defined()) continue;
    const auto found = gradient_slot(params[i]);
    const std::string at = "torchdbg: observe_gradients: params[" + std::to_string(i) + "]";
    if (!found) throw Error(at + " is not a parameter this session attaches gradients of");
    if (grads[i].sizes() != params[i].sizes())
      throw Error(at + " has shape " + c10::str(params[i].sizes()) + " and its gradient " +
                  c10::str(grads[i].sizes()));
    for (std::size_t k = 0; k < i; ++k)
      if (grads[k].defined() && where[k] == *found)
        throw Error(at + " is params[" + std::to_string(k) +
                    "] again (or tied to it): each gradient once");
    where[i] = *found;
  }
  if (!core_->active.load()) return;
  // LibTorch 2.x runs the parameters' tensor hooks for torch::autograd::grad: what they
  // delivered is not delivered again.
  std::shared_ptr<detail::PassLedger::Pass> pass;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!grads[i].defined() || core_->delivered_by_hook(where[i].first, where[i].second, grads[i]))
      continue;
    if (!pass) pass = core_->open_handed_pass();
    core_->take_gradient(where[i].first, where[i].second, grads[i], pass);
  }
  if (pass) core_->end_handed_pass(*pass);
}

template <typename Mutex>
uint64_t BasicAttachSession<Mutex>::host_transfers() const noexcept {
  return core_->host_transfers.load();
}

template <typename Mutex>
auto BasicAttachSession<Mutex>::gradient_slot(const at::Tensor& p) const
    -> std::optional<std::pair<std::size_t, std::size_t>> {
  if (!p.defined() || !core_->options.backward()) return std::nullopt;
  const auto it = core_->owner.find(p.unsafeGetTensorImpl());
  if (it == core_->owner.end()) return std::nullopt;
  const std::size_t m = it->second.front();
  if (core_->modules[m].hidden) return std::nullopt;
  const auto& params = core_->modules[m].params;
  for (std::size_t i = 0; i < params.size(); ++i)
    if (params[i].impl._unsafe_get_target() == p.unsafeGetTensorImpl()) return std::make_pair(m, i);
  return std::nullopt;
}

template <typename Mutex>
void BasicAttachSession<Mutex>::update(const std::shared_ptr<detail::AttachCore>& c,
                                       BasicHookManager<Mutex>& mgr) {
  if (!c->active.load()) return;
  const int64_t step = mgr.step();
  const bool fwd = c->options.forward() && mgr.may_fire(true, step);
  const bool bwd = c->options.backward() && mgr.may_fire(false, step);
  c->forward_due.store(fwd);
  c->backward_due.store(bwd);
  c->gradient_signs.store(bwd && mgr.reads_sign_counts(false, step));
  c->input_due.store(true);
  if (c->calls_step.exchange(step) != step) c->reset_calls();
  detail::ForwardObserver::stepped_here(*c);
  detail::ForwardObserver::instance().set(c, fwd);
}

#endif  // TORCHDBG_DEFINITIONS

using AttachSession = BasicAttachSession<std::mutex>;

TORCHDBG_EXTERN_TEMPLATE(class BasicAttachSession<std::mutex>)
TORCHDBG_EXTERN_TEMPLATE(class BasicAttachSession<detail::NullMutex>)

/// Attaches `hooks` to every module of `model` that owns parameters or buffers (or those
/// matching `options.patterns()`), without changing the model's code.
///
/// ```cpp
/// auto session = torchdbg::attach(*model, hooks);
/// // the unchanged training loop: forward outputs arrive as execute_hooks(name, out, true),
/// // gradients as execute_hooks(name, grad, false, {{"parameter", "weight"}})
/// ```
template <typename Mutex>
[[nodiscard]] BasicAttachSession<Mutex> attach(torch::nn::Module& model,
                                               BasicHookManager<Mutex>& hooks,
                                               AttachOptions options = {}) {
  return BasicAttachSession<Mutex>(model, hooks, std::move(options));
}

}  // namespace torchdbg
