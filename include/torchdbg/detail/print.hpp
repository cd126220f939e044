// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Printing torchdbg's objects: a type T with `torchdbg::to_string(const T&)` and
// `detail::Printable<T>` prints with `fmt::format("{}", x)` and `std::cout << x` in the same
// one-line form. Names are quoted and escaped (fmt's `{:?}`), numbers have 4 significant digits.

#include <fmt/format.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>

namespace torchdbg {
namespace detail {

/// Specialized as std::true_type for each printable torchdbg type.
template <typename T>
struct Printable : std::false_type {};

/// A name as printed: double-quoted, with control characters and quotes escaped.
inline std::string quoted(std::string_view s) { return fmt::format("{:?}", s); }

/// `s` with control characters, quotes and backslashes escaped, unquoted: user text inside a
/// larger description (an alert message, a directory) stays on one line.
inline std::string escaped(std::string_view s) {
  const std::string q = quoted(s);
  return q.substr(1, q.size() - 2);
}

/// A number as printed: 4 significant digits ("nan", "inf" for those).
inline std::string num(double v) { return fmt::format("{:.4g}", v); }

/// "1 hook", "3 hooks": `n` and `noun`, with an "s" unless n is 1.
inline std::string count(uint64_t n, std::string_view noun) {
  return fmt::format("{} {}{}", n, noun, n == 1 ? "" : "s");
}

}  // namespace detail

/// `os << x` for every printable torchdbg type: the text of `to_string(x)`.
template <typename T, std::enable_if_t<detail::Printable<T>::value, int> = 0>
std::ostream& operator<<(std::ostream& os, const T& x) {
  return os << to_string(x);
}

}  // namespace torchdbg

/// `fmt::format("{}", x)` for every printable torchdbg type; string format specs apply
/// (`{:>60}`).
/// (The string formatter is held, not inherited: fmt's ranges would otherwise quote each
/// element as a string.)
template <typename T>
struct fmt::formatter<T, char, std::enable_if_t<torchdbg::detail::Printable<T>::value>> {
  fmt::formatter<std::string_view> text_;

  template <typename ParseContext>
  constexpr auto parse(ParseContext& ctx) {
    return text_.parse(ctx);
  }
  template <typename FormatContext>
  auto format(const T& x, FormatContext& ctx) const {
    const std::string text = to_string(x);
    return text_.format(std::string_view(text), ctx);
  }
};
