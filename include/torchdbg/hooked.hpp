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

  void mark_hookable(const std::shared_ptr<torch::nn::Module>& m) {
    if (!m) return;
    std::lock_guard<std::mutex> lock(mutex_);
    hookable_[m.get()] = m;
  }
  bool is_hookable(const torch::nn::Module* m) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = hookable_.find(m);
    if (it == hookable_.end()) return false;
    if (it->second.expired()) {
      hookable_.erase(it);
      return false;
    }
    return true;
  }

  /// A child of a plain Sequential becomes hookable by swapping, in the Sequential's list of
  /// AnyModules, a forwarder that runs the hooks around the original; `restore` swaps the
  /// original back. named_children()/parameters() are never touched.
  void forward_through(const std::shared_ptr<torch::nn::SequentialImpl>& parent,
                       const std::shared_ptr<torch::nn::Module>& child);

  uint64_t add(const std::shared_ptr<torch::nn::Module>& m, std::string path, ExactHook hook) {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t id = ++seq_;
    auto& slot = hooks_[m.get()];
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

  bool remove(uint64_t id) {
    std::shared_ptr<torch::nn::SequentialImpl> restore_parent;
    const torch::nn::Module* restore_child = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto o = owner_of_.find(id);
      if (o == owner_of_.end()) return false;
      auto it = hooks_.find(o->second);
      owner_of_.erase(o);
      if (it == hooks_.end()) return false;
      auto next = std::make_shared<List>();
      for (const auto& e : *it->second.list)
        if (e.id != id) next->push_back(e);
      const torch::nn::Module* m = it->first;
      if (next->empty()) {
        hooks_.erase(it);
        auto f = forwarded_.find(m);
        if (f != forwarded_.end()) {  // the last hook of a Sequential child: put it back
          restore_parent = f->second.lock();
          restore_child = m;
          forwarded_.erase(f);
          hookable_.erase(m);
        }
      } else {
        it->second.list = std::move(next);
      }
      count_.fetch_sub(1);
    }
    if (restore_parent) restore(*restore_parent, restore_child);
    return true;
  }

  /// The hooks of `m` (null when none); a cheap atomic check when no hook exists at all.
  std::shared_ptr<const List> hooks_for(const torch::nn::Module* m) {
    if (count_.load(std::memory_order_relaxed) == 0) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = hooks_.find(m);
    return it == hooks_.end() ? nullptr : it->second.list;
  }

 private:
  struct Slot {
    std::shared_ptr<const List> list;
    std::weak_ptr<torch::nn::Module> owner;
  };
  std::mutex mutex_;
  std::atomic<std::size_t> count_{0};
  uint64_t seq_ = 0;
  int64_t front_position_ = 0, back_position_ = 0;
  std::unordered_map<const torch::nn::Module*, Slot> hooks_;  // each list in execution order
  std::unordered_map<uint64_t, const torch::nn::Module*> owner_of_;
  std::unordered_map<const torch::nn::Module*, std::weak_ptr<torch::nn::Module>> hookable_;
  std::unordered_map<const torch::nn::Module*, std::weak_ptr<torch::nn::SequentialImpl>> forwarded_;

  static void restore(torch::nn::SequentialImpl& parent, const torch::nn::Module* child);
};

inline void check_replacement(const at::Tensor& original, const at::Tensor& replacement, const ModuleCall& call) {
  const std::string where = std::string(to_string(call.direction)) + " hook of '" + std::string(call.path) + "'";
  if (!replacement.defined()) throw Error("torchdbg: " + where + " returned an undefined tensor");
  if (!original.defined()) return;
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
  at::Tensor out = apply_direction(*hooks, HookDirection::Fwd, *m, call(in),
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
  explicit SequentialForwarderImpl(torch::nn::AnyModule original)
      : torch::nn::Module("torchdbg::SequentialForwarder"), original_(std::move(original)), target_(original_.ptr()) {}

  at::Tensor forward(const at::Tensor& x) {
    return run_with_hooks(target_, x, [this](const at::Tensor& in) { return original_.forward<at::Tensor>(in); });
  }
  /// Cloning a Sequential while a child is hooked clones the child, which stays reachable
  /// (and its parameters registered) under the forwarder's child "module"; hooks do not
  /// follow clones.
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<at::Device>& device = c10::nullopt) const override {
    auto copy = std::make_shared<SequentialForwarderImpl>(original_.clone(device));
    copy->register_module("module", copy->target_);
    return copy;
  }
  [[nodiscard]] const std::shared_ptr<torch::nn::Module>& target() const noexcept { return target_; }
  torch::nn::AnyModule take_original() { return std::move(original_); }

 private:
  torch::nn::AnyModule original_;
  std::shared_ptr<torch::nn::Module> target_;
};

inline void ExactHookRegistry::forward_through(const std::shared_ptr<torch::nn::SequentialImpl>& parent,
                                               const std::shared_ptr<torch::nn::Module>& child) {
  bool installed = false;
  for (auto it = parent->begin(); it != parent->end(); ++it) {
    auto current = it->ptr();
    if (auto* f = dynamic_cast<SequentialForwarderImpl*>(current.get())) {
      if (f->target().get() == child.get()) installed = true;
    } else if (current.get() == child.get()) {
      *it = torch::nn::AnyModule(std::make_shared<SequentialForwarderImpl>(std::move(*it)));
      installed = true;
    }
    if (installed) break;
  }
  if (!installed) throw Error("torchdbg: module is not a child of the given Sequential");
  std::lock_guard<std::mutex> lock(mutex_);
  hookable_[child.get()] = child;
  forwarded_[child.get()] = parent;
}

inline void ExactHookRegistry::restore(torch::nn::SequentialImpl& parent, const torch::nn::Module* child) {
  for (auto it = parent.begin(); it != parent.end(); ++it) {
    auto current = it->ptr();
    auto* f = dynamic_cast<SequentialForwarderImpl*>(current.get());
    if (f != nullptr && f->target().get() == child) {
      *it = f->take_original();
      return;
    }
  }
}

/// The direct parent of `child` under `root`, or null.
inline std::shared_ptr<torch::nn::Module> find_parent(const std::shared_ptr<torch::nn::Module>& root,
                                                      const torch::nn::Module* child) {
  for (const auto& item : root->named_children()) {
    if (item.value().get() == child) return root;
    if (auto p = find_parent(item.value(), child)) return p;
  }
  return nullptr;
}

}  // namespace detail

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

class HookedSequentialImpl;

/// Registers an exact hook on one module. The module's calls must go through torchdbg: it is
/// declared Hooked<...>, is a child of a (Hooked)Sequential — pass that Sequential as
/// `parent`, or use the path overload or MultiHookManager, which find it — or is called with
/// hooked_call. Throws torchdbg::Error otherwise.
[[nodiscard]] inline ModuleHookHandle register_module_hook(const std::shared_ptr<torch::nn::Module>& module,
                                                           ExactHook hook, std::string path = "",
                                                           const std::shared_ptr<torch::nn::Module>& parent = nullptr) {
  if (!module) throw Error("torchdbg: register_module_hook got a null module");
  if (!hook.fn) throw Error("torchdbg: register_module_hook got an empty hook for '" + path + "'");
  auto& registry = detail::ExactHookRegistry::instance();
  if (!registry.is_hookable(module.get())) {
    auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(parent);
    if (seq) {
      registry.forward_through(seq, module);
    } else {
      throw Error("torchdbg: module '" + path + "' (" + module->name() +
                  ") is not called through torchdbg: declare it as torchdbg::Hooked<...>, put it in a "
                  "Sequential (register by path or with MultiHookManager), call it with "
                  "torchdbg::hooked_call, or observe it read-only with torchdbg::attach()");
    }
  }
  return ModuleHookHandle({registry.add(module, std::move(path), std::move(hook))});
}

/// Registers an exact hook on the module at `path` (paths.hpp) under `root`; a child of a
/// plain Sequential is made hookable for as long as it has hooks.
[[nodiscard]] inline ModuleHookHandle register_module_hook(const std::shared_ptr<torch::nn::Module>& root,
                                                           std::string_view path, ExactHook hook) {
  auto found = resolve_submodule_paths(root, path);
  if (found.size() != 1) throw Error("torchdbg: path '" + std::string(path) + "' must select one module");
  return register_module_hook(found.front().module, std::move(hook), found.front().name,
                              detail::find_parent(root, found.front().module.get()));
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
      detail::ExactHookRegistry::instance().mark_hookable(child);
      out = detail::run_with_hooks(child, out, [&](const at::Tensor& in) { return it->forward<at::Tensor>(in); });
    }
    return out;
  }

  /// Marks every current child as hookable (done by the constructors, forward and
  /// MultiHookManager; call it after push_back to hook a new child before its first call).
  void mark_children() {
    for (std::size_t i = 0; i < size(); ++i) detail::ExactHookRegistry::instance().mark_hookable(ptr(i));
  }
};
TORCH_MODULE(HookedSequential);

// ---- hook factories (tdhook's set) ----------------------------------------------------------

/// What caching hooks store.
struct CacheOptions {
  /// Store `tensor.detach()` (the default) rather than the tensor in the graph.
  TORCH_ARG(bool, detach) = true;
  /// Store a copy, so later in-place changes do not reach the cache.
  TORCH_ARG(bool, clone) = false;
};

namespace detail {
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
  return {direction, [cache, key, direction, options](const ModuleCall& c, const HookTensors& t) -> std::optional<at::Tensor> {
            at::Tensor v = detail::direction_tensor(direction, t);
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
  return {direction, [value](const ModuleCall&, const HookTensors&) -> std::optional<at::Tensor> { return value; }};
}

/// Replaces the direction's tensor with `cache->get(key)`, resolved at call time (an absent
/// key is an error naming it).
inline ExactHook setting_hook(std::shared_ptr<TensorCache> cache, std::string key,
                              HookDirection direction = HookDirection::Fwd) {
  if (!cache) throw Error("torchdbg: setting_hook needs a cache");
  return {direction, [cache, key](const ModuleCall&, const HookTensors&) -> std::optional<at::Tensor> {
            return cache->get(key);
          }};
}

/// Replaces the direction's tensor with `fn(tensor)`.
inline ExactHook setting_hook(std::function<at::Tensor(const at::Tensor&)> fn,
                              HookDirection direction = HookDirection::Fwd) {
  if (!fn) throw Error("torchdbg: setting_hook needs a function");
  return {direction, [fn, direction](const ModuleCall&, const HookTensors& t) -> std::optional<at::Tensor> {
            return fn(detail::direction_tensor(direction, t));
          }};
}

/// Calls `fn(call, tensor)` with the direction's tensor; changes nothing.
inline ExactHook reading_hook(std::function<void(const ModuleCall&, const at::Tensor&)> fn,
                              HookDirection direction = HookDirection::Fwd) {
  if (!fn) throw Error("torchdbg: reading_hook needs a function");
  return {direction, [fn, direction](const ModuleCall& c, const HookTensors& t) -> std::optional<at::Tensor> {
            fn(c, detail::direction_tensor(direction, t));
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

struct MultiHookOptions {
  /// Regex matched from the start of the dotted name relative to the root (`$` anchors the
  /// end). Empty: every module.
  TORCH_ARG(std::string, pattern) = "";
  /// Only modules for which one of these holds (empty: all).
  TORCH_ARG(std::vector<ModulePredicate>, classes_to_hook);
  /// Never modules for which one of these holds.
  TORCH_ARG(std::vector<ModulePredicate>, classes_to_skip);
  /// A submodule path (paths.hpp) below the model under which to search; names stay
  /// relative to the model.
  TORCH_ARG(std::string, relative_path) = "";
};

/// Registers one hook on every hookable module that matches a pattern and class filters.
///
/// ```cpp
/// auto cache = std::make_shared<torchdbg::TensorCache>();
/// torchdbg::MultiHookManager mgr(torchdbg::MultiHookOptions().pattern("layers\\.[0-9]+$"));
/// auto handle = mgr.register_hook(model, torchdbg::caching_hook(cache));   // RAII
/// ```
class MultiHookManager {
 public:
  explicit MultiHookManager(MultiHookOptions options = {})
      : options_(std::move(options)), regex_(detail::compile_pattern(options_.pattern(), "module pattern")) {}

  /// The dotted names of the modules that a hook would be registered on.
  [[nodiscard]] std::vector<std::string> matching(const std::shared_ptr<torch::nn::Module>& model) const {
    std::vector<std::string> names;
    for (auto& sel : select(model)) names.push_back(sel.name);
    return names;
  }

  /// Registers `hook` on every selected module; throws torchdbg::Error when none is selected.
  [[nodiscard]] ModuleHookHandle register_hook(const std::shared_ptr<torch::nn::Module>& model, const ExactHook& hook) const {
    auto selected = select(model);
    if (selected.empty()) {
      throw Error("torchdbg: no hookable module matches '" + options_.pattern() + "'" +
                  (skipped_unhookable_.empty() ? std::string() : " (matching but not hookable: " + skipped_unhookable_ + ")"));
    }
    ModuleHookHandle all;
    for (auto& sel : selected) all = std::move(all) + register_module_hook(sel.module, hook, sel.name, sel.parent);
    return all;
  }

  template <typename T>
  [[nodiscard]] ModuleHookHandle register_hook(const torch::nn::ModuleHolder<T>& holder, const ExactHook& hook) const {
    return register_hook(detail::as_module_ptr(holder), hook);
  }

 private:
  struct Selected {
    std::string name;
    std::shared_ptr<torch::nn::Module> module;
    std::shared_ptr<torch::nn::Module> parent;
  };

  std::vector<Selected> select(const std::shared_ptr<torch::nn::Module>& model) const {
    if (!model) throw Error("torchdbg: MultiHookManager got a null model");
    skipped_unhookable_.clear();
    std::shared_ptr<torch::nn::Module> root = model;
    std::string prefix;
    if (!options_.relative_path().empty()) {
      auto found = resolve_submodule_paths(model, options_.relative_path());
      if (found.size() != 1) throw Error("torchdbg: relative_path '" + options_.relative_path() + "' must select one module");
      root = found.front().module;
      prefix = found.front().name;
    }
    std::vector<Selected> out;
    walk(root, prefix, out);
    return out;
  }

  void walk(const std::shared_ptr<torch::nn::Module>& parent, const std::string& prefix, std::vector<Selected>& out) const {
    if (auto* seq = dynamic_cast<HookedSequentialImpl*>(parent.get())) seq->mark_children();
    const bool sequential = dynamic_cast<torch::nn::SequentialImpl*>(parent.get()) != nullptr;
    for (const auto& item : parent->named_children()) {
      const std::string name = prefix.empty() ? item.key() : prefix + "." + item.key();
      const auto& m = item.value();
      if (accept(name, *m)) {
        if (sequential || detail::ExactHookRegistry::instance().is_hookable(m.get())) {
          out.push_back({name, m, parent});
        } else {
          skipped_unhookable_ += (skipped_unhookable_.empty() ? "" : ", ") + name;
        }
      }
      walk(m, name, out);
    }
  }

  bool accept(const std::string& name, const torch::nn::Module& m) const {
    if (!options_.pattern().empty() && !regex_.match_prefix(name)) return false;
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
  mutable std::string skipped_unhookable_;
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
    const auto parent = detail::find_parent(root, found.front().module.get());
    auto handle = register_module_hook(found.front().module,
                                       caching_hook(cache, name, HookDirection::Fwd, options).with_priority(kLast), name, parent);
    handle = std::move(handle) + register_module_hook(found.front().module, stopping_hook().with_priority(kLast), name, parent);
    try {
      (void)model->forward(input);
    } catch (const StopForward&) {
    }
  }
  if (!cache->contains(name)) throw Error("torchdbg: the forward never reached '" + name + "'");
  return cache;
}

}  // namespace torchdbg
