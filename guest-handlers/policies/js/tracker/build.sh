#!/usr/bin/env bash
# Builds the JavaScript `tracker` policy into the component OUT: the SpiderMonkey
# engine (StarlingMonkey, compiled to WebAssembly) with tracker.js evaluated and its
# heap snapshotted by Wizer, bound to the 0.2.0 world in wit/0.2.0/ by componentize-js.
#
#   guest-handlers/policies/js/tracker/build.sh OUT.wasm
#
# Writes only OUT, a temporary directory and this folder's gitignored build/cache/
# (the last component built, named by a hash of everything it was built from).
# Exit 3 when the toolchain is missing.
#
# Reproducibility: componentize-js 0.23 runs the engine's start-up under Wizer with
# the build machine's WASI (its randomness and clocks, and the paths of its scratch
# directories end up in the snapshot too), and has no option to fix them. So two
# fresh builds of the same sources behave the same but differ in bytes. To give the
# same bytes for the same sources, a build whose inputs (tracker.js, the build
# scripts, the WIT, the lockfile) hash to the cached one copies that component instead
# of building again. BUILD_NO_CACHE=1 forces a fresh build.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"
OUT=$(out_path "$@")

command -v node >/dev/null 2>&1 || missing node
CJS="$HERE/node_modules/@bytecodealliance/componentize-js"
[ -f "$CJS/src/componentize.js" ] || missing componentize-js
[ -f "$CJS/lib/starlingmonkey_embedding.wasm" ] || missing componentize-js

CACHE="$HERE/build/cache"
mkdir -p "$CACHE"
key=$(cat "$HERE/tracker.js" "$HERE/build.mjs" "$HERE/build.sh" "$HERE/package-lock.json" \
  "$ROOT"/wit/0.2.0/*.wit | sha256sum | cut -c1-16)
cached="$CACHE/tracker-$key.wasm"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if [ -f "$cached" ] && [ "${BUILD_NO_CACHE:-0}" != 1 ]; then
  cp "$cached" "$TMP/out.wasm"
else
  # Built from a copy in the temporary directory, which is also componentize-js's
  # TMPDIR: its scratch files go there and are removed with it.
  mkdir -p "$TMP/src"
  cp "$HERE/tracker.js" "$TMP/src/tracker.js"
  (cd "$TMP/src" && TMPDIR="$TMP" node "$HERE/build.mjs" tracker.js "$ROOT/wit/0.2.0" "$TMP/out.wasm")
  # Keep only the newest build in the cache.
  rm -f "$CACHE"/tracker-*.wasm
  cp "$TMP/out.wasm" "$cached"
fi

deliver "$TMP/out.wasm" "$OUT"
