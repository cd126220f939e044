// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Health rules: what counts as dead, saturated, exploding, vanishing or diverging, and the
// base class of a rule of your own (health/rules.hpp).

#include "torchdbg/health/rules.hpp"
