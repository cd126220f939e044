// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Text shared by the HTML pieces: escaping, numbers, and the health states' ranks and colors.

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <string_view>

#include "torchdbg/detail/text.hpp"

namespace torchdbg::detail {

/// `s` as HTML text: markup characters escaped, invalid UTF-8 and NUL as U+FFFD.
inline std::string html_escape(std::string_view raw) {
  const std::string s = valid_utf8(raw);
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      case '\'':
        o += "&#39;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

/// A number as the pages print it: 4 significant digits, "n/a" when not finite.
inline std::string html_number(double v) {
  if (!std::isfinite(v)) return "n/a";
  return fmt::format("{:.4g}", v);
}

/// Severity rank of a state name, for the heatmap (the worse state of a cell wins).
inline int state_rank(std::string_view s) {
  if (s == "normal" || s == "healthy") return 1;
  if (s == "anomalous") return 2;
  if (s == "vanishing" || s == "saturated") return 3;
  if (s == "dead") return 4;
  if (s == "exploding") return 5;
  if (s == "non_finite") return 6;
  return 0;
}
inline const char* rank_name(int r) {
  static const char* const kNames[] = {"unobserved",          "healthy", "anomalous",
                                       "vanishing/saturated", "dead",    "exploding",
                                       "non-finite"};
  return kNames[std::clamp(r, 0, 6)];
}
inline const char* rank_color(int r) {
  static const char* const kColors[] = {"#f4f4f4", "#8fd19e", "#f5e08a", "#f0b35a",
                                        "#b07cc6", "#e8663d", "#b3001b"};
  return kColors[std::clamp(r, 0, 6)];
}

}  // namespace torchdbg::detail
