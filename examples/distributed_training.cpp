// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// Data-parallel training over c10d (ProcessGroupGloo) with torchdbg on every rank: global
// per-layer statistics every 10 steps, and a NaN injected on one rank that pauses every rank
// at the same step, with a diagnosis that names the rank and the layer.
//
// Launch one process per rank (here 2 on this machine, rendezvous through a TCPStore):
//   distributed_training --rank 0 --world-size 2 --store tcp://127.0.0.1:29500 &
//   distributed_training --rank 1 --world-size 2 --store tcp://127.0.0.1:29500
// or through a shared file: --store file:///tmp/torchdbg-store (delete it before a new run).
// Other flags: --steps N (default 30), --nan-rank R --nan-step S (default 1 and 12; -1: none).
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdlib>
#include <string>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torchdbg/distributed.hpp>
#include <torchdbg/torchdbg.hpp>

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(32, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 64));
    fc3 = register_module("fc3", torch::nn::Linear(64, 10));
  }
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

struct Args {
  int rank = -1, world = -1;
  std::string store;
  int64_t steps = 30, nan_rank = 1, nan_step = 12;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rank")
      a.rank = std::stoi(v);
    else if (k == "--world-size")
      a.world = std::stoi(v);
    else if (k == "--store")
      a.store = v;
    else if (k == "--steps")
      a.steps = std::stoll(v);
    else if (k == "--nan-rank")
      a.nan_rank = std::stoll(v);
    else if (k == "--nan-step")
      a.nan_step = std::stoll(v);
    else
      throw torchdbg::Error("unknown flag " + k);
  }
  if (a.rank < 0 || a.world < 1 || a.rank >= a.world || a.store.empty())
    throw torchdbg::Error(
        "usage: distributed_training --rank R --world-size W --store tcp://HOST:PORT|file:///PATH");
  return a;
}

c10::intrusive_ptr<c10d::Store> make_store(const Args& a) {
  if (a.store.rfind("file://", 0) == 0)
    return c10::make_intrusive<c10d::FileStore>(a.store.substr(7), a.world);
  if (a.store.rfind("tcp://", 0) == 0) {
    const std::string hp = a.store.substr(6);
    const auto colon = hp.rfind(':');
    if (colon == std::string::npos)
      throw torchdbg::Error("--store tcp://HOST:PORT needs a port: " + a.store);
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(std::stoi(hp.substr(colon + 1)));
    o.isServer = a.rank == 0;
    o.numWorkers = static_cast<std::size_t>(a.world);
    o.timeout = std::chrono::seconds(60);
    return c10::make_intrusive<c10d::TCPStore>(hp.substr(0, colon), o);
  }
  throw torchdbg::Error("--store must start with tcp:// or file://, got " + a.store);
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  torch::set_num_threads(1);
  // [snippet group]
  auto store = make_store(a);  // a c10d::TCPStore or c10d::FileStore
  auto group = torchdbg::make_gloo_group(store, a.rank, a.world, std::chrono::seconds(30));
  // [/snippet]

  torch::manual_seed(0);  // the same initial weights on every rank
  auto model = std::make_shared<Net>();
  torch::optim::SGD opt(model->parameters(), 0.05);
  torch::manual_seed(1000 + static_cast<uint64_t>(a.rank));  // each rank its own data
  const auto proj = torch::randn({32, 10});

  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health(torchdbg::HealthOptions().on_failure(torchdbg::OnFailure::Pause));
  auto health_fed = health.install(hooks);
  auto session = torchdbg::attach(*model, hooks);
  // [snippet monitor]
  torchdbg::DistributedMonitor dist(
      group, store, hooks, &health,
      torchdbg::DistributedOptions().report_interval(10).timeout_ms(30000));
  // [/snippet]

  for (int64_t step = 0; step < a.steps; ++step) {
    if (a.rank == a.nan_rank && step == a.nan_step) {
      torch::NoGradGuard g;
      model->fc2->weight[3][5] = std::nan("");  // this rank's replica goes bad
    }
    hooks.set_step(step);
    auto x = torch::randn({64, 32});
    auto y = x.matmul(proj).argmax(1);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    hooks.set_loss(loss.item<double>());
    loss.backward();
    // Average gradients over the ranks through the same process group.
    std::vector<at::Tensor> parts;
    for (auto& p : model->parameters()) parts.push_back(p.grad().flatten());
    std::vector<at::Tensor> flat{torch::cat(parts)};
    group->allreduce(flat)->wait();
    int64_t off = 0;
    for (auto& p : model->parameters()) {
      p.mutable_grad().copy_(flat[0].slice(0, off, off + p.numel()).view_as(p) / a.world);
      off += p.numel();
    }
    // [snippet boundary]
    const auto b = dist.step_boundary(step);  // every rank, once per step
    if (b.reported && a.rank == 0) {
      for (const auto& g : dist.global_stats())
        if (g.name.find('/') == std::string::npos || g.name.find("/grad") != std::string::npos)
          fmt::print(
              "[rank 0] step {:>3} global {:<16} mean {:>9.4f} std {:>8.4f} min {:>8.3f} max "
              "{:>8.3f}\n",
              step, g.name, g.global.mean, g.global.std(), g.global.min, g.global.max);
    }
    if (b.paused) {
      fmt::print("[rank {}] step {}: PAUSED with every rank: {}\n", a.rank, step,
                 hooks.pause_info()->reason);
      if (a.rank == 0) {
        const auto d = dist.global_diagnosis();
        const auto* top = d.top();
        fmt::print("[rank 0] diagnosis: rank {} layer '{}' ({}): {}\n", top ? top->rank : -1,
                   top ? top->layer : "?", top ? torchdbg::to_string(top->kind) : "?", d.summary());
      }
      break;
    }
    // [/snippet]
    opt.step();
    if (a.rank == 0 && step % 10 == 0)
      fmt::print("[rank 0] step {:>3} loss {:.4f}\n", step, loss.item<double>());
  }
  fmt::print("[rank {}] done\n", a.rank);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "distributed_training: {}\n", e.what());
  return 1;
}
