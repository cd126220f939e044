#!/usr/bin/env bash
# The tests against LibTorch 2.x: Debian trixie's libtorch-dev (LibTorch 2.6 with GCC 14,
# Catch2 3, fmt 10 and nlohmann_json 3.11) in a chroot made with debootstrap. Makes the root
# once (TORCHDBG_TRIXIE_ROOT, default /var/tmp/torchdbg-trixie) and reuses it, then runs this
# checkout's own scripts/test.sh inside it, which installs what is missing there and builds in
# build-libtorch2/ (TORCHDBG_LIBTORCH2_BUILD_DIR changes it). Arguments go to ctest. The header
# check (every public header compiled on its own), the ThreadSanitizer run of the concurrency
# tests (torchdbg's own locking; LibTorch is not instrumented), the statistics tests on the
# scalar kernel and the libFuzzer run of the path grammar are left to the 1.13 build unless
# TORCHDBG_HEADER_CHECK=ON / TORCHDBG_TSAN_TESTS=ON / TORCHDBG_SCALAR_TESTS=ON /
# TORCHDBG_FUZZ_TESTS=ON; the 2.6 suite still runs the concurrency tests under ASan/UBSan.
#   scripts/test-libtorch2.sh --exec CMD ARGS...   runs CMD from the checkout inside the root
#   instead (e.g. build-libtorch2/bench/torchdbg_bench once a test run has built it).
# Needs root (debootstrap, mount, chroot) and about 5 GB of disk for the root.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${TORCHDBG_TRIXIE_ROOT:-/var/tmp/torchdbg-trixie}"
build="${TORCHDBG_LIBTORCH2_BUILD_DIR:-$repo/build-libtorch2}"
mirror="${TORCHDBG_TRIXIE_MIRROR:-}"  # empty: debootstrap's default Debian mirror

if [[ -n "${TORCHDBG_IN_NAMESPACE:-}" ]]; then
  # Second half, in a private mount namespace: the mounts vanish with it, however it ends.
  unset TORCHDBG_IN_NAMESPACE
  mount -t proc proc "$target/proc"
  mount -t sysfs sys "$target/sys"
  mount --rbind /dev "$target/dev"
  mkdir -p "$target$repo"
  mount --bind "$repo" "$target$repo"
  env=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
       TERM="${TERM:-dumb}" CI="${CI:-}" TORCHDBG_BUILD_DIR="$build"
       TORCHDBG_HEADER_CHECK="${TORCHDBG_HEADER_CHECK:-OFF}"
       TORCHDBG_TSAN_TESTS="${TORCHDBG_TSAN_TESTS:-OFF}"
       TORCHDBG_SCALAR_TESTS="${TORCHDBG_SCALAR_TESTS:-OFF}"
       TORCHDBG_FUZZ_TESTS="${TORCHDBG_FUZZ_TESTS:-OFF}"
       CMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}")
  cd "$repo"
  if [[ "${1:-}" == "--exec" ]]; then
    shift
    exec chroot "$target" /usr/bin/env -i "${env[@]}" bash -c 'cd "$0" && exec "$@"' "$repo" "$@"
  fi
  echo "torchdbg test-libtorch2: $(. "$target/etc/os-release"; echo "$PRETTY_NAME")"
  exec chroot "$target" /usr/bin/env -i "${env[@]}" "$repo/scripts/test.sh" "$@"
fi

if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null; then
    exec sudo --preserve-env=TORCHDBG_TRIXIE_ROOT,TORCHDBG_LIBTORCH2_BUILD_DIR,TORCHDBG_TRIXIE_MIRROR "$0" "$@"
  fi
  echo "torchdbg test-libtorch2: needs root (debootstrap, mount, chroot)" >&2
  exit 1
fi
case "$build" in
  "$repo"/*) ;;
  *) echo "torchdbg test-libtorch2: the build directory must be inside the checkout: $build" >&2; exit 1 ;;
esac
if [[ "${1:-}" == "--exec" && $# -lt 2 ]]; then
  echo "torchdbg test-libtorch2: --exec needs a command" >&2
  exit 2
fi

for tool in debootstrap unshare; do
  if ! command -v "$tool" >/dev/null; then
    echo "torchdbg test-libtorch2: installing $tool"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$tool" ||
      { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$tool"; }
  fi
done

mkdir -p "$(dirname "$target")"
exec 9>"$target.lock"
flock 9  # one run at a time per root

# The root is made in a side directory and moved into place once complete, so a killed
# debootstrap never leaves a half-made root that a later run would trust.
if [[ ! -f "$target/.torchdbg-root" ]]; then
  echo "torchdbg test-libtorch2: making a Debian trixie root in $target (about a minute)"
  rm -rf "$target.partial" "$target"
  debootstrap --variant=minbase --include=ca-certificates trixie "$target.partial" ${mirror:+"$mirror"}
  touch "$target.partial/.torchdbg-root"
  mv "$target.partial" "$target"
fi
cp -L /etc/resolv.conf "$target/etc/resolv.conf"

TORCHDBG_IN_NAMESPACE=1 exec unshare --mount --propagation private "$0" "$@"
