#!/usr/bin/env bash
# Installs the toolchain of this AssemblyScript policy: assemblyscript 0.28.20 (with the
# binaryen.js it pins), the versions allocbox's own AssemblyScript policy is built with,
# into node_modules here with `npm ci` (package-lock.json). Needs Node.js >= 20 and npm;
# Debian 12's own nodejs is 18, too old. Idempotent: returns at once when installed.
set -euo pipefail

VERSION=0.28.20
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "setup: install Node.js >= 20 and npm first (e.g. NodeSource's nodejs package)" >&2
    exit 1
fi
major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$major" -lt 20 ]; then
    echo "setup: node $(node --version) is too old: assemblyscript $VERSION needs Node.js >= 20" >&2
    exit 1
fi
if grep -qs "\"version\": \"$VERSION\"" "$HERE/node_modules/assemblyscript/package.json" &&
    [ -f "$HERE/node_modules/binaryen/index.js" ]; then
    exit 0
fi
(cd "$HERE" && npm ci --no-audit --no-fund --loglevel=error)
