// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <torchdbg/exporters/csv.hpp>
#include <torchdbg/exporters/html.hpp>
#include <torchdbg/exporters/jsonl.hpp>
#include <torchdbg/exporters/summary_json.hpp>

#include "helpers.hpp"

using torchdbg::LayerRecord;
using torchdbg::StepRecord;

namespace {

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// A synthetic step with `layers` layers: forward stats, gradient stats and health.
StepRecord make_step(int64_t step, int layers, bool bad = false) {
  StepRecord r;
  r.step = step;
  r.loss = bad ? std::nan("") : 2.0 / (static_cast<double>(step) + 1.0);
  for (int l = 0; l < layers; ++l) {
    const std::string name = "block" + std::to_string(l) + ".fc";
    LayerRecord f;
    f.layer = name;
    f.stats = torchdbg::compute_stats(torch::full({4}, static_cast<double>(l)));
    r.layers.push_back(f);
    LayerRecord g;
    g.layer = name;
    g.forward = false;
    g.parameter = "weight";
    g.stats = torchdbg::compute_stats(torch::full({4}, std::pow(10.0, -l % 6)));
    r.layers.push_back(g);
    torchdbg::LayerHealth h;
    h.name = name;
    h.module = name;
    h.order = l;
    h.has_activation = h.has_gradient = true;
    h.activation = (bad && l == 3) ? torchdbg::ActivationHealth::NonFinite
                                   : torchdbg::ActivationHealth::Normal;
    h.gradient =
        l % 7 == 6 ? torchdbg::GradientHealth::Vanishing : torchdbg::GradientHealth::Healthy;
    r.health.push_back(h);
  }
  if (bad) {
    torchdbg::SemanticEvent e;
    e.id = static_cast<uint64_t>(step);
    e.type = torchdbg::EventType::NonFiniteActivation;
    e.layer = "block3.fc";
    e.step = step;
    e.from = "normal";
    e.to = "non_finite";
    e.confidence = 0.95;
    r.events.push_back(e);
  }
  return r;
}

}  // namespace

TEST_CASE("JSONL: one parseable object per line, NaN as null, flushed at the interval",
          "[exporters]") {
  const std::string dir = torchdbg_test::tmp_dir("jsonl");
  const std::string path = dir + "/run.jsonl";
  {
    torchdbg::JsonlExporter x(
        path, torchdbg::StreamOptions().flush_every_steps(3).flush_every_seconds(1e9));
    x.write_step(make_step(0, 2));
    x.write_step(make_step(1, 2, /*bad=*/true));
    CHECK(read_lines(path).empty());  // not yet: the interval is 3 steps
    x.write_step(make_step(2, 2));
    const auto lines = read_lines(path);
    // per step: 1 step line + 2 layers x 2 records + 2 health lines (+1 event on step 1)
    CHECK(lines.size() == 3 * 7 + 1);
    int events = 0;
    for (const auto& l : lines) {
      const auto j = nlohmann::json::parse(l);  // throws on a malformed line
      CHECK(j.contains("type"));
      if (j["type"] == "step" && j["step"] == 1) CHECK(j["loss"].is_null());
      if (j["type"] == "event") {
        ++events;
        CHECK(j["layer"] == "block3.fc");
        CHECK(j["to"] == "non_finite");
      }
      if (j["type"] == "layer" && j["direction"] == "backward") CHECK(j["parameter"] == "weight");
    }
    CHECK(events == 1);
    x.write_step(make_step(3, 1));
  }  // the destructor flushes the rest
  CHECK(read_lines(path).size() == 3 * 7 + 1 + 4);
  // pandas reads the whole stream as one table.
  if (std::system("/usr/bin/python3 -c 'import pandas' 2>/dev/null") == 0) {
    const std::string cmd = "/usr/bin/python3 -c \"import pandas as pd; df = pd.read_json('" +
                            path +
                            "', lines=True); assert len(df) == 26, len(df); assert set(df['type']) "
                            "== {'step','layer','health','event'}; "
                            "print('pandas ok', df.shape)\"";
    CHECK(std::system(cmd.c_str()) == 0);
  } else {
    WARN("python3-pandas not installed: pandas.read_json not checked");
  }
}

TEST_CASE("JSONL: a process killed mid-stream leaves only complete, parseable lines",
          "[exporters]") {
  const std::string path = torchdbg_test::tmp_dir("jsonl_kill") + "/run.jsonl";
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    torchdbg::JsonlExporter x(path, torchdbg::StreamOptions().flush_every_steps(1));
    for (int64_t s = 0;; ++s) x.write_step(make_step(s, 40));
  }
  // Wait until the file has grown, then kill -9.
  for (int i = 0; i < 200; ++i) {
    usleep(10000);
    std::ifstream f(path, std::ios::ate);
    if (f && f.tellg() > 400000) break;
  }
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  const std::string text = slurp(path);
  REQUIRE(text.size() > 0);
  std::size_t complete = 0, pos = 0;
  while (true) {
    const auto nl = text.find('\n', pos);
    if (nl == std::string::npos) break;
    CHECK(nlohmann::json::accept(text.substr(pos, nl - pos)));
    ++complete;
    pos = nl + 1;
  }
  CHECK(complete > 100);
  // What follows the last newline (if anything) is the one line being written at the kill.
  CHECK(text.size() - pos < 4096);
  // The next run appends: a torn line is cut first, so every line of the file parses.
  {
    torchdbg::JsonlExporter again(path, torchdbg::StreamOptions().truncate(false));
    CHECK(again.torn_bytes_removed() == text.size() - pos);
    again.write_step(make_step(100000, 3));
    again.flush();
  }
  const auto lines = read_lines(path);
  CHECK(lines.size() == complete + 1 + 3 * 3);
  for (const auto& l : lines) CHECK(nlohmann::json::accept(l));
  CHECK(nlohmann::json::parse(lines[complete])["step"] == 100000);
}

TEST_CASE(
    "streams: a full disk is counted and reported, not thrown, and nothing is lost once it clears",
    "[exporters]") {
  if (access("/dev/full", W_OK) == 0) {
    torchdbg::JsonlExporter x("/dev/full",
                              torchdbg::StreamOptions().flush_every_steps(1).truncate(false));
    CHECK_NOTHROW(x.write_step(make_step(0, 2)));
    CHECK_NOTHROW(x.write_step(make_step(1, 2)));
    CHECK(x.failures() == 2);
    CHECK(x.last_error().find("/dev/full") != std::string::npos);
  }
  CHECK_THROWS_WITH(torchdbg::JsonlExporter("/nonexistent-dir/x.jsonl"),
                    Catch::Contains("/nonexistent-dir/x.jsonl"));
  CHECK_THROWS_WITH(torchdbg::CsvExporter("/nonexistent-dir/x.csv"),
                    Catch::Contains("/nonexistent-dir/x.csv"));
  CHECK_THROWS_WITH(torchdbg::JsonlExporter(torchdbg_test::tmp_dir("bad_opt") + "/x",
                                            torchdbg::StreamOptions().flush_every_steps(0)),
                    Catch::Contains("flush_every_steps"));
}

TEST_CASE("CSV: the per-layer table with quoted names, empty cells for unknown values",
          "[exporters]") {
  const std::string path = torchdbg_test::tmp_dir("csv") + "/run.csv";
  {
    torchdbg::CsvExporter x(path);
    auto r = make_step(5, 2, /*bad=*/true);
    r.layers[0].layer = "enc,\"odd\"";
    x.write_step(r);
  }
  const auto lines = read_lines(path);
  REQUIRE(lines.size() == 5);
  CHECK(lines[0] == torchdbg::CsvExporter::kHeader);
  CHECK(lines[1].rfind("5,\"enc,\"\"odd\"\"\",forward,,4,0,0,0,0,0,0,0,4,,", 0) == 0);
  CHECK(lines[2].rfind("5,block0.fc,backward,weight,4,1,0,1,1,2,0,0,0,healthy,", 0) == 0);
  CHECK(lines[3].find("block1.fc,forward") != std::string::npos);
  CHECK(lines[1].back() == ',');  // the loss was NaN: an empty cell
}

TEST_CASE("summary JSON is rewritten atomically with the loss range and the diagnosis",
          "[exporters]") {
  const std::string path = torchdbg_test::tmp_dir("summary") + "/summary.json";
  torchdbg::SummaryJsonExporter x(path);
  for (int s = 0; s < 5; ++s) x.write_step(make_step(s, 3, s == 4));
  torchdbg::RunSummary sum;
  sum.steps = 5;
  sum.last_step = 4;
  torchdbg::HealthReport report;
  torchdbg::Incident inc;
  inc.kind = torchdbg::FailureKind::NonFiniteOutput;
  inc.layer = inc.module = "block3.fc";
  inc.step = 4;
  report.incidents.push_back(inc);
  sum.diagnosis = torchdbg::diagnose(report);
  x.write_summary(sum);
  const auto j = nlohmann::json::parse(slurp(path));
  CHECK(j["steps"] == 5);
  CHECK(j["loss"]["first"] == 2.0);
  CHECK(j["loss"]["min"] == Approx(0.5));
  CHECK(j["loss"]["non_finite"] == 1);
  CHECK(j["alarms"] == 1);
  CHECK(j["diagnosis"]["hypotheses"][0]["layer"] == "block3.fc");
  // No temporary files left beside it.
  int files = 0;
  for (const auto& e :
       std::filesystem::directory_iterator(std::filesystem::path(path).parent_path())) {
    (void)e;
    ++files;
  }
  CHECK(files == 1);
}

TEST_CASE("HTML: every section renders, and 120 layers x 10000 steps stay bounded", "[exporters]") {
  torchdbg::HtmlExporter small(torchdbg_test::tmp_dir("html_small") + "/r.html");
  CHECK_NOTHROW(small.flush());  // an empty report is still a complete page
  const std::string empty = small.render();
  for (const char* id : {"summary", "diagnosis", "loss", "gradient-flow", "health-heatmap",
                         "histograms", "events", "alerts"})
    CHECK(empty.find(std::string("id=\"") + id + "\"") != std::string::npos);

  torchdbg::HtmlExporter big(torchdbg_test::tmp_dir("html_big") + "/r.html");
  for (int64_t s = 0; s < 10000; ++s) {
    auto r = make_step(s, 120, s == 9000);
    if (s % 500 == 0) {
      for (auto& l : r.layers)
        if (l.forward)
          l.stats = torchdbg::compute_stats(
              torch::randn({256}), torchdbg::StatsOptions().distribution(true).histogram_bins(20));
    }
    big.write_step(r);
  }
  big.flush();
  const std::string html = slurp(big.path());
  CHECK(html.size() < 4u << 20);  // bounded: no point per step
  CHECK(html.find("step 9999") != std::string::npos);
  CHECK(html.find("(64 steps per column)") !=
        std::string::npos);  // 10000 steps into <= 200 columns
  CHECK(html.find("Showing 64 of 120 layers.") != std::string::npos);
  std::size_t lines = 0;
  for (std::size_t p = html.find("class=\"flow-line\""); p != std::string::npos;
       p = html.find("class=\"flow-line\"", p + 1))
    ++lines;
  CHECK(lines >= 5);
  CHECK(lines <= 11);
  CHECK(html.find("non-finite") != std::string::npos);   // the bad step shows in the heatmap
  CHECK(html.find("<script src") == std::string::npos);  // nothing fetched from the network
  CHECK(html.find("http://") == std::string::npos);
  CHECK(html.find("https://") == std::string::npos);
}

TEST_CASE("the decimated series keeps at most its capacity over any length", "[exporters]") {
  torchdbg::detail::Decimated<int> d(10);
  for (int i = 0; i < 100000; ++i) d.add(i);
  CHECK(d.items().size() <= 10);
  CHECK(d.items().size() >= 5);
  CHECK(d.items().front() == 0);
  for (std::size_t i = 1; i < d.items().size(); ++i) CHECK(d.items()[i] > d.items()[i - 1]);
}

namespace {
/// Names no exporter may choke on: invalid UTF-8 (stray, truncated, overlong, surrogate),
/// NUL, markup, quotes, commas, newlines and a 100 kB name.
std::vector<std::string> odd_names() {
  return {std::string("fc\xff\xfe", 4),         std::string("trunc\xe2\x82", 7),
          std::string("overlong\xc0\xaf", 10),   std::string("surrogate\xed\xa0\x80", 12),
          std::string("nul\0inside", 10),        "</script><script>alert(1)</script>",
          "quote\"comma,new\nline\r",            "\xe2\x9c\x93 valid \xf0\x9f\x98\x80",
          std::string(100000, 'x')};
}
}  // namespace

TEST_CASE("exporters: any string gives valid JSON, CSV and HTML; one bad name costs no record",
          "[exporters]") {
  const std::string dir = torchdbg_test::tmp_dir("odd_names");
  torchdbg::JsonlExporter jsonl(dir + "/run.jsonl");
  torchdbg::CsvExporter csv(dir + "/run.csv");
  torchdbg::HtmlExporter html(dir + "/report.html");
  torchdbg::SummaryJsonExporter summary(dir + "/summary.json");
  const auto names = odd_names();
  for (int64_t step = 0; step < 25; ++step) {
    StepRecord r = make_step(step, 2);
    for (const auto& n : names) {
      LayerRecord l;
      l.layer = n;
      l.parameter = n;
      l.forward = step % 2 == 0;
      l.stats = torchdbg::compute_stats(torch::full({3}, 1.5));
      r.layers.push_back(l);
    }
    for (torchdbg::Exporter* e : std::initializer_list<torchdbg::Exporter*>{&jsonl, &csv, &html, &summary})
      CHECK_NOTHROW(e->write_step(r));
  }
  torchdbg::RunSummary rs;
  rs.steps = 25;
  for (torchdbg::Exporter* e : std::initializer_list<torchdbg::Exporter*>{&jsonl, &csv, &html, &summary}) {
    CHECK_NOTHROW(e->write_summary(rs));
    e->flush();
  }
  // JSONL: every record of every step, each line valid JSON in valid UTF-8.
  const auto lines = read_lines(dir + "/run.jsonl");
  CHECK(lines.size() == 25 * (1 + 4 + names.size() + 2) + 1);
  for (const auto& l : lines) {
    CHECK(nlohmann::json::accept(l));
    CHECK(torchdbg::detail::valid_utf8(l) == l);
  }
  CHECK(nlohmann::json::parse(lines[5])["layer"] == "fc\xef\xbf\xbd\xef\xbf\xbd");  // U+FFFD per bad byte
  // CSV: valid UTF-8 without NUL; Python's csv reader reads every row with 15 fields.
  const std::string text = slurp(dir + "/run.csv");
  CHECK(torchdbg::detail::valid_utf8(text) == text);
  CHECK(text.find('\0') == std::string::npos);
  if (std::system("/usr/bin/python3 -c 'import csv' 2>/dev/null") == 0) {
    const std::string cmd = "/usr/bin/python3 -c \"import csv,sys; rows=list(csv.reader(open('" + dir +
                            "/run.csv', encoding='utf-8', newline=''))); assert len(rows) == 1 + 25 * " +
                            std::to_string(4 + names.size()) + ", len(rows); assert all(len(r) == 15 for r in rows)\"";
    CHECK(std::system(cmd.c_str()) == 0);
  }
  // HTML and summary JSON: valid UTF-8, names escaped.
  const std::string page = slurp(dir + "/report.html");
  CHECK(torchdbg::detail::valid_utf8(page) == page);
  CHECK(page.find("<script>alert(1)") == std::string::npos);
  const std::string sj = slurp(dir + "/summary.json");
  CHECK(nlohmann::json::accept(sj));
}

TEST_CASE("valid_utf8 keeps valid text and replaces each invalid byte with U+FFFD", "[exporters]") {
  using torchdbg::detail::valid_utf8;
  const std::string fffd = "\xef\xbf\xbd";
  CHECK(valid_utf8("plain ascii") == "plain ascii");
  const std::string ok = "\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf";  // e-acute, euro, emoji, U+10FFFF
  CHECK(valid_utf8(ok) == ok);
  CHECK(valid_utf8(std::string("a\0b", 3)) == "a" + fffd + "b");
  CHECK(valid_utf8("\x80") == fffd);                       // stray continuation byte
  CHECK(valid_utf8("\xe2\x82") == fffd + fffd);           // truncated
  CHECK(valid_utf8("\xc0\xaf") == fffd + fffd);           // overlong '/'
  CHECK(valid_utf8("\xe0\x80\xaf") == fffd + fffd + fffd);  // overlong, 3 bytes
  CHECK(valid_utf8("\xed\xa0\x80") == fffd + fffd + fffd);  // surrogate U+D800
  CHECK(valid_utf8("\xf4\x90\x80\x80") == fffd + fffd + fffd + fffd);  // past U+10FFFF
  CHECK(valid_utf8("\xf5") == fffd);
}

TEST_CASE("streams: appending repairs an unterminated last line; bad options leave the file untouched",
          "[exporters]") {
  const std::string dir = torchdbg_test::tmp_dir("append_repair");
  SECTION("JSONL: a torn line is cut, a complete one gets its newline") {
    const std::string path = dir + "/torn.jsonl";
    const std::string torn = "{\"type\":\"layer\",\"st";
    std::ofstream(path) << "{\"a\":1}\n{\"a\":2}\n" << torn;
    {
      torchdbg::JsonlExporter x(path, torchdbg::StreamOptions().truncate(false));
      CHECK(x.torn_bytes_removed() == torn.size());
      x.write_step(make_step(7, 1));
    }
    auto lines = read_lines(path);
    REQUIRE(lines.size() == 2 + 1 + 1 + 2);
    for (const auto& l : lines) CHECK(nlohmann::json::accept(l));
    const std::string whole = dir + "/whole.jsonl";
    std::ofstream(whole) << "{\"a\":1}\n{\"a\":2}";  // complete, no newline: kept
    {
      torchdbg::JsonlExporter x(whole, torchdbg::StreamOptions().truncate(false));
      CHECK(x.torn_bytes_removed() == 0);
      x.write_step(make_step(8, 1));
    }
    lines = read_lines(whole);
    REQUIRE(lines.size() == 2 + 4);
    CHECK(lines[1] == "{\"a\":2}");
    for (const auto& l : lines) CHECK(nlohmann::json::accept(l));
  }
  SECTION("CSV: a torn row is cut; a new file gets its header even when appending") {
    const std::string path = dir + "/torn.csv";
    {
      torchdbg::CsvExporter x(path, torchdbg::StreamOptions().truncate(false));
      x.write_step(make_step(1, 1));
    }
    std::ofstream(path, std::ios::app) << "2,\"fc,";  // torn inside a quoted field
    {
      torchdbg::CsvExporter x(path, torchdbg::StreamOptions().truncate(false));
      CHECK(x.torn_bytes_removed() == 6);
      x.write_step(make_step(3, 1));
    }
    const auto lines = read_lines(path);
    REQUIRE(lines.size() == 1 + 2 + 2);
    CHECK(lines[0] == torchdbg::CsvExporter::kHeader);
    for (const auto& l : lines) CHECK(torchdbg::CsvExporter::fields(l) == 15);
  }
  SECTION("a bad option is refused before the existing file is opened") {
    const std::string path = dir + "/keep.jsonl";
    std::ofstream(path) << "{\"a\":1}\n";
    CHECK_THROWS_WITH(torchdbg::JsonlExporter(path, torchdbg::StreamOptions().flush_every_steps(0)),
                      Catch::Contains("flush_every_steps"));
    CHECK_THROWS_WITH(torchdbg::CsvExporter(path, torchdbg::StreamOptions().flush_every_steps(-3)),
                      Catch::Contains("flush_every_steps"));
    CHECK(slurp(path) == "{\"a\":1}\n");
  }
}

namespace {

/// One RFC 4180 record and the offset just past its newline.
struct CsvRecord {
  std::vector<std::string> fields;
  std::size_t end = 0;
};

/// An RFC 4180 reader written apart from the exporter: a quoted field holds anything with
/// quotes doubled, an unquoted one holds no quote, CR or LF, and every record ends with "\n".
/// Returns false with `error` set at the first departure (an unterminated last record too).
bool parse_csv(const std::string& text, std::vector<CsvRecord>& out, std::string& error) {
  out.clear();
  std::size_t i = 0;
  const std::size_t n = text.size();
  while (i < n) {
    CsvRecord rec;
    while (true) {
      std::string f;
      if (i < n && text[i] == '"') {
        ++i;
        while (true) {
          if (i >= n) {
            error = "open quote at end of file";
            return false;
          }
          if (text[i] == '"') {
            if (i + 1 < n && text[i + 1] == '"') {
              f += '"';
              i += 2;
              continue;
            }
            ++i;
            break;
          }
          f += text[i++];
        }
      } else {
        while (i < n && text[i] != ',' && text[i] != '\n') {
          if (text[i] == '"' || text[i] == '\r') {
            error = "quote or CR in an unquoted field at byte " + std::to_string(i);
            return false;
          }
          f += text[i++];
        }
      }
      rec.fields.push_back(f);
      if (i >= n) {
        error = "last record has no newline";
        return false;
      }
      if (text[i] == ',') {
        ++i;
        continue;
      }
      if (text[i] != '\n') {
        error = "a closing quote not followed by a comma or newline at byte " + std::to_string(i);
        return false;
      }
      ++i;
      break;
    }
    rec.end = i;
    out.push_back(std::move(rec));
  }
  return true;
}

/// `s` with control bytes, quotes and backslashes escaped, as a C++ literal shows them.
std::string escaped(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\n')
      out += "\\n";
    else if (c == '\r')
      out += "\\r";
    else if (c == '"' || c == '\\')
      out += std::string("\\") + static_cast<char>(c);
    else
      out += static_cast<char>(c);
  }
  return out;
}

/// Layer (and parameter) names that stress RFC 4180 quoting, all valid UTF-8.
std::vector<std::string> hostile_names() {
  return {"fc1",    "block\nfc2", "with,comma", "quo\"te",
          "cr\rlf", "crlf\r\nx",  "\"\"",       "\n",
          ",",      "a\"\nb,\"c", "ends\n",     "\xc3\xa9t\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80",
          "\"\n\"", "step"};
}

/// A step whose layers carry `names`, forward and backward (the name as parameter too), with
/// values whose text has many digits, so that a cut can fall inside a number. Step 999999
/// (the appended one) has a loss of 0.5.
StepRecord hostile_step(int64_t step, const std::vector<std::string>& names) {
  StepRecord r;
  r.step = step;
  r.loss = step == 999999 ? 0.5 : 1234.56789 + static_cast<double>(step);
  for (std::size_t i = 0; i < names.size(); ++i) {
    for (bool forward : {true, false}) {
      LayerRecord l;
      l.layer = names[i];
      l.forward = forward;
      if (!forward) l.parameter = names[i];
      l.stats = torchdbg::compute_stats(
          torch::tensor({1.0 / 3.0, static_cast<double>(i) + 0.123456789, -7.25}));
      r.layers.push_back(l);
    }
  }
  return r;
}

}  // namespace

TEST_CASE("CSV: appending after a cut at any byte keeps every complete record and only those",
          "[exporters]") {
  // A real exporter file with hostile names is cut at every byte offset, reopened with
  // truncate(false) and given one more step; an independent RFC 4180 reader then checks that
  // the file is the records complete before the cut, unchanged, and the new step's.
  const std::string dir = torchdbg_test::tmp_dir("csv_cut_everywhere");
  const std::string ref_path = dir + "/ref.csv";
  const auto names = hostile_names();
  {
    torchdbg::CsvExporter x(ref_path);
    x.write_step(hostile_step(0, names));
    x.write_step(hostile_step(1, {"x"}));
  }
  const std::string full = slurp(ref_path);
  std::vector<CsvRecord> ref;
  std::string error;
  REQUIRE(parse_csv(full, ref, error));
  REQUIRE(ref.size() == 1 + 2 * names.size() + 2);
  std::vector<std::string> header;
  {
    std::vector<CsvRecord> h;
    REQUIRE(parse_csv(std::string(torchdbg::CsvExporter::kHeader) + "\n", h, error));
    header = h[0].fields;
  }
  REQUIRE(header.size() == torchdbg::CsvExporter::kColumns);
  REQUIRE(ref[0].fields == header);

  const std::vector<std::string> appended_names = {"app\"end\ned,", "z"};
  const std::string path = dir + "/cut.csv";
  std::size_t bad = 0;
  std::string first_bad;
  for (std::size_t cut = 0; cut <= full.size(); ++cut) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << full.substr(0, cut);
    std::size_t torn = 0;
    {
      torchdbg::CsvExporter x(path, torchdbg::StreamOptions().truncate(false));
      torn = x.torn_bytes_removed();
      x.write_step(hostile_step(999999, appended_names));
    }
    const std::string text = slurp(path);
    std::size_t kept = 0;  // records complete before the cut
    while (kept < ref.size() && ref[kept].end <= cut) ++kept;
    const std::size_t keep_bytes = kept == 0 ? 0 : ref[kept - 1].end;
    std::string problem;
    std::vector<CsvRecord> got;
    if (!parse_csv(text, got, error)) {
      problem = error;
    } else if (torn != cut - keep_bytes) {
      problem = "torn_bytes_removed " + std::to_string(torn) + ", expected " +
                std::to_string(cut - keep_bytes);
    } else if (text.compare(0, keep_bytes, full, 0, keep_bytes) != 0) {
      problem = "the complete records before the cut changed";
    } else {
      const std::size_t head = kept == 0 ? 1 : kept;  // a file left empty gets its header
      std::size_t headers = 0;
      for (const auto& rec : got) {
        if (rec.fields.size() != header.size())
          problem = "a record of " + std::to_string(rec.fields.size()) + " fields";
        if (rec.fields == header) ++headers;
      }
      if (got.size() != head + 2 * appended_names.size()) {
        problem = std::to_string(got.size()) + " records, expected " +
                  std::to_string(head + 2 * appended_names.size());
      } else if (headers != 1 || got[0].fields != header) {
        problem = "the header is not first exactly once";
      } else {
        for (std::size_t i = 1; i < kept; ++i)
          if (got[i].fields != ref[i].fields) problem = "record " + std::to_string(i) + " changed";
        for (std::size_t i = 0; i < 2 * appended_names.size(); ++i) {
          const auto& f = got[head + i].fields;
          const bool forward = i % 2 == 0;
          const std::string& name = appended_names[i / 2];
          if (f[0] != "999999" || f[1] != name || f[2] != (forward ? "forward" : "backward") ||
              f[3] != (forward ? "" : name) || f[14] != "0.5")
            problem = "appended record " + std::to_string(i) + " is not intact";
        }
      }
    }
    if (!problem.empty() && bad++ == 0) {
      first_bad = "cut at byte " + std::to_string(cut) + " of " + std::to_string(full.size()) +
                  ": " + problem + "\n  file before reopening ends: \"" +
                  escaped(full.substr(cut > 80 ? cut - 80 : 0, std::min<std::size_t>(cut, 80))) +
                  "\"\n  file after appending ends: \"" +
                  escaped(text.substr(text.size() > 400 ? text.size() - 400 : 0)) + "\"";
    }
  }
  INFO(bad << " of " << full.size() + 1 << " cuts broke the file; the first:\n" << first_bad);
  CHECK(bad == 0);
}

TEST_CASE(
    "CSV: appending cuts a record torn after a quoted newline, inside a number or inside the "
    "header",
    "[exporters]") {
  const std::string dir = torchdbg_test::tmp_dir("csv_torn_cases");
  const std::string path = dir + "/run.csv";
  const auto reopen_and_append = [&](const std::string& content) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
    std::size_t torn = 0;
    {
      torchdbg::CsvExporter x(path, torchdbg::StreamOptions().truncate(false));
      torn = x.torn_bytes_removed();
      x.write_step(hostile_step(2, {"fc3"}));
    }
    return torn;
  };
  {
    torchdbg::CsvExporter x(path);
    x.write_step(hostile_step(0, {"fc1"}));
    x.write_step(hostile_step(1, {"block\nfc2"}));
  }
  const std::string whole = slurp(path);
  REQUIRE(whole.back() == '\n');
  std::vector<CsvRecord> recs;
  std::string error;
  REQUIRE(parse_csv(whole, recs, error));
  REQUIRE(recs.size() == 5);
  const std::size_t before_last = recs[3].end;
  SECTION("a record whose quoted name holds a newline, with only its final newline lost") {
    CHECK(reopen_and_append(whole.substr(0, whole.size() - 1)) == whole.size() - 1 - before_last);
  }
  SECTION("a record cut inside its last number, its field count whole") {
    const std::string cut = whole.substr(0, whole.size() - 6);  // "...,1235." of 1235.56789
    REQUIRE(torchdbg::CsvExporter::fields(cut.substr(before_last)) ==
            torchdbg::CsvExporter::kColumns);
    CHECK(reopen_and_append(cut) == cut.size() - before_last);
  }
  SECTION("a record cut just after the newline inside its quoted name") {
    const std::string cut = whole.substr(0, whole.find("block\n", before_last) + 6);
    CHECK(reopen_and_append(cut) == cut.size() - before_last);
  }
  const std::string text = slurp(path);
  REQUIRE(parse_csv(text, recs, error));
  REQUIRE(recs.size() == 4 + 2);
  CHECK(text.substr(0, before_last) == whole.substr(0, before_last));
  CHECK(recs[4].fields[0] == "2");
  CHECK(recs[4].fields[1] == "fc3");
}

TEST_CASE("CSV: a file holding only a torn header gets a whole header before the appended rows",
          "[exporters]") {
  const std::string dir = torchdbg_test::tmp_dir("csv_torn_header");
  const std::string path = dir + "/run.csv";
  const std::string header = torchdbg::CsvExporter::kHeader;
  for (const std::string& content : {header.substr(0, 16), header}) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
    {
      torchdbg::CsvExporter x(path, torchdbg::StreamOptions().truncate(false));
      CHECK(x.torn_bytes_removed() == content.size());
      x.write_step(hostile_step(0, {"fc1"}));
    }
    const auto lines = read_lines(path);
    REQUIRE(lines.size() == 3);
    CHECK(lines[0] == header);
    CHECK(lines[1].rfind("0,fc1,forward,", 0) == 0);
  }
}

TEST_CASE("JSONL: appending after a cut at any byte keeps every complete line and only those",
          "[exporters]") {
  // JSONL records never span lines: a cut line is torn unless only its newline was lost.
  const std::string dir = torchdbg_test::tmp_dir("jsonl_cut_everywhere");
  const std::string ref_path = dir + "/ref.jsonl";
  {
    torchdbg::JsonlExporter x(ref_path);
    x.write_step(hostile_step(0, {"block\nfc2", "quo\"te,", "\xc3\xa9t\xc3\xa9"}));
  }
  const std::string full = slurp(ref_path);
  REQUIRE(full.back() == '\n');
  const std::string path = dir + "/cut.jsonl";
  std::size_t bad = 0;
  std::string first_bad;
  for (std::size_t cut = 0; cut <= full.size(); ++cut) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << full.substr(0, cut);
    {
      torchdbg::JsonlExporter x(path, torchdbg::StreamOptions().truncate(false));
      x.write_step(hostile_step(999999, {"app\"end\ned,"}));
    }
    const std::string text = slurp(path);
    // Kept: the lines ended before the cut, and the one whose newline alone was cut.
    std::size_t keep = 0;
    if (cut < full.size() && full[cut] == '\n') {
      keep = cut + 1;
    } else if (cut > 0) {
      const auto nl = full.rfind('\n', cut - 1);
      keep = nl == std::string::npos ? 0 : nl + 1;
    }
    std::string problem;
    if (text.compare(0, keep, full, 0, keep) != 0)
      problem = "the complete lines before the cut changed";
    std::size_t lines = 0, appended = 0;
    for (std::size_t pos = 0; pos < text.size();) {
      const auto nl = text.find('\n', pos);
      if (nl == std::string::npos) {
        problem = "last line has no newline";
        break;
      }
      const std::string line = text.substr(pos, nl - pos);
      if (!nlohmann::json::accept(line))
        problem = "line " + std::to_string(lines) + " does not parse";
      else if (pos >= keep && nlohmann::json::parse(line).value("step", int64_t{-1}) == 999999)
        ++appended;
      ++lines;
      pos = nl + 1;
    }
    const auto full_lines = static_cast<std::size_t>(
        std::count(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(keep), '\n'));
    if (problem.empty() && (appended != 1 + 2 || lines != full_lines + appended))
      problem = std::to_string(lines) + " lines, " + std::to_string(appended) + " appended";
    if (!problem.empty() && bad++ == 0)
      first_bad = "cut at byte " + std::to_string(cut) + ": " + problem +
                  "\n  file after appending ends: \"" +
                  escaped(text.substr(text.size() > 400 ? text.size() - 400 : 0)) + "\"";
  }
  INFO(bad << " of " << full.size() + 1 << " cuts broke the file; the first:\n" << first_bad);
  CHECK(bad == 0);
}

TEST_CASE("HTML: steps at the ends of int64 and steps going backwards stay in range", "[exporters]") {
  const std::string dir = torchdbg_test::tmp_dir("html_steps");
  for (const auto& steps : std::vector<std::vector<int64_t>>{
           {std::numeric_limits<int64_t>::min(), -5, 0, std::numeric_limits<int64_t>::max()},
           {std::numeric_limits<int64_t>::max() - 2, std::numeric_limits<int64_t>::max()},
           {100, 50, 10, 200, 0},
           {std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::min() + 1}}) {
    torchdbg::HtmlExporter html(dir + "/r.html", torchdbg::HtmlOptions().heatmap_columns(2));
    for (int64_t s : steps) CHECK_NOTHROW(html.write_step(make_step(s, 2, s == 0)));
    const std::string page = html.render();
    CHECK(page.find("id=\"health-heatmap\"") != std::string::npos);
  }
}

TEST_CASE("streams never block: a FIFO without a reader is refused, a slow or vanished reader costs lines, not the loop",
          "[exporters]") {
  const std::string dir = torchdbg_test::tmp_dir("fifo");
  const std::string fifo = dir + "/run.jsonl";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const auto started = std::chrono::steady_clock::now();
  const auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  };
  // No reader: open would wait for one; the exporter refuses at once and says why.
  CHECK_THROWS_WITH(torchdbg::JsonlExporter(fifo), Catch::Contains("FIFO") && Catch::Contains("no reader") &&
                                                       Catch::Contains(fifo));
  CHECK_THROWS_WITH(torchdbg::CsvExporter(fifo), Catch::Contains("no reader"));
  CHECK(seconds() < 5.0);

  // A reader that reads nothing yet: the pipe fills, flushes return at once, the buffer
  // stays bounded and drops whole lines (counted); what the reader gets parses line by line.
  const int rfd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  REQUIRE(rfd >= 0);
  uint64_t dropped = 0, failures = 0, pending = 0;
  {
    torchdbg::JsonlExporter x(fifo, torchdbg::StreamOptions().flush_every_steps(1).max_buffer_bytes(64 << 10));
    for (int64_t s = 0; s < 400; ++s) x.write_step(make_step(s, 8));  // ~2 MB: far past the pipe's 64 KiB
    CHECK(seconds() < 30.0);
    failures = x.failures();
    dropped = x.dropped_lines();
    pending = x.pending_lines();
    CHECK_THAT(x.last_error(), Catch::Contains("not keeping up"));
  }
  CHECK(failures > 0);
  CHECK(dropped > 0);
  std::string got;
  char buf[65536];
  for (ssize_t n; (n = ::read(rfd, buf, sizeof buf)) > 0;) got.append(buf, static_cast<std::size_t>(n));
  ::close(rfd);
  std::istringstream lines(got);
  int parsed = 0;
  for (std::string l; std::getline(lines, l); ++parsed) {
    INFO("line " << parsed << ": " << l.substr(0, 120));
    CHECK(nlohmann::json::accept(l));  // no line torn and joined to another
  }
  CHECK(parsed > 10);
  // Every line is accounted for: read, dropped (counted) or still pending when destroyed.
  CHECK(static_cast<uint64_t>(parsed) + dropped + pending == 400u * 25u);
  CHECK(pending > 0);
  CHECK(!got.empty());
  CHECK(got.back() == '\n');

  // The reader goes away: EPIPE is an error the exporter counts; no SIGPIPE kills the process.
  {
    const int r2 = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
    REQUIRE(r2 >= 0);
    torchdbg::JsonlExporter x(fifo, torchdbg::StreamOptions().flush_every_steps(1));
    ::close(r2);
    x.write_step(make_step(0, 2));
    CHECK(x.failures() == 1);
    CHECK_THAT(x.last_error(), Catch::Contains("reader has gone"));
  }
  CHECK(seconds() < 60.0);
}

TEST_CASE("atomic writes follow a symbolic link and refuse a FIFO or device instead of replacing it",
          "[exporters]") {
  const std::string dir = torchdbg_test::tmp_dir("atomic_kinds");
  const std::string target = dir + "/real.json", link = dir + "/link.json", fifo = dir + "/fifo.json";
  torchdbg::detail::atomic_write_file(target, "old", 3);
  REQUIRE(::symlink(target.c_str(), link.c_str()) == 0);
  torchdbg::detail::atomic_write_file(link, "new", 3);
  CHECK(std::filesystem::is_symlink(link));  // the link stays a link
  CHECK(slurp(target) == "new");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH(torchdbg::detail::atomic_write_file(fifo, "x", 1),
                    Catch::Contains("a FIFO") && Catch::Contains(fifo));
  CHECK(std::filesystem::is_fifo(fifo));
  CHECK_THROWS_WITH(torchdbg::detail::atomic_write_file(dir, "x", 1), Catch::Contains("a directory"));
  if (access("/dev/null", W_OK) == 0)
    CHECK_THROWS_WITH(torchdbg::detail::atomic_write_file("/dev/null", "x", 1), Catch::Contains("character device"));
  CHECK(std::filesystem::is_character_file("/dev/null"));
}

TEST_CASE("atomic writes through a dangling link create the file it names", "[exporters]") {
  const std::string dir = torchdbg_test::tmp_dir("atomic_dangling");
  std::filesystem::create_directories(dir + "/sub");
  REQUIRE(::symlink("sub/missing.json", (dir + "/dangling.json").c_str()) == 0);
  torchdbg::detail::atomic_write_file(dir + "/dangling.json", "made", 4);
  CHECK(std::filesystem::is_symlink(dir + "/dangling.json"));
  CHECK(slurp(dir + "/sub/missing.json") == "made");
  REQUIRE(::symlink("loop.json", (dir + "/loop.json").c_str()) == 0);
  CHECK_THROWS_WITH(torchdbg::detail::atomic_write_file(dir + "/loop.json", "x", 1), Catch::Contains("symbolic links"));
}
