// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <fcntl.h>
#include <torch/arg.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "torchdbg/detail/atomic_file.hpp"
#include "torchdbg/detail/text.hpp"
#include "torchdbg/exporters/exporter.hpp"

namespace torchdbg {

/// When a streaming exporter (JSONL, CSV) hands its buffer to the file: every
/// `flush_every_steps` steps or `flush_every_seconds` seconds, whichever comes first. A crash
/// loses at most that interval; every complete line written before stays parseable.
struct StreamOptions {
  TORCH_ARG(int64_t, flush_every_steps) = 10;
  TORCH_ARG(double, flush_every_seconds) = 5.0;
  /// Start a new file (true) or append to an existing one. Appending first repairs the end a
  /// killed process left: a torn last record (up to 16 MiB) is cut, so every record of the
  /// file parses; a JSONL line that parses and lacks only its newline gets one instead. A CSV
  /// record ends only at a newline outside quotes, and a file the repair leaves empty gets its
  /// header.
  TORCH_ARG(bool, truncate) = true;
  /// fsync after each flush (survives a power cut, not only a process crash).
  TORCH_ARG(bool, fsync) = false;
  /// Bytes kept while the file cannot be written (disk full); older lines are dropped beyond.
  TORCH_ARG(std::size_t, max_buffer_bytes) = 64u << 20;
};

namespace detail {

/// How a stream's records end, which tells appending where a torn last record begins (see
/// StreamOptions::truncate).
struct RecordSyntax {
  /// Accepts a last line that lacks only its newline (JSONL: the line parses); it gets its
  /// newline. Any other unterminated tail is cut; when empty, every one is.
  std::function<bool(const std::string&)> complete_line;
  /// A newline inside double quotes belongs to its record (RFC 4180), so the end of the last
  /// record is found by reading the file from its start.
  bool quoted_newlines = false;
};

/// The buffering and failure policy shared by the line-oriented exporters.
class LineStream {
 public:
  /// Bytes of a torn last record that appending cuts at most; a longer tail is left alone.
  static constexpr std::size_t kMaxTornLine = 16u << 20;

  /// `syntax` tells a whole record from a torn one (see StreamOptions::truncate).
  /// Options are checked before the file is opened: a bad one leaves the file untouched.
  LineStream(const std::string& path, StreamOptions o, const RecordSyntax& syntax)
      : options_(validated(std::move(o))),
        file_(path, options_.truncate()),
        size_(file_.size_at_open()) {
    last_flush_ = std::chrono::steady_clock::now();
    if (options_.truncate()) return;
    if (syntax.quoted_newlines) {
      cut_after_last_record_(path);
    } else {
      repair_last_line_(syntax.complete_line);
    }
  }
  void add(const std::string& line) {
    buffer_ += line;
    buffer_ += '\n';
  }
  /// Counts a step and flushes when the interval is reached.
  void step_done() {
    ++steps_;
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - last_flush_).count();
    if (steps_ >= options_.flush_every_steps() || secs >= options_.flush_every_seconds()) flush();
  }
  /// Writes the buffer without blocking. On failure (disk full, a pipe whose reader is behind)
  /// the unwritten part is kept for the next flush (bounded by max_buffer_bytes: whole oldest
  /// lines are dropped and counted) and the error is recorded.
  void flush() {
    steps_ = 0;
    last_flush_ = std::chrono::steady_clock::now();
    if (buffer_.empty()) return;
    std::size_t written = 0;
    try {
      file_.append(buffer_, written, options_.fsync());
      buffer_.clear();
      partial_ = 0;
    } catch (const Error& e) {
      ++failures_;
      last_error_ = e.what();
      // The rest of a line already partly written stays first and is never dropped: the
      // reader has its head, and dropping the rest would join that head to the next line.
      if (written > 0) {
        const bool at_line_end = buffer_[written - 1] == '\n';
        buffer_.erase(0, written);
        const auto nl = buffer_.find('\n');
        partial_ = at_line_end || nl == std::string::npos ? 0 : nl + 1;
      }
      while (buffer_.size() > options_.max_buffer_bytes()) {
        const auto nl = buffer_.find('\n', partial_);
        if (nl == std::string::npos) break;
        buffer_.erase(partial_, nl + 1 - partial_);
        ++dropped_lines_;
      }
    }
  }
  [[nodiscard]] uint64_t failures() const noexcept { return failures_; }
  [[nodiscard]] uint64_t dropped_lines() const noexcept { return dropped_lines_; }
  /// Lines written to the buffer and not yet to the file (a failed flush keeps them).
  [[nodiscard]] uint64_t pending_lines() const noexcept {
    return static_cast<uint64_t>(std::count(buffer_.begin(), buffer_.end(), '\n'));
  }
  [[nodiscard]] const std::string& last_error() const noexcept { return last_error_; }
  [[nodiscard]] const std::string& path() const noexcept { return file_.path(); }
  /// Whether the file holds nothing once opened and repaired (a CSV header is due): a new or
  /// truncated file, one whose only content was torn, or one that is not a regular file.
  [[nodiscard]] bool starts_empty() const noexcept { return size_ <= 0; }
  /// Bytes of a torn last record cut when the file was opened for appending.
  [[nodiscard]] std::size_t torn_bytes_removed() const noexcept { return torn_bytes_; }

 private:
  /// One record a line: the bytes after the last newline are given a newline when
  /// `complete_line` accepts them, and cut otherwise.
  void repair_last_line_(const std::function<bool(const std::string&)>& complete_line) {
    const auto tail = file_.unterminated_tail(kMaxTornLine);
    if (!tail || tail->empty()) return;  // ends with a newline, or not ours to cut
    std::size_t written = 0;
    if (complete_line && complete_line(*tail)) {
      file_.append("\n", written);
      size_ += 1;
    } else {
      cut_to_(size_ - static_cast<int64_t>(tail->size()));
    }
  }
  /// Records that may hold newlines inside double quotes: everything after the last newline
  /// outside quotes is torn (the writer ends every record with a newline) and is cut. The
  /// quote state at the end depends on every byte before, so this reads the whole file once,
  /// 64 KiB at a time: constant memory, and the time of one sequential read (about 0.2 s a GB
  /// from the page cache). A file that cannot be read, or that shrinks meanwhile, is left alone.
  void cut_after_last_record_(const std::string& path) {
    if (size_ <= 0) return;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    std::vector<char> block(64u << 10);
    bool quoted = false;
    int64_t end = 0;  // just past the last record's newline
    int64_t at = 0;
    while (at < size_) {
      const auto want = static_cast<std::size_t>(
          std::min<int64_t>(size_ - at, static_cast<int64_t>(block.size())));
      const ssize_t n = ::pread(fd, block.data(), want, static_cast<off_t>(at));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      // Between quotes a newline is part of a field; outside, the last one in a stretch ends
      // a record ("" inside quotes toggles twice).
      const char* p = block.data();
      const char* const stop = p + n;
      while (p < stop) {
        const auto* q =
            static_cast<const char*>(std::memchr(p, '"', static_cast<std::size_t>(stop - p)));
        if (q == nullptr) q = stop;
        if (!quoted) {
          for (const char* c = q; c != p; --c) {
            if (c[-1] == '\n') {
              end = at + (c - block.data());
              break;
            }
          }
        }
        if (q == stop) break;
        quoted = !quoted;
        p = q + 1;
      }
      at += n;
    }
    ::close(fd);
    if (at < size_ || end == size_ || size_ - end > static_cast<int64_t>(kMaxTornLine)) return;
    cut_to_(end);
  }
  void cut_to_(int64_t size) {
    file_.truncate_to(size);
    torn_bytes_ = static_cast<std::size_t>(size_ - size);
    size_ = size;
  }
  static StreamOptions validated(StreamOptions o) {
    detail::require_at_least<int64_t>(o.flush_every_steps(), 1, "StreamOptions::flush_every_steps");
    return o;
  }
  StreamOptions options_;
  AppendFile file_;
  int64_t size_;  // the file's size after the repair; -1 when not a regular file
  std::string buffer_;
  std::size_t partial_ = 0;  // leading bytes of buffer_ that end a line partly written
  uint64_t failures_ = 0, dropped_lines_ = 0;
  int64_t steps_ = 0;
  std::size_t torn_bytes_ = 0;
  std::string last_error_;
  std::chrono::steady_clock::time_point last_flush_;
};

inline nlohmann::json stats_fields(const TensorStats& s) {
  return {{"numel", s.numel},          {"mean", json_number(s.mean)},
          {"std", json_number(s.std)}, {"min", json_number(s.min)},
          {"max", json_number(s.max)}, {"l2_norm", json_number(s.l2_norm)},
          {"nan", s.nan_count},        {"inf", s.inf_count},
          {"zeros", s.sign_counts ? nlohmann::json(s.zero_count) : nlohmann::json()},
          {"sparsity", json_number(s.sparsity)}};
}

}  // namespace detail

/// The base of the line-oriented exporters: owns the LineStream, flushes it when destroyed,
/// and reports its failures.
template <typename Mutex = std::mutex>
class BasicStreamExporter : public BaseExporter<Mutex> {
 public:
  /// One record a line; `complete_line` accepts a last line that lacks only its newline.
  BasicStreamExporter(const std::string& path, StreamOptions options,
                      const std::function<bool(const std::string&)>& complete_line)
      : stream_(path, std::move(options), detail::RecordSyntax{complete_line, false}) {}
  BasicStreamExporter(const std::string& path, StreamOptions options,
                      const detail::RecordSyntax& syntax)
      : stream_(path, std::move(options), syntax) {}
  ~BasicStreamExporter() override {
    try {
      stream_.flush();
    } catch (...) {
    }
  }
  [[nodiscard]] std::string path() const { return stream_.path(); }
  /// Flushes that failed (disk full, ...), the last reason, and lines dropped beyond
  /// max_buffer_bytes while the file could not be written.
  [[nodiscard]] uint64_t failures() const {
    std::lock_guard<Mutex> lock(this->mutex_);
    return stream_.failures();
  }
  [[nodiscard]] std::string last_error() const {
    std::lock_guard<Mutex> lock(this->mutex_);
    return stream_.last_error();
  }
  [[nodiscard]] uint64_t dropped_lines() const {
    std::lock_guard<Mutex> lock(this->mutex_);
    return stream_.dropped_lines();
  }
  /// Lines not written yet: after a failed flush (a full disk, a pipe whose reader is behind),
  /// what the next flush will try again. Lines still pending when the exporter is destroyed
  /// are lost: check this (after `flush()` or `Reporter::finish`) to know how many.
  [[nodiscard]] uint64_t pending_lines() const {
    std::lock_guard<Mutex> lock(this->mutex_);
    return stream_.pending_lines();
  }
  /// Bytes of a torn last record cut when an existing file was opened for appending.
  [[nodiscard]] std::size_t torn_bytes_removed() const {
    std::lock_guard<Mutex> lock(this->mutex_);
    return stream_.torn_bytes_removed();
  }

 protected:
  void flush_() override { stream_.flush(); }
  /// Adds the line `make()` returns; a record that cannot be made is counted and the step's
  /// other records still go out (end_step_ reports it).
  template <typename F>
  void record_(F&& make) {
    try {
      stream_.add(make());
    } catch (const std::exception& e) {
      if (bad_records_++ == 0) bad_reason_ = e.what();
    }
  }
  /// Ends a step; throws torchdbg::Error (counted by the reporter) when records were lost.
  void end_step_(int64_t step) {
    stream_.step_done();
    if (bad_records_ == 0) return;
    const std::string msg = "torchdbg: " + std::to_string(bad_records_) + " record(s) of step " +
                            std::to_string(step) + " not written to '" + stream_.path() + "': " + bad_reason_;
    bad_records_ = 0;
    bad_reason_.clear();
    throw Error(msg);
  }
  detail::LineStream stream_;
  uint64_t bad_records_ = 0;
  std::string bad_reason_;
};

/// JSON Lines: one object per line with a "type" of "step", "layer", "health", "event" or
/// "summary"; pandas.read_json(path, lines=True) reads the whole file into one table.
///
/// ```cpp
/// reporter.add_exporter(std::make_shared<torchdbg::JsonlExporter>("run.jsonl"));
/// ```
template <typename Mutex = std::mutex>
class BasicJsonlExporter : public BasicStreamExporter<Mutex> {
 public:
  explicit BasicJsonlExporter(const std::string& path, StreamOptions options = {})
      : BasicStreamExporter<Mutex>(path, std::move(options),
                                   [](const std::string& line) { return nlohmann::json::accept(line); }) {}

 protected:
  void write_step_(const StepRecord& r) override {
    this->record_([&] {
      return detail::dump_json({{"type", "step"},
                                {"step", r.step},
                                {"loss", r.loss ? json_number(*r.loss) : nlohmann::json()},
                                {"gradient_norm", r.gradient_norm ? json_number(*r.gradient_norm) : nlohmann::json()},
                                {"loss_health", to_string(r.loss_health)}});
    });
    for (const auto& l : r.layers) {
      this->record_([&] {
        nlohmann::json j = detail::stats_fields(l.stats);
        j["type"] = "layer";
        j["step"] = r.step;
        j["layer"] = l.layer;
        j["direction"] = l.forward ? "forward" : "backward";
        if (!l.forward) j["parameter"] = l.parameter;
        return detail::dump_json(j);
      });
    }
    for (const auto& h : r.health) {
      this->record_([&] {
        nlohmann::json j = to_json(h);
        j["type"] = "health";
        j["step"] = r.step;
        return detail::dump_json(j);
      });
    }
    for (const auto& e : r.events) {
      this->record_([&] {
        nlohmann::json j = to_json(e);
        j["type"] = "event";
        return detail::dump_json(j);
      });
    }
    this->end_step_(r.step);
  }
  void write_summary_(const RunSummary& s) override {
    nlohmann::json j = {{"type", "summary"},
                        {"steps", s.steps},
                        {"last_step", s.last_step},
                        {"alerts_total", s.alerts_total},
                        {"events_total", s.events_total}};
    if (s.diagnosis) j["diagnosis"] = s.diagnosis->to_json();
    stream_.add(detail::dump_json(j));
    stream_.flush();
  }
  using BasicStreamExporter<Mutex>::stream_;
};

using JsonlExporter = BasicJsonlExporter<std::mutex>;

}  // namespace torchdbg
