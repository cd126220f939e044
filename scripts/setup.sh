#!/usr/bin/env bash
# Installs what torchdbg's build, demo and tests need on Debian/Ubuntu, skipping what is
# already installed. Users with a LibTorch zip set CMAKE_PREFIX_PATH=/path/to/libtorch and
# libtorch-dev is not installed.
set -euo pipefail

# libre2-dev: RE2 runs the name patterns in linear time (pkg-config finds it).
pkgs=(cmake g++ ninja-build pkg-config libfmt-dev catch2 nlohmann-json3-dev libre2-dev libopenblas0-pthread)
# clang with its runtime: the libFuzzer target (ctest label "fuzz").
pkgs+=(clang libclang-rt-dev)
if [[ -z "${CMAKE_PREFIX_PATH:-}" ]]; then
  # libgloo-dev: the Gloo headers c10d's ProcessGroupGloo.hpp includes (distributed.hpp).
  pkgs+=(libtorch-dev libgloo-dev)
fi
# Debian's python3-torch: the test suite checks that snapshots load with Python's torch.load;
# python3-pandas: that the JSONL stream reads with pandas.read_json(lines=True).
pkgs+=(python3-torch python3-pandas)
# cpp-httplib: the live page's server (torchdbg/live.hpp).
pkgs+=(libcpp-httplib-dev)
# Headless Chromium: the HTML report and the live page are loaded in a real browser (ctest
# label "browser"; python3-websocket drives the live page over DevTools). Optional: when they
# cannot be installed the browser tests say SKIPPED and why.
optional=(chromium python3-websocket)

missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" >/dev/null; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "torchdbg setup: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null; then SUDO="sudo"; else
      echo "torchdbg setup: need root (or sudo) to install: ${missing[*]}" >&2
      exit 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

for p in "${optional[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" >/dev/null; then
    echo "torchdbg setup: installing $p (optional)"
    SUDO=""
    if [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null; then SUDO="sudo"; fi
    if ! { DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "$p" ||
           { $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "$p"; }; }; then
      echo "torchdbg setup: warning: could not install $p; the tests that need it will be skipped" >&2
    fi
  fi
done

# Without OpenBLAS, Debian's LibTorch falls back to reference BLAS (~27x slower steps).
if ! ldconfig -p | grep "libopenblas" >/dev/null; then  # not -q: with pipefail, SIGPIPE in ldconfig read as "missing"
  echo "torchdbg setup: warning: OpenBLAS not found by the dynamic linker" >&2
fi
