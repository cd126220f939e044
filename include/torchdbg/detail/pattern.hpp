// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <re2/re2.h>

#include <memory>
#include <string>
#include <string_view>

#include "torchdbg/error.hpp"

namespace torchdbg::detail {

/// A user's regex over layer and module names, on RE2: matching takes time linear in the
/// name's length whatever the pattern (no backtracking, no recursion), so a 40 kB name or
/// `(a+)+$` costs microseconds. RE2 syntax is Perl's without back-references and
/// look-around. Copies share one compiled program; matching is thread-safe.
class Pattern {
 public:
  /// Compiles `pattern`; throws torchdbg::Error naming `what` and the pattern when RE2
  /// rejects it (invalid, a back-reference, look-around, or a program over 8 MiB).
  Pattern(const std::string& pattern, const std::string& what) {
    RE2::Options options;
    options.set_log_errors(false);
    auto re = std::make_shared<const RE2>(pattern, options);
    if (!re->ok()) throw Error("torchdbg: invalid " + what + " '" + pattern + "': " + re->error());
    re_ = std::move(re);
  }

  /// Found anywhere in `s` (as std::regex_search).
  [[nodiscard]] bool search(std::string_view s) const { return match(s, RE2::UNANCHORED); }
  /// A match that starts at the beginning of `s` (a prefix of `s`).
  [[nodiscard]] bool match_prefix(std::string_view s) const { return match(s, RE2::ANCHOR_START); }
  /// The whole of `s` (as std::regex_match).
  [[nodiscard]] bool full_match(std::string_view s) const { return match(s, RE2::ANCHOR_BOTH); }
  [[nodiscard]] const std::string& pattern() const { return re_->pattern(); }

 private:
  bool match(std::string_view s, RE2::Anchor anchor) const {
    return re_->Match(re2::StringPiece(s.data(), s.size()), 0, s.size(), anchor, nullptr, 0);
  }
  std::shared_ptr<const RE2> re_;
};

/// Compiles a user's regex (see Pattern). Throws torchdbg::Error naming `what` and the
/// pattern when it is invalid.
inline Pattern compile_pattern(const std::string& pattern, const std::string& what) {
  return Pattern(pattern, what);
}

}  // namespace torchdbg::detail
