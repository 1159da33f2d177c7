#!/usr/bin/env bash
# The npm-based toolchain of a policy folder: Node.js >= 20 (Debian's package, only when
# there is no node at all) and the folder's package-lock.json installed with `npm ci`
# into its node_modules, skipped when that is what is there already.
#
#   npm-setup.sh DIR PACKAGE VERSION SENTINEL
#
# PACKAGE@VERSION is the pinned tool (checked in node_modules); SENTINEL is a file under
# node_modules that an interrupted install would lack. Sourced by slab/ and tracker/.
set -euo pipefail

dir=$1 package=$2 version=$3 sentinel=$4

node_major() {
  node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0
}

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "setup: installing nodejs and npm (Debian packages)" >&2
  $SUDO apt-get install -y --no-install-recommends nodejs npm >/dev/null ||
    { $SUDO apt-get update -qq && $SUDO apt-get install -y --no-install-recommends nodejs npm >/dev/null; }
fi
# Debian 12's own nodejs is 18: use a newer one (e.g. NodeSource's package), then run
# this again.
if [ "$(node_major)" -lt 20 ]; then
  echo "setup: node $(node --version) is too old: $package $version needs Node.js >= 20" >&2
  exit 1
fi

installed() {
  local lock="$dir/node_modules/.package-lock.json"
  [ -f "$lock" ] && [ "$lock" -nt "$dir/package-lock.json" ] &&
    grep -q "\"version\": \"$version\"" "$dir/node_modules/$package/package.json" 2>/dev/null &&
    [ -f "$dir/node_modules/$sentinel" ]
}
if ! installed; then
  echo "setup: npm ci in $dir" >&2
  (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
fi
