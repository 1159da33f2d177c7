#!/usr/bin/env bash
# Installs the toolchain of the JavaScript `tracker` policy: Node.js >= 20 (Debian
# package, only when missing) and the pinned npm packages of package-lock.json
# (@bytecodealliance/componentize-js 0.23.0, which brings the SpiderMonkey engine
# built for WebAssembly, Wizer and jco: about 385 MB) into this folder's node_modules.
# Idempotent, and quick when everything is there already.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CJS_VERSION="0.23.0"

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
# componentize-js 0.23 needs Node.js >= 20 (its parser, oxc-parser, says so; Debian
# 12's own nodejs is 18: use a newer one, e.g. NodeSource's package, then run this again).
if [ "$(node_major)" -lt 20 ]; then
  echo "setup: node $(node --version) is too old: componentize-js $CJS_VERSION needs Node.js >= 20" >&2
  exit 1
fi

# `npm ci` installs exactly the lockfile; skip it when that is what is there already.
installed() {
  local lock="$HERE/node_modules/.package-lock.json"
  [ -f "$lock" ] && [ "$lock" -nt "$HERE/package-lock.json" ] &&
    grep -q "\"version\": \"$CJS_VERSION\"" \
      "$HERE/node_modules/@bytecodealliance/componentize-js/package.json" 2>/dev/null &&
    [ -f "$HERE/node_modules/@bytecodealliance/componentize-js/lib/starlingmonkey_embedding.wasm" ]
}
if ! installed; then
  echo "setup: npm ci in $HERE" >&2
  (cd "$HERE" && npm ci --no-audit --no-fund --loglevel=error)
fi
