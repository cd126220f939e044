// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Submodule paths (tdhook's grammar):
//   path    := ( segment | '[' index ']' ) ( '.' segment | '<' escaped '>' | '[' index ']' )*
//   segment := name | '<' escaped '>'        e.g. encoder, <block0/module>
//   escaped := any characters but '<' and '>'
//   index   := integer | -integer | 'key' | "key" | [int]:[int][:int]   (a slice as Python's)
// `layers[0]` is the first child of `layers` (Sequential/ModuleList item 0), `layers[-1]` the
// last, `layers['key']` the child registered as key (ModuleDict), `layers[1:3]` children 1 and
// 2 (a slice fans a path out to several modules), `<a.b>` a child whose name holds '.', '/'
// or brackets. An escaped name needs no '.' before it: `<block2/module><sub/0>[0]` is
// `<block2/module>.<sub/0>[0]`, as in tdhook.

#include <torch/nn/module.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "torchdbg/error.hpp"

namespace torchdbg {

/// One step of a parsed path.
struct PathStep {
  enum class Kind { Name, Index, Key, Slice };
  Kind kind = Kind::Name;
  std::string name;  ///< Name and Key
  int64_t index = 0;  ///< Index (negative counts from the end)
  std::optional<int64_t> start, stop;  ///< Slice bounds (Python semantics)
  int64_t step = 1;
  std::size_t position = 0;  ///< character offset in the path, for messages
};

namespace detail {

[[noreturn]] inline void path_error(std::string_view path, std::size_t pos, const std::string& why) {
  throw Error("torchdbg: bad submodule path '" + std::string(path) + "' at position " +
              std::to_string(pos) + ": " + why);
}

/// The character at `i` as text: a whole UTF-8 sequence, not one byte of it.
inline std::string char_at(std::string_view path, std::size_t i) {
  std::size_t n = 1;
  while (i + n < path.size() && (static_cast<unsigned char>(path[i + n]) & 0xC0) == 0x80 &&
         (static_cast<unsigned char>(path[i]) & 0x80) != 0 && n < 4) {
    ++n;
  }
  return std::string(path.substr(i, n));
}

inline bool is_name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
}

inline std::optional<int64_t> parse_int(std::string_view s, std::string_view path, std::size_t pos,
                                        const char* what) {
  if (s.empty()) return std::nullopt;
  std::size_t i = 0;
  if (s[0] == '-' || s[0] == '+') i = 1;
  if (i == s.size()) path_error(path, pos, std::string(what) + " '" + std::string(s) + "' is not an integer");
  for (std::size_t k = i; k < s.size(); ++k) {
    if (!std::isdigit(static_cast<unsigned char>(s[k]))) {
      path_error(path, pos, std::string(what) + " '" + std::string(s) + "' is not an integer");
    }
  }
  try {
    return std::stoll(std::string(s));
  } catch (...) {
    path_error(path, pos, std::string(what) + " '" + std::string(s) + "' is out of range");
  }
}

}  // namespace detail

/// Parses `path` into steps; throws torchdbg::Error naming the position and the reason.
inline std::vector<PathStep> parse_submodule_path(std::string_view path) {
  std::vector<PathStep> steps;
  std::size_t i = 0;
  const std::size_t n = path.size();
  auto read_segment = [&]() {
    PathStep s;
    s.position = i;
    if (i < n && path[i] == '<') {
      const std::size_t close = path.find('>', i + 1);
      if (close == std::string_view::npos) detail::path_error(path, i, "missing '>'");
      if (close == i + 1) detail::path_error(path, i, "empty name in '<>'");
      s.name = std::string(path.substr(i + 1, close - i - 1));
      if (const auto nested = s.name.find('<'); nested != std::string::npos) {
        detail::path_error(path, i + 1 + nested, "'<' inside '<...>'");
      }
      i = close + 1;
    } else {
      const std::size_t start = i;
      while (i < n && detail::is_name_char(path[i])) ++i;
      if (i == start) {
        if (i < n) {
          detail::path_error(path, i, "unexpected '" + detail::char_at(path, i) + "', expected a name");
        }
        detail::path_error(path, i, "expected a name");
      }
      s.name = std::string(path.substr(start, i - start));
    }
    steps.push_back(std::move(s));
  };
  auto read_index = [&]() {
    const std::size_t open = i;
    ++i;  // '['
    PathStep s;
    s.position = open;
    if (i < n && (path[i] == '\'' || path[i] == '"')) {
      const char q = path[i];
      const std::size_t close = path.find(q, i + 1);
      if (close == std::string_view::npos) detail::path_error(path, i, std::string("missing closing ") + q);
      s.kind = PathStep::Kind::Key;
      s.name = std::string(path.substr(i + 1, close - i - 1));
      i = close + 1;
      if (i >= n || path[i] != ']') detail::path_error(path, i, "missing ']'");
      ++i;
      steps.push_back(std::move(s));
      return;
    }
    const std::size_t close = path.find(']', i);
    if (close == std::string_view::npos) detail::path_error(path, open, "missing ']'");
    const std::string_view body = path.substr(i, close - i);
    if (body.empty()) detail::path_error(path, open, "empty index '[]'");
    if (body.find(':') != std::string_view::npos) {
      s.kind = PathStep::Kind::Slice;
      std::vector<std::string_view> parts;
      std::size_t b = 0;
      for (std::size_t k = 0; k <= body.size(); ++k) {
        if (k == body.size() || body[k] == ':') {
          parts.push_back(body.substr(b, k - b));
          b = k + 1;
        }
      }
      if (parts.size() > 3) detail::path_error(path, i, "bad slice '" + std::string(body) + "': too many ':'");
      s.start = detail::parse_int(parts[0], path, i, "slice start");
      s.stop = detail::parse_int(parts[1], path, i, "slice stop");
      if (parts.size() == 3) {
        auto st = detail::parse_int(parts[2], path, i, "slice step");
        if (st && *st == 0) detail::path_error(path, i, "bad slice '" + std::string(body) + "': step cannot be zero");
        if (st && *st == std::numeric_limits<int64_t>::min()) {
          detail::path_error(path, i, "bad slice '" + std::string(body) + "': step out of range");
        }
        s.step = st.value_or(1);
      }
    } else {
      s.kind = PathStep::Kind::Index;
      s.index = *detail::parse_int(body, path, i, "index");
    }
    i = close + 1;
    steps.push_back(std::move(s));
  };

  if (n == 0) return steps;  // the root itself
  if (path[0] == '[') {
    read_index();  // "[0]" indexes the root container itself
  } else {
    read_segment();
  }
  while (i < n) {
    if (path[i] == '.') {
      ++i;
      if (i >= n) detail::path_error(path, i, "expected a name after '.'");
      read_segment();
    } else if (path[i] == '[') {
      read_index();
    } else if (path[i] == '<') {
      read_segment();  // an escaped name right after a name or index: `<a/b><c/d>`
    } else {
      detail::path_error(path, i, "unexpected '" + detail::char_at(path, i) + "'");
    }
  }
  return steps;
}

/// A module found by a path, with its dotted name ("layers.0.linear").
struct ResolvedModule {
  std::string name;
  std::shared_ptr<torch::nn::Module> module;
};

/// Every module `path` designates under `root` (several when the path holds a slice).
/// Throws torchdbg::Error for a malformed path, an unknown child or an index out of range.
inline std::vector<ResolvedModule> resolve_submodule_paths(const std::shared_ptr<torch::nn::Module>& root,
                                                           std::string_view path) {
  if (!root) throw Error("torchdbg: resolve_submodule_path got a null root module");
  const auto steps = parse_submodule_path(path);
  std::vector<ResolvedModule> current{{"", root}};
  auto join = [](const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; };
  for (const auto& s : steps) {
    std::vector<ResolvedModule> next;
    for (const auto& cur : current) {
      const auto children = cur.module->named_children();
      const auto count = static_cast<int64_t>(children.size());
      auto by_position = [&](int64_t idx) {
        const int64_t k = idx < 0 ? idx + count : idx;
        if (k < 0 || k >= count) {
          detail::path_error(path, s.position, "index " + std::to_string(idx) + " out of range for '" +
                                                   (cur.name.empty() ? "<root>" : cur.name) + "' with " +
                                                   std::to_string(count) + " children");
        }
        const auto& item = children[static_cast<std::size_t>(k)];
        next.push_back({join(cur.name, item.key()), item.value()});
      };
      switch (s.kind) {
        case PathStep::Kind::Name:
        case PathStep::Kind::Key: {
          const auto* child = children.find(s.name);
          if (child == nullptr) {
            std::string known;
            for (const auto& c : children) known += (known.empty() ? "" : ", ") + c.key();
            detail::path_error(path, s.position, "no child '" + s.name + "' in '" +
                                                     (cur.name.empty() ? "<root>" : cur.name) + "' (children: " +
                                                     (known.empty() ? "none" : known) + ")");
          }
          next.push_back({join(cur.name, s.name), *child});
          break;
        }
        case PathStep::Kind::Index:
          by_position(s.index);
          break;
        case PathStep::Kind::Slice: {  // Python's slice.indices(count)
          const bool up = s.step > 0;
          auto bound = [&](std::optional<int64_t> v, int64_t dflt) {
            if (!v) return dflt;
            const int64_t k = *v < 0 ? std::max<int64_t>(*v, -count - 1) + count : std::min<int64_t>(*v, count);
            return up ? std::max<int64_t>(0, k) : std::max<int64_t>(-1, std::min<int64_t>(k, count - 1));
          };
          const int64_t a = bound(s.start, up ? 0 : count - 1), b = bound(s.stop, up ? count : -1);
          for (int64_t k = a; up ? k < b : k > b; k += s.step) {
            by_position(k);
            if (up ? b - k <= s.step : k - b <= -s.step) break;  // the next k would pass b (or overflow)
          }
          break;
        }
      }
    }
    current = std::move(next);
  }
  return current;
}

/// The one module `path` designates; a path that fans out (a slice) must select exactly one.
inline std::shared_ptr<torch::nn::Module> resolve_submodule_path(const std::shared_ptr<torch::nn::Module>& root,
                                                                 std::string_view path) {
  auto all = resolve_submodule_paths(root, path);
  if (all.size() != 1) {
    throw Error("torchdbg: submodule path '" + std::string(path) + "' selects " + std::to_string(all.size()) +
                " modules, expected one (use resolve_submodule_paths)");
  }
  return all.front().module;
}

/// The dotted module name a path spells, without a model: `a[0].<b.c>['k']` -> "a.0.b.c.k".
/// Negative indices and slices need the model (resolve_submodule_paths gives their names).
inline std::string submodule_path_to_name(std::string_view path) {
  std::string out;
  for (const auto& s : parse_submodule_path(path)) {
    std::string part;
    switch (s.kind) {
      case PathStep::Kind::Name:
      case PathStep::Kind::Key:
        part = s.name;
        break;
      case PathStep::Kind::Index:
        if (s.index < 0) {
          detail::path_error(path, s.position, "a negative index needs the model to be named");
        }
        part = std::to_string(s.index);
        break;
      case PathStep::Kind::Slice:
        detail::path_error(path, s.position, "a slice needs the model to be named");
    }
    out += (out.empty() ? "" : ".") + part;
  }
  return out;
}

/// Joins a relative root path and a path below it: merge_paths("encoder", "layers[0]") ->
/// "encoder.layers[0]"; merge_paths("layers", "[0]") -> "layers[0]". Either may be empty.
inline std::string merge_paths(std::string_view root, std::string_view path) {
  (void)parse_submodule_path(root);
  (void)parse_submodule_path(path);
  if (root.empty()) return std::string(path);
  if (path.empty()) return std::string(root);
  return std::string(root) + (path.front() == '[' ? "" : ".") + std::string(path);
}

}  // namespace torchdbg
