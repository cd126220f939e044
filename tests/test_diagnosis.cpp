// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
// Failure scenarios: small models trained until a failure appears; the top hypothesis must
// name the right kind and the right originating layer within a few steps of onset. Seeds and
// widths vary so that the logic is not tuned to one case.
#include <functional>
#include <random>
#include <sstream>
#include <torchdbg/attach.hpp>
#include <torchdbg/diagnosis.hpp>

#include "helpers.hpp"

using torchdbg::FailureKind;

namespace {

enum class Act { Relu, Tanh, Sigmoid };

/// An MLP of Linear layers "fc0".."fc{n-1}" with an activation after every hidden layer;
/// `tweak` may change the output of a given layer (the failure being induced).
struct ScenarioNet : torch::nn::Module {
  ScenarioNet(int64_t in, int64_t width, int64_t depth, int64_t out, Act act) : act_(act) {
    for (int64_t i = 0; i < depth; ++i) {
      const int64_t a = i == 0 ? in : width;
      const int64_t b = i == depth - 1 ? out : width;
      fcs.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(a, b)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i < fcs.size(); ++i) {
      x = fcs[i](x);
      if (log_layer == static_cast<int64_t>(i) && log_on) x = torch::log(x);  // NaN where x < 0
      if (i + 1 < fcs.size()) {
        switch (act_) {
          case Act::Relu:
            x = torch::relu(x);
            break;
          case Act::Tanh:
            x = torch::tanh(x);
            break;
          case Act::Sigmoid:
            x = torch::sigmoid(x);
            break;
        }
      }
    }
    return x;
  }
  Act act_;
  std::vector<torch::nn::Linear> fcs;
  int64_t log_layer = -1;
  bool log_on = false;
};

struct Scenario {
  int64_t width = 32, depth = 4, steps = 40;
  Act act = Act::Relu;
  double lr = 0.05;
  uint64_t seed = 1;
  int64_t onset = 0;  // the step at which `induce` runs
  std::function<void(ScenarioNet&)> induce;
  /// Changes the onset step's batch (bad data); later steps get the clean batch again.
  std::function<void(torch::Tensor&)> corrupt;
  torchdbg::HealthOptions options;
};

struct Outcome {
  torchdbg::Diagnosis diagnosis;
  uint64_t alarms = 0;
  std::vector<torchdbg::SemanticEvent> events;
  std::optional<torchdbg::PauseInfo> pause;
  std::optional<torchdbg::Diagnosis> at_failure;  // diagnose(failure_report()) when one was taken
  int64_t steps_run = 0;
};

/// Trains a classifier on fixed random data with attach + HealthMonitor until `steps` or the
/// pause flag; returns the diagnosis at the end.
Outcome run(const Scenario& sc, bool stop_on_pause = false) {
  torch::manual_seed(sc.seed);
  const int64_t in = 16, classes = 4, batch = 64;
  auto net = std::make_shared<ScenarioNet>(in, sc.width, sc.depth, classes, sc.act);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(sc.lr));
  const auto x = torch::randn({batch, in});
  auto y = torch::randint(0, classes, {batch});
  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health(sc.options);
  auto installed = health.install(hooks);
  auto session = torchdbg::attach(*net, hooks);
  Outcome o;
  for (int64_t step = 0; step < sc.steps; ++step) {
    if (step == sc.onset && sc.induce) {
      torch::NoGradGuard g;
      sc.induce(*net);
    }
    hooks.set_step(step);
    opt.zero_grad();
    torch::Tensor batch_x = x;
    if (step == sc.onset && sc.corrupt) {
      batch_x = x.clone();
      sc.corrupt(batch_x);
    }
    auto loss = torch::nn::functional::cross_entropy(net->forward(batch_x), y);
    hooks.set_loss(loss.item<double>());
    loss.backward();
    opt.step();
    o.steps_run = step + 1;
    if (stop_on_pause && hooks.is_paused()) break;
  }
  hooks.set_step(o.steps_run);  // judge what the last step left pending
  o.diagnosis = torchdbg::diagnose(health);
  o.alarms = health.alarm_count();
  o.events = health.events();
  o.pause = hooks.pause_info();
  if (auto r = health.failure_report()) o.at_failure = torchdbg::diagnose(*r);
  return o;
}

std::string explain(const Outcome& o) {
  std::ostringstream s;
  s << o.diagnosis.summary() << "\nhypotheses:";
  for (const auto& h : o.diagnosis.hypotheses)
    s << "\n  " << torchdbg::to_string(h.kind) << " @ " << h.layer << " (" << h.observed
      << ") step " << h.step << " conf " << h.confidence;
  s << "\nevents:";
  std::size_t k = 0;
  for (const auto& e : o.events) {
    if (++k > 40) break;
    s << "\n  " << e.step << " " << e.layer << " " << torchdbg::to_string(e.type) << " " << e.from
      << "->" << e.to << " " << e.metadata.dump();
  }
  return s.str();
}

void check_top(const Outcome& o, FailureKind kind, const std::string& layer, int64_t onset,
               int64_t within = 3) {
  INFO(explain(o));
  REQUIRE(o.diagnosis.top() != nullptr);
  const auto& top = *o.diagnosis.top();
  CHECK(top.kind == kind);
  CHECK(top.layer == layer);
  CHECK(top.step >= onset);
  CHECK(top.step <= onset + within);
  CHECK(top.confidence > 0.0);
  CHECK(top.confidence <= 1.0);
  CHECK_FALSE(top.causal_chain.empty());
  CHECK_FALSE(top.evidence.empty());
}

}  // namespace

TEST_CASE("a healthy run raises no alarm and diagnoses healthy", "[diagnosis]") {
  for (uint64_t seed : {1, 2, 3}) {
    for (Act act : {Act::Relu, Act::Tanh}) {
      Scenario sc;
      sc.seed = seed;
      sc.act = act;
      sc.width = seed == 2 ? 64 : 32;
      sc.depth = 3 + static_cast<int64_t>(seed % 2);
      sc.steps = 60;
      const Outcome o = run(sc);
      INFO("seed " << seed << " act " << static_cast<int>(act) << "\n" << explain(o));
      CHECK(o.alarms == 0);
      CHECK(o.diagnosis.healthy());
      CHECK_FALSE(o.pause.has_value());
    }
  }
}

TEST_CASE("a deep sigmoid MLP is diagnosed with vanishing gradients at the input layer",
          "[diagnosis]") {
  for (uint64_t seed : {1, 7}) {
    for (int64_t width : {32, 64}) {
      Scenario sc;
      sc.seed = seed;
      sc.width = width;
      sc.depth = 10 + static_cast<int64_t>(seed % 3);
      sc.act = Act::Sigmoid;
      sc.lr = 0.1;
      sc.steps = 10;
      INFO("seed " << seed << " width " << width);
      const Outcome o = run(sc);
      check_top(o, FailureKind::VanishingGradient, "fc0", 0);
    }
  }
}

TEST_CASE("a Linear with a large negative bias is diagnosed as dead ReLU units at that layer",
          "[diagnosis]") {
  for (uint64_t seed : {1, 5}) {
    for (int64_t layer : {1, 2}) {
      Scenario sc;
      sc.seed = seed;
      sc.width = seed == 1 ? 32 : 48;
      sc.depth = 4;
      sc.onset = 6;
      sc.steps = 14;
      sc.induce = [layer](ScenarioNet& n) {
        n.fcs[static_cast<std::size_t>(layer)]->bias.fill_(-20.0);
      };
      INFO("seed " << seed << " layer " << layer);
      const Outcome o = run(sc);
      check_top(o, FailureKind::DeadUnits, "fc" + std::to_string(layer), sc.onset);
    }
  }
}

TEST_CASE("a Linear with scaled-up weights before a tanh is diagnosed as saturation at that layer",
          "[diagnosis]") {
  for (uint64_t seed : {2, 3}) {
    for (int64_t layer : {0, 2}) {
      Scenario sc;
      sc.seed = seed;
      sc.width = seed == 2 ? 32 : 64;
      sc.depth = 4;
      sc.act = Act::Tanh;
      sc.onset = 5;
      sc.steps = 12;
      sc.induce = [layer](ScenarioNet& n) {
        n.fcs[static_cast<std::size_t>(layer)]->weight.mul_(25.0);
      };
      INFO("seed " << seed << " layer " << layer);
      const Outcome o = run(sc);
      check_top(o, FailureKind::Saturation, "fc" + std::to_string(layer), sc.onset);
    }
  }
}

TEST_CASE("a Linear with huge weights is diagnosed as the origin of the explosion", "[diagnosis]") {
  for (uint64_t seed : {1, 4}) {
    for (int64_t layer : {1, 3}) {
      Scenario sc;
      sc.seed = seed;
      sc.width = seed == 1 ? 32 : 40;
      sc.depth = 5;
      sc.onset = 8;
      sc.steps = 14;
      sc.lr = 0.01;
      sc.induce = [layer](ScenarioNet& n) {
        n.fcs[static_cast<std::size_t>(layer)]->weight.mul_(300.0);
      };
      INFO("seed " << seed << " layer " << layer);
      const Outcome o = run(sc);
      const auto* top = o.diagnosis.top();
      REQUIRE(top != nullptr);
      INFO(explain(o));
      CHECK((top->kind == FailureKind::ExplodingActivation ||
             top->kind == FailureKind::ExplodingGradient));
      CHECK(top->layer == "fc" + std::to_string(layer));
      CHECK(top->step >= sc.onset);
      CHECK(top->step <= sc.onset + 3);
    }
  }
}

TEST_CASE("a layer computing the log of negative values is the NaN origin", "[diagnosis]") {
  for (uint64_t seed : {1, 9}) {
    for (int64_t layer : {1, 2}) {
      Scenario sc;
      sc.seed = seed;
      sc.width = seed == 1 ? 32 : 24;
      sc.depth = 4;
      sc.onset = 7;
      sc.steps = 12;
      sc.induce = [layer](ScenarioNet& n) {
        n.log_layer = layer;
        n.log_on = true;
      };
      INFO("seed " << seed << " layer " << layer);
      const Outcome o = run(sc);
      check_top(o, FailureKind::NonFiniteOutput, "fc" + std::to_string(layer), sc.onset, 0);
      CHECK(o.diagnosis.top()->observed == "fc" + std::to_string(layer) + "/log");
      // The loss divergence that followed is explained by it.
      bool loss_in_chain = false;
      const torchdbg::Hypothesis* top = o.diagnosis.top();
      REQUIRE(top != nullptr);
      for (const auto& c : top->causal_chain)
        loss_in_chain = loss_in_chain || c.kind == FailureKind::LossDivergence;
      CHECK(loss_in_chain);
    }
  }
}

TEST_CASE("on_failure pause stops training at the step the failure is first detected",
          "[diagnosis]") {
  Scenario sc;
  sc.seed = 3;
  sc.onset = 9;
  sc.steps = 30;
  sc.options = torchdbg::HealthOptions().on_failure(torchdbg::OnFailure::Pause);
  sc.induce = [](ScenarioNet& n) {
    n.log_layer = 1;
    n.log_on = true;
  };
  const Outcome o = run(sc, /*stop_on_pause=*/true);
  INFO(explain(o));
  REQUIRE(o.pause.has_value());
  CHECK(o.pause->step == sc.onset);
  CHECK(o.steps_run == sc.onset + 1);
  CHECK(o.pause->reason.find("fc1/log") != std::string::npos);
  REQUIRE(o.diagnosis.top() != nullptr);
  CHECK(o.diagnosis.top()->layer == "fc1");
  // The diagnosis as it stood at the moment of the failure.
  REQUIRE(o.at_failure.has_value());
  REQUIRE(o.at_failure->top() != nullptr);
  CHECK(o.at_failure->top()->kind == FailureKind::NonFiniteOutput);
  CHECK(o.at_failure->top()->layer == "fc1");
  CHECK(o.at_failure->step == sc.onset);
}

namespace {

torchdbg::Incident incident(FailureKind k, const std::string& layer, int64_t step,
                            torchdbg::Phase phase, int64_t order, double confidence = 0.6) {
  torchdbg::Incident i;
  i.kind = k;
  i.layer = layer;
  i.module = layer.substr(0, layer.find('/'));
  i.step = i.last_step = step;
  i.phase = phase;
  i.order = order;
  i.confidence = confidence;
  i.value = 0.5;
  i.threshold = 0.25;
  return i;
}

}  // namespace

TEST_CASE("causal rules: a dead layer explains vanishing upstream and the plateau after it",
          "[diagnosis]") {
  using P = torchdbg::Phase;
  torchdbg::HealthReport r;
  r.step = 50;
  r.incidents = {incident(FailureKind::VanishingGradient, "fc0", 3, P::Backward, 0),
                 incident(FailureKind::VanishingGradient, "fc1", 3, P::Backward, 2),
                 incident(FailureKind::DeadUnits, "fc2/relu", 3, P::Forward, 4),
                 incident(FailureKind::VanishingGradient, "fc3", 3, P::Backward,
                          6),  // downstream: not explained
                 incident(FailureKind::LossPlateau, "loss", 40, P::Loss, 1 << 30)};
  const auto d = torchdbg::diagnose(r);
  REQUIRE(d.hypotheses.size() == 2);
  CHECK(d.hypotheses[0].kind == FailureKind::DeadUnits);
  CHECK(d.hypotheses[0].layer == "fc2");
  CHECK(d.hypotheses[0].observed == "fc2/relu");
  REQUIRE(d.hypotheses[0].causal_chain.size() == 4);  // itself, fc0, fc1, the plateau
  CHECK(d.hypotheses[0].causal_chain[0].layer == "fc2/relu");
  CHECK(d.hypotheses[1].kind == FailureKind::VanishingGradient);
  CHECK(d.hypotheses[1].layer == "fc3");
  CHECK(d.edges.size() == 3);
  // Explaining consequences raises confidence above the root's own.
  CHECK(d.hypotheses[0].confidence > 0.6);
  CHECK_FALSE(d.healthy());
}

TEST_CASE(
    "causal rules: an explosion explains the NaN, the NaN gradients and the divergence after it",
    "[diagnosis]") {
  using P = torchdbg::Phase;
  torchdbg::HealthReport r;
  r.incidents = {incident(FailureKind::ExplodingActivation, "fc1", 5, P::Forward, 2),
                 incident(FailureKind::NonFiniteOutput, "fc3", 6, P::Forward, 6),
                 incident(FailureKind::LossDivergence, "loss", 6, P::Loss, 1 << 30),
                 incident(FailureKind::NonFiniteGradient, "fc3", 6, P::Backward, 6),
                 incident(FailureKind::ConstantOutput, "fc9", 2, P::Forward, 20)};
  const auto d = torchdbg::diagnose(r);
  REQUIRE(d.hypotheses.size() == 2);
  CHECK(d.hypotheses[0].kind ==
        FailureKind::ExplodingActivation);  // tier 2 before an earlier tier-1 finding
  CHECK(d.hypotheses[0].layer == "fc1");
  CHECK(d.hypotheses[0].causal_chain.size() == 4);
  CHECK(d.hypotheses[1].kind == FailureKind::ConstantOutput);
  // An exploding activation that feeds a saturated tanh is that saturation.
  torchdbg::HealthReport s;
  s.incidents = {incident(FailureKind::ExplodingActivation, "fc2", 4, P::Forward, 4),
                 incident(FailureKind::Saturation, "fc2/tanh", 4, P::Forward, 4)};
  const auto ds = torchdbg::diagnose(s);
  REQUIRE(ds.hypotheses.size() == 1);
  CHECK(ds.hypotheses[0].kind == FailureKind::Saturation);
  CHECK(ds.hypotheses[0].layer == "fc2");
  // Vanishing in many layers with nothing to blame: one depth hypothesis at the input layer.
  torchdbg::HealthReport v;
  for (int k = 0; k < 4; ++k)
    v.incidents.push_back(
        incident(FailureKind::VanishingGradient, "l" + std::to_string(k), 0, P::Backward, 2 * k));
  const auto dv = torchdbg::diagnose(v);
  REQUIRE(dv.hypotheses.size() == 1);
  CHECK(dv.hypotheses[0].layer == "l0");
  CHECK(dv.hypotheses[0].description.find("4 layers") != std::string::npos);
  // Nothing at all: healthy, and the summary says so.
  torchdbg::HealthReport none;
  none.step = 7;
  const auto dn = torchdbg::diagnose(none);
  CHECK(dn.healthy());
  CHECK(dn.top() == nullptr);
  CHECK(dn.summary().find("No failure detected up to step 7") != std::string::npos);
}

TEST_CASE("NaN in the model's input is bad data, not the first layer's failure", "[diagnosis]") {
  for (uint64_t seed : {2, 5, 11}) {
    for (int64_t nan_count : {1, 3}) {
      Scenario sc;
      sc.seed = seed;
      sc.width = 24 + static_cast<int64_t>(seed);
      sc.depth = 3 + static_cast<int64_t>(seed % 3);
      sc.onset = 6 + static_cast<int64_t>(seed % 4);
      sc.steps = sc.onset + 4;
      sc.corrupt = [nan_count, seed](torch::Tensor& x) {
        for (int64_t k = 0; k < nan_count; ++k)
          x[(k * 7 + static_cast<int64_t>(seed)) % x.size(0)][(k * 5) % x.size(1)] = std::nan("");
      };
      INFO("seed " << seed << ", " << nan_count << " NaN");
      const Outcome o = run(sc);
      INFO(explain(o));
      // Ground truth: the batch really held the NaN, and the model was finite before.
      torch::Tensor probe = torch::randn({4, 16});
      sc.corrupt(probe);
      REQUIRE(torch::isnan(probe).sum().item<int64_t>() == std::min<int64_t>(nan_count, 4 * 16));
      REQUIRE(o.diagnosis.top() != nullptr);
      const auto& top = *o.diagnosis.top();
      CHECK(top.kind == FailureKind::BadInput);
      CHECK(top.layer == "input");
      CHECK(top.step == sc.onset);
      CHECK(top.description.find("held " + std::to_string(nan_count) + " NaN value") != std::string::npos);
      CHECK(top.description.find("'fc0'") != std::string::npos);
      // No layer is blamed for the NaN it was fed: every later finding is explained by the data.
      for (const auto& h : o.diagnosis.hypotheses) {
        INFO(h.description);
        CHECK(h.kind != FailureKind::NonFiniteOutput);
        CHECK(h.kind != FailureKind::NonFiniteGradient);
      }
    }
  }
}

TEST_CASE("causal rules: an upstream explosion explains dead units and explosions downstream in the same step; causes rank in forward order",
          "[diagnosis]") {
  using P = torchdbg::Phase;
  torchdbg::HealthReport r;
  auto dead = incident(FailureKind::DeadUnits, "fc2/relu", 1, P::Forward, 5);
  dead.confidence = 0.95;  // more confident than the explosions: order, not confidence, decides
  auto up = incident(FailureKind::ExplodingActivation, "fc0", 1, P::Forward, 0);
  up.confidence = 0.4;
  auto down = incident(FailureKind::ExplodingActivation, "fc2", 1, P::Forward, 4);
  down.confidence = 0.6;
  r.incidents = {dead, down, up};
  const auto d = torchdbg::diagnose(r);
  REQUIRE(d.hypotheses.size() == 1);  // one destructive update: one root
  CHECK(d.hypotheses[0].kind == FailureKind::ExplodingActivation);
  CHECK(d.hypotheses[0].layer == "fc0");
  REQUIRE(d.hypotheses[0].causal_chain.size() == 3);
  CHECK(d.hypotheses[0].causal_chain[1].layer == "fc2");
  CHECK(d.hypotheses[0].causal_chain[2].layer == "fc2/relu");
  // Gradients rank in backward order: the layer nearest the loss first.
  torchdbg::HealthReport g;
  auto near_loss = incident(FailureKind::ExplodingGradient, "fc3", 2, P::Backward, 6);
  near_loss.confidence = 0.3;
  auto near_input = incident(FailureKind::VanishingGradient, "fc0", 2, P::Backward, 0);
  near_input.confidence = 0.9;
  g.incidents = {near_input, near_loss};
  const auto dg = torchdbg::diagnose(g);
  REQUIRE(dg.hypotheses.size() == 2);
  CHECK(dg.hypotheses[0].layer == "fc3");
  // Bad data explains a later non-finite output and the divergence.
  torchdbg::HealthReport b;
  b.incidents = {incident(FailureKind::BadInput, "input", 4, P::Forward, -1),
                 incident(FailureKind::LossDivergence, "loss", 4, P::Loss, 1 << 30),
                 incident(FailureKind::NonFiniteGradient, "fc1", 4, P::Backward, 2),
                 incident(FailureKind::NonFiniteOutput, "fc0", 5, P::Forward, 0)};
  const auto db = torchdbg::diagnose(b);
  REQUIRE(db.hypotheses.size() == 1);
  CHECK(db.hypotheses[0].kind == FailureKind::BadInput);
  CHECK(db.hypotheses[0].causal_chain.size() == 4);
}

TEST_CASE("the causal graph exports as Mermaid, DOT and JSON", "[diagnosis]") {
  using P = torchdbg::Phase;
  torchdbg::HealthReport r;
  r.step = 9;
  r.incidents = {incident(FailureKind::Saturation, "enc.\"fc\"/tanh", 1, P::Forward, 0),
                 incident(FailureKind::VanishingGradient, "enc", 1, P::Backward, 0)};
  torchdbg::SemanticEvent e;
  e.id = 1;
  e.type = torchdbg::EventType::Saturation;
  e.layer = r.incidents[0].layer;
  r.incidents[0].events = {1};
  r.events = {e};
  const auto d = torchdbg::diagnose(r);
  const std::string mm = d.to_mermaid();
  CHECK(mm.rfind("graph LR\n", 0) == 0);
  CHECK(mm.find("n0 --> n1") != std::string::npos);
  CHECK(mm.find("saturation @ enc.'fc'/tanh (step 1)") !=
        std::string::npos);  // quotes cannot break a label
  const std::string dot = d.to_dot();
  CHECK(dot.rfind("digraph torchdbg_diagnosis {", 0) == 0);
  CHECK(dot.find("n0 -> n1;") != std::string::npos);
  CHECK(dot.find("enc.\\\"fc\\\"/tanh") != std::string::npos);  // escaped for DOT
  const auto j = nlohmann::json::parse(d.to_json().dump());
  CHECK(j["hypotheses"].size() == 1);
  CHECK(j["hypotheses"][0]["kind"] == "saturation");
  CHECK(j["hypotheses"][0]["evidence"].size() == 1);
  CHECK(j["edges"][0] == nlohmann::json::array({0, 1}));
  CHECK(j["summary"].get<std::string>().find("saturated") != std::string::npos);
}

TEST_CASE("causal rules: a constant output blocks the gradient upstream and makes units downstream dead",
          "[diagnosis]") {
  using P = torchdbg::Phase;
  torchdbg::HealthReport r;
  // fc1's weight is zero: its output is constant, fc0's gradient vanishes, and the units
  // after fc2 see one input and die; all in the step of the onset.
  r.incidents = {incident(FailureKind::ConstantOutput, "fc1", 7, P::Forward, 2),
                 incident(FailureKind::DeadUnits, "fc2/relu", 7, P::Forward, 4),
                 incident(FailureKind::VanishingGradient, "fc0", 7, P::Backward, 0)};
  const auto d = torchdbg::diagnose(r);
  REQUIRE(d.hypotheses.size() == 1);
  CHECK(d.hypotheses[0].kind == FailureKind::ConstantOutput);
  CHECK(d.hypotheses[0].layer == "fc1");
  CHECK(d.hypotheses[0].causal_chain.size() == 3);
  // A constant output downstream of the vanishing layer only: fc3's vanishing gradient is
  // not explained by fc1 (fc3 is downstream of it).
  r.incidents.push_back(incident(FailureKind::VanishingGradient, "fc3", 7, P::Backward, 6));
  const auto d2 = torchdbg::diagnose(r);
  REQUIRE(d2.hypotheses.size() == 2);
  CHECK(d2.hypotheses[1].kind == FailureKind::VanishingGradient);
  CHECK(d2.hypotheses[1].layer == "fc3");
}

TEST_CASE("the exploding-gradient origin uses the amplification over its usual value when known",
          "[diagnosis]") {
  using P = torchdbg::Phase;
  torchdbg::HealthReport r;
  // A uniformly scaled backward pass: bn0 amplifies 30x, which is what it always does (its
  // usual ratio); fc is where backward starts. Without the usual values, bn0 would be taken.
  auto fc = incident(FailureKind::ExplodingGradient, "fc", 4, P::Backward, 6);
  auto bn = incident(FailureKind::ExplodingGradient, "bn0", 4, P::Backward, 2);
  auto conv = incident(FailureKind::ExplodingGradient, "conv0", 4, P::Backward, 0);
  bn.details["amplification"] = 30.0;
  conv.details["amplification"] = 1.5;
  r.incidents = {fc, bn, conv};
  CHECK(torchdbg::diagnose(r).top()->layer == "bn0");
  bn.details["amplification_vs_usual"] = 1.02;
  conv.details["amplification_vs_usual"] = 0.98;
  fc.details["amplification_vs_usual"] = 1.0;
  r.incidents = {fc, bn, conv};
  const auto d = torchdbg::diagnose(r);
  CHECK(d.top()->layer == "fc");
  CHECK(d.hypotheses.size() == 1);
  // A real jump over the usual ratio is still found.
  bn.details["amplification_vs_usual"] = 40.0;
  r.incidents = {fc, bn, conv};
  CHECK(torchdbg::diagnose(r).top()->layer == "bn0");
}

TEST_CASE("a fresh explosion outranks a saturation that began earlier; a persisting finding is listed once with its span",
          "[diagnosis]") {
  using P = torchdbg::Phase;
  // dcgan: the generator's output tanh saturates from step 8 (by design, not silenced), then
  // the discriminator explodes at step 20 and its sigmoid saturates on and off 39 times.
  torchdbg::HealthReport r;
  auto tanh_sat = incident(FailureKind::Saturation, "g.conv4/tanh", 8, P::Forward, 9, 0.9);
  tanh_sat.last_step = 60;
  r.incidents.push_back(tanh_sat);
  auto explosion = incident(FailureKind::ExplodingActivation, "d.conv2", 20, P::Forward, 2, 0.5);
  explosion.last_step = 59;  // the discriminator stays broken
  r.incidents.push_back(explosion);
  r.incidents.push_back(incident(FailureKind::LossSpike, "loss", 20, P::Loss, 1 << 30));
  for (int64_t s = 21; s < 60; ++s) {
    auto sat = incident(FailureKind::Saturation, "d.conv3/sigmoid", s, P::Forward, 3);
    r.incidents.push_back(sat);
  }
  const auto d = torchdbg::diagnose(r);
  REQUIRE(d.hypotheses.size() == 2);
  const auto& top = d.hypotheses[0];
  CHECK(top.kind == FailureKind::ExplodingActivation);
  CHECK(top.layer == "d.conv2");
  CHECK(top.acute());
  // root, the loss spike, the sigmoid's saturation once (steps 21 to 59, 39 times)
  REQUIRE(top.causal_chain.size() == 3);
  CHECK(top.causal_chain[0].layer == "d.conv2");
  CHECK(top.causal_chain[1].layer == "loss");
  const auto& sat = top.causal_chain[2];
  CHECK(sat.layer == "d.conv3/sigmoid");
  CHECK(sat.step == 21);
  CHECK(sat.last_step == 59);
  CHECK(sat.occurrences == 39);
  CHECK(d.summary().find("saturation at 'd.conv3/sigmoid' (steps 21 to 59, 39 times)") != std::string::npos);
  CHECK(d.to_json()["hypotheses"][0]["causal_chain"][2]["occurrences"] == 39);
  CHECK(d.hypotheses[1].layer == "g.conv4");
  CHECK_FALSE(d.hypotheses[1].acute());
  CHECK(d.nodes.size() == r.incidents.size());  // the graph keeps every incident
  // Without the explosion the saturation is the top finding, as before.
  torchdbg::HealthReport alone;
  alone.incidents = {tanh_sat};
  CHECK(torchdbg::diagnose(alone).top()->layer == "g.conv4");
  // The same findings in any order give the same diagnosis.
  for (int k = 0; k < 20; ++k) {
    torchdbg::HealthReport shuffled = r;
    std::shuffle(shuffled.incidents.begin(), shuffled.incidents.end(), std::mt19937(static_cast<unsigned>(k)));
    const auto ds = torchdbg::diagnose(shuffled);
    REQUIRE(ds.hypotheses.size() == d.hypotheses.size());
    for (std::size_t h = 0; h < ds.hypotheses.size(); ++h) {
      CHECK(ds.hypotheses[h].layer == d.hypotheses[h].layer);
      CHECK(ds.hypotheses[h].step == d.hypotheses[h].step);
      CHECK(ds.hypotheses[h].causal_chain.size() == d.hypotheses[h].causal_chain.size());
    }
  }
}

TEST_CASE("diagnosis: an explosion that ended long before explains nothing later; the graph has no cycle", "[diagnosis]") {
  using P = torchdbg::Phase;
  torchdbg::HealthReport r;
  r.incidents = {incident(FailureKind::ExplodingActivation, "fc1", 0, P::Forward, 0),
                 incident(FailureKind::NonFiniteOutput, "fc3", 30, P::Forward, 2)};
  const auto d = torchdbg::diagnose(r);
  REQUIRE(d.hypotheses.size() == 2);
  CHECK(d.hypotheses[0].layer == "fc1");  // the earlier of two acute roots
  CHECK(d.hypotheses[1].layer == "fc3");
  CHECK(d.edges.empty());
  // An explosion with its own tanh's saturation a step later: one link, not two.
  torchdbg::HealthReport c;
  auto sat = incident(FailureKind::Saturation, "fc1/tanh", 6, P::Forward, 3);
  sat.last_step = 9;
  c.incidents = {incident(FailureKind::ExplodingActivation, "fc1", 5, P::Forward, 2), sat,
                 incident(FailureKind::LossSpike, "loss", 7, P::Loss, 1 << 30)};
  const auto dc = torchdbg::diagnose(c);
  CHECK(dc.edges.size() == 2);
  for (const auto& [a, b] : dc.edges)
    for (const auto& [a2, b2] : dc.edges) CHECK_FALSE((a == b2 && b == a2));
  REQUIRE(dc.hypotheses.size() == 1);
  CHECK(dc.hypotheses[0].causal_chain.size() == 3);
  CHECK(dc.hypotheses[0].causal_chain[0].kind == dc.hypotheses[0].kind);
  CHECK(dc.hypotheses[0].causal_chain[0].step == dc.hypotheses[0].step);
}

TEST_CASE("a layer that saturates in a step's forward explains that step's exploding gradients; a loss failure the latest acute one",
          "[diagnosis]") {
  using P = torchdbg::Phase;
  // A discriminator broken by its update: its sigmoid saturates at step 41 (after it had
  // flapped at step 20), the generator's gradients through it explode, the loss spikes.
  torchdbg::HealthReport r;
  r.incidents = {incident(FailureKind::Saturation, "d.fc3/sigmoid", 20, P::Forward, 3),
                 incident(FailureKind::Saturation, "d.fc3/sigmoid", 41, P::Forward, 3),
                 incident(FailureKind::LossSpike, "loss", 41, P::Loss, 1 << 30),
                 incident(FailureKind::ExplodingGradient, "g.fc1", 41, P::Backward, 4),
                 incident(FailureKind::ExplodingGradient, "g.fc3", 41, P::Backward, 6)};
  r.incidents[4].details["amplification"] = 50.0;
  const auto d = torchdbg::diagnose(r);
  REQUIRE(d.top() != nullptr);
  CHECK(d.top()->layer == "d.fc3");
  CHECK(d.top()->step == 41);  // not the flap of step 20: it explains none of this
  CHECK(d.top()->acute());
  CHECK(d.top()->causal_chain.size() == 4);  // the loss spike and the two gradients
  // The loss spike goes to the latest acute layer failure before it, not the first failure.
  torchdbg::HealthReport l;
  l.incidents = {incident(FailureKind::DeadUnits, "a/relu", 2, P::Forward, 0),
                 incident(FailureKind::ExplodingActivation, "b", 30, P::Forward, 1),
                 incident(FailureKind::LossSpike, "loss", 30, P::Loss, 1 << 30)};
  const auto dl = torchdbg::diagnose(l);
  REQUIRE(dl.hypotheses.size() == 2);
  CHECK(dl.hypotheses[0].layer == "b");
  REQUIRE(dl.hypotheses[0].causal_chain.size() == 2);
  CHECK(dl.hypotheses[0].causal_chain[1].layer == "loss");
}

TEST_CASE("causal rules: a normalization's collapsing weight explains its constant output, the gradients fading "
          "upstream, dead units and gains downstream; an explosion upstream explains stale running statistics",
          "[diagnosis]") {
  using P = torchdbg::Phase;
  torchdbg::HealthReport r;
  auto collapse = incident(FailureKind::NormWeightCollapse, "bn", 20, P::Forward, 3);
  collapse.last_step = 40;
  collapse.value = 0.06;
  collapse.details = {{"weight_rms", 0.06}, {"peak_weight_rms", 1.0}};
  auto constant = incident(FailureKind::ConstantOutput, "bn", 35, P::Forward, 3);
  constant.last_step = 40;
  auto dead = incident(FailureKind::DeadUnits, "bn/relu", 24, P::Forward, 4);
  dead.last_step = 40;
  // its own weight's gradient, and a loss spike in the step it began
  r.incidents = {collapse, dead, constant, incident(FailureKind::VanishingGradient, "fc0", 33, P::Backward, 1),
                 incident(FailureKind::ExplodingActivation, "head", 30, P::Forward, 6),
                 incident(FailureKind::ExplodingGradient, "bn", 23, P::Backward, 3),
                 incident(FailureKind::LossSpike, "loss", 20, P::Loss, 1 << 30)};
  const auto d = torchdbg::diagnose(r);
  REQUIRE(d.hypotheses.size() == 1);
  CHECK(d.hypotheses[0].kind == FailureKind::NormWeightCollapse);
  CHECK(d.hypotheses[0].layer == "bn");
  CHECK(d.hypotheses[0].step == 20);
  CHECK(d.hypotheses[0].causal_chain.size() == 7);
  CHECK(d.hypotheses[0].description.find("6% of its peak") != std::string::npos);
  // Without the collapse, the constant output is a root of its own.
  torchdbg::HealthReport alone;
  alone.incidents = {constant};
  REQUIRE(torchdbg::diagnose(alone).hypotheses.size() == 1);
  CHECK(torchdbg::diagnose(alone).hypotheses[0].kind == FailureKind::ConstantOutput);
  // A BatchNorm downstream of a layer that exploded in the same step lags by design; stale
  // running statistics on their own are a root, ranked under a failure that breaks training.
  torchdbg::HealthReport s;
  s.incidents = {incident(FailureKind::ExplodingActivation, "conv0", 12, P::Forward, 1),
                 incident(FailureKind::NormStatistics, "bn0", 12, P::Forward, 2),
                 incident(FailureKind::NormStatistics, "bn9", 3, P::Forward, 9)};
  const auto ds = torchdbg::diagnose(s);
  REQUIRE(ds.hypotheses.size() == 2);
  CHECK(ds.hypotheses[0].kind == FailureKind::ExplodingActivation);
  CHECK(ds.hypotheses[0].causal_chain.size() == 2);
  CHECK(ds.hypotheses[1].kind == FailureKind::NormStatistics);
  CHECK(ds.hypotheses[1].layer == "bn9");
  CHECK(ds.hypotheses[1].description.find("eval mode") != std::string::npos);
}

TEST_CASE("a diagnosis and its hypotheses print one line, best first", "[diagnosis]") {
  Scenario sc;
  sc.seed = 1;
  sc.width = 32;
  sc.depth = 5;
  sc.onset = 8;
  sc.steps = 14;
  sc.lr = 0.01;
  sc.induce = [](ScenarioNet& n) { n.fcs[3]->weight.mul_(300.0); };
  const Outcome o = run(sc);
  const auto* top = o.diagnosis.top();
  REQUIRE(top != nullptr);
  const std::string text = fmt::format("{}", o.diagnosis);
  std::ostringstream os;
  os << o.diagnosis;
  CHECK(os.str() == text);
  INFO(text);
  CHECK(text.rfind(fmt::format("Diagnosis(step {}, {} layers, ", o.diagnosis.step, o.diagnosis.layers_observed), 0) == 0);
  CHECK(text.find(fmt::format("{} at \"{}\" from step {}", torchdbg::to_string(top->kind), top->layer, top->step)) != std::string::npos);
  CHECK(text.find('\n') == std::string::npos);
  CHECK(fmt::format("{}", *top).rfind(std::string("Hypothesis(") + torchdbg::to_string(top->kind) + " at \"" + top->layer + "\"", 0) == 0);

  torchdbg::Diagnosis d;
  d.step = 25;
  d.layers_observed = 1;
  CHECK(fmt::format("{}", d) == "Diagnosis(step 25, 1 layer, healthy)");
  torchdbg::Hypothesis plateau;
  plateau.kind = FailureKind::LossPlateau;
  plateau.layer = "loss";
  d.hypotheses.push_back(plateau);
  CHECK(fmt::format("{}", d) == "Diagnosis(step 25, 1 layer, healthy, 1 note)");
  d.hypotheses.clear();
  for (int i = 0; i < 5; ++i) {
    torchdbg::Hypothesis h;
    h.kind = i == 0 ? FailureKind::ExplodingGradient : FailureKind::DeadUnits;
    h.layer = "fc" + std::to_string(i);
    h.observed = i == 1 ? "fc1/relu" : h.layer;
    h.step = 20 + i;
    h.confidence = 0.9 - 0.1 * i;
    h.causal_chain.resize(i == 0 ? 4 : 1);
    d.hypotheses.push_back(h);
  }
  d.layers_observed = 9;
  CHECK(fmt::format("{}", d) ==
        "Diagnosis(step 25, 9 layers, 5 hypotheses: exploding_gradient at \"fc0\" from step 20 (confidence 0.9); "
        "dead_units at \"fc1\" from step 21 (confidence 0.8); dead_units at \"fc2\" from step 22 (confidence 0.7); "
        "and 2 more)");
  CHECK(fmt::format("{}", d.hypotheses[0]) == "Hypothesis(exploding_gradient at \"fc0\", step 20, confidence 0.9, explains 3 findings)");
  d.hypotheses[1].rank = 2;
  CHECK(fmt::format("{}", d.hypotheses[1]) == "Hypothesis(dead_units at \"fc1\" (observed \"fc1/relu\"), step 21, confidence 0.8, rank 2)");
}

TEST_CASE("outputs judged every few steps: a finding after unjudged steps is placed where the gradients or the loss "
          "broke, unless an update there could have caused it",
          "[diagnosis]") {
  using P = torchdbg::Phase;
  auto unobserved = [](torchdbg::Incident i, int64_t from) {
    i.details["unobserved_from"] = from;
    return i;
  };
  const auto dead = unobserved(incident(FailureKind::DeadUnits, "fc2/relu", 12, P::Forward, 4), 11);
  const auto vanish0 = incident(FailureKind::VanishingGradient, "fc0", 11, P::Backward, 0);
  const auto vanish1 = incident(FailureKind::VanishingGradient, "fc1", 11, P::Backward, 2);
  {  // dead units behind the vanishing gradients of step 11: the root, placed in step 11
    torchdbg::HealthReport r;
    r.step = 14;
    r.incidents = {vanish0, vanish1, dead};
    const auto d = torchdbg::diagnose(r);
    REQUIRE(d.top() != nullptr);
    CHECK(d.top()->kind == FailureKind::DeadUnits);
    CHECK(d.top()->layer == "fc2");
    CHECK(d.top()->step == 11);
    CHECK(d.top()->causal_chain.size() == 3);
    CHECK_THAT(d.top()->description, Catch::Contains("Seen at step 12"));
    // The same report without the mark (outputs judged every step): seen at 12, a root of its own.
    r.incidents[2].details.erase("unobserved_from");
    const auto plain = torchdbg::diagnose(r);
    REQUIRE(plain.top() != nullptr);
    CHECK(plain.top()->kind == FailureKind::VanishingGradient);
    CHECK(plain.top()->step == 11);
  }
  {  // an exploding gradient in step 11 could have made them dead through the update: not placed
    torchdbg::HealthReport r;
    r.step = 14;
    r.incidents = {incident(FailureKind::ExplodingGradient, "fc3", 11, P::Backward, 6), dead};
    const auto d = torchdbg::diagnose(r);
    REQUIRE(d.top() != nullptr);
    CHECK(d.top()->kind == FailureKind::ExplodingGradient);
    CHECK(d.top()->step == 11);
    for (const auto& h : d.hypotheses) CHECK(h.description.find("Seen at step") == std::string::npos);
  }
  const auto exploding = unobserved(incident(FailureKind::ExplodingActivation, "fc1", 12, P::Forward, 2), 10);
  auto spike = incident(FailureKind::LossSpike, "loss", 11, P::Loss, 1 << 30);
  const auto grads = incident(FailureKind::ExplodingGradient, "fc1", 11, P::Backward, 2);
  for (const int64_t spike_until : {11, 12}) {
    // A loss spike's update wrecks the weights whether or not the loss stays high after it
    // (a loss scaled by mistake): the explosion seen at 12 is not placed before it.
    spike.last_step = spike_until;
    torchdbg::HealthReport r;
    r.step = 14;
    r.incidents = {spike, grads, exploding};
    const auto d = torchdbg::diagnose(r);
    REQUIRE(d.top() != nullptr);
    CHECK(d.top()->kind == FailureKind::LossSpike);
    CHECK(d.top()->step == 11);
    for (const auto& h : d.hypotheses) CHECK(h.description.find("Seen at step") == std::string::npos);
  }
  {  // the input stays where seen: a batch is that batch, whatever broke before it
    auto scale = unobserved(incident(FailureKind::BadInput, "input", 12, P::Forward, -1), 10);
    scale.details["ratio"] = 1e4;
    scale.details["rms"] = 1e4;
    scale.details["baseline_rms"] = 1.0;
    torchdbg::HealthReport r;
    r.step = 14;
    r.incidents = {vanish0, scale};
    const auto d = torchdbg::diagnose(r);
    for (const auto& h : d.hypotheses) {
      CHECK(h.description.find("Seen at step") == std::string::npos);
      if (h.kind == FailureKind::BadInput) CHECK(h.step == 12);
    }
  }
  {  // a plateau (a long window's statistic) or a user rule's finding is no break to place it at
    auto plateau = incident(FailureKind::LossPlateau, "loss", 11, P::Loss, 1 << 30);
    auto custom = incident(FailureKind::Custom, "loss", 11, P::Loss, 1 << 30);
    for (const auto& other : {plateau, custom}) {
      torchdbg::HealthReport r;
      r.step = 14;
      r.incidents = {other, dead};
      const auto d = torchdbg::diagnose(r);
      for (const auto& h : d.hypotheses) {
        CHECK(h.description.find("Seen at step") == std::string::npos);
        if (h.kind == FailureKind::DeadUnits) CHECK(h.step == 12);
      }
    }
  }
  {  // a non-finite output is not placed: after a non-finite update every layer is one
    torchdbg::HealthReport r;
    r.step = 14;
    r.incidents = {incident(FailureKind::VanishingGradient, "fc3", 11, P::Backward, 6),
                   unobserved(incident(FailureKind::NonFiniteOutput, "fc0", 12, P::Forward, 0), 11)};
    const auto d = torchdbg::diagnose(r);
    REQUIRE(d.top() != nullptr);
    CHECK(d.top()->kind == FailureKind::NonFiniteOutput);  // the worse failure ranks first
    CHECK(d.top()->step == 12);
    CHECK(d.top()->description.find("Seen at step") == std::string::npos);
  }
}

TEST_CASE("property: with activation_interval, dead units induced between judged steps are diagnosed at their layer",
          "[diagnosis]") {
  std::mt19937_64 rng(20261208);
  for (int trial = 0; trial < 8; ++trial) {
    const int64_t every = 3 + static_cast<int64_t>(rng() % 6);
    int64_t onset = 20 + static_cast<int64_t>(rng() % 20);
    if (onset % every == 0) ++onset;  // outputs not judged on the onset's step
    const int64_t layer = 1 + static_cast<int64_t>(rng() % 2);
    Scenario sc;
    sc.seed = 300 + static_cast<uint64_t>(trial);
    sc.width = 24 + static_cast<int64_t>(rng() % 24);
    sc.depth = 4;
    sc.onset = onset;
    sc.steps = onset + 4;
    sc.options = torchdbg::HealthOptions().activation_interval(every);
    sc.induce = [layer](ScenarioNet& n) { n.fcs[static_cast<std::size_t>(layer)]->bias.fill_(-50.0); };
    INFO("trial " << trial << ": activation_interval " << every << ", onset " << onset << ", layer fc" << layer
                  << ", width " << sc.width);
    const Outcome o = run(sc);
    check_top(o, FailureKind::DeadUnits, "fc" + std::to_string(layer), sc.onset, 2);
  }
}

TEST_CASE("property: a state that explains only loss spikes does not outrank a later explosion",
          "[diagnosis]") {
  // A GAN's discriminator sigmoid saturating while it wins (the discriminator's loss spiking
  // later as the generator catches up), then its learning rate x1000: the explosion that
  // paused the run comes first. A state that explains a NaN loss still does.
  using P = torchdbg::Phase;
  std::mt19937 gen(23);
  for (int trial = 0; trial < 60; ++trial) {
    const bool divergence = trial % 3 == 2;
    const auto state = trial % 2 == 0 ? FailureKind::Saturation : FailureKind::DeadUnits;
    const int64_t onset = 5 + static_cast<int64_t>(gen() % 400), spike_at = onset + 1 + static_cast<int64_t>(gen() % 50),
                  boom = spike_at + 3 + static_cast<int64_t>(gen() % 20);  // beyond the spike's update
    const int64_t state_order = 2 + static_cast<int64_t>(gen() % 6), boom_order = static_cast<int64_t>(gen() % 8);
    INFO("trial " << trial << " state " << torchdbg::to_string(state) << " at " << onset << ", "
                  << (divergence ? "divergence" : "spike") << " at " << spike_at << ", explosion at " << boom);
    torchdbg::HealthReport r;
    r.step = boom;
    auto st = incident(state, "d.out" + std::to_string(state_order) + (state == FailureKind::Saturation ? "/sigmoid" : "/relu"),
                       onset, P::Forward, state_order);
    st.last_step = boom;
    st.persisted = boom - onset + 1;
    r.incidents = {st,
                   incident(divergence ? FailureKind::LossDivergence : FailureKind::LossSpike, "loss", spike_at, P::Loss, 1 << 30),
                   incident(FailureKind::ExplodingActivation, "d.conv" + std::to_string(boom_order), boom, P::Forward,
                            boom_order, 0.45)};
    const auto d = torchdbg::diagnose(r);
    REQUIRE(d.top() != nullptr);
    CHECK(d.top()->kind == (divergence ? state : FailureKind::ExplodingActivation));
  }
}
