// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// AttachCore's gradient entry and the ends of backward passes (declared in core.hpp).

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "torchdbg/attach/core.hpp"

namespace torchdbg::detail {

inline void AttachCore::on_backward_end(PassLedger::Pass& pass) {
  // A pass that reached none of this session's parameters (another model's, or one taken
  // with torch::autograd::grad) is no step of it; torch::autograd::grad is suspected until
  // gradients are handed over (warned of at the next iteration's first call).
  if (!passes_.had_gradients(pass)) {
    passes_.close(pass);
    if (forward_since_pass.load()) no_gradient_pass.store(true);
    return;
  }
  forward_since_pass.store(false);
  flush_deferred();  // the queued gradients' squares count toward their passes
  if (passes_.end(pass)) finish_pass(pass);  // else when another thread's flush has its squares in
}

inline void AttachCore::finish_pass(PassLedger::Pass& pass) {
  const auto squares = passes_.close(pass).second;
  std::vector<std::pair<std::string, double>> norms;
  // The manager's listeners, on this thread, read this pass's norms (gradient_norms()).
  struct Reporting {
    Reporting(const AttachCore* c, const std::vector<std::pair<std::string, double>>* n) : saved(reporting()) {
      reporting() = {c, n};
    }
    ~Reporting() { reporting() = saved; }
    std::pair<const AttachCore*, const std::vector<std::pair<std::string, double>>*> saved;
  } scope(this, &norms);
  if (active.load() && options.gradient_norms() && !squares.empty()) {
    double total = 0.0;
    for (const auto& [m, sq] : squares) {
      norms.emplace_back(modules[m].name, std::sqrt(sq));
      total += sq;
    }
    {
      std::lock_guard<std::mutex> lock(norms_mutex_);
      last_norms_ = norms;
    }
    if (report_gradient_norm) {
      try {
        report_gradient_norm(std::sqrt(total));
      } catch (...) {
      }
    }
  }
  if (active.load() && report_pass_end) {
    try {
      report_pass_end();
    } catch (...) {
    }
  }
  if (active.load() && options.auto_step() && advance_step) {
    try {
      advance_step();
    } catch (...) {
    }
  }
}

inline std::shared_ptr<PassLedger::Pass> AttachCore::begin_pass() {
  if (!active.load()) return nullptr;
  if (!backward_due.load() && !options.auto_step()) return nullptr;
  const void* id = PassLedger::current_id();
  if (id == nullptr) return nullptr;  // not inside a backward pass (a manual hook call)
  bool opened = false;
  std::shared_ptr<PassLedger::Pass> pass = passes_.open(id, modules.size(), &opened);
  if (!opened) return pass;
  std::weak_ptr<AttachCore> self = weak_from_this();
  std::weak_ptr<PassLedger::Pass> p = pass;  // the ledger holds it until it is closed
  const bool queued = queue_pass_end(
      [self, p] {
        auto s = self.lock();
        auto q = p.lock();
        if (s && q) s->on_backward_end(*q);
      },
      [self, p] {
        auto s = self.lock();
        auto q = p.lock();
        if (s && q) s->on_backward_failed(*q);
      });
  if (!queued) {
    passes_.close(*pass);
    return nullptr;
  }
  return pass;
}

inline void AttachCore::on_backward_failed(PassLedger::Pass& pass) noexcept {
  forward_since_pass.store(false);
  failed_passes.fetch_add(1);
  flush_deferred();
  try {
    passes_.close(pass);
    if (active.load() && report_failed_pass) report_failed_pass();
  } catch (...) {
  }
}

inline void AttachCore::on_grad(std::size_t m, std::size_t param, const at::Tensor& g) {
  if (!active.load()) return;
  // The end-of-backward callback is needed for norms and queued deliveries (when hooks are
  // due) and auto_step only: a step with nothing due costs this one check per gradient.
  const std::shared_ptr<PassLedger::Pass> pass = begin_pass();
  if (g.defined()) {
    std::lock_guard<std::mutex> lock(hooked_mutex_);
    hooked_[param_base_[m] + param] = weak_of(g);
  }
  take_gradient(m, param, g, pass);
}

inline void AttachCore::take_gradient(std::size_t m, std::size_t param, const at::Tensor& g,
                                      const std::shared_ptr<PassLedger::Pass>& pass) {
  if (!g.defined()) return;
  no_gradient_pass.store(false, std::memory_order_relaxed);
  if (pass) passes_.note_gradient(*pass);
  if (!backward_due.load()) return;
  const Metadata& md = modules[m].params[param].grad_md;
  if (defers(g)) {  // the norm comes with the batch
    send(m, modules[m].name, g, false, md, nullptr, {}, pass);
    return;
  }
  std::optional<TensorStats> stats;
  if (options.gradient_norms()) {
    // One pass: the same statistics serve the norm and every hook of this delivery.
    try {
      stats = compute_stats(g, StatsOptions().sign_counts(gradient_signs.load()).sampling(sampling));
      if (pass) passes_.add(*pass, m, stats->l2_norm * stats->l2_norm);
    } catch (...) {
    }
  }
  send(m, modules[m].name, g, false, md, stats ? &*stats : nullptr);
}

}  // namespace torchdbg::detail
