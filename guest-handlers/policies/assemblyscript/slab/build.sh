#!/usr/bin/env bash
# Builds the `slab` policy into the core module OUT (the host componentizes it on load).
# Usage: build.sh OUT
# Writes only OUT (and a temp dir it removes); exit 3 when the toolchain is missing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"
# Absolute: the build runs in this folder.
OUT=$(out_path "$@")

command -v node >/dev/null 2>&1 || missing node
[ -f "$HERE/node_modules/assemblyscript/bin/asc.js" ] || missing assemblyscript
[ -f "$HERE/node_modules/binaryen/index.js" ] || missing binaryen

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

cd "$HERE"
# --runtime stub: no garbage collector (the policy manages its own memory and allocates
# nothing through the runtime); --use abort=: no `env.abort` import, which the world
# does not provide; -Oz: smallest code.
node node_modules/assemblyscript/bin/asc.js assembly/slab.ts -o "$TMP/slab.wasm" \
  -Oz --runtime stub --use abort= --noAssert
# Exports get their canonical-ABI names (`allocbox:policy/allocator@0.2.0#malloc` ...).
node rename.mjs "$TMP/slab.wasm" "$TMP/out.wasm"
stamp_language "$TMP/out.wasm" AssemblyScript
deliver "$TMP/out.wasm" "$OUT"
