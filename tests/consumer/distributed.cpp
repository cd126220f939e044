// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// A project that opts into distributed coordination: torchdbg/distributed.hpp on its own
// (it brings the manager and the health monitor), one rank over a FileStore.
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torchdbg/distributed.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "consumer_distributed.store";
  std::remove(path.c_str());
  auto store = c10::make_intrusive<c10d::FileStore>(path, 1);
  auto group = torchdbg::make_gloo_group(store, 0, 1);
  torchdbg::HookManager hooks;
  torchdbg::DistributedMonitor dist(group, store, hooks, nullptr,
                                    torchdbg::DistributedOptions().report_interval(2));
  const auto x = at::arange(10, at::kFloat).reshape({2, 5});  // mean 4.5, std sqrt(8.25)
  for (int64_t step = 0; step < 4; ++step) {
    hooks.set_step(step);
    (void)hooks.execute_hooks("fc1", x, true);
    const auto b = dist.step_boundary(step);
    if (b.reported != (step % 2 == 0) || b.paused) {
      std::cerr << "consumer: unexpected boundary at step " << step << "\n";
      return 1;
    }
  }
  const auto fc1 = dist.global_layer("fc1");
  if (!fc1 || fc1->global.finite != 10 || fc1->global.mean != 4.5 ||
      std::abs(fc1->global.std() - std::sqrt(8.25)) > 1e-12) {
    std::cerr << "consumer: wrong global statistics for fc1\n";
    return 1;
  }
  std::cout << "consumer ok: distributed, world " << dist.world_size() << "\n";
  return 0;
}
