// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

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
