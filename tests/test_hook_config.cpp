// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <torchdbg/hook_config.hpp>

#include <fmt/ranges.h>

#include <atomic>
#include <memory>
#include <regex>
#include <set>
#include <sstream>

#include "helpers.hpp"

using torchdbg::HookAction;
using torchdbg::HookConfig;
using torchdbg::HookTrigger;

namespace {
bool due(const HookTrigger& t, std::string_view layer, bool fwd, int64_t step, std::optional<double> loss = {}) {
  torchdbg::Metadata md;
  auto x = torch::zeros({1});
  torchdbg::TrainingState st;
  st.step = step;
  st.loss = loss;
  return t.is_due(torchdbg::HookContext(layer, fwd, st, md, x));
}
}  // namespace

TEST_CASE("hook ids are unique and print like UUIDs", "[config]") {
  std::set<torchdbg::HookId> ids;
  const std::regex uuid("^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$");
  for (int i = 0; i < 1000; ++i) {
    const auto id = torchdbg::HookId::generate();
    CHECK_FALSE(id.is_nil());
    CHECK(std::regex_match(id.to_string(), uuid));
    ids.insert(id);
  }
  CHECK(ids.size() == 1000);
  CHECK(torchdbg::HookId{}.is_nil());
  std::ostringstream os;
  const auto id = torchdbg::HookId::generate();
  os << id;
  CHECK(os.str() == id.to_string());
}

TEST_CASE("triggers fire on their direction, interval, layers or condition", "[config]") {
  CHECK(due(HookTrigger::every_forward(), "a", true, 0));
  CHECK_FALSE(due(HookTrigger::every_forward(), "a", false, 0));
  CHECK(due(HookTrigger::every_backward(), "a", false, 0));
  CHECK_FALSE(due(HookTrigger::every_backward(), "a", true, 0));
  const auto every3 = HookTrigger::every_n_steps(3);
  for (int64_t s = 0; s < 10; ++s) {
    CHECK(due(every3, "a", true, s) == (s % 3 == 0));
    CHECK(due(every3, "a", false, s) == (s % 3 == 0));
  }
  const auto layers = HookTrigger::layer_specific({"fc1", "conv2"});
  CHECK(due(layers, "fc1", true, 0));
  CHECK(due(layers, "conv2", false, 0));
  CHECK_FALSE(due(layers, "fc10", true, 0));  // exact names, not regex
  CHECK_FALSE(due(layers, "fc", true, 0));
  const auto cond = HookTrigger::conditional(torchdbg::HookCondition::loss_above(1.0));
  CHECK_FALSE(due(cond, "a", true, 0));
  CHECK(due(cond, "a", true, 0, 2.0));
  CHECK(HookTrigger::once().kind() == HookTrigger::Kind::Once);
  CHECK(every3.describe() == "every 3 steps");
  CHECK(layers.describe() == "layers {fc1, conv2}");
  // on_steps: whatever the predicate says of the step, in both directions, read each time.
  auto until = std::make_shared<std::atomic<int64_t>>(-1);
  const auto alert = HookTrigger::on_steps(
      [until](int64_t s) { return s % 5 == 0 || s <= until->load(); }, "every 5 steps and while alert");
  CHECK(alert.kind() == HookTrigger::Kind::OnSteps);
  CHECK(alert.describe() == "on steps: every 5 steps and while alert");
  for (int64_t s = 0; s < 12; ++s) {
    CHECK(due(alert, "a", true, s) == (s % 5 == 0));
    CHECK(due(alert, "a", false, s) == (s % 5 == 0));
    CHECK(alert.accepts_step(s) == (s % 5 == 0));
  }
  until->store(7);
  for (int64_t s = 0; s < 12; ++s) CHECK(due(alert, "a", true, s) == (s % 5 == 0 || s <= 7));
  CHECK(every3.accepts_step(1));  // other kinds: no step predicate
}

TEST_CASE("invalid trigger and action arguments are rejected with the value named", "[config]") {
  CHECK_THROWS_WITH(HookTrigger::every_n_steps(0), Catch::Contains("got 0"));
  CHECK_THROWS_WITH(HookTrigger::every_n_steps(-4), Catch::Contains("got -4"));
  CHECK_THROWS_WITH(HookTrigger::on_steps({}, "x"), Catch::Contains("on_steps") && Catch::Contains("empty"));
  CHECK_THROWS_AS(HookTrigger::layer_specific({}), torchdbg::Error);
  CHECK_THROWS_AS(HookAction::save_snapshot(""), torchdbg::Error);
  CHECK_THROWS_AS(HookAction::custom_callback(""), torchdbg::Error);
}

TEST_CASE("hook configs build in LibTorch's options style", "[config]") {
  auto c = HookConfig()
               .name("snap")
               .trigger(HookTrigger::every_n_steps(100))
               .actions({HookAction::save_snapshot("out")})
               .max_executions(5)
               .layer_patterns({"^fc"});
  c.add_action(HookAction::alert("saved", torchdbg::AlertSeverity::Info));
  CHECK(c.name() == "snap");
  CHECK(c.trigger().interval() == 100);
  REQUIRE(c.actions().size() == 2);
  CHECK(c.actions()[0].describe() == "save_snapshot(out)");
  CHECK(c.actions()[1].describe() == "alert(info: saved)");
  CHECK(c.max_executions() == std::optional<uint64_t>(5));
  CHECK(c.enabled());
  CHECK(HookConfig().trigger().kind() == HookTrigger::Kind::EveryForward);
}

TEST_CASE("hook results carry status and message", "[config]") {
  const auto ok = torchdbg::HookResult::success("saved x");
  CHECK(ok.ok());
  CHECK(ok.message() == "saved x");
  const auto err = torchdbg::HookResult::error("bad");
  CHECK(err.is_error());
  CHECK_FALSE(err.ok());
  CHECK(torchdbg::HookResult::skipped("later").is_skipped());
  torchdbg::HookStats s;
  CHECK(s.mean_time_us() == 0.0);
  s.executions = 4;
  s.total_time_us = 10.0;
  CHECK(s.mean_time_us() == 2.5);
}

namespace {
template <typename T>
std::string streamed(const T& x) {
  std::ostringstream os;
  os << x;
  return os.str();
}
}  // namespace

TEST_CASE("a hook's configuration and statistics print one stable line, the same with fmt and ostream", "[config]") {
  const auto c = HookConfig()
                     .name("fc snapshots")
                     .trigger(HookTrigger::every_n_steps(100))
                     .actions({HookAction::inspect_tensor(), HookAction::save_snapshot("out")})
                     .layer_patterns({"^fc[0-9]+$"})
                     .direction(torchdbg::CallDirection::Forward)
                     .max_executions(10);
  const std::string expected =
      R"(HookConfig("fc snapshots", every 100 steps, [inspect_tensor, save_snapshot(out)], patterns ["^fc[0-9]+$"], forward, max 10))";
  CHECK(fmt::format("{}", c) == expected);
  CHECK(streamed(c) == expected);
  CHECK(fmt::format("{}", HookConfig()) == "HookConfig(\"hook\", every forward, [])");
  CHECK(fmt::format("{}", HookConfig().priority(-2).prepend(true).enabled(false).direction(torchdbg::CallDirection::Backward)) ==
        "HookConfig(\"hook\", every forward, [], backward, priority -2, prepend, disabled)");
  // Odd names stay on one line, escaped and quoted.
  const auto odd = fmt::format("{}", HookConfig().name("a\"b\nc\\d").layer_patterns({"x\ty"}));
  CHECK(odd == R"(HookConfig("a\"b\nc\\d", every forward, [], patterns ["x\ty"]))");
  CHECK(odd.find('\n') == std::string::npos);
  // So does user text inside the trigger and the actions.
  const auto inner = fmt::format(
      "{}", HookConfig()
                .trigger(HookTrigger::layer_specific({"fc1", "fc\n2"}))
                .actions({HookAction::alert("line1\nline2"), HookAction::save_snapshot("dir\nx"),
                          HookAction::custom_callback("cb\tname")}));
  CHECK(inner ==
        R"(HookConfig("hook", layers {fc1, fc\n2}, [alert(warning: line1\nline2), save_snapshot(dir\nx), custom_callback(cb\tname)]))");
  CHECK(fmt::format("{}", HookConfig().trigger(HookTrigger::conditional(torchdbg::HookCondition::metadata_equals("k\n", "v")))).find('\n') ==
        std::string::npos);
  // String format specs apply to the whole text.
  const std::string plain = fmt::format("{}", HookConfig());
  CHECK(fmt::format("{:>40}", HookConfig()) == std::string(40 - plain.size(), ' ') + plain);

  torchdbg::HookStats st;
  CHECK(fmt::format("{}", st) == "HookStats(0 executions, 0 errors, 0 skipped, never ran)");
  st.executions = 1;
  st.errors = 1;
  st.skipped = 7;
  st.last_step = 41;
  st.total_time_us = 1234.0;
  CHECK(fmt::format("{}", st) == "HookStats(1 execution, 1 error, 7 skipped, last step 41, 1.234 ms, 1234 us each)");
  CHECK(streamed(st) == fmt::format("{}", st));
  // In a range each element prints as itself, not as a quoted string.
  CHECK(fmt::format("{}", std::vector<torchdbg::HookStats>{torchdbg::HookStats{}}) ==
        "[HookStats(0 executions, 0 errors, 0 skipped, never ran)]");
}
