// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

/// Umbrella header: everything torchdbg offers.
#include "torchdbg/activation_visualizer.hpp"
#include "torchdbg/attach.hpp"
#include "torchdbg/diagnosis.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/health.hpp"
#include "torchdbg/hook_condition.hpp"
#include "torchdbg/hook_config.hpp"
#include "torchdbg/hook_context.hpp"
#include "torchdbg/hook_manager.hpp"
#include "torchdbg/hooked.hpp"
#include "torchdbg/paths.hpp"
#include "torchdbg/snapshot.hpp"
#include "torchdbg/tensor_inspector.hpp"
#include "torchdbg/tensor_stats.hpp"
#include "torchdbg/version.hpp"
