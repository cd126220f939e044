// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <stdexcept>
#include <string>

namespace torchdbg {

/// The one exception type torchdbg throws for bad input at configuration calls
/// (invalid regex, unknown hook id, zero interval, ...). Its message names the bad value.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

/// Throws torchdbg::Error "torchdbg: <what> must be >= <min>, got <value>" (option checks).
template <typename T>
inline void require_at_least(T value, T min, const char* what) {
  if (!(value >= min))
    throw Error(std::string("torchdbg: ") + what + " must be >= " + std::to_string(min) + ", got " +
                std::to_string(value));
}

}  // namespace detail

}  // namespace torchdbg
