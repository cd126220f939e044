// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Health states of layers and of the loss, and the semantic events their transitions make.
//
// A HealthMonitor turns what the observer delivers (forward outputs, activations, parameter
// gradients and the loss) into per-layer states:
// * activation: normal, saturated, dead, anomalous (near-constant output, or an output whose
//   scale jumps far above its input's: an exploding activation), non-finite;
// * gradient: healthy, vanishing, exploding, non-finite (absolute thresholds, a threshold
//   relative to the step's largest layer gradient, and an adaptive per-layer baseline);
// * loss: healthy, diverging (NaN/Inf), spike, plateau.
// The monitor keeps the bookkeeping (per-layer windows and baselines, forward and backward
// order, events, incidents, pauses); what counts as unhealthy is decided by its rules
// (health/rules.hpp): the built-in ones, configured by HealthOptions, and any user rules
// (`HealthOptions::rules`, `add_rule`), whose findings become states, events and incidents the
// same way. Each transition, and the first observation of a layer that starts unhealthy, is a
// SemanticEvent; each onset of a failure is an Incident, the raw material of diagnose()
// (diagnosis.hpp). Layers are ordered by forward execution order as observed.
//
// ```cpp
// torchdbg::HookManager hooks;
// torchdbg::HealthMonitor health(torchdbg::HealthOptions().on_failure(torchdbg::OnFailure::Pause));
// auto h = health.install(hooks);          // feeds on every delivery and on set_step/set_loss
// auto session = torchdbg::attach(*model, hooks);
// ```
//
// The pieces, in health/, along the data flow: options.hpp (HealthOptions, the states);
// rules.hpp (the signals a rule sees, the built-in rules); records.hpp (events, incidents,
// reports); monitor.hpp (BasicHealthMonitor, HealthInstallation). Internal: signals.hpp (what
// a layer looks like: layer.hpp, units.hpp; gradients.hpp for the backward pass),
// input_watch.hpp (the model's input), ledger.hpp (events, incidents, persistence, pauses;
// pauses.hpp calls back), and core.hpp, which hands the signals to the rules and their
// findings to the ledger.

#include "torchdbg/health/monitor.hpp"
#include "torchdbg/health/options.hpp"
#include "torchdbg/health/records.hpp"
#include "torchdbg/health/rules.hpp"
