// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The hook manager's registry (hook_manager.hpp): its hooks in execution order, the callbacks
// that custom_callback actions call, and the prefetches attach runs on queued deliveries.

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/detail/mutex.hpp"
#include "torchdbg/detail/pattern.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/hook_config.hpp"
#include "torchdbg/hook_context.hpp"
#include "torchdbg/hook_manager/statistics.hpp"

namespace torchdbg {
namespace detail {

/// One registered hook: its configuration, compiled patterns, execution budget and counters.
/// Thread safety: the atomics and `matches` may be used from any thread; the rest is fixed
/// once the entry is registered.
template <typename Mutex>
struct HookEntry {
  HookId id;
  HookConfig config;
  int64_t position = 0;  // among equal priorities: prepended hooks negative, appended positive
  std::vector<Pattern> patterns;
  uint64_t limit = std::numeric_limits<uint64_t>::max();
  std::atomic<bool> enabled{true};
  std::atomic<uint64_t> claimed{0};
  std::atomic<int64_t> last_alert_step{std::numeric_limits<int64_t>::min()};
  HookCounters counters;
  mutable Mutex cache_mutex;
  std::unordered_map<std::string, bool> match_cache;
  std::size_t cache_capacity = 4096;

  /// Whether the hook's patterns match `layer` (no patterns: every layer); cached per name.
  bool matches(std::string_view layer) {
    if (patterns.empty()) return true;
    std::lock_guard<Mutex> lock(cache_mutex);
    const std::string key(layer);
    auto it = match_cache.find(key);
    if (it != match_cache.end()) return it->second;
    bool hit = false;
    for (const auto& re : patterns) {
      if (re.search(key)) {
        hit = true;
        break;
      }
    }
    if (match_cache.size() >= cache_capacity) match_cache.clear();
    match_cache.emplace(key, hit);
    return hit;
  }

  /// Takes one of the `limit` executions; false when none is left.
  bool claim() {
    uint64_t cur = claimed.load();
    do {
      if (cur >= limit) return false;
    } while (!claimed.compare_exchange_weak(cur, cur + 1));
    return true;
  }

  /// Whether it is enabled and has executions left.
  [[nodiscard]] bool live() const { return enabled.load() && claimed.load() < limit; }

  /// The configuration with the current enabled flag.
  [[nodiscard]] HookConfig current_config() const {
    HookConfig c = config;
    c.enabled(enabled.load());
    return c;
  }
};

/// Hooks, callbacks and prefetches of one manager. Readers take a snapshot (a shared_ptr to
/// an immutable list) and iterate it without the lock; writers replace the list. Thread
/// safety: every member may be used from any number of threads at once (with Mutex =
/// std::mutex).
template <typename Mutex>
class HookRegistry {
 public:
  using Entry = HookEntry<Mutex>;
  using List = std::vector<std::shared_ptr<Entry>>;
  using Callback = std::function<void(const HookContext&)>;
  using Prefetch = std::function<at::Tensor(std::string_view layer, const at::Tensor& tensor,
                                            bool is_forward, const Metadata& metadata)>;

  /// An entry for `config`; throws torchdbg::Error naming an invalid layer pattern or a
  /// max_executions of 0.
  static std::shared_ptr<Entry> make_entry(HookConfig config, std::size_t match_cache);

  /// Gives `e` a fresh id and its place in execution order; returns the id.
  HookId add(const std::shared_ptr<Entry>& e);
  /// The removed hook's configuration, or nullopt for an unknown id.
  std::optional<HookConfig> remove(const HookId& id);
  void clear();
  /// False for an unknown id.
  bool set_enabled(const HookId& id, bool enabled);
  [[nodiscard]] std::optional<HookConfig> get(const HookId& id) const;
  /// The hooks in execution order (priority, then position).
  [[nodiscard]] std::shared_ptr<const List> snapshot() const;

  void set_callback(std::string name, Callback callback, CallbackStats reads);
  [[nodiscard]] bool has_callback(std::string_view name) const;
  bool remove_callback(std::string_view name);
  /// The callback registered under `name`, or null.
  [[nodiscard]] std::shared_ptr<const Callback> callback(const std::string& name) const;
  /// Whether `name` was registered with CallbackStats::Moments.
  [[nodiscard]] bool reads_moments_only(const std::string& name) const;

  void add_prefetch(std::string key, Prefetch fn);
  bool remove_prefetch(std::string_view key);
  [[nodiscard]] std::vector<std::pair<std::string, at::Tensor>> run_prefetches(
      std::string_view layer, const at::Tensor& tensor, bool is_forward,
      const Metadata& metadata) const;

 private:
  using PrefetchList = std::vector<std::pair<std::string, Prefetch>>;
  Entry* find_locked(const HookId& id) const;

  mutable Mutex mutex_;
  std::shared_ptr<const List> hooks_ = std::make_shared<const List>();  // in execution order
  int64_t front_position_ = 0, back_position_ = 0;
  std::shared_ptr<const PrefetchList> prefetches_ = std::make_shared<const PrefetchList>();
  std::unordered_map<std::string, std::shared_ptr<const Callback>> callbacks_;
  std::unordered_set<std::string> moment_callbacks_;  // registered with CallbackStats::Moments
};

#if TORCHDBG_DEFINITIONS

template <typename Mutex>
auto HookRegistry<Mutex>::make_entry(HookConfig config, std::size_t match_cache)
    -> std::shared_ptr<Entry> {
  auto e = std::make_shared<Entry>();
  for (const auto& p : config.layer_patterns()) {
    e->patterns.push_back(compile_pattern(p, "layer pattern in hook '" + config.name() + "'"));
  }
  if (config.max_executions() && *config.max_executions() == 0) {
    throw Error("torchdbg: hook '" + config.name() + "' has max_executions 0 (it could never run)");
  }
  e->limit = config.max_executions().value_or(std::numeric_limits<uint64_t>::max());
  if (config.trigger().kind() == HookTrigger::Kind::Once) e->limit = std::min<uint64_t>(e->limit, 1);
  e->enabled.store(config.enabled());
  e->cache_capacity = match_cache;
  e->config = std::move(config);
  return e;
}

template <typename Mutex>
HookId HookRegistry<Mutex>::add(const std::shared_ptr<Entry>& e) {
  std::lock_guard<Mutex> lock(mutex_);
  do {
    e->id = HookId::generate();
  } while (find_locked(e->id) != nullptr);
  e->position = e->config.prepend() ? --front_position_ : ++back_position_;
  auto next = std::make_shared<List>(*hooks_);
  const auto runs_before = [](const std::shared_ptr<Entry>& a, const std::shared_ptr<Entry>& b) {
    if (a->config.priority() != b->config.priority()) return a->config.priority() > b->config.priority();
    return a->position < b->position;
  };
  next->insert(std::upper_bound(next->begin(), next->end(), e, runs_before), e);
  hooks_ = std::move(next);
  return e->id;
}

template <typename Mutex>
std::optional<HookConfig> HookRegistry<Mutex>::remove(const HookId& id) {
  std::optional<HookConfig> removed;
  std::lock_guard<Mutex> lock(mutex_);
  auto next = std::make_shared<List>();
  for (const auto& e : *hooks_) {
    if (e->id == id) {
      removed = e->current_config();
    } else {
      next->push_back(e);
    }
  }
  if (removed) hooks_ = std::move(next);
  return removed;
}

template <typename Mutex>
void HookRegistry<Mutex>::clear() {
  std::lock_guard<Mutex> lock(mutex_);
  hooks_ = std::make_shared<const List>();
}

template <typename Mutex>
bool HookRegistry<Mutex>::set_enabled(const HookId& id, bool enabled) {
  std::lock_guard<Mutex> lock(mutex_);
  Entry* e = find_locked(id);
  if (e == nullptr) return false;
  e->enabled.store(enabled);
  return true;
}

template <typename Mutex>
std::optional<HookConfig> HookRegistry<Mutex>::get(const HookId& id) const {
  std::lock_guard<Mutex> lock(mutex_);
  const Entry* e = find_locked(id);
  if (e == nullptr) return std::nullopt;
  return e->current_config();
}

template <typename Mutex>
auto HookRegistry<Mutex>::snapshot() const -> std::shared_ptr<const List> {
  std::lock_guard<Mutex> lock(mutex_);
  return hooks_;
}

template <typename Mutex>
void HookRegistry<Mutex>::set_callback(std::string name, Callback callback, CallbackStats reads) {
  std::lock_guard<Mutex> lock(mutex_);
  if (reads == CallbackStats::Moments) {
    moment_callbacks_.insert(name);
  } else {
    moment_callbacks_.erase(name);
  }
  callbacks_[std::move(name)] = std::make_shared<const Callback>(std::move(callback));
}

template <typename Mutex>
bool HookRegistry<Mutex>::has_callback(std::string_view name) const {
  std::lock_guard<Mutex> lock(mutex_);
  return callbacks_.count(std::string(name)) > 0;
}

template <typename Mutex>
bool HookRegistry<Mutex>::remove_callback(std::string_view name) {
  std::lock_guard<Mutex> lock(mutex_);
  moment_callbacks_.erase(std::string(name));
  return callbacks_.erase(std::string(name)) > 0;
}

template <typename Mutex>
auto HookRegistry<Mutex>::callback(const std::string& name) const -> std::shared_ptr<const Callback> {
  std::lock_guard<Mutex> lock(mutex_);
  auto it = callbacks_.find(name);
  return it == callbacks_.end() ? nullptr : it->second;
}

template <typename Mutex>
bool HookRegistry<Mutex>::reads_moments_only(const std::string& name) const {
  std::lock_guard<Mutex> lock(mutex_);
  return moment_callbacks_.count(name) > 0;
}

template <typename Mutex>
void HookRegistry<Mutex>::add_prefetch(std::string key, Prefetch fn) {
  if (key.empty()) throw Error("torchdbg: add_prefetch needs a non-empty key");
  if (!fn) throw Error("torchdbg: prefetch '" + key + "' is empty");
  std::lock_guard<Mutex> lock(mutex_);
  auto next = std::make_shared<PrefetchList>();
  for (const auto& p : *prefetches_)
    if (p.first != key) next->push_back(p);
  next->emplace_back(std::move(key), std::move(fn));
  prefetches_ = std::move(next);
}

template <typename Mutex>
bool HookRegistry<Mutex>::remove_prefetch(std::string_view key) {
  std::lock_guard<Mutex> lock(mutex_);
  auto next = std::make_shared<PrefetchList>();
  for (const auto& p : *prefetches_)
    if (p.first != key) next->push_back(p);
  const bool removed = next->size() != prefetches_->size();
  prefetches_ = std::move(next);
  return removed;
}

template <typename Mutex>
auto HookRegistry<Mutex>::run_prefetches(std::string_view layer, const at::Tensor& tensor,
                                         bool is_forward, const Metadata& metadata) const
    -> std::vector<std::pair<std::string, at::Tensor>> {
  std::shared_ptr<const PrefetchList> list;
  {
    std::lock_guard<Mutex> lock(mutex_);
    list = prefetches_;
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [key, fn] : *list) {
    try {
      at::Tensor v = fn(layer, tensor, is_forward, metadata);
      if (v.defined()) out.emplace_back(key, v.reshape({-1}));
    } catch (...) {
    }
  }
  return out;
}

template <typename Mutex>
auto HookRegistry<Mutex>::find_locked(const HookId& id) const -> Entry* {
  for (const auto& e : *hooks_)
    if (e->id == id) return e.get();
  return nullptr;
}

#endif  // TORCHDBG_DEFINITIONS

TORCHDBG_EXTERN_TEMPLATE(class HookRegistry<std::mutex>)
TORCHDBG_EXTERN_TEMPLATE(class HookRegistry<NullMutex>)

}  // namespace detail
}  // namespace torchdbg
