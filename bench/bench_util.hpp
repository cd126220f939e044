// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <fstream>
#include <string>

namespace torchdbg_bench {

/// This process's resident set size in KiB (Linux /proc), -1 when unknown.
inline long rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

}  // namespace torchdbg_bench
