#!/usr/bin/env bash
# Renders the demo's HTML report with headless Chromium into docs/report.png, the picture in
# the README. Runs the demo first (scripts/demo.sh installs what is missing and builds it).
#   scripts/screenshot.sh [output.png]      (default: docs/report.png)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
png="$(realpath -m "${1:-$root/docs/report.png}")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$root/scripts/demo.sh" "$work/demo" >"$work/demo.log"
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
[[ -n "$browser" ]] || { echo "no chromium found (scripts/setup.sh installs Debian's chromium)" >&2; exit 1; }
"$browser" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run \
  --hide-scrollbars --virtual-time-budget=5000 --window-size=1200,1500 \
  --screenshot="$png" "file://$work/demo/report.html" 2>"$work/chromium.log" ||
  { cat "$work/chromium.log" >&2; exit 1; }
echo "$png"
