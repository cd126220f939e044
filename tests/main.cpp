// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#if !defined(TORCHDBG_CATCH2_V3)
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
#endif

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <utility>

namespace {

/// The tests check torchdbg's figures against LibTorch's own results, so LibTorch must compute
/// them right. Debian trixie's LibTorch 2.6 with its oneDNN (3.7.2) does not on some CPUs
/// (AMD Zen 5 VMs): a convolution's input gradient and an LSTM's output under no_grad come
/// out wrong by tens of percent, and differ from run to run. Before any test runs, both are
/// compared with LibTorch's native kernels (oneDNN off); where they disagree the tests run
/// with oneDNN off, and say so.
struct OneDnnCheck {
  OneDnnCheck() {
    if (!at::globalContext().userEnabledMkldnn()) return;
    auto generator = at::detail::getDefaultCPUGenerator();
    const auto state = generator.get_state();  // the tests' random streams stay as they were
    double conv_gap = 0.0, lstm_gap = 0.0;
    for (int seed = 7; seed < 10; ++seed) {
      torch::manual_seed(seed);
      torch::nn::Conv2d c1(torch::nn::Conv2dOptions(3, 6, 3).padding(1)), c2(torch::nn::Conv2dOptions(6, 6, 3).padding(1));
      torch::nn::Linear head(150, 2);
      torch::nn::LSTM lstm(torch::nn::LSTMOptions(5, 5).batch_first(true));
      const auto x = torch::randn({12, 3, 5, 5}), seq = torch::randn({6, 1, 5});
      const auto conv_grads = [&] {  // the input gradient of the second convolution, the first's weight gradient
        c1->weight.mutable_grad() = torch::Tensor();
        const auto a = torch::relu(c1(x));
        const auto h = a.detach().requires_grad_(true);
        head(torch::relu(c2(h)).flatten(1)).square().mean().backward();
        a.backward(h.grad());
        return std::make_pair(h.grad(), c1->weight.grad().clone());
      };
      const auto lstm_no_grad = [&] {
        torch::NoGradGuard no_grad;
        return std::get<0>(lstm(seq));
      };
      const auto gap = [](const torch::Tensor& a, const torch::Tensor& b) {
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
      };
      const auto conv_on = conv_grads();
      const auto lstm_on = lstm_no_grad();
      at::globalContext().setUserEnabledMkldnn(false);
      const auto conv_off = conv_grads();
      conv_gap = std::max({conv_gap, gap(conv_on.first, conv_off.first), gap(conv_on.second, conv_off.second)});
      lstm_gap = std::max(lstm_gap, gap(lstm_on, lstm_no_grad()));
      at::globalContext().setUserEnabledMkldnn(true);
    }
    generator.set_state(state);
    if (conv_gap < 1e-4 && lstm_gap < 1e-4) return;
    at::globalContext().setUserEnabledMkldnn(false);
    std::fprintf(stderr,
                 "torchdbg tests: LibTorch's oneDNN kernels are wrong on this CPU (a convolution's "
                 "gradients off by %.3g, an LSTM's output under no_grad by %.3g, relative to the native "
                 "kernels): the tests run with oneDNN off\n",
                 conv_gap, lstm_gap);
  }
};
const OneDnnCheck kOneDnnCheck;

}  // namespace
