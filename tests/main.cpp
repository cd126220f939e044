// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#if !defined(TORCHDBG_CATCH2_V3)
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
#endif
