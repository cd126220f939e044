// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

/// The quick start's API and no more: HookManager, attach, HealthMonitor and diagnose
/// (no exporters, reports or exact hooks: include those headers where they are used).
/// With the compiled library (`torchdbg::compiled`, TORCHDBG_COMPILED_LIB) this is the
/// lightest way to add torchdbg to a file: see docs/performance.md, "Compile time".
///
/// ```cpp
/// #include <torchdbg/lite.hpp>
/// torchdbg::HookManager hooks;
/// torchdbg::HealthMonitor health;
/// auto fed = health.install(hooks);
/// auto session = torchdbg::attach(*model, hooks);
/// ```
#include "torchdbg/attach.hpp"
#include "torchdbg/diagnosis.hpp"
#include "torchdbg/health.hpp"
#include "torchdbg/hook_manager.hpp"
