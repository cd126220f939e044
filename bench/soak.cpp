// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// Soak: a small model trained for many monitored steps (every child attached, statistics of
// every output, activation and gradient, alerts, visualizer records) with RSS printed at
// intervals. After the warm-up fills the configured rings, RSS must stay flat.
//
//   torchdbg_soak [--steps 100000] [--every 10000] [--max-growth-mib M]
// With --max-growth-mib, exits 1 when RSS grew more than M MiB after the warm-up (ctest runs
// a short soak this way).
#include <torch/torch.h>
#include <torchdbg/torchdbg.hpp>

#include "bench_util.hpp"

#include <fmt/format.h>

#include <cstring>
#include <fstream>
#include <string>

int main(int argc, char** argv) {
  int64_t steps = 100000, every = 10000;
  double max_growth = -1.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--steps")) steps = std::stoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--every")) every = std::stoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--max-growth-mib")) max_growth = std::stod(argv[i + 1]);
  }
  torch::set_num_threads(1);
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                                     torch::nn::Tanh(), torch::nn::Linear(64, 10));
  torch::optim::SGD opt(model->parameters(), 0.01);
  torchdbg::HookManager hooks(torchdbg::HookManagerOptions().alert_capacity(100).inspector(
      torchdbg::InspectorOptions().history_capacity(50).sample_rate(0.01).extreme_magnitude(0.5)));
  hooks.create_tensor_inspection_hook({});
  hooks.create_gradient_tracking_hook({});
  hooks.create_alert_hook(torchdbg::HookCondition::loss_above(0.0), "loss seen");  // an alert every step
  auto session = torchdbg::attach(*model, hooks, torchdbg::AttachOptions().auto_step(true));
  auto x = torch::randn({32, 32});
  auto y = torch::randint(0, 10, {32});
  const int64_t warm = std::min<int64_t>(steps, 1000);
  long base = 0;
  double growth = 0.0;
  for (int64_t s = 1; s <= steps; ++s) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    hooks.set_loss(loss.item<double>());
    loss.backward();
    opt.step();
    if (s == warm) base = torchdbg_bench::rss_kib();
    if (s % every == 0 || s == steps) {
      const long now = torchdbg_bench::rss_kib();
      growth = static_cast<double>(now - base) / 1024.0;
      fmt::print("step {:>7}: rss {:>8} KiB ({:+.2f} MiB since step {}), alerts {}\n", s, now,
                 static_cast<double>(now - base) / 1024.0, warm, hooks.alert_count());
      std::fflush(stdout);
    }
  }
  if (max_growth >= 0.0 && growth > max_growth) {
    fmt::print("FAILED: RSS grew {:.2f} MiB after the warm-up (limit {:.2f})\n", growth, max_growth);
    return 1;
  }
  return 0;
}
