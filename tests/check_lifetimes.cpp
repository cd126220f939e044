// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// Keeps one class of use-after-free out of the tree: a range-for loop whose range is reached
// through the result of a call, such as
//   for (const auto& c : *registry.snapshot()) ...     // the shared_ptr dies before the body
//   for (const auto& e : make_list().items()) ...      // items() refers into a dead temporary
// In C++17 only the outermost temporary of the range expression lives as long as the loop;
// anything it points into is freed first. Hold the result in a named local, then loop over it.
// A range proved safe (every call in it returns by value) may carry `// lifetime-ok: <why>` on
// the loop's line or the line above.
//   check_lifetimes <file or directory>...   (exit 1 and one line per finding when any is found)
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// `s` with comments and string/char literals blanked (same length, newlines kept), so the
/// scanner below sees code only.
std::string code_only(const std::string& s) {
  std::string out = s;
  enum { Code, Line, Block, Str, Chr } st = Code;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i], n = i + 1 < s.size() ? s[i + 1] : '\0';
    switch (st) {
      case Code:
        if (c == '/' && n == '/') st = Line, out[i] = ' ';
        else if (c == '/' && n == '*') st = Block, out[i] = ' ';
        else if (c == '"') st = Str;
        else if (c == '\'') st = Chr;
        break;
      case Line:
        if (c == '\n') st = Code; else out[i] = ' ';
        break;
      case Block:
        if (c == '*' && n == '/') { out[i] = out[i + 1] = ' '; ++i; st = Code; }
        else if (c != '\n') out[i] = ' ';
        break;
      case Str:
      case Chr:
        if (c == '\\') { out[i] = ' '; if (i + 1 < s.size() && n != '\n') out[++i] = ' '; }
        else if (c == (st == Str ? '"' : '\'')) st = Code;
        else if (c != '\n') out[i] = ' ';
        break;
    }
  }
  return out;
}

bool ident_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

/// Whether the range expression reaches its range through a call's result: `*f()`, `*p->g()`,
/// `f().g()`, `f()->g()`, `f()[i]`.
bool through_call(const std::string& range) {
  // The top-level postfix chain only: what stands inside (), [] and {} is an argument, an
  // index or a braced list (whose elements live as long as the loop), and is dropped.
  std::string r;
  int depth = 0;
  for (char c : range) {
    if (std::isspace(static_cast<unsigned char>(c))) continue;
    if (c == ')' || c == ']' || c == '}') --depth;
    if (depth == 0) r += c;
    if (c == '(' || c == '[' || c == '{') ++depth;
  }
  if (r.empty()) return false;
  if (r[0] == '*' && r.find('(') != std::string::npos) return true;
  for (std::size_t i = 0; i + 1 < r.size(); ++i) {
    if (r[i] != ')') continue;
    const char n = r[i + 1];
    if (n == '.' || n == '[' || (n == '-' && i + 2 < r.size() && r[i + 2] == '>')) return true;
  }
  return false;
}

struct Finding {
  int line;
  std::string text;
};

std::vector<Finding> scan(const std::string& original) {
  const std::string s = code_only(original);
  std::vector<Finding> out;
  std::vector<std::string> lines;
  {
    std::stringstream ss(original);
    std::string l;
    while (std::getline(ss, l)) lines.push_back(l);
  }
  const auto line_of = [&](std::size_t pos) {
    return static_cast<int>(std::count(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(pos), '\n')) + 1;
  };
  for (std::size_t i = 0; i + 3 < s.size(); ++i) {
    if (s.compare(i, 3, "for") != 0 || (i > 0 && ident_char(s[i - 1])) || ident_char(s[i + 3])) continue;
    std::size_t j = i + 3;
    while (j < s.size() && std::isspace(static_cast<unsigned char>(s[j]))) ++j;
    if (j >= s.size() || s[j] != '(') continue;
    // The loop head up to its closing parenthesis; the range-for colon is the first one at
    // depth 1 that is not part of `::` (a `;` at depth 1 means a classic for).
    int depth = 0;
    std::size_t colon = std::string::npos, close = std::string::npos;
    bool classic = false;
    for (std::size_t k = j; k < s.size(); ++k) {
      const char c = s[k];
      if (c == '(' || c == '[' || c == '{') ++depth;
      else if (c == ')' || c == ']' || c == '}') {
        if (--depth == 0) { close = k; break; }
      } else if (depth == 1 && c == ';') classic = true;
      else if (depth == 1 && c == ':' && colon == std::string::npos) {
        const bool dbl = (k + 1 < s.size() && s[k + 1] == ':') || (k > 0 && s[k - 1] == ':');
        if (!dbl) colon = k;
      }
    }
    if (classic || colon == std::string::npos || close == std::string::npos) continue;
    if (!through_call(s.substr(colon + 1, close - colon - 1))) continue;
    const int ln = line_of(i);
    const auto marked = [&](int l) {
      return l >= 1 && l <= static_cast<int>(lines.size()) &&
             lines[static_cast<std::size_t>(l - 1)].find("lifetime-ok:") != std::string::npos;
    };
    if (marked(ln) || marked(ln - 1)) continue;
    out.push_back({ln, lines[static_cast<std::size_t>(ln - 1)]});
  }
  return out;
}

bool source_file(const std::filesystem::path& p) {
  const std::string e = p.extension().string();
  return e == ".hpp" || e == ".cpp" || e == ".h" || e == ".cc";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: check_lifetimes <file or directory>...\n";
    return 2;
  }
  int findings = 0, files = 0;
  try {
    std::vector<std::filesystem::path> paths;
    for (int a = 1; a < argc; ++a) {
      const std::filesystem::path root = argv[a];
      if (std::filesystem::is_directory(root)) {
        for (const auto& e : std::filesystem::recursive_directory_iterator(root))
          if (e.is_regular_file() && source_file(e.path())) paths.push_back(e.path());
      } else {
        paths.push_back(root);
      }
    }
    std::sort(paths.begin(), paths.end());
    for (const auto& p : paths) {
      ++files;
      for (const auto& f : scan(read_file(p))) {
        std::cout << p.string() << ":" << f.line << ": range-for over a call's result (hold it in a local): "
                  << f.text << "\n";
        ++findings;
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "check_lifetimes: " << e.what() << "\n";
    return 2;
  }
  std::cout << "check_lifetimes: " << files << " files, " << findings << " findings\n";
  return findings == 0 ? 0 : 1;
}
