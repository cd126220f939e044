// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// A single-file HTML report: inline SVG, CSS and a few lines of JS, no network access. It
// shows the loss, gradient flow (per-layer gradient norm across layers, log scale, a line per
// sampled step), per-layer activation histograms, a layers x steps health heatmap, the events
// timeline, the diagnosis with its causal graph, and the alerts. Memory and file size stay
// bounded for any number of steps (html/run.hpp). The drawing is in html/: plots.hpp (loss,
// gradient flow, histograms), heatmap.hpp, diagnosis.hpp (diagnosis, causal graph, events,
// alerts) and page.hpp (the page around them).

#include <optional>
#include <string>
#include <utility>

#include "torchdbg/detail/atomic_file.hpp"
#include "torchdbg/exporters/exporter.hpp"
#include "torchdbg/exporters/html/page.hpp"
#include "torchdbg/exporters/html/run.hpp"

namespace torchdbg {

/// The HTML report. Written atomically (temp + rename) on flush and on write_summary, so the
/// file on disk is always a complete report.
template <typename Mutex = std::mutex>
class BasicHtmlExporter : public BaseExporter<Mutex> {
 public:
  explicit BasicHtmlExporter(std::string path, HtmlOptions options = {})
      : path_(checked(std::move(path))), run_(options) {}
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

  /// The report as it would be written now.
  [[nodiscard]] std::string render() const {
    std::lock_guard<Mutex> lock(this->mutex_);
    return detail::html_page(run_, summary_);
  }

 protected:
  void write_step_(const StepRecord& r) override { run_.add(r); }
  void write_summary_(const RunSummary& s) override {
    summary_ = s;
    write_file();
  }
  void flush_() override {
    if (run_.options().write_on_flush()) write_file();
  }

 private:
  static std::string checked(std::string path) {
    if (path.empty()) throw Error("torchdbg: HtmlExporter needs a path");
    return path;
  }
  void write_file() {
    const std::string text = detail::html_page(run_, summary_);
    detail::atomic_write_file(path_, text.data(), text.size());
  }

  std::string path_;
  detail::HtmlRun run_;
  std::optional<RunSummary> summary_;
};

using HtmlExporter = BasicHtmlExporter<std::mutex>;

}  // namespace torchdbg
