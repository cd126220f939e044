// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// The diagnosis scenario suite: small models of six architectures (MLP, CNN with BatchNorm,
// residual MLP, LayerNorm/GELU blocks, LSTM, self-attention) trained with SGD or Adam, each
// either healthy or with one failure induced at a known step and layer. Every run is
// diagnosed with attach + HealthMonitor + diagnose(); a failure run is a hit when the top
// hypothesis names the induced kind at the induced module within two steps of the onset (see
// --window), and
// a healthy run is a hit when it raised no incident at all.
//
// Each induced failure is first checked with plain torch on the onset step's own tensors (the
// models record what their submodules returned), so a scenario that does not really produce
// its failure is reported as such instead of counting as a miss or a hit.
//
//   torchdbg_scenarios [--seeds N] [--only REGEX] [--min-accuracy F]
//                      [--min-scenario-accuracy F] [--by-kind] [--verbose]
//                      [--interval N] [--activation-interval N] [--alert-steps N]
//                      [--activation-budget F] [--late N] [--window N]
//
// --interval N and --activation-interval N run the monitor with HealthOptions().interval(N)
// (everything judged every N-th step) and .activation_interval(N) (gradients judged every
// step, forward outputs every N-th): what those options cost in accuracy; --alert-steps N sets
// HealthOptions::alert_steps. --activation-budget F runs with HealthOptions().activation_budget(F)
// (forward outputs judged as often as keeps their measured cost within F of a step: the
// interval each run chose is counted at the end; it measures on steps 10 to 29, so onsets after
// it need --late). --late N adds N healthy steps before every onset (baselines long
// settled; with an activation interval, onsets at every phase of it). --window N (default 2)
// counts a hit whose onset is up to N steps after the induced one, and runs N + 1 steps past
// it: what a failure seen only on judged steps needs.
//
// Prints one row per scenario (a Markdown table; --by-kind: one row per failure, with its
// scenarios' hits in one cell) and the totals. Exit status 1 when a ground
// truth check fails, a healthy run raises an incident, the failure accuracy is below
// --min-accuracy, or a scenario's is below --min-scenario-accuracy.
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <torchdbg/attach.hpp>
#include <torchdbg/diagnosis.hpp>
#include <vector>

namespace {

/// HealthOptions::interval and activation_interval of every run (--interval,
/// --activation-interval).
int64_t g_interval = 1;
int64_t g_activation_interval = 1;
int64_t g_alert_steps = -1;  // -1: the option's default
double g_activation_budget = 0.0;
std::map<int64_t, int64_t> g_chosen;  // activation_budget's interval -> runs
int64_t g_late = 0;          // steps added before every onset
int64_t g_window = 2;        // a hit's onset is at most this many steps after the induced one

using torchdbg::FailureKind;
namespace F = torch::nn::functional;

constexpr int64_t kClasses = 4;

enum class Arch { Mlp, Cnn, Residual, LayerNormGelu, Lstm, Attention, MlpBn };

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::Mlp:
      return "MLP";
    case Arch::Cnn:
      return "CNN+BN";
    case Arch::Residual:
      return "residual";
    case Arch::LayerNormGelu:
      return "LN/GELU";
    case Arch::Lstm:
      return "LSTM";
    case Arch::Attention:
      return "attention";
    case Arch::MlpBn:
      return "MLP+BN";
  }
  return "?";
}

enum class Act { Relu, Tanh, Sigmoid };

/// A model that records what its submodules returned on the step it is asked to (the ground
/// truth, taken with no torchdbg code involved).
struct Model : torch::nn::Module {
  virtual torch::Tensor forward(torch::Tensor x) = 0;
  /// A batch of `n` inputs.
  virtual torch::Tensor input(int64_t n) const = 0;
  /// What each submodule received and returned on a recorded step.
  std::map<std::string, torch::Tensor> out, in;
  std::vector<std::string> order;  // the recorded submodules in forward order
  bool record = false;
  torch::Tensor rec(const std::string& name, const torch::Tensor& input_tensor,
                    const torch::Tensor& output) {
    // Only the handles are kept (no operator runs): an operator reading the output here
    // would come between the module and its activation.
    if (record) {
      if (!out.count(name)) order.push_back(name);
      in[name] = input_tensor;
      out[name] = output;
    }
    return output;
  }
  /// The Linear (or other) submodule called `name`, for inducing failures.
  torch::Tensor weight(const std::string& name) { return param(name + ".weight"); }
  torch::Tensor bias(const std::string& name) { return param(name + ".bias"); }
  torch::Tensor param(const std::string& full) {
    const auto params = named_parameters();
    const auto* p = params.find(full);
    if (p == nullptr) throw std::runtime_error("no parameter " + full);
    return *p;  // shares the parameter's storage: in-place changes reach the model
  }
};

torch::Tensor activate(Act a, const torch::Tensor& x) {
  switch (a) {
    case Act::Relu:
      return torch::relu(x);
    case Act::Tanh:
      return torch::tanh(x);
    case Act::Sigmoid:
      return torch::sigmoid(x);
  }
  return x;
}

struct Mlp : Model {
  explicit Mlp(Act act, int64_t width) : act_(act) {
    const int64_t dims[] = {16, width, width, width, kClasses};
    for (int i = 0; i < 4; ++i)
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(dims[i], dims[i + 1])));
  }
  torch::Tensor forward(torch::Tensor x) override {
    for (std::size_t i = 0; i < fc.size(); ++i) {
      x = rec("fc" + std::to_string(i), x, fc[i](x));
      if (i + 1 < fc.size()) x = activate(act_, x);
    }
    return x;
  }
  torch::Tensor input(int64_t n) const override { return torch::randn({n, 16}); }
  Act act_;
  std::vector<torch::nn::Linear> fc;
};

struct Cnn : Model {
  Cnn() {
    conv0 = register_module("conv0", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 8, 3).padding(1)));
    bn0 = register_module("bn0", torch::nn::BatchNorm2d(8));
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).padding(1)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(16));
    fc = register_module("fc", torch::nn::Linear(16, kClasses));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = rec("conv0", x, conv0(x));
    x = torch::relu(rec("bn0", x, bn0(x)));
    x = rec("conv1", x, conv1(x));
    x = torch::relu(rec("bn1", x, bn1(x)));
    x = x.mean({2, 3});
    return rec("fc", x, fc(x));
  }
  torch::Tensor input(int64_t n) const override { return torch::randn({n, 2, 8, 8}); }
  torch::nn::Conv2d conv0{nullptr}, conv1{nullptr};
  torch::nn::BatchNorm2d bn0{nullptr}, bn1{nullptr};
  torch::nn::Linear fc{nullptr};
};

/// Linear - BatchNorm1d - ReLU blocks and a Linear head.
struct MlpBn : Model {
  explicit MlpBn(int64_t width) {
    for (int i = 0; i < 2; ++i) {
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(i == 0 ? 16 : width, width)));
      bn.push_back(register_module("bn" + std::to_string(i), torch::nn::BatchNorm1d(width)));
    }
    head = register_module("head", torch::nn::Linear(width, kClasses));
  }
  torch::Tensor forward(torch::Tensor x) override {
    for (std::size_t i = 0; i < fc.size(); ++i) {
      const std::string n = std::to_string(i);
      x = rec("fc" + n, x, fc[i](x));
      x = torch::relu(rec("bn" + n, x, bn[i](x)));
    }
    return rec("head", x, head(x));
  }
  torch::Tensor input(int64_t n) const override { return torch::randn({n, 16}); }
  std::vector<torch::nn::Linear> fc;
  std::vector<torch::nn::BatchNorm1d> bn;
  torch::nn::Linear head{nullptr};
};

/// relu(x + fc_b(relu(fc_a(x)))) blocks between a stem and a head.
struct Residual : Model {
  explicit Residual(int64_t width) {
    stem = register_module("stem", torch::nn::Linear(16, width));
    for (int b = 0; b < 2; ++b) {
      const std::string p = "block" + std::to_string(b);
      fa.push_back(register_module(p + "_a", torch::nn::Linear(width, width)));
      fb.push_back(register_module(p + "_b", torch::nn::Linear(width, width)));
    }
    head = register_module("head", torch::nn::Linear(width, kClasses));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::relu(rec("stem", x, stem(x)));
    for (std::size_t b = 0; b < fa.size(); ++b) {
      const std::string p = "block" + std::to_string(b);
      auto h = torch::relu(rec(p + "_a", x, fa[b](x)));
      x = torch::relu(x + rec(p + "_b", h, fb[b](h)));
    }
    return rec("head", x, head(x));
  }
  torch::Tensor input(int64_t n) const override { return torch::randn({n, 16}); }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  std::vector<torch::nn::Linear> fa, fb;
};

/// Pre-norm blocks x + ff2(gelu(ff1(ln(x)))).
struct LnGelu : Model {
  explicit LnGelu(int64_t width) {
    embed = register_module("embed", torch::nn::Linear(16, width));
    for (int b = 0; b < 2; ++b) {
      const std::string p = "block" + std::to_string(b);
      ln.push_back(register_module(p + "_ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}))));
      ff1.push_back(register_module(p + "_ff1", torch::nn::Linear(width, 2 * width)));
      ff2.push_back(register_module(p + "_ff2", torch::nn::Linear(2 * width, width)));
    }
    head = register_module("head", torch::nn::Linear(width, kClasses));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = rec("embed", x, embed(x));
    for (std::size_t b = 0; b < ln.size(); ++b) {
      const std::string p = "block" + std::to_string(b);
      auto h = rec(p + "_ln", x, ln[b](x));
      h = rec(p + "_ff1", h, ff1[b](h));
      h = torch::gelu(h);
      x = x + rec(p + "_ff2", h, ff2[b](h));
    }
    return rec("head", x, head(x));
  }
  torch::Tensor input(int64_t n) const override { return torch::randn({n, 16}); }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  std::vector<torch::nn::LayerNorm> ln;
  std::vector<torch::nn::Linear> ff1, ff2;
};

struct Lstm : Model {
  explicit Lstm(int64_t width) {
    lstm = register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(8, width).batch_first(true)));
    fc = register_module("fc", torch::nn::Linear(width, kClasses));
  }
  torch::Tensor forward(torch::Tensor x) override {
    auto y = std::get<0>(lstm(x));
    rec("lstm", x, y);
    auto last = y.select(1, y.size(1) - 1);
    return rec("fc", last, fc(last));
  }
  torch::Tensor input(int64_t n) const override { return torch::randn({n, 6, 8}); }
  torch::nn::LSTM lstm{nullptr};
  torch::nn::Linear fc{nullptr};
};

/// One self-attention layer with its own q/k/v/o projections, mean-pooled into a head.
struct Attention : Model {
  explicit Attention(int64_t width) : width_(width) {
    embed = register_module("embed", torch::nn::Linear(8, width));
    q = register_module("q", torch::nn::Linear(width, width));
    k = register_module("k", torch::nn::Linear(width, width));
    v = register_module("v", torch::nn::Linear(width, width));
    o = register_module("o", torch::nn::Linear(width, width));
    head = register_module("head", torch::nn::Linear(width, kClasses));
  }
  torch::Tensor forward(torch::Tensor x) override {
    auto e = rec("embed", x, embed(x));
    auto qq = rec("q", e, q(e)), kk = rec("k", e, k(e)), vv = rec("v", e, v(e));
    auto att = torch::softmax(qq.matmul(kk.transpose(1, 2)) / std::sqrt(static_cast<double>(width_)), -1);
    auto ctx = att.matmul(vv);
    auto h = e + rec("o", ctx, o(ctx));
    auto pooled = h.mean(1);
    return rec("head", pooled, head(pooled));
  }
  torch::Tensor input(int64_t n) const override { return torch::randn({n, 6, 8}); }
  int64_t width_;
  torch::nn::Linear embed{nullptr}, q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, head{nullptr};
};

std::shared_ptr<Model> make_model(Arch a, Act act, int64_t width) {
  switch (a) {
    case Arch::Mlp:
      return std::make_shared<Mlp>(act, width);
    case Arch::Cnn:
      return std::make_shared<Cnn>();
    case Arch::Residual:
      return std::make_shared<Residual>(width);
    case Arch::LayerNormGelu:
      return std::make_shared<LnGelu>(width);
    case Arch::Lstm:
      return std::make_shared<Lstm>(width);
    case Arch::Attention:
      return std::make_shared<Attention>(width);
    case Arch::MlpBn:
      return std::make_shared<MlpBn>(width);
  }
  return nullptr;
}

/// What the onset step looked like, for the ground truth check.
struct Onset {
  Model* model = nullptr;
  torch::Tensor x;                  // the batch the model saw
  torch::Tensor logits;             // the model's output
  double loss = 0.0;                // the loss the loop reported
  std::vector<double> prev_losses;  // the losses before the onset
  std::vector<double> prev_input_rms;  // the batches' RMS before the onset
  std::map<std::string, double> grad_norm;       // per module (weight and bias), after backward
  std::map<std::string, double> prev_grad_norm;  // the same one step earlier
  /// Per recorded submodule: output std over input RMS at the onset and on a later step.
  std::map<std::string, double> gain, next_gain;
  std::vector<std::string> order;
  double next_loss = 0.0;
};

/// The L2 norm over a module's parameters' gradients.
std::map<std::string, double> grad_norms(Model& m) {
  std::map<std::string, double> sq;
  for (const auto& p : m.named_parameters()) {
    const std::string mod = p.key().substr(0, p.key().rfind('.'));
    const auto g = p.value().grad();
    if (!g.defined()) continue;
    sq[mod] += g.to(torch::kDouble).pow(2).sum().item<double>();
  }
  for (auto& [k, v] : sq) v = std::sqrt(v);
  return sq;
}

double mean_of(const std::vector<double>& v) {
  double sum = 0.0;
  for (double x : v) sum += x;
  return sum / static_cast<double>(v.size());
}
double rms(const torch::Tensor& t) { return t.to(torch::kDouble).pow(2).mean().sqrt().item<double>(); }
double std_all(const torch::Tensor& t) { return t.to(torch::kDouble).std(/*unbiased=*/false).item<double>(); }
bool finite(const torch::Tensor& t) { return torch::isfinite(t).all().item<bool>(); }

struct Scenario {
  std::string group;  // the failure ("dead units"), "healthy" for none
  std::string name;   // group: architecture [activation] [layer] optimizer
  Arch arch = Arch::Mlp;
  Act act = Act::Relu;
  bool adam = false;
  std::optional<FailureKind> kind;  // none: healthy
  std::string layer;                // the module the top hypothesis must name
  std::string how;                  // one line: what is done at the onset
  /// Changes the model (no grad) at the onset.
  std::function<void(Model&)> induce;
  /// Changes the onset batch.
  std::function<void(torch::Tensor&)> corrupt;
  /// Scales the onset step's backward (the loss the loop reports is unscaled).
  double backward_scale = 1.0;
  /// Divides the onset step's logits in the loss (a temperature).
  double temperature = 1.0;
  /// Multiplies the learning rate from the onset on.
  double lr_factor = 1.0;
  /// The plain-torch ground truth; returns an empty string when the failure is there.
  std::function<std::string(const Onset&)> truth;
  /// A ground truth that shows on one of the two steps after the onset (checked on each until
  /// it holds), for failures that an optimizer's update makes.
  std::function<std::string(const Onset&)> truth_later;
  /// A second kind the top hypothesis may have; layer "*": any layer.
  std::optional<FailureKind> or_kind;
  /// The data's scale (unnormalized inputs: outputs that are mostly their bias).
  double input_scale = 1.0;
  /// Multiplies every batch from the onset on (data that stops being normalized).
  double data_factor = 1.0;
  /// Changes the model (no grad) after every step's update from the onset on.
  std::function<void(Model&)> after_step;
  /// Steps added before the onset (a BatchNorm's running statistics warm up over 44 steps).
  int64_t later = 0;
};

/// The onset step varies with the seed (after the monitor's baselines have warmed up).
int64_t onset_step(uint64_t seed) { return 9 + static_cast<int64_t>(seed % 5); }

/// The failure must really be there, measured with plain torch on the onset's tensors.
std::string check_nonfinite_origin(const Onset& o, const std::string& layer) {
  const auto& out = o.model->out.at(layer);
  const auto& in = o.model->in.at(layer);
  if (finite(out)) return layer + "'s output is finite";
  if (!finite(in)) return layer + "'s input is already non-finite";
  return {};
}
/// The std across the batch: each position's batch mean (a bias among it) taken out.
double batch_spread(const torch::Tensor& t) {
  const auto x = t.to(torch::kDouble);
  return (x - x.mean(0, true)).pow(2).mean().sqrt().item<double>();
}
/// The layer's output spread over its input's spread, both across the batch: what its
/// weights do to what varies between samples.
std::string check_spread_gain_above(const Onset& o, const std::string& layer, double g) {
  const double gain = batch_spread(o.model->out.at(layer)) / batch_spread(o.model->in.at(layer));
  if (!(gain > g)) return layer + " spread gain " + std::to_string(gain) + " is not above " + std::to_string(g);
  return {};
}
std::string check_gain_above(const Onset& o, const std::string& layer, double g) {
  // The output's spread across the batch (what its bias adds taken out) over the input's RMS.
  const double gain = batch_spread(o.model->out.at(layer)) / rms(o.model->in.at(layer));
  if (!(gain > g)) return layer + " gain " + std::to_string(gain) + " is not above " + std::to_string(g);
  return {};
}
std::string check_dead(const Onset& o, const std::string& layer, int64_t unit_dim) {
  auto a = torch::relu(o.model->out.at(layer));
  auto dims = std::vector<int64_t>();
  for (int64_t d = 0; d < a.dim(); ++d)
    if (d != unit_dim) dims.push_back(d);
  const double dead = (a.gt(0).sum(dims) == 0).to(torch::kDouble).mean().item<double>();
  if (!(dead > 0.5)) return layer + " dead unit fraction " + std::to_string(dead);
  return {};
}
std::string check_saturated(const Onset& o, const std::string& layer, Act act) {
  const auto& pre = o.model->out.at(layer);
  const auto y = activate(act, pre);
  const auto sat = act == Act::Tanh ? y.abs().gt(0.97) : (y.lt(0.01) | y.gt(0.99));
  const double frac = sat.to(torch::kDouble).mean().item<double>();
  if (!(frac > 0.25)) return layer + " saturated fraction " + std::to_string(frac);
  // and no explosion that would explain it
  const double gain = std_all(pre) / rms(o.model->in.at(layer));
  if (gain > 10.0) return layer + " gain " + std::to_string(gain) + " (an explosion, not saturation)";
  return {};
}
/// The layer's eval-mode output (normalized with its running statistics) against its
/// training-mode output (the batch's statistics): their difference's RMS, over the batch's
/// normalized output's, is above 1.
std::string check_norm_statistics(const Onset& o, const std::string& layer) {
  const auto x = o.model->in.at(layer).to(torch::kDouble);
  std::vector<int64_t> dims, shape(static_cast<std::size_t>(x.dim()), 1);
  shape[1] = -1;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (d != 1) dims.push_back(d);
  auto bufs = o.model->named_buffers();
  const auto rm = bufs[layer + ".running_mean"].to(torch::kDouble).view(shape);
  const auto rv = bufs[layer + ".running_var"].to(torch::kDouble).view(shape);
  const double eps = 1e-5;
  const auto mean = x.mean(dims, true);
  const auto var = (x - mean).pow(2).mean(dims, true);
  const auto train = (x - mean) / (var + eps).sqrt();
  const auto eval = (x - rm) / (rv + eps).sqrt();
  const double err = (eval - train).pow(2).mean().sqrt().item<double>();
  if (!(err > 1.0)) return layer + "'s eval-mode error " + std::to_string(err);
  return {};
}
std::string check_constant(const Onset& o, const std::string& layer) {
  const double s = std_all(o.model->out.at(layer));
  if (s != 0.0) return layer + " output std " + std::to_string(s);
  return {};
}

/// A failure scenario's common fields.
Scenario failure(std::string group, FailureKind kind, Arch arch, std::string layer, bool adam, std::string how) {
  Scenario s;
  s.group = std::move(group);
  s.kind = kind;
  s.arch = arch;
  s.layer = std::move(layer);
  s.adam = adam;
  s.how = std::move(how);
  return s;
}

std::vector<Scenario> scenarios() {
  std::vector<Scenario> v;
  auto add = [&](Scenario s) {
    s.name = s.group + ": " + arch_name(s.arch);
    if (s.act == Act::Tanh) s.name += " tanh";
    if (s.act == Act::Sigmoid) s.name += " sigmoid";
    if (s.input_scale != 1.0) {
      std::ostringstream scale;
      scale << s.input_scale;
      s.name += " inputs x" + scale.str();
    }
    if (!s.layer.empty() && s.layer != "input" && s.layer != "loss" && s.layer != "*") s.name += " " + s.layer;
    s.name += s.adam ? " Adam" : " SGD";
    v.push_back(std::move(s));
  };
  // ---- healthy runs
  const std::pair<Arch, Act> healthy_models[] = {
      {Arch::Mlp, Act::Relu}, {Arch::Mlp, Act::Tanh}, {Arch::Cnn, Act::Relu},
      {Arch::Residual, Act::Relu}, {Arch::LayerNormGelu, Act::Relu}, {Arch::Lstm, Act::Relu},
      {Arch::Attention, Act::Relu}, {Arch::Cnn, Act::Relu}, {Arch::MlpBn, Act::Relu}, {Arch::MlpBn, Act::Relu}};
  for (std::size_t i = 0; i < std::size(healthy_models); ++i) {
    Scenario s;
    s.arch = healthy_models[i].first;
    s.act = healthy_models[i].second;
    s.adam = i % 2 == 1 || i == 6;
    s.group = "healthy";
    s.how = "no failure";
    add(std::move(s));
  }
  // Unnormalized data of a small scale: every layer's output is then mostly its bias. (Not
  // ReLU layers without a normalization before them: their units whose bias is negative are
  // dead for every sample, as reported.)
  for (const auto& [arch, act, scale] : {std::tuple{Arch::Mlp, Act::Tanh, 1e-3}, std::tuple{Arch::Mlp, Act::Tanh, 1e-4},
                                         std::tuple{Arch::Cnn, Act::Relu, 1e-3}, std::tuple{Arch::LayerNormGelu, Act::Relu, 1e-2},
                                         std::tuple{Arch::Lstm, Act::Relu, 1e-3}}) {
    Scenario s;
    s.arch = arch;
    s.act = act;
    s.adam = arch == Arch::Cnn;
    s.input_scale = scale;
    s.group = "healthy";
    s.how = "no failure, inputs of a small scale";
    add(std::move(s));
  }
  // ---- bad input: a few NaN values in the onset batch
  const std::pair<Arch, std::string> first_layers[] = {
      {Arch::Mlp, "fc0"}, {Arch::Cnn, "conv0"}, {Arch::Residual, "stem"},
      {Arch::LayerNormGelu, "embed"}, {Arch::Lstm, "lstm"}, {Arch::Attention, "embed"}};
  for (std::size_t i = 0; i < std::size(first_layers); ++i) {
    Scenario s = failure("bad input", FailureKind::BadInput, first_layers[i].first, "input", i % 2 == 0,
                         "3 NaN values in the batch");
    s.corrupt = [](torch::Tensor& x) {
      auto flat = x.view({-1});
      for (int64_t j : {5, 77, 300}) flat[j % flat.numel()] = std::numeric_limits<float>::quiet_NaN();
    };
    s.truth = [](const Onset& o) -> std::string {
      return torch::isnan(o.x).sum().item<int64_t>() > 0 ? "" : "the batch holds no NaN";
    };
    add(std::move(s));
  }
  // ---- finite bad data: every batch x1e4 from the onset on (normalization dropped)
  for (std::size_t i = 0; i < std::size(first_layers); ++i) {
    Scenario s = failure("bad input (scale)", FailureKind::BadInput, first_layers[i].first, "input", i % 2 == 1,
                         "every batch times 1e4 from the onset on");
    s.data_factor = 1e4;
    s.truth = [](const Onset& o) -> std::string {
      const double mean = mean_of(o.prev_input_rms);
      const double now = rms(o.x);
      if (!(now > 10.0 * mean)) return "the batch's RMS " + std::to_string(now) + " vs " + std::to_string(mean);
      return {};
    };
    add(std::move(s));
  }
  // ---- a layer that produces Inf/NaN from finite input: one weight set to Inf
  const std::tuple<Arch, std::string, bool> nonfinite[] = {
      {Arch::Mlp, "fc1", false},        {Arch::Cnn, "conv1", true},     {Arch::Residual, "block1_b", false},
      {Arch::LayerNormGelu, "block0_ff2", true}, {Arch::Lstm, "fc", false}, {Arch::Attention, "k", true}};
  for (const auto& [arch, layer, adam] : nonfinite) {
    Scenario s = failure("non-finite output", FailureKind::NonFiniteOutput, arch, layer, adam,
                         "one weight of the layer set to Inf");
    const std::string l = layer;
    s.induce = [l](Model& m) { m.weight(l).view({-1})[0] = std::numeric_limits<float>::infinity(); };
    s.truth = [l](const Onset& o) { return check_nonfinite_origin(o, l); };
    add(std::move(s));
  }
  // ---- dead ReLU units: the bias before a ReLU pushed far negative
  const std::tuple<Arch, std::string, bool, std::string> dead[] = {
      {Arch::Mlp, "fc1", false, "bias"},
      {Arch::Mlp, "fc2", true, "bias"},
      {Arch::Cnn, "bn1", false, "bias"},
      {Arch::Residual, "block0_a", true, "bias"},
      {Arch::Residual, "stem", false, "bias"}};
  for (const auto& [arch, layer, adam, what] : dead) {
    Scenario s = failure("dead units", FailureKind::DeadUnits, arch, layer, adam,
                         "the bias before a ReLU set to -50");
    const std::string l = layer;
    s.induce = [l](Model& m) { m.bias(l).fill_(-50.0); };
    const int64_t unit_dim = 1;
    s.truth = [l, unit_dim](const Onset& o) { return check_dead(o, l, unit_dim); };
    add(std::move(s));
  }
  // ---- saturation: the pre-activation shifted past the saturating range (no explosion)
  const std::tuple<Act, std::string, bool, double> sat[] = {
      {Act::Tanh, "fc1", false, 4.0}, {Act::Tanh, "fc2", true, -4.0}, {Act::Sigmoid, "fc1", false, -9.0}};
  for (const auto& [act, layer, adam, shift] : sat) {
    Scenario s = failure("saturation", FailureKind::Saturation, Arch::Mlp, layer, adam,
                         "the bias before a tanh shifted by +-4, before a sigmoid by -9");
    s.act = act;
    const std::string l = layer;
    const double d = shift;
    s.induce = [l, d](Model& m) { m.bias(l).add_(d); };
    const Act a = act;
    s.truth = [l, a](const Onset& o) { return check_saturated(o, l, a); };
    add(std::move(s));
  }
  // ---- exploding activation: a layer's weights scaled up
  const std::tuple<Arch, std::string, bool> explode[] = {
      {Arch::Mlp, "fc1", true}, {Arch::Cnn, "conv0", false}, {Arch::LayerNormGelu, "block0_ff1", true},
      {Arch::Attention, "v", false}, {Arch::Residual, "block0_b", true}};
  for (const auto& [arch, layer, adam] : explode) {
    Scenario s = failure("exploding activation", FailureKind::ExplodingActivation, arch, layer, adam,
                         "the layer's weight times 1000");
    const std::string l = layer;
    s.induce = [l](Model& m) { m.weight(l).mul_(1000.0); };
    s.truth = [l](const Onset& o) { return check_gain_above(o, l, 10.0); };
    add(std::move(s));
  }
  {  // the same with inputs of a small scale, where the outputs are mostly their biases
    Scenario s = failure("exploding activation", FailureKind::ExplodingActivation, Arch::Mlp, "fc1", false,
                         "the layer's weight times 1000, inputs x0.001");
    s.input_scale = 1e-3;
    s.induce = [](Model& m) { m.weight("fc1").mul_(1000.0); };
    s.truth = [](const Onset& o) { return check_spread_gain_above(o, "fc1", 10.0); };
    add(std::move(s));
  }
  // ---- exploding gradients: the backward pass of one step scaled by 1e9 (an unscaled loss
  // scale); the most downstream layer is where backward starts
  const std::tuple<Arch, std::string, bool> egrad[] = {
      {Arch::Mlp, "fc3", false}, {Arch::Cnn, "fc", true}, {Arch::Lstm, "fc", true}};
  for (const auto& [arch, layer, adam] : egrad) {
    Scenario s = failure("exploding gradient", FailureKind::ExplodingGradient, arch, layer, adam,
                         "backward of the loss times 1e9");
    s.backward_scale = 1e9;
    const std::string l = layer;
    s.truth = [l](const Onset& o) -> std::string {
      const double g = o.grad_norm.at(l), before = o.prev_grad_norm.at(l);
      if (!(g > 1e3 && g > 100.0 * before)) return l + " gradient norm " + std::to_string(g);
      return {};
    };
    add(std::move(s));
  }
  // ---- vanishing gradients: the backward pass of one step scaled by 1e-12; the input-most
  // layer is named
  const std::tuple<Arch, std::string, bool> vgrad[] = {
      {Arch::Mlp, "fc0", false}, {Arch::Lstm, "lstm", true}};
  for (const auto& [arch, layer, adam] : vgrad) {
    Scenario s = failure("vanishing gradient", FailureKind::VanishingGradient, arch, layer, adam,
                         "backward of the loss times 1e-12");
    s.backward_scale = 1e-12;
    const std::string l = layer;
    s.truth = [l](const Onset& o) -> std::string {
      for (const auto& [m, g] : o.grad_norm)
        if (!(g < 1e-7)) return m + " gradient norm " + std::to_string(g);
      return {};
    };
    add(std::move(s));
  }
  // ---- constant output: a layer's weight zeroed and its bias one value
  const std::tuple<Arch, std::string, bool> constant[] = {
      {Arch::Mlp, "fc1", false}, {Arch::Residual, "block0_a", true}};
  for (const auto& [arch, layer, adam] : constant) {
    Scenario s = failure("constant output", FailureKind::ConstantOutput, arch, layer, adam,
                         "the layer's weight zeroed, its bias 0.5");
    const std::string l = layer;
    s.induce = [l](Model& m) {
      m.weight(l).zero_();
      m.bias(l).fill_(0.5);
    };
    s.truth = [l](const Onset& o) { return check_constant(o, l); };
    add(std::move(s));
  }
  {  // a LayerNorm's weight collapsed to 0: its bias (one row) for every sample, which differs
     // between units, so the whole tensor is not constant
    Scenario s = failure("constant output", FailureKind::ConstantOutput, Arch::LayerNormGelu, "block0_ln", true,
                         "the LayerNorm's weight zeroed, its bias random");
    s.induce = [](Model& m) {
      m.weight("block0_ln").zero_();
      m.bias("block0_ln").normal_(0.0, 0.5);
    };
    s.truth = [](const Onset& o) {
      const auto& out = o.model->out.at("block0_ln");
      if (batch_spread(out) != 0.0) return "block0_ln's spread across the batch " + std::to_string(batch_spread(out));
      if (std_all(out) == 0.0) return std::string("block0_ln's output is one value");
      return std::string();
    };
    add(std::move(s));
  }
  // ---- a BatchNorm's running statistics from another model (mean 3 standard deviations off,
  // variance x0.1), frozen (momentum 0): training normalizes with the batch's, eval would not
  const std::tuple<Arch, std::string, bool> stale[] = {
      {Arch::Cnn, "bn0", false}, {Arch::Cnn, "bn1", true}, {Arch::MlpBn, "bn0", true}, {Arch::MlpBn, "bn1", false}};
  for (const auto& [arch, layer, adam] : stale) {
    Scenario s = failure("norm statistics", FailureKind::NormStatistics, arch, layer, adam,
                         "running mean +3 std, running variance x0.1, momentum 0");
    s.later = 50;
    const std::string l = layer;
    s.induce = [l](Model& m) {
      auto bufs = m.named_buffers();
      auto rm = bufs[l + ".running_mean"], rv = bufs[l + ".running_var"];
      rm.add_(rv.sqrt() * 3.0);
      rv.mul_(0.1);
      auto mod = m.named_modules()[l];
      if (auto* b = dynamic_cast<torch::nn::BatchNorm1dImpl*>(mod.get())) b->options.momentum(0.0);
      if (auto* b = dynamic_cast<torch::nn::BatchNorm2dImpl*>(mod.get())) b->options.momentum(0.0);
    };
    s.truth = [l](const Onset& o) { return check_norm_statistics(o, l); };
    add(std::move(s));
  }
  // ---- a normalization's weight shrinking toward 0 (x0.25 a step from the onset on: weight
  // decay run wild on normalization weights)
  const std::tuple<Arch, std::string, bool> shrink[] = {{Arch::Cnn, "bn1", false},
                                                        {Arch::MlpBn, "bn0", true},
                                                        {Arch::LayerNormGelu, "block0_ln", true},
                                                        {Arch::LayerNormGelu, "block1_ln", false}};
  for (const auto& [arch, layer, adam] : shrink) {
    Scenario s = failure("norm weight collapse", FailureKind::NormWeightCollapse, arch, layer, adam,
                         "the normalization's weight x0.25 at the onset and after every step");
    const std::string l = layer;
    auto peak = std::make_shared<double>(0.0);
    s.induce = [l, peak](Model& m) {
      *peak = rms(m.weight(l));
      m.weight(l).mul_(0.25);
    };
    s.after_step = [l](Model& m) { m.weight(l).mul_(0.25); };
    s.truth_later = [l, peak](const Onset& o) -> std::string {
      const double now = rms(o.model->weight(l));
      if (!(now < 0.1 * *peak)) return l + "'s weight RMS " + std::to_string(now) + " vs " + std::to_string(*peak);
      return {};
    };
    add(std::move(s));
  }
  // ---- the loss itself: a zero temperature (NaN loss from finite logits), and a batch of
  // unnormalised data (a loss spike)
  const std::pair<Arch, bool> diverge[] = {{Arch::Mlp, false}, {Arch::Attention, true}};
  for (const auto& [arch, adam] : diverge) {
    Scenario s = failure("loss divergence", FailureKind::LossDivergence, arch, "loss", adam,
                         "logits divided by a zero temperature in the loss");
    s.temperature = 0.0;
    s.truth = [](const Onset& o) -> std::string {
      if (!finite(o.logits)) return "the logits are non-finite";
      if (std::isfinite(o.loss)) return "the loss is finite";
      return {};
    };
    add(std::move(s));
  }
  // ---- a learning rate far too high from the onset on: the first update wrecks the weights;
  // the next forward pass explodes at the first layer
  const std::tuple<Arch, bool, double, std::string> lr_high[] = {
      {Arch::Mlp, false, 200.0, "fc0"}, {Arch::Mlp, true, 1000.0, "fc0"}, {Arch::Residual, true, 1000.0, "stem"}};
  for (const auto& [arch, adam, factor, layer] : lr_high) {
    Scenario s;
    s.arch = arch;
    s.adam = adam;
    s.group = "learning rate too high";
    // No layer is at fault, and attach sees no update: the right answer is the update's
    // first consequence, an exploding activation (any layer) or a loss spike.
    s.kind = FailureKind::ExplodingActivation;
    s.or_kind = FailureKind::LossSpike;
    s.layer = "*";
    s.how = "the learning rate times 200 (SGD) or 1000 (Adam)";
    s.lr_factor = factor;
    s.truth_later = [](const Onset& o) -> std::string {
      for (const auto& m : o.order)
        if (o.next_gain.count(m) && o.gain.count(m) && o.next_gain.at(m) > 10.0 * o.gain.at(m)) return {};
      const double mean = mean_of(o.prev_losses);
      if (o.next_loss > 10.0 * mean) return {};
      return "no layer's gain rose 10x and the loss did not spike";
    };
    add(std::move(s));
  }
  const std::pair<Arch, bool> spike[] = {{Arch::Mlp, true}, {Arch::Lstm, false}};
  for (const auto& [arch, adam] : spike) {
    Scenario s = failure("loss spike", FailureKind::LossSpike, arch, "loss", adam,
                         "logits times 1000 in the loss (temperature 0.001)");
    s.temperature = 0.001;
    s.truth = [](const Onset& o) -> std::string {
      const double mean = mean_of(o.prev_losses);
      if (!(o.loss > 10.0 * mean)) return "loss " + std::to_string(o.loss) + " vs mean " + std::to_string(mean);
      return {};
    };
    add(std::move(s));
  }
  return v;
}

struct RunResult {
  bool truth_ok = true;
  std::string truth_error;
  bool hit = false;
  std::string top;  // "kind @ module (step)"
  std::size_t incidents = 0;
};

RunResult run(const Scenario& sc, uint64_t seed, bool verbose) {
  torch::manual_seed(static_cast<int64_t>(seed));
  const int64_t width = 24 + 8 * static_cast<int64_t>(seed % 3);
  auto model = make_model(sc.arch, sc.act, width);
  // A learnable task: labels from a random teacher on fixed inputs.
  const int64_t n = 256, batch = 32;
  const auto X = model->input(n) * sc.input_scale;
  const auto teacher = torch::randn({X[0].numel(), kClasses});
  const auto Y = X.reshape({n, -1}).matmul(teacher).argmax(1);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (sc.adam)
    opt = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
  else
    opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  torchdbg::HookManager hooks;
  auto health_options = torchdbg::HealthOptions().interval(g_interval).activation_interval(g_activation_interval);
  if (g_alert_steps >= 0) health_options.alert_steps(g_alert_steps);
  health_options.activation_budget(g_activation_budget);
  torchdbg::HealthMonitor health(health_options);
  auto installed = health.install(hooks);
  auto session = torchdbg::attach(*model, hooks);

  RunResult r;
  const int64_t at = onset_step(seed) + sc.later + g_late;
  const int64_t steps = sc.kind ? at + g_window + 1 : 60;
  Onset onset;
  onset.model = model.get();
  std::map<std::string, double> prev_grads;
  for (int64_t step = 0; step < steps; ++step) {
    const bool at_onset = sc.kind && step == at;
    const int64_t from = (step * batch) % n;
    auto x = X.narrow(0, from, batch);
    auto y = Y.narrow(0, from, batch);
    if (at_onset && sc.induce) {
      torch::NoGradGuard g;
      sc.induce(*model);
    }
    if (sc.kind && step >= at && sc.data_factor != 1.0) x = x * sc.data_factor;
    if (at_onset && sc.corrupt) {
      x = x.clone();
      sc.corrupt(x);
    }
    hooks.set_step(step);
    opt->zero_grad();
    const bool after_onset = sc.kind && (step == at + 1 || step == at + 2);
    model->record = at_onset || after_onset;
    if (after_onset) {
      model->in.clear();
      model->out.clear();
    }
    auto logits = model->forward(x);
    model->record = false;
    const double temperature = at_onset ? sc.temperature : 1.0;
    auto loss = F::cross_entropy(logits / temperature, y);
    const double lv = loss.item<double>();
    hooks.set_loss(lv);
    const double scale = at_onset ? sc.backward_scale : 1.0;
    (scale == 1.0 ? loss : loss * scale).backward();
    // The ground truth's own arithmetic on parameters runs without grad, as bookkeeping in a
    // training loop should: attach takes operators on a module's tensors in grad mode outside
    // its forward for that module's.
    if (at_onset) {
      torch::NoGradGuard no_grad;
      onset.x = x;
      onset.logits = logits.detach();
      onset.loss = lv;
      onset.grad_norm = grad_norms(*model);
      onset.prev_grad_norm = prev_grads;
      if (sc.lr_factor != 1.0)
        for (auto& group : opt->param_groups()) group.options().set_lr(group.options().get_lr() * sc.lr_factor);
    } else if (step < at) {
      torch::NoGradGuard no_grad;
      onset.prev_losses.push_back(lv);
      onset.prev_input_rms.push_back(rms(x));
      prev_grads = grad_norms(*model);
    }
    opt->step();
    const auto gains = [&] {
      std::map<std::string, double> g;
      for (const auto& m : model->order) g[m] = std_all(model->out.at(m)) / rms(model->in.at(m));
      return g;
    };
    if (after_onset && sc.truth_later && (step == at + 1 || !r.truth_ok)) {
      torch::NoGradGuard no_grad;
      onset.next_gain = gains();
      onset.next_loss = lv;
      r.truth_error = sc.truth_later(onset);
      r.truth_ok = r.truth_error.empty();
    }
    if (at_onset) {
      torch::NoGradGuard no_grad;
      onset.gain = gains();
      onset.order = model->order;
      if (sc.truth) {
        r.truth_error = sc.truth(onset);
        r.truth_ok = r.truth_error.empty();
      }
    }
    if (sc.kind && step >= at && sc.after_step) {  // after the ground truth read the step's model
      torch::NoGradGuard no_grad;
      sc.after_step(*model);
    }
  }
  hooks.set_step(steps);
  if (g_activation_budget > 0.0) ++g_chosen[health.report().activation_interval];
  const auto d = torchdbg::diagnose(health);
  r.incidents = health.incidents().size();
  if (const auto* top = d.top()) {
    r.top = std::string(torchdbg::to_string(top->kind)) + " @ " + top->layer + " (step " +
            std::to_string(top->step) + ")";
  }
  if (!sc.kind) {
    r.hit = r.incidents == 0;
  } else if (const auto* top = d.top()) {
    r.hit = (top->kind == *sc.kind || top->kind == sc.or_kind) && (sc.layer == "*" || top->layer == sc.layer) && top->step >= at &&
            top->step <= at + g_window;
  }
  if (verbose && !r.hit) {
    std::printf("  miss: %s seed %llu: %s\n", sc.name.c_str(), static_cast<unsigned long long>(seed),
                d.summary().c_str());
    for (const auto& h : d.hypotheses)
      std::printf("    %s @ %s (%s) step %lld conf %.2f\n", torchdbg::to_string(h.kind), h.layer.c_str(),
                  h.observed.c_str(), static_cast<long long>(h.step), h.confidence);
    for (const auto& e : health.events())
      if (e.step >= at - 1)
        std::printf("    event %lld %s %s %s->%s %s\n", static_cast<long long>(e.step), e.layer.c_str(),
                    torchdbg::to_string(e.type), e.from.c_str(), e.to.c_str(), e.metadata.dump().c_str());
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t seeds = 5;
  double min_accuracy = 0.0, min_scenario = 0.0;
  std::string only;
  bool verbose = false, by_kind = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--seeds") {
      seeds = std::stoll(next());
    } else if (a == "--min-accuracy") {
      min_accuracy = std::stod(next());
    } else if (a == "--min-scenario-accuracy") {
      min_scenario = std::stod(next());
    } else if (a == "--only") {
      only = next();
    } else if (a == "--verbose") {
      verbose = true;
    } else if (a == "--by-kind") {
      by_kind = true;
    } else if (a == "--interval") {
      g_interval = std::stoll(next());
    } else if (a == "--activation-interval") {
      g_activation_interval = std::stoll(next());
    } else if (a == "--alert-steps") {
      g_alert_steps = std::stoll(next());
    } else if (a == "--activation-budget") {
      g_activation_budget = std::stod(next());
    } else if (a == "--late") {
      g_late = std::stoll(next());
    } else if (a == "--window") {
      g_window = std::stoll(next());
      if (g_window < 2) {
        std::fprintf(stderr, "--window needs at least 2\n");
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--seeds N] [--only REGEX] [--min-accuracy F] [--min-scenario-accuracy F] [--by-kind] [--verbose] [--interval N] [--activation-interval N] [--alert-steps N] [--activation-budget F] [--late N] [--window N]\n", argv[0]);
      return 2;
    }
  }
  torch::set_num_threads(1);
  const std::regex filter(only.empty() ? std::string(".*") : only);
  if (!by_kind) {
    std::printf("| scenario | induced at the onset (step %lld to %lld) | expected top hypothesis | hits |\n",
                static_cast<long long>(9 + g_late), static_cast<long long>(13 + g_late));
    std::printf("|---|---|---|---|\n");
  }
  int64_t fail_hits = 0, fail_runs = 0, healthy_hits = 0, healthy_runs = 0, truth_failures = 0,
          weak_scenarios = 0;
  // --by-kind: one row per failure, its scenarios' hits in one cell.
  std::vector<std::string> groups;
  std::map<std::string, std::string> group_how, group_expected, group_cells;
  for (const auto& sc : scenarios()) {
    if (!std::regex_search(sc.name, filter)) continue;
    int64_t hits = 0;
    std::string misses;
    for (int64_t s = 1; s <= seeds; ++s) {
      const RunResult r = run(sc, static_cast<uint64_t>(s), verbose);
      if (!r.truth_ok) {
        ++truth_failures;
        std::printf("GROUND TRUTH FAILED: %s seed %lld: %s\n", sc.name.c_str(), static_cast<long long>(s),
                    r.truth_error.c_str());
      }
      hits += r.hit ? 1 : 0;
      if (!r.hit) misses += " seed " + std::to_string(s) + ": " + (r.top.empty() ? "no hypothesis" : r.top) + ";";
    }
    std::string expected = "no incident";
    if (sc.kind) {
      expected = std::string(torchdbg::to_string(*sc.kind));
      if (sc.or_kind) expected += std::string(" or ") + torchdbg::to_string(*sc.or_kind);
      expected += sc.layer == "*" ? " (any layer)" : sc.layer == "input" || sc.layer == "loss" ? " @ " + sc.layer : "";
    }
    const std::string score = std::to_string(hits) + "/" + std::to_string(seeds);
    if (by_kind) {
      if (!group_how.count(sc.group)) {
        groups.push_back(sc.group);
        group_how[sc.group] = sc.how;
        group_expected[sc.group] = expected + (sc.kind && sc.layer != "input" && sc.layer != "loss" && sc.layer != "*"
                                                   ? " @ the layer"
                                                   : "");
      }
      std::string& cell = group_cells[sc.group];
      cell += (cell.empty() ? "" : ", ") + sc.name.substr(sc.group.size() + 2) + " " + score;
    } else {
      std::printf("| %s | %s | %s | %s |%s\n", sc.name.c_str(), sc.how.c_str(),
                  (expected + (sc.layer != "input" && sc.layer != "loss" && sc.layer != "*" && sc.kind ? " @ " + sc.layer : ""))
                      .c_str(),
                  score.c_str(), misses.empty() ? "" : (" misses:" + misses).c_str());
      std::fflush(stdout);
    }
    if (static_cast<double>(hits) < min_scenario * static_cast<double>(seeds)) ++weak_scenarios;
    if (sc.kind) {
      fail_hits += hits;
      fail_runs += seeds;
    } else {
      healthy_hits += hits;
      healthy_runs += seeds;
    }
  }
  if (by_kind) {
    std::printf("| induced at the onset (step %lld to %lld) | expected top hypothesis | hits per scenario |\n",
                static_cast<long long>(9 + g_late), static_cast<long long>(13 + g_late));
    std::printf("|---|---|---|\n");
    for (const auto& g : groups)
      std::printf("| %s: %s | %s | %s |\n", g.c_str(), group_how[g].c_str(), group_expected[g].c_str(),
                  group_cells[g].c_str());
  }
  const double acc = fail_runs > 0 ? static_cast<double>(fail_hits) / static_cast<double>(fail_runs) : 1.0;
  std::printf("\nfailures: %lld/%lld runs with the right top hypothesis (%.1f%%); healthy: %lld/%lld runs without an incident; ground truth failures: %lld\n",
              static_cast<long long>(fail_hits), static_cast<long long>(fail_runs), 100.0 * acc,
              static_cast<long long>(healthy_hits), static_cast<long long>(healthy_runs),
              static_cast<long long>(truth_failures));
  if (g_activation_budget > 0.0) {
    std::printf("activation_budget %.3g chose:", g_activation_budget);
    for (const auto& [n, runs] : g_chosen)
      std::printf(" every %lld step(s) in %lld run(s);", static_cast<long long>(n), static_cast<long long>(runs));
    std::printf("\n");
  }
  if (weak_scenarios > 0)
    std::printf("%lld scenario(s) below --min-scenario-accuracy %.2f\n", static_cast<long long>(weak_scenarios), min_scenario);
  const bool ok = truth_failures == 0 && healthy_hits == healthy_runs && acc >= min_accuracy && weak_scenarios == 0;
  return ok ? 0 : 1;
}
