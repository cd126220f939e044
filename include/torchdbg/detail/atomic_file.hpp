// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
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

/// What a file that is not a regular one is, for error messages.
inline const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

/// Writes `size` bytes to `path` so that readers see either the old complete file or the
/// new complete one: the bytes go to a temporary file beside it, are fsync'ed, and the
/// temporary is renamed over `path`. A symbolic link is followed (its target is replaced, the
/// link stays); a path that is not a regular file (a FIFO, a device such as /dev/stdout, a
/// directory) is refused, since renaming over it would replace it. Throws torchdbg::Error
/// naming the path and the reason (the temporary is removed; an existing `path` is untouched).
inline void atomic_write_file(const std::string& path, const char* data, std::size_t size) {
  static std::atomic<uint64_t> counter{0};
  std::string target = path;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    throw Error("torchdbg: cannot write '" + path + "': it is " + file_kind(st.st_mode) +
                ", and the file is written by replacing it atomically; give a regular file's path");
  }
  // Follow the link chain by hand: a dangling link names the file to create.
  for (int hops = 0; ::lstat(target.c_str(), &st) == 0 && S_ISLNK(st.st_mode); ++hops) {
    if (hops == 40) throw Error("torchdbg: cannot write '" + path + "': too many levels of symbolic links");
    std::string link(PATH_MAX, '\0');
    const ssize_t n = ::readlink(target.c_str(), link.data(), link.size());
    if (n < 0) {
      const int err = errno;
      throw Error("torchdbg: cannot write '" + path + "': readlink: " + std::strerror(err));
    }
    link.resize(static_cast<std::size_t>(n));
    target = link.front() == '/' ? link : (std::filesystem::path(target).parent_path() / link).string();
  }
  const std::string tmp = target + ".tmp." + std::to_string(::getpid()) + "." +
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
  if (std::rename(tmp.c_str(), target.c_str()) != 0) fail("rename", errno);
}

/// An append-only file written with O_APPEND: each `append` issues write() calls for the whole
/// buffer, so after a crash the file holds every earlier append complete. Throws
/// torchdbg::Error naming the path and the reason.
///
/// Never blocks: the file is opened with O_NONBLOCK, so a FIFO without a reader is refused at
/// once (open would wait for one), and a pipe or terminal whose reader falls behind makes
/// `append` throw with what was written so far instead of waiting. A reader that went away
/// gives an error too (EPIPE), never a SIGPIPE that would kill the process.
class AppendFile {
 public:
  AppendFile() = default;
  AppendFile(const std::string& path, bool truncate) : path_(path) {
    const int flags = O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK | (truncate ? O_TRUNC : 0);
    // Read too (see unterminated_tail), except a FIFO: opened for reading as well it would
    // never lack a reader, and a slow one would go unnoticed.
    struct stat before {};
    const bool fifo = ::stat(path.c_str(), &before) == 0 && S_ISFIFO(before.st_mode);
    fd_ = fifo ? -1 : ::open(path.c_str(), O_RDWR | flags, 0644);
    if (fd_ < 0 && (fifo || errno == EACCES)) fd_ = ::open(path.c_str(), O_WRONLY | flags, 0644);
    if (fd_ < 0) {
      const int err = errno;
      if (err == ENXIO)
        throw Error("torchdbg: cannot open '" + path +
                    "' for writing: it is a FIFO (or socket) with no reader, and torchdbg never "
                    "blocks the training loop on a file; start the reader first or write to a "
                    "regular file");
      throw Error("torchdbg: cannot open '" + path + "' for writing: " + std::strerror(err));
    }
    struct stat st {};
    if (::fstat(fd_, &st) == 0) {
      regular_ = S_ISREG(st.st_mode);
      if (regular_) size_at_open_ = static_cast<int64_t>(st.st_size);
    }
  }
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;
  AppendFile(AppendFile&& o) noexcept
      : path_(std::move(o.path_)), fd_(o.fd_), size_at_open_(o.size_at_open_), regular_(o.regular_) {
    o.fd_ = -1;
  }
  AppendFile& operator=(AppendFile&& o) noexcept {
    if (this != &o) {
      close();
      path_ = std::move(o.path_);
      fd_ = o.fd_;
      size_at_open_ = o.size_at_open_;
      regular_ = o.regular_;
      o.fd_ = -1;
    }
    return *this;
  }
  ~AppendFile() { close(); }

  /// Writes all of `data`; on failure throws and reports how much was written in `written`.
  /// A pipe that is full throws at once (errno EAGAIN) rather than waiting for its reader. To
  /// a pipe, whole lines go in writes of at most PIPE_BUF bytes, which a pipe takes whole or
  /// not at all: a full pipe never holds half a line (unless one line is longer than that).
  void append(const std::string& data, std::size_t& written, bool sync = false) {
    written = 0;
    int err = 0;
    {
      SigpipeBlock quiet(!regular_);
      while (written < data.size()) {
        std::size_t len = data.size() - written;
        if (!regular_ && len > PIPE_BUF) {
          const auto cut = data.rfind('\n', written + PIPE_BUF - 1);
          if (cut != std::string::npos && cut >= written) {
            len = cut + 1 - written;  // the lines that fit
          } else {
            const auto end = data.find('\n', written);  // one long line, alone
            len = end == std::string::npos ? data.size() - written : end + 1 - written;
          }
        }
        const ssize_t n = ::write(fd_, data.data() + written, len);
        if (n < 0) {
          if (errno == EINTR) continue;
          err = errno;
          quiet.note(err);
          break;
        }
        written += static_cast<std::size_t>(n);
      }
    }
    if (err == EAGAIN || err == EWOULDBLOCK)
      throw Error("torchdbg: cannot write '" + path_ + "': its reader is not keeping up (the pipe is "
                  "full); the rest waits for the next flush");
    if (err == EPIPE) throw Error("torchdbg: cannot write '" + path_ + "': its reader has gone (broken pipe)");
    if (err != 0) throw Error("torchdbg: cannot write '" + path_ + "': " + std::strerror(err));
    if (sync && regular_ && ::fsync(fd_) != 0) {
      const int sync_err = errno;
      throw Error("torchdbg: cannot fsync '" + path_ + "': " + std::strerror(sync_err));
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

  /// Whether the file is a regular file (not a pipe, FIFO or terminal).
  [[nodiscard]] bool regular() const noexcept { return regular_; }

 private:
  /// Blocks SIGPIPE on this thread while writing to a pipe, and takes back the one a write to
  /// a pipe without a reader raised, so EPIPE comes back as an error instead of killing the
  /// process. A SIGPIPE pending before is left pending.
  class SigpipeBlock {
   public:
    explicit SigpipeBlock(bool on) : on_(on) {
      if (!on_) return;
      sigemptyset(&set_);
      sigaddset(&set_, SIGPIPE);
      sigset_t pending;
      sigemptyset(&pending);
      was_pending_ = sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
      on_ = pthread_sigmask(SIG_BLOCK, &set_, &old_) == 0;
    }
    void note(int err) noexcept { epipe_ = epipe_ || err == EPIPE; }
    ~SigpipeBlock() {
      if (!on_) return;
      if (epipe_ && !was_pending_) {
        const timespec zero{0, 0};
        while (sigtimedwait(&set_, nullptr, &zero) < 0 && errno == EINTR) {
        }
      }
      pthread_sigmask(SIG_SETMASK, &old_, nullptr);
    }
    SigpipeBlock(const SigpipeBlock&) = delete;
    SigpipeBlock& operator=(const SigpipeBlock&) = delete;

   private:
    bool on_ = false, epipe_ = false, was_pending_ = false;
    sigset_t set_{}, old_{};
  };

  std::string path_;
  int fd_ = -1;
  int64_t size_at_open_ = -1;
  bool regular_ = true;
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
