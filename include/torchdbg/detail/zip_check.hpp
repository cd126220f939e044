// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "torchdbg/error.hpp"

namespace torchdbg::detail {

/// Checks that `bytes` is a well-formed zip archive of the kind `torch.save` writes (every
/// record stored uncompressed, zip64 fields allowed) before LibTorch's reader sees it: the
/// central directory, each local header and each record's data lie inside the file, so no
/// record can claim more bytes than the file holds. Throws torchdbg::Error naming `path` and
/// the first defect. LibTorch's reader trusts these fields (a corrupted one crashed it).
inline void check_torch_zip(const std::vector<char>& bytes, const std::string& path) {
  const uint64_t n = bytes.size();
  auto fail = [&](const std::string& what) {
    throw Error("torchdbg: '" + path + "' is not a tensor snapshot: " + what);
  };
  auto u16 = [&](uint64_t at) -> uint64_t {
    if (at + 2 > n) fail("truncated at byte " + std::to_string(at));
    return static_cast<uint64_t>(static_cast<unsigned char>(bytes[at])) |
           static_cast<uint64_t>(static_cast<unsigned char>(bytes[at + 1])) << 8;
  };
  auto u32 = [&](uint64_t at) { return u16(at) | u16(at + 2) << 16; };
  auto u64 = [&](uint64_t at) { return u32(at) | u32(at + 4) << 32; };

  // End of central directory: the last signature within the final 64 KiB + 22 bytes.
  if (n < 22) fail("too short for a zip archive (" + std::to_string(n) + " bytes)");
  uint64_t eocd = n - 22;
  const uint64_t stop = n > 22 + 65535 ? n - 22 - 65535 : 0;
  while (u32(eocd) != 0x06054b50u) {
    if (eocd == stop) fail("no zip end-of-central-directory record");
    --eocd;
  }
  uint64_t entries = u16(eocd + 10), cd_size = u32(eocd + 12), cd_offset = u32(eocd + 16);
  uint64_t cd_end_limit = eocd;
  if (entries == 0xFFFF || cd_size == 0xFFFFFFFFu || cd_offset == 0xFFFFFFFFu) {
    // zip64: the locator (20 bytes before) points at the zip64 end-of-central-directory.
    if (eocd < 20 || u32(eocd - 20) != 0x07064b50u) fail("zip64 locator missing");
    const uint64_t z = u64(eocd - 20 + 8);
    if (z + 56 > eocd - 20 || u32(z) != 0x06064b50u) fail("zip64 end-of-central-directory out of place");
    entries = u64(z + 32), cd_size = u64(z + 40), cd_offset = u64(z + 48);
    cd_end_limit = z;
  }
  if (cd_offset > cd_end_limit || cd_size > cd_end_limit - cd_offset)
    fail("central directory outside the file");
  if (entries == 0 || entries > cd_size / 46) fail("implausible record count " + std::to_string(entries));

  uint64_t at = cd_offset;
  const uint64_t cd_end = cd_offset + cd_size;
  for (uint64_t e = 0; e < entries; ++e) {
    if (at + 46 > cd_end || u32(at) != 0x02014b50u) fail("central directory entry " + std::to_string(e) + " damaged");
    const uint64_t method = u16(at + 10);
    uint64_t csize = u32(at + 20), usize = u32(at + 24), local = u32(at + 42);
    const uint64_t name_len = u16(at + 28), extra_len = u16(at + 30), comment_len = u16(at + 32);
    const uint64_t next = at + 46 + name_len + extra_len + comment_len;
    if (next > cd_end) fail("central directory entry " + std::to_string(e) + " runs past the directory");
    // zip64 extended information: the 0xFFFFFFFF fields, in order, from extra field 0x0001.
    for (uint64_t x = at + 46 + name_len; x + 4 <= at + 46 + name_len + extra_len;) {
      const uint64_t id = u16(x), len = u16(x + 2);
      if (x + 4 + len > at + 46 + name_len + extra_len) fail("extra field past its entry");
      if (id == 0x0001) {
        uint64_t p = x + 4;
        auto take = [&](uint64_t& v) {
          if (v != 0xFFFFFFFFu) return;
          if (p + 8 > x + 4 + len) fail("zip64 field missing");
          v = u64(p);
          p += 8;
        };
        take(usize);
        take(csize);
        take(local);
      }
      x += 4 + len;
    }
    if (method != 0 || csize != usize) fail("record " + std::to_string(e) + " is compressed");
    if (local > cd_offset || cd_offset - local < 30 || u32(local) != 0x04034b50u)
      fail("record " + std::to_string(e) + " has no local header inside the file");
    const uint64_t data = local + 30 + u16(local + 26) + u16(local + 28);
    if (data > cd_offset || usize > cd_offset - data)
      fail("record " + std::to_string(e) + " claims " + std::to_string(usize) + " bytes past the file's end");
    at = next;
  }
}

}  // namespace torchdbg::detail
