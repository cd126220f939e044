// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <cstdlib>
#include <fstream>
#include <map>
#include <torchdbg/attach.hpp>
#include <torchdbg/exporters/html.hpp>
#include <torchdbg/exporters/jsonl.hpp>
#include <torchdbg/report.hpp>
#include <torchdbg/terminal.hpp>

#include "helpers.hpp"

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc0 = register_module("fc0", torch::nn::Linear(8, 16));
    fc1 = register_module("fc1", torch::nn::Linear(16, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc0(x));
    x = fc1(x);
    if (nan_from_step) x = torch::log(x);  // NaN for negative values
    return fc2(torch::relu(x));
  }
  torch::nn::Linear fc0{nullptr}, fc1{nullptr}, fc2{nullptr};
  bool nan_from_step = false;
};

class ThrowingExporter : public torchdbg::BaseExporter<> {
 protected:
  void write_step_(const torchdbg::StepRecord&) override { throw torchdbg::Error("disk on fire"); }
};

/// Trains `steps` steps with attach + health + reporter; the log NaN starts at `nan_step`.
struct Run {
  std::map<int64_t, double> grad_norm;  // reference: torch's own norm of all gradients per step
  std::shared_ptr<torchdbg::RecordingExporter> rec =
      std::make_shared<torchdbg::RecordingExporter>();
  torchdbg::RunSummary summary;
  uint64_t errors = 0;
};

Run train(int64_t steps, int64_t nan_step, bool with_health,
          const std::vector<std::shared_ptr<torchdbg::Exporter>>& extra = {}) {
  torch::manual_seed(4);
  auto net = std::make_shared<Net>();
  torch::optim::SGD opt(net->parameters(), 0.05);
  auto x = torch::randn({32, 8});
  auto y = torch::randint(0, 3, {32});
  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health;
  torchdbg::Reporter reporter(torchdbg::ReporterOptions().histogram_interval(5));
  Run run;
  reporter.add_exporter(run.rec);
  for (const auto& e : extra) reporter.add_exporter(e);
  auto fed =
      with_health ? health.install(hooks) : torchdbg::HealthInstallation<std::mutex, std::mutex>();
  auto rep = reporter.install(hooks, with_health ? &health : nullptr);
  auto session = torchdbg::attach(*net, hooks);
  for (int64_t s = 0; s < steps; ++s) {
    net->nan_from_step = s >= nan_step;
    hooks.set_step(s);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    hooks.set_loss(loss.item<double>());
    loss.backward();
    double sq = 0;
    for (const auto& p : net->parameters())
      sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
    run.grad_norm[s] = std::sqrt(sq);
    opt.step();
  }
  if (with_health) {
    run.summary = torchdbg::make_summary(hooks, health);
  } else {
    hooks.set_step(steps);
  }
  reporter.finish(run.summary);
  run.errors = reporter.exporter_errors();
  return run;
}

}  // namespace

TEST_CASE("the reporter hands every step with statistics, health, events and loss to its exporters",
          "[report]") {
  auto jsonl_path = torchdbg_test::tmp_dir("report_run") + "/run.jsonl";
  auto jsonl = std::make_shared<torchdbg::JsonlExporter>(jsonl_path);
  const Run run = train(12, 8, /*with_health=*/true, {jsonl});
  const auto steps = run.rec->steps();
  REQUIRE(steps.size() == 12);
  for (const auto& r : steps) {
    INFO("step " << r.step);
    REQUIRE(r.loss.has_value());
    CHECK_FALSE(r.layers.empty());
    CHECK_FALSE(r.health.empty());
    // The global gradient norm against torch's own, from the same backward pass.
    if (r.step < 8) {
      REQUIRE(r.gradient_norm.has_value());
      CHECK_CLOSE(*r.gradient_norm, run.grad_norm.at(r.step), 1e-5);
    }
    bool has_hist = false;
    for (const auto& l : r.layers)
      has_hist = has_hist || (l.forward && l.stats.distribution.has_value());
    CHECK(has_hist == (r.step % 5 == 0));
  }
  // The NaN step carries the events that describe it.
  bool nan_event = false;
  for (const auto& e : steps[8].events)
    nan_event =
        nan_event || (e.type == torchdbg::EventType::NonFiniteActivation && e.layer == "fc1/log");
  CHECK(nan_event);
  REQUIRE(run.summary.diagnosis.has_value());
  REQUIRE(run.summary.diagnosis->top() != nullptr);
  CHECK(run.summary.diagnosis->top()->layer == "fc1");
  REQUIRE(run.rec->summary().has_value());
  CHECK(run.errors == 0);
  // The JSONL stream has the same steps.
  std::ifstream in(jsonl_path);
  std::string line;
  int step_lines = 0, summary_lines = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    step_lines += j["type"] == "step";
    summary_lines += j["type"] == "summary";
  }
  CHECK(step_lines == 12);
  CHECK(summary_lines == 1);
}

TEST_CASE("without a health monitor the manager's step changes drive the reporter", "[report]") {
  const Run run = train(6, 100, /*with_health=*/false);
  const auto steps = run.rec->steps();
  REQUIRE(steps.size() == 6);
  for (const auto& r : steps) {
    CHECK(r.health.empty());
    REQUIRE(r.loss.has_value());
    CHECK(std::isfinite(*r.loss));
    CHECK_CLOSE(*r.gradient_norm, run.grad_norm.at(r.step), 1e-5);
  }
}

TEST_CASE("an exporter that throws is counted and never stops training or the other exporters",
          "[report]") {
  const Run run = train(5, 100, true, {std::make_shared<ThrowingExporter>()});
  CHECK(run.errors >= 5);
  CHECK(run.rec->steps().size() == 5);
  torchdbg::Reporter r;
  CHECK_THROWS_WITH(r.add_exporter(nullptr), Catch::Contains("null exporter"));
  CHECK_THROWS_WITH(torchdbg::Reporter(torchdbg::ReporterOptions().interval(0)),
                    Catch::Contains("interval"));
}

TEST_CASE("terminal table and progress line, coloured only when asked or on a TTY", "[report]") {
  torchdbg::LayerHealth a;
  a.name = "encoder.layers.0.fc";
  a.has_activation = true;
  a.activation = torchdbg::ActivationHealth::Saturated;
  a.rms = 0.75;
  a.saturated_fraction = 0.4;
  torchdbg::LayerHealth b;
  b.name = "head";
  b.has_gradient = true;
  b.gradient = torchdbg::GradientHealth::Exploding;
  b.gradient_norm = 1234.5;
  const std::string plain = torchdbg::health_table({a, b}, torchdbg::ColorMode::Never);
  CHECK(plain.find("encoder.layers.0.fc") != std::string::npos);
  CHECK(plain.find("saturated") != std::string::npos);
  CHECK(plain.find("40.0") != std::string::npos);
  CHECK(plain.find("1.23e+03") != std::string::npos);
  CHECK(plain.find('\033') == std::string::npos);
  const std::string colored = torchdbg::health_table({a, b}, torchdbg::ColorMode::Always);
  CHECK(colored.find("\033[31;1m") != std::string::npos);  // exploding in red
  // A pipe is not a terminal: Auto stays plain.
  std::FILE* pipe = ::popen("cat > /dev/null", "w");
  REQUIRE(pipe != nullptr);
  CHECK(torchdbg::health_table({a}, torchdbg::ColorMode::Auto, pipe).find('\033') ==
        std::string::npos);
  ::pclose(pipe);
  CHECK(torchdbg::progress_line(7, 400, 0.4312, 3, 1, torchdbg::LossHealth::Healthy,
                                torchdbg::ColorMode::Never) ==
        "step   7/400  loss 0.4312  alerts 3  alarms 1");
}

TEST_CASE("browser fixture: a real run's report and a 120-layer, 10000-step report", "[browser]") {
  const char* dir = std::getenv("TORCHDBG_BROWSER_DIR");
  const std::string out = dir ? dir : torchdbg_test::tmp_dir("browser");
  std::filesystem::create_directories(out);
  auto html = std::make_shared<torchdbg::HtmlExporter>(
      out + "/real.html", torchdbg::HtmlOptions().title("torchdbg: a NaN in fc1"));
  const Run run = train(30, 20, true, {html});
  CHECK(run.errors == 0);
  torchdbg::HtmlExporter big(out + "/big.html",
                             torchdbg::HtmlOptions().title("torchdbg: 120 layers x 10000 steps"));
  for (int64_t s = 0; s < 10000; ++s) {
    torchdbg::StepRecord r;
    r.step = s;
    r.loss = 3.0 * std::exp(-static_cast<double>(s) / 3000.0) + 0.1;
    for (int l = 0; l < 120; ++l) {
      torchdbg::LayerRecord g;
      g.layer = "layers." + std::to_string(l);
      g.forward = false;
      g.stats.l2_norm = std::pow(10.0, -static_cast<double>(120 - l) / 30.0) *
                        (1 + 0.1 * std::sin(static_cast<double>(s)));
      r.layers.push_back(g);
      torchdbg::LayerHealth h;
      h.name = g.layer;
      h.order = l;
      h.has_gradient = true;
      h.gradient = (l < 20 && s > 5000) ? torchdbg::GradientHealth::Vanishing
                                        : torchdbg::GradientHealth::Healthy;
      r.health.push_back(h);
    }
    big.write_step(r);
  }
  big.flush();
  CHECK(std::filesystem::file_size(out + "/big.html") < (4u << 20));
}

TEST_CASE("a backward pass that throws leaves no record in the step's report", "[report]") {
  for (const int variant : {0, 1, 2}) {
    const bool with_health = variant == 1, norms = variant != 2;
    INFO("steps from the health monitor: " << with_health << ", gradient norms: " << norms);
    torch::manual_seed(9);
    auto net = std::make_shared<Net>();
    torchdbg::HookManager hooks;
    torchdbg::HealthMonitor health;
    torchdbg::Reporter reporter(torchdbg::ReporterOptions().histogram_interval(0));
    auto rec = std::make_shared<torchdbg::RecordingExporter>();
    reporter.add_exporter(rec);
    auto fed = with_health ? health.install(hooks) : torchdbg::HealthInstallation<std::mutex, std::mutex>();
    auto installed = reporter.install(hooks, with_health ? &health : nullptr);
    CHECK_THROWS_WITH(reporter.install(hooks), Catch::Contains("already installed"));
    auto session = torchdbg::attach(*net, hooks, torchdbg::AttachOptions().auto_step(true).gradient_norms(norms));
    const auto x = torch::randn({6, 8});
    std::map<int64_t, double> reference;
    const auto pass = [&](bool fail) {
      net->zero_grad();
      const int64_t step = hooks.step();
      const auto loss = net->forward(x).pow(2).mean();
      hooks.set_loss(loss.item<double>());
      if (fail) {  // fc2's, fc1's and fc0.weight's gradients are delivered, then it throws
        const auto h = net->fc0->weight.register_hook(
            [](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("no"); });
        CHECK_THROWS(loss.backward());
        net->fc0->weight.remove_hook(h);
        return;
      }
      loss.backward();
      double sq = 0;
      for (const auto& p : net->parameters()) sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
      reference[step] = std::sqrt(sq);
    };
    pass(false);
    pass(true);  // at step 1: its forward outputs and most gradients were recorded, then it threw
    pass(false);
    pass(false);
    reporter.finish(with_health ? torchdbg::make_summary(hooks, health) : torchdbg::RunSummary{});
    CHECK(session.failed_backward_passes() == 1);
    int seen = 0;
    for (const auto& r : rec->steps()) {
      if (r.step < 0 || r.step > 2) continue;
      ++seen;
      INFO("step " << r.step);
      std::map<std::string, int> forward, backward;
      for (const auto& l : r.layers) (l.forward ? forward : backward)[l.layer + "." + l.parameter] += 1;
      CHECK(forward["fc1."] == 1);  // one forward per step, the failed iteration's dropped
      CHECK(backward["fc2.weight"] == 1);
      CHECK(backward["fc0.weight"] == 1);
      REQUIRE(r.gradient_norm);
      CHECK_CLOSE(*r.gradient_norm, reference.at(r.step), 1e-6);
    }
    CHECK(seen == 3);
  }
}
