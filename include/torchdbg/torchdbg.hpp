// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

/// Umbrella header: everything torchdbg offers except distributed coordination, which needs
/// c10d's Gloo headers and is included on its own: `#include <torchdbg/distributed.hpp>`.
/// This header needs only LibTorch, fmt and nlohmann_json.
#include "torchdbg/activation_visualizer.hpp"
#include "torchdbg/attach.hpp"
#include "torchdbg/diagnosis.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/exporters/csv.hpp"
#include "torchdbg/exporters/exporter.hpp"
#include "torchdbg/exporters/html.hpp"
#include "torchdbg/exporters/jsonl.hpp"
#include "torchdbg/exporters/summary_json.hpp"
#include "torchdbg/health.hpp"
#include "torchdbg/health_rules.hpp"
#include "torchdbg/hook_condition.hpp"
#include "torchdbg/hook_config.hpp"
#include "torchdbg/hook_context.hpp"
#include "torchdbg/hook_manager.hpp"
#include "torchdbg/hooked.hpp"
#include "torchdbg/paths.hpp"
#include "torchdbg/report.hpp"
#include "torchdbg/snapshot.hpp"
#include "torchdbg/tensor_inspector.hpp"
#include "torchdbg/tensor_stats.hpp"
#include "torchdbg/terminal.hpp"
#include "torchdbg/version.hpp"
