#!/usr/bin/env bash
# Installs the toolchain of this JavaScript policy: @bytecodealliance/componentize-js
# 0.23.0 (the SpiderMonkey engine built for WebAssembly, Wizer, and jco pinned to 1.15.1
# by `overrides`), the versions allocbox's own JavaScript policy is built with, into
# node_modules here with `npm ci` (package-lock.json; about 190 MB). Needs Node.js >= 20
# and npm; Debian 12's own nodejs is 18, too old. Idempotent: returns at once when
# installed.
set -euo pipefail

VERSION=0.23.0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "setup: install Node.js >= 20 and npm first (e.g. NodeSource's nodejs package)" >&2
    exit 1
fi
major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$major" -lt 20 ]; then
    echo "setup: node $(node --version) is too old: componentize-js $VERSION needs Node.js >= 20" >&2
    exit 1
fi
CJS="$HERE/node_modules/@bytecodealliance/componentize-js"
if grep -qs "\"version\": \"$VERSION\"" "$CJS/package.json" &&
    [ -f "$CJS/lib/starlingmonkey_embedding.wasm" ]; then
    exit 0
fi
(cd "$HERE" && npm ci --no-audit --no-fund --loglevel=error)
