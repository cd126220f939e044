#!/usr/bin/env bash
# The tests against LibTorch 2.x: Debian trixie's libtorch-dev (LibTorch 2.6 with GCC 14,
# Catch2 3, fmt 10 and nlohmann_json 3.11) in a chroot made with debootstrap. Makes the root
# once (TORCHDBG_TRIXIE_ROOT, default /var/tmp/torchdbg-trixie) and reuses it, then runs this
# checkout's own scripts/test.sh inside it, which installs what is missing there and builds in
# build-libtorch2/ (TORCHDBG_LIBTORCH2_BUILD_DIR changes it). Arguments go to ctest.
# Needs root (debootstrap, mount, chroot) and about 5 GB of disk for the root.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${TORCHDBG_TRIXIE_ROOT:-/var/tmp/torchdbg-trixie}"
build="${TORCHDBG_LIBTORCH2_BUILD_DIR:-$repo/build-libtorch2}"
mirror="${TORCHDBG_TRIXIE_MIRROR:-}"  # empty: debootstrap's default Debian mirror

if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null; then exec sudo --preserve-env=TORCHDBG_TRIXIE_ROOT,TORCHDBG_LIBTORCH2_BUILD_DIR,TORCHDBG_TRIXIE_MIRROR "$0" "$@"; fi
  echo "torchdbg test-libtorch2: needs root (debootstrap, mount, chroot)" >&2
  exit 1
fi
case "$build" in
  "$repo"/*) ;;
  *) echo "torchdbg test-libtorch2: the build directory must be inside the checkout: $build" >&2; exit 1 ;;
esac

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

# The mounts live in a private mount namespace: they disappear with the run, however it ends.
export TORCHDBG_CHROOT="$target" TORCHDBG_REPO="$repo" TORCHDBG_BUILD="$build"
exec unshare --mount --propagation private bash -s -- "$@" <<'EOF'
set -euo pipefail
r="$TORCHDBG_CHROOT"
mount -t proc proc "$r/proc"
mount -t sysfs sys "$r/sys"
mount --rbind /dev "$r/dev"
mkdir -p "$r$TORCHDBG_REPO"
mount --bind "$TORCHDBG_REPO" "$r$TORCHDBG_REPO"
exec chroot "$r" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" CI="${CI:-}" \
  TORCHDBG_BUILD_DIR="$TORCHDBG_BUILD" CMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}" \
  bash -c 'echo "torchdbg test-libtorch2: $(. /etc/os-release; echo "$PRETTY_NAME")"; exec "$0"/scripts/test.sh "$@"' "$TORCHDBG_REPO" "$@"
EOF
