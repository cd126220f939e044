// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <cctype>
#include <regex>
#include <string>

#include "torchdbg/error.hpp"

namespace torchdbg::detail {

/// Compiles a user's regex (ECMAScript). Throws torchdbg::Error naming `what` and the pattern
/// when it is invalid, or when a back-reference or repetition count has more than 6 digits:
/// libstdc++ overflows a signed integer on those (undefined behaviour, found by fuzzing).
inline std::regex compile_pattern(const std::string& pattern, const std::string& what,
                                  std::regex::flag_type flags = std::regex::ECMAScript) {
  bool in_braces = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size() && !std::isdigit(static_cast<unsigned char>(pattern[i + 1]))) {
      ++i;  // an escaped character
      continue;
    }
    if (c == '{') in_braces = true;
    if (c == '}') in_braces = false;
    if (c == '\\' || (in_braces && (c == '{' || c == ','))) {
      std::size_t digits = 0;
      while (i + 1 + digits < pattern.size() && std::isdigit(static_cast<unsigned char>(pattern[i + 1 + digits]))) ++digits;
      if (digits > 6) {
        throw Error("torchdbg: invalid " + what + " '" + pattern + "': number too large at position " +
                    std::to_string(i + 1));
      }
    }
  }
  try {
    return std::regex(pattern, flags);
  } catch (const std::regex_error& e) {
    throw Error("torchdbg: invalid " + what + " '" + pattern + "': " + e.what());
  }
}

}  // namespace torchdbg::detail
