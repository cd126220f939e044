// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <cstdio>
#include <string>

#include "torchdbg/exporters/jsonl.hpp"

namespace torchdbg {

/// CSV (RFC 4180) of the per-step, per-layer table: one row per delivery with its statistics,
/// the layer's health after the step and the step's loss. Empty cells for unknown values.
template <typename Mutex = std::mutex>
class BasicCsvExporter : public BasicStreamExporter<Mutex> {
 public:
  static constexpr const char* kHeader =
      "step,layer,direction,parameter,numel,mean,std,min,max,l2_norm,nan_count,inf_count,zero_"
      "count,"
      "health,loss";

  explicit BasicCsvExporter(const std::string& path, StreamOptions options = {})
      : BasicStreamExporter<Mutex>(path, std::move(options), detail::RecordSyntax{{}, true}) {
    if (this->stream_.starts_empty()) this->stream_.add(kHeader);
  }

  /// Columns of a row (the header's).
  static constexpr std::size_t kColumns = 15;
  /// The number of RFC 4180 fields in `line`; 0 when a quoted field is left open.
  static std::size_t fields(const std::string& line) {
    std::size_t n = 1;
    bool quoted = false;
    for (char c : line) {
      if (c == '"') quoted = !quoted;  // "" inside quotes toggles twice
      if (c == ',' && !quoted) ++n;
    }
    return quoted ? 0 : n;
  }

  /// A field quoted when it holds a comma, quote or line break; invalid UTF-8 and NUL are
  /// written as U+FFFD.
  static std::string field(const std::string& raw) {
    std::string s = detail::valid_utf8(raw);
    if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
    std::string out = "\"";
    for (char c : s) {
      if (c == '"') out += '"';
      out += c;
    }
    return out + "\"";
  }
  static std::string number(double v) {
    if (!std::isfinite(v)) return {};
    char b[32];
    std::snprintf(b, sizeof b, "%.9g", v);
    return b;
  }

 protected:
  void write_step_(const StepRecord& r) override {
    const std::string loss = r.loss ? number(*r.loss) : std::string();
    for (const auto& l : r.layers) {
      std::string health;
      const std::string module = l.layer.substr(0, l.layer.find('/'));
      for (const auto& h : r.health) {
        if (l.forward && h.name == l.layer && h.has_activation) health = to_string(h.activation);
        if (!l.forward && h.name == module && h.has_gradient) health = to_string(h.gradient);
      }
      const TensorStats& s = l.stats;
      std::string row = std::to_string(r.step) + "," + field(l.layer) + "," +
                        (l.forward ? "forward" : "backward") + "," + field(l.parameter) + "," +
                        std::to_string(s.numel) + "," + number(s.mean) + "," + number(s.std) + "," +
                        number(s.min) + "," + number(s.max) + "," + number(s.l2_norm) + "," +
                        std::to_string(s.nan_count) + "," + std::to_string(s.inf_count) + "," +
                        (s.sign_counts ? std::to_string(s.zero_count) : std::string()) + "," + health +
                        "," + loss;
      stream_.add(row);
    }
    this->end_step_(r.step);
  }
  void write_summary_(const RunSummary&) override { stream_.flush(); }
  using BasicStreamExporter<Mutex>::stream_;
};

using CsvExporter = BasicCsvExporter<std::mutex>;

}  // namespace torchdbg
