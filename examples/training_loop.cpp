// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// The demo: an MLP trained on synthetic data with torchdbg attached to every layer (no change
// to the model), a health monitor and a reporter. Midway the learning rate is raised until
// training breaks; torchdbg pauses it, the loop sees the pause flag between steps, prints the
// diagnosis and the layers' health, restores the last good checkpoint with a sane learning
// rate and resumes. At the end it prints what torchdbg did and what it cost per step (100 more
// steps timed with and without it), writes an HTML report, a JSONL stream, a CSV table and a
// JSON summary, and prints their paths. With --live it also serves the live page
// (torchdbg/live.hpp): it prints the page's address, slows to about 20 steps a second so the
// run can be watched, and when training pauses it waits for Resume on the page before
// restoring the checkpoint; at the end the page stays up until Enter (or end of input).
//
//   training_loop [output directory] [--live]      (default: ./torchdbg-demo)
#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>
#include <iostream>
#include <string>
#include <thread>
#include <torchdbg/torchdbg.hpp>
#if defined(TORCHDBG_DEMO_LIVE)
#include <torchdbg/live.hpp>
#endif

namespace {

struct Mlp : torch::nn::Module {
  Mlp(int64_t in, int64_t hidden, int64_t classes)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, classes))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1(x));
    x = torch::relu(fc2(x));
    return fc3(x);
  }
  torch::nn::Linear fc1, fc2, fc3;
};

std::string serialize(torch::nn::Module& m) {
  std::ostringstream os;
  torch::serialize::OutputArchive ar;
  m.save(ar);
  ar.save_to(os);
  return os.str();
}

void restore(torch::nn::Module& m, const std::string& bytes) {
  std::istringstream is(bytes);
  torch::serialize::InputArchive ar;
  ar.load_from(is);
  m.load(ar);
}

}  // namespace

int main(int argc, char** argv) {
  torch::manual_seed(42);
  torch::set_num_threads(1);
  constexpr int64_t kSteps = 400, kBoostStep = 200, kBatch = 128, kIn = 64, kClasses = 10;
  std::string out_arg = "torchdbg-demo";
  bool live_page = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--live") {
      live_page = true;
    } else {
      out_arg = a;
    }
  }
#if !defined(TORCHDBG_DEMO_LIVE)
  if (live_page) {
    fmt::print(stderr, "training_loop: built without cpp-httplib (libcpp-httplib-dev), so without --live\n");
    return 2;
  }
#endif
  const std::filesystem::path out = std::filesystem::absolute(out_arg);
  std::filesystem::create_directories(out);

  // Synthetic, learnable data: the class is the argmax of a fixed random projection.
  const auto projection = torch::randn({kIn, kClasses});
  auto make_batch = [&] {
    auto x = torch::randn({kBatch, kIn});
    return std::make_pair(x, x.matmul(projection).argmax(1));
  };

  auto model = std::make_shared<Mlp>(kIn, 128, kClasses);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto set_lr = [&](double lr) {
    for (auto& g : opt.param_groups()) static_cast<torch::optim::SGDOptions&>(g.options()).lr(lr);
  };

  // The debugger: a loss guard hook, a health monitor that pauses on failures, a reporter
  // with four outputs, and the model attached as it is.
  // [snippet setup]
  torchdbg::HookManager hooks(
      torchdbg::HookManagerOptions().inspector(torchdbg::InspectorOptions().sample_rate(0.1)));
  hooks.register_hook(
      torchdbg::HookConfig()
          .name("loss guard")
          .trigger(torchdbg::HookTrigger::conditional(torchdbg::HookCondition::loss_above(10.0) ||
                                                      torchdbg::HookCondition::loss_non_finite()))
          .actions({torchdbg::HookAction::alert("loss exploded", torchdbg::AlertSeverity::Critical),
                    torchdbg::HookAction::pause_training("loss above 10 or not finite")}));
  torchdbg::HealthMonitor health(torchdbg::HealthOptions().on_failure(torchdbg::OnFailure::Pause));
  auto health_fed = health.install(hooks);
  torchdbg::Reporter reporter(torchdbg::ReporterOptions().histogram_interval(25));
  const std::string html = (out / "report.html").string(), jsonl = (out / "run.jsonl").string(),
                    csv = (out / "layers.csv").string(), summary = (out / "summary.json").string();
  reporter.add_exporter(std::make_shared<torchdbg::HtmlExporter>(
      html, torchdbg::HtmlOptions().title("torchdbg demo: a learning-rate blow-up")));
  reporter.add_exporter(std::make_shared<torchdbg::JsonlExporter>(jsonl));
  reporter.add_exporter(std::make_shared<torchdbg::CsvExporter>(csv));
  reporter.add_exporter(std::make_shared<torchdbg::SummaryJsonExporter>(summary));
  auto report_fed = reporter.install(hooks, &health);
  auto session = torchdbg::attach(*model, hooks);
  auto pause = hooks.pause_flag();
  // [/snippet]
#if defined(TORCHDBG_DEMO_LIVE)
  // [snippet live]
  std::optional<torchdbg::LiveServer> live;  // the live page (torchdbg/live.hpp), with --live
  if (live_page)  // prints "torchdbg live page: http://127.0.0.1:PORT/?token=..." to stderr
    live.emplace(hooks, health, reporter, torchdbg::LiveOptions().html(torchdbg::HtmlOptions().title("torchdbg demo")));
  // [/snippet]
#endif

  std::string checkpoint = serialize(*model);
  int64_t checkpoint_step = 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    if (step == kBoostStep) {
      fmt::print("step {:>3}: raising the learning rate to 8.0 (a bad schedule)\n", step);
      set_lr(8.0);
    }
    hooks.set_step(step);
    auto [x, target] = make_batch();
    opt.zero_grad();
    auto loss = torch::cross_entropy_loss(model->forward(x), target);
    const double loss_value = loss.item<double>();
    hooks.set_loss(loss_value);
    loss.backward();

    // [snippet pause]
    // Between steps the loop polls the flag; torchdbg never blocks.
    if (pause->load()) {
      const auto info = hooks.pause_info();
      fmt::print("\nstep {:>3}: training PAUSED: {} (loss {:.4g})\n", step,
                 info ? info->reason : "?", loss_value);
      health.set_step(step +
                      1);  // finish this step's health (gradients included) before reading it
      const auto at_failure = health.failure_report();
      const auto d = torchdbg::diagnose(at_failure ? *at_failure : health.report());
      fmt::print("diagnosis: {}\n\n", d.summary());
      fmt::print("{}", torchdbg::health_table(health.layers()));
      if (live_page) {  // the page shows the diagnosis; its Resume button clears the flag
        fmt::print("\nwaiting for Resume on the live page\n");
        std::fflush(stdout);
        while (pause->load()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      fmt::print("\nrestoring the checkpoint of step {} with learning rate 0.05 and resuming\n\n",
                 checkpoint_step);
      restore(*model, checkpoint);
      opt.state().clear();  // drop the momentum built up by the bad steps
      set_lr(0.05);
      hooks.resume_training();
      continue;  // this step's update is skipped
    }
    // [/snippet]
    if (step % 25 == 0) {  // the weights that gave this step's healthy loss
      checkpoint = serialize(*model);
      checkpoint_step = step;
    }
    opt.step();
    if (live_page) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // to be watched
    if (step % 50 == 0 || step == kSteps - 1) {
      fmt::print("{}\n", torchdbg::progress_line(step, kSteps, loss_value, hooks.alert_count(),
                                                 health.alarm_count(), health.loss_health()));
    }
  }
  reporter.finish(torchdbg::make_summary(hooks, health));
  fmt::print("\nfinished {} steps; what torchdbg did:\n", kSteps);
  fmt::print("  attach:  {} forward outputs and {} gradients delivered from {} modules\n",
             session.forward_deliveries(), session.backward_deliveries(), session.module_names().size());
  fmt::print("  health:  {} events, {} alarms, {} incidents\n", health.event_count(), health.alarm_count(),
             health.incidents().size());
  fmt::print("  manager: {}\n", hooks);
  for (const auto& [id, cfg] : hooks.get_all_hooks()) fmt::print("  {}: {}\n", cfg.name(), *hooks.get_hook_stats(id));
  fmt::print("\nlayer health at the end:\n{}", torchdbg::health_table(health.layers()));

  // What it cost: 100 more steps with the debugger (attach, health monitor, loss guard; the
  // reporter's files are finished) and 100 without, interleaved so drift hits both alike.
  report_fed.remove();
  auto timed_steps = [&](int64_t first, int64_t n, bool debugged) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t step = first; step < first + n; ++step) {
      if (debugged) hooks.set_step(step);
      auto [x, target] = make_batch();
      opt.zero_grad();
      auto loss = torch::cross_entropy_loss(model->forward(x), target);
      const double loss_value = loss.item<double>();
      if (debugged) hooks.set_loss(loss_value);
      loss.backward();
      opt.step();
    }
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  double with_ms = 0, without_ms = 0;
  int64_t next = kSteps;
  for (int round = 0; round < 4; ++round, next += 50) {
    session.detach();
    without_ms += timed_steps(next, 25, false);
    session = torchdbg::attach(*model, hooks);
    with_ms += timed_steps(next + 25, 25, true);
  }
  fmt::print("\ncost: a step took {:.3f} ms with torchdbg (attach, health monitor, loss guard), {:.3f} ms without "
             "({:+.1f} %; 100 more steps each)\n",
             with_ms / 100, without_ms / 100, 100.0 * (with_ms / without_ms - 1.0));
  fmt::print("\nreport: {}\nstream: {}\ntable:  {}\nsummary: {}\n", html, jsonl, csv, summary);
  if (reporter.exporter_errors() > 0)
    fmt::print("exporter errors {}: {}\n", reporter.exporter_errors(), reporter.last_error());
  if (live_page) {
    fmt::print("\nthe live page stays up until Enter\n");
    std::fflush(stdout);
    std::string line;
    std::getline(std::cin, line);
  }
  return 0;
}
