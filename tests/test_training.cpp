// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
// The pause contract inside a real LibTorch training loop.
#include <torchdbg/attach.hpp>
#include <torchdbg/exporters/jsonl.hpp>
#include <torchdbg/hook_manager.hpp>
#include <torchdbg/report.hpp>

#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <thread>

#include "helpers.hpp"

using torchdbg::HookAction;
using torchdbg::HookCondition;
using torchdbg::HookConfig;
using torchdbg::HookTrigger;

namespace {

struct Mlp : torch::nn::Module {
  Mlp() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 1));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct Run {
  std::vector<double> losses;          // loss of every executed step
  std::vector<int64_t> paused_at;      // steps at which the loop saw the flag
  int64_t steps_executed = 0;
};

/// Trains until `steps` steps have run; the learning rate jumps at `boost_step` so the loss
/// explodes. `on_pause` decides how the loop waits while paused.
Run train(torchdbg::HookManager& hooks, int64_t steps, int64_t boost_step,
          const std::function<void(Mlp&)>& on_pause) {
  torch::manual_seed(0);
  auto model = std::make_shared<Mlp>();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
  auto x = torch::randn({64, 8});
  auto y = x.sum(1, true);
  auto pause = hooks.pause_flag();
  Run run;
  for (int64_t step = 0; step < steps; ++step) {
    if (step == boost_step) {
      for (auto& g : opt.param_groups()) static_cast<torch::optim::SGDOptions&>(g.options()).lr(2.0);
    }
    hooks.set_step(step);
    opt.zero_grad();
    auto h = torch::relu(model->fc1(x));
    auto loss = torch::mse_loss(model->fc2(h), y);
    const double lv = loss.item<double>();
    hooks.set_loss(lv);
    hooks.execute_hooks("fc1", h, true);
    loss.backward();
    hooks.execute_hooks("fc1", model->fc1->weight.grad(), false, {{"parameter", "weight"}});
    run.losses.push_back(lv);
    if (pause->load()) {
      run.paused_at.push_back(step);
      on_pause(*model);
      if (pause->load()) break;  // not resumed: stop training
    }
    opt.step();
    ++run.steps_executed;
  }
  return run;
}

}  // namespace

TEST_CASE("a loss alert pauses training at the first step past the threshold, resume continues", "[training]") {
  torchdbg::HookManager hooks;
  const double threshold = 1e3;
  hooks.register_hook(HookConfig()
                          .name("loss guard")
                          .trigger(HookTrigger::conditional(HookCondition::loss_above(threshold) ||
                                                            HookCondition::loss_non_finite()))
                          .actions({HookAction::alert("loss exploded", torchdbg::AlertSeverity::Critical),
                                    HookAction::pause_training("loss above 1e3")})
                          .max_executions(1));
  hooks.create_tensor_inspection_hook({"fc"});
  int pauses_seen = 0;
  const auto run = train(hooks, 60, 20, [&](Mlp&) {
    ++pauses_seen;
    hooks.resume_training();
  });
  // The step the manager must have paused at, found independently from the losses.
  int64_t expected = -1;
  for (std::size_t i = 0; i < run.losses.size(); ++i) {
    if (!(run.losses[i] <= threshold)) {
      expected = static_cast<int64_t>(i);
      break;
    }
  }
  REQUIRE(expected >= 20);  // the boosted learning rate made it explode
  REQUIRE(run.paused_at.size() == 1);
  CHECK(run.paused_at[0] == expected);
  CHECK(pauses_seen == 1);
  CHECK(run.steps_executed == 60);  // resumed and ran to the end
  const auto alerts = hooks.alerts();
  REQUIRE_FALSE(alerts.empty());
  CHECK(alerts[0].step == expected);
  CHECK(alerts[0].message == "loss exploded");
  CHECK(hooks.inspector.latest("fc1"));
  CHECK(hooks.inspector.latest("fc1")->step == 59);
}

TEST_CASE("while paused the loop does not advance until another thread resumes it", "[training]") {
  torchdbg::HookManager hooks;
  hooks.register_hook(HookConfig()
                          .name("pause at 5")
                          .trigger(HookTrigger::conditional(HookCondition::step_range(5, 5)))
                          .actions({HookAction::pause_training()}));
  std::atomic<bool> params_changed_while_paused{false};
  std::atomic<int64_t> step_seen_by_watcher{-1};
  std::thread watcher;
  const auto run = train(hooks, 10, 1000, [&](Mlp& model) {
    // The loop's side of the contract: stop advancing and poll.
    watcher = std::thread([&hooks, &model, &params_changed_while_paused, &step_seen_by_watcher] {
      auto before = model.fc1->weight.detach().clone();
      step_seen_by_watcher = hooks.step();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      params_changed_while_paused = !torch::equal(before, model.fc1->weight.detach());
      hooks.resume_training();
    });
    while (hooks.pause_flag()->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    watcher.join();
  });
  CHECK(run.paused_at == std::vector<int64_t>{5});
  CHECK(step_seen_by_watcher == 5);
  CHECK_FALSE(params_changed_while_paused);
  CHECK(run.steps_executed == 10);
}

TEST_CASE("a pause that is never resumed stops the loop at that step", "[training]") {
  torchdbg::HookManager hooks;
  hooks.register_hook(HookConfig()
                          .trigger(HookTrigger::conditional(HookCondition::step_range(3, 100)))
                          .actions({HookAction::pause_training("stop")}));
  const auto run = train(hooks, 10, 1000, [](Mlp&) {});
  CHECK(run.paused_at == std::vector<int64_t>{3});
  CHECK(run.steps_executed == 3);
  CHECK(hooks.pause_info()->step == 3);
}

TEST_CASE("ten threads: attached training, execute, register/remove, every query, set_step, pause, reporter", "[training]") {
  // Each thread below works on one manager while an attached model trains on another thread.
  // Under ASan and TSan (ctest runs this file in both), any use-after-free or data race fails.
  torchdbg::HookManager hooks(torchdbg::HookManagerOptions().inspector(torchdbg::InspectorOptions().sample_rate(0.0)));
  const auto dir = torchdbg_test::tmp_dir("stress_threads");
  torchdbg::Reporter reporter(torchdbg::ReporterOptions().histogram_interval(7).layers({"^fc[0-9]+$", "^w"}));
  reporter.add_exporter(std::make_shared<torchdbg::JsonlExporter>(dir + "/stream.jsonl"));
  auto installed = reporter.install(hooks);
  std::atomic<int64_t> counted{0};
  hooks.register_callback("count", [&](const torchdbg::HookContext&) { counted.fetch_add(1); });
  const auto count_hook = hooks.register_hook(
      HookConfig().name("count").trigger(HookTrigger::every_backward()).actions({HookAction::custom_callback("count")}));
  hooks.create_tensor_inspection_hook({"^fc"});
  hooks.create_gradient_tracking_hook({});

  torch::manual_seed(3);
  auto model = std::make_shared<Mlp>();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
  auto session = torchdbg::attach(*model, hooks);
  const auto x = torch::randn({16, 8});
  const auto y = x.sum(1, true);

  std::atomic<bool> stop{false};
  std::atomic<int64_t> problems{0};  // Catch2 assertions are for the main thread only
  constexpr int64_t kSteps = 60;
  std::vector<std::thread> threads;
  threads.emplace_back([&] {  // the training loop
    for (int64_t step = 0; step < kSteps; ++step) {
      hooks.set_step(step);
      opt.zero_grad();
      auto loss = torch::mse_loss(model->fc2(torch::relu(model->fc1(x))), y);
      hooks.set_loss(loss.item<double>());
      loss.backward();
      opt.step();
    }
    stop.store(true);
  });
  threads.emplace_back([&] {  // registration churn
    while (!stop.load()) {
      auto id = hooks.create_tensor_inspection_hook({"^w"});
      hooks.set_hook_enabled(id, false);
      (void)hooks.remove_hook(id);
    }
  });
  threads.emplace_back([&] {  // every list query
    while (!stop.load()) {
      for (const auto& [id, config] : hooks.get_all_hooks())
        if (!hooks.get_hook(id) && config.name() == "count") problems.fetch_add(1);
      for (const auto& [id, stats] : hooks.get_all_stats())
        if (stats.errors > stats.executions) problems.fetch_add(1);
      if (!hooks.get_hook_stats(count_hook)) problems.fetch_add(1);
      (void)hooks.may_fire(true, 3);
      (void)hooks.reads_sign_counts(false, 3);
      (void)hooks.hook_count();
    }
  });
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {  // direct deliveries
      int64_t k = 0;
      while (!stop.load()) {
        ++k;
        auto r = hooks.execute_hooks("w" + std::to_string(w), torch::full({32}, static_cast<double>(k)), k % 2 == 0);
        for (const auto& [id, res] : r)
          if (res.is_error()) problems.fetch_add(1);  // skipped: a churned hook, disabled
      }
    });
  }
  threads.emplace_back([&] {  // pause and resume
    while (!stop.load()) {
      hooks.pause_training("stress");
      hooks.resume_training();
    }
  });
  threads.emplace_back([&] {  // reporter writes and queries
    while (!stop.load()) {
      reporter.flush();
      (void)reporter.steps_written();
      (void)reporter.exporter_errors();
    }
  });
  threads.emplace_back([&] {  // inspector and state queries
    while (!stop.load()) {
      (void)hooks.inspector.latest("fc1");
      (void)hooks.inspector.gradient_history("w1/grad");
      (void)hooks.state();
      (void)session.gradient_norms();
    }
  });
  threads.emplace_back([&] {  // set_step (to the current step) and set_loss from another thread
    int64_t k = 0;
    while (!stop.load()) {
      hooks.set_step(hooks.step());
      hooks.set_loss(static_cast<double>(++k));
    }
  });
  threads.emplace_back([&] {  // callbacks registered and removed while hooks may call them
    while (!stop.load()) {
      hooks.register_callback("spare", [](const torchdbg::HookContext&) {});
      (void)hooks.remove_callback("spare");
    }
  });
  REQUIRE(threads.size() >= 10);
  for (auto& t : threads) t.join();
  session.detach();
  installed.remove();
  reporter.finish(torchdbg::RunSummary{});

  CHECK(problems.load() == 0);
  CHECK(reporter.exporter_errors() == 0);
  CHECK(hooks.get_hook_stats(count_hook)->errors == 0);
  CHECK(hooks.get_hook_stats(count_hook)->executions == static_cast<uint64_t>(counted.load()));
  CHECK(counted.load() >= kSteps * 4);  // at least the attached parameters' gradients
  // Every line the reporter wrote is a complete JSON object.
  std::ifstream in(dir + "/stream.jsonl");
  std::string line;
  int64_t lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    CHECK(nlohmann::json::accept(line));
  }
  CHECK(lines > 0);
}
