// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <ATen/ATen.h>
#include <torch/serialize.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "torchdbg/detail/atomic_file.hpp"
#include "torchdbg/detail/zip_check.hpp"
#include "torchdbg/error.hpp"

namespace torchdbg {

/// `name` made safe as one file-name component: characters other than letters, digits,
/// '-', '_' and '.' become '_' (so "encoder.0/fc1" -> "encoder.0_fc1"); empty -> "_".
inline std::string sanitize_file_component(std::string_view name) {
  std::string out;
  out.reserve(name.size());
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.';
    out.push_back(ok ? c : '_');
  }
  if (out.empty() || out == "." || out == "..") out = "_" + out;
  return out;
}

/// The file name a snapshot of `layer` at `step` gets: "<layer>_step<step>_<fwd|grad>.pt".
inline std::string snapshot_file_name(std::string_view layer, int64_t step, bool is_forward) {
  return sanitize_file_component(layer) + "_step" + std::to_string(step) +
         (is_forward ? "_fwd" : "_grad") + ".pt";
}

/// Writes `t` (detached, moved to the CPU, dtype and shape kept) to `path` in the format of
/// Python's `torch.save`, so `torch.load(path)` in Python and `load_snapshot` here read it.
/// The write is atomic (temporary file + rename). Throws torchdbg::Error naming the path.
///
/// LibTorch's `torch::save(tensor, path)` writes a TorchScript archive that Python's
/// `torch.load` does not return as a tensor; `torch::pickle_save` is the format both share.
inline void save_snapshot(const at::Tensor& t, const std::string& path) {
  if (!t.defined()) throw Error("torchdbg: cannot snapshot an undefined tensor to '" + path + "'");
  const at::Tensor cpu = t.detach().to(at::kCPU);
  const std::vector<char> bytes = torch::pickle_save(cpu.is_sparse() ? cpu.to_dense() : cpu.contiguous());
  detail::atomic_write_file(path, bytes.data(), bytes.size());
}

/// Reads a tensor written by `save_snapshot` (or Python's `torch.save(tensor, path)`).
/// Throws torchdbg::Error naming the path for a missing, unreadable or damaged file; the
/// archive is checked before it is parsed, so nothing it declares makes the reader allocate
/// more than the file's size.
inline at::Tensor load_snapshot(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw Error("torchdbg: cannot open snapshot '" + path + "': " +
                (std::filesystem::exists(path, ec) ? "not a regular file" : "no such file"));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("torchdbg: cannot open snapshot '" + path + "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw Error("torchdbg: cannot read snapshot '" + path + "'");
  detail::check_torch_zip(bytes, path);
  torch::IValue v;
  try {
    v = torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    throw Error("torchdbg: '" + path + "' is not a tensor snapshot: " + e.what());
  }
  if (!v.isTensor()) throw Error("torchdbg: '" + path + "' holds a " + v.tagKind() + ", not a tensor");
  return v.toTensor();
}

}  // namespace torchdbg
