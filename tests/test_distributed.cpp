// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
// Real processes on loopback: this binary launches copies of itself (fork + exec) that run
// the hidden "distributed worker" case with their rank in the environment, rendezvous
// through a c10d FileStore and train over ProcessGroupGloo.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torchdbg/attach.hpp>
#include <torchdbg/distributed.hpp>

#include "helpers.hpp"

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc0 = register_module("fc0", torch::nn::Linear(8, 16));
    fc1 = register_module("fc1", torch::nn::Linear(16, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(torch::relu(fc0(x))))); }
  torch::nn::Linear fc0{nullptr}, fc1{nullptr}, fc2{nullptr};
};

torch::Tensor batch_of(int rank) {
  torch::manual_seed(100 + static_cast<uint64_t>(rank));
  return torch::randn({16 + 4 * rank, 8});  // ranks hold different amounts of data
}

struct Worker {
  int status = -1;
  std::string output;
};

/// Runs `world` processes of this binary on `scenario`; waits at most `deadline_s`.
std::vector<Worker> launch(int world, const std::string& scenario, int deadline_s = 120) {
  const std::string dir = torchdbg_test::tmp_dir("dist_" + scenario + "_" + std::to_string(world));
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const std::string out = dir + "/rank" + std::to_string(r) + ".txt";
    const pid_t pid = fork();
    if (pid == 0) {
      setenv("TORCHDBG_DIST_RANK", std::to_string(r).c_str(), 1);
      setenv("TORCHDBG_DIST_WORLD", std::to_string(world).c_str(), 1);
      setenv("TORCHDBG_DIST_STORE", (dir + "/store").c_str(), 1);
      setenv("TORCHDBG_DIST_SCENARIO", scenario.c_str(), 1);
      const int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      execl("/proc/self/exe", "torchdbg_tests", "distributed worker", static_cast<char*>(nullptr));
      _exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<Worker> res(static_cast<std::size_t>(world));
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t left = pids.size();
  while (left > 0) {
    for (std::size_t r = 0; r < pids.size(); ++r) {
      if (pids[r] == 0) continue;
      int st = 0;
      if (waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        res[r].status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        pids[r] = 0;
        --left;
      }
    }
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(deadline_s)) {
      for (auto p : pids)
        if (p != 0) kill(p, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < world; ++r) {
    std::ifstream in(dir + "/rank" + std::to_string(r) + ".txt");
    std::stringstream ss;
    ss << in.rdbuf();
    res[static_cast<std::size_t>(r)].output = ss.str();
  }
  return res;
}

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : -1;
}

void train_scenario(int rank, int world, const std::string& store_path) {
  torch::set_num_threads(1);
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, world);
  auto group = torchdbg::make_gloo_group(store, rank, world, std::chrono::seconds(30));
  torch::manual_seed(0);  // identical initial weights on every rank
  auto net = std::make_shared<Net>();
  torch::optim::SGD opt(net->parameters(), 0.05);
  const auto x = batch_of(rank);
  torch::manual_seed(7 + static_cast<uint64_t>(rank));
  const auto y = torch::randint(0, 4, {x.size(0)});
  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health(torchdbg::HealthOptions().on_failure(torchdbg::OnFailure::Pause));
  auto fed = health.install(hooks);
  auto session = torchdbg::attach(*net, hooks);
  torchdbg::DistributedMonitor dist(
      group, store, hooks, &health,
      torchdbg::DistributedOptions().report_interval(5).timeout_ms(30000));
  REQUIRE(dist.rank() == rank);
  REQUIRE(dist.world_size() == world);
  constexpr int64_t kNanStep = 7;
  int64_t paused_at = -1;
  for (int64_t step = 0; step < 15; ++step) {
    if (rank == 1 && step == kNanStep) {
      torch::NoGradGuard g;
      net->fc1->weight[0][0] = std::nan("");  // this rank's copy of fc1 goes bad
    }
    hooks.set_step(step);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    hooks.set_loss(loss.item<double>());
    loss.backward();
    // Data parallel: average the gradients through the same process group.
    std::vector<at::Tensor> grads;
    for (auto& p : net->parameters()) grads.push_back(p.grad().flatten());
    std::vector<at::Tensor> flat{torch::cat(grads)};
    group->allreduce(flat)->wait();
    int64_t off = 0;
    for (auto& p : net->parameters()) {
      const int64_t n = p.numel();
      p.mutable_grad().copy_(flat[0].slice(0, off, off + n).view_as(p) / world);
      off += n;
    }
    const auto b = dist.step_boundary(step);
    if (step == 0) {
      // Global statistics of fc0's output against the same statistics of the concatenated data.
      REQUIRE(b.reported);
      std::vector<torch::Tensor> all;
      {
        torch::NoGradGuard g;
        for (int r = 0; r < world; ++r) all.push_back(net->fc0(batch_of(r)));
      }
      const auto cat = torch::cat(all).to(torch::kDouble);
      const auto got = dist.global_layer("fc0");
      REQUIRE(got.has_value());
      CHECK(got->global.finite == cat.numel());
      CHECK_CLOSE(got->global.mean, cat.mean().item<double>(), 1e-6);
      CHECK_CLOSE(got->global.std(), cat.std(/*unbiased=*/false).item<double>(), 1e-6);
      CHECK_CLOSE(got->global.min, cat.min().item<double>(), 1e-6);
      CHECK_CLOSE(got->global.max, cat.max().item<double>(), 1e-6);
      REQUIRE(got->per_rank.size() == static_cast<std::size_t>(world));
      for (int r = 0; r < world; ++r) {
        REQUIRE(got->per_rank[static_cast<std::size_t>(r)].has_value());
        CHECK(got->per_rank[static_cast<std::size_t>(r)]->finite ==
              all[static_cast<std::size_t>(r)].numel());
      }
      // Gradients are reported per parameter, globally as well.
      CHECK(dist.global_layer("fc1.weight/grad").has_value());
    }
    if (b.paused) {
      paused_at = step;
      CHECK(b.newly_paused);
      CHECK(b.pausers == std::vector<int>{1});
      REQUIRE(b.reasons.size() == 1);
      CHECK(b.reasons[0].find("non_finite_output") != std::string::npos);
      break;
    }
    opt.step();
  }
  CHECK(paused_at == kNanStep);  // every rank, the same step
  CHECK(hooks.is_paused());
  // The rank that raised it keeps its own reason; the others learn whose it was and why.
  CHECK(hooks.pause_info()->reason.find(rank == 1 ? "non_finite_output"
                                                  : "rank 1: torchdbg health: non_finite_output") !=
        std::string::npos);
  const auto d = dist.global_diagnosis();
  INFO(d.summary());
  REQUIRE(d.top() != nullptr);
  CHECK(d.top()->kind == torchdbg::FailureKind::NonFiniteOutput);
  CHECK(d.top()->layer == "fc1");
  CHECK(d.top()->rank == 1);
  CHECK(d.top()->step == kNanStep);
  const auto ev = dist.events();
  REQUIRE_FALSE(ev.empty());
  CHECK(ev.back().rank == 1);
  // Resume is coordinated the same way: rank 0 asks, every rank resumes at one boundary.
  bool resumed = false;
  for (int i = 0; i < 3 && !resumed; ++i) {
    if (rank == 0) dist.request_resume();
    resumed = dist.step_boundary(paused_at).resumed;
  }
  CHECK(resumed);
  CHECK_FALSE(hooks.is_paused());
  CHECK_FALSE(dist.paused());
}

void failure_scenario(int rank, int world, const std::string& store_path, bool hang) {
  torch::set_num_threads(1);
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, world);
  auto group = torchdbg::make_gloo_group(store, rank, world, std::chrono::seconds(3));
  torchdbg::HookManager hooks;
  torchdbg::DistributedMonitor dist(group, store, hooks, nullptr,
                                    torchdbg::DistributedOptions().timeout_ms(3000));
  (void)dist.step_boundary(0);  // everyone alive
  if (rank == 1) {
    if (hang) std::this_thread::sleep_for(std::chrono::seconds(12));
    std::_Exit(0);  // dies without a word (or after hanging past the others' timeout)
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::string message;
  try {
    (void)dist.step_boundary(1);
  } catch (const torchdbg::Error& e) {
    message = e.what();
  }
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const bool ok = message.find("a rank died or hangs") != std::string::npos &&
                  message.find("step 1") != std::string::npos && waited < 10.0;
  std::printf("rank 0 %s after %.2f s: %s\n", ok ? "failed clearly" : "did NOT fail as expected",
              waited, message.c_str());
  std::fflush(stdout);
  std::_Exit(ok ? 0 : 1);  // the group's peer is gone: skip destructors that would talk to it
}

/// One layer's moments against torchdbg_test::wide_reference of `v`.
void check_layer(const torchdbg::LayerMoments& m, const std::vector<double>& v) {
  const auto r = torchdbg_test::wide_reference(v);
  INFO("finite " << m.finite << " mean " << m.mean << " std " << m.std() << " min " << m.min
                 << " max " << m.max);
  CHECK(m.finite == r.finite);
  CHECK(m.nan == r.nan);
  CHECK(m.inf == r.pos_inf + r.neg_inf);
  if (r.finite == 0) {
    CHECK(std::isnan(m.std()));
    return;
  }
  // to the data's scale: a mean that cancels to about 0 included
  CHECK(std::fabs(m.mean - r.mean) <= 1e-12L * r.abs_max);
  CHECK(m.min == r.min);
  CHECK(m.max == r.max);
  CHECK(std::isfinite(m.std()));
  if (torchdbg_test::kWideLongDouble) CHECK(torchdbg_test::wide_near(m.std(), r.std, 1e-9));
}

/// Every rank generates the same cases, delivers its share in up to 3 chunks (each merged
/// into the rank's moments) and checks the exchanged global and per-rank moments.
void magnitudes_scenario(int rank, int world, const std::string& store_path) {
  torch::set_num_threads(1);
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, world);
  auto group = torchdbg::make_gloo_group(store, rank, world, std::chrono::seconds(30));
  torchdbg::HookManager hooks(
      torchdbg::HookManagerOptions().inspector(torchdbg::InspectorOptions().sample_rate(0.0)));
  torchdbg::DistributedMonitor dist(group, store, hooks, nullptr,
                                    torchdbg::DistributedOptions().report_interval(1));
  constexpr int kChunks = 3;
  for (int64_t step = 0; step < 80; ++step) {
    std::mt19937_64 gen(9000 + static_cast<uint64_t>(step));
    const auto c = torchdbg_test::wide_case(gen, step % 4 == 0 ? 3000 : 40, kChunks * world);
    INFO("step " << step << ": rank r delivers pieces " << kChunks << "r to " << kChunks << "r+"
                 << kChunks - 1 << " of " << c.code() << " (wide_case with seed " << 9000 + step
                 << ")");
    hooks.set_step(step);
    for (int k = 0; k < kChunks; ++k) {
      const auto piece = c.piece(static_cast<std::size_t>(kChunks * rank + k));
      if (!piece.empty())
        (void)hooks.execute_hooks("layer", torch::tensor(piece, torch::kDouble), true);
    }
    REQUIRE(dist.step_boundary(step).reported);
    const auto got = dist.global_layer("layer");
    REQUIRE(got.has_value());
    check_layer(got->global, c.values);
    REQUIRE(got->per_rank.size() == static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) {
      const auto& share = got->per_rank[static_cast<std::size_t>(r)];
      const std::size_t lo = c.cuts[static_cast<std::size_t>(kChunks * r)],
                        hi = c.cuts[static_cast<std::size_t>(kChunks * r + kChunks)];
      INFO("rank " << r << "'s share");
      CHECK(share.has_value() == (hi > lo));
      if (share) {
        check_layer(*share,
                    std::vector<double>(c.values.begin() + static_cast<std::ptrdiff_t>(lo),
                                        c.values.begin() + static_cast<std::ptrdiff_t>(hi)));
      }
    }
  }
}

}  // namespace

TEST_CASE("distributed worker", "[.distributed_worker]") {
  const int rank = env_int("TORCHDBG_DIST_RANK"), world = env_int("TORCHDBG_DIST_WORLD");
  if (rank < 0 || world < 1) return;  // only meaningful when launched by the cases below
  const std::string store = std::getenv("TORCHDBG_DIST_STORE");
  const std::string scenario = std::getenv("TORCHDBG_DIST_SCENARIO");
  if (scenario == "train") train_scenario(rank, world, store);
  if (scenario == "dead") failure_scenario(rank, world, store, false);
  if (scenario == "hang") failure_scenario(rank, world, store, true);
  if (scenario == "magnitudes") magnitudes_scenario(rank, world, store);
}

TEST_CASE(
    "2 and 4 processes pause at the step a NaN appears on one rank, with global statistics and a "
    "rank-aware diagnosis",
    "[distributed]") {
  for (int world : {2, 4}) {
    const auto res = launch(world, "train");
    for (std::size_t r = 0; r < res.size(); ++r) {
      INFO("world " << world << " rank " << r << " output:\n" << res[r].output);
      CHECK(res[r].status == 0);
    }
  }
}

TEST_CASE(
    "property: global and per-rank mean, std, min and max of float64 data of any magnitude, "
    "1e-300 to 1e307, split across 3 processes and chunks, are a long-double reference's",
    "[distributed]") {
  const auto res = launch(3, "magnitudes");
  for (std::size_t r = 0; r < res.size(); ++r) {
    INFO("rank " << r << " output:\n" << res[r].output);
    CHECK(res[r].status == 0);
  }
}

TEST_CASE("a rank that dies or hangs makes the others fail with a clear error instead of blocking",
          "[distributed]") {
  for (const char* scenario : {"dead", "hang"}) {
    const auto res = launch(2, scenario, 60);
    INFO(scenario << " rank 0 output:\n" << res[0].output);
    CHECK(res[0].status == 0);
    CHECK(res[0].output.find("failed clearly") != std::string::npos);
  }
}

TEST_CASE("100000 steps with new layer names every step keep the monitor's memory bounded", "[distributed]") {
  // One rank over a FileStore: the name table, local moments and global statistics stay
  // within max_layers whatever names come and go; the newest names still resolve.
  const std::string dir = torchdbg_test::tmp_dir("dist_names");
  auto store = c10::make_intrusive<c10d::FileStore>(dir + "/store", 1);
  auto group = torchdbg::make_gloo_group(store, 0, 1);
  torchdbg::HookManager hooks(torchdbg::HookManagerOptions().inspector(torchdbg::InspectorOptions().sample_rate(0.0)));
  torchdbg::DistributedMonitor dist(group, store, hooks, nullptr,
                                    torchdbg::DistributedOptions().report_interval(100).max_layers(16));
  const auto x = torch::ones({4});
  std::size_t most_names = 0, most_global = 0;
  constexpr int64_t kSteps = 100000;
  for (int64_t step = 0; step < kSteps; ++step) {
    hooks.set_step(step);
    if (step % 100 == 0) {  // a reporting step: 3 layers named after the step
      for (int k = 0; k < 3; ++k) (void)hooks.execute_hooks("layer" + std::to_string(step + k), x, true);
    }
    const auto b = dist.step_boundary(step);
    if (b.reported) {
      most_names = std::max(most_names, dist.known_name_count());
      most_global = std::max(most_global, dist.global_stats().size());
    }
  }
  CHECK(most_names <= 16);
  CHECK(most_global <= 16);
  const auto last = dist.global_layer("layer" + std::to_string(kSteps - 100 + 2));
  REQUIRE(last);
  CHECK(last->global.finite == 4);
  CHECK(last->global.mean == 1.0);
}
