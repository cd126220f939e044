// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <torchdbg/hook_manager.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "helpers.hpp"

using torchdbg::AlertSeverity;
using torchdbg::HookAction;
using torchdbg::HookCondition;
using torchdbg::HookConfig;
using torchdbg::HookManager;
using torchdbg::HookTrigger;

namespace {

HookConfig callback_hook(const std::string& name, const std::string& cb) {
  return HookConfig().name(name).trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback(cb)});
}
}  // namespace

TEST_CASE("inspection hooks match layers by unanchored regex and record real statistics", "[manager]") {
  HookManager hooks;
  const auto id = hooks.create_tensor_inspection_hook({"fc"});
  auto y = torch::randn({8, 16});
  auto r = hooks.execute_hooks("encoder.fc1", y, true);
  REQUIRE(r.size() == 1);
  CHECK(r[0].first == id);
  CHECK(r[0].second.ok());
  CHECK(hooks.execute_hooks("conv1", y, true).empty());  // not matched: not in the results
  const auto rec = hooks.inspector.latest("encoder.fc1");
  REQUIRE(rec);
  const auto ry = torchdbg_test::reference(y);
  CHECK_SCALED(rec->stats.mean, ry.mean, ry.scale(), 1e-6);
  REQUIRE(hooks.visualizer.latest("encoder.fc1"));
  CHECK(hooks.visualizer.latest("encoder.fc1")->numel == 128);
  // Backward calls are not due for an every-forward hook.
  auto b = hooks.execute_hooks("encoder.fc1", y, false);
  REQUIRE(b.size() == 1);
  CHECK(b[0].second.is_skipped());
  CHECK(hooks.get_hook_stats(id)->skipped == 1);
}

TEST_CASE("hooks run in registration order", "[manager]") {
  HookManager hooks;
  std::vector<std::string> order;
  for (const char* n : {"c", "a", "b"}) {
    hooks.register_callback(n, [&order, n](const torchdbg::HookContext&) { order.emplace_back(n); });
    hooks.register_hook(callback_hook(n, n));
  }
  for (int i = 0; i < 3; ++i) hooks.execute_hooks("x", torch::ones({1}), true);
  CHECK(order == std::vector<std::string>{"c", "a", "b", "c", "a", "b", "c", "a", "b"});
  const auto all = hooks.get_all_hooks();
  REQUIRE(all.size() == 3);
  CHECK(all[0].second.name() == "c");
  CHECK(all[2].second.name() == "b");
}

TEST_CASE("property: hooks run by priority, then registration, a prepended hook first; removal keeps the order", "[manager]") {
  // Reference: one deque per priority (prepend pushes to the front), read from the highest.
  std::mt19937 rng(29);
  for (int trial = 0; trial < 150; ++trial) {
    HookManager hooks;
    std::vector<std::string> order;
    std::map<int, std::deque<std::string>, std::greater<int>> reference;
    std::vector<std::pair<torchdbg::HookId, std::string>> live;
    const int ops = 1 + static_cast<int>(rng() % 14);
    for (int op = 0; op < ops; ++op) {
      if (!live.empty() && rng() % 4 == 0) {  // remove one
        const std::size_t k = rng() % live.size();
        REQUIRE(hooks.remove_hook(live[k].first));
        for (auto& [prio, names] : reference) names.erase(std::remove(names.begin(), names.end(), live[k].second), names.end());
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
        continue;
      }
      const std::string name = "h" + std::to_string(op);
      const int priority = static_cast<int>(rng() % 5) - 2;
      const bool prepend = rng() % 3 == 0;
      hooks.register_callback(name, [&order, name](const torchdbg::HookContext&) { order.push_back(name); });
      live.emplace_back(hooks.register_hook(callback_hook(name, name).priority(priority).prepend(prepend)), name);
      if (prepend) {
        reference[priority].push_front(name);
      } else {
        reference[priority].push_back(name);
      }
    }
    std::vector<std::string> expected;
    for (const auto& [prio, names] : reference) expected.insert(expected.end(), names.begin(), names.end());
    order.clear();
    const auto results = hooks.execute_hooks("layer", torch::ones({2}), true);
    INFO("trial " << trial);
    CHECK(order == expected);
    REQUIRE(results.size() == expected.size());
    std::vector<std::string> listed;
    for (const auto& [id, config] : hooks.get_all_hooks()) listed.push_back(config.name());
    CHECK(listed == expected);
    for (std::size_t i = 0; i < results.size(); ++i) CHECK(hooks.get_hook(results[i].first)->name() == expected[i]);
  }
}

TEST_CASE("a hook given a higher priority acts before the hooks that read its effect", "[manager]") {
  HookManager hooks;
  std::vector<bool> paused_seen;
  hooks.register_callback("reader", [&](const torchdbg::HookContext&) { paused_seen.push_back(hooks.is_paused()); });
  hooks.register_hook(callback_hook("reader", "reader"));
  const auto pauser = hooks.register_hook(HookConfig().name("pauser").actions({HookAction::pause_training("stop")}));
  hooks.execute_hooks("x", torch::ones({1}), true);  // registration order: the reader runs first
  REQUIRE(paused_seen == std::vector<bool>{false});
  hooks.resume_training();
  hooks.remove_hook(pauser);
  hooks.register_hook(HookConfig().name("pauser").priority(1).actions({HookAction::pause_training("stop")}));
  hooks.execute_hooks("x", torch::ones({1}), true);
  CHECK(paused_seen == std::vector<bool>{false, true});
  hooks.resume_training();
  hooks.register_hook(callback_hook("reader", "reader").prepend(true).priority(1));  // before the pauser
  paused_seen.clear();
  hooks.execute_hooks("x", torch::ones({1}), true);
  CHECK(paused_seen == std::vector<bool>{false, true});
}

TEST_CASE("an invalid regex is rejected at registration with the pattern named", "[manager]") {
  HookManager hooks;
  CHECK_THROWS_WITH(hooks.register_hook(HookConfig().name("bad").layer_patterns({"fc(["})), Catch::Contains("fc(["));
  CHECK_THROWS_WITH(hooks.register_hook(HookConfig().max_executions(0)), Catch::Contains("max_executions 0"));
  // Back-references, look-around and huge repetition counts are refused by name.
  CHECK_THROWS_WITH(hooks.register_hook(HookConfig().layer_patterns({"(fc)\\1"})), Catch::Contains("(fc)\\1"));
  CHECK_THROWS_WITH(hooks.register_hook(HookConfig().layer_patterns({"a{1,2000}"})), Catch::Contains("a{1,2000}"));
  CHECK_THROWS_WITH(hooks.register_hook(HookConfig().layer_patterns({"fc(?=1)"})), Catch::Contains("fc(?=1)"));
  CHECK_NOTHROW(hooks.register_hook(HookConfig().layer_patterns({"fc\\.[0-9]{1,3}$"})));
  hooks.clear_hooks();
  CHECK(hooks.hook_count() == 0);  // nothing half-registered
  hooks.register_hook(HookConfig().layer_patterns({"^fc1$"}).actions({HookAction::inspect_tensor()}));
  CHECK(hooks.execute_hooks("fc1", torch::ones({1}), true).size() == 1);
  CHECK(hooks.execute_hooks("fc10", torch::ones({1}), true).empty());
}

TEST_CASE("max_executions and once stop a hook, later calls are skipped", "[manager]") {
  HookManager hooks;
  int calls = 0;
  hooks.register_callback("count", [&](const torchdbg::HookContext&) { ++calls; });
  const auto twice = hooks.register_hook(callback_hook("twice", "count").max_executions(2));
  const auto once = hooks.register_hook(callback_hook("once", "count").trigger(HookTrigger::once()));
  for (int64_t s = 0; s < 5; ++s) {
    hooks.set_step(s);
    hooks.execute_hooks("x", torch::ones({1}), true);
  }
  CHECK(calls == 3);
  const auto st = *hooks.get_hook_stats(twice);
  CHECK(st.executions == 2);
  CHECK(st.skipped == 3);
  CHECK(st.last_step == 1);
  CHECK(hooks.get_hook_stats(once)->executions == 1);
  CHECK(hooks.get_hook_stats(once)->last_step == 0);
  auto r = hooks.execute_hooks("x", torch::ones({1}), true);
  CHECK(r[0].second.message().find("max_executions (2)") != std::string::npos);
}

TEST_CASE("every_n_steps hooks execute on multiples of n only", "[manager]") {
  HookManager hooks;
  std::vector<int64_t> seen;
  hooks.register_callback("s", [&](const torchdbg::HookContext& c) { seen.push_back(c.step()); });
  hooks.register_hook(callback_hook("n", "s").trigger(HookTrigger::every_n_steps(4)));
  for (int64_t s = 0; s < 13; ++s) {
    hooks.set_step(s);
    hooks.execute_hooks("x", torch::ones({1}), s % 2 == 0);
  }
  CHECK(seen == std::vector<int64_t>{0, 4, 8, 12});
}

TEST_CASE("enabling, disabling, removing and clearing hooks", "[manager]") {
  HookManager hooks;
  const auto a = hooks.create_tensor_inspection_hook({});
  const auto b = hooks.create_gradient_tracking_hook({});
  hooks.set_hook_enabled(a, false);
  CHECK_FALSE(hooks.get_hook(a)->enabled());
  CHECK(hooks.execute_hooks("x", torch::ones({2}), true).size() == 1);  // only b, skipped
  hooks.set_hook_enabled(a, true);
  CHECK(hooks.execute_hooks("x", torch::ones({2}), true).size() == 2);
  hooks.set_enabled(false);
  CHECK(hooks.execute_hooks("x", torch::ones({2}), true).empty());
  hooks.set_enabled(true);
  const auto unknown = torchdbg::HookId::generate();
  CHECK_THROWS_WITH(hooks.set_hook_enabled(unknown, true), Catch::Contains(unknown.to_string()));
  CHECK_FALSE(hooks.remove_hook(unknown));
  const auto removed = hooks.remove_hook(a);
  REQUIRE(removed);
  CHECK(removed->name() == "tensor_inspection");
  CHECK_FALSE(hooks.get_hook(a));
  CHECK_FALSE(hooks.get_hook_stats(a));
  CHECK(hooks.get_hook(b));
  hooks.clear_hooks();
  CHECK(hooks.get_all_hooks().empty());
  CHECK(hooks.get_all_stats().empty());
}

TEST_CASE("a throwing or missing callback becomes a counted error result", "[manager]") {
  HookManager hooks;
  std::vector<torchdbg::HookError> errors;
  hooks.set_error_handler([&](const torchdbg::HookError& e) { errors.push_back(e); });
  hooks.register_callback("throws", [](const torchdbg::HookContext&) { throw std::runtime_error("kaboom"); });
  hooks.register_callback("torch", [](const torchdbg::HookContext&) { (void)torch::ones({2}).view({3}); });
  const auto t = hooks.register_hook(callback_hook("t", "throws"));
  const auto m = hooks.register_hook(callback_hook("m", "missing"));
  const auto c = hooks.register_hook(callback_hook("c", "torch"));
  hooks.set_step(9);
  std::vector<std::pair<torchdbg::HookId, torchdbg::HookResult>> r;
  REQUIRE_NOTHROW(r = hooks.execute_hooks("layer", torch::ones({1}), true));
  REQUIRE(r.size() == 3);
  CHECK(r[0].second.is_error());
  CHECK(r[0].second.message() == "kaboom");
  CHECK(r[1].second.message().find("'missing'") != std::string::npos);
  CHECK(r[2].second.is_error());
  CHECK(r[2].second.message().find("shape '[3]' is invalid") != std::string::npos);
  CHECK(r[2].second.message().find("Exception raised from") == std::string::npos);  // no backtrace
  CHECK(hooks.get_hook_stats(t)->errors == 1);
  CHECK(hooks.get_hook_stats(m)->errors == 1);
  CHECK(hooks.get_hook_stats(c)->executions == 1);
  REQUIRE(errors.size() == 3);
  CHECK(errors[0].hook_name == "t");
  CHECK(errors[0].layer == "layer");
  CHECK(errors[0].step == 9);
  // A handler that throws is contained too.
  hooks.set_error_handler([](const torchdbg::HookError&) { throw std::logic_error("handler"); });
  CHECK_NOTHROW(hooks.execute_hooks("layer", torch::ones({1}), true));
  CHECK_THROWS_AS(hooks.register_callback("", [](const torchdbg::HookContext&) {}), torchdbg::Error);
  CHECK_THROWS_AS(hooks.register_callback("x", nullptr), torchdbg::Error);
}

TEST_CASE("bad data gives each matching hook an error result naming the problem", "[manager]") {
  HookManager hooks;
  const auto id = hooks.create_tensor_inspection_hook({});
  std::vector<float> data = {1, 2, 3, 4, 5};
  auto r = hooks.execute_hooks("fc", data, {2, 3}, true);
  REQUIRE(r.size() == 1);
  CHECK(r[0].second.is_error());
  CHECK(r[0].second.message().find("5 elements") != std::string::npos);
  CHECK(r[0].second.message().find("[2, 3]") != std::string::npos);
  r = hooks.execute_hooks("fc", torch::ones({2}, torch::kComplexFloat), true);
  CHECK(r[0].second.message().find("ComplexFloat") != std::string::npos);
  r = hooks.execute_hooks("fc", torch::Tensor(), true);
  CHECK(r[0].second.message().find("undefined") != std::string::npos);
  CHECK(hooks.get_hook_stats(id)->errors == 3);
  CHECK(hooks.inspector.names().empty());
  // Good data after bad: the loop goes on.
  CHECK(hooks.execute_hooks("fc", data, {5}, true)[0].second.ok());
  CHECK(hooks.inspector.latest("fc")->stats.mean == 3.0);
}

TEST_CASE("raw data of every element type goes through the same statistics", "[manager]") {
  HookManager hooks;
  hooks.create_tensor_inspection_hook({});
  std::vector<double> d = {1, 2, 3, 6};
  std::vector<c10::Half> h = {c10::Half(1.f), c10::Half(3.f)};
  std::vector<c10::BFloat16> bf = {c10::BFloat16(2.f), c10::BFloat16(4.f)};
  std::vector<int32_t> i = {-1, 1, 3};
  std::vector<uint8_t> u = {0, 0, 4};
  CHECK(hooks.execute_hooks("d", d, {2, 2}, true)[0].second.ok());
  CHECK(hooks.execute_hooks("h", h.data(), h.size(), {2}, true)[0].second.ok());
  CHECK(hooks.execute_hooks("bf", bf, {2}, true)[0].second.ok());
  CHECK(hooks.execute_hooks("i", i, {3}, true)[0].second.ok());
  CHECK(hooks.execute_hooks("u", u, {3}, true)[0].second.ok());
  CHECK(hooks.inspector.latest("d")->stats.mean == 3.0);
  CHECK(hooks.inspector.latest("h")->stats.mean == 2.0);
  CHECK(hooks.inspector.latest("bf")->stats.mean == 3.0);
  CHECK(hooks.inspector.latest("i")->stats.dtype == "Int");
  CHECK(hooks.inspector.latest("u")->stats.sparsity == Approx(2.0 / 3.0));
}

TEST_CASE("gradient tracking keys parameters and raises exploding alerts", "[manager]") {
  HookManager hooks(torchdbg::HookManagerOptions().inspector(torchdbg::InspectorOptions().exploding_gradient_norm(5.0)));
  hooks.create_gradient_tracking_hook({"^fc1$"});
  hooks.set_step(2);
  hooks.execute_hooks("fc1", torch::full({3, 3}, 4.0), false, {{"parameter", "weight"}});
  hooks.execute_hooks("fc1", torch::full({3}, 0.1), false, {{"parameter", "bias"}});
  CHECK(hooks.inspector.gradient_history("fc1.weight/grad").size() == 1);
  CHECK(hooks.inspector.gradient_history("fc1.bias/grad").size() == 1);
  const auto alerts = hooks.alerts();
  REQUIRE(alerts.size() == 1);
  CHECK(alerts[0].layer == "fc1");
  CHECK(alerts[0].step == 2);
  CHECK(alerts[0].hook_name == "gradient_tracking");
  CHECK(alerts[0].message.find("exploding") != std::string::npos);
}

TEST_CASE("alert hooks log once per step with severity and forward to the sink", "[manager]") {
  HookManager hooks(torchdbg::HookManagerOptions().alert_capacity(3));
  std::vector<torchdbg::Alert> sunk;
  hooks.set_alert_sink([&](const torchdbg::Alert& a) { sunk.push_back(a); });
  const auto id = hooks.create_alert_hook(HookCondition::loss_above(10.0), "loss exploded", AlertSeverity::Critical);
  hooks.set_step(0);
  hooks.execute_hooks("fc1", torch::ones({1}), true);  // no loss reported: condition false
  CHECK(hooks.alerts().empty());
  for (int64_t s = 1; s <= 6; ++s) {
    hooks.set_step(s);
    hooks.set_loss(s >= 2 ? 50.0 : 1.0);
    hooks.execute_hooks("fc1", torch::ones({1}), true);
    hooks.execute_hooks("fc2", torch::ones({1}), true);  // same step: no second entry
  }
  CHECK(hooks.alert_count() == 5);   // steps 2..6
  const auto log = hooks.alerts();  // ring of 3
  REQUIRE(log.size() == 3);
  CHECK(log.front().step == 4);
  CHECK(log.back().step == 6);
  CHECK(log.back().severity == AlertSeverity::Critical);
  CHECK(log.back().message == "loss exploded");
  CHECK(log.back().hook_id == id);
  CHECK(sunk.size() == 5);
  hooks.set_alert_sink([](const torchdbg::Alert&) { throw std::runtime_error("sink down"); });
  hooks.set_step(7);
  CHECK_FALSE(hooks.state().loss.has_value());  // a new step has no loss yet
  CHECK(hooks.execute_hooks("fc1", torch::ones({1}), true)[0].second.is_skipped());
  hooks.set_loss(50.0);
  const auto r = hooks.execute_hooks("fc1", torch::ones({1}), true);
  CHECK(r[0].second.message() == "sink down");
  CHECK(hooks.alert_count() == 6);  // logged before the sink failed: nothing lost
  hooks.clear_alerts();
  CHECK(hooks.alerts().empty());
}

TEST_CASE("the pause action sets the shared flag, records why, and resume clears it", "[manager]") {
  HookManager hooks;
  auto flag = hooks.pause_flag();
  hooks.register_hook(HookConfig()
                          .name("nan guard")
                          .trigger(HookTrigger::conditional(HookCondition::loss_non_finite()))
                          .actions({HookAction::pause_training("loss is NaN")}));
  hooks.set_step(3);
  hooks.set_loss(1.0);
  hooks.execute_hooks("fc1", torch::ones({1}), true);
  CHECK_FALSE(flag->load());
  hooks.set_step(4);
  hooks.set_loss(std::nan(""));
  hooks.execute_hooks("fc1", torch::ones({1}), true);
  CHECK(flag->load());
  CHECK(hooks.is_paused());
  REQUIRE(hooks.pause_info());
  CHECK(hooks.pause_info()->step == 4);
  CHECK(hooks.pause_info()->reason == "loss is NaN");
  CHECK(hooks.pause_info()->hook_name == "nan guard");
  hooks.resume_training();
  CHECK_FALSE(flag->load());
  CHECK_FALSE(hooks.pause_info());
  hooks.pause_training("manual");
  CHECK(flag->load());
  CHECK(hooks.pause_info()->reason == "manual");
}

TEST_CASE("snapshot actions write loadable files; a bad directory is an error result", "[manager]") {
  HookManager hooks;
  const auto dir = torchdbg_test::tmp_dir("manager_snap") + "/created/by/hook";
  hooks.register_hook(HookConfig().name("snap").actions({HookAction::save_snapshot(dir)}));
  hooks.set_step(12);
  auto y = torch::randn({3, 4});
  auto r = hooks.execute_hooks("encoder.0/fc1", y, true);
  REQUIRE(r[0].second.ok());
  const auto path = dir + "/encoder.0_fc1_step12_fwd.pt";
  CHECK(r[0].second.message() == "saved " + path);
  CHECK(torch::equal(torchdbg::load_snapshot(path), y));
  // A directory under a regular file cannot be created.
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/file") << "x";
  hooks.clear_hooks();
  hooks.register_hook(HookConfig().name("bad").actions({HookAction::save_snapshot(dir + "/file/sub")}));
  r = hooks.execute_hooks("fc1", y, true);
  CHECK(r[0].second.is_error());
  CHECK(r[0].second.message().find(dir + "/file/sub") != std::string::npos);
}

TEST_CASE("hooks may call back into the manager", "[manager]") {
  HookManager hooks;
  std::size_t seen_hooks = 0;
  hooks.register_callback("reenter", [&](const torchdbg::HookContext& c) {
    seen_hooks = hooks.get_all_stats().size();
    hooks.set_gradient_norm(1.0);
    hooks.create_alert_hook(HookCondition::step_range(0, 0), "inner");
    hooks.execute_hooks(std::string(c.layer_name()) + "/inner", torch::ones({1}), true);
  });
  hooks.register_hook(callback_hook("outer", "reenter").layer_patterns({"^fc$"}));
  auto r = hooks.execute_hooks("fc", torch::ones({1}), true);
  REQUIRE(r.size() == 1);  // the hook registered during the call is not part of it
  CHECK(r[0].second.ok());
  CHECK(seen_hooks == 1);
  CHECK(hooks.hook_count() == 2);
  CHECK(hooks.state().gradient_norm == 1.0);
}

TEST_CASE("execute_hooks runs concurrently with itself and with registration", "[manager]") {
  HookManager hooks(torchdbg::HookManagerOptions().inspector(torchdbg::InspectorOptions().sample_rate(0.0)));
  std::atomic<int64_t> calls{0};
  hooks.register_callback("count", [&](const torchdbg::HookContext&) { calls.fetch_add(1); });
  const auto counted = hooks.register_hook(callback_hook("count", "count").trigger(HookTrigger::every_backward()));
  hooks.create_gradient_tracking_hook({});
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load()) {
      auto id = hooks.create_tensor_inspection_hook({"^w"});
      hooks.set_hook_enabled(id, false);
      hooks.remove_hook(id);
    }
  });
  std::atomic<int64_t> not_ok{0};  // Catch2 assertions are for the main thread only
  std::vector<std::thread> workers;
  for (int w = 0; w < 4; ++w) {
    workers.emplace_back([&, w] {
      for (int k = 0; k < 200; ++k) {
        auto r = hooks.execute_hooks("w" + std::to_string(w), torch::ones({16}), false);
        for (const auto& [id, res] : r) {
          if (id == counted && !res.ok()) not_ok.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : workers) t.join();
  stop.store(true);
  churn.join();
  CHECK(not_ok.load() == 0);
  CHECK(calls.load() == 800);
  CHECK(hooks.get_hook_stats(counted)->executions == 800);
  CHECK(hooks.get_hook_stats(counted)->errors == 0);
  CHECK(hooks.get_hook_stats(counted)->total_time_us > 0.0);
  CHECK(hooks.inspector.gradient_history("w0/grad").size() == 100);  // ring capacity
}

TEST_CASE("the single-thread manager offers the same behaviour", "[manager]") {
  torchdbg::HookManagerSt hooks;
  hooks.create_tensor_inspection_hook({"fc"});
  CHECK(hooks.execute_hooks("fc1", torch::ones({2}), true)[0].second.ok());
  CHECK(hooks.inspector.latest("fc1")->stats.mean == 1.0);
}

TEST_CASE("every kind of bad tensor gives a documented result through every action; the loop goes on", "[manager]") {
  HookManager hooks;
  const auto dir = torchdbg_test::tmp_dir("bad_input_snaps");
  hooks.register_hook(HookConfig().name("all").trigger(HookTrigger::every_n_steps(1)).actions(
      {HookAction::inspect_tensor(), HookAction::track_gradients(), HookAction::record_activations(),
       HookAction::save_snapshot(dir)}));
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  struct Row {
    std::string name;
    torch::Tensor t;
    bool ok;                // success, or an error result whose message holds `error`
    std::string error;
  };
  std::vector<Row> table = {
      {"empty", torch::empty({0, 3}), true, ""},
      {"zero-d", torch::tensor(2.5), true, ""},
      {"large", torch::randn({1 << 22}), true, ""},
      {"transposed", torch::randn({5, 7}).t(), true, ""},
      {"expanded", torch::randn({1, 3}).expand({1000, 3}), true, ""},
      {"int", torch::arange(10, torch::kInt), true, ""},
      {"bool", torch::tensor({true, false, true}), true, ""},
      {"half", torch::randn({8}).to(torch::kHalf), true, ""},
      {"bfloat16", torch::randn({8}).to(torch::kBFloat16), true, ""},
      {"all-nan", torch::full({4}, nan), true, ""},
      {"all-inf", torch::full({4}, -inf), true, ""},
      {"complex", torch::randn({4}, torch::kComplexFloat), false, "ComplexFloat"},
      {"undefined", torch::Tensor(), false, "undefined"},
      {"csr", torch::randn({3, 4}).to_sparse_csr(), false, "layout SparseCsr"},
  };
  if (at::hasMKLDNN()) table.push_back({"mkldnn", torch::randn({3, 4}).to_mkldnn(), false, "layout Mkldnn"});
  for (const auto& row : table) {
    INFO("input " << row.name);
    std::vector<std::pair<torchdbg::HookId, torchdbg::HookResult>> r;
    REQUIRE_NOTHROW(r = hooks.execute_hooks(row.name, row.t, true));
    REQUIRE(r.size() == 1);
    if (row.ok) {
      CHECK(r[0].second.ok());
      REQUIRE(hooks.inspector.latest(row.name));
      CHECK(hooks.inspector.latest(row.name)->stats.numel == row.t.numel());
      CHECK(torch::equal(torchdbg::load_snapshot(dir + "/" + torchdbg::snapshot_file_name(row.name, 0, true)).isnan(),
                         row.t.isnan()));
    } else {
      CHECK(r[0].second.is_error());
      CHECK(r[0].second.message().find(row.error) != std::string::npos);
      CHECK_FALSE(hooks.inspector.latest(row.name));  // nothing half-recorded
    }
  }
  std::vector<float> data = {1, 2, 3};
  CHECK(hooks.execute_hooks("mismatch", data, {2, 2}, true)[0].second.message().find("3 elements") != std::string::npos);
  CHECK(hooks.execute_hooks("negative", data, {-3}, true)[0].second.message().find("-3") != std::string::npos);
  CHECK(hooks.get_all_stats()[0].second.errors == (at::hasMKLDNN() ? 6u : 5u));
  CHECK(hooks.execute_hooks("after", torch::ones({2}), true)[0].second.ok());  // still working
}

TEST_CASE("prefetches run on a tensor and their values reach the hooks of that call", "[manager]") {
  HookManager hooks;
  CHECK_THROWS_WITH(hooks.add_prefetch("", [](std::string_view, const at::Tensor& t, bool, const torchdbg::Metadata&) { return t; }),
                    Catch::Contains("non-empty key"));
  CHECK_THROWS_WITH(hooks.add_prefetch("k", nullptr), Catch::Contains("'k'"));
  hooks.add_prefetch("sum", [](std::string_view layer, const at::Tensor& t, bool fwd, const torchdbg::Metadata&) {
    return layer == "skip" || !fwd ? at::Tensor() : t.sum().to(at::kDouble);
  });
  hooks.add_prefetch("boom", [](std::string_view, const at::Tensor&, bool, const torchdbg::Metadata&) -> at::Tensor {
    throw std::runtime_error("prefetch failed");
  });
  const auto t = torch::arange(6, torch::kFloat).reshape({2, 3});
  auto got = hooks.run_prefetches("fc", t, true, {});
  REQUIRE(got.size() == 1);  // the throwing one is left out
  CHECK(got[0].first == "sum");
  CHECK(got[0].second.dim() == 1);
  CHECK(got[0].second.item<double>() == 15.0);
  CHECK(hooks.run_prefetches("skip", t, true, {}).empty());
  CHECK(hooks.run_prefetches("fc", t, false, {}).empty());
  // Replacing under the same key keeps one; removing reports whether it existed.
  hooks.add_prefetch("sum", [](std::string_view, const at::Tensor& x, bool, const torchdbg::Metadata&) {
    return x.max().to(at::kDouble);
  });
  got = hooks.run_prefetches("fc", t, true, {});
  REQUIRE(got.size() == 1);
  CHECK(got[0].second.item<double>() == 5.0);
  CHECK(hooks.remove_prefetch("boom"));
  CHECK_FALSE(hooks.remove_prefetch("boom"));

  // The values given to execute_hooks are what ctx.prefetched returns; absent keys are null.
  std::vector<double> seen;
  bool absent_is_null = false;
  hooks.register_callback("read", [&](const torchdbg::HookContext& c) {
    if (const auto* v = c.prefetched("sum")) seen = *v;
    absent_is_null = c.prefetched("other") == nullptr;
  });
  hooks.register_hook(callback_hook("read", "read"));
  const torchdbg::Prefetched values{{"sum", {1.5, 2.5}}};
  hooks.execute_hooks("fc", t, true, {}, nullptr, &values);
  CHECK(seen == std::vector<double>{1.5, 2.5});
  CHECK(absent_is_null);
  seen.clear();
  hooks.execute_hooks("fc", t, true);  // delivered at once: no prefetched values
  CHECK(seen.empty());
}

TEST_CASE("hooks say whether they read sign counts; one pass serves moment and full readers", "[manager]") {
  HookManager hooks;
  CHECK_FALSE(hooks.reads_sign_counts(false, 0));  // no hooks
  hooks.create_gradient_tracking_hook({"fc"});       // norms only
  CHECK_FALSE(hooks.reads_sign_counts(false, 0));
  std::optional<torchdbg::TensorStats> moment_seen;
  hooks.register_callback(
      "moments", [&](const torchdbg::HookContext& c) { moment_seen = c.moment_stats(); },
      torchdbg::CallbackStats::Moments);
  hooks.register_hook(HookConfig().name("m").trigger(HookTrigger::every_backward()).actions(
      {HookAction::custom_callback("moments")}));
  CHECK_FALSE(hooks.reads_sign_counts(false, 0));
  // Moment readers alone: the statistics skip the sign counts.
  auto g = torch::relu(torch::randn({4096}));
  hooks.execute_hooks("fc1", g, false, {{"parameter", "weight"}});
  REQUIRE(moment_seen);
  CHECK_FALSE(moment_seen->sign_counts);
  CHECK(moment_seen->l2_norm == torchdbg::compute_stats(g).l2_norm);
  CHECK(hooks.inspector.gradient_history("fc1.weight/grad").size() == 1);

  int64_t zeros_seen = -2;
  hooks.register_callback("full", [&](const torchdbg::HookContext& c) { zeros_seen = c.stats().zero_count; });
  hooks.register_hook(HookConfig().name("f").trigger(HookTrigger::every_backward()).actions(
      {HookAction::custom_callback("full")}));
  CHECK(hooks.reads_sign_counts(false, 0));  // a callback registered without a declaration
  CHECK_FALSE(hooks.reads_sign_counts(true, 0));  // ... runs on gradients only
  hooks.execute_hooks("fc1", g, false, {{"parameter", "weight"}});
  CHECK(zeros_seen == (g == 0).sum().item<int64_t>());
  CHECK(moment_seen->sign_counts);  // the moment reader ran first and already got them
  // The same callback re-registered as a moment reader, then removed: no reader is left.
  hooks.register_callback("full", [&](const torchdbg::HookContext&) {}, torchdbg::CallbackStats::Moments);
  CHECK_FALSE(hooks.reads_sign_counts(false, 0));
  hooks.remove_callback("full");
  CHECK(hooks.reads_sign_counts(false, 0));  // a missing callback is assumed to read them
  hooks.clear_hooks();
  hooks.create_tensor_inspection_hook({"fc"});  // records full statistics of forward outputs
  CHECK(hooks.reads_sign_counts(true, 0));
  CHECK_FALSE(hooks.reads_sign_counts(false, 0));
  hooks.register_hook(HookConfig().name("every3").trigger(HookTrigger::every_n_steps(3)).actions(
      {HookAction::inspect_tensor()}));  // both directions, on its steps only
  CHECK(hooks.reads_sign_counts(false, 3));
  CHECK_FALSE(hooks.reads_sign_counts(false, 4));
  hooks.set_enabled(false);
  CHECK_FALSE(hooks.reads_sign_counts(true, 0));
}

TEST_CASE("a hook's direction keeps it to forward or gradient calls, for its trigger and the queries", "[manager]") {
  HookManager hooks;
  int fwd_calls = 0, bwd_calls = 0;
  hooks.register_callback("fwd", [&](const torchdbg::HookContext& c) {
    CHECK(c.is_forward());
    ++fwd_calls;
  });
  hooks.register_callback("bwd", [&](const torchdbg::HookContext& c) {
    CHECK_FALSE(c.is_forward());
    ++bwd_calls;
  }, torchdbg::CallbackStats::Moments);
  const auto f = hooks.register_hook(HookConfig()
                                         .name("f")
                                         .trigger(HookTrigger::every_n_steps(2))
                                         .direction(torchdbg::CallDirection::Forward)
                                         .actions({HookAction::custom_callback("fwd")}));
  const auto b = hooks.register_hook(HookConfig()
                                         .name("b")
                                         .trigger(HookTrigger::every_n_steps(2))
                                         .direction(torchdbg::CallDirection::Backward)
                                         .actions({HookAction::custom_callback("bwd")}));
  CHECK(HookConfig().direction() == torchdbg::CallDirection::Both);
  auto t = torch::randn({8});
  for (int64_t step = 0; step < 4; ++step) {
    hooks.set_step(step);
    const auto rf = hooks.execute_hooks("fc1", t, true);
    const auto rb = hooks.execute_hooks("fc1", t, false);
    // Only the hook of the call's direction answers: skipped on odd steps, run on even ones.
    REQUIRE(rf.size() == 1);
    REQUIRE(rb.size() == 1);
    CHECK(rf[0].first == f);
    CHECK(rb[0].first == b);
    CHECK(rf[0].second.is_skipped() == (step % 2 == 1));
    CHECK(rb[0].second.is_skipped() == (step % 2 == 1));
    CHECK(hooks.may_fire(true, step) == (step % 2 == 0));
    CHECK(hooks.may_fire(false, step) == (step % 2 == 0));
  }
  CHECK(fwd_calls == 2);
  CHECK(bwd_calls == 2);
  // Calls of the other direction are not counted as skipped.
  CHECK(hooks.get_hook_stats(f)->executions == 2);
  CHECK(hooks.get_hook_stats(f)->skipped == 2);
  CHECK(hooks.get_hook_stats(b)->skipped == 2);
  // The forward hook reads every count (a callback without a declaration), the backward one
  // moments only: gradients at its steps need no sign counts.
  CHECK(hooks.reads_sign_counts(true, 2));
  CHECK_FALSE(hooks.reads_sign_counts(false, 2));
  // A backward-only hook alone never makes a forward call due.
  hooks.remove_hook(f);
  CHECK_FALSE(hooks.may_fire(true, 2));
  CHECK(hooks.may_fire(false, 2));
  // An on_steps trigger is asked by may_fire (a condition would count as possibly due).
  hooks.remove_hook(b);
  std::atomic<bool> alert{false};
  const auto a = hooks.register_hook(HookConfig()
                                         .name("alert")
                                         .trigger(torchdbg::HookTrigger::on_steps(
                                             [&alert](int64_t s) { return s % 4 == 0 || alert.load(); }, "alert"))
                                         .direction(torchdbg::CallDirection::Forward)
                                         .actions({HookAction::custom_callback("fwd")}));
  for (int64_t step = 0; step < 8; ++step) {
    alert.store(step >= 5);
    CHECK(hooks.may_fire(true, step) == (step % 4 == 0 || step >= 5));
    CHECK_FALSE(hooks.may_fire(false, step));
    hooks.set_step(step);
    const auto r = hooks.execute_hooks("fc1", t, true);
    REQUIRE(r.size() == 1);
    CHECK(r[0].second.is_skipped() == !(step % 4 == 0 || step >= 5));
  }
  CHECK(hooks.get_hook_stats(a)->executions == 5);  // steps 0, 4, 5, 6, 7
  // A predicate that throws: possibly due for may_fire (set_step does not throw), the hook's
  // own error at the call, and the other hooks of the call still run.
  const auto bad = hooks.register_hook(
      HookConfig()
          .name("throws")
          .trigger(torchdbg::HookTrigger::on_steps([](int64_t) -> bool { throw std::runtime_error("pred boom"); },
                                                   "throws"))
          .actions({HookAction::alert("never", torchdbg::AlertSeverity::Info)}));
  CHECK_NOTHROW(hooks.set_step(9));
  CHECK(hooks.may_fire(false, 9));
  std::vector<std::pair<torchdbg::HookId, torchdbg::HookResult>> r;
  CHECK_NOTHROW(r = hooks.execute_hooks("fc1", t, true));
  REQUIRE(r.size() == 2);
  for (const auto& [id, res] : r) {
    if (id == bad) {
      CHECK(res.is_error());
      CHECK_THAT(res.message(), Catch::Contains("pred boom"));
    } else {
      CHECK(res.ok());  // the hook of the flag: step 9 with the flag set
    }
  }
}

TEST_CASE("a moment reader before a full reader in one call computes the statistics once", "[manager]") {
  HookManager hooks;
  std::vector<const torchdbg::TensorStats*> seen;
  hooks.register_callback(
      "moments", [&](const torchdbg::HookContext& c) { seen.push_back(&c.moment_stats()); },
      torchdbg::CallbackStats::Moments);
  hooks.register_callback("full", [&](const torchdbg::HookContext& c) { seen.push_back(&c.stats()); });
  hooks.register_hook(callback_hook("m", "moments"));
  hooks.register_hook(callback_hook("f", "full"));
  auto y = torch::relu(torch::randn({4096}));
  hooks.execute_hooks("fc1", y, true);
  REQUIRE(seen.size() == 2);
  // One object: the moment reader already got the full statistics, since a full reader followed.
  CHECK(seen[0] == seen[1]);
}

TEST_CASE("huge layer names and backtracking patterns match in linear time, without recursion", "[manager]") {
  HookManager hooks;
  const auto id = hooks.register_hook(HookConfig().layer_patterns({"^fc[0-9]+$"}).actions({HookAction::inspect_tensor()}));
  const std::string huge = "fc" + std::string(40000, '7');  // 40 kB: std::regex overflowed the stack
  auto r = hooks.execute_hooks(huge, torch::ones({2}), true);
  REQUIRE(r.size() == 1);
  CHECK(r[0].second.ok());
  CHECK(hooks.execute_hooks(huge + "x", torch::ones({2}), true).empty());
  // (a+)+$ against a name that almost matches: exponential for a backtracking engine (a
  // 60-character name would take days), linear here.
  hooks.remove_hook(id);
  hooks.register_hook(HookConfig().layer_patterns({"(a+)+$"}).actions({HookAction::inspect_tensor()}));
  const std::string near_miss = std::string(60, 'a') + "!";
  CHECK(hooks.execute_hooks(near_miss, torch::ones({2}), true).empty());
  CHECK(hooks.execute_hooks(std::string(100000, 'a'), torch::ones({2}), true).size() == 1);
  // The same engine serves every pattern option: the reporter's, attach's and MultiHookManager's.
  CHECK_NOTHROW(torchdbg::detail::compile_pattern("(x+x+)+y", "test pattern").search(std::string(50000, 'x')));
  CHECK(torchdbg::detail::compile_pattern("enc", "p").match_prefix("encoder.0"));
  CHECK_FALSE(torchdbg::detail::compile_pattern("enc", "p").match_prefix("x.encoder"));
  CHECK(torchdbg::detail::compile_pattern("enc", "p").search("x.encoder"));
  CHECK_FALSE(torchdbg::detail::compile_pattern("enc", "p").full_match("encoder"));
  // Invalid UTF-8 in a name is matched byte by byte, never an error.
  CHECK_NOTHROW(torchdbg::detail::compile_pattern("^fc", "p").search(std::string("fc\xff\xfe", 4)));
}

TEST_CASE("the manager prints its step, hooks in order with their runs, alerts and pause in one line", "[manager]") {
  HookManager hooks;
  CHECK(fmt::format("{}", hooks) == "HookManager(step 0, 0 hooks, 0 alerts, running)");
  const auto inspect = hooks.create_tensor_inspection_hook({"fc"});
  hooks.register_callback("boom", [](const torchdbg::HookContext&) { throw std::runtime_error("boom"); });
  hooks.register_hook(callback_hook("boom", "boom").priority(1));
  hooks.set_step(7);
  for (int i = 0; i < 3; ++i) hooks.execute_hooks("fc1", torch::randn({4, 4}), true);
  hooks.execute_hooks("conv", torch::randn({4, 4}), true);
  const auto stats = hooks.get_all_stats();
  REQUIRE(stats.size() == 2);
  CHECK(stats[0].second.executions == 4);  // boom matches every layer and runs first
  CHECK(stats[0].second.errors == 4);
  CHECK(hooks.get_hook_stats(inspect)->executions == 3);
  CHECK(fmt::format("{}", hooks) ==
        "HookManager(step 7, 2 hooks [\"boom\" (4 runs, 4 errors), \"tensor_inspection\" (3 runs)], 0 alerts, running)");
  hooks.set_hook_enabled(inspect, false);
  hooks.warn("me", "a warning");
  hooks.pause_training("loss\nexploded", "fc2", 7, "torchdbg.health");
  const std::string paused = fmt::format("{}", hooks);
  CHECK(paused ==
        "HookManager(step 7, 2 hooks [\"boom\" (4 runs, 4 errors), \"tensor_inspection\" (3 runs, disabled)], 1 alert, "
        "paused at step 7 in \"fc2\": \"loss\\nexploded\")");
  std::ostringstream os;
  os << hooks;
  CHECK(os.str() == paused);
  hooks.resume_training();
  hooks.set_enabled(false);
  for (int i = 0; i < 9; ++i) hooks.register_hook(HookConfig().name("h" + std::to_string(i)).priority(-1));
  const std::string many = fmt::format("{}", hooks);
  CHECK(many.find("\"h5\" (0 runs), and 3 more], 1 alert, disabled)") != std::string::npos);
  // Each manager keeps its own Change type, as before the manager was made of pieces.
  static_assert(!std::is_same_v<HookManager::Change, torchdbg::HookManagerSt::Change>);
  torchdbg::HookManagerSt st;
  st.set_step(3);
  CHECK(fmt::format("{}", st) == "HookManagerSt(step 3, 0 hooks, 0 alerts, running)");
}

TEST_CASE("a manager that samples gives its hooks estimated statistics of large tensors, exact ones of the rest",
          "[manager]") {
  torchdbg_test::SeededRng rng(81);
  torchdbg::HookManager hooks(
      torchdbg::HookManagerOptions().sampling(torchdbg::StatsSampling().stride(8).above(50000)));
  CHECK(hooks.options().sampling().stride() == 8);
  std::vector<torchdbg::TensorStats> seen, moments, with_distribution;
  hooks.register_callback("read", [&](const torchdbg::HookContext& ctx) { seen.push_back(ctx.stats()); });
  hooks.register_callback("moments", [&](const torchdbg::HookContext& ctx) { moments.push_back(ctx.moment_stats()); },
                          torchdbg::CallbackStats::Moments);
  hooks.register_callback("dist", [&](const torchdbg::HookContext& ctx) {
    with_distribution.push_back(ctx.stats_with_distribution(10));
  });
  hooks.register_hook(torchdbg::HookConfig().name("all").trigger(torchdbg::HookTrigger::every_n_steps(1)).actions(
      {torchdbg::HookAction::custom_callback("read"), torchdbg::HookAction::custom_callback("moments"),
       torchdbg::HookAction::custom_callback("dist")}));
  const auto large = torch::randn({1024, 300}) * 3.0 + 1.0, small = torch::randn({100, 250});
  hooks.execute_hooks("large", large, true);
  hooks.execute_hooks("small", small, true);
  REQUIRE(seen.size() == 2);
  REQUIRE(moments.size() == 2);
  REQUIRE(with_distribution.size() == 2);
  CHECK(seen[0].sampled_count > 0);
  CHECK(seen[0].sampled_count < large.numel());
  CHECK(std::fabs(seen[0].std - large.std(/*unbiased=*/false).item<double>()) < 0.1 * 3.0);
  CHECK(moments[0].sampled_count > 0);
  CHECK(seen[1].sampled_count == 0);
  // The distribution is of every value, and its summary too.
  for (const auto& s : with_distribution) {
    CHECK(s.sampled_count == 0);
    CHECK(s.distribution.has_value());
  }
  CHECK(with_distribution[0].mean == torchdbg::compute_stats(large).mean);
  CHECK_THROWS_WITH(torchdbg::HookManager(torchdbg::HookManagerOptions().sampling(torchdbg::StatsSampling().stride(0))),
                    Catch::Contains("stride must be at least 1, got 0"));
  CHECK_THROWS_WITH(
      torchdbg::HookManager(torchdbg::HookManagerOptions().sampling(torchdbg::StatsSampling().above(-1))),
      Catch::Contains("above must be at least 0, got -1"));
}
