// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Exact module hooks where the forward call goes through torchdbg:
// * modules declared as `torchdbg::Hooked<torch::nn::Linear> fc1{nullptr};` (a drop-in for
//   the ModuleHolder);
// * children of a plain torch::nn::Sequential, with no change to the model: while a child
//   has hooks, torchdbg swaps a forwarder for it in the Sequential's list of AnyModules
//   (public API: SequentialImpl::begin()) and swaps the original back when its last hook is
//   removed; named_children() and parameters() never change, `seq->ptr(i)` returns the
//   forwarder meanwhile. Register and remove such hooks while no forward runs on the model;
// * children of torchdbg::HookedSequential (always hookable);
// * ModuleList/ModuleDict items, which the model's own forward calls directly: call them
//   through `torchdbg::hooked_call<Impl>(list[i], x)`. Hooks can read, cache, replace and stop, in
// tdhook's four directions:
//   FwdPre  sees the input, may replace it;
//   Fwd     sees input and output, may replace the output (activation patching);
//   BwdPre  sees the gradient w.r.t. the output, may replace it;
//   Bwd     sees the gradients w.r.t. input and output, may replace the input's gradient.
// A replacement must match the original's shape, dtype and device (torchdbg::Error otherwise).
// Removing the hooks restores the module's exact original behaviour. Exact hooks work on
// modules whose forward maps one Tensor to one Tensor; for read-only observation of any
// module without changing the model, see attach.hpp.

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torchdbg/detail/pattern.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/paths.hpp"

namespace torchdbg {

enum class HookDirection { FwdPre, Fwd, BwdPre, Bwd };

inline const char* to_string(HookDirection d) noexcept {
  switch (d) {
    case HookDirection::FwdPre: return "fwd_pre";
    case HookDirection::Fwd: return "fwd";
    case HookDirection::BwdPre: return "bwd_pre";
    case HookDirection::Bwd: return "bwd";
  }
  return "?";
}

namespace detail {
/// Throws torchdbg::Error naming `d`'s value when it is none of the four directions (a cast
/// integer, a corrupted config); `where` names the call.
inline void check_direction(HookDirection d, std::string_view where) {
  switch (d) {
    case HookDirection::FwdPre:
    case HookDirection::Fwd:
    case HookDirection::BwdPre:
    case HookDirection::Bwd:
      return;
  }
  throw Error("torchdbg: " + std::string(where) + ": invalid HookDirection " +
              std::to_string(static_cast<long long>(static_cast<std::underlying_type_t<HookDirection>>(d))) +
              " (expected FwdPre, Fwd, BwdPre or Bwd)");
}
}  // namespace detail

/// The direction a name spells, as tdhook and `to_string` write them: "fwd_pre", "fwd",
/// "bwd_pre", "bwd". Throws torchdbg::Error naming any other text (tdhook's "fwd_kwargs" and
/// "fwd_pre_kwargs" too: LibTorch modules take no keyword arguments).
inline HookDirection parse_hook_direction(std::string_view name) {
  for (auto d : {HookDirection::FwdPre, HookDirection::Fwd, HookDirection::BwdPre, HookDirection::Bwd}) {
    if (name == to_string(d)) return d;
  }
  const bool kwargs = name == "fwd_kwargs" || name == "fwd_pre_kwargs";
  throw Error("torchdbg: invalid hook direction '" + std::string(name) + "' (expected fwd_pre, fwd, bwd_pre or bwd" +
              (kwargs ? "; LibTorch modules take no keyword arguments)" : ")"));
}

/// The module an exact hook runs for.
struct ModuleCall {
  std::string_view path;  ///< the name the hook was registered under (dotted path)
  torch::nn::Module& module;
  HookDirection direction;
};

/// The tensors of one hook call; those not known in a direction are undefined
/// (FwdPre: input; Fwd: input, output; BwdPre: grad_output; Bwd: grad_input, grad_output).
struct HookTensors {
  const at::Tensor& input;
  const at::Tensor& output;
  const at::Tensor& grad_input;
  const at::Tensor& grad_output;
};

/// An exact hook: returns a replacement for the direction's tensor, or nullopt to keep it.
using ExactHookFn = std::function<std::optional<at::Tensor>(const ModuleCall&, const HookTensors&)>;

/// One exact hook. A module's hooks of one direction run by `priority` (higher first), then
/// in registration order; a `prepend`ed hook runs before those of its priority registered so
/// far (PyTorch's and tdhook's `prepend=True`). A replacement is what every later hook sees.
///
/// ```cpp
/// auto h = register_module_hook(model, "fc1", setting_hook(fix).with_priority(10));
/// ```
struct ExactHook {
  HookDirection direction = HookDirection::Fwd;
  ExactHookFn fn;
  int priority = 0;
  bool prepend = false;

  /// This hook with `priority` set.
  [[nodiscard]] ExactHook with_priority(int p) const {
    ExactHook h = *this;
    h.priority = p;
    return h;
  }
  /// This hook, to run before the same priority's hooks registered so far.
  [[nodiscard]] ExactHook prepended() const {
    ExactHook h = *this;
    h.prepend = true;
    return h;
  }
};

/// Thrown by a stopping hook to end the forward pass after a module; `run_until` catches it.
class StopForward : public std::exception {
 public:
  explicit StopForward(std::string path) : path_(std::move(path)), what_("torchdbg: forward stopped after '" + path_ + "'") {}
  const char* what() const noexcept override { return what_.c_str(); }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
  std::string what_;
};

/// Named tensors stored by caching hooks. Thread-safe.
class TensorCache {
 public:
  void set(const std::string& key, at::Tensor t) {
    std::lock_guard<std::mutex> lock(mutex_);
    items_[key] = std::move(t);
  }
  /// The tensor under `key`; throws torchdbg::Error naming it when absent.
  [[nodiscard]] at::Tensor get(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = items_.find(key);
    if (it == items_.end()) throw Error("torchdbg: no tensor cached under '" + key + "'");
    return it->second;
  }
  [[nodiscard]] bool contains(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return items_.count(key) > 0;
  }
  [[nodiscard]] std::vector<std::string> keys() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    for (const auto& kv : items_) out.push_back(kv.first);
    return out;
  }
  [[nodiscard]] std::size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return items_.size();
  }
  bool erase(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    return items_.erase(key) > 0;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    items_.clear();
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::string, at::Tensor> items_;
};

namespace detail {

/// Process-wide table: module -> exact hooks, and the modules whose calls go through us.
class ExactHookRegistry {
 public:
  struct Entry {
    uint64_t id;
    std::string path;
    ExactHook hook;
    int64_t position = 0;  // among equal priorities: prepended negative, appended positive
  };
  using List = std::vector<Entry>;

  static ExactHookRegistry& instance() {
    static ExactHookRegistry r;
    return r;
  }

  /// Marks `m` as called through torchdbg: for as long as it lives (Hooked<>, hooked_call),
  /// or, with `container`, for as long as that HookedSequential lives.
  void mark_hookable(const std::shared_ptr<torch::nn::Module>& m,
                     const std::shared_ptr<torch::nn::Module>& container = nullptr) {
    if (!m) return;
    std::lock_guard<std::mutex> lock(mutex_);
    auto& marked = hookable_[m.get()];
    if (marked.module.lock() != m) marked = Marked{m, false, {}};
    if (!container) {
      marked.permanent = true;
    } else if (std::none_of(marked.containers.begin(), marked.containers.end(),
                            [&](const auto& w) { return w.lock() == container; })) {
      marked.containers.push_back(container);
    }
  }
  /// True when `m`'s calls go through torchdbg: marked (Hooked<>, HookedSequential,
  /// hooked_call) or forwarded in a Sequential that still lives. Entries of dead modules are
  /// dropped, so a new module at a freed address inherits nothing.
  bool is_hookable(const torch::nn::Module* m) {
    std::lock_guard<std::mutex> lock(mutex_);
    return hookable_locked(m);
  }

  /// Registers `hook` on `m`, first made hookable in each Sequential of `through` (all under
  /// one lock, so a removal on another thread cannot swap the forwarder back in between).
  /// Throws torchdbg::Error, naming `path`, when `m`'s calls do not go through torchdbg.
  ///
  /// A child of a plain Sequential becomes hookable by swapping, in the Sequential's list of
  /// AnyModules, a forwarder that runs the hooks around the original (at every place the
  /// child holds in that list); `remove` of its last hook swaps the original back.
  /// named_children() and the Sequential's parameters() are never touched.
  uint64_t add(const std::shared_ptr<torch::nn::Module>& m, std::string path, ExactHook hook,
               const std::vector<std::shared_ptr<torch::nn::SequentialImpl>>& through = {}) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& seq : through) forward_through_locked(seq, m);
    if (!hookable_locked(m.get())) {
      throw Error("torchdbg: module '" + path + "' (" + m->name() +
                  ") is not called through torchdbg: declare it as torchdbg::Hooked<...>, put it in a "
                  "Sequential (register by path or with MultiHookManager), call it with "
                  "torchdbg::hooked_call, or observe it read-only with torchdbg::attach()");
    }
    const uint64_t id = ++seq_;
    auto& slot = hooks_[m.get()];
    if (slot.list && slot.owner.lock() != m) drop_locked(slot);  // a dead module's hooks
    auto next = std::make_shared<List>(slot.list ? *slot.list : List{});
    const int64_t position = hook.prepend ? --front_position_ : ++back_position_;
    Entry e{id, std::move(path), std::move(hook), position};
    const auto runs_before = [](const Entry& a, const Entry& b) {
      if (a.hook.priority != b.hook.priority) return a.hook.priority > b.hook.priority;
      return a.position < b.position;
    };
    next->insert(std::upper_bound(next->begin(), next->end(), e, runs_before), std::move(e));
    slot.list = std::move(next);
    slot.owner = m;
    owner_of_[id] = m.get();
    count_.fetch_add(1);
    return id;
  }

  /// Removes hook `id`; false when it is gone already (removed, or its module died).
  bool remove(uint64_t id) {
    std::vector<std::weak_ptr<torch::nn::SequentialImpl>> restore_parents;
    const torch::nn::Module* restore_child = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto o = owner_of_.find(id);
      if (o == owner_of_.end()) return false;
      const torch::nn::Module* m = o->second;
      owner_of_.erase(o);
      auto it = hooks_.find(m);
      if (it == hooks_.end()) return false;
      const auto& list = *it->second.list;
      if (std::none_of(list.begin(), list.end(), [id](const Entry& e) { return e.id == id; })) return false;
      auto next = std::make_shared<List>();
      for (const auto& e : list)
        if (e.id != id) next->push_back(e);
      if (next->empty()) {
        hooks_.erase(it);
        auto f = forwarded_.find(m);
        if (f != forwarded_.end()) {  // the last hook of a Sequential child: put it back
          restore_parents = std::move(f->second.parents);
          restore_child = m;
          forwarded_.erase(f);
        }
      } else {
        it->second.list = std::move(next);
      }
      count_.fetch_sub(1);
      // Under the lock, so no registration on the same Sequential edits its list meanwhile.
      for (const auto& weak : restore_parents) {
        if (auto parent = weak.lock()) restore(*parent, restore_child);
      }
    }
    return true;
  }

  /// The hooks of `m` (null when none); a cheap atomic check when no hook exists at all.
  std::shared_ptr<const List> hooks_for(const torch::nn::Module* m) {
    if (count_.load(std::memory_order_relaxed) == 0) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = hooks_.find(m);
    if (it == hooks_.end()) return nullptr;
    if (it->second.owner.expired()) {  // registered on a module that died; `m` is another
      drop_locked(it->second);
      hooks_.erase(it);
      return nullptr;
    }
    return it->second.list;
  }

 private:
  struct Slot {
    std::shared_ptr<const List> list;
    std::weak_ptr<torch::nn::Module> owner;
  };
  struct Forwarded {
    std::weak_ptr<torch::nn::Module> child;
    std::vector<std::weak_ptr<torch::nn::SequentialImpl>> parents;
  };
  struct Marked {
    std::weak_ptr<torch::nn::Module> module;
    bool permanent = false;
    std::vector<std::weak_ptr<torch::nn::Module>> containers;
  };
  bool hookable_locked(const torch::nn::Module* m) {
    auto alive = [](const auto& w) { return !w.expired(); };
    if (auto it = hookable_.find(m); it != hookable_.end()) {
      if (it->second.module.expired()) {
        hookable_.erase(it);
      } else if (it->second.permanent || std::any_of(it->second.containers.begin(), it->second.containers.end(), alive)) {
        return true;
      }
    }
    if (auto f = forwarded_.find(m); f != forwarded_.end()) {
      if (f->second.child.expired()) {
        forwarded_.erase(f);
      } else if (std::any_of(f->second.parents.begin(), f->second.parents.end(), alive)) {
        return true;
      }
    }
    return false;
  }
  void forward_through_locked(const std::shared_ptr<torch::nn::SequentialImpl>& parent,
                              const std::shared_ptr<torch::nn::Module>& child);
  void drop_locked(Slot& slot) {
    for (const auto& e : *slot.list) owner_of_.erase(e.id);
    count_.fetch_sub(slot.list->size());
    slot.list.reset();
  }

  std::mutex mutex_;
  std::atomic<std::size_t> count_{0};
  uint64_t seq_ = 0;
  int64_t front_position_ = 0, back_position_ = 0;
  std::unordered_map<const torch::nn::Module*, Slot> hooks_;  // each list in execution order
  std::unordered_map<uint64_t, const torch::nn::Module*> owner_of_;
  std::unordered_map<const torch::nn::Module*, Marked> hookable_;
  std::unordered_map<const torch::nn::Module*, Forwarded> forwarded_;

  static void restore(torch::nn::SequentialImpl& parent, const torch::nn::Module* child);
};

inline void check_replacement(const at::Tensor& original, const at::Tensor& replacement, const ModuleCall& call) {
  const std::string where = std::string(to_string(call.direction)) + " hook of '" + std::string(call.path) + "'";
  if (!original.defined()) {  // a bwd hook's input gradient when the input needs none
    if (replacement.defined()) {
      throw Error("torchdbg: " + where + " returned a tensor, but there is no input gradient to replace: the "
                  "module's input needs no gradient");
    }
    return;
  }
  if (!replacement.defined()) {
    throw Error("torchdbg: " + where + " returned an undefined tensor (return std::nullopt to keep the value)");
  }
  if (replacement.sizes() != original.sizes() || replacement.scalar_type() != original.scalar_type() ||
      replacement.device() != original.device()) {
    throw Error("torchdbg: " + where + " replaced a " + c10::toString(original.scalar_type()) + " " +
                c10::str(original.sizes()) + " tensor on " + original.device().str() + " with a " +
                c10::toString(replacement.scalar_type()) + " " + c10::str(replacement.sizes()) + " tensor on " +
                replacement.device().str());
  }
}

/// Runs the hooks of direction `d` in order on `value` (what they may replace); `make`
/// builds the HookTensors they see from the current value.
template <typename Make>
at::Tensor apply_direction(const ExactHookRegistry::List& hooks, HookDirection d, torch::nn::Module& m,
                           at::Tensor value, Make&& make) {
  for (const auto& e : hooks) {
    if (e.hook.direction != d) continue;
    ModuleCall c{e.path, m, d};
    if (auto r = e.hook.fn(c, make(value))) {
      check_replacement(value, *r, c);
      value = std::move(*r);
    }
  }
  return value;
}

/// Runs `call(input)` with the exact hooks of `m` around it.
template <typename Call>
at::Tensor run_with_hooks(const std::shared_ptr<torch::nn::Module>& m, const at::Tensor& x, Call&& call) {
  const auto hooks = ExactHookRegistry::instance().hooks_for(m.get());
  if (!hooks || hooks->empty()) return call(x);
  static const at::Tensor none;
  bool has_bwd = false, has_bwd_pre = false;
  for (const auto& e : *hooks) {
    has_bwd = has_bwd || e.hook.direction == HookDirection::Bwd;
    has_bwd_pre = has_bwd_pre || e.hook.direction == HookDirection::BwdPre;
  }
  at::Tensor in = apply_direction(*hooks, HookDirection::FwdPre, *m, x,
                                  [](const at::Tensor& v) { return HookTensors{v, none, none, none}; });
  // Gradients w.r.t. this module's input alone: hook an identity view of it.
  const bool hook_input = has_bwd && in.defined() && in.requires_grad() && at::GradMode::is_enabled();
  if (hook_input) in = in.view_as(in);
  const auto version = hook_input ? in._version() : 0;
  at::Tensor raw = call(in);
  if (hook_input && in._version() != version) {
    // The module changed its input in place (ReLU(inplace)): the hook on `in` would see the
    // gradient of the changed value, not of the input. PyTorch refuses this case too.
    const auto bwd = std::find_if(hooks->begin(), hooks->end(), [](const auto& e) { return e.hook.direction == HookDirection::Bwd; });
    throw Error("torchdbg: the bwd hook of '" + bwd->path + "' cannot see its input's gradient: " + m->name() +
                " changes its input in place; use an out-of-place module or a bwd_pre hook");
  }
  at::Tensor out = apply_direction(*hooks, HookDirection::Fwd, *m, std::move(raw),
                                   [&in](const at::Tensor& v) { return HookTensors{in, v, none, none}; });
  if ((has_bwd || has_bwd_pre) && out.defined() && out.requires_grad()) {
    auto grad_output = std::make_shared<at::Tensor>();
    std::weak_ptr<torch::nn::Module> weak = m;
    if (out.is_leaf()) out = out.view_as(out);  // hooks on a returned leaf would outlive the call
    out.register_hook([hooks, grad_output, weak, hook_input](const at::Tensor& g) -> at::Tensor {
      auto mod = weak.lock();
      if (!mod) return g;
      *grad_output = apply_direction(*hooks, HookDirection::BwdPre, *mod, g,
                                     [](const at::Tensor& v) { return HookTensors{none, none, none, v}; });
      if (!hook_input) {  // no input gradient will come: Bwd hooks see it undefined
        (void)apply_direction(*hooks, HookDirection::Bwd, *mod, at::Tensor(),
                              [&](const at::Tensor& v) { return HookTensors{none, none, v, *grad_output}; });
      }
      return *grad_output;
    });
    if (hook_input) {
      in.register_hook([hooks, grad_output, weak](const at::Tensor& gi) -> at::Tensor {
        auto mod = weak.lock();
        if (!mod) return gi;
        return apply_direction(*hooks, HookDirection::Bwd, *mod, gi,
                               [&](const at::Tensor& v) { return HookTensors{none, none, v, *grad_output}; });
      });
    }
  }
  return out;
}

/// Stands in a plain Sequential's list for a hooked child: runs the child's exact hooks
/// around the original AnyModule. Not registered as a child, so parameters are unchanged.
class SequentialForwarderImpl : public torch::nn::Module {
 public:
  /// The original is the forwarder's child "module", so train()/eval(), to() and apply()
  /// reach it, and `seq->ptr(i)->parameters()` meanwhile lists its parameters.
  explicit SequentialForwarderImpl(torch::nn::AnyModule original)
      : torch::nn::Module("torchdbg::SequentialForwarder"), original_(std::move(original)), target_(original_.ptr()) {
    register_module("module", target_);
  }

  at::Tensor forward(const at::Tensor& x) {
    // A hook may remove the last hook, which swaps this forwarder out of the Sequential
    // while it runs: hold it, and what it calls, until the call ends.
    const auto self = shared_from_this();
    const auto target = target_;
    return run_with_hooks(target, x, [this, &target](const at::Tensor& in) {
      auto out = original_.any_forward(in);
      if (auto* t = out.try_get<at::Tensor>()) return std::move(*t);
      throw Error("torchdbg: exact hooks need a module that maps one Tensor to one Tensor; " + target->name() +
                  " returned " + c10::demangle(out.type_info().name()) + ": remove its hooks");
    });
  }
  /// Cloning a Sequential while a child is hooked gives the clone a hook-less forwarder of
  /// the child's clone, whose parameters are named `<i>.module.<name>`; hooks do not follow
  /// clones, and the clone's child can be hooked in turn.
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<at::Device>& device = c10::nullopt) const override {
    return std::make_shared<SequentialForwarderImpl>(original_.clone(device));
  }
  [[nodiscard]] const std::shared_ptr<torch::nn::Module>& target() const noexcept { return target_; }
  /// A copy of the original (copies of this forwarder made meanwhile keep working).
  [[nodiscard]] torch::nn::AnyModule original() const { return original_; }

 private:
  torch::nn::AnyModule original_;
  std::shared_ptr<torch::nn::Module> target_;
};

inline void ExactHookRegistry::forward_through_locked(const std::shared_ptr<torch::nn::SequentialImpl>& parent,
                                                      const std::shared_ptr<torch::nn::Module>& child) {
  bool installed = false;
  for (auto it = parent->begin(); it != parent->end(); ++it) {  // every place the child holds
    auto current = it->ptr();
    auto* f = dynamic_cast<SequentialForwarderImpl*>(current.get());
    if (f != nullptr && f->target().get() == child.get()) {
      installed = true;
    } else if (current.get() == child.get()) {
      *it = torch::nn::AnyModule(std::make_shared<SequentialForwarderImpl>(*it));
      installed = true;
    }
  }
  if (!installed) throw Error("torchdbg: module is not a child of the given Sequential");
  auto& entry = forwarded_[child.get()];
  if (entry.child.lock() != child) entry = Forwarded{child, {}};
  const bool known = std::any_of(entry.parents.begin(), entry.parents.end(), [&](const auto& w) { return w.lock() == parent; });
  if (!known) entry.parents.push_back(parent);
}

inline void ExactHookRegistry::restore(torch::nn::SequentialImpl& parent, const torch::nn::Module* child) {
  for (auto it = parent.begin(); it != parent.end(); ++it) {
    if (it->is_empty()) continue;
    auto current = it->ptr();
    auto* f = dynamic_cast<SequentialForwarderImpl*>(current.get());
    if (f != nullptr && f->target().get() == child) *it = f->original();  // copies: nothing throws
  }
}

/// Why LibTorch's `m` cannot take exact hooks in a Sequential (its forward does not map one
/// Tensor to one Tensor), or null. Other modules are checked at their first hooked call.
inline const char* not_tensor_to_tensor(const torch::nn::Module& m) {
  static const std::unordered_map<std::string, const char*> known = {
      {"torch::nn::RNN", "returns a tuple"},          {"torch::nn::LSTM", "returns a tuple"},
      {"torch::nn::GRU", "returns a tuple"},          {"torch::nn::LSTMCell", "returns a tuple"},
      {"torch::nn::MultiheadAttention", "takes three tensors and returns a tuple"},
      {"torch::nn::AdaptiveLogSoftmaxWithLoss", "takes two tensors and returns an ASMoutput"},
      {"torch::nn::Transformer", "takes two tensors"},  {"torch::nn::TransformerDecoder", "takes two tensors"},
      {"torch::nn::TransformerDecoderLayer", "takes two tensors"},
      {"torch::nn::Bilinear", "takes two tensors"},      {"torch::nn::CosineSimilarity", "takes two tensors"},
      {"torch::nn::PairwiseDistance", "takes two tensors"}};
  std::string name = m.name();  // the type's name, or what its constructor set (no "Impl")
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  const auto it = known.find(name);
  return it == known.end() ? nullptr : it->second;
}

/// Every module under `root` (itself included) that holds `child` as a direct child, each once.
inline std::vector<std::shared_ptr<torch::nn::Module>> find_parents(const std::shared_ptr<torch::nn::Module>& root,
                                                                    const torch::nn::Module* child) {
  std::vector<std::shared_ptr<torch::nn::Module>> parents;
  std::unordered_set<const torch::nn::Module*> seen;
  std::function<void(const std::shared_ptr<torch::nn::Module>&)> visit = [&](const std::shared_ptr<torch::nn::Module>& m) {
    if (!seen.insert(m.get()).second) return;
    bool holds = false;
    for (const auto& item : m->named_children()) {
      holds = holds || item.value().get() == child;
      visit(item.value());
    }
    if (holds) parents.push_back(m);
  };
  visit(root);
  return parents;
}

}  // namespace detail

/// A Sequential whose children run their exact hooks (children map one Tensor to one Tensor).
class HookedSequentialImpl : public torch::nn::SequentialImpl {
 public:
  HookedSequentialImpl() = default;
  template <typename... Modules>
  explicit HookedSequentialImpl(Modules&&... modules) : SequentialImpl(std::forward<Modules>(modules)...) {
    mark_children();
  }
  explicit HookedSequentialImpl(torch::OrderedDict<std::string, torch::nn::AnyModule>&& named)
      : SequentialImpl(std::move(named)) {
    mark_children();
  }

  at::Tensor forward(const at::Tensor& x) {
    at::Tensor out = x;
    std::size_t i = 0;
    for (auto it = begin(); it != end(); ++it, ++i) {
      auto child = ptr(i);
      detail::ExactHookRegistry::instance().mark_hookable(child, weak_from_this().lock());
      out = detail::run_with_hooks(child, out, [&](const at::Tensor& in) { return it->forward<at::Tensor>(in); });
    }
    return out;
  }

  /// Marks every current child as hookable (done by the constructors, forward and
  /// MultiHookManager; call it after push_back to hook a new child before its first call).
  void mark_children() {
    const auto self = weak_from_this().lock();  // null in the constructor: marked for the child's life
    for (std::size_t i = 0; i < size(); ++i) detail::ExactHookRegistry::instance().mark_hookable(ptr(i), self);
  }
};
TORCH_MODULE(HookedSequential);

/// RAII ownership of registered exact hooks: removes them when destroyed or on `remove()`.
/// Handles combine with `+`. Move-only.
class ModuleHookHandle {
 public:
  ModuleHookHandle() = default;
  explicit ModuleHookHandle(std::vector<uint64_t> ids) : ids_(std::move(ids)) {}
  ModuleHookHandle(const ModuleHookHandle&) = delete;
  ModuleHookHandle& operator=(const ModuleHookHandle&) = delete;
  ModuleHookHandle(ModuleHookHandle&& o) noexcept : ids_(std::move(o.ids_)) { o.ids_.clear(); }
  ModuleHookHandle& operator=(ModuleHookHandle&& o) noexcept {
    if (this != &o) {
      remove();
      ids_ = std::move(o.ids_);
      o.ids_.clear();
    }
    return *this;
  }
  ~ModuleHookHandle() { remove(); }

  /// Removes the hooks; true the first time, false afterwards.
  bool remove() noexcept {
    if (ids_.empty()) return false;
    for (auto id : ids_) detail::ExactHookRegistry::instance().remove(id);
    ids_.clear();
    return true;
  }
  /// Number of hooks held (one per hooked module and hook).
  [[nodiscard]] std::size_t size() const noexcept { return ids_.size(); }

  friend ModuleHookHandle operator+(ModuleHookHandle a, ModuleHookHandle b) {
    std::vector<uint64_t> ids = std::move(a.ids_);
    ids.insert(ids.end(), b.ids_.begin(), b.ids_.end());
    a.ids_.clear();
    b.ids_.clear();
    return ModuleHookHandle(std::move(ids));
  }

 private:
  std::vector<uint64_t> ids_;
};

namespace detail {
/// Registers `hook` on `module`, making it hookable in each plain Sequential among `parents`
/// that holds it (a module shared by several Sequentials runs its hooks through each).
inline ModuleHookHandle register_exact(const std::shared_ptr<torch::nn::Module>& module, ExactHook hook, std::string path,
                                       const std::vector<std::shared_ptr<torch::nn::Module>>& parents) {
  if (!module) throw Error("torchdbg: register_module_hook got a null module");
  if (!hook.fn) throw Error("torchdbg: register_module_hook got an empty hook for '" + path + "'");
  check_direction(hook.direction, "register_module_hook for '" + path + "'");
  auto& registry = ExactHookRegistry::instance();
  std::vector<std::shared_ptr<torch::nn::SequentialImpl>> through;
  for (const auto& parent : parents) {
    auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(parent);
    if (!seq) continue;
    if (dynamic_cast<HookedSequentialImpl*>(seq.get()) != nullptr) {
      registry.mark_hookable(module, seq);  // its forward runs the hooks already
    } else if (const char* why = not_tensor_to_tensor(*module)) {
      throw Error("torchdbg: module '" + path + "' (" + module->name() + ") " + why +
                  ": exact hooks need a module that maps one Tensor to one Tensor");
    } else {
      through.push_back(std::move(seq));
    }
  }
  return ModuleHookHandle({registry.add(module, std::move(path), std::move(hook), through)});
}
}  // namespace detail

/// Registers an exact hook on one module. The module's calls must go through torchdbg: it is
/// declared Hooked<...>, is a child of a (Hooked)Sequential — pass that Sequential as
/// `parent`, or use the path overload or MultiHookManager, which find it — or is called with
/// hooked_call. Throws torchdbg::Error otherwise, or for a direction outside HookDirection.
[[nodiscard]] inline ModuleHookHandle register_module_hook(const std::shared_ptr<torch::nn::Module>& module,
                                                           ExactHook hook, std::string path = "",
                                                           const std::shared_ptr<torch::nn::Module>& parent = nullptr) {
  std::vector<std::shared_ptr<torch::nn::Module>> parents;
  if (parent) parents.push_back(parent);
  return detail::register_exact(module, std::move(hook), std::move(path), parents);
}

/// Registers an exact hook on the module at `path` (paths.hpp) under `root`; a child of
/// plain Sequentials is made hookable in each of them for as long as it has hooks.
[[nodiscard]] inline ModuleHookHandle register_module_hook(const std::shared_ptr<torch::nn::Module>& root,
                                                           std::string_view path, ExactHook hook) {
  auto found = resolve_submodule_paths(root, path);
  if (found.size() != 1) throw Error("torchdbg: path '" + std::string(path) + "' must select one module");
  return detail::register_exact(found.front().module, std::move(hook), found.front().name,
                                detail::find_parents(root, found.front().module.get()));
}

/// Calls a container child (a ModuleList or ModuleDict item, whose calls the model's own
/// forward makes) through torchdbg so its exact hooks run: `hooked_call<torch::nn::LinearImpl>(list[i], x)`.
/// The child becomes hookable at its first call.
template <typename Impl>
at::Tensor hooked_call(const std::shared_ptr<torch::nn::Module>& module, const at::Tensor& x) {
  if (!module) throw Error("torchdbg: hooked_call got a null module");
  auto* impl = module->as<Impl>();
  if (impl == nullptr) throw Error("torchdbg: hooked_call: module " + module->name() + " is not of the requested type");
  detail::ExactHookRegistry::instance().mark_hookable(module);
  return detail::run_with_hooks(module, x, [impl](const at::Tensor& in) { return impl->forward(in); });
}

/// A drop-in for a ModuleHolder whose calls run the module's exact hooks.
///
/// ```cpp
/// struct Net : torch::nn::Module {
///   torchdbg::Hooked<torch::nn::Linear> fc1{nullptr};
///   Net() { fc1 = register_module("fc1", torch::nn::Linear(4, 8)); }
///   torch::Tensor forward(torch::Tensor x) { return fc1(x); }   // call the holder, not ->forward
/// };
/// ```
template <typename Holder>
class Hooked : public Holder {
 public:
  using Impl = typename Holder::ContainedType;

  Hooked(std::nullptr_t) : Holder(nullptr) {}  // NOLINT: implicit like the holder's
  Hooked(Holder h) : Holder(std::move(h)) { mark(); }  // NOLINT
  Hooked(std::shared_ptr<Impl> p) : Holder(std::move(p)) { mark(); }  // NOLINT
  template <typename A0, typename... As,
            typename = std::enable_if_t<!std::is_same_v<std::decay_t<A0>, Hooked> &&
                                        !std::is_same_v<std::decay_t<A0>, Holder> &&
                                        !std::is_same_v<std::decay_t<A0>, std::shared_ptr<Impl>> &&
                                        !std::is_same_v<std::decay_t<A0>, std::nullptr_t>>>
  explicit Hooked(A0&& a0, As&&... as) : Holder(std::forward<A0>(a0), std::forward<As>(as)...) {
    mark();
  }

  /// Calls the module's forward with its exact hooks around it.
  at::Tensor operator()(const at::Tensor& x) {
    static_assert(std::is_same_v<decltype(std::declval<Impl&>().forward(std::declval<const at::Tensor&>())), at::Tensor>,
                  "torchdbg::Hooked needs a module whose forward maps one Tensor to one Tensor");
    return detail::run_with_hooks(this->ptr(), x, [this](const at::Tensor& in) { return this->get()->forward(in); });
  }

 private:
  void mark() {
    if (!this->is_empty()) detail::ExactHookRegistry::instance().mark_hookable(this->ptr());
  }
};


// ---- hook factories (tdhook's set) ----------------------------------------------------------

/// What caching hooks store.
struct CacheOptions {
  /// Store `tensor.detach()` (the default) rather than the tensor in the graph.
  TORCH_ARG(bool, detach) = true;
  /// Store a copy, so later in-place changes do not reach the cache.
  TORCH_ARG(bool, clone) = false;
};

namespace detail {
template <typename T>
struct is_std_function : std::false_type {};
template <typename R, typename... A>
struct is_std_function<std::function<R(A...)>> : std::true_type {};

inline const at::Tensor& direction_tensor(HookDirection d, const HookTensors& t) {
  switch (d) {
    case HookDirection::FwdPre: return t.input;
    case HookDirection::Fwd: return t.output;
    case HookDirection::BwdPre: return t.grad_output;
    case HookDirection::Bwd: return t.grad_input;
  }
  return t.output;
}
}  // namespace detail

/// Stores the direction's tensor (input, output, grad_output, grad_input) in `cache` under
/// `key` (the module's path when empty).
inline ExactHook caching_hook(std::shared_ptr<TensorCache> cache, std::string key = "",
                              HookDirection direction = HookDirection::Fwd, CacheOptions options = {}) {
  if (!cache) throw Error("torchdbg: caching_hook needs a cache");
  detail::check_direction(direction, "caching_hook");
  return {direction, [cache, key, options](const ModuleCall& c, const HookTensors& t) -> std::optional<at::Tensor> {
            at::Tensor v = detail::direction_tensor(c.direction, t);
            if (v.defined()) {
              if (options.detach()) v = v.detach();
              if (options.clone()) v = v.clone();
            }
            cache->set(key.empty() ? std::string(c.path) : key, v);
            return std::nullopt;
          }};
}

/// Replaces the direction's tensor with `value` (shape, dtype and device must match).
inline ExactHook setting_hook(at::Tensor value, HookDirection direction = HookDirection::Fwd) {
  if (!value.defined()) throw Error("torchdbg: setting_hook needs a defined tensor");
  detail::check_direction(direction, "setting_hook");
  return {direction, [value](const ModuleCall&, const HookTensors&) -> std::optional<at::Tensor> { return value; }};
}

/// Replaces the direction's tensor with `cache->get(key)`, resolved at call time (an absent
/// key is an error naming it).
inline ExactHook setting_hook(std::shared_ptr<TensorCache> cache, std::string key,
                              HookDirection direction = HookDirection::Fwd) {
  if (!cache) throw Error("torchdbg: setting_hook needs a cache");
  detail::check_direction(direction, "setting_hook");
  return {direction, [cache, key](const ModuleCall&, const HookTensors&) -> std::optional<at::Tensor> {
            return cache->get(key);
          }};
}

/// Replaces the direction's tensor with `fn(tensor)`. `fn` returns a Tensor, or a
/// `std::optional<Tensor>` whose `std::nullopt` keeps the value (tdhook's `None`):
///
/// ```cpp
/// auto clip = setting_hook([](const torch::Tensor& t) -> std::optional<torch::Tensor> {
///   if (t.abs().max().item<double>() < 10) return std::nullopt;  // keep it
///   return t.clamp(-10, 10);
/// });
/// ```
template <typename Fn, typename = std::enable_if_t<std::is_invocable_v<const Fn&, const at::Tensor&>>>
ExactHook setting_hook(Fn fn, HookDirection direction = HookDirection::Fwd) {
  using Result = std::decay_t<std::invoke_result_t<const Fn&, const at::Tensor&>>;
  static_assert(std::is_same_v<Result, at::Tensor> || std::is_same_v<Result, std::optional<at::Tensor>>,
                "torchdbg::setting_hook: the function must return a Tensor or a std::optional<Tensor>");
  if constexpr (std::is_pointer_v<Fn> || detail::is_std_function<Fn>::value) {
    if (!fn) throw Error("torchdbg: setting_hook needs a function");
  }
  detail::check_direction(direction, "setting_hook");
  return {direction, [fn = std::move(fn)](const ModuleCall& c, const HookTensors& t) -> std::optional<at::Tensor> {
            return fn(detail::direction_tensor(c.direction, t));
          }};
}

/// Calls `fn(call, tensor)` with the direction's tensor; changes nothing.
inline ExactHook reading_hook(std::function<void(const ModuleCall&, const at::Tensor&)> fn,
                              HookDirection direction = HookDirection::Fwd) {
  if (!fn) throw Error("torchdbg: reading_hook needs a function");
  detail::check_direction(direction, "reading_hook");
  return {direction, [fn](const ModuleCall& c, const HookTensors& t) -> std::optional<at::Tensor> {
            fn(c, detail::direction_tensor(c.direction, t));
            return std::nullopt;
          }};
}

/// Ends the forward pass right after the module (throws StopForward).
inline ExactHook stopping_hook() {
  return {HookDirection::Fwd, [](const ModuleCall& c, const HookTensors&) -> std::optional<at::Tensor> {
            throw StopForward(std::string(c.path));
          }};
}

namespace detail {
template <typename T>
std::shared_ptr<torch::nn::Module> as_module_ptr(const std::shared_ptr<T>& p) {
  return p;
}
template <typename T>
std::shared_ptr<torch::nn::Module> as_module_ptr(const torch::nn::ModuleHolder<T>& h) {
  return h.ptr();
}
}  // namespace detail

// ---- selecting modules (tdhook's MultiHookManager) -------------------------------------------

/// A test on a module, e.g. `module_type<torch::nn::LinearImpl>()`.
using ModulePredicate = std::function<bool(const torch::nn::Module&)>;

/// True for modules of type T (or derived from it).
template <typename T>
ModulePredicate module_type() {
  return [](const torch::nn::Module& m) { return dynamic_cast<const T*>(&m) != nullptr; };
}

/// What a MultiHookManager selects. The pattern is required (tdhook's default pattern
/// matches nothing; torchdbg asks for one instead of guessing): a regex matched from the
/// start of each module's dotted name, as Python's `re.match` (`$` anchors the end, `""`
/// matches every module).
///
/// ```cpp
/// torchdbg::MultiHookOptions().pattern("layers\\.[0-9]+$").require_match(true)
/// ```
struct MultiHookOptions {
  /// The regex over dotted module names (relative to the model). Required.
  TORCH_ARG(std::optional<std::string>, pattern);
  /// Only modules for which one of these holds (empty: all).
  TORCH_ARG(std::vector<ModulePredicate>, classes_to_hook);
  /// Never modules for which one of these holds.
  TORCH_ARG(std::vector<ModulePredicate>, classes_to_skip);
  /// A submodule path (paths.hpp) below the model under which to search; names stay
  /// relative to the model.
  TORCH_ARG(std::string, relative_path) = "";
  /// register_hook throws torchdbg::Error when it selects no module; by default it returns
  /// an empty handle, as tdhook does.
  TORCH_ARG(bool, require_match) = false;
};

/// Makes the hook for one selected module from its dotted name (tdhook's hook factory).
using ExactHookFactory = std::function<ExactHook(const std::string& name)>;

/// Registers one hook on every hookable module that matches a pattern and class filters, each
/// module once (a module registered under two names is hooked under the first, as PyTorch's
/// `named_modules()` lists it). Modules that match but whose calls do not go through torchdbg
/// are skipped; `unhookable(model)` names them. Const members may run concurrently;
/// `set_pattern` must not run beside them.
///
/// ```cpp
/// auto cache = std::make_shared<torchdbg::TensorCache>();
/// torchdbg::MultiHookManager mgr(torchdbg::MultiHookOptions().pattern("layers\\.[0-9]+$"));
/// auto handle = mgr.register_hook(model, torchdbg::caching_hook(cache));   // RAII
/// ```
class MultiHookManager {
 public:
  /// Throws torchdbg::Error when `options` has no pattern or an invalid one.
  explicit MultiHookManager(MultiHookOptions options)
      : options_(std::move(options)), regex_(compile(options_.pattern())) {}

  /// The pattern modules are selected by.
  [[nodiscard]] const std::string& pattern() const noexcept { return *options_.pattern(); }
  /// Selects by `pattern` from now on (tdhook's `manager.pattern = ...`); an invalid pattern
  /// throws torchdbg::Error and keeps the previous one. Hooks registered before stay.
  void set_pattern(std::string pattern) {
    auto regex = compile(pattern);
    options_.pattern(std::move(pattern));
    regex_ = std::move(regex);
  }

  /// The dotted names of the modules that a hook would be registered on.
  [[nodiscard]] std::vector<std::string> matching(const std::shared_ptr<torch::nn::Module>& model) const {
    const auto selection = select(model);
    std::vector<std::string> names;
    for (const auto& sel : selection.hookable) names.push_back(sel.name);
    return names;
  }
  /// The dotted names of the modules that match but cannot be hooked (their calls do not go
  /// through torchdbg: see register_module_hook).
  [[nodiscard]] std::vector<std::string> unhookable(const std::shared_ptr<torch::nn::Module>& model) const {
    return select(model).unhookable;
  }

  /// Registers `hook` on every selected module; an empty handle when none is selected
  /// (torchdbg::Error with `require_match`).
  [[nodiscard]] ModuleHookHandle register_hook(const std::shared_ptr<torch::nn::Module>& model, const ExactHook& hook) const {
    return register_each(model, [&hook](const std::string&) { return hook; });
  }
  /// Registers `factory(name)` on every selected module (tdhook's hook factory).
  [[nodiscard]] ModuleHookHandle register_hook(const std::shared_ptr<torch::nn::Module>& model,
                                               const ExactHookFactory& factory) const {
    if (!factory) throw Error("torchdbg: MultiHookManager::register_hook got an empty hook factory");
    return register_each(model, factory);
  }
  template <typename T>
  [[nodiscard]] ModuleHookHandle register_hook(const torch::nn::ModuleHolder<T>& holder, const ExactHook& hook) const {
    return register_hook(detail::as_module_ptr(holder), hook);
  }
  template <typename T>
  [[nodiscard]] ModuleHookHandle register_hook(const torch::nn::ModuleHolder<T>& holder,
                                               const ExactHookFactory& factory) const {
    return register_hook(detail::as_module_ptr(holder), factory);
  }

 private:
  struct Selected {
    std::string name;
    std::shared_ptr<torch::nn::Module> module;
    std::vector<std::shared_ptr<torch::nn::Module>> parents;  // every module that holds it
  };
  struct Selection {
    std::vector<Selected> hookable;
    std::vector<std::string> unhookable;
  };

  static detail::Pattern compile(const std::optional<std::string>& pattern) {
    if (!pattern) {
      throw Error("torchdbg: MultiHookManager needs a pattern (MultiHookOptions().pattern(...)); "
                  "\"\" matches every module");
    }
    return detail::compile_pattern(*pattern, "module pattern");
  }

  template <typename Make>
  ModuleHookHandle register_each(const std::shared_ptr<torch::nn::Module>& model, Make&& make) const {
    auto selection = select(model);
    if (selection.hookable.empty() && options_.require_match()) {
      std::string skipped;
      for (const auto& n : selection.unhookable) skipped += (skipped.empty() ? "" : ", ") + n;
      throw Error("torchdbg: no hookable module matches '" + pattern() + "'" +
                  (skipped.empty() ? std::string() : " (matching but not hookable: " + skipped + ")"));
    }
    std::vector<ExactHook> hooks;  // all made and checked before any is registered
    for (const auto& sel : selection.hookable) {
      hooks.push_back(make(sel.name));
      if (!hooks.back().fn) throw Error("torchdbg: the hook factory returned an empty hook for '" + sel.name + "'");
      detail::check_direction(hooks.back().direction, "MultiHookManager::register_hook for '" + sel.name + "'");
    }
    ModuleHookHandle all;
    for (std::size_t i = 0; i < hooks.size(); ++i) {
      const auto& sel = selection.hookable[i];
      all = std::move(all) + detail::register_exact(sel.module, std::move(hooks[i]), sel.name, sel.parents);
    }
    return all;
  }

  Selection select(const std::shared_ptr<torch::nn::Module>& model) const {
    if (!model) throw Error("torchdbg: MultiHookManager got a null model");
    std::shared_ptr<torch::nn::Module> root = model;
    std::string prefix;
    if (!options_.relative_path().empty()) {
      auto found = resolve_submodule_paths(model, options_.relative_path());
      if (found.size() != 1) throw Error("torchdbg: relative_path '" + options_.relative_path() + "' must select one module");
      root = found.front().module;
      prefix = found.front().name;
    }
    // Each module once, under its first name in pre-order (PyTorch's named_modules()), with
    // every parent that holds it: a module shared by two Sequentials is hooked in both.
    std::vector<Selected> found;
    std::unordered_map<const torch::nn::Module*, std::size_t> index{{root.get(), SIZE_MAX}};
    walk(root, prefix, index, found);
    if (root != model) {  // parents outside the relative root hold some of them too
      std::vector<Selected> everywhere;
      std::unordered_map<const torch::nn::Module*, std::size_t> at{{model.get(), SIZE_MAX}};
      walk(model, "", at, everywhere);
      for (auto& sel : found) sel.parents = everywhere[at.at(sel.module.get())].parents;
    }
    Selection out;
    for (auto& sel : found) {
      if (!accept(sel.name, *sel.module)) continue;
      const bool in_sequential = std::any_of(sel.parents.begin(), sel.parents.end(), [](const auto& p) {
        return dynamic_cast<torch::nn::SequentialImpl*>(p.get()) != nullptr;
      });
      const bool forwardable = in_sequential && detail::not_tensor_to_tensor(*sel.module) == nullptr;
      if (forwardable || detail::ExactHookRegistry::instance().is_hookable(sel.module.get())) {
        out.hookable.push_back(std::move(sel));
      } else {
        out.unhookable.push_back(sel.name);
      }
    }
    return out;
  }

  static void walk(const std::shared_ptr<torch::nn::Module>& parent, const std::string& prefix,
                   std::unordered_map<const torch::nn::Module*, std::size_t>& index, std::vector<Selected>& found) {
    for (const auto& item : parent->named_children()) {
      const auto& m = item.value();
      const auto [it, first] = index.emplace(m.get(), found.size());
      if (!first) {  // seen before: one more parent, nothing new below it
        if (it->second != SIZE_MAX) {
          auto& parents = found[it->second].parents;
          if (std::find(parents.begin(), parents.end(), parent) == parents.end()) parents.push_back(parent);
        }
        continue;
      }
      const std::string name = prefix.empty() ? item.key() : prefix + "." + item.key();
      found.push_back({name, m, {parent}});
      walk(m, name, index, found);
    }
  }

  bool accept(const std::string& name, const torch::nn::Module& m) const {
    if (!regex_.match_prefix(name)) return false;
    if (!options_.classes_to_hook().empty()) {
      bool any = false;
      for (const auto& p : options_.classes_to_hook()) any = any || p(m);
      if (!any) return false;
    }
    for (const auto& p : options_.classes_to_skip())
      if (p(m)) return false;
    return true;
  }

  MultiHookOptions options_;
  detail::Pattern regex_;
};

/// Runs `model->forward(input)` until the module at `path` has produced its output, and
/// returns a cache holding that output under the module's dotted name: the output the rest of
/// the model would see, after every Fwd hook of the module (run_until's own hooks have the
/// lowest priority). `model` is a std::shared_ptr to a module or a ModuleHolder. The rest of the
/// forward does not run. Throws torchdbg::Error when the forward never reaches the module.
template <typename Model>
std::shared_ptr<TensorCache> run_until(Model& model, const at::Tensor& input, std::string_view path,
                                       CacheOptions options = {}) {
  std::shared_ptr<torch::nn::Module> root = detail::as_module_ptr(model);
  auto found = resolve_submodule_paths(root, path);
  if (found.size() != 1) throw Error("torchdbg: run_until path '" + std::string(path) + "' must select one module");
  auto cache = std::make_shared<TensorCache>();
  const std::string name = found.front().name;
  {
    // After every hook of the user's; two statements: the cache must be registered (and run)
    // before the stop.
    constexpr int kLast = std::numeric_limits<int>::min();
    const auto parents = detail::find_parents(root, found.front().module.get());
    auto handle = detail::register_exact(found.front().module,
                                         caching_hook(cache, name, HookDirection::Fwd, options).with_priority(kLast), name, parents);
    handle = std::move(handle) + detail::register_exact(found.front().module, stopping_hook().with_priority(kLast), name, parents);
    try {
      (void)model->forward(input);
    } catch (const StopForward&) {
    }
  }
  if (!cache->contains(name)) throw Error("torchdbg: the forward never reached '" + name + "'");
  return cache;
}

}  // namespace torchdbg
