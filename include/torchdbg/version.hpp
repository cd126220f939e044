// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#define TORCHDBG_VERSION_MAJOR 0
#define TORCHDBG_VERSION_MINOR 2
#define TORCHDBG_VERSION_PATCH 0

namespace torchdbg {
/// The library version as "MAJOR.MINOR.PATCH".
constexpr const char* version_string() noexcept { return "0.2.0"; }
}  // namespace torchdbg
