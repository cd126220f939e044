// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// The check a test makes of the statistics attach delivered with a module output.
#pragma once

#include <string>

#include "helpers.hpp"

namespace torchdbg_test {

/// The statistics `st` (a torchdbg::TensorStats) delivered with `want` against `want`'s
/// double reference: dtype, device, counts and extrema exactly; mean, std and L2 to the
/// tolerance of float32 kernels.
template <typename Stats>
void check_delivered_stats(const Stats& st, const torch::Tensor& want) {
  const auto ref = reference(want);
  CHECK(st.dtype == std::string(c10::toString(want.scalar_type())));
  CHECK(st.device == want.device().str());
  CHECK(st.numel == ref.numel);
  CHECK(st.finite_count == ref.finite);
  CHECK_SCALED(st.mean, ref.mean, ref.scale(), 1e-5);
  CHECK_CLOSE(st.std, ref.std, 1e-4);
  CHECK(st.min == ref.min);
  CHECK(st.max == ref.max);
  CHECK_CLOSE(st.l2_norm, ref.l2, 1e-5);
}

}  // namespace torchdbg_test
