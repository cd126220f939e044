// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// Every C++ code block of the README and the guides is an excerpt of an example that ctest
// builds and runs. A block is preceded by
//   <!-- snippet: examples/tour.cpp hooks -->
// and must equal, line for line (common indentation removed), the region of that file between
//   // [snippet hooks]      and      // [/snippet]
// so a renamed function breaks the example's build, and a changed example breaks this check
// until the text is updated.
//   check_snippets <repository root> <markdown file>...
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(f, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    out.push_back(line);
  }
  return out;
}

std::string trim(const std::string& s) {
  const auto a = s.find_first_not_of(" \t");
  if (a == std::string::npos) return {};
  const auto b = s.find_last_not_of(" \t");
  return s.substr(a, b - a + 1);
}

/// Removes the indentation common to the non-blank lines, and trailing blanks.
std::vector<std::string> dedent(std::vector<std::string> v) {
  std::size_t common = std::string::npos;
  for (const auto& l : v)
    if (!trim(l).empty()) common = std::min(common, l.find_first_not_of(' '));
  for (auto& l : v) {
    l = trim(l).empty() ? std::string() : l.substr(common == std::string::npos ? 0 : common);
    while (!l.empty() && (l.back() == ' ' || l.back() == '\t')) l.pop_back();
  }
  while (!v.empty() && v.back().empty()) v.pop_back();
  while (!v.empty() && v.front().empty()) v.erase(v.begin());
  return v;
}

/// The regions `// [snippet NAME]` ... `// [/snippet]` of a source file.
std::map<std::string, std::vector<std::string>> regions(const std::string& path, std::vector<std::string>& errors) {
  std::map<std::string, std::vector<std::string>> out;
  const auto lines = lines_of(path);
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const std::string t = trim(lines[i]);
    if (t.rfind("// [snippet ", 0) != 0) continue;
    const std::string name = t.substr(12, t.size() - 13);
    std::vector<std::string> body;
    std::size_t j = i + 1;
    for (; j < lines.size() && trim(lines[j]) != "// [/snippet]"; ++j) body.push_back(lines[j]);
    if (j == lines.size()) errors.push_back(path + ": snippet '" + name + "' is not closed");
    if (out.count(name)) errors.push_back(path + ": snippet '" + name + "' is defined twice");
    out[name] = dedent(body);
    i = j;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: check_snippets <repository root> <markdown file>...\n";
    return 2;
  }
  const std::string root = argv[1];
  std::vector<std::string> errors;
  std::map<std::string, std::map<std::string, std::vector<std::string>>> sources;
  int blocks = 0;
  for (int a = 2; a < argc; ++a) {
    const std::string md = argv[a];
    std::vector<std::string> lines;
    try {
      lines = lines_of(md);
    } catch (const std::exception& e) {
      errors.push_back(e.what());
      continue;
    }
    for (std::size_t i = 0; i < lines.size(); ++i) {
      const std::string t = trim(lines[i]);
      if (t.rfind("```", 0) != 0) continue;
      const std::string lang = trim(t.substr(3));
      std::size_t end = i + 1;
      while (end < lines.size() && trim(lines[end]).rfind("```", 0) != 0) ++end;
      if (lang == "cpp" || lang == "c++") {
        ++blocks;
        const std::string where = md + ":" + std::to_string(i + 1);
        std::size_t m = i;
        while (m > 0 && trim(lines[m - 1]).empty()) --m;
        const std::string marker = m > 0 ? trim(lines[m - 1]) : std::string();
        const std::string prefix = "<!-- snippet: ";
        if (marker.rfind(prefix, 0) != 0 || marker.size() < prefix.size() + 4 ||
            marker.compare(marker.size() - 4, 4, " -->") != 0) {
          errors.push_back(where + ": a C++ block without a '<!-- snippet: FILE NAME -->' line before it");
        } else {
          const std::string spec = marker.substr(prefix.size(), marker.size() - prefix.size() - 4);
          const auto sp = spec.find(' ');
          const std::string file = spec.substr(0, sp), name = sp == std::string::npos ? "" : trim(spec.substr(sp));
          if (!sources.count(file)) {
            try {
              sources[file] = regions(root + "/" + file, errors);
            } catch (const std::exception& e) {
              errors.push_back(where + ": " + e.what());
              sources[file] = {};
            }
          }
          const auto& regs = sources[file];
          auto it = regs.find(name);
          if (it == regs.end()) {
            errors.push_back(where + ": no snippet '" + name + "' in " + file);
          } else {
            const auto block = dedent(std::vector<std::string>(lines.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                                                               lines.begin() + static_cast<std::ptrdiff_t>(end)));
            if (block != it->second) {
              std::ostringstream s;
              s << where << ": differs from " << file << " [snippet " << name << "]";
              for (std::size_t k = 0; k < std::max(block.size(), it->second.size()); ++k) {
                const std::string x = k < block.size() ? block[k] : "<none>";
                const std::string y = k < it->second.size() ? it->second[k] : "<none>";
                if (x != y) {
                  s << "\n  line " << k + 1 << " of the block: " << x << "\n  line " << k + 1 << " of the example: " << y;
                  break;
                }
              }
              errors.push_back(s.str());
            }
          }
        }
      }
      i = end;
    }
  }
  for (const auto& e : errors) std::cerr << e << "\n";
  if (!errors.empty()) return 1;
  std::cout << blocks << " C++ blocks checked: each is an excerpt of a built and run example\n";
  return 0;
}
