// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once
// A differential model fuzzer for attach, shared by the test suite ([fuzz_attach]) and
// bench/attach_fuzz.cpp (longer runs). From a seed it draws a model from a grammar of what
// users write — Linear, LayerNorm, Embedding, GRUCell and MultiheadAttention calls,
// activations as functions and as modules, views before an activation, residuals, shared
// (repeated) calls, a tied pair, functional use of a module's parameters, a module called
// between another's call and its activation, no-grad blocks — and trains it a few steps with
// SGD or Adam in one of several backward styles (one backward, gradient accumulation over
// micro-batches, retain_graph and a second backward). The model's forward records, by handle
// and without running any operator of its own, what each module returned and what each
// activation made of it: the reference. Every delivery attach makes (name, call, shape,
// statistics) and every gradient and norm is compared with it. A mismatch prints the model
// as code to paste into a regression test.
//
// Gradients taken with torch::autograd::grad (style 3) run no tensor hook: the harness hands
// them over with observe_gradients, as a user must. A sparse Embedding (SGD only: Adam takes no
// sparse gradients) delivers sparse gradients.
// A second session may watch the same model (Spec::second): a forward-only one that also sees
// no-grad forwards, on a second manager or on the same one, or a full session on a second
// manager; each receives every delivery of its own. Hogwild (style 4): two threads each run a
// forward and a backward pass of the model, and one pass runs whole while the other is
// blocked part way (a tensor hook after statement Spec::tap): each pass's gradients and norms
// are its own. Its forward deliveries are checked by name and count only: threads training one
// model share its call counters (a limit by construction, see attach.hpp).

#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <torchdbg/attach.hpp>

namespace torchdbg_test::fuzz {

/// One statement of a generated forward, acting on the running activation `h` ([B, W]).
enum class Op {
  Linear,       // h = lin[a](h); with c == 1 then h += input in place (the delivery is lin's output before)
  ActFn,        // h = act_a(h) as a function           (after a call: "<module>/<act>")
  ActModule,    // h = act_mod[a](h)                    (an activation module: no parameters)
  ViewAct,      // h = act_a(h.view(B, 2, W/2)).view(B, W)  (the activation in the view's shape)
  Residual,     // h = h + lin[a](h)
  Norm,         // h = norm[a](h)                       (LayerNorm)
  Between,      // y = lin[a](h); z = lin[b](h); h = act_c(y) + z   (lin[b] runs in between)
  Functional,   // h = torch::linear(h, lin[a]->weight, lin[a]->bias)  (a call of lin[a])
  NoGrad,       // { NoGradGuard; lin[a](h.detach()); }  (no delivery by default)
  Gru,          // h = gru(h, hidden) over `b` time steps (calls 0..b-1)
  Attention,    // h = mha(h, h, h)                      (its output only)
  Tied,         // h = tied_b(h) where tied_b shares tied_a's weight (bias-free, both Linear)
  Conv,         // h = conv(h.view(B, 4, W/4)).view(B, W)  (an activation after it is conv's)
  LstmCell,     // h = std::get<0>(lstm_cell(h, {h0, c0}))  (a tuple output: its first tensor)
  BatchNorm,    // h = bn(h)                             (running statistics updated in place)
  Dropout,      // h = dropout(h)                        (a reader that is no activation)
  Siamese,      // h = lin[a](h) + lin[a](h * 0.5)       (calls k and k+1 of one module)
};

struct Stmt {
  Op op;
  int a = 0, b = 0, c = 0;
};

/// A generated model: its statements and sizes.
struct Spec {
  std::vector<Stmt> body;
  int64_t width = 8;
  int64_t linears = 3;
  int64_t embedding_vocab = 0;  // > 0: the input is token ids through an Embedding
  int style = 0;                // 0 backward, 1 accumulation (2 micro-batches), 2 retain_graph twice,
                                // 3 torch::autograd::grad handed over with observe_gradients
  int optimizer = 0;            // 0 SGD, 1 Adam
  uint64_t seed = 0;
  bool sparse_embedding = false;
  int loss = 0;  // 0 h.pow(2).mean(), 1 cross_entropy(h, y), 2 mse_loss(h, 0) (losses run operators inside)
  int second = 0;  // a second session: 0 none; 1 forward-only with no_grad_forward on a second manager;
                   // 2 the same on the same manager; 3 a full session on a second manager
  int tap = 0;     // style 4: the statement after which the first thread's pass blocks
};

constexpr const char* kActs[] = {"relu", "tanh", "sigmoid", "gelu", "silu", "softplus", "elu"};
constexpr int kNumActs = 7;

inline torch::Tensor act_fn(int a, const torch::Tensor& x) {
  switch (a) {
    case 0: return torch::relu(x);
    case 1: return torch::tanh(x);
    case 2: return torch::sigmoid(x);
    case 3: return torch::gelu(x);
    case 4: return torch::silu(x);
    case 5: return torch::softplus(x);
    default: return torch::elu(x);
  }
}

inline const char* op_name(Op op) {
  switch (op) {
    case Op::Linear: return "Linear";
    case Op::ActFn: return "ActFn";
    case Op::ActModule: return "ActModule";
    case Op::ViewAct: return "ViewAct";
    case Op::Residual: return "Residual";
    case Op::Norm: return "Norm";
    case Op::Between: return "Between";
    case Op::Functional: return "Functional";
    case Op::NoGrad: return "NoGrad";
    case Op::Gru: return "Gru";
    case Op::Attention: return "Attention";
    case Op::Tied: return "Tied";
    case Op::Conv: return "Conv";
    case Op::LstmCell: return "LstmCell";
    case Op::BatchNorm: return "BatchNorm";
    case Op::Dropout: return "Dropout";
    default: return "Siamese";
  }
}

/// The spec as C++ to paste into a regression test.
inline std::string as_code(const Spec& s) {
  std::ostringstream o;
  o << "torchdbg_test::fuzz::Spec spec{{";
  for (std::size_t i = 0; i < s.body.size(); ++i) {
    const Stmt& t = s.body[i];
    o << (i ? ", " : "") << "{Op::" << op_name(t.op) << ", " << t.a << ", " << t.b << ", " << t.c << "}";
  }
  o << "}, " << s.width << ", " << s.linears << ", " << s.embedding_vocab << ", " << s.style << ", " << s.optimizer
    << ", " << s.seed << ", " << (s.sparse_embedding ? "true" : "false") << ", " << s.loss << ", " << s.second
    << ", " << s.tap << "};";
  return o.str();
}

inline Spec random_spec(uint64_t seed) {
  std::mt19937_64 g(seed);
  const auto pick = [&](int lo, int hi) { return static_cast<int>(std::uniform_int_distribution<int>(lo, hi)(g)); };
  Spec s;
  s.seed = seed;
  s.width = 4 * pick(1, 4);  // even, so ViewAct can split it
  s.linears = pick(2, 4);
  s.embedding_vocab = pick(0, 2) == 0 ? pick(5, 30) : 0;
  s.style = pick(0, 3);
  s.optimizer = pick(0, 1);
  s.sparse_embedding = s.embedding_vocab > 0 && pick(0, 1) == 1;
  s.loss = pick(0, 2);
  if (s.sparse_embedding) s.optimizer = 0;
  const int n = pick(2, 9);
  const int lin = static_cast<int>(s.linears) - 1;
  for (int i = 0; i < n; ++i) {
    Stmt t{Op::Linear, pick(0, lin), 0, 0};
    switch (pick(0, 20)) {
      case 0: case 1: case 2: t.op = Op::Linear; break;
      case 3: case 4: t = {Op::ActFn, pick(0, kNumActs - 1)}; break;
      case 5: t = {Op::ActModule, pick(0, 1)}; break;
      case 6: t = {Op::ViewAct, pick(0, kNumActs - 1)}; break;
      case 7: t = {Op::Residual, pick(0, lin)}; break;
      case 8: t = {Op::Norm, pick(0, 1)}; break;
      case 9: t = {Op::Between, pick(0, lin), pick(0, lin), pick(0, kNumActs - 1)}; break;
      case 10: t = {Op::Functional, pick(0, lin)}; break;
      case 11: t = {Op::NoGrad, pick(0, lin)}; break;
      case 12: t = {Op::Gru, 0, pick(1, 3)}; break;
      case 13: t = {Op::Attention}; break;
      case 14: t = {Op::Tied, pick(0, 1)}; break;
      case 15: t = {Op::Conv}; break;
      case 16: t = {Op::LstmCell}; break;
      case 17: t = {Op::BatchNorm}; break;
      case 18: t = {Op::Dropout}; break;
      default: t = {Op::Siamese, pick(0, lin)}; break;
    }
    if (t.op == Op::Between && t.a == t.b) t.b = (t.b + 1) % static_cast<int>(s.linears);
    if (t.op == Op::Linear && (seed + static_cast<uint64_t>(i)) % 4 == 0) t.c = 1;  // no draw: seeds keep their models
    s.body.push_back(t);
  }
  // The loss must depend on a parameter: without an Embedding, the first statement is a call.
  if (s.embedding_vocab == 0) s.body.insert(s.body.begin(), Stmt{Op::Linear, pick(0, lin)});
  s.second = pick(0, 5);
  if (s.second > 3) s.second = 0;
  if (pick(0, 4) == 0) {
    s.style = 4;
    s.second = 0;
    // Limit by construction: a tied pair is told apart by call order, and threads share the
    // call counters.
    for (auto& t : s.body)
      if (t.op == Op::Tied) t = Stmt{Op::Linear, t.a};
  }
  s.tap = pick(0, static_cast<int>(s.body.size()) - 1);
  return s;
}

/// What the generated forward returned to its caller, by handle: the reference.
struct Expected {
  std::string name;
  int64_t call = 0;  // in a session that observes grad-mode forwards only (-1: none sees it)
  torch::Tensor value;
  int64_t eval_call = 0;  // in a session that also observes no-grad forwards
  torch::Tensor input;    // a module call's data input (its scale: "input_from" or "input_rms")
};

struct Model : torch::nn::Module {
  explicit Model(const Spec& s) : spec(s) {
    if (s.embedding_vocab > 0)
      emb = register_module(
          "emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(s.embedding_vocab, s.width).sparse(s.sparse_embedding)));
    for (int64_t i = 0; i < s.linears; ++i)
      lins.push_back(register_module("lin" + std::to_string(i), torch::nn::Linear(s.width, s.width)));
    for (int i = 0; i < 2; ++i) {
      norms.push_back(register_module("norm" + std::to_string(i), torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.width}))));
    }
    act_relu = register_module("act_relu", torch::nn::ReLU());
    act_tanh = register_module("act_tanh", torch::nn::Tanh());
    gru = register_module("gru", torch::nn::GRUCell(s.width, s.width));
    mha = register_module("mha", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(s.width, 2)));
    tied0 = register_module("tied0", torch::nn::Linear(torch::nn::LinearOptions(s.width, s.width).bias(false)));
    tied1 = register_module("tied1", torch::nn::Linear(torch::nn::LinearOptions(s.width, s.width).bias(false)));
    tied1->weight = tied0->weight;  // tied: attributed by call order (both are Linear)
    conv = register_module("conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(4, 4, 3).padding(1)));
    lstm_cell = register_module("lstm_cell", torch::nn::LSTMCell(s.width, s.width));
    bn = register_module("bn", torch::nn::BatchNorm1d(s.width));
    dropout = register_module("dropout", torch::nn::Dropout(0.25));
  }

  /// Runs the body on `x` and the loss on the result; appends what each module returned (and
  /// each activation of it) to `expected`, with its call index in the pass. The square of a
  /// module's output is delivered too, as "<module>/pow"; the operators inside a loss
  /// (cross_entropy's log_softmax) are not.
  /// `tap`, when set, is given `h` after statement `tap_at` (to register a tensor hook).
  torch::Tensor forward(const torch::Tensor& x, std::vector<Expected>& expected,
                        const std::function<void(const torch::Tensor&)>& tap = nullptr, int tap_at = -1) {
    std::map<std::string, int64_t> calls, eval_calls;
    using Call = std::pair<int64_t, int64_t>;  // (call, eval_call)
    int64_t tied_uses = 0;
    const auto note = [&](const std::string& name, const torch::Tensor& v, const torch::Tensor& in) {
      const Call k{calls[name]++, eval_calls[name]++};
      expected.push_back({name, k.first, v, k.second, in});
      return k;
    };
    // The module output `h` is, if it is one: its name and call (an activation of it is
    // delivered as "<name>/<act>").
    std::string last;
    Call last_call{0, 0};
    const auto output_of = [&](const std::string& name, const torch::Tensor& v, const torch::Tensor& in) {
      last = name;
      last_call = note(name, v, in);
    };
    const auto activation = [&](int a, const torch::Tensor& in, const torch::Tensor& out) {
      (void)in;
      if (!last.empty()) expected.push_back({last + "/" + kActs[a], last_call.first, out, last_call.second, {}});
      last.clear();
    };
    int stmt = -1;
    const int64_t B = x.size(0);
    torch::Tensor h;
    if (emb) {
      h = emb(x);
      output_of("emb", h, x);
    } else {
      h = x;
    }
    for (const Stmt& t : spec.body) {
      switch (t.op) {
        case Op::Linear: {
          const auto in = h;
          h = lins[t.a](h);
          if (t.c == 1) {
            // Changed in place after its delivery (`out += identity`): what the next call
            // reads is no delivery's tensor any more.
            output_of("lin" + std::to_string(t.a), h.detach().clone(), in);
            h.add_(in);
          } else {
            output_of("lin" + std::to_string(t.a), h, in);
          }
          break;
        }
        case Op::ActFn: {
          const auto out = act_fn(t.a, h);
          activation(t.a, h, out);
          h = out;
          break;
        }
        case Op::ActModule: {
          const auto out = t.a == 0 ? act_relu(h) : act_tanh(h);
          activation(t.a == 0 ? 0 : 1, h, out);
          h = out;
          break;
        }
        case Op::ViewAct: {
          const auto v = h.view({B, 2, spec.width / 2});
          const auto out = act_fn(t.a, v);
          activation(t.a, v, out);
          h = out.view({B, spec.width});
          break;
        }
        case Op::Residual: {
          const auto y = lins[t.a](h);
          output_of("lin" + std::to_string(t.a), y, h);
          h = h + y;
          last.clear();
          break;
        }
        case Op::Norm: {
          const auto in = h;
          h = norms[t.a](h);
          output_of("norm" + std::to_string(t.a), h, in);
          break;
        }
        case Op::Between: {
          const auto y = lins[t.a](h);
          const std::string ya = "lin" + std::to_string(t.a);
          const Call yk = note(ya, y, h);
          const auto z = lins[t.b](h);
          note("lin" + std::to_string(t.b), z, h);
          const auto a = act_fn(t.c, y);
          expected.push_back({ya + "/" + kActs[t.c], yk.first, a, yk.second, {}});
          h = a + z;
          last.clear();
          break;
        }
        case Op::Functional: {
          const auto in = h;
          h = torch::linear(h, lins[t.a]->weight, lins[t.a]->bias);
          output_of("lin" + std::to_string(t.a), h, in);
          break;
        }
        case Op::NoGrad: {
          torch::NoGradGuard no_grad;
          const auto y = lins[t.a](h.detach());
          const std::string name = "lin" + std::to_string(t.a);
          expected.push_back({name, -1, y, eval_calls[name]++, h});  // seen with no_grad_forward only
          break;
        }
        case Op::Gru: {
          auto hidden = torch::zeros({B, spec.width});
          for (int k = 0; k < t.b; ++k) {
            hidden = gru(h, hidden);
            note("gru", hidden, h);
          }
          h = hidden;
          last = "gru";
          last_call = {calls["gru"] - 1, eval_calls["gru"] - 1};
          break;
        }
        case Op::Attention: {
          const auto q = h.unsqueeze(0);  // [1, B, W]: one sequence position
          const auto out = std::get<0>(mha(q, q, q));
          output_of("mha", out, q);
          h = out.squeeze(0);  // a view: an activation of it is still "mha/<act>"
          break;
        }
        case Op::Tied: {
          // Limit by construction: two bias-free Linears sharing their weight are told apart
          // by call order only; the uses of a pass alternate tied0, tied1, tied0, ...
          const auto in = h;
          h = (t.a == 0 ? tied0 : tied1)(h);
          output_of(tied_uses++ % 2 == 0 ? "tied0" : "tied1", h, in);
          break;
        }
        case Op::Conv: {
          const auto in = h.view({B, 4, spec.width / 4});
          const auto out = conv(in);
          output_of("conv", out, in);
          h = out.view({B, spec.width});  // a view: an activation of it is still "conv/<act>"
          break;
        }
        case Op::LstmCell: {
          const auto in = h;
          const auto state = lstm_cell(h, std::make_tuple(torch::zeros({B, spec.width}), torch::zeros({B, spec.width})));
          h = std::get<0>(state);
          output_of("lstm_cell", h, in);
          break;
        }
        case Op::BatchNorm: {
          const auto in = h;
          h = bn(h);
          output_of("bn", h, in);
          break;
        }
        case Op::Dropout: {
          h = dropout(h);
          last.clear();
          break;
        }
        case Op::Siamese: {
          const std::string name = "lin" + std::to_string(t.a);
          const auto y1 = lins[t.a](h);
          note(name, y1, h);
          const auto half = h * 0.5;
          const auto y2 = lins[t.a](half);
          note(name, y2, half);
          h = y1 + y2;
          last.clear();
          break;
        }
      }
      if (tap && ++stmt == tap_at && h.requires_grad()) tap(h);
    }
    if (spec.loss == 1) return torch::nn::functional::cross_entropy(h, torch::randint(0, spec.width, {B}));
    if (spec.loss == 2) return torch::nn::functional::mse_loss(h, torch::zeros_like(h));
    const auto sq = h.pow(2);
    if (!last.empty()) expected.push_back({last + "/pow", last_call.first, sq, last_call.second, {}});
    return sq.mean();
  }

  Spec spec;
  torch::nn::Embedding emb{nullptr};
  std::vector<torch::nn::Linear> lins;
  std::vector<torch::nn::LayerNorm> norms;
  torch::nn::ReLU act_relu{nullptr};
  torch::nn::Tanh act_tanh{nullptr};
  torch::nn::GRUCell gru{nullptr};
  torch::nn::MultiheadAttention mha{nullptr};
  torch::nn::Linear tied0{nullptr}, tied1{nullptr};
  torch::nn::Conv1d conv{nullptr};
  torch::nn::LSTMCell lstm_cell{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::nn::Dropout dropout{nullptr};
};

/// One delivery as a hook saw it.
struct Seen {
  std::string name;
  bool forward = true;
  int64_t call = -1;
  std::string parameter;
  std::vector<int64_t> shape;
  double mean = 0, std = 0, min = 0, max = 0, l2 = 0;
  int64_t numel = 0;
  std::thread::id thread;
  // where a module call's data input came from (attach's metadata)
  std::string input_from;
  int64_t input_call = -1;
  std::optional<double> input_rms;
  std::optional<bool> input_alike;
};

struct Result {
  int64_t deliveries = 0, gradients = 0, checks = 0;
  std::vector<std::string> mismatches;
};

inline bool close(double a, double b, double rel) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::fabs(a - b) <= rel * std::max({1.0, std::fabs(a), std::fabs(b)});
}

/// A manager with a callback recording every delivery while `in_pass` (others: `outside`).
struct Recorder {
  torchdbg::HookManager hooks;
  std::mutex mutex;
  std::vector<Seen> seen, outside;
  std::atomic<bool> in_pass{false};
  /// Each pass's end as a GradientNorm listener saw it (the passes of style 4 end one by one).
  struct PassEnd {
    std::thread::id thread;
    double global = 0;
    std::vector<std::pair<std::string, double>> modules;
  };
  std::vector<PassEnd> ends;
  Recorder() {
    hooks.register_callback("fuzz", [this](const torchdbg::HookContext& c) {
      Seen s;
      s.name = std::string(c.layer_name());
      s.forward = c.is_forward();
      if (auto k = c.metadata_value("call")) s.call = std::stoll(std::string(*k));
      if (auto p = c.metadata_value("parameter")) s.parameter = std::string(*p);
      if (auto f = c.metadata_value("input_from")) s.input_from = std::string(*f);
      if (auto k = c.metadata_value("input_call")) s.input_call = std::stoll(std::string(*k));
      if (auto r = c.metadata_value("input_rms")) s.input_rms = std::stod(std::string(*r));
      if (auto a = c.metadata_value("input_alike")) s.input_alike = *a == "1";
      s.shape = c.tensor().sizes().vec();
      const auto& st = c.stats();
      s.mean = st.mean;
      s.std = st.std;
      s.min = st.min;
      s.max = st.max;
      s.l2 = st.l2_norm;
      s.numel = st.numel;
      s.thread = std::this_thread::get_id();
      std::lock_guard<std::mutex> lock(mutex);
      (in_pass.load() ? seen : outside).push_back(std::move(s));
    });
    hooks.register_hook(torchdbg::HookConfig().trigger(torchdbg::HookTrigger::every_n_steps(1)).actions(
        {torchdbg::HookAction::custom_callback("fuzz")}));
  }
  /// Records pass ends with `session`'s module norms.
  void listen(const torchdbg::AttachSession& session) {
    hooks.add_listener([this, &session](torchdbg::HookManager::Change c) {
      if (c != torchdbg::HookManager::Change::GradientNorm) return;
      PassEnd e{std::this_thread::get_id(), hooks.reported_gradient_norm().value_or(-1.0), session.gradient_norms()};
      std::lock_guard<std::mutex> lock(mutex);
      ends.push_back(std::move(e));
    });
  }
};

/// Trains the model of `spec` for `steps` steps under attach and compares every delivery
/// and gradient with the reference. Never throws; mismatches are described in the result.
inline Result run(const Spec& spec, int steps = 3) {
  Result res;
  const auto fail = [&](const std::string& what) {
    if (res.mismatches.size() < 20) res.mismatches.push_back(what);
  };
  try {
    torch::manual_seed(spec.seed);
    auto model = std::make_shared<Model>(spec);
    Recorder main, other;  // `other`: the second manager (Spec::second 1 and 3)
    auto session = torchdbg::attach(*model, main.hooks, torchdbg::AttachOptions().concurrent_forward(spec.style == 4));
    main.listen(session);
    std::optional<torchdbg::AttachSession> second;
    const auto eval_only = torchdbg::AttachOptions().backward(false).no_grad_forward(true);
    if (spec.second == 1) second.emplace(torchdbg::attach(*model, other.hooks, eval_only));
    if (spec.second == 2) second.emplace(torchdbg::attach(*model, main.hooks, eval_only));
    if (spec.second == 3) {
      second.emplace(torchdbg::attach(*model, other.hooks));
      other.listen(*second);
    }
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (spec.optimizer == 0) {
      opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    } else {
      opt = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(0.001));
    }
    const int64_t B = 5;
    const auto params = model->named_parameters();
    // The module a parameter's gradient is delivered under, and its own name there.
    const auto split_name = [](const std::string& full) {
      const auto dot = full.rfind('.');
      return std::make_pair(full.substr(0, dot), full.substr(dot + 1));
    };
    const auto dense = [](const torch::Tensor& t) { return t.is_sparse() ? t.to_dense() : t; };
    std::vector<torch::Tensor> trainable;
    for (const auto& p : params)
      if (p.value().requires_grad()) trainable.push_back(p.value());
    int64_t inputs_made = 0;
    const auto input = [&] {
      if (spec.embedding_vocab > 0) return torch::randint(0, spec.embedding_vocab, {B});
      // every third batch of identical samples (copies of an environment reset together)
      if (inputs_made++ % 3 == 1) return torch::randn({1, spec.width}).expand({B, spec.width}).contiguous();
      return torch::randn({B, spec.width});
    };
    // Every parameter's gradient now, in double (zeros where none).
    using Grads = std::map<std::string, torch::Tensor>;
    const auto snapshot = [&] {
      Grads g;
      for (const auto& p : params)
        g[p.key()] = (p.value().grad().defined() ? dense(p.value().grad()) : torch::zeros_like(p.value()))
                         .to(torch::kDouble)
                         .clone();
      return g;
    };

    // Forward: every wanted delivery (name, call) exactly once with its values, nothing else.
    // `eval`: the session also observes no-grad forwards (its own call numbering).
    struct Want {
      const Expected* e;
      bool eval;
    };
    const auto check_forward = [&](const std::string& where, const std::vector<Seen>& list,
                                   const std::vector<Want>& wants, bool by_call) {
      std::multimap<std::pair<std::string, int64_t>, const Seen*> got;
      for (const auto& s : list) {
        if (!s.forward) continue;
        ++res.deliveries;
        got.emplace(std::make_pair(s.name, by_call ? s.call : 0), &s);
      }
      for (const Want& w : wants) {
        const Expected& e = *w.e;
        const int64_t call = w.eval ? e.eval_call : e.call;
        if (call < 0) continue;
        const auto key = std::make_pair(e.name, by_call ? call : 0);
        auto it = got.find(key);
        if (it == got.end()) {
          fail(where + "'" + e.name + "' call " + std::to_string(call) + " not delivered");
          continue;
        }
        const torch::Tensor v = e.value.detach().to(torch::kDouble);
        const double mean = v.mean().item<double>(), lo = v.min().item<double>(), hi = v.max().item<double>();
        const double sd = v.numel() > 0 ? v.std(/*unbiased=*/false).item<double>() : std::nan("");
        const auto same_values = [&](const Seen& x) {
          return close(x.mean, mean, 1e-5) && close(x.min, lo, 1e-6) && close(x.max, hi, 1e-6) && close(x.std, sd, 1e-4);
        };
        // Among deliveries under one key (two sessions on one manager), the one whose values match.
        for (auto k = it; k != got.end() && k->first == key; ++k)
          if (k->second->shape == e.value.sizes().vec() && same_values(*k->second)) {
            it = k;
            break;
          }
        const Seen& s = *it->second;
        ++res.checks;
        if (s.shape != e.value.sizes().vec())
          fail(where + "'" + e.name + "' shape " + c10::str(torch::IntArrayRef(s.shape)) + " vs " + c10::str(e.value.sizes()));
        else if (!same_values(s))
          fail(where + "'" + e.name + "' call " + std::to_string(call) + " holds other values (mean " +
               std::to_string(s.mean) + " vs " + std::to_string(v.mean().item<double>()) + ")");
        // Rows 0 and 1 of the input as the call read it: "0" only where they differ, "1" where
        // they agree within 1e-4 of their largest magnitude (every position looked at up to 64).
        if (e.input.defined() && e.input.is_floating_point() && e.input.dim() >= 2 && e.input.size(0) >= 2 &&
            e.input.numel() > 0) {
          const auto rows = e.input.detach().to(torch::kDouble).flatten(1);
          const double gap = (rows[0] - rows[1]).abs().max().item<double>();
          const double largest = rows.narrow(0, 0, 2).abs().max().item<double>();
          ++res.checks;
          if (!s.input_alike.has_value() && e.input.is_cpu() && std::isfinite(largest))
            fail(where + "'" + e.name + "' has no input_alike");
          else if (s.input_alike == false && gap == 0.0)
            fail(where + "'" + e.name + "' input_alike 0 for equal rows 0 and 1");
          else if (s.input_alike == true && rows.size(1) <= 64 && !(gap <= 1e-4 * largest * (1 + 1e-9)))
            fail(where + "'" + e.name + "' input_alike 1 for rows 0 and 1 " + std::to_string(gap) + " apart");
        }
        // The call's input scale: measured, or the output of the delivery it names.
        if (e.input.defined() && e.input.is_floating_point() && e.input.numel() > 0) {
          const double in_rms = e.input.detach().to(torch::kDouble).pow(2).mean().sqrt().item<double>();
          ++res.checks;
          if (s.input_rms) {
            if (!s.input_from.empty()) fail(where + "'" + e.name + "' has both input_rms and input_from");
            if (!close(*s.input_rms, in_rms, 1e-4))
              fail(where + "'" + e.name + "' call " + std::to_string(call) + " input_rms " +
                   std::to_string(*s.input_rms) + " vs " + std::to_string(in_rms));
          } else if (!s.input_from.empty()) {
            const Seen* from = nullptr;
            for (const auto& x : list)
              if (x.forward && x.name == s.input_from && (!by_call || x.call == s.input_call) &&
                  (from == nullptr || close(std::sqrt(x.mean * x.mean + x.std * x.std), in_rms, 1e-4)))
                from = &x;
            const double from_rms = from ? std::sqrt(from->mean * from->mean + from->std * from->std) : 0.0;
            if (from == nullptr)
              fail(where + "'" + e.name + "' input_from '" + s.input_from + "' call " +
                   std::to_string(s.input_call) + " was not delivered");
            else if (by_call && !close(from_rms, in_rms, 1e-4))
              fail(where + "'" + e.name + "' call " + std::to_string(call) + " input_from '" + s.input_from +
                   "' call " + std::to_string(s.input_call) + " has RMS " + std::to_string(from_rms) +
                   ", the input " + std::to_string(in_rms));
          } else {
            fail(where + "'" + e.name + "' call " + std::to_string(call) + " has no input scale");
          }
        }
        got.erase(it);
      }
      for (const auto& [key, s] : got)
        fail(where + "unexpected delivery '" + key.first + "' call " + std::to_string(s->call));
    };
    const auto wants_of = [](const std::vector<Expected>& expected, bool eval) {
      std::vector<Want> w;
      for (const auto& e : expected) w.push_back({&e, eval});
      return w;
    };
    // Gradients: each parameter's contribution `delta` of this pass, once, under its module;
    // `norms` (the session's module norms) and `global` (the manager's) from it alone.
    const auto check_gradients = [&](const std::string& where, const std::vector<Seen>& list, const Grads& delta,
                                     const std::vector<std::pair<std::string, double>>& norms,
                                     std::optional<double> global) {
      std::map<std::string, const Seen*> grads;
      for (const auto& s : list) {
        if (s.forward) continue;
        ++res.gradients;
        const std::string key = s.name + "." + s.parameter;
        if (grads.count(key)) fail(where + "gradient of '" + key + "' delivered twice");
        grads[key] = &s;
      }
      std::map<std::string, double> module_sq;
      double total_sq = 0;
      for (const auto& p : params) {
        const auto [module, param] = split_name(p.key());
        if (module == "tied1" && param == "weight") continue;  // tied0's: delivered once, there
        const double sq = delta.at(p.key()).pow(2).sum().item<double>();
        const auto it = grads.find(p.key());
        if (it == grads.end()) {
          // A parameter this pass did not reach has no gradient to deliver.
          if (sq > 0) fail(where + "gradient of '" + p.key() + "' not delivered");
          continue;
        }
        ++res.checks;
        if (!close(it->second->l2, std::sqrt(sq), 1e-4))
          fail(where + "gradient of '" + p.key() + "' has norm " + std::to_string(it->second->l2) + " vs " +
               std::to_string(std::sqrt(sq)));
        module_sq[module] += sq;
        total_sq += sq;
        grads.erase(it);
      }
      for (const auto& [key, s] : grads) fail(where + "unexpected gradient '" + key + "'");
      for (const auto& [module, n] : norms) {
        ++res.checks;
        if (!close(n, std::sqrt(module_sq[module]), 1e-4))
          fail(where + "module norm of '" + module + "' " + std::to_string(n) + " vs " +
               std::to_string(std::sqrt(module_sq[module])));
      }
      ++res.checks;
      if (!global || !close(*global, std::sqrt(total_sq), 1e-4))
        fail(where + "global norm " + (global ? std::to_string(*global) : "none") + " vs " +
             std::to_string(std::sqrt(total_sq)));
    };
    const auto subtract = [](const Grads& a, const Grads& b) {
      Grads d;
      for (const auto& [k, v] : a) d[k] = v - b.at(k);
      return d;
    };

    for (int64_t step = 0; step < steps; ++step) {
      main.hooks.set_step(step);
      other.hooks.set_step(step);
      opt->zero_grad();
      const std::string at_step = "step " + std::to_string(step) + " ";
      if (spec.style == 4) {
        // Two threads at once: B's whole pass runs while A's is blocked in a hook after
        // statement `tap` (or, if A's pass never reaches it, after A's pass).
        std::mutex m;
        std::condition_variable cv;
        int phase = 0;  // 1: B's forward done; 2: B may run its backward; 3: B's pass ended
        Grads before = snapshot(), at_block, after_b;
        const auto release_b = [&] {
          std::unique_lock<std::mutex> lock(m);
          if (phase >= 2) return;
          lock.unlock();
          at_block = snapshot();
          lock.lock();
          phase = 2;
          cv.notify_all();
          cv.wait(lock, [&] { return phase == 3; });
          lock.unlock();
          after_b = snapshot();
        };
        std::vector<Expected> exp_a, exp_b;
        std::thread::id thread_b;
        {
          std::lock_guard<std::mutex> lock(main.mutex);
          main.seen.clear();
          main.ends.clear();
        }
        main.in_pass = true;
        const auto loss_a = model->forward(input(), exp_a, [&](const torch::Tensor& h) {
          h.register_hook([&](const torch::Tensor&) { release_b(); });
        }, spec.tap);
        std::string b_error;
        std::thread tb([&] {
          try {
            thread_b = std::this_thread::get_id();
            const auto loss_b = model->forward(input(), exp_b);
            std::unique_lock<std::mutex> lock(m);
            phase = 1;
            cv.notify_all();
            cv.wait(lock, [&] { return phase >= 2; });
            lock.unlock();
            loss_b.backward();
            lock.lock();
            phase = 3;
            cv.notify_all();
          } catch (const std::exception& e) {
            std::lock_guard<std::mutex> lock(m);
            b_error = e.what();
            phase = 3;
            cv.notify_all();
          }
        });
        {
          std::unique_lock<std::mutex> lock(m);
          cv.wait(lock, [&] { return phase >= 1; });
        }
        loss_a.backward();
        release_b();  // nothing when A's hook ran
        tb.join();
        main.in_pass = false;
        if (!b_error.empty()) throw std::runtime_error(b_error);
        const Grads final_grads = snapshot();
        const Grads delta_b = subtract(after_b, at_block);
        Grads delta_a = subtract(final_grads, after_b);
        for (auto& [k, v] : delta_a) v = v + at_block.at(k) - before.at(k);
        std::vector<Seen> seen_a, seen_b;
        for (const auto& s : main.seen) (s.thread == thread_b ? seen_b : seen_a).push_back(s);
        // Forward deliveries by name: both threads' calls share the session's counters.
        std::vector<Seen> fwd = main.seen;
        std::vector<Want> wants = wants_of(exp_a, false);
        for (const auto& w : wants_of(exp_b, false)) wants.push_back(w);
        check_forward(at_step + "(two threads): ", fwd, wants, /*by_call=*/false);
        // One pass end each, B's first, each with its own pass's norms.
        if (main.ends.size() != 2 || main.ends[0].thread != thread_b) {
          fail(at_step + "(two threads): " + std::to_string(main.ends.size()) + " pass ends, not B's then A's");
        } else {
          check_gradients(at_step + "thread B: ", seen_b, delta_b, main.ends[0].modules, main.ends[0].global);
          check_gradients(at_step + "thread A: ", seen_a, delta_a, main.ends[1].modules, main.ends[1].global);
        }
        opt->step();
        continue;
      }
      const int passes = spec.style == 0 || spec.style == 3 ? 1 : 2;
      std::map<const c10::TensorImpl*, torch::Tensor> handed;  // style 3: autograd::grad's results
      std::vector<Expected> expected;
      torch::Tensor loss;
      for (int pass = 0; pass < passes; ++pass) {
        // Gradients before this pass, to tell this pass's contribution.
        const Grads before = snapshot();
        main.seen.clear();
        other.seen.clear();
        main.in_pass = other.in_pass = true;
        expected.clear();  // the second backward of a retained graph (style 2) has no forward
        if (spec.style != 2 || pass == 0) loss = model->forward(input(), expected);
        if (spec.style == 3) {
          const auto grads = torch::autograd::grad({loss}, trainable, {}, /*retain_graph=*/false,
                                                   /*create_graph=*/false, /*allow_unused=*/true);
          handed.clear();
          for (std::size_t i = 0; i < grads.size(); ++i)
            if (grads[i].defined()) handed[trainable[i].unsafeGetTensorImpl()] = grads[i];
          session.observe_gradients(trainable, grads);
          if (spec.second == 3) second->observe_gradients(trainable, grads);
        } else {
          loss.backward({}, /*retain_graph=*/spec.style == 2 && pass == 0);
        }
        main.in_pass = other.in_pass = false;
        const std::string where = at_step + "pass " + std::to_string(pass) + ": ";
        std::vector<Want> wants = wants_of(expected, false);
        if (spec.second == 2)
          for (const auto& w : wants_of(expected, true)) wants.push_back(w);
        check_forward(where, main.seen, wants, true);
        if (spec.second == 1) check_forward("second manager, " + where, other.seen, wants_of(expected, true), true);
        if (spec.second == 3) check_forward("second manager, " + where, other.seen, wants_of(expected, false), true);
        Grads delta;
        if (spec.style == 3) {
          for (const auto& p : params) {
            const auto h = handed.find(p.value().unsafeGetTensorImpl());
            delta[p.key()] = h == handed.end() ? torch::zeros_like(p.value(), torch::kDouble)
                                               : dense(h->second).to(torch::kDouble);
          }
        } else {
          delta = subtract(snapshot(), before);
        }
        check_gradients(where, main.seen, delta, session.gradient_norms(), main.hooks.state().gradient_norm);
        if (spec.second == 3)
          check_gradients("second manager, " + where, other.seen, delta, second->gradient_norms(),
                          other.hooks.state().gradient_norm);
      }
      if (spec.style == 3) {  // the optimizer reads .grad
        for (const auto& [impl, g] : handed)
          for (auto& t : trainable)
            if (t.unsafeGetTensorImpl() == impl) t.mutable_grad() = g.detach().clone();
      }
      opt->step();  // under no-grad: no delivery
      for (Recorder* r : {&main, &other}) {
        if (r->outside.empty()) continue;
        fail(at_step + ": " + std::to_string(r->outside.size()) + " deliveries outside forward/backward, first '" +
             r->outside.front().name + "'");
        r->outside.clear();
      }
    }
  } catch (const std::exception& e) {
    fail(std::string("exception: ") + e.what());
  }
  return res;
}

}  // namespace torchdbg_test::fuzz
