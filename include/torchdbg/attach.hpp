// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once


// Attaching a HookManager to any torch::nn::Module without changing the model's code.
//
// Mechanism (measured and chosen on LibTorch 1.13, valid on 2.x):
// * Backward: a tensor hook on every parameter of every attached module delivers the
//   gradient (`is_forward == false`, metadata {"parameter": name}) as autograd produces it.
//   The hook is registered on a parameter's first attach and stays for the tensor's life
//   (sessions subscribe to it): LibTorch cannot add or remove a tensor hook safely while a
//   backward pass on another thread may run it, and detach() must be safe at any time.
//   The first hook of a backward pass queues an autograd final callback, which computes the
//   per-module gradient norms (one host copy for all modules), reports the global norm to
//   the manager (`set_gradient_norm`) and, with `auto_step`, advances the step. Each pass
//   (an autograd graph task) keeps its own norms: passes that several threads run at once on
//   one model (Hogwild) are never summed together, and each ends on its own. A pass that
//   throws (LibTorch then drops its final callbacks) is noticed when the pass is freed: it is
//   counted (`failed_backward_passes`), its partial norms are dropped and the next pass
//   starts afresh.
// * Forward: Module::forward is not virtual and `fc1(x)` inside a user's forward never
//   passes through any registry, so the output is observed one level down: an ATen
//   RecordFunction observer sees every operator with its inputs and outputs. An operator
//   that takes a module's own parameter or buffer (or a tensor derived only from them, such
//   as `weight.t()`) together with data is attributed to that module; the outermost such
//   operator wins (nested ones are ignored). Each call of a module is one delivery with
//   metadata {"call": "<k>"}, its index among the module's calls in the step (from 0; the
//   count restarts at each step change and each backward pass), so `fc(a) + fc(b)` and a
//   Siamese encoder's two branches deliver two outputs, calls 0 and 1, as PyTorch's forward
//   hooks fire twice. An operator of the same module that consumes the call's output and
//   reads module tensors the call has not read yet continues the call (`x.matmul(w) + b`
//   delivers the sum once); one that reads the same tensors again (`fc(fc(x))`) is a new
//   call. The output is delivered when the next operator consumes it or another module
//   starts (at the latest when backward begins).
//   A parameter-free activation (relu, tanh, sigmoid, gelu, softmax, ... as a function or a
//   module) that consumes a module's output is delivered as "<module>/<activation>", e.g.
//   "fc1/relu" with metadata {"activation": "relu", "call": "0"}, also when view-like
//   operators (view, reshape, transpose, permute, flatten, squeeze, unsqueeze, contiguous,
//   expand, ...) stand between them: `relu(fc1(x).view(n, 2, 4))` delivers "fc1" as fc1
//   returned it and "fc1/relu" in the view's shape. The activation may come later: after
//   another module's call (`y = fc(x); h = other(z); a = tanh(y)`) or another reader of the
//   output (`y.detach().clone()` kept for logging), it is still "fc/tanh" (a thread
//   remembers each session's last 8 module outputs and views of them; an activation, delivered once,
//   takes its output off that list). An elementwise function that can make
//   finite values non-finite (log, sqrt, rsqrt, reciprocal, exp, pow, ...) is delivered the
//   same way with metadata {"op": "log"}, so a NaN born there is attributed to it. Module
//   outputs carry {"module_type": "torch::nn::LinearImpl", "call": "<k>"} and where their
//   data input came from: {"input_from": "<delivery>", "input_call": "<k>"} when it is
//   another delivery's output or a view of one (`fc2(relu(fc1(x)).flatten(1))` names
//   "fc1/relu"), else {"input_rms": "<RMS of it>"} (the model's input, noise, a sum); the
//   first module output after a step change also carries the input's {"input_nan":
//   "<count>", "input_inf": "<count>"} (of the raw data only, with its {"input_data_rms"},
//   where `cat`/`stack` joined it with data made from deliveries: `cat({emb(ids).sum(1), x})`). Operators inside
//   backward are ignored. Several sessions on one model (a training session and a
//   validation one with `no_grad_forward`, or two managers) each attribute every operator
//   and each receives its own deliveries. A backward pass restarts the call counts of the sessions whose
//   forward ran on its thread only, so two threads training their own models never touch
//   each other's counts, and the observer stays on during a pass when some session's
//   forward runs on another thread.
// * Tied weights: a tensor several modules read (`decoder->weight = tok->weight`, also by
//   assigning a built-in layer's `weight`/`bias` member) belongs to all of them; an
//   operator goes to the module whose kind fits it (an embedding lookup to the Embedding, a
//   matmul or linear to the Linear, a convolution to the Conv), then to the one whose own
//   tensors it reads most (a bias outranks a shared weight), then to the one called least in
//   the step. The tensor's gradient is delivered once, under the module that registered it
//   first, with metadata {"tied": "decoder.weight"} naming the others; it counts once in
//   the gradient norms, toward that module.
// * MultiheadAttention: its output is the attention output (what it returns), delivered
//   under its own name; its packed q/k/v projection is internal, and `out_proj`, whose
//   weights it applies itself, has gradients but no forward output of its own (as in
//   PyTorch, where out_proj's forward never runs).
// * Tensors on a device (StatsBatching::Device, the default): a delivery never syncs. Its
//   statistics are reduced on the device into 15 doubles and queued; at the end of the
//   backward pass (or at the next step change, `flush()`, or when `max_deferred` deliveries
//   are queued) every queued vector of a device is stacked and copied to the host at once,
//   and the queued deliveries run their hooks then, in arrival order, with those statistics.
//   The gradient norms come from the same copy. A queued tensor is held until then: hooks see
//   its data as it is at that time (an in-place change made later in the step shows), and a
//   gradient held this way is copied, not stolen, by AccumulateGrad. CPU tensors are handled
//   at once (StatsBatching::All queues them too, StatsBatching::PerDelivery queues nothing).
// * Cost: the observer is registered only while some hook could fire for a forward call at
//   the current step (HookManager::may_fire, re-evaluated on every set_step and hook change)
//   and removed otherwise, so a step with no hook due runs no torchdbg code in the forward.
//   It is also removed from the first backward node of a pass to the pass's end (unless
//   AttachOptions::concurrent_forward). Gradient hooks cost one atomic check when no hook is
//   due.
//
// Not forward outputs: in-place updates of a module's own tensors and the operators they run
// inside, operators that take a parameter together with its own gradient (optimizer
// arithmetic such as weight decay), operators that use a parameter only as a shape or dtype
// template (`g.view_as(weight)`: gradient all-reduce code does this), fresh tensors shaped
// like a parameter (`zeros_like(weight)`, `new_*`: optimizer state such as Adam's `exp_avg`,
// which is therefore never taken for the module's own), and by default anything run with
// gradients disabled (AttachOptions::no_grad_forward opts in to observing evaluation passes
// under torch::NoGradGuard). Tested with SGD (momentum, Nesterov, weight decay), Adam
// (weight decay, AMSGrad), AdamW, RMSprop (centered, momentum) and Adagrad, with and without
// no_grad_forward.
//
// Limits (attribution follows the operators; a module's forward is not itself observable):
// - a module whose forward runs several operator groups on its own tensors with something
//   between them (two linear maps of its own weights with an activation between) reports
//   each group as a call of its own;
// - a module's tensors used outside its forward (`torch::linear(h, emb->weight)` in the
//   parent's forward) are attributed to that module, as a call of it;
// - two modules of the same kind that share every tensor an operator reads (two bias-free
//   Linears tied to one weight) are told apart only by call order: the first use in a step
//   goes to the first registered;
// - a module output that nothing consumes before the step ends is delivered at the step
//   change or `flush()`, and an in-place change made to it before then is what hooks see;
// - threads training one model at once (Hogwild) share the session's call counters: a
//   call's index mixes both threads' calls (its norms do not), and a tied pair told apart by
//   call order may swap; the health monitor judges the gradients that arrive between two
//   pass ends together;
// - a backward pass run inside another one (a custom Function's backward calling
//   backward) is a pass of its own: its norm is reported, and with `auto_step` it is a step.
// Where a call must be seen exactly as the module made it (one delivery per call, the
// returned tensor, read/replace/stop), route it through torchdbg: `Hooked<>` members or
// `hooked_call` (hooked.hpp).

// The pieces, in the order data flows: options; the module table; each backward pass's
// gradient bookkeeping; the device queue; delivery names; a session's core (its state and
// delivery; the gradient entry and pass ends in core_passes); the gradient taps; the forward
// observer's per-thread state, its attribution of operators to modules, the observer itself;
// the session a user holds.
#include "torchdbg/attach/options.hpp"
#include "torchdbg/detail/compiled.hpp"
#if TORCHDBG_DEFINITIONS  // compiled mode: the session's declarations are enough
#include "torchdbg/attach/modules.hpp"
#include "torchdbg/attach/pass_ledger.hpp"
#include "torchdbg/attach/deferred.hpp"
#include "torchdbg/attach/delivery_names.hpp"
#include "torchdbg/attach/core.hpp"
#include "torchdbg/attach/core_passes.hpp"
#include "torchdbg/attach/gradient_tap.hpp"
#include "torchdbg/attach/observer_state.hpp"
#include "torchdbg/attach/attribution.hpp"
#include "torchdbg/attach/observer.hpp"
#endif
#include "torchdbg/attach/session.hpp"
