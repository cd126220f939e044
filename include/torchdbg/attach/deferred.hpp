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
///
/// A queued tensor of up to MomentsBatch::kMaxElements distinct elements is copied into its
/// device's MomentsBatch (one kernel); the step's batch reduces all of them together, so a
/// step costs a fixed number of kernels for its small tensors instead of dozens per tensor.
class DeferredQueue {
 public:
  struct Item {
    std::size_t module;
    std::string name;
    at::Tensor tensor;
    bool is_forward;
    Metadata md;
    at::Tensor packed;        // kPackedMoments doubles on the tensor's device; undefined: batched
    at::Tensor input_packed;  // the data input's, or undefined
    std::vector<std::pair<std::string, at::Tensor>> extras;  // the manager's prefetches
    std::shared_ptr<PassLedger::Pass> pass;  // a gradient's backward pass, or null
    bool model_input = false;                // input_packed is the step's model input
    int64_t row = -1;                        // its row in its device's MomentsBatch
    int64_t repeats = 1;                     // copies of the batched data in `tensor`
    [[nodiscard]] at::Device device() const { return packed.defined() ? packed.device() : tensor.device(); }
  };
  /// Everything queued, taken at once: the items and their devices' batches.
  struct Batch {
    std::vector<Item> items;
    std::vector<std::pair<at::Device, MomentsBatch>> moments;
  };
  /// An item's statistics on the host (each unset when the copy failed).
  struct Fetched {
    std::optional<Moments> stats;
    std::optional<Moments> input;
    Prefetched extras;
  };

  /// Queues `item`, its moments batched (MomentsBatch::accepts) or else reduced on their own
  /// (pack_moments); true when the queue holds `limit` items or more. Throws (queuing
  /// nothing) when the tensor cannot be copied or reduced.
  bool push(Item item, int64_t limit) {
    std::lock_guard<std::mutex> lock(mutex_);
    const Repeated r = collapse_repeats(item.tensor.detach());
    if (MomentsBatch::accepts(r.base)) {
      item.row = moments_for(item.tensor.device()).add(r.base);
      item.repeats = r.repeats;
    } else {
      item.packed = pack_moments(item.tensor.detach());
    }
    items_.push_back(std::move(item));
    return static_cast<int64_t>(items_.size()) >= limit;
  }

  /// Takes everything queued.
  Batch take() {
    Batch batch;
    std::lock_guard<std::mutex> lock(mutex_);
    batch.items.swap(items_);
    batch.moments.swap(moments_);
    return batch;
  }
  /// Gives a taken batch's buffer back (emptied) for the next step: no reallocation per step.
  void recycle(Batch& batch) {
    batch.items.clear();
    std::lock_guard<std::mutex> lock(mutex_);
    if (items_.empty() && items_.capacity() < batch.items.capacity()) items_.swap(batch.items);
  }

  /// Brings `batch`'s statistics to the host: one copy per device (counted in `transfers`).
  /// Never throws: where a copy fails, every item's statistics are left unset.
  static std::vector<Fetched> fetch(Batch& batch, std::atomic<uint64_t>& transfers) {
    const std::vector<Item>& items = batch.items;
    std::vector<Fetched> out(items.size());
    try {
      std::vector<at::Device> devices;
      for (const auto& d : items)
        if (std::find(devices.begin(), devices.end(), d.device()) == devices.end()) devices.push_back(d.device());
      for (const at::Device& dev : devices) {
        // Everything queued on `dev`, laid end to end: the batched rows, then each item's
        // own moments, input moments and prefetches.
        std::vector<at::Tensor> parts;
        int64_t rows = 0;
        for (auto& [where, moments] : batch.moments) {
          if (where != dev || moments.rows() == 0) continue;
          rows = moments.rows();
          parts.push_back(moments.reduce().reshape({-1}));
        }
        for (const auto& d : items) {
          if (d.device() != dev) continue;
          if (d.packed.defined()) parts.push_back(d.packed);
          if (d.input_packed.defined()) parts.push_back(d.input_packed.to(dev));
          for (const auto& e : d.extras) parts.push_back(e.second.to(dev, at::kDouble));
        }
        const at::Tensor host = at::cat(parts).to(at::kCPU, at::kDouble).contiguous();
        transfers.fetch_add(1);
        const double* batched = host.data_ptr<double>();
        const double* v = batched + rows * kPackedMoments;
        for (std::size_t i = 0; i < items.size(); ++i) {
          const Item& d = items[i];
          if (d.device() != dev) continue;
          if (d.packed.defined()) {
            out[i].stats = unpack_moments(v);
            v += kPackedMoments;
          } else {
            out[i].stats = repeated(unpack_moments(batched + d.row * kPackedMoments), d.repeats);
          }
          if (d.input_packed.defined()) {
            out[i].input = unpack_moments(v);
            v += kPackedMoments;
          }
          for (const auto& e : d.extras) {
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
  MomentsBatch& moments_for(const at::Device& device) {
    for (auto& [where, moments] : moments_)
      if (where == device) return moments;
    return moments_.emplace_back(device, MomentsBatch{}).second;
  }
  std::mutex mutex_;
  std::vector<Item> items_;
  std::vector<std::pair<at::Device, MomentsBatch>> moments_;
};

}  // namespace torchdbg::detail
