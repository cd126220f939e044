// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The one permanent tensor hook per parameter that gradient sessions subscribe to.

#include <ATen/ATen.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "torchdbg/attach/core.hpp"

namespace torchdbg::detail {

/// The one tensor hook torchdbg puts on a parameter, shared by every session that watches it.
/// LibTorch's tensor hooks cannot be added or removed while a backward pass may run them
/// (removal frees the hook while it runs; adding may move the list being walked), so a tap
/// is registered once, on the first attach, and stays for the tensor's life: sessions
/// subscribe and unsubscribe under the tap's own lock, from any thread, at any time. With no
/// subscriber a tap costs one list check per gradient.
class GradientTap {
 public:
  struct Subscriber {
    std::shared_ptr<AttachCore> core;
    std::size_t module = 0;
    std::size_t param = 0;
  };

  /// The tap of `t`, registering its hook if `t` has none yet.
  static std::shared_ptr<GradientTap> of(const at::Tensor& t) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto& slot = r.taps[t.unsafeGetTensorImpl()];
    if (auto tap = slot.lock(); tap && !tap->tensor_.expired() && tap->tensor_._unsafe_get_target() == t.unsafeGetTensorImpl())
      return tap;
    auto tap = std::shared_ptr<GradientTap>(new GradientTap(weak_of(t)));
    // The hook owns the tap; the registry only finds it.
    t.register_hook([tap](const at::Tensor& g) { tap->fire(g); });
    slot = tap;
    if (r.taps.size() >= 2 * r.live_at_sweep + 64) {  // forget the taps of freed tensors
      for (auto it = r.taps.begin(); it != r.taps.end();)
        it = it->second.expired() ? r.taps.erase(it) : std::next(it);
      r.live_at_sweep = r.taps.size();
    }
    return tap;
  }

  void subscribe(Subscriber s) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto next = std::make_shared<List>(*std::atomic_load(&subscribers_));
    next->push_back(std::move(s));
    std::atomic_store(&subscribers_, std::shared_ptr<const List>(std::move(next)));
  }
  void unsubscribe(const AttachCore* core) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto next = std::make_shared<List>();
    const auto current = std::atomic_load(&subscribers_);
    for (const auto& s : *current)
      if (s.core.get() != core) next->push_back(s);
    std::atomic_store(&subscribers_, std::shared_ptr<const List>(std::move(next)));
  }

 private:
  using List = std::vector<Subscriber>;
  struct Registry {
    std::mutex mutex;
    std::unordered_map<const c10::TensorImpl*, std::weak_ptr<GradientTap>> taps;
    std::size_t live_at_sweep = 0;
  };
  static Registry& registry() {
    static Registry* r = new Registry();  // never destroyed: hooks may run during static destruction
    return *r;
  }

  explicit GradientTap(WeakImpl tensor) : tensor_(std::move(tensor)) {}

  void fire(const at::Tensor& g) const {
    const auto subscribers = std::atomic_load(&subscribers_);  // held for the whole loop
    for (const auto& s : *subscribers) s.core->on_grad(s.module, s.param, g);
  }

  WeakImpl tensor_;
  std::mutex mutex_;
  std::shared_ptr<const List> subscribers_ = std::make_shared<const List>();
};

}  // namespace torchdbg::detail
