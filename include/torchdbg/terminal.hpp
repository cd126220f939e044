// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Terminal output: a per-layer table of the latest statistics and health, coloured when the
// stream is a terminal, and a one-line training progress report.

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "torchdbg/health.hpp"

namespace torchdbg {

enum class ColorMode { Auto, Always, Never };

namespace detail {

inline bool use_color(ColorMode mode, std::FILE* stream) {
  if (mode == ColorMode::Always) return true;
  if (mode == ColorMode::Never || stream == nullptr) return false;
  return ::isatty(::fileno(stream)) != 0 && std::getenv("NO_COLOR") == nullptr;
}

inline std::string paint(const std::string& text, std::string_view state, bool color) {
  if (!color) return text;
  const char* code = "32";  // green
  if (state == "saturated" || state == "vanishing" || state == "anomalous" || state == "plateau")
    code = "33";
  if (state == "dead") code = "35";
  if (state == "exploding" || state == "non_finite" || state == "diverging" || state == "spike")
    code = "31;1";
  if (state == "-") code = "2";
  return fmt::format("\033[{}m{}\033[0m", code, text);
}

inline std::string cell(double v, const char* spec = "{:.3g}") {
  return std::isfinite(v) ? fmt::format(fmt::runtime(spec), v) : std::string("-");
}

}  // namespace detail

/// A table of every layer's latest health and statistics, in forward order.
///
/// ```cpp
/// std::fputs(torchdbg::health_table(health.layers(), torchdbg::ColorMode::Auto, stdout).c_str(),
/// stdout);
/// ```
inline std::string health_table(const std::vector<LayerHealth>& layers,
                                ColorMode mode = ColorMode::Auto, std::FILE* stream = stdout) {
  const bool color = detail::use_color(mode, stream);
  std::size_t w = 5;
  for (const auto& l : layers) w = std::max(w, l.name.size());
  w = std::min<std::size_t>(w, 48);
  std::string out =
      fmt::format("{:<{}}  {:<10} {:>9} {:>8} {:>6} {:>6}  {:<10} {:>10}\n", "layer", w,
                  "activation", "rms", "gain", "sat%", "dead%", "gradient", "grad norm");
  for (const auto& l : layers) {
    const std::string name = l.name.size() > w ? l.name.substr(0, w - 1) + "~" : l.name;
    const std::string act = l.has_activation ? to_string(l.activation) : "-";
    const std::string grad = l.has_gradient ? to_string(l.gradient) : "-";
    out += fmt::format("{:<{}}  {} {:>9} {:>8} {:>6} {:>6}  {} {:>10}\n", name, w,
                       detail::paint(fmt::format("{:<10}", act), act, color), detail::cell(l.rms),
                       detail::cell(l.gain), detail::cell(l.saturated_fraction * 100, "{:.1f}"),
                       detail::cell(l.dead_fraction * 100, "{:.1f}"),
                       detail::paint(fmt::format("{:<10}", grad), grad, color),
                       detail::cell(l.gradient_norm));
  }
  return out;
}

/// "step   120/400  loss 0.4312  alerts 3  alarms 1" (the loss coloured by its health).
inline std::string progress_line(int64_t step, int64_t total, std::optional<double> loss,
                                 uint64_t alerts, uint64_t alarms,
                                 LossHealth loss_health = LossHealth::Healthy,
                                 ColorMode mode = ColorMode::Auto, std::FILE* stream = stdout) {
  const bool color = detail::use_color(mode, stream);
  const int width = static_cast<int>(std::to_string(std::max<int64_t>(total, 1)).size());
  const std::string l = loss ? fmt::format("{:.4g}", *loss) : std::string("-");
  return fmt::format("step {:>{}}/{}  loss {}  alerts {}  alarms {}", step, width, total,
                     detail::paint(l, to_string(loss_health), color), alerts, alarms);
}

}  // namespace torchdbg
