// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <torchdbg/hook_condition.hpp>

#include <limits>

#include "helpers.hpp"

using torchdbg::Comparison;
using torchdbg::HookCondition;

namespace {
struct Ctx {
  torchdbg::Metadata md;
  torch::Tensor t = torch::zeros({1});
  torchdbg::TrainingState st;
  bool eval(const HookCondition& c) const { return c.evaluate(torchdbg::HookContext("layer", true, st, md, t)); }
};
}  // namespace

TEST_CASE("comparisons follow their truth table and are false for NaN", "[condition]") {
  struct Row {
    Comparison op;
    bool below, equal, above;
  };
  const Row rows[] = {{Comparison::Greater, false, false, true},
                      {Comparison::Less, true, false, false},
                      {Comparison::Equal, false, true, false},
                      {Comparison::GreaterEqual, false, true, true},
                      {Comparison::LessEqual, true, true, false}};
  for (const auto& r : rows) {
    INFO("op " << torchdbg::to_string(r.op));
    CHECK(torchdbg::compare(1.0, r.op, 2.0) == r.below);
    CHECK(torchdbg::compare(2.0, r.op, 2.0) == r.equal);
    CHECK(torchdbg::compare(3.0, r.op, 2.0) == r.above);
    CHECK_FALSE(torchdbg::compare(std::nan(""), r.op, 2.0));
  }
}

TEST_CASE("threshold conditions read the reported value and are false when none was reported", "[condition]") {
  Ctx c;
  const auto loss = HookCondition::loss_above(10.0);
  const auto grad = HookCondition::gradient_norm(Comparison::LessEqual, 1e-3);
  const auto mem = HookCondition::memory_above(512.0);
  CHECK_FALSE(c.eval(loss));  // set_loss never called
  CHECK_FALSE(c.eval(grad));
  CHECK_FALSE(c.eval(mem));
  c.st.loss = 10.0;
  CHECK_FALSE(c.eval(loss));
  c.st.loss = 10.5;
  CHECK(c.eval(loss));
  CHECK(c.eval(HookCondition::loss(Comparison::GreaterEqual, 10.5)));
  CHECK(c.eval(HookCondition::loss_below(11.0)));
  c.st.gradient_norm = 1e-3;
  CHECK(c.eval(grad));
  c.st.gradient_norm = 2e-3;
  CHECK_FALSE(c.eval(grad));
  CHECK(c.eval(HookCondition::gradient_norm_above(1e-3)));
  c.st.memory_mb = 600.0;
  CHECK(c.eval(mem));
  CHECK(c.eval(HookCondition::memory_mb(Comparison::Less, 1000.0)));
}

TEST_CASE("a NaN loss is caught by loss_non_finite, not by thresholds", "[condition]") {
  Ctx c;
  CHECK_FALSE(c.eval(HookCondition::loss_non_finite()));
  c.st.loss = std::numeric_limits<double>::quiet_NaN();
  CHECK_FALSE(c.eval(HookCondition::loss_above(10.0)));
  CHECK(c.eval(HookCondition::loss_non_finite()));
  c.st.loss = std::numeric_limits<double>::infinity();
  CHECK(c.eval(HookCondition::loss_non_finite()));
  CHECK(c.eval(HookCondition::loss_above(10.0)));
  c.st.loss = 1.0;
  CHECK_FALSE(c.eval(HookCondition::loss_non_finite()));
}

TEST_CASE("step ranges are inclusive; metadata conditions match keys and values", "[condition]") {
  Ctx c;
  const auto range = HookCondition::step_range(10, 20);
  for (int64_t s : {9, 10, 15, 20, 21}) {
    c.st.step = s;
    CHECK(c.eval(range) == (s >= 10 && s <= 20));
  }
  CHECK_THROWS_WITH(HookCondition::step_range(5, 4), Catch::Contains("5") && Catch::Contains("4"));
  CHECK_FALSE(c.eval(HookCondition::has_metadata("phase")));
  c.md["phase"] = "eval";
  CHECK(c.eval(HookCondition::has_metadata("phase")));
  CHECK(c.eval(HookCondition::metadata_equals("phase", "eval")));
  CHECK_FALSE(c.eval(HookCondition::metadata_equals("phase", "train")));
}

TEST_CASE("custom predicates see the context; combinators follow boolean logic", "[condition]") {
  Ctx c;
  const auto is_fc = HookCondition::custom([](const torchdbg::HookContext& x) { return x.layer_name() == "layer"; }, "is layer");
  const auto f = HookCondition::custom([](const torchdbg::HookContext&) { return false; }, "never");
  CHECK(c.eval(is_fc));
  for (bool a : {false, true}) {
    for (bool b : {false, true}) {
      const auto ca = a ? is_fc : f;
      const auto cb = b ? is_fc : f;
      CHECK(c.eval(ca && cb) == (a && b));
      CHECK(c.eval(ca || cb) == (a || b));
      CHECK(c.eval(!ca) == !a);
      CHECK(c.eval(HookCondition::all_of({ca, cb, is_fc})) == (a && b));
      CHECK(c.eval(HookCondition::any_of({ca, cb, f})) == (a || b));
    }
  }
  CHECK((HookCondition::loss_above(10) || !HookCondition::step_range(1, 2)).describe() == "(loss > 10 || !step in [1, 2])");
  CHECK_THROWS_AS(HookCondition::all_of({}), torchdbg::Error);
  CHECK_THROWS_AS(HookCondition::custom(nullptr), torchdbg::Error);
  CHECK_THROWS_WITH(HookCondition::loss_above(std::nan("")), Catch::Contains("NaN"));
  const auto boom = HookCondition::custom([](const torchdbg::HookContext&) -> bool { throw std::runtime_error("boom"); });
  CHECK_THROWS_WITH(c.eval(boom), "boom");
}
