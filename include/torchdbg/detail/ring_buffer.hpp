// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "torchdbg/error.hpp"

namespace torchdbg::detail {

/// Fixed-capacity ring: push overwrites the oldest element once full. Not thread-safe;
/// owners lock around it.
template <typename T>
class RingBuffer {
 public:
  explicit RingBuffer(std::size_t capacity = 1) : capacity_(capacity) {
    if (capacity == 0) throw Error("ring buffer capacity must be at least 1, got 0");
    items_.reserve(capacity < 1024 ? capacity : 1024);
  }

  void push(T&& value) {
    if (items_.size() < capacity_) {
      items_.push_back(std::move(value));
    } else {
      items_[head_] = std::move(value);
      head_ = (head_ + 1) % capacity_;
    }
    ++total_pushed_;
  }
  /// Copy-assigns into the oldest slot once full, so an element's buffers (a vector's
  /// capacity) are reused instead of freed and allocated again every push.
  void push(const T& value) {
    if (items_.size() < capacity_) {
      items_.push_back(value);
    } else {
      items_[head_] = value;
      head_ = (head_ + 1) % capacity_;
    }
    ++total_pushed_;
  }

  [[nodiscard]] std::size_t size() const noexcept { return items_.size(); }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] bool empty() const noexcept { return items_.empty(); }
  /// Every push ever made, including those that were overwritten.
  [[nodiscard]] std::size_t total_pushed() const noexcept { return total_pushed_; }

  /// Element i in age order: 0 is the oldest still held.
  [[nodiscard]] const T& at(std::size_t i) const { return items_[(head_ + i) % items_.size()]; }
  [[nodiscard]] const T& back() const { return at(items_.size() - 1); }

  /// A copy of the contents, oldest first.
  [[nodiscard]] std::vector<T> to_vector() const {
    std::vector<T> out;
    out.reserve(items_.size());
    for (std::size_t i = 0; i < items_.size(); ++i) out.push_back(at(i));
    return out;
  }

  void clear() noexcept {
    items_.clear();
    head_ = 0;
  }

 private:
  std::size_t capacity_;
  std::size_t head_ = 0;
  std::size_t total_pushed_ = 0;
  std::vector<T> items_;
};

}  // namespace torchdbg::detail
