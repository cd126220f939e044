// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

namespace torchdbg::detail {

/// A mutex that does nothing, for the single-thread (`_st`) variants of torchdbg classes.
struct NullMutex {
  void lock() noexcept {}
  void unlock() noexcept {}
  bool try_lock() noexcept { return true; }
};

}  // namespace torchdbg::detail
