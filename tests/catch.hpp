// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once
// Catch2 v2 (Debian) and v3 behind one include.
#if defined(TORCHDBG_CATCH2_V3)
#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
using Catch::Approx;
namespace Catch {
// v2's spelling, used throughout the tests.
inline Matchers::StringContainsMatcher Contains(const std::string& s) {
  return Matchers::ContainsSubstring(s);
}
}  // namespace Catch
#else
#include <catch2/catch.hpp>
#endif
