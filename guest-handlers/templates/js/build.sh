#!/usr/bin/env bash
# Builds the policy_name policy: a component of the `allocbox:policy` world
# (wit/policy.wit), made by componentize-js from policy.js (the SpiderMonkey engine
# compiled to WebAssembly, with policy.js evaluated and snapshotted by Wizer; about
# 12 MB). build.mjs calls componentize-js's JS API.
#
#   ./build.sh [OUT]     # OUT defaults to policy_name.wasm in this folder
#
# Node.js >= 20 and componentize-js 0.23.0: this folder's node_modules (./setup.sh
# installs it), or the `tracker` policy's in the allocbox checkout that
# ALLOCBOX_TOOLCHAINS names. Exits 3 when neither has it. Writes only OUT (through a
# temporary directory). Takes 5-10 s. Two builds of the same source behave the same but
# differ in bytes (the snapshot keeps some of the build machine's state).
set -euo pipefail

VERSION=0.23.0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:-$HERE/policy_name.wasm}

if ! command -v node >/dev/null 2>&1; then
    echo "missing node: install Node.js >= 20, then run ./setup.sh" >&2
    exit 3
fi
MODULES=""
for candidate in "$HERE/node_modules" ${ALLOCBOX_TOOLCHAINS:+"$ALLOCBOX_TOOLCHAINS/guest-handlers/policies/js/tracker/node_modules"}; do
    CJS="$candidate/@bytecodealliance/componentize-js"
    if grep -qs "\"version\": \"$VERSION\"" "$CJS/package.json" &&
        [ -f "$CJS/lib/starlingmonkey_embedding.wasm" ]; then
        MODULES=$candidate
        break
    fi
done
if [ -z "$MODULES" ]; then
    echo "missing componentize-js $VERSION: run ./setup.sh (or set ALLOCBOX_TOOLCHAINS to an allocbox checkout whose .ci/setup has run)" >&2
    exit 3
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# build.mjs imports componentize-js, which node finds in the node_modules next to the
# script: run a copy beside a link to the toolchain, on a copy of the source. The
# temporary directory is componentize-js's TMPDIR too: its scratch files go there and
# are removed with it.
mkdir -p "$TMP/src"
cp "$HERE/build.mjs" "$TMP/build.mjs"
ln -s "$MODULES" "$TMP/node_modules"
cp "$HERE/policy.js" "$TMP/src/policy.js"
(cd "$TMP/src" && TMPDIR="$TMP" node "$TMP/build.mjs" policy.js "$HERE/wit" "$TMP/out.wasm")

# componentize-js records `language = JavaScript` itself: `allocbox inspect` shows it.
mkdir -p "$(dirname "$OUT")"
mv -f "$TMP/out.wasm" "$OUT"
