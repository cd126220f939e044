// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <torchdbg/snapshot.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>

#include "helpers.hpp"


TEST_CASE("file names carry the sanitised layer name, step and direction", "[snapshot]") {
  CHECK(torchdbg::sanitize_file_component("encoder.0/fc1") == "encoder.0_fc1");
  CHECK(torchdbg::sanitize_file_component("a b:c*?<>|\\") == "a_b_c______");
  CHECK(torchdbg::sanitize_file_component("") == "_");
  CHECK(torchdbg::sanitize_file_component("..") == "_..");
  CHECK(torchdbg::snapshot_file_name("fc1/relu", 40, true) == "fc1_relu_step40_fwd.pt");
  CHECK(torchdbg::snapshot_file_name("fc1", 3, false) == "fc1_step3_grad.pt");
}

TEST_CASE("snapshots round-trip every dtype, shape and stride", "[snapshot]") {
  torchdbg_test::SeededRng rng(31);
  const auto dir = torchdbg_test::tmp_dir("snap_roundtrip");
  const std::vector<torch::Tensor> tensors = {
      torch::randn({3, 4}),
      torch::randn({5}, torch::kDouble).to(torch::kHalf),
      torch::randn({2, 2}).to(torch::kBFloat16),
      torch::arange(10, torch::kLong),
      torch::randn({6, 8}).t(),  // non-contiguous
      torch::tensor(3.5),        // 0-d
      torch::empty({0, 3}),
      torch::tensor({1.0, std::nan(""), std::numeric_limits<double>::infinity()}),
  };
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto path = dir + "/t" + std::to_string(i) + ".pt";
    torchdbg::save_snapshot(tensors[i], path);
    const auto back = torchdbg::load_snapshot(path);
    INFO("tensor " << i);
    CHECK(back.scalar_type() == tensors[i].scalar_type());
    CHECK(back.sizes() == tensors[i].sizes());
    CHECK(torch::equal(back.isnan(), tensors[i].isnan()));
    CHECK(torch::equal(torch::nan_to_num(back), torch::nan_to_num(tensors[i])));
  }
}

TEST_CASE("a snapshot replaces the old file whole and leaves no temporary behind", "[snapshot]") {
  const auto dir = torchdbg_test::tmp_dir("snap_atomic");
  const auto path = dir + "/x.pt";
  torchdbg::save_snapshot(torch::zeros({4}), path);
  torchdbg::save_snapshot(torch::ones({1000}), path);
  CHECK(torchdbg::load_snapshot(path).numel() == 1000);
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    (void)e;
    ++files;
  }
  CHECK(files == 1);
}

TEST_CASE("snapshot errors name the path and keep the existing file", "[snapshot]") {
  const auto dir = torchdbg_test::tmp_dir("snap_errors");
  const auto path = dir + "/keep.pt";
  torchdbg::save_snapshot(torch::arange(3), path);
  CHECK_THROWS_WITH(torchdbg::save_snapshot(torch::ones({2}), dir + "/missing/x.pt"), Catch::Contains(dir + "/missing/x.pt"));
  CHECK_THROWS_AS(torchdbg::save_snapshot(torch::Tensor(), path), torchdbg::Error);
  CHECK(torch::equal(torchdbg::load_snapshot(path), torch::arange(3)));
  CHECK_THROWS_WITH(torchdbg::load_snapshot(dir + "/nope.pt"), Catch::Contains("nope.pt"));
  std::ofstream(dir + "/garbage.pt") << "not a pickle";
  CHECK_THROWS_WITH(torchdbg::load_snapshot(dir + "/garbage.pt"), Catch::Contains("not a tensor snapshot"));
  // A full disk: with RLIMIT_FSIZE below the snapshot's size the write fails (EFBIG), the
  // temporary is removed and the existing file stays whole.
  struct rlimit old_limit {};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_limit) == 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old_limit;
  small.rlim_cur = 4096;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  bool threw = false;
  std::string message;
  try {
    torchdbg::save_snapshot(torch::ones({100000}), path);
  } catch (const torchdbg::Error& e) {
    threw = true;
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  CHECK(threw);
  CHECK(message.find("keep.pt") != std::string::npos);
  CHECK(torch::equal(torchdbg::load_snapshot(path), torch::arange(3)));
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.path().string().find(".tmp.") != std::string::npos;
  CHECK(files == 0);
}

TEST_CASE("Python's torch.load reads a snapshot", "[snapshot]") {
  const std::string python = TORCHDBG_TEST_PYTHON;
  if (python.empty() || std::system((python + " -c 'import torch' 2>/dev/null").c_str()) != 0) {
    WARN("no Python with torch (set TORCHDBG_TEST_PYTHON): skipped");
    return;
  }
  const auto dir = torchdbg_test::tmp_dir("snap_python");
  const auto path = dir + "/p.pt";
  torchdbg::save_snapshot(torch::arange(6, torch::kFloat).reshape({2, 3}) * 0.5, path);
  const std::string cmd = python + " -c \"import torch,sys; t=torch.load('" + path +
                          "'); sys.exit(0 if t.shape==(2,3) and t.dtype==torch.float32 and float(t.sum())==7.5 else 1)\"";
  CHECK(std::system(cmd.c_str()) == 0);
}

TEST_CASE("a writer killed with SIGKILL leaves the old or the new complete snapshot", "[snapshot]") {
  const auto dir = torchdbg_test::tmp_dir("snap_kill");
  const auto path = dir + "/x.pt";
  torchdbg::save_snapshot(torch::zeros({1 << 20}), path);  // the old complete file
  for (int attempt = 0; attempt < 5; ++attempt) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {  // child: rewrite the snapshot as fast as it can until killed
      for (int i = 1;; ++i) torchdbg::save_snapshot(torch::full({1 << 20}, static_cast<float>(i)), path);
    }
    ::usleep(static_cast<useconds_t>(20000 + 15000 * attempt));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status));
    const auto t = torchdbg::load_snapshot(path);  // never a partial file
    REQUIRE(t.numel() == (1 << 20));
    CHECK(torch::equal(t, torch::full({1 << 20}, t[0].item<float>())));
  }
}

TEST_CASE("damaged snapshots are refused with torchdbg::Error, never a crash or a huge allocation", "[snapshot]") {
  const std::string dir = torchdbg_test::tmp_dir("snapshot_damage");
  const std::string good = dir + "/good.pt";
  torchdbg::save_snapshot(torch::arange(200, torch::kFloat), good);
  std::ifstream in(good, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE(bytes.size() > 1000);
  // Offsets overwritten with 1 or 4 bytes of 0xFF / 0x00: every offset of the last 256 bytes
  // (the zip's central directory and end record, whose damage crashed LibTorch's reader) and
  // every 16th before (local headers, the pickle, the data). Each load returns a tensor of at
  // most the file's size or throws torchdbg::Error naming the file.
  const std::string bad = dir + "/bad.pt";
  int64_t refused = 0, loaded = 0;
  for (std::size_t i = 0; i < bytes.size(); i += i + 256 < bytes.size() ? 16 : 1) {
    for (std::size_t w : {std::size_t{1}, std::size_t{4}}) {
      for (unsigned char v : {0xFF, 0x00}) {
        std::string b = bytes;
        for (std::size_t k = 0; k < w && i + k < b.size(); ++k) b[i + k] = static_cast<char>(v);
        std::ofstream(bad, std::ios::binary | std::ios::trunc) << b;
        try {
          const auto t = torchdbg::load_snapshot(bad);
          CHECK(t.nbytes() <= b.size());
          ++loaded;
        } catch (const torchdbg::Error& e) {
          if (std::string(e.what()).find(bad) == std::string::npos) FAIL("error without the path: " << e.what());
          ++refused;
        }
      }
    }
  }
  CHECK(refused > 500);
  CHECK(loaded > 0);  // bytes inside the data or names change values, not the structure
  // Truncated at every length.
  for (std::size_t len = 0; len < bytes.size(); len += 31) {
    std::ofstream(bad, std::ios::binary | std::ios::trunc) << bytes.substr(0, len);
    CHECK_THROWS_AS(torchdbg::load_snapshot(bad), torchdbg::Error);
  }
  // The undamaged file still loads.
  CHECK(torchdbg::load_snapshot(good).equal(torch::arange(200, torch::kFloat)));
}

TEST_CASE("load_snapshot names the path for a directory or a missing file", "[snapshot]") {
  const std::string dir = torchdbg_test::tmp_dir("snapshot_dir");
  CHECK_THROWS_WITH(torchdbg::load_snapshot(dir), Catch::Contains(dir) && Catch::Contains("not a regular file"));
  CHECK_THROWS_WITH(torchdbg::load_snapshot(dir + "/none.pt"), Catch::Contains("none.pt") && Catch::Contains("no such file"));
}
