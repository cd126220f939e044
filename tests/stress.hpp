// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once
// A randomized concurrency stress run, shared by the test suite ([stress], also under TSan and
// ASan) and bench/stress.cpp (longer runs). Two models train on their own threads, each with
// its own manager; meanwhile other threads, at random moments and with random delays:
// destroy and re-create model A's gradient session (detach from another thread during a
// pass), attach and drop forward-only sessions, register and remove hooks (some of which
// throw), install and remove the health monitor, flush the reporter, and query the manager,
// inspector, monitor and sessions. Some of A's backward passes throw (a tensor hook). Model
// B's session is never touched: each of its steps must report exactly its own gradient norm.
// Everything is seeded; the seed is printed so a failing run can be replayed.

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <torchdbg/attach.hpp>
#include <torchdbg/diagnosis.hpp>
#include <torchdbg/exporters/jsonl.hpp>
#include <torchdbg/health.hpp>
#include <torchdbg/report.hpp>

namespace torchdbg_test {

struct StressOptions {
  uint64_t seed = 1;
  double seconds = 2.0;
  std::string jsonl_path;  // the reporter's stream; empty: no exporter
};

struct StressReport {
  uint64_t steps_a = 0, steps_b = 0, thrown_passes = 0, session_swaps = 0, side_sessions = 0;
  uint64_t hook_changes = 0, health_swaps = 0, flushes = 0, queries = 0;
  /// What must never happen: a wrong norm on B, an unexpected exception, a broken end state.
  std::vector<std::string> problems;
};

namespace stress_detail {

struct Mlp : torch::nn::Module {
  explicit Mlp(int64_t width)
      : fc1(register_module("fc1", torch::nn::Linear(6, width))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        fc2(register_module("fc2", torch::nn::Linear(width, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(norm(fc1(x)))); }
  torch::nn::Linear fc1;
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc2;
};

inline double reference_norm(torch::nn::Module& m) {
  double sq = 0;
  for (const auto& p : m.parameters())
    if (p.grad().defined()) sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
  return std::sqrt(sq);
}

inline void sgd(torch::nn::Module& m, double lr) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters())
    if (p.grad().defined()) p.sub_(p.grad() * lr);
}

}  // namespace stress_detail

/// Runs the stress scenario for `o.seconds`; never throws (problems are reported).
inline StressReport run_stress(const StressOptions& o) {
  using namespace stress_detail;
  std::printf("torchdbg stress: seed %llu, %.1f s\n", static_cast<unsigned long long>(o.seed), o.seconds);
  std::fflush(stdout);
  StressReport rep;
  std::mutex problems_mutex;
  const auto problem = [&](std::string what) {
    std::lock_guard<std::mutex> lock(problems_mutex);
    if (rep.problems.size() < 50) rep.problems.push_back(std::move(what));
  };
  torch::manual_seed(o.seed);
  auto model_a = std::make_shared<Mlp>(16);
  auto model_b = std::make_shared<Mlp>(12);
  torchdbg::HookManager mgr_a, mgr_b;
  mgr_a.create_gradient_tracking_hook({});
  mgr_b.create_gradient_tracking_hook({});
  mgr_a.create_tensor_inspection_hook({});
  torchdbg::HealthMonitor health(torchdbg::HealthOptions().event_capacity(256));
  torchdbg::Reporter reporter;
  if (!o.jsonl_path.empty()) {
    try {
      reporter.add_exporter(std::make_shared<torchdbg::JsonlExporter>(o.jsonl_path));
    } catch (const std::exception& e) {
      problem(std::string("exporter: ") + e.what());
    }
  }
  std::optional<torchdbg::ReporterInstallation> report_inst;
  report_inst.emplace(reporter.install(mgr_a));

  // Model A's gradient session and the health installation, replaced from other threads.
  std::mutex slot_mutex;
  std::shared_ptr<torchdbg::AttachSession> session_a =
      std::make_shared<torchdbg::AttachSession>(torchdbg::attach(*model_a, mgr_a));
  std::shared_ptr<torchdbg::HealthInstallation<std::mutex, std::mutex>> health_inst =
      std::make_shared<torchdbg::HealthInstallation<std::mutex, std::mutex>>(health.install(mgr_a));
  auto session_b = torchdbg::attach(*model_b, mgr_b, torchdbg::AttachOptions().auto_step(true));

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.seconds);
  const auto running = [&] { return std::chrono::steady_clock::now() < deadline; };
  std::atomic<uint64_t> steps_a{0}, steps_b{0}, thrown{0}, swaps{0}, sides{0}, hook_changes{0}, health_swaps{0},
      flushes{0}, queries{0};
  const auto pause = [](std::mt19937_64& g) {
    const auto r = g() % 100;
    if (r < 40) return;
    if (r < 70) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(g() % 300));
    }
  };

  std::vector<std::thread> threads;
  // Trainer A: steps, losses, some passes that throw.
  threads.emplace_back([&] {
    std::mt19937_64 g(o.seed * 7 + 1);
    try {
      for (int64_t step = 0; running(); ++step) {
        mgr_a.set_step(step);
        model_a->zero_grad();
        const auto x = torch::randn({8, 6});
        torch::Tensor y = model_a->forward(x);
        const bool fail = g() % 12 == 0;
        if (fail) y.register_hook([](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("stress: hook"); });
        const auto loss = y.pow(2).mean();
        mgr_a.set_loss(loss.item<double>());
        try {
          loss.backward();
          if (fail) problem("A: a throwing pass did not throw");
        } catch (const std::exception&) {
          if (!fail) throw;
          thrown.fetch_add(1);
        }
        sgd(*model_a, 1e-3);
        steps_a.fetch_add(1);
        pause(g);
      }
    } catch (const std::exception& e) {
      problem(std::string("trainer A: ") + e.what());
    }
  });
  // Trainer B: its session is never touched, so every step's norm is its own.
  threads.emplace_back([&] {
    std::mt19937_64 g(o.seed * 7 + 2);
    try {
      while (running()) {
        model_b->zero_grad();
        const int64_t before = mgr_b.step();
        model_b->forward(torch::randn({5, 6})).pow(2).mean().backward();
        const double ref = reference_norm(*model_b);
        const auto st = mgr_b.state();
        if (st.step != before + 1) problem("B: step " + std::to_string(st.step) + " after " + std::to_string(before));
        if (!st.gradient_norm || std::fabs(*st.gradient_norm - ref) > 1e-5 * std::max(1.0, ref))
          problem("B: gradient norm " + (st.gradient_norm ? std::to_string(*st.gradient_norm) : "none") +
                  ", reference " + std::to_string(ref));
        sgd(*model_b, 1e-3);
        steps_b.fetch_add(1);
        pause(g);
      }
    } catch (const std::exception& e) {
      problem(std::string("trainer B: ") + e.what());
    }
  });
  // Churn on A: sessions, hooks, health, reporter.
  threads.emplace_back([&] {
    std::mt19937_64 g(o.seed * 7 + 3);
    std::vector<torchdbg::HookId> extra_hooks;
    std::shared_ptr<torchdbg::AttachSession> side;
    mgr_a.register_callback("stress.throws", [](const torchdbg::HookContext& c) {
      if (c.layer_name() == "fc2") throw std::runtime_error("stress: callback");
    });
    try {
      while (running()) {
        switch (g() % 6) {
          case 0: {  // the gradient session is destroyed (maybe during a pass) and made anew
            std::shared_ptr<torchdbg::AttachSession> old;
            {
              std::lock_guard<std::mutex> lock(slot_mutex);
              old = std::move(session_a);
            }
            old.reset();
            pause(g);
            auto options = torchdbg::AttachOptions()
                               .batching(g() % 2 ? torchdbg::StatsBatching::All : torchdbg::StatsBatching::Device)
                               .gradient_norms(g() % 4 != 0);
            auto fresh = std::make_shared<torchdbg::AttachSession>(torchdbg::attach(*model_a, mgr_a, options));
            std::lock_guard<std::mutex> lock(slot_mutex);
            session_a = std::move(fresh);
            swaps.fetch_add(1);
            break;
          }
          case 1:  // a forward-only session beside it, dropped later
            if (side) {
              side.reset();
            } else {
              side = std::make_shared<torchdbg::AttachSession>(
                  torchdbg::attach(*model_a, mgr_a, torchdbg::AttachOptions().backward(false)));
              sides.fetch_add(1);
            }
            break;
          case 2:  // hooks come and go; may_fire changes, so the observer comes and goes
            if (!extra_hooks.empty() && g() % 2) {
              (void)mgr_a.remove_hook(extra_hooks.back());
              extra_hooks.pop_back();
            } else if (extra_hooks.size() < 8) {
              extra_hooks.push_back(mgr_a.register_hook(
                  torchdbg::HookConfig()
                      .trigger(torchdbg::HookTrigger::every_n_steps(1 + static_cast<int64_t>(g() % 3)))
                      .actions({torchdbg::HookAction::custom_callback("stress.throws")})));
            }
            hook_changes.fetch_add(1);
            break;
          case 3: {  // the health installation is removed and made anew
            std::shared_ptr<torchdbg::HealthInstallation<std::mutex, std::mutex>> old;
            {
              std::lock_guard<std::mutex> lock(slot_mutex);
              old = std::move(health_inst);
            }
            old.reset();
            pause(g);
            auto fresh = std::make_shared<torchdbg::HealthInstallation<std::mutex, std::mutex>>(health.install(mgr_a));
            std::lock_guard<std::mutex> lock(slot_mutex);
            health_inst = std::move(fresh);
            health_swaps.fetch_add(1);
            break;
          }
          case 4:
            reporter.flush();
            flushes.fetch_add(1);
            break;
          default: {
            std::shared_ptr<torchdbg::AttachSession> s;
            {
              std::lock_guard<std::mutex> lock(slot_mutex);
              s = session_a;
            }
            if (s) {
              s->flush();
              (void)s->gradient_norms();
              (void)s->execution_order();
            }
            queries.fetch_add(1);
            break;
          }
        }
        pause(g);
      }
    } catch (const std::exception& e) {
      problem(std::string("churn A: ") + e.what());
    }
    side.reset();
    for (const auto& id : extra_hooks) (void)mgr_a.remove_hook(id);
  });
  // Queries from yet another thread, and hook churn on B's manager (B's observer state).
  threads.emplace_back([&] {
    std::mt19937_64 g(o.seed * 7 + 4);
    std::vector<torchdbg::HookId> b_hooks;
    try {
      while (running()) {
        switch (g() % 5) {
          case 0:
            (void)health.events();
            (void)health.layers();
            break;
          case 1:
            (void)torchdbg::diagnose(health);
            break;
          case 2:
            (void)mgr_a.get_all_stats();
            (void)mgr_a.get_all_hooks();
            (void)mgr_a.inspector.gradient_history("fc1/grad");
            break;
          case 3:
            if (!b_hooks.empty() && g() % 2) {
              (void)mgr_b.remove_hook(b_hooks.back());
              b_hooks.pop_back();
            } else if (b_hooks.size() < 4) {
              b_hooks.push_back(mgr_b.create_tensor_inspection_hook({}));
            }
            break;
          default:
            (void)session_b.gradient_norms();
            (void)mgr_b.state();
            break;
        }
        queries.fetch_add(1);
        pause(g);
      }
    } catch (const std::exception& e) {
      problem(std::string("queries: ") + e.what());
    }
    for (const auto& id : b_hooks) (void)mgr_b.remove_hook(id);
  });
  for (auto& t : threads) t.join();

  // Quiet again: a fresh gradient session on A observes one step exactly.
  try {
    {
      std::lock_guard<std::mutex> lock(slot_mutex);
      session_a.reset();
    }
    auto fresh = torchdbg::attach(*model_a, mgr_a);
    mgr_a.set_step(mgr_a.step() + 1);
    model_a->zero_grad();
    model_a->forward(torch::randn({4, 6})).sum().backward();
    const auto st = mgr_a.state();
    const double ref = reference_norm(*model_a);
    if (!st.gradient_norm || std::fabs(*st.gradient_norm - ref) > 1e-5 * std::max(1.0, ref))
      problem("A at the end: gradient norm " + (st.gradient_norm ? std::to_string(*st.gradient_norm) : "none") +
              ", reference " + std::to_string(ref));
    if (fresh.forward_deliveries() == 0) problem("A at the end: no forward delivery");
    if (health.events().size() > 256) problem("health events beyond their capacity");
    (void)torchdbg::diagnose(health);
    reporter.flush();
  } catch (const std::exception& e) {
    problem(std::string("end state: ") + e.what());
  }
  health_inst.reset();
  report_inst.reset();
  rep.steps_a = steps_a;
  rep.steps_b = steps_b;
  rep.thrown_passes = thrown;
  rep.session_swaps = swaps;
  rep.side_sessions = sides;
  rep.hook_changes = hook_changes;
  rep.health_swaps = health_swaps;
  rep.flushes = flushes;
  rep.queries = queries;
  std::printf(
      "torchdbg stress: A %llu steps (%llu passes threw), B %llu steps; %llu session swaps, %llu side sessions, "
      "%llu hook changes, %llu health swaps, %llu flushes, %llu queries; %zu problems\n",
      static_cast<unsigned long long>(rep.steps_a), static_cast<unsigned long long>(rep.thrown_passes),
      static_cast<unsigned long long>(rep.steps_b), static_cast<unsigned long long>(rep.session_swaps),
      static_cast<unsigned long long>(rep.side_sessions), static_cast<unsigned long long>(rep.hook_changes),
      static_cast<unsigned long long>(rep.health_swaps), static_cast<unsigned long long>(rep.flushes),
      static_cast<unsigned long long>(rep.queries), rep.problems.size());
  for (const auto& p : rep.problems) std::printf("  problem: %s\n", p.c_str());
  std::fflush(stdout);
  return rep;
}

}  // namespace torchdbg_test
