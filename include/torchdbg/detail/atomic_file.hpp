// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>

#include "torchdbg/error.hpp"

namespace torchdbg::detail {

/// Writes `size` bytes to `path` so that readers see either the old complete file or the
/// new complete one: the bytes go to a temporary file beside it, are fsync'ed, and the
/// temporary is renamed over `path`. Throws torchdbg::Error naming the path and the reason
/// (the temporary is removed; an existing `path` is untouched).
inline void atomic_write_file(const std::string& path, const char* data, std::size_t size) {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                          std::to_string(counter.fetch_add(1));
  auto fail = [&](const char* what, int err) {
    ::unlink(tmp.c_str());
    throw Error("torchdbg: cannot write '" + path + "': " + what + ": " + std::strerror(err));
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    throw Error("torchdbg: cannot write '" + path + "': open: " + std::strerror(err));
  }
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      fail("write", err);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    fail("fsync", err);
  }
  if (::close(fd) != 0) fail("close", errno);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("rename", errno);
}

/// An append-only file written with O_APPEND: each `append` issues write() calls for the whole
/// buffer, so after a crash the file holds every earlier append complete. Throws
/// torchdbg::Error naming the path and the reason.
class AppendFile {
 public:
  AppendFile() = default;
  AppendFile(const std::string& path, bool truncate) : path_(path) {
    const int flags = O_CREAT | O_APPEND | O_CLOEXEC | (truncate ? O_TRUNC : 0);
    fd_ = ::open(path.c_str(), O_RDWR | flags, 0644);  // read too: see unterminated_tail
    if (fd_ < 0 && errno == EACCES) fd_ = ::open(path.c_str(), O_WRONLY | flags, 0644);
    if (fd_ < 0) {
      const int err = errno;
      throw Error("torchdbg: cannot open '" + path + "' for writing: " + std::strerror(err));
    }
    struct stat st {};
    if (::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode)) size_at_open_ = static_cast<int64_t>(st.st_size);
  }
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;
  AppendFile(AppendFile&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_), size_at_open_(o.size_at_open_) {
    o.fd_ = -1;
  }
  AppendFile& operator=(AppendFile&& o) noexcept {
    if (this != &o) {
      close();
      path_ = std::move(o.path_);
      fd_ = o.fd_;
      size_at_open_ = o.size_at_open_;
      o.fd_ = -1;
    }
    return *this;
  }
  ~AppendFile() { close(); }

  /// Writes all of `data`; on failure throws and reports how much was written in `written`.
  void append(const std::string& data, std::size_t& written, bool sync = false) {
    written = 0;
    while (written < data.size()) {
      const ssize_t n = ::write(fd_, data.data() + written, data.size() - written);
      if (n < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        throw Error("torchdbg: cannot write '" + path_ + "': " + std::strerror(err));
      }
      written += static_cast<std::size_t>(n);
    }
    if (sync && ::fsync(fd_) != 0) {
      const int err = errno;
      throw Error("torchdbg: cannot fsync '" + path_ + "': " + std::strerror(err));
    }
  }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  /// The regular file's size when it was opened (0 when truncated); -1 for other files.
  [[nodiscard]] int64_t size_at_open() const noexcept { return size_at_open_; }

  /// The bytes after the last newline of a regular file opened without truncation: what a
  /// process killed in the middle of a line left behind. Empty when the file ends with a
  /// newline; std::nullopt when it cannot be read or the tail is longer than `limit`.
  [[nodiscard]] std::optional<std::string> unterminated_tail(std::size_t limit) const {
    if (size_at_open_ <= 0) return std::string();
    std::string tail;
    int64_t end = size_at_open_;
    while (end > 0) {
      const int64_t begin = std::max<int64_t>(0, end - 65536);
      std::string chunk(static_cast<std::size_t>(end - begin), '\0');
      if (::pread(fd_, chunk.data(), chunk.size(), static_cast<off_t>(begin)) != static_cast<ssize_t>(chunk.size()))
        return std::nullopt;
      const auto nl = chunk.rfind('\n');
      if (nl != std::string::npos) return chunk.substr(nl + 1) + tail;
      tail = chunk + tail;
      if (tail.size() > limit) return std::nullopt;
      end = begin;
    }
    return tail;
  }
  /// Cuts the file to its first `size` bytes; throws torchdbg::Error naming the path.
  void truncate_to(int64_t size) {
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) {
      const int err = errno;
      throw Error("torchdbg: cannot truncate '" + path_ + "': " + std::strerror(err));
    }
  }

  void close() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_at_open_ = -1;
};

/// Creates `dir` (and parents) if missing; throws torchdbg::Error naming it otherwise.
inline void ensure_directory(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir)) {
    throw Error("torchdbg: cannot create directory '" + dir + "': " +
                (ec ? ec.message() : std::string("not a directory")));
  }
}

}  // namespace torchdbg::detail
