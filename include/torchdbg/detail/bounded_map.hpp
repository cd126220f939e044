// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <deque>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace torchdbg::detail {

/// Name -> value map holding at most `max_size` names; inserting past it evicts the name
/// inserted first. Iteration order is insertion order. Not thread-safe; owners lock.
template <typename V>
class BoundedMap {
 public:
  explicit BoundedMap(std::size_t max_size) : max_size_(max_size) {}

  /// The value for `name`, created with `make()` (evicting the oldest name if full).
  template <typename Make>
  V& get_or_create(std::string_view name, Make&& make) {
    auto it = map_.find(std::string(name));
    if (it != map_.end()) return it->second;
    if (map_.size() >= max_size_ && !order_.empty()) {
      map_.erase(order_.front());
      order_.pop_front();
    }
    order_.emplace_back(name);
    return map_.emplace(std::string(name), make()).first->second;
  }

  [[nodiscard]] const V* find(std::string_view name) const {
    auto it = map_.find(std::string(name));
    return it == map_.end() ? nullptr : &it->second;
  }

  /// Names in insertion order.
  [[nodiscard]] std::vector<std::string> names() const { return {order_.begin(), order_.end()}; }
  [[nodiscard]] std::size_t size() const noexcept { return map_.size(); }

  /// Calls f(name, value) in insertion order.
  template <typename F>
  void for_each(F&& f) const {
    for (const auto& name : order_) f(name, map_.at(name));
  }

  void clear() {
    map_.clear();
    order_.clear();
  }

 private:
  std::size_t max_size_;
  std::unordered_map<std::string, V> map_;
  std::deque<std::string> order_;
};

}  // namespace torchdbg::detail
