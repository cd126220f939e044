// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Deliveries whose statistics are reduced on the tensor's device and brought to the host in
// one copy per device (StatsBatching::Device and All).

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torchdbg/attach/pass_ledger.hpp"
#include "torchdbg/hook_context.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg::detail {

/// A session's queue of deliveries waiting for their statistics. Thread-safe.
class DeferredQueue {
 public:
  struct Item {
    std::size_t module;
    std::string name;
    at::Tensor tensor;
    bool is_forward;
    Metadata md;
    at::Tensor packed;        // kPackedMoments doubles, on the tensor's device
    at::Tensor input_packed;  // the data input's, or undefined
    std::vector<std::pair<std::string, at::Tensor>> extras;  // the manager's prefetches
    std::shared_ptr<PassLedger::Pass> pass;  // a gradient's backward pass, or null
    bool model_input = false;                // input_packed is the step's model input
  };
  /// An item's statistics on the host (each unset when the copy failed).
  struct Fetched {
    std::optional<Moments> stats;
    std::optional<Moments> input;
    Prefetched extras;
  };

  /// Queues `item`; true when the queue holds `limit` items or more.
  bool push(Item item, int64_t limit) {
    std::lock_guard<std::mutex> lock(mutex_);
    items_.push_back(std::move(item));
    return static_cast<int64_t>(items_.size()) >= limit;
  }

  /// Takes everything queued.
  std::vector<Item> take() {
    std::vector<Item> batch;
    std::lock_guard<std::mutex> lock(mutex_);
    batch.swap(items_);
    return batch;
  }
  /// Gives a taken batch's buffer back (emptied) for the next step: no reallocation per step.
  void recycle(std::vector<Item>& batch) {
    batch.clear();
    std::lock_guard<std::mutex> lock(mutex_);
    if (items_.empty() && items_.capacity() < batch.capacity()) items_.swap(batch);
  }

  /// Brings `batch`'s statistics to the host: one copy per device (counted in `transfers`).
  /// Never throws: where a copy fails, every item's statistics are left unset.
  static std::vector<Fetched> fetch(const std::vector<Item>& batch, std::atomic<uint64_t>& transfers) {
    std::vector<Fetched> out(batch.size());
    try {
      std::vector<at::Device> devices;
      for (const auto& d : batch)
        if (std::find(devices.begin(), devices.end(), d.packed.device()) == devices.end())
          devices.push_back(d.packed.device());
      for (const at::Device& dev : devices) {
        // Everything queued on `dev`, laid end to end: moments, input moments, prefetches.
        std::vector<at::Tensor> parts;
        for (const auto& d : batch) {
          if (d.packed.device() != dev) continue;
          parts.push_back(d.packed);
          if (d.input_packed.defined()) parts.push_back(d.input_packed.to(dev));
          for (const auto& e : d.extras) parts.push_back(e.second.to(dev, at::kDouble));
        }
        const at::Tensor host = at::cat(parts).to(at::kCPU, at::kDouble).contiguous();
        transfers.fetch_add(1);
        const double* v = host.data_ptr<double>();
        for (std::size_t i = 0; i < batch.size(); ++i) {
          if (batch[i].packed.device() != dev) continue;
          out[i].stats = unpack_moments(v);
          v += kPackedMoments;
          if (batch[i].input_packed.defined()) {
            out[i].input = unpack_moments(v);
            v += kPackedMoments;
          }
          for (const auto& e : batch[i].extras) {
            const auto len = static_cast<std::size_t>(e.second.numel());
            out[i].extras[e.first].assign(v, v + len);
            v += len;
          }
        }
      }
    } catch (...) {
      // the copy failed (a device error): the deliveries still run and compute their own
      for (auto& f : out) f = Fetched{};
    }
    return out;
  }

 private:
  std::mutex mutex_;
  std::vector<Item> items_;
};

}  // namespace torchdbg::detail
