// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>

namespace torchdbg::detail {

/// `s` as valid UTF-8 for a text file: every byte that does not start a well-formed sequence
/// (stray continuation bytes, truncated or overlong sequences, surrogates, code points past
/// U+10FFFF) and every NUL becomes U+FFFD. Valid text is returned unchanged.
inline std::string valid_utf8(std::string_view s) {
  static constexpr const char* kReplacement = "\xEF\xBF\xBD";
  std::string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c != 0 && c < 0x80) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    std::size_t len = 0;
    uint32_t cp = 0, min = 0;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2, cp = c & 0x1Fu, min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3, cp = c & 0x0Fu, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4, cp = c & 0x07u, min = 0x10000;
    }
    bool ok = len > 0 && i + len <= n;
    for (std::size_t k = 1; ok && k < len; ++k) {
      if ((p[i + k] & 0xC0u) != 0x80u) ok = false;
      cp = (cp << 6) | (p[i + k] & 0x3Fu);
    }
    ok = ok && cp >= min && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
    if (ok) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      out += kReplacement;
      ++i;
    }
  }
  return out;
}

/// `v` as the shortest text that reads back (std::stod, strtod) as exactly `v`: "0.1",
/// "1.2345678901234567e-300", "inf", "nan". What a delivery's metadata carries for a number.
inline std::string number_text(double v) {
  char buf[40];
  const auto r = fmt::format_to_n(buf, sizeof buf, "{}", v);
  return std::string(buf, r.out);
}

/// The JSON text of `j` (compact, or indented by `indent`). Strings that are not valid UTF-8
/// are written with U+FFFD in place of the invalid bytes instead of throwing.
inline std::string dump_json(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace torchdbg::detail
