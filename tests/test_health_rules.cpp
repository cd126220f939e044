// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
// Health rules: each built-in rule at its thresholds, on signals measured from real tensors;
// user rules feeding the monitor's states, events, incidents, pauses and diagnosis.
#include <cmath>
#include <functional>
#include <random>
#include <torchdbg/diagnosis.hpp>
#include <torchdbg/health.hpp>
#include <torchdbg/health_rules.hpp>

#include "helpers.hpp"

using torchdbg::ActivationHealth;
using torchdbg::ActivationInfo;
using torchdbg::ActivationSignals;
using torchdbg::EventType;
using torchdbg::FailureKind;
using torchdbg::Finding;
using torchdbg::GradientHealth;
using torchdbg::GradientSignals;
using torchdbg::HealthMonitor;
using torchdbg::HealthOptions;
using torchdbg::LossHealth;
using torchdbg::LossSignals;

namespace {

torchdbg::TensorStats stats_of(const torch::Tensor& t) { return torchdbg::compute_stats(t); }

ActivationInfo act(std::string_view a) {
  ActivationInfo i;
  i.activation = a;
  return i;
}

/// Flags module outputs whose mean is more than `k` standard deviations from zero.
struct MeanDrift : torchdbg::HealthRule {
  explicit MeanDrift(double k) : k_(k) {}
  std::string name() const override { return "mean_drift"; }
  std::optional<Finding> check_activation(const ActivationSignals& s) override {
    ++calls;
    if (!s.module_output || !(s.stats.std > 0.0)) return std::nullopt;
    const double z = std::fabs(s.stats.mean) / s.stats.std;
    if (!(z > k_)) return std::nullopt;
    return Finding::custom("mean_drift", z, k_, "output mean " + std::to_string(s.stats.mean) + " far from zero");
  }
  double k_;
  int calls = 0;
};

/// Flags gradient norms above a fixed budget, and losses above a fixed budget.
struct Budget : torchdbg::HealthRule {
  std::string name() const override { return "budget"; }
  std::optional<Finding> check_gradient(const GradientSignals& s) override {
    if (!(s.norm > 5.0)) return std::nullopt;
    return Finding::custom("gradient_budget", s.norm, 5.0, "gradient above its budget");
  }
  std::optional<Finding> check_loss(const LossSignals& s) override {
    if (!(s.loss > 3.0)) return std::nullopt;
    return Finding::custom("loss_budget", s.loss, 3.0, "loss above its budget");
  }
};

/// Returns findings whose numbers are NaN.
struct Undefined : torchdbg::HealthRule {
  std::string name() const override { return "undefined"; }
  std::optional<Finding> check_activation(const ActivationSignals& s) override {
    if (!s.module_output) return std::nullopt;
    Finding f;
    f.value = f.threshold = f.margin = std::nan("");
    f.reason = "no numbers";
    return f;
  }
};

struct Throws : torchdbg::HealthRule {
  std::string name() const override { return "throws"; }
  std::optional<Finding> check_activation(const ActivationSignals&) override {
    throw std::runtime_error("a broken rule");
  }
};

}  // namespace

TEST_CASE("non-finite output rule: the fraction of NaN/Inf, an incident only at the origin", "[rules]") {
  torchdbg::NonFiniteOutputRule rule;
  auto y = torch::randn({10});
  const auto healthy = stats_of(y);
  ActivationSignals ok(y, healthy);
  CHECK_FALSE(rule.check_activation(ok));
  y[1] = std::nan("");
  y[4] = std::nan("");
  y[7] = std::numeric_limits<float>::infinity();
  const auto st = stats_of(y);
  ActivationSignals s(y, st);
  s.origin = true;
  auto f = rule.check_activation(s);
  REQUIRE(f);
  CHECK(f->kind == FailureKind::NonFiniteOutput);
  CHECK(f->value == Approx(0.3));
  CHECK(f->incident);
  CHECK(f->details["nan"] == 2);
  CHECK(f->details["inf"] == 1);
  s.origin = false;
  f = rule.check_activation(s);
  REQUIRE(f);
  CHECK_FALSE(f->incident);
  CHECK(f->reason == "non-finite input");
}

TEST_CASE("dead-units rule: above its fraction, with the onset of the inactive run", "[rules]") {
  auto y = torch::zeros({4, 8});
  const auto st = stats_of(y);
  ActivationSignals s(y, st);
  s.step = 9;
  s.dead_since = 9;
  s.dead_activity = 0.01;
  torchdbg::DeadUnitsRule rule;
  CHECK(rule.options().fraction() == 0.5);
  CHECK_FALSE(rule.check_activation(s));  // not measured (NaN): no judgement
  s.dead_fraction = 0.5;
  CHECK_FALSE(rule.check_activation(s));  // at the threshold: not above it
  s.dead_fraction = 0.75;
  auto f = rule.check_activation(s);
  REQUIRE(f);
  CHECK(f->kind == FailureKind::DeadUnits);
  CHECK(f->value == 0.75);
  CHECK(f->threshold == 0.5);
  CHECK(f->margin == Approx(0.5));
  CHECK_FALSE(f->since);
  CHECK(f->reason == "units active in fewer than 1% of samples");
  s.dead_since = 7;
  f = rule.check_activation(s);
  REQUIRE(f->since);
  CHECK(*f->since == 7);
  CHECK(f->details["since"] == 7);
  torchdbg::DeadUnitsRule strict(torchdbg::DeadUnitsRuleOptions().fraction(0.8));
  CHECK_FALSE(strict.check_activation(s));
}

TEST_CASE("saturation rule: above its fraction, worded for outputs and pre-activations", "[rules]") {
  auto y = torch::zeros({4});
  const auto st = stats_of(y);
  ActivationSignals s(y, st);
  s.kind = "tanh";
  torchdbg::SaturationRule rule;
  s.saturated_fraction = 0.25;
  CHECK_FALSE(rule.check_activation(s));
  s.saturated_fraction = 0.625;
  auto f = rule.check_activation(s);
  REQUIRE(f);
  CHECK(f->kind == FailureKind::Saturation);
  CHECK(f->margin == Approx(0.5));
  CHECK(f->reason == "tanh output saturated");
  s.pre_activation = true;
  CHECK(rule.check_activation(s)->reason == "tanh pre-activation beyond its saturation bound");
  CHECK_FALSE(torchdbg::SaturationRule(torchdbg::SaturationRuleOptions().fraction(0.7)).check_activation(s));
}

TEST_CASE("exploding-activation rule: an absolute gain, widened by a grown baseline, narrowed by a small one", "[rules]") {
  auto y = torch::zeros({4});
  const auto st = stats_of(y);
  ActivationSignals s(y, st);
  torchdbg::ExplodingActivationRule rule;
  s.gain = 11.0;
  CHECK_FALSE(rule.check_activation(s));  // not a module output (an activation or a norm)
  s.module_output = true;
  auto f = rule.check_activation(s);
  REQUIRE(f);
  CHECK(f->kind == FailureKind::ExplodingActivation);
  CHECK(f->threshold == 10.0);
  CHECK(f->margin == Approx(std::log10(1.1) / (std::log10(1.1) + 0.5)));
  // A head whose gain grew to 6 while it learned: 11 is no explosion, 3x its history is.
  s.gain_baseline = 6.0;
  CHECK_FALSE(rule.check_activation(s));
  s.gain = 17.9;
  CHECK_FALSE(rule.check_activation(s));
  s.gain = 19.0;
  f = rule.check_activation(s);
  REQUIRE(f);
  CHECK(f->threshold == Approx(18.0));
  CHECK(f->details["gain_baseline"] == 6.0);
  // A baseline of 0.5: a 10x jump (5) counts below the absolute limit of 10.
  s.gain_baseline = 0.5;
  s.gain = 4.9;
  CHECK_FALSE(rule.check_activation(s));
  s.gain = 5.1;
  REQUIRE(rule.check_activation(s));
  CHECK(rule.check_activation(s)->threshold == Approx(5.0));
  // A small baseline: the limit is 10x it, but never below min_gain.
  s.gain_baseline = 0.1;
  s.gain = 1.9;
  CHECK_FALSE(rule.check_activation(s));
  s.gain = 2.5;
  REQUIRE(rule.check_activation(s));
  CHECK(rule.check_activation(s)->threshold == 2.0);
  s.gain = std::nan("");
  CHECK_FALSE(rule.check_activation(s));
}

TEST_CASE("constant-output rule: std below a fraction of the RMS, finite outputs of 2+ elements", "[rules]") {
  torchdbg::ConstantOutputRule rule;
  auto judge = [&](const torch::Tensor& y) {
    const auto st = stats_of(y);
    ActivationSignals s(y, st);
    s.rms = std::sqrt(st.mean * st.mean + st.std * st.std);
    return rule.check_activation(s);
  };
  auto f = judge(torch::full({3, 4}, 0.5));
  REQUIRE(f);
  CHECK(f->kind == FailureKind::ConstantOutput);
  CHECK(f->value == 0.0);
  CHECK(f->margin == 1.0);
  CHECK(judge(torch::zeros({5})));  // all zeros: constant
  CHECK_FALSE(judge(torch::randn({3, 4})));
  CHECK_FALSE(judge(torch::full({1}, 2.0)));  // one element is no evidence
  auto nan = torch::full({4}, 0.5);
  nan[0] = std::nan("");
  CHECK_FALSE(judge(nan));
}

TEST_CASE("gradient rules: non-finite at the origin, exploding and vanishing by norm, ratio and baseline",
          "[rules]") {
  GradientSignals s;
  s.norm = 1.0;
  s.max_norm = 1.0;
  s.count = 100;
  torchdbg::NonFiniteGradientRule nf;
  torchdbg::ExplodingGradientRule ex;
  torchdbg::VanishingGradientRule va;
  CHECK_FALSE(nf.check_gradient(s));
  CHECK_FALSE(ex.check_gradient(s));
  CHECK_FALSE(va.check_gradient(s));
  s.non_finite = 5;
  s.origin = true;
  auto f = nf.check_gradient(s);
  REQUIRE(f);
  CHECK(f->value == Approx(0.05));
  CHECK(f->incident);
  s.origin = false;
  CHECK_FALSE(nf.check_gradient(s)->incident);
  s.non_finite = 0;
  s.norm = 2e3;
  CHECK_FALSE(ex.check_gradient(s));  // the layer's first norm: no growth to judge
  s.recent = 1500.0;                  // steady at its scale
  CHECK_FALSE(ex.check_gradient(s));
  s.recent = 150.0;  // grown 13x and above 1e3
  f = ex.check_gradient(s);
  REQUIRE(f);
  CHECK(f->threshold == 1.5e3);
  CHECK(f->details.at("recent") == 150.0);
  s.recent = 1.0;  // the absolute limit is the floor of the growth limit
  f = ex.check_gradient(s);
  REQUIRE(f);
  CHECK(f->threshold == 1e3);
  s.norm = 900.0;
  CHECK_FALSE(ex.check_gradient(s));
  CHECK(torchdbg::ExplodingGradientRule(torchdbg::ExplodingGradientRuleOptions().norm(500.0))
            .check_gradient(s));
  s.recent = std::nan("");
  s.norm = 50.0;
  CHECK_FALSE(ex.check_gradient(s));
  s.baseline = 0.4;  // 50 > 100 * 0.4
  f = ex.check_gradient(s);
  REQUIRE(f);
  CHECK(f->threshold == Approx(40.0));
  s.norm = 1e-8;
  s.baseline = std::nan("");
  f = va.check_gradient(s);
  REQUIRE(f);
  CHECK(f->threshold == Approx(1e-4));  // the larger limit: 1e-4 of the step's largest norm
  s.norm = 5e-5;
  s.max_norm = 1.0;
  CHECK(va.check_gradient(s));
  s.max_norm = 0.1;
  CHECK_FALSE(va.check_gradient(s));
  s.baseline = 1.0;  // 5e-5 < 1 / 1e4
  CHECK(va.check_gradient(s));
  CHECK_FALSE(torchdbg::VanishingGradientRule(torchdbg::VanishingGradientRuleOptions().collapse(1e5))
                  .check_gradient(s));
}

TEST_CASE("loss rules: divergence, a spike from the second loss on, a plateau over its window", "[rules]") {
  std::vector<double> history;
  torchdbg::LossDivergenceRule div;
  torchdbg::LossSpikeRule spike;
  torchdbg::LossPlateauRule plateau(torchdbg::LossPlateauRuleOptions().window(4).tolerance(1e-3));
  {
    LossSignals s(std::nan(""), history);
    CHECK(div.check_loss(s));
    CHECK_FALSE(spike.check_loss(s));
  }
  {
    LossSignals s(5.0, history);  // no earlier loss: no spike
    s.first_loss = 5.0;
    CHECK_FALSE(spike.check_loss(s));
  }
  history = {1.0, 1.2};
  {
    LossSignals s(11.5, history);
    s.first_loss = 1.0;
    auto f = spike.check_loss(s);
    REQUIRE(f);
    CHECK(f->threshold == Approx(11.0));
    CHECK(f->details["recent_mean"] == Approx(1.1));
    LossSignals t(10.9, history);
    t.first_loss = 1.0;
    CHECK_FALSE(spike.check_loss(t));
  }
  {
    // A loss near zero: the mean is floored at 10% of the first loss, so one hard batch of a
    // converged model (0.08 -> 0.9 with a first loss of 1.4) is no spike; 1.5 is.
    std::vector<double> tiny{0.08, 0.09, 0.085};
    LossSignals s(0.9, tiny);
    s.first_loss = 1.4;
    CHECK_FALSE(spike.check_loss(s));
    LossSignals t(1.5, tiny);
    t.first_loss = 1.4;
    auto f = spike.check_loss(t);
    REQUIRE(f);
    CHECK(f->threshold == Approx(1.4));
    torchdbg::LossSpikeRule loose(torchdbg::LossSpikeRuleOptions().floor(0.0));
    CHECK(loose.check_loss(s));
  }
  {
    std::vector<double> flat{2.0, 2.0, 2.0};
    LossSignals s(2.0, flat);
    auto f = plateau.check_loss(s);
    REQUIRE(f);
    CHECK(f->kind == FailureKind::LossPlateau);
    CHECK(f->value == 0.0);
    std::vector<double> falling{4.0, 3.0, 2.0};
    LossSignals t(1.0, falling);
    CHECK_FALSE(plateau.check_loss(t));
    std::vector<double> short_history{2.0, 2.0};
    LossSignals u(2.0, short_history);
    CHECK_FALSE(plateau.check_loss(u));  // 3 losses < window 4
  }
}

TEST_CASE("property: the plateau rule's relative improvement is the two half-window means' against a double loop",
          "[rules]") {
  std::mt19937 rng(20261203);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  int found = 0, passed = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int window = 4 + static_cast<int>(u(rng) * 60);  // odd and even windows
    const double tolerance = std::pow(10.0, -1.0 - 4.0 * u(rng));
    torchdbg::LossPlateauRule rule(torchdbg::LossPlateauRuleOptions().window(window).tolerance(tolerance));
    // Flat, slowly falling, noisy or large-offset losses; histories shorter and longer than the window.
    const int n = static_cast<int>(u(rng) * 2.5 * window);
    const double offset = u(rng) < 0.3 ? 1e6 : 1.0, slope = u(rng) < 0.5 ? 0.0 : -1e-3 * u(rng);
    const double noise = u(rng) < 0.5 ? 0.0 : std::pow(10.0, -6.0 * u(rng));
    std::vector<double> history;
    for (int i = 0; i < n; ++i) history.push_back(offset * (1.0 + slope * i + noise * (u(rng) - 0.5)));
    const double loss = offset * (1.0 + slope * n + noise * (u(rng) - 0.5));
    LossSignals s(loss, history);
    const auto f = rule.check_loss(s);
    if (n + 1 < window) {
      CHECK_FALSE(f);
      continue;
    }
    std::vector<double> all(history.end() - (window - 1), history.end());
    all.push_back(loss);
    long double a = 0, b = 0;
    for (int i = 0; i < window; ++i) (i < window / 2 ? a : b) += all[static_cast<std::size_t>(i)];
    a /= window / 2;
    b /= window - window / 2;
    const double rel = static_cast<double>((a - b) / std::max<long double>(std::fabs(a), 1e-12L));
    const double slack = 1e-12 * offset / std::max(std::fabs(static_cast<double>(a)), 1e-12);
    if (std::fabs(std::fabs(rel) - tolerance) <= slack) continue;  // on the boundary: either verdict
    CHECK(static_cast<bool>(f) == (std::fabs(rel) < tolerance));
    if (f) {
      ++found;
      CHECK(f->value == Approx(rel).margin(slack));
    } else {
      ++passed;
    }
  }
  CHECK(found > 40);
  CHECK(passed > 40);
}

TEST_CASE("property: a steadily growing loss diverges, by a reference loop over random loss sequences", "[rules]") {
  // The reference: the definition read off the whole sequence (a loss above `growth` x the
  // lowest of the `window` before it and `floor` x the first, risen on `rising` of its last
  // `rising_of` steps or above that threshold on all of them; any loss <= 0 in that window:
  // no verdict).
  const auto reference = [](const std::vector<double>& seq, std::size_t t, double growth, std::size_t window,
                            double floor, int rising, std::size_t rising_of) {
    const std::size_t steps = std::min(t, rising_of);
    if (steps < 3 || !(seq[t] > 0.0)) return false;
    const std::size_t from = t > window ? t - window : 0;
    const std::vector<double> before(seq.begin() + static_cast<std::ptrdiff_t>(from),
                                     seq.begin() + static_cast<std::ptrdiff_t>(t));
    if (std::any_of(before.begin(), before.end(), [](double v) { return !(v > 0.0); })) return false;
    const double lowest = *std::min_element(before.begin(), before.end());
    int rises = 0;
    for (std::size_t k = t + 1 - steps; k <= t; ++k) rises += seq[k] > seq[k - 1];
    const double share = static_cast<double>(rises) / static_cast<double>(steps);
    const bool sustained = std::all_of(seq.begin() + static_cast<std::ptrdiff_t>(t - steps),
                                       seq.begin() + static_cast<std::ptrdiff_t>(t),
                                       [&](double v) { return v > growth * lowest; });
    return seq[t] > growth * lowest && seq[t] > floor * std::fabs(seq[0]) &&
           (sustained || share >= static_cast<double>(rising) / static_cast<double>(rising_of) - 1e-12);
  };
  std::mt19937 rng(20261207);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::normal_distribution<double> z(0.0, 1.0);
  int healthy_runs = 0, diverging_runs = 0, signed_runs = 0, flagged_steps = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const bool defaults = trial % 3 != 0;
    const double growth = defaults ? 100.0 : std::pow(10.0, 0.5 + 2.5 * u(rng));  // 0, the default, is off
    const std::size_t window = defaults ? 100 : 2 + static_cast<std::size_t>(u(rng) * 150);
    const double floor = defaults ? 10.0 : (u(rng) < 0.3 ? 0.0 : 30.0 * u(rng));
    const std::size_t rising_of = defaults ? 12 : 2 + static_cast<std::size_t>(u(rng) * 20);
    const int rising = defaults ? 9 : static_cast<int>(u(rng) * static_cast<double>(rising_of + 1));
    torchdbg::LossDivergenceRule rule(torchdbg::LossDivergenceRuleOptions()
                                          .growth(growth)
                                          .window(static_cast<int64_t>(window))
                                          .floor(floor)
                                          .rising(rising)
                                          .rising_of(static_cast<int64_t>(rising_of)));
    // healthy: falling towards a floor with log-normal batch noise and rare spikes;
    // diverging: the same, then growing r x a step; signed: a loss that crosses 0 or sits at 0.
    const int family = trial % 4 == 3 ? 2 : trial % 2;
    const int n = 150 + static_cast<int>(u(rng) * 350), onset = 20 + static_cast<int>(u(rng) * 180);
    const double l0 = std::pow(10.0, -3.0 + 6.0 * u(rng)), fall = std::log(10.0) * 6.0 * u(rng);
    const double tau = 5.0 + 100.0 * u(rng), sigma = 0.5 * u(rng), r = 1.1 + 0.9 * u(rng);
    const double sigma_d = 0.05 * u(rng);
    std::vector<double> seq;
    for (int t = 0; t < n; ++t) {
      double log_l = std::log(l0) - fall * (1.0 - std::exp(-t / tau));
      if (family == 1 && t >= onset)
        log_l = std::log(l0) - fall * (1.0 - std::exp(-onset / tau)) + (t - onset) * std::log(r) + sigma_d * z(rng);
      else
        log_l += sigma * z(rng) + (u(rng) < 0.02 ? std::log(2.0 + 6.0 * u(rng)) : 0.0);
      double l = std::exp(log_l);
      if (family == 2) l = u(rng) < 0.1 ? 0.0 : l * (u(rng) < 0.3 ? -1.0 : 1.0);
      if (!std::isfinite(l)) break;
      seq.push_back(l);
    }
    int first_flag = -1;
    std::vector<double> history;
    for (std::size_t t = 0; t < seq.size(); ++t) {
      LossSignals s(seq[t], history);
      s.step = static_cast<int64_t>(t);
      s.first_loss = std::fabs(seq[0]);
      const auto f = rule.check_loss(s);
      const bool want = reference(seq, t, growth, window, floor, rising, rising_of);
      // A loss exactly on the threshold (a product's last bit): either verdict.
      const std::size_t from = t > window ? t - window : 0;
      bool edge = false;
      if (t > from) {
        const double lowest = *std::min_element(seq.begin() + static_cast<std::ptrdiff_t>(from),
                                                seq.begin() + static_cast<std::ptrdiff_t>(t));
        for (std::size_t k = t >= rising_of ? t - rising_of : 0; k <= t; ++k)
          edge = edge || std::fabs(seq[k] / (growth * lowest) - 1.0) < 1e-12;
      }
      if (!edge) CHECK(static_cast<bool>(f) == want);
      if (f) {
        ++flagged_steps;
        CHECK(f->kind == FailureKind::LossDivergence);
        CHECK(f->value == seq[t]);
        CHECK(f->details["growth"].get<double>() > growth * (1.0 - 1e-12));
        CHECK(f->margin >= 0.0);
        CHECK(f->margin <= 1.0);
        if (first_flag < 0) first_flag = static_cast<int>(t);
      }
      history.push_back(seq[t]);
    }
    if (!defaults) continue;
    if (family == 0) {
      ++healthy_runs;
      CHECK(first_flag == -1);  // a falling loss, however noisy or spiky, never diverges
    } else if (family == 1 && static_cast<int>(seq.size()) == n) {
      // Flagged no later than a few steps after the noiseless curve passes 3x both thresholds.
      int due = -1;
      for (int t = onset; t < n && due < 0; ++t) {
        const double clean = l0 * std::exp(-fall * (1.0 - std::exp(-onset / tau)) + (t - onset) * std::log(r));
        const std::size_t from = t > 100 ? static_cast<std::size_t>(t) - 100 : 0;
        const double lowest = *std::min_element(seq.begin() + static_cast<std::ptrdiff_t>(from), seq.begin() + t);
        if (clean > 3.0 * std::max(100.0 * lowest, 10.0 * std::fabs(seq[0]))) due = t;
      }
      if (due < 0) continue;
      ++diverging_runs;
      CHECK(first_flag >= onset);
      CHECK(first_flag != -1);
      CHECK(first_flag <= due + 12);
    } else if (family == 2) {
      ++signed_runs;
      CHECK(first_flag == -1);  // a zero or negative loss in every window: no scale to grow from
    }
  }
  CHECK(healthy_runs > 100);
  CHECK(diverging_runs > 60);
  CHECK(signed_runs > 50);
  CHECK(flagged_steps > 500);
}

TEST_CASE("loss divergence options: invalid windows and counts are rejected by name", "[rules]") {
  using torchdbg::LossDivergenceRuleOptions;
  torchdbg::LossDivergenceRule off;  // the default: NaN/Inf only
  std::vector<double> rising_history{1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0};
  LossSignals grown(1e6, rising_history);
  grown.first_loss = 1.0;
  CHECK_FALSE(off.check_loss(grown));
  CHECK(torchdbg::LossDivergenceRule(LossDivergenceRuleOptions().growth(100.0)).check_loss(grown));
  for (const double bad : {0.5, -1.0, 1.0, 0.9999999, std::nan("")})
    CHECK_THROWS_WITH(torchdbg::LossDivergenceRule(LossDivergenceRuleOptions().growth(bad)),
                      Catch::Contains("growth must be 0 (off) or > 1, got " + torchdbg::detail::number_text(bad)));
  for (const double bad : {-1.0, -1e-9, std::nan("")})
    CHECK_THROWS_WITH(torchdbg::LossDivergenceRule(LossDivergenceRuleOptions().floor(bad)),
                      Catch::Contains("floor must be >= 0, got " + torchdbg::detail::number_text(bad)));
  CHECK_THROWS_WITH(torchdbg::LossDivergenceRule(LossDivergenceRuleOptions().window(1)),
                    Catch::Contains("window >= 2") && Catch::Contains("window 1"));
  CHECK_THROWS_WITH(torchdbg::LossDivergenceRule(LossDivergenceRuleOptions().rising(13)),
                    Catch::Contains("rising 13 of 12"));
  CHECK_THROWS_WITH(torchdbg::LossDivergenceRule(LossDivergenceRuleOptions().rising_of(1).rising(1)),
                    Catch::Contains("rising 1 of 1"));
  CHECK_THROWS_WITH(HealthMonitor(HealthOptions().loss_growth(0.9999999)),
                    Catch::Contains("loss_growth must be 0 (off) or > 1, got 0.9999999"));
  CHECK_THROWS_WITH(HealthMonitor(HealthOptions().loss_growth_window(1)), Catch::Contains("loss_growth_window"));
  CHECK_THROWS_WITH(HealthMonitor(HealthOptions().loss_growth_floor(-1e-9)),
                    Catch::Contains("loss_growth_floor must be >= 0, got -1e-09"));
  CHECK_NOTHROW(HealthMonitor(HealthOptions().loss_growth(0.0)));
}

TEST_CASE("the built-in rules take their thresholds from HealthOptions, in evaluation order", "[rules]") {
  const auto rules = torchdbg::builtin_health_rules(HealthOptions().dead_fraction(0.7).saturated_fraction(0.4));
  std::vector<std::string> names;
  for (const auto& r : rules) names.push_back(r->name());
  CHECK(names == std::vector<std::string>{"non_finite_output", "dead_units", "saturation", "exploding_activation",
                                          "constant_output", "norm_weight_collapse", "norm_statistics",
                                          "non_finite_gradient", "exploding_gradient",
                                          "vanishing_gradient", "loss_divergence", "loss_spike", "loss_plateau"});
  CHECK(dynamic_cast<const torchdbg::DeadUnitsRule&>(*rules[1]).options().fraction() == 0.7);
  CHECK(dynamic_cast<const torchdbg::SaturationRule&>(*rules[2]).options().fraction() == 0.4);
  HealthMonitor m(HealthOptions().rules({std::make_shared<MeanDrift>(3.0)}));
  auto listed = m.rule_names();
  REQUIRE(listed.size() == names.size() + 1);
  CHECK(listed.back() == "mean_drift");
}

TEST_CASE("a user rule's findings become states, events, incidents, pauses and hypotheses", "[rules]") {
  auto drift = std::make_shared<MeanDrift>(3.0);
  HealthMonitor m(HealthOptions()
                      .rules({drift})
                      .on_failure(torchdbg::OnFailure::Pause)
                      .pause_on({FailureKind::Custom}));
  std::vector<std::string> paused;
  m.set_pause_callback([&](int64_t, const std::string& layer, const std::string& reason) {
    paused.push_back(layer + ": " + reason);
  });
  ActivationInfo module_output;
  module_output.input_rms = 1.0;
  for (int64_t step = 0; step < 4; ++step) m.observe_activation("fc1", torch::randn({32, 8}), step, module_output);
  CHECK(m.incidents().empty());
  CHECK(drift->calls == 4);
  // The output moves far from zero (a bias of +20), with its spread unchanged.
  for (int64_t step = 4; step < 7; ++step)
    m.observe_activation("fc1", torch::randn({32, 8}) + 20.0, step, module_output);
  const auto l = m.layer("fc1");
  CHECK(l->activation == ActivationHealth::Anomalous);
  CHECK(l->activation_since == 4);
  const auto incidents = m.incidents();
  REQUIRE(incidents.size() == 1);
  const auto& inc = incidents[0];
  CHECK(inc.kind == FailureKind::Custom);
  CHECK(inc.layer == "fc1");
  CHECK(inc.step == 4);
  CHECK(inc.last_step == 6);
  CHECK(inc.persisted == 3);
  CHECK(inc.details["rule"] == "mean_drift");
  CHECK(inc.details["label"] == "mean_drift");
  CHECK(inc.value > 3.0);
  CHECK(inc.threshold == 3.0);
  const auto anomalies = [&] {
    std::size_t n = 0;
    for (const auto& e : m.events())
      if (e.type == EventType::ActivationAnomaly && e.metadata.value("label", "") == "mean_drift") ++n;
    return n;
  }();
  CHECK(anomalies == 1);
  REQUIRE(paused.size() == 1);
  CHECK(paused[0] == "fc1: torchdbg health: mean_drift at 'fc1' (step 4)");
  REQUIRE(m.failure_report());
  CHECK(m.failure_report()->incidents.size() == 1);
  CHECK(m.failure_report()->incidents[0].details["rule"] == "mean_drift");
  const auto d = torchdbg::diagnose(m);
  REQUIRE(d.top() != nullptr);
  CHECK(d.top()->kind == FailureKind::Custom);
  CHECK(d.top()->layer == "fc1");
  CHECK(d.top()->description.find("mean_drift at 'fc1' from step 4") != std::string::npos);
  CHECK(d.top()->description.find("far from zero") != std::string::npos);
  CHECK(d.top()->tier() == 1);
  // Back to normal: a recovery event, and a later drift is a new incident.
  m.observe_activation("fc1", torch::randn({32, 8}), 7, module_output);
  CHECK(m.layer("fc1")->activation == ActivationHealth::Normal);
  m.observe_activation("fc1", torch::randn({32, 8}) - 30.0, 8, module_output);
  CHECK(m.incidents().size() == 2);
}

TEST_CASE("property: a layer called several times a step has the step's finding; one incident per run of steps",
          "[rules]") {
  // A recurrent cell or a discriminator: 1-5 calls a step (now and then 6-15 under one step
  // number, as auto_step gives without a backward pass), the user rule's finding on some of
  // them, step numbers that restart (epochs) or stay for another block (evaluation beside
  // training), blocks with gradients off. Reference, by the layer's steps: a call without the
  // finding keeps it when the finding was made with gradients on and this call has them on,
  // and either a call of this step had it (from the layer's second step on) or the layer made
  // several calls with gradients on in some step; a step in which such a call kept it and none
  // had it ends it when the step ends. Otherwise a call without it ends it. A call with
  // gradients off that has it continues it, but does not keep it past a step whose training
  // calls had it not.
  std::mt19937 rng(20261207);
  for (int trial = 0; trial < 60; ++trial) {
    INFO("trial " << trial);
    auto drift = std::make_shared<MeanDrift>(3.0);
    HealthMonitor m(HealthOptions().rules({drift}));
    struct Run {
      int64_t first, last, steps;
    };
    std::vector<Run> expected;
    bool active = false, seen = false, hit_in_step = false, trained = false, found_grad = false, deferred = false;
    int64_t recoveries = 0, calls = 0, calls_prev = 0, calls_most = 0, step = 0;
    const auto settle = [&] {  // the step ends
      if (deferred && active && !trained) {
        active = false;
        ++recoveries;
      }
      deferred = false;
    };
    const int blocks = 12 + static_cast<int>(rng() % 20);
    for (int block = 0; block < blocks; ++block) {
      const uint32_t r = rng() % 12;
      const int64_t number = block == 0 ? 0 : r == 0 ? 0 : r <= 2 ? step : step + 1;  // 0: an epoch restarts
      const bool stuck = rng() % 10 == 0;
      const int n = stuck ? 6 + static_cast<int>(rng() % 10) : 1 + static_cast<int>(rng() % 5);
      const bool failing = block >= 3 && rng() % 3 != 0;
      const bool grad_on = rng() % 5 != 0;
      torch::AutoGradMode mode(grad_on);
      for (int call = 0; call < n; ++call) {
        const bool hit = failing && rng() % 2 == 0;
        if (!seen || number != step) {
          if (seen) settle();
          calls_prev = calls;
          calls = 0;
          hit_in_step = trained = false;
        }
        step = number;
        if (grad_on) calls_most = std::max(calls_most, ++calls);
        ActivationInfo info;
        info.input_rms = 1.0;
        info.call = call;
        m.observe_activation("cell", torch::randn({32, 8}) + (hit ? 20.0 : 0.0), step, info);
        if (hit) {
          if (!active) {
            expected.push_back({step, step, 1});
            found_grad = grad_on;
            deferred = false;
          } else {
            if (!hit_in_step) ++expected.back().steps;
            found_grad = found_grad || grad_on;
          }
          expected.back().last = step;
          active = true;
          hit_in_step = true;
          trained = trained || grad_on;
        } else if (active && seen) {
          const bool held = found_grad && grad_on && (trained ? calls_prev > 0 : calls_most > 1);
          if (held && !trained) deferred = true;
          if (!held) {
            active = false;
            deferred = false;
            ++recoveries;
          }
        }
        seen = true;
      }
    }
    m.flush();
    settle();
    const auto incidents = m.incidents();
    REQUIRE(incidents.size() == expected.size());
    for (std::size_t i = 0; i < incidents.size(); ++i) {
      INFO("incident " << i);
      CHECK(incidents[i].kind == FailureKind::Custom);
      CHECK(incidents[i].layer == "cell");
      CHECK(incidents[i].step == expected[i].first);
      CHECK(incidents[i].last_step == expected[i].last);
      CHECK(incidents[i].persisted == expected[i].steps);
    }
    std::size_t anomalies = 0, recovered = 0;
    for (const auto& e : m.events()) {
      anomalies += e.type == EventType::ActivationAnomaly;
      recovered += e.type == EventType::ActivationRecovered;
    }
    CHECK(anomalies == expected.size());
    CHECK(static_cast<int64_t>(recovered) == recoveries);
    CHECK((m.layer("cell")->activation == ActivationHealth::Anomalous) == active);
  }
}

TEST_CASE("a cell, a discriminator and bucketed lengths: one incident per failure; evaluation batches each judged",
          "[rules]") {
  struct Counts {
    std::vector<torchdbg::Incident> incidents;
    std::size_t failures = 0, recoveries = 0;
  };
  // `hit(step, call)`: the output is 20 off zero (the user rule's finding), or NaN (`nan`).
  const auto run = [](const std::vector<int>& lengths, const std::function<bool(int64_t, int)>& hit, bool nan,
                      bool grad_on = true, bool advance = true) {
    torch::manual_seed(3);
    HealthMonitor m(HealthOptions().rules({std::make_shared<MeanDrift>(3.0)}));
    torch::AutoGradMode mode(grad_on);
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      const int64_t step = advance ? static_cast<int64_t>(i) : 0;
      for (int call = 0; call < lengths[i]; ++call) {
        ActivationInfo info;
        info.input_rms = 1.0;
        info.call = call;
        auto y = torch::randn({32, 8});
        if (hit(static_cast<int64_t>(i), call)) {
          if (nan) {
            y[0][0] = std::nan("");
          } else {
            y += 20.0;
          }
        }
        m.observe_activation("cell", y, step, info);
      }
    }
    m.flush();  // the end of training: the last step is over
    Counts c;
    c.incidents = m.incidents();
    for (const auto& e : m.events()) {
      c.failures += e.type == EventType::ActivationAnomaly || e.type == EventType::NonFiniteActivation;
      c.recoveries += e.type == EventType::ActivationRecovered;
    }
    return c;
  };
  const std::vector<int> four(14, 4);
  // A cell flagged on every other time step from step 5 to 11, then healthy.
  auto c = run(four, [](int64_t s, int k) { return s >= 5 && s <= 11 && k % 2 == 0; }, false);
  REQUIRE(c.incidents.size() == 1);
  CHECK(c.incidents[0].step == 5);
  CHECK(c.incidents[0].last_step == 11);
  CHECK(c.incidents[0].persisted == 7);
  CHECK(c.failures == 1);
  CHECK(c.recoveries == 1);
  // A discriminator: the real batch clean, the two generated ones flagged.
  c = run(std::vector<int>(14, 3), [](int64_t s, int k) { return s >= 5 && s <= 11 && k > 0; }, false);
  REQUIRE(c.incidents.size() == 1);
  CHECK(c.incidents[0].last_step == 11);
  CHECK(c.recoveries == 1);
  // A cell NaN from its 4th time step on (the built-in non-finite rule).
  c = run(four, [](int64_t s, int k) { return s >= 5 && s <= 11 && k >= 3; }, true);
  REQUIRE(c.incidents.size() == 1);
  CHECK(c.incidents[0].kind == FailureKind::NonFiniteOutput);
  CHECK(c.incidents[0].persisted == 7);
  CHECK(c.failures == 1);
  // Bucketed lengths, growing past every earlier step's: flagged on calls 3 and 20 of each;
  // then on the last time step of each, whatever its length; then a clean step ends it.
  c = run({5, 5, 40, 5, 40, 64, 32}, [](int64_t s, int k) { return s >= 2 && (k == 3 || k == 20); }, false);
  REQUIRE(c.incidents.size() == 1);
  CHECK(c.incidents[0].step == 2);
  CHECK(c.incidents[0].last_step == 6);
  CHECK(c.recoveries == 0);
  const std::vector<int> buckets = {3, 4, 5, 6, 8, 3, 10, 16, 7, 12};
  c = run(buckets, [&](int64_t s, int k) { return s >= 1 && s <= 8 && k == buckets[static_cast<std::size_t>(s)] - 1; },
          false);
  REQUIRE(c.incidents.size() == 1);
  CHECK(c.incidents[0].step == 1);
  CHECK(c.incidents[0].last_step == 8);
  CHECK(c.incidents[0].persisted == 8);
  CHECK(c.recoveries == 1);  // at step 9's end (flush), when its last call is in
  // Evaluation under NoGradGuard, one step number for every batch: NaN on batches 3 and 8,
  // each batch judged on its own.
  c = run(std::vector<int>(12, 1), [](int64_t b, int) { return b == 3 || b == 8; }, true, false, false);
  CHECK(c.failures == 2);
  CHECK(c.recoveries == 2);
  // A validation batch (gradients off) flagged, then the step's training call clean: the
  // validation finding is its own; the next step's flagged training call is a new incident.
  {
    HealthMonitor m(HealthOptions().rules({std::make_shared<MeanDrift>(3.0)}));
    ActivationInfo info;
    info.input_rms = 1.0;
    for (int64_t step = 0; step < 6; ++step) {
      if (step == 3) {
        torch::NoGradGuard no_grad;
        for (int batch = 0; batch < 4; ++batch)
          m.observe_activation("fc", torch::randn({32, 8}) + (batch == 3 ? 20.0 : 0.0), step, info);
      }
      m.observe_activation("fc", torch::randn({32, 8}) + (step == 4 ? 20.0 : 0.0), step, info);
    }
    const auto incidents = m.incidents();
    REQUIRE(incidents.size() == 2);
    CHECK(incidents[0].step == 3);
    CHECK(incidents[0].last_step == 3);
    CHECK(incidents[1].step == 4);
    CHECK(m.layer("fc")->activation == ActivationHealth::Normal);
  }
  // A step whose training calls are clean and whose evaluation call is flagged: the evaluation
  // batch continues the finding, which ends with the step, in either order.
  for (const bool eval_first : {false, true}) {
    INFO("evaluation first: " << eval_first);
    HealthMonitor m(HealthOptions().rules({std::make_shared<MeanDrift>(3.0)}));
    ActivationInfo info;
    info.input_rms = 1.0;
    const auto call = [&](int64_t step, bool flagged, bool grad) {
      torch::AutoGradMode mode(grad);
      m.observe_activation("cell", torch::randn({32, 8}) + (flagged ? 20.0 : 0.0), step, info);
    };
    for (int k = 0; k < 2; ++k) call(0, false, true);
    for (int k = 0; k < 2; ++k) call(1, true, true);
    if (eval_first) call(2, true, false);
    call(2, false, true);
    if (!eval_first) call(2, true, false);
    for (int k = 0; k < 2; ++k) call(3, false, true);
    m.flush();
    const auto incidents = m.incidents();
    REQUIRE(incidents.size() == 1);
    CHECK(incidents[0].step == 1);
    CHECK(incidents[0].last_step == 2);
    std::vector<int64_t> recovered;
    for (const auto& e : m.events())
      if (e.type == EventType::ActivationRecovered) recovered.push_back(e.step);
    CHECK(recovered == std::vector<int64_t>{2});
    CHECK(m.layer("cell")->activation == ActivationHealth::Normal);
  }
}

TEST_CASE("built-in rules come first: a user rule judges only what none of them flags", "[rules]") {
  auto drift = std::make_shared<MeanDrift>(0.0);  // flags every module output with a spread
  HealthMonitor m(HealthOptions().rules({drift}).dead_window_samples(16));
  ActivationInfo info = act("relu");
  // A dead ReLU layer: dead units, whatever the user rule would say (it sees no module output).
  m.observe_activation("fc/relu", torch::zeros({16, 4}), 0, info);
  CHECK(m.layer("fc/relu")->activation == ActivationHealth::Dead);
  // An exploding module output: the built-in explosion, not the user rule's finding.
  ActivationInfo mod;
  mod.input_rms = 1e-3;
  m.observe_activation("fc", torch::randn({16, 4}), 1, mod);
  REQUIRE(m.incidents().size() == 2);
  CHECK(m.incidents()[1].kind == FailureKind::ExplodingActivation);
  CHECK(m.incidents()[1].details["rule"] == "exploding_activation");
}

TEST_CASE("user rules on gradients and on the loss: anomalous states and their events", "[rules]") {
  HealthMonitor m;
  m.add_rule(std::make_shared<Budget>());
  m.observe_gradient("fc", "weight", torch::full({4}, 1.0), 0);  // norm 2
  m.end_backward();
  CHECK(m.layer("fc")->gradient == GradientHealth::Healthy);
  m.observe_gradient("fc", "weight", torch::full({4}, 4.0), 1);  // norm 8 > 5
  m.end_backward();
  CHECK(m.layer("fc")->gradient == GradientHealth::Anomalous);
  m.observe_loss(1, 2.0);
  CHECK(m.loss_health() == LossHealth::Healthy);
  m.observe_loss(2, 4.0);
  CHECK(m.loss_health() == LossHealth::Anomalous);
  std::size_t grad_events = 0, loss_events = 0;
  for (const auto& e : m.events()) {
    if (e.type == EventType::GradientAnomaly) ++grad_events;
    if (e.type == EventType::LossAnomaly) ++loss_events;
  }
  CHECK(grad_events == 1);
  CHECK(loss_events == 1);
  CHECK(std::string(torchdbg::to_string(EventType::GradientAnomaly)) == "gradient_anomaly");
  CHECK(std::string(torchdbg::to_string(GradientHealth::Anomalous)) == "anomalous");
  const auto incidents = m.incidents();
  REQUIRE(incidents.size() == 2);
  CHECK(incidents[0].details["label"] == "gradient_budget");
  CHECK(incidents[0].phase == torchdbg::Phase::Backward);
  CHECK(incidents[1].details["label"] == "loss_budget");
  CHECK(incidents[1].layer == "loss");
}

TEST_CASE("a rule that throws is counted and judges nothing; null rules are rejected by position",
          "[rules]") {
  HealthMonitor m(HealthOptions().rules({std::make_shared<Throws>(), std::make_shared<MeanDrift>(3.0)}));
  ActivationInfo mod;
  mod.input_rms = 1.0;
  m.observe_activation("fc", torch::randn({8, 8}) + 50.0, 0, mod);  // Throws throws, MeanDrift flags it
  CHECK(m.rule_errors() == 1);
  REQUIRE(m.incidents().size() == 1);
  CHECK(m.incidents()[0].details["rule"] == "mean_drift");
  CHECK_THROWS_WITH(HealthMonitor(HealthOptions().rules({std::make_shared<MeanDrift>(1.0), nullptr})),
                    Catch::Contains("HealthOptions::rules[1] is null"));
  CHECK_THROWS_WITH(m.add_rule(nullptr), Catch::Contains("add_rule got a null rule"));
}

TEST_CASE("dead units are dated from the first output of their inactive run", "[rules]") {
  // 32 samples per output, a window of 64: confirmed one output after they die.
  HealthMonitor m(HealthOptions().dead_window_samples(64));
  const auto info = act("relu");
  for (int64_t step = 0; step < 5; ++step) m.observe_activation("fc/relu", torch::rand({32, 8}) + 0.1, step, info);
  for (int64_t step = 5; step < 8; ++step) m.observe_activation("fc/relu", torch::zeros({32, 8}), step, info);
  const auto incidents = m.incidents();
  REQUIRE(incidents.size() == 1);
  CHECK(incidents[0].kind == FailureKind::DeadUnits);
  CHECK(incidents[0].step == 5);                    // the units died at step 5
  CHECK(incidents[0].details["detected_step"] == 6);  // the window confirmed it at step 6
  CHECK(incidents[0].last_step == 7);
  CHECK(m.layer("fc/relu")->activation_since == 6);
  // Half the units die: the others' activity does not shorten the dead units' run.
  HealthMonitor h(HealthOptions().dead_window_samples(64));
  for (int64_t step = 0; step < 3; ++step) h.observe_activation("fc/relu", torch::rand({32, 8}) + 0.1, step, info);
  auto half = torch::rand({32, 8}) + 0.1;
  half.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, 6)}, 0.0);
  for (int64_t step = 3; step < 6; ++step) h.observe_activation("fc/relu", half, step, info);
  REQUIRE(h.incidents().size() == 1);
  CHECK(h.incidents()[0].step == 3);
}

TEST_CASE("an output whose gain grows steadily is no explosion; a jump over its history is", "[rules]") {
  HealthMonitor m;
  torchdbg_test::SeededRng rng(11);
  ActivationInfo mod;
  mod.input_rms = 1.0;
  double scale = 1.0;
  for (int64_t step = 0; step < 40; ++step) {  // from 1x to ~40x, 10% a step
    m.observe_activation("head", torch::randn({64, 4}) * scale, step, mod);
    scale *= 1.1;
  }
  CHECK(m.incidents().empty());
  m.observe_activation("head", torch::randn({64, 4}) * scale * 20.0, 40, mod);
  REQUIRE(m.incidents().size() == 1);
  CHECK(m.incidents()[0].kind == FailureKind::ExplodingActivation);
  CHECK(m.incidents()[0].step == 40);
}

TEST_CASE("an all-zero ReLU output is left to the dead-units rule; a constant non-zero one is constant",
          "[rules]") {
  torchdbg::ConstantOutputRule rule;
  auto zeros = torch::zeros({8, 4});
  const auto zs = stats_of(zeros);
  ActivationSignals s(zeros, zs);
  s.rms = 0.0;
  CHECK(rule.check_activation(s));  // an unknown kind: constant
  s.kind = "relu";
  CHECK_FALSE(rule.check_activation(s));
  auto half = torch::full({8, 4}, 0.5);
  const auto hs = stats_of(half);
  ActivationSignals h(half, hs);
  h.kind = "relu";
  h.rms = 0.5;
  CHECK(rule.check_activation(h));
}

TEST_CASE("a finding with NaN numbers gets a confidence in [0, 1] and a diagnosis", "[rules]") {
  HealthMonitor m(HealthOptions().rules({std::make_shared<Undefined>()}));
  ActivationInfo mod;
  mod.input_rms = 1.0;
  for (int64_t step = 0; step < 3; ++step) m.observe_activation("fc", torch::randn({8, 8}), step, mod);
  REQUIRE(m.incidents().size() == 1);
  const auto inc = m.incidents()[0];
  CHECK(inc.confidence >= 0.0);
  CHECK(inc.confidence <= 1.0);
  CHECK(inc.persisted == 3);
  const auto d = torchdbg::diagnose(m);
  REQUIRE(d.top() != nullptr);
  CHECK(d.top()->kind == FailureKind::Custom);
  CHECK(d.top()->confidence >= 0.0);
  CHECK(d.top()->confidence <= 1.0);
  CHECK_NOTHROW(d.to_json().dump());
  for (const auto& e : m.events()) CHECK(std::isfinite(e.confidence));
}
