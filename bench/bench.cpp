// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// Overhead of torchdbg on a training step, measured with baseline and monitored steps
// interleaved in rounds in one process (these machines are shared and noisy: compare ratios
// from one run). Prints one line per model and mode and writes the same figures as JSON.
//
//   torchdbg_bench [--threads N] [--rounds R] [--steps S] [--rss-steps N] [--json FILE] [--models
//   mlp,scripted,cnn,transformer,gru,tiny,one] [--modes
//   detached,full,sampled,every10,act10,budget10,idle,observer,reporter,live]
//   [--sample K] [--no-health] [--device cpu|cuda] [--default-malloc] [--count-ops]
//   torchdbg_bench --models MODEL --train-only MODE [--steps N] [--warmup W]
//
// `sampled` is full with HookManagerOptions().sampling(StatsSampling().stride(K)) (K = 8 by
// default): tensors of 16 * K blocks of 2048 values and more (up to 16 MiB) get a light pass
// (sums) and one block in K through the full kernel (see StatsSampling).
//
// --count-ops also prints, per model, the LibTorch operators one baseline step and one full
// step dispatch (with the most frequent extra ones and the .item() reads): on a GPU each
// operator costs at least a dispatch and most a kernel launch.
//
// --train-only MODE (plain, or one of the modes above but reporter and live) trains --steps
// steps of the one model --models names in that mode after --warmup steps (10), inside
// train_counted(), and does nothing else: bench/count_instructions.sh counts the instructions
// it runs there under callgrind, a figure that does not drift with the machine's load.
//
// It first prints the machine (CPU model, threads, copy bandwidth): every figure is this
// machine's.
//
// glibc's mmap and trim thresholds are fixed (32 MiB, 1 GiB) unless --default-malloc: with
// its dynamic threshold, the baseline steps' allocation cost depends on what the monitored
// steps freed before them.
//
// `reporter` is full with a Reporter (no exporter) fed by the health monitor; `live` is
// reporter with the live page (torchdbg/live.hpp) serving and a page open: a thread that
// fetches /state and /sections every second, as the page does, during the monitored steps.
// live against reporter is what the page costs the run (built with cpp-httplib only).
//
// `observer` attaches nothing: a global RecordFunction callback that boxes every operator's
// inputs and outputs and does nothing with them, registered over the window torchdbg's
// operator observer is (removed at a backward pass's first node, back at its end): what a
// naive observer of a forward from outside the model pays LibTorch before deciding anything
// (it boxes the operators inside composite ones, which torchdbg's observer does not).
//
// `scripted` is the MLP as a TorchScript module (torchdbg/jit.hpp's attach), beside `mlp`.
// `tiny` is the MLP at 16 features: it prints what one delivery costs outside the kernel.
// `one` is a single Linear with the README's quick start: what torchdbg costs per step.
// `act10` (`one` only) is the quick start with HealthOptions().activation_interval(10):
// gradients judged every step, forward outputs every 10th. `budget10` (`one` only) is the
// quick start with HealthOptions().activation_budget(0.1): forward outputs judged as often as
// keeps their measured cost within 10% of a step (the interval chosen is printed).
//
// With --device cuda the models train on the GPU, each timed step ends with a device
// synchronize, and the run also prints how many copies brought statistics to the host per
// monitored step (StatsBatching::Device: one per step, not one per layer).
#include <dlfcn.h>
#include <malloc.h>
#if defined(TORCHDBG_BENCH_LIVE)
#include <torchdbg/live.hpp>
#endif
#include <ATen/record_function.h>
#include <fmt/format.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <torchdbg/jit.hpp>
#include <torchdbg/torchdbg.hpp>
#include <type_traits>
#include <utility>
#include <vector>

#include "bench_util.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Mlp : torch::nn::Module {
  explicit Mlp(int64_t in = 784, int64_t width = 512) {
    layers.push_back(register_module("fc0", torch::nn::Linear(in, width)));
    for (int i = 1; i <= 6; ++i)
      layers.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(width, width)));
    out = register_module("out", torch::nn::Linear(width, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::relu(l(x));
    return out(x);
  }
  std::vector<torch::nn::Linear> layers;
  torch::nn::Linear out{nullptr};
};

/// The MLP's topology at 16 features and batch 4: its step is mostly fixed costs, so the
/// monitored difference is what torchdbg spends per delivery outside the statistics kernel.
struct TinyMlp : Mlp {
  TinyMlp() : Mlp(16, 16) {}
};

/// One Linear (PyTorch's regression example, a small RL policy): a step of a few tens of
/// microseconds, where what torchdbg costs per step whatever the model's size shows.
struct OneLinear : torch::nn::Module {
  OneLinear() : fc(register_module("fc", torch::nn::Linear(16, 10))) {}
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc;
};

/// A 2-block transformer language model written as users write one: token and position
/// embeddings, per block LayerNorm, q/k/v/o Linears with the heads as views, a causal
/// softmax, LayerNorm, a GELU feed-forward, residual adds, a vocabulary head. Many small
/// operators, each Linear a module of its own.
struct TransformerLm : torch::nn::Module {
  static constexpr int64_t kVocab = 256, kSeq = 64, kDim = 128, kHeads = 4, kBlocks = 2;
  struct Block : torch::nn::Module {
    Block()
        : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
          q(register_module("q", torch::nn::Linear(kDim, kDim))),
          k(register_module("k", torch::nn::Linear(kDim, kDim))),
          v(register_module("v", torch::nn::Linear(kDim, kDim))),
          o(register_module("o", torch::nn::Linear(kDim, kDim))),
          ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
          ff1(register_module("ff1", torch::nn::Linear(kDim, 4 * kDim))),
          ff2(register_module("ff2", torch::nn::Linear(4 * kDim, kDim))) {}
    torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask) {
      const int64_t b = x.size(0), t = x.size(1), hd = kDim / kHeads;
      auto h = ln1(x);
      auto split = [&](torch::Tensor y) { return y.view({b, t, kHeads, hd}).transpose(1, 2); };
      auto qh = split(q(h)), kh = split(k(h)), vh = split(v(h));
      auto att = torch::matmul(qh, kh.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
      att = torch::softmax(att.masked_fill(mask, -1e9), -1);
      auto y = torch::matmul(att, vh).transpose(1, 2).contiguous().view({b, t, kDim});
      x = x + o(y);
      return x + ff2(torch::gelu(ff1(ln2(x))));
    }
    torch::nn::LayerNorm ln1;
    torch::nn::Linear q, k, v, o;
    torch::nn::LayerNorm ln2;
    torch::nn::Linear ff1, ff2;
  };
  TransformerLm()
      : tok(register_module("tok", torch::nn::Embedding(kVocab, kDim))),
        pos(register_module("pos", torch::nn::Embedding(kSeq, kDim))),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        head(register_module("head", torch::nn::Linear(kDim, kVocab))) {
    for (int64_t i = 0; i < kBlocks; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), std::make_shared<Block>()));
  }
  torch::Tensor forward(torch::Tensor ids) {
    const int64_t t = ids.size(1);
    auto mask = torch::ones({t, t}, ids.options().dtype(torch::kBool)).triu(1);
    auto x = tok(ids) + pos(torch::arange(t, ids.options()));
    for (auto& b : blocks) x = b->forward(x, mask);
    return head(ln(x)).view({-1, kVocab});  // [batch * seq, vocab] for cross_entropy
  }
  static torch::Tensor input(int64_t batch) { return torch::randint(0, kVocab, {batch, kSeq}); }
  static torch::Tensor target(int64_t batch) { return torch::randint(0, kVocab, {batch * kSeq}); }
  torch::nn::Embedding tok, pos;
  std::vector<std::shared_ptr<Block>> blocks;
  torch::nn::LayerNorm ln;
  torch::nn::Linear head;
};

/// A GRUCell unrolled over 32 time steps and a Linear head on the last state: one module
/// called 32 times a step, each call a delivery of its own.
struct UnrolledGru : torch::nn::Module {
  static constexpr int64_t kSteps = 32, kIn = 32, kHidden = 128;
  UnrolledGru()
      : cell(register_module("cell", torch::nn::GRUCell(kIn, kHidden))),
        head(register_module("head", torch::nn::Linear(kHidden, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {  // [batch, time, features]
    auto h = torch::zeros({x.size(0), kHidden}, x.options());
    for (int64_t t = 0; t < x.size(1); ++t) h = cell(x.select(1, t), h);
    return head(h);
  }
  static torch::Tensor input(int64_t batch) { return torch::randn({batch, kSteps, kIn}); }
  static torch::Tensor target(int64_t batch) { return torch::randint(0, 10, {batch}); }
  torch::nn::GRUCell cell;
  torch::nn::Linear head;
};

/// The bench MLP as a TorchScript module: what `torch.jit.script` of the same Python MLP
/// gives (eight Linear submodules, `torch.relu` between them), defined here with
/// `torch::jit::Module::define` from an eager Mlp's weights, trained through the graph
/// executor as a model loaded with `torch::jit::load` is. Beside `mlp` in one run it shows
/// what attaching to a TorchScript model costs against the same model in C++.
struct ScriptedMlp {
  ScriptedMlp() : module("Mlp") {
    // An activation fused into a kernel has no delivery, and where LibTorch has LLVM
    // (Debian's 2.6) compiling a CPU kernel takes minutes: the fuser off, as docs/attach.md says.
    torch::jit::setTensorExprFuserEnabled(false);
    const Mlp eager;
    std::string code = "def forward(self, x):\n";
    auto add = [&](const std::string& name, const torch::nn::Linear& l, bool relu) {
      torch::jit::Module m("Linear");
      m.register_parameter("weight", l->weight.detach().clone().requires_grad_(), false);
      m.register_parameter("bias", l->bias.detach().clone().requires_grad_(), false);
      m.define("def forward(self, x):\n  return torch.linear(x, self.weight, self.bias)\n");
      module.register_module(name, m);
      code += relu ? "  x = torch.relu(self." + name + ".forward(x))\n" : "  return self." + name + ".forward(x)\n";
    };
    for (std::size_t i = 0; i < eager.layers.size(); ++i) add("fc" + std::to_string(i), eager.layers[i], true);
    add("out", eager.out, false);
    module.define(code);
    module.train();
  }
  std::vector<torch::Tensor> parameters() {
    std::vector<torch::Tensor> out;
    for (const auto& p : module.parameters()) out.push_back(p);
    return out;
  }
  void to(torch::Device device) { module.to(device); }
  torch::Tensor forward(const torch::Tensor& x) { return module.forward({x}).toTensor(); }
  torch::jit::Module module;
};

/// A session on the bench's model, eager or TorchScript.
template <typename Model>
torchdbg::AttachSession attach_model(Model& model, torchdbg::HookManager& hooks) {
  if constexpr (std::is_same_v<Model, ScriptedMlp>) {
    return torchdbg::attach(model.module, hooks);
  } else {
    return torchdbg::attach(model, hooks);
  }
}

struct Cnn : torch::nn::Module {
  Cnn() {
    const int64_t ch[] = {3, 32, 64, 128, 128};
    for (int i = 0; i < 4; ++i) {
      convs.push_back(register_module(
          "conv" + std::to_string(i),
          torch::nn::Conv2d(torch::nn::Conv2dOptions(ch[i], ch[i + 1], 3).padding(1))));
      bns.push_back(register_module("bn" + std::to_string(i), torch::nn::BatchNorm2d(ch[i + 1])));
    }
    fc = register_module("fc", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (int i = 0; i < 4; ++i) {
      x = torch::relu(bns[i](convs[i](x)));
      if (i == 1 || i == 2) x = torch::max_pool2d(x, 2);
    }
    return fc(x.mean({2, 3}));
  }
  std::vector<torch::nn::Conv2d> convs;
  std::vector<torch::nn::BatchNorm2d> bns;
  torch::nn::Linear fc{nullptr};
};

struct Args {
  int threads = 1;
  int rounds = 20;  // short rounds: drift between the halves cancels at a finer grain
  int steps = 5;
  int rss_steps = 10000;
  std::string json = "torchdbg_bench.json";
  // tiny: the per-delivery cost; one: the fixed cost
  std::string models = "mlp,scripted,cnn,transformer,gru,tiny,one";
  std::string modes = "detached,full,sampled,every10,idle";
  int64_t sample = 8;  // --sample: the stride of `sampled` (StatsSampling::stride)
  bool health = true;  // --no-health: statistics hooks only, to see the health monitor's share
  std::string device = "cpu";
  bool fixed_malloc = true;  // --default-malloc: glibc's dynamic mmap/trim thresholds
  bool count_ops = false;    // --count-ops: LibTorch operators per step, baseline and full
  std::string train_only;    // --train-only MODE: --steps steps of the one model, nothing else
  int warmup = 10;           // --warmup: --train-only's steps before the counted ones
};

bool model_listed(const std::string& list, const std::string& name);

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    auto next = [&](const char* name) {
      if (i + 1 >= argc) throw std::runtime_error(std::string("missing value for ") + name);
      return std::string(argv[++i]);
    };
    if (!std::strcmp(argv[i], "--threads"))
      a.threads = std::stoi(next("--threads"));
    else if (!std::strcmp(argv[i], "--default-malloc"))
      a.fixed_malloc = false;
    else if (!std::strcmp(argv[i], "--rounds"))
      a.rounds = std::stoi(next("--rounds"));
    else if (!std::strcmp(argv[i], "--steps"))
      a.steps = std::stoi(next("--steps"));
    else if (!std::strcmp(argv[i], "--rss-steps"))
      a.rss_steps = std::stoi(next("--rss-steps"));
    else if (!std::strcmp(argv[i], "--json"))
      a.json = next("--json");
    else if (!std::strcmp(argv[i], "--models"))
      a.models = next("--models");
    else if (!std::strcmp(argv[i], "--modes"))
      a.modes = next("--modes");
    else if (!std::strcmp(argv[i], "--device")) {
      a.device = next("--device");
      bool ok = a.device == "cpu" || a.device.rfind("cuda", 0) == 0;
      try {
        ok = ok && (torch::Device(a.device).is_cpu() || torch::Device(a.device).is_cuda());
      } catch (const c10::Error&) {
        ok = false;
      }
      if (!ok) throw std::runtime_error("--device: expected cpu, cuda or cuda:N, got '" + a.device + "'");
    }
    else if (!std::strcmp(argv[i], "--sample")) {
      a.sample = std::stoll(next("--sample"));
      if (a.sample < 2) throw std::runtime_error("--sample: expected a stride of at least 2, got " + std::to_string(a.sample));
    }
    else if (!std::strcmp(argv[i], "--no-health"))
      a.health = false;
    else if (!std::strcmp(argv[i], "--count-ops"))
      a.count_ops = true;
    else if (!std::strcmp(argv[i], "--warmup"))
      a.warmup = std::stoi(next("--warmup"));
    else if (!std::strcmp(argv[i], "--train-only")) {
      a.train_only = next("--train-only");
      if (!model_listed("plain,detached,full,sampled,every10,act10,budget10,idle,observer", a.train_only))
        throw std::runtime_error("--train-only: expected plain, detached, full, sampled, every10, act10, budget10, idle or observer, got '" +
                                 a.train_only + "'");
    }
    else
      throw std::runtime_error(std::string("unknown argument ") + argv[i]);
  }
  if (!a.train_only.empty()) {
    if (a.steps <= 0 || a.warmup < 0)
      throw std::runtime_error("--train-only: expected --steps > 0 and --warmup >= 0, got " + std::to_string(a.steps) +
                               " and " + std::to_string(a.warmup));
    if ((a.train_only == "every10" || a.train_only == "act10") && (a.steps % 10 != 0 || a.warmup % 10 != 0))
      throw std::runtime_error("--train-only " + a.train_only + ": --steps and --warmup must be multiples of 10 (one due "
                               "step in ten counted), got " + std::to_string(a.steps) + " and " + std::to_string(a.warmup));
  }
  return a;
}

/// Whether `name` is one of the comma-separated `list`'s entries (models, modes).
bool model_listed(const std::string& list, const std::string& name) {
  std::size_t start = 0;
  while (start <= list.size()) {
    const std::size_t end = std::min(list.find(',', start), list.size());
    if (list.compare(start, end - start, name) == 0) return true;
    start = end + 1;
  }
  return false;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// LibTorch operators dispatched while `f` runs, on every thread, by name (nested ones
/// included): on a GPU each costs a launch or at least a dispatch, and the monitored step's
/// extra operators are where a device step's overhead goes.
template <typename F>
std::map<std::string, int64_t> count_operators(F&& f) {
  static std::mutex mutex;
  static std::map<std::string, int64_t>* counts = nullptr;
  std::map<std::string, int64_t> out;
  {
    std::lock_guard<std::mutex> lock(mutex);
    counts = &out;
  }
  const auto handle = at::addGlobalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
        std::lock_guard<std::mutex> lock(mutex);
        if (counts != nullptr) ++(*counts)[fn.name()];
        return nullptr;
      }).scopes({at::RecordScope::FUNCTION}));
  f();
  at::removeCallback(handle);
  std::lock_guard<std::mutex> lock(mutex);
  counts = nullptr;
  return out;
}

/// The `observer` mode: what LibTorch charges a naive observer of a forward from outside the
/// model, with nothing decided. A global callback that asks for every operator's inputs and
/// outputs (as torchdbg's observer does) and returns at once, registered from construction to
/// destruction except during backward passes run on the constructing thread: it removes
/// itself at such a pass's first autograd node and is put back at the pass's end, also when
/// the pass throws (torchdbg's queue_pass_end), as torchdbg's observer is. Unlike torchdbg's,
/// it boxes the operators inside composite ones too (torchdbg turns RecordFunction off inside
/// those it decided). One at a time.
class BareObserver {
 public:
  BareObserver() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (live_) throw std::runtime_error("BareObserver: one at a time");
    live_ = true;
    owner_ = std::this_thread::get_id();
    add();
  }
  ~BareObserver() {
    std::lock_guard<std::mutex> lock(mutex_);
    live_ = false;
    if (handle_ != 0) at::removeCallback(handle_);
    handle_ = 0;
  }
  BareObserver(const BareObserver&) = delete;
  BareObserver& operator=(const BareObserver&) = delete;

 private:
  static void add() {  // under mutex_
    if (!live_ || handle_ != 0) return;
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(&BareObserver::on_start, [](const at::RecordFunction&, at::ObserverContext*) {})
            .needsInputs(true)
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                     at::RecordScope::TORCHSCRIPT_FUNCTION}));
  }
  static void readd() {
    std::lock_guard<std::mutex> lock(mutex_);
    add();
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    static constexpr std::string_view kEngineNode = "autograd::engine::evaluate_function";
    const std::string_view name = fn.name();
    if (fn.scope() != at::RecordScope::BACKWARD_FUNCTION && name.substr(0, kEngineNode.size()) != kEngineNode)
      return nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // A pass on another thread (a device's autograd thread) keeps it, as torchdbg does.
      if (handle_ == 0 || std::this_thread::get_id() != owner_) return nullptr;
    }
    if (!torchdbg::detail::queue_pass_end(&BareObserver::readd, &BareObserver::readd)) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    if (handle_ != 0) at::removeCallback(handle_);
    handle_ = 0;
    return nullptr;
  }
  static inline std::mutex mutex_;
  static inline at::CallbackHandle handle_ = 0;
  static inline bool live_ = false;
  static inline std::thread::id owner_;
};

/// What a mode puts on the model: torchdbg's session, the bare observer (`observer`), or
/// nothing (`plain`, `detached`).
template <typename Model>
void watch(const std::string& mode, Model& model, torchdbg::HookManager& hooks,
           std::optional<torchdbg::AttachSession>& session, std::optional<BareObserver>& bare) {
  if (mode == "observer") {
    bare.emplace();
  } else if (mode != "plain" && mode != "detached") {
    session.emplace(attach_model(model, hooks));
  }
}

/// What a monitored run installs: forward statistics of every child and activation,
/// gradient statistics of every parameter, and the health monitor (states, events) on all of
/// them (every step, or every 10th).
struct Monitor {
  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health;
  torchdbg::HealthInstallation<std::mutex, std::mutex> fed;
  torchdbg::Reporter reporter;
  torchdbg::ReporterInstallation reported;
  /// `quick_start`: the README's quick start only (the health monitor, no other hook);
  /// `with_reporter`: a Reporter fed by the monitor, as a live page needs.
  /// `sample_stride` > 1: statistics of large tensors from a sample (StatsSampling).
  /// `activation_interval` > 1: the health monitor judges forward outputs every that many
  /// steps, gradients every step (HealthOptions::activation_interval; the quick start's `act10`).
  /// `activation_budget` > 0: as often as keeps their cost within that share of a step
  /// (HealthOptions::activation_budget; `budget10`).
  Monitor(bool every10, bool with_health = true, bool quick_start = false, bool with_reporter = false,
          int64_t sample_stride = 1, int64_t activation_interval = 1, double activation_budget = 0.0)
      : hooks(torchdbg::HookManagerOptions()
                  .inspector(torchdbg::InspectorOptions().sample_rate(0.0))
                  .sampling(torchdbg::StatsSampling().stride(sample_stride))),
        health(torchdbg::HealthOptions()
                   .interval(every10 ? 10 : 1)
                   .activation_interval(activation_interval)
                   .activation_budget(activation_budget)) {
    if (with_health) fed = health.install(hooks);
    if (with_reporter) reported = reporter.install(hooks, &health);
    if (quick_start) return;
    // every10 does full's work on every 10th step: the same hooks, each in its own direction
    // (every_n_steps alone fires in both, which would do twice full's work on a due step).
    auto trig_f =
        every10 ? torchdbg::HookTrigger::every_n_steps(10) : torchdbg::HookTrigger::every_forward();
    auto trig_b = every10 ? torchdbg::HookTrigger::every_n_steps(10)
                          : torchdbg::HookTrigger::every_backward();
    hooks.register_hook(torchdbg::HookConfig()
                            .name("fwd")
                            .trigger(trig_f)
                            .direction(torchdbg::CallDirection::Forward)
                            .actions({torchdbg::HookAction::inspect_tensor()}));
    hooks.register_hook(torchdbg::HookConfig()
                            .name("bwd")
                            .trigger(trig_b)
                            .direction(torchdbg::CallDirection::Backward)
                            .actions({torchdbg::HookAction::track_gradients()}));
  }
};

template <typename Model, typename = void>
struct HasInput : std::false_type {};
template <typename Model>
struct HasInput<Model, std::void_t<decltype(Model::input(1))>> : std::true_type {};

template <typename Model>
struct Trainer {
  std::shared_ptr<Model> model = std::make_shared<Model>();
  torch::optim::SGD opt{model->parameters(), torch::optim::SGDOptions(0.01)};
  torch::Tensor x, y;
  torch::Device device;
  Trainer(std::vector<int64_t> shape, int64_t batch, torch::Device dev = torch::kCPU) : device(dev) {
    shape.insert(shape.begin(), batch);
    model->to(device);
    if constexpr (HasInput<Model>::value) {  // token ids, sequences: the model makes its batch
      x = Model::input(batch).to(device);
      y = Model::target(batch).to(device);
    } else {
      x = torch::randn(shape).to(device);
      y = torch::randint(0, 10, {batch}).to(device);
    }
  }
  double step() {
    const auto t0 = Clock::now();
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();
    opt.step();
    if (device.is_cuda()) torch::cuda::synchronize();
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  }
};

/// The steps --train-only counts (callgrind collects inside this function only).
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((noinline, noipa))  // no clone either: callgrind toggles on this one name
#else
__attribute__((noinline))
#endif
void train_counted(const std::function<void()>& step, int steps) {
  for (int i = 0; i < steps; ++i) step();
}

/// --train-only: `a.steps` steps of one model in `mode` after `a.warmup` steps (the first
/// steps build per-layer state; the health monitor judges its first steps as a warm-up), set
/// up as bench_model sets up its monitored half (`one`: the quick start).
template <typename Model>
void train_only(std::vector<int64_t> shape, int64_t batch, const Args& a, bool quick_start) {
  const std::string& mode = a.train_only;
  Trainer<Model> tr(shape, batch, torch::Device(a.device));
  Monitor monitor(mode == "every10", a.health && mode != "idle", quick_start, false,
                  mode == "sampled" ? a.sample : 1, mode == "act10" ? 10 : 1, mode == "budget10" ? 0.1 : 0.0);
  if (mode == "idle") monitor.hooks.clear_hooks();
  std::optional<torchdbg::AttachSession> session;
  std::optional<BareObserver> bare;
  watch(mode, *tr.model, monitor.hooks, session, bare);
  int64_t n = 0;
  const std::function<void()> step = [&] {
    if (mode != "plain") monitor.hooks.set_step(n++);
    tr.step();
  };
  for (int i = 0; i < a.warmup; ++i) step();
  train_counted(step, a.steps);
}

/// The overhead from paired windows: a window is `period` steps' worth of consecutive rounds
/// (whole rounds; every10 needs windows that hold exactly one due step), and its difference is
/// the monitored steps' time minus the baseline steps' time of the same rounds. The median
/// difference over windows, relative to the median baseline window, is the overhead: pairing
/// cancels drift between rounds, and the median ignores the windows a burst of load on the
/// shared cores hit.
struct Paired {
  double percent = 0.0;
  double difference_us_per_step = 0.0;
  /// A distribution-free 95% confidence interval of `percent` (the median's, from order
  /// statistics: no assumption on how load on shared cores is distributed); NaN under 6
  /// windows, too few for one.
  double percent_low = std::numeric_limits<double>::quiet_NaN();
  double percent_high = std::numeric_limits<double>::quiet_NaN();
  double difference_low_us_per_step = std::numeric_limits<double>::quiet_NaN();  // the same interval
  double difference_high_us_per_step = std::numeric_limits<double>::quiet_NaN();
  int windows = 0;
  int steps_per_window = 0;
};

/// The 0-based ranks [lo, hi] of sorted values that bracket the median of n with at least 95%
/// confidence: the largest k with P(Binomial(n, 1/2) < k) <= 2.5%, from k - 1 to n - k.
std::optional<std::pair<std::size_t, std::size_t>> median_interval_ranks(std::size_t n) {
  double cdf = 0.0, pmf = std::pow(0.5, static_cast<double>(n));  // P(X = 0)
  std::size_t k = 0;  // P(X < k) = cdf
  while (k < n / 2 && cdf + pmf <= 0.025) {
    cdf += pmf;
    pmf *= static_cast<double>(n - k) / static_cast<double>(k + 1);
    ++k;
  }
  if (k == 0) return std::nullopt;
  return std::make_pair(k - 1, n - k);
}

Paired paired_overhead(const std::vector<double>& base, const std::vector<double>& mon, int steps,
                       int period) {
  int rounds_per_window = 1;
  while ((rounds_per_window * steps) % period != 0) ++rounds_per_window;
  const std::size_t per_window = static_cast<std::size_t>(rounds_per_window * steps);
  std::vector<double> diffs, bases;
  for (std::size_t i = 0; i + per_window <= std::min(base.size(), mon.size()); i += per_window) {
    double sb = 0.0, sm = 0.0;
    for (std::size_t k = i; k < i + per_window; ++k) {
      sb += base[k];
      sm += mon[k];
    }
    diffs.push_back(sm - sb);
    bases.push_back(sb);
  }
  Paired p;
  p.windows = static_cast<int>(diffs.size());
  p.steps_per_window = static_cast<int>(per_window);
  if (diffs.empty()) return p;
  const double d = median(diffs), b = median(bases);
  p.percent = 100.0 * d / b;
  p.difference_us_per_step = d / static_cast<double>(per_window);
  if (const auto ranks = median_interval_ranks(diffs.size())) {
    std::sort(diffs.begin(), diffs.end());
    p.percent_low = 100.0 * diffs[ranks->first] / b;
    p.percent_high = 100.0 * diffs[ranks->second] / b;
    p.difference_low_us_per_step = diffs[ranks->first] / static_cast<double>(per_window);
    p.difference_high_us_per_step = diffs[ranks->second] / static_cast<double>(per_window);
  }
  return p;
}

/// The copy bandwidth bench_machine measured (GB/s), for the read-floor arithmetic.
double g_copy_gbs = 0.0;
/// `--sample`: the stride of the `sampled` mode and of the sampled kernel figures.
int64_t g_sample = 8;

/// Bytes of the tensors the full monitor reads in one step: every forward and backward
/// delivery's tensor, counted by a hook on a manager of its own (one untimed step).
template <typename Model>
double delivered_bytes_per_step(Trainer<Model>& tr) {
  torchdbg::HookManager counter;
  double bytes = 0.0;
  counter.register_callback("bytes", [&](const torchdbg::HookContext& c) {
    bytes += static_cast<double>(c.tensor().numel()) * static_cast<double>(c.tensor().element_size());
  });
  counter.register_hook(torchdbg::HookConfig()
                            .name("forward bytes")
                            .trigger(torchdbg::HookTrigger::every_forward())
                            .direction(torchdbg::CallDirection::Forward)
                            .actions({torchdbg::HookAction::custom_callback("bytes")}));
  counter.register_hook(torchdbg::HookConfig()
                            .name("backward bytes")
                            .trigger(torchdbg::HookTrigger::every_backward())
                            .direction(torchdbg::CallDirection::Backward)
                            .actions({torchdbg::HookAction::custom_callback("bytes")}));
  auto session = attach_model(*tr.model, counter);
  counter.set_step(0);
  tr.step();
  return bytes;
}

/// For the live mode: the live page serving `monitor` and a thread that reads it as an open
/// page does (/state and /sections every second) while opened.
class PageReader {
 public:
  explicit PageReader(Monitor* monitor) {
    if (monitor == nullptr) return;
#if defined(TORCHDBG_BENCH_LIVE)
    server_.emplace(monitor->hooks, monitor->health, monitor->reporter, torchdbg::LiveOptions().print_url(false));
    thread_ = std::thread([this] {
      httplib::Client c("127.0.0.1", server_->port());
      const httplib::Headers token{{"X-Torchdbg-Token", server_->token()}};
      std::unique_lock<std::mutex> lock(mutex_);
      while (!done_) {
        if (open_) {
          lock.unlock();
          const bool ok = c.Get("/state", token) && c.Get("/sections", token);
          lock.lock();
          if (ok) ++reads_;
        }
        wake_.wait_for(lock, std::chrono::seconds(1), [this] { return done_; });
      }
    });
#else
    throw std::runtime_error("torchdbg_bench: built without cpp-httplib, so without the live mode");
#endif
  }
  ~PageReader() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  /// The page reads while one of these lives.
  struct Open {
    explicit Open(PageReader& p) : p_(p) { p_.set(true); }
    ~Open() { p_.set(false); }
    PageReader& p_;
  };
  [[nodiscard]] int64_t reads() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return reads_;
  }

 private:
  void set(bool open) {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = open;
  }
#if defined(TORCHDBG_BENCH_LIVE)
  std::optional<torchdbg::LiveServer> server_;
#endif
  std::thread thread_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool done_ = false, open_ = false;
  int64_t reads_ = 0;
};

template <typename Model>
nlohmann::json bench_model(const std::string& name, std::vector<int64_t> shape, int64_t batch,
                           const Args& a, bool print = true, bool quick_start = false) {
  Trainer<Model> tr(shape, batch, torch::Device(a.device));
  for (int i = 0; i < 3; ++i) tr.step();  // warm-up
  nlohmann::json out;
  // "idle": attached to a manager with no hook at all, so nothing is ever due: what merely
  // having tensor hooks on the parameters does to LibTorch's step.
  for (const std::string mode :
       {"detached", "full", "sampled", "every10", "act10", "budget10", "idle", "observer", "reporter", "live"}) {
    if (!model_listed(a.modes, mode)) continue;
    if ((mode == "act10" || mode == "budget10") && !quick_start) continue;  // the quick start's options (`one`)
    std::vector<double> base, mon;
    uint64_t copies = 0, deliveries = 0;
    // One monitor per mode, kept across rounds (its per-layer state is built once, as in a
    // real run); only the attachment comes and goes, so baseline steps run detached.
    const bool reporting = mode == "reporter" || mode == "live";
    Monitor monitor(mode == "every10", a.health && mode != "idle", quick_start, reporting && a.health,
                    mode == "sampled" ? a.sample : 1, mode == "act10" ? 10 : 1, mode == "budget10" ? 0.1 : 0.0);
    if (mode == "idle") monitor.hooks.clear_hooks();
    PageReader page(mode == "live" ? &monitor : nullptr);
    for (int r = 0; r < a.rounds; ++r) {
      // ABBA: odd rounds run the monitored half first, so drift within a round (allocator,
      // caches, frequency) cancels instead of favouring one side.
      auto run_base = [&] {
        for (int s = 0; s < a.steps; ++s) base.push_back(tr.step());
      };
      if (r % 2 == 0) run_base();
      {
        PageReader::Open open(page);  // the page reads during the monitored half only
        std::optional<torchdbg::AttachSession> session;
        std::optional<BareObserver> bare;
        watch(mode, *tr.model, monitor.hooks, session, bare);
        for (int s = 0; s < a.steps; ++s) {
          monitor.hooks.set_step(r * a.steps + s);
          mon.push_back(tr.step());
        }
        if (session) {
          copies += session->host_transfers();
          deliveries += session->forward_deliveries() + session->backward_deliveries();
        }
      }
      if (r % 2 == 1) run_base();
    }
    const double b = median(base), m = median(mon);
    // The headline: median step times, monitored against baseline. every10's cost sits in
    // one step of ten, which a median of steps hides: there the headline is the paired
    // estimate over windows of ten steps (one due step each), which a burst of load on shared
    // cores moves far less than a mean of all steps would.
    const bool sparse = mode == "every10" || mode == "act10" || mode == "budget10";
    const Paired paired = paired_overhead(base, mon, a.steps, sparse ? 10 : 1);
    const double median_steps = 100.0 * (m - b) / b;
    const double overhead = sparse ? paired.percent : median_steps;
    const double copies_per_step = static_cast<double>(copies) / static_cast<double>(mon.size());
    if (print && mode == "full" && !tr.device.is_cuda() && g_copy_gbs > 0.0) {
      // The floor of reading every delivered tensor once from memory, at copy bandwidth (data
      // still in cache reads faster: the floor is at most this).
      const double bytes = delivered_bytes_per_step(tr);
      const double floor_us = bytes / (g_copy_gbs * 1e9) * 1e6;
      fmt::print("read floor {}: {:.2f} MB delivered per step / {:.1f} GB/s = {:.0f} us, {:.1f}% of the {:.0f} us step\n",
                 name, bytes / 1e6, g_copy_gbs, floor_us, 100.0 * floor_us / b, b);
      out["read_floor"] = {{"bytes_per_step", bytes}, {"floor_us", floor_us}, {"percent", 100.0 * floor_us / b}};
    }
    if (print) {
      fmt::print("overhead {} {}: {:.1f}%\n", name, mode, overhead);
      fmt::print("  paired windows {} {}: {:.1f}% (median of {} windows of {} steps; 95% interval {})\n", name,
                 mode, paired.percent, paired.windows, paired.steps_per_window,
                 std::isnan(paired.percent_low)
                     ? std::string("needs 6 windows")
                     : fmt::format("{:+.1f}% to {:+.1f}%", paired.percent_low, paired.percent_high));
      if (tr.device.is_cuda()) fmt::print("host copies per step {} {}: {:.2f}\n", name, mode, copies_per_step);
      if (mode == "live") fmt::print("  page reads during live {}: {}\n", name, page.reads());
      std::fflush(stdout);
    }
    out[mode] = {{"overhead_percent", overhead},
                 {"overhead_percent_median_steps", median_steps},
                 {"overhead_percent_paired", paired.percent},
                 {"overhead_percent_paired_interval",
                  std::isnan(paired.percent_low) ? nlohmann::json() : nlohmann::json::array({paired.percent_low, paired.percent_high})},
                 {"paired_windows", paired.windows},
                 {"paired_difference_us_per_step", paired.difference_us_per_step},
                 {"paired_difference_us_per_step_interval",
                  std::isnan(paired.difference_low_us_per_step)
                      ? nlohmann::json()
                      : nlohmann::json::array({paired.difference_low_us_per_step, paired.difference_high_us_per_step})},
                 {"baseline_median_us", b},
                 {"monitored_median_us", m},
                 {"host_copies_per_step", copies_per_step},
                 {"deliveries_per_step", static_cast<double>(deliveries) / static_cast<double>(mon.size())}};
    if (mode == "budget10") {  // what the monitor measured and chose
      const auto rep = monitor.health.report();
      out[mode]["activation_interval"] = rep.activation_interval;
      out[mode]["activation_cost"] = rep.activation_cost ? nlohmann::json(*rep.activation_cost) : nlohmann::json();
    }
  }
  if (a.count_ops) {
    // One baseline step and one monitored (full) step, with the operators each dispatched.
    const auto total = [](const std::map<std::string, int64_t>& m) {
      int64_t n = 0;
      for (const auto& [op, c] : m) n += c;
      return n;
    };
    const auto base_ops = count_operators([&] { tr.step(); });
    Monitor monitor(false, a.health);
    std::map<std::string, int64_t> mon_ops;
    {
      auto session = attach_model(*tr.model, monitor.hooks);
      for (int s = 0; s < 3; ++s) {
        monitor.hooks.set_step(s);
        tr.step();
      }
      monitor.hooks.set_step(3);
      mon_ops = count_operators([&] {
        tr.step();
        monitor.hooks.set_step(4);  // the step's batch comes to the host here
      });
    }
    std::vector<std::pair<int64_t, std::string>> extra;
    for (const auto& [op, c] : mon_ops) {
      const auto it = base_ops.find(op);
      const int64_t d = c - (it == base_ops.end() ? 0 : it->second);
      if (d != 0) extra.emplace_back(d, op);
    }
    std::sort(extra.rbegin(), extra.rend());
    const auto scalar = mon_ops.find("aten::_local_scalar_dense");
    const int64_t items = scalar == mon_ops.end() ? 0 : scalar->second;
    if (print) {
      fmt::print("operators per step {}: baseline {}, full {} (+{}), .item() reads {}\n", name, total(base_ops),
                 total(mon_ops), total(mon_ops) - total(base_ops), items);
      for (std::size_t i = 0; i < extra.size() && i < 12; ++i)
        fmt::print("  {:+6} {}\n", extra[i].first, extra[i].second);
    }
    nlohmann::json top = nlohmann::json::object();
    for (std::size_t i = 0; i < extra.size() && i < 40; ++i) top[extra[i].second] = extra[i].first;
    out["operators"] = {{"baseline", total(base_ops)}, {"full", total(mon_ops)}, {"item_reads", items}, {"extra", top}};
  }
  return out;
}

/// What one delivery (a forward output or a gradient reaching the hooks) costs besides the
/// statistics kernel: the tiny MLP's paired step difference (see paired_overhead), per delivery.
nlohmann::json bench_delivery(const Args& a) {
  Args tiny = a;
  tiny.modes = "full";
  tiny.steps = 20;  // ~0.2 ms steps: more per round for the same share of round overhead
  const nlohmann::json r = bench_model<TinyMlp>("tiny", {16}, 4, tiny, /*print=*/false)["full"];
  const double per_step = r["deliveries_per_step"].get<double>();
  const double us = r["paired_difference_us_per_step"].get<double>() / std::max(per_step, 1.0);
  fmt::print("delivery cost full: {:.2f} us per delivery ({:.0f} per step, 16-wide MLP, {:.0f} us step)\n",
             us, per_step, r["baseline_median_us"].get<double>());
  return {{"us_per_delivery", us},
          {"deliveries_per_step", per_step},
          {"baseline_median_us", r["baseline_median_us"]},
          {"monitored_median_us", r["monitored_median_us"]}};
}

/// What torchdbg costs per step whatever the model: the quick start (a health monitor, every
/// step), the same judging every 10th step (`HealthOptions().interval(10)`) and a manager with
/// no hook (idle) on one Linear, in microseconds per step; beside them what a do-nothing
/// operator observer costs over the same window (`observer`: LibTorch's price of watching).
nlohmann::json bench_fixed(const Args& a) {
  Args one = a;
  one.modes = "full,every10,act10,budget10,idle,observer";
  one.steps = 50;  // ~30 us steps: more per round for the same share of round overhead
  one.rounds = std::max(a.rounds, 40);
  const nlohmann::json r = bench_model<OneLinear>("one", {16}, 32, one, /*print=*/false, /*quick_start=*/true);
  nlohmann::json out;
  for (const std::string mode : {"full", "every10", "act10", "budget10", "idle", "observer"}) {
    const auto& m = r[mode];
    // every10's and act10's extra cost sits in one step of ten: their mean over paired
    // windows, not a median step
    const double us = mode == "every10" || mode == "act10" || mode == "budget10"
                          ? m["paired_difference_us_per_step"].get<double>()
                          : m["monitored_median_us"].get<double>() - m["baseline_median_us"].get<double>();
    const char* what = mode == "full"      ? ", the quick start's health monitor"
                       : mode == "every10" ? ", the quick start with HealthOptions().interval(10), mean per step"
                       : mode == "act10"   ? ", the quick start with HealthOptions().activation_interval(10) "
                                             "(gradients every step, activations every 10th), mean per step"
                       : mode == "budget10"
                           ? ", the quick start with HealthOptions().activation_budget(0.1) (gradients every step, "
                             "activations as often as keeps them within 10% of a step), mean per step"
                       : mode == "idle"    ? ", attached, no hook"
                                           : ", no torchdbg: a RecordFunction callback boxing the operators' inputs "
                                             "and outputs over the quick start's window, deciding nothing";
    const auto& interval = m["paired_difference_us_per_step_interval"];
    std::string chose;
    if (mode == "budget10" && m.contains("activation_interval"))
      chose = m["activation_cost"].is_number()
                  ? fmt::format(" (it measured activations at {:.0f}% of a step and judged them every {} steps)",
                                100.0 * m["activation_cost"].get<double>(), m["activation_interval"].get<int64_t>())
                  : std::string(" (still measuring)");
    fmt::print("fixed cost per step {}: {:.1f} us (one Linear 16->10, batch 32: {:.1f} us step, {:+.1f}%){}{}{}\n",
               mode, us, m["baseline_median_us"].get<double>(), m["overhead_percent"].get<double>(), what, chose,
               interval.is_array() ? fmt::format("; paired windows {:.1f} us, 95% interval {:.1f} to {:.1f} us",
                                                 m["paired_difference_us_per_step"].get<double>(),
                                                 interval[0].get<double>(), interval[1].get<double>())
                                   : std::string());
    out[mode] = {{"us_per_step", us},
                 {"activation_interval", m.value("activation_interval", nlohmann::json())},
                 {"activation_cost", m.value("activation_cost", nlohmann::json())},
                 {"paired_difference_us_per_step", m["paired_difference_us_per_step"]},
                 {"paired_difference_us_per_step_interval", interval},
                 {"baseline_median_us", m["baseline_median_us"]},
                 {"overhead_percent", m["overhead_percent"]}};
  }
  std::fflush(stdout);
  return out;
}

/// Median seconds of `reps` runs of f.
template <typename F>
double median_seconds(int reps, F&& f) {
  std::vector<double> s;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    f();
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(s);
}

/// Copy bandwidth in GB/s on 64 MiB of float32 (a copy reads and writes every byte: both count).
double copy_bandwidth_gbs() {
  auto t = torch::randn({(64ll << 20) / 4});
  auto dst = torch::empty_like(t);
  const double s = median_seconds(7, [&] { dst.copy_(t); });
  return 2.0 * static_cast<double>(t.numel()) * 4.0 / s / 1e9;
}

/// The name and driver version of CUDA device `ordinal`, read from the driver library
/// (libcuda.so.1, present wherever a GPU is usable), or "unknown GPU" without it.
std::string gpu_name(int ordinal) {
  void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (lib == nullptr) return "unknown GPU";
  using Init = int (*)(unsigned);
  using Get = int (*)(int*, int);
  using Name = int (*)(char*, int, int);
  using Version = int (*)(int*);
  const auto init = reinterpret_cast<Init>(dlsym(lib, "cuInit"));
  const auto get = reinterpret_cast<Get>(dlsym(lib, "cuDeviceGet"));
  const auto name = reinterpret_cast<Name>(dlsym(lib, "cuDeviceGetName"));
  const auto version = reinterpret_cast<Version>(dlsym(lib, "cuDriverGetVersion"));
  std::string out = "unknown GPU";
  char buf[256] = {};
  int dev = 0, v = 0;
  if (init && get && name && init(0) == 0 && get(&dev, ordinal) == 0 &&
      name(buf, static_cast<int>(sizeof(buf)) - 1, dev) == 0) {
    out = buf;
    if (version && version(&v) == 0) out += fmt::format(" (CUDA driver {}.{})", v / 1000, v % 1000 / 10);
  }
  dlclose(lib);
  return out;
}

/// The machine every figure of this run belongs to: CPU model, cores, the threads the bench
/// uses, copy bandwidth, the kernel's vector width, LibTorch's version, and with --device cuda
/// the GPU. Printed first.
nlohmann::json bench_machine(const Args& a) {
  std::string cpu = "unknown CPU";
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) cpu = line.substr(line.find_first_not_of(' ', colon + 1));
      break;
    }
  }
  const unsigned cores = std::thread::hardware_concurrency();
  const double copy_gbs = copy_bandwidth_gbs();
  g_copy_gbs = copy_gbs;
  const std::string torch_version = fmt::format("{}.{}.{}", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR,
                                                TORCH_VERSION_PATCH);
  fmt::print("machine: {}, {} hardware threads, {} intra-op thread(s), copy bandwidth {:.1f} GB/s, kernel {}, "
             "LibTorch {}\n",
             cpu, cores, a.threads, copy_gbs, torchdbg::detail::block_kernels().name, torch_version);
  nlohmann::json machine = {{"cpu", cpu},
                            {"hardware_threads", cores},
                            {"threads", a.threads},
                            {"copy_gbs", copy_gbs},
                            {"vector_width", torchdbg::detail::block_kernels().name},
                            {"libtorch", torch_version}};
  const torch::Device device(a.device);
  if (device.is_cuda()) {
    const std::string gpu = gpu_name(device.has_index() ? device.index() : 0);
    fmt::print("device: {}: {}\n", device.str(), gpu);
    machine["gpu"] = gpu;
  }
  std::fflush(stdout);
  return machine;
}

nlohmann::json bench_kernel() {
  const int64_t n = (64ll << 20) / 4;  // 64 MiB of float32
  auto t = torch::randn({n});
  std::vector<double> stat_s;
  for (int i = 0; i < 7; ++i) {
    const auto t0 = Clock::now();
    auto m = torchdbg::detail::compute_moments(t);
    stat_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    if (m.count != n) std::abort();
  }
  const double bytes = static_cast<double>(n) * 4.0;
  const double copy_gbs = copy_bandwidth_gbs();  // the kernel only reads
  const double stat_gbs = bytes / median(stat_s) / 1e9;
  fmt::print("stats kernel float32 64MiB: {:.2f} GB/s ({:.0f}% of copy bandwidth)\n", stat_gbs,
             100.0 * stat_gbs / copy_gbs);
  // What a delivery sees: a tensor just written, still in cache (1 MiB, a 512x512 weight's
  // gradient). The kernel is compute-bound there; moments only (no sign counts) is what
  // gradient checks ask for.
  auto hot = torch::randn({(1 << 20) / 4});
  const double hot_bytes = static_cast<double>(hot.numel()) * 4.0;
  const auto full_s = median_seconds(101, [&] { (void)torchdbg::detail::compute_moments(hot); });
  const auto moments_s =
      median_seconds(101, [&] { (void)torchdbg::detail::compute_moments(hot, /*signs=*/false); });
  fmt::print("stats kernel float32 1MiB in cache: {:.2f} GB/s, moments only {:.2f} GB/s\n",
             hot_bytes / full_s / 1e9, hot_bytes / moments_s / 1e9);
  // The in-cache tensor with StatsSampling (stride --sample): a light pass and one block in K
  // (64 MiB is read whole: it comes from memory, where the full kernel is at bandwidth).
  torchdbg::detail::SampleInfo info;
  const auto sampled = [&](const at::Tensor& x, bool signs) {
    (void)torchdbg::detail::compute_moments(x, signs, g_sample, 0, info);
  };
  const auto hot_sampled_s = median_seconds(101, [&] { sampled(hot, true); });
  const auto hot_sampled_moments_s = median_seconds(101, [&] { sampled(hot, false); });
  fmt::print("stats kernel sampled (stride {}) 1MiB in cache: {:.2f} GB/s, moments only {:.2f} GB/s{}\n", g_sample,
             hot_bytes / hot_sampled_s / 1e9, hot_bytes / hot_sampled_moments_s / 1e9,
             info.values == 0 ? " (read whole: fewer than 16 groups at this stride)" : "");
  // A histogram step on a huge activation: statistics with the distribution of 1e8 floats.
  auto big = torch::randn({100000000});
  const auto dist_s = median_seconds(3, [&] {
    (void)torchdbg::compute_stats(big, torchdbg::StatsOptions().distribution(true));
  });
  big = torch::Tensor();
  fmt::print("stats with distribution, 1e8 float32: {:.2f} s\n", dist_s);
  return {{"stats_gbs", stat_gbs},
          {"distribution_1e8_s", dist_s},
          {"copy_gbs", copy_gbs},
          {"percent_of_copy", 100.0 * stat_gbs / copy_gbs},
          {"cached_gbs", hot_bytes / full_s / 1e9},
          {"cached_moments_gbs", hot_bytes / moments_s / 1e9},
          {"sampled", {{"stride", g_sample},
                       {"cached_gbs", hot_bytes / hot_sampled_s / 1e9},
                       {"cached_moments_gbs", hot_bytes / hot_sampled_moments_s / 1e9}}},
          {"vector_width", torchdbg::detail::block_kernels().name}};  // which fast path ran
}

nlohmann::json bench_rss(const Args& a) {
  Trainer<Mlp> tr({784}, 128);
  Monitor m(false);
  auto session = torchdbg::attach(*tr.model, m.hooks);
  const int warm = std::min(200, a.rss_steps / 10);
  for (int s = 0; s < warm; ++s) {
    m.hooks.set_step(s);
    tr.step();
  }
  const long start = torchdbg_bench::rss_kib();
  for (int s = warm; s < warm + a.rss_steps; ++s) {
    m.hooks.set_step(s);
    tr.step();
  }
  const double growth = static_cast<double>(torchdbg_bench::rss_kib() - start) / 1024.0;
  fmt::print("rss growth mlp full {} steps: {:.1f} MiB\n", a.rss_steps, growth);
  return {{"steps", a.rss_steps}, {"growth_mib", growth}};
}

}  // namespace

/// OpenBLAS keeps its own thread pool, which torch::set_num_threads does not size; its idle
/// workers spin on sched_yield and, on a 2-core machine, disturb every timing.
void set_blas_threads(int n) {
  using Fn = void (*)(int);
  if (auto f = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(n);
}

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    g_sample = a.sample;
    if (torch::Device(a.device).is_cuda() && !torch::cuda::is_available())
      throw std::runtime_error("--device " + a.device + ": no CUDA device is available to this LibTorch");
    if (a.fixed_malloc) {
      // glibc raises its mmap threshold after large frees, so what the monitored steps free
      // changes how the baseline steps allocate (page faults on fresh mmaps): fixed
      // thresholds give both halves the same allocator.
      mallopt(M_MMAP_THRESHOLD, 32 << 20);
      mallopt(M_TRIM_THRESHOLD, 1 << 30);
    }
    torch::set_num_threads(a.threads);
    set_blas_threads(a.threads);
    torch::manual_seed(0);
    if (!a.train_only.empty()) {
      const std::string& m = a.models;
      if (m == "mlp") train_only<Mlp>({784}, 128, a, false);
      else if (m == "scripted") train_only<ScriptedMlp>({784}, 128, a, false);
      else if (m == "cnn") train_only<Cnn>({3, 32, 32}, 32, a, false);
      else if (m == "transformer") train_only<TransformerLm>({}, 8, a, false);
      else if (m == "gru") train_only<UnrolledGru>({}, 32, a, false);
      else if (m == "one") train_only<OneLinear>({16}, 32, a, true);
      else throw std::runtime_error("--train-only: --models names one of mlp, scripted, cnn, transformer, gru, one; got '" + m + "'");
      return 0;
    }
    nlohmann::json report{{"threads", a.threads},
                           {"rounds", a.rounds},
                           {"steps_per_round", a.steps},
                           {"device", a.device},
                           {"fixed_malloc", a.fixed_malloc}};
    report["machine"] = bench_machine(a);
    const auto wants = [&](const char* m) { return model_listed(a.models, m); };
    if (wants("mlp")) report["mlp"] = bench_model<Mlp>("mlp", {784}, 128, a);
    if (wants("scripted")) report["scripted"] = bench_model<ScriptedMlp>("scripted", {784}, 128, a);
    if (wants("cnn")) report["cnn"] = bench_model<Cnn>("cnn", {3, 32, 32}, 32, a);
    if (wants("transformer")) report["transformer"] = bench_model<TransformerLm>("transformer", {}, 8, a);
    if (wants("gru")) report["gru"] = bench_model<UnrolledGru>("gru", {}, 32, a);
    if (wants("tiny")) report["delivery"] = bench_delivery(a);
    if (wants("one")) report["fixed"] = bench_fixed(a);
    report["kernel"] = bench_kernel();
    if (a.rss_steps > 0) report["rss"] = bench_rss(a);
    std::ofstream(a.json) << report.dump(2) << "\n";
    fmt::print("figures written to {}\n", a.json);
  } catch (const std::exception& e) {
    fmt::print(stderr, "torchdbg_bench: {}\n", e.what());
    return 2;
  }
  return 0;
}
