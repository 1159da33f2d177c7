#!/usr/bin/env bash
# Builds the `buddy` policy into OUT: a core module written to the canonical ABI of
# contract 0.2.0's `allocbox:policy/sharding-policy` world (allocbox makes it a component
# when it loads it).
#
#   guest-handlers/policies/zig/buddy/build.sh OUT.wasm
#
# Writes only OUT and this folder's gitignored `build/` (Zig's caches). Exits 3 with one
# line on stderr when the toolchain is missing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"
OUT=$(out_path "$@")

pip_require ziglang "$(pin ZIG_VERSION)"

# Zig's caches go under build/ so that a build writes nowhere else (not ~/.cache/zig).
export ZIG_GLOBAL_CACHE_DIR="$HERE/build/zig-global"
export ZIG_LOCAL_CACHE_DIR="$HERE/build/zig-local"
mkdir -p "$HERE/build"

# Build into a temp dir and move the result into place: no partial OUT on failure.
TMP="$(mktemp -d "$HERE/build/out.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

# wasm32-freestanding: no WASI, so the module imports only the world's functions.
# -fno-entry -rdynamic: a library-like module whose `export`ed functions are its exports.
# -fsingle-threaded: the host calls an instance on one thread at a time (one per thread
# when it shards it); no atomics, no shared memory.
# ReleaseSafe: bounds and overflow checks stay in and trap (see README: a trap is a
# caught failure; a silent bookkeeping error could lend overlapping blocks).
# -fstrip: no debug sections, smaller and path-independent output.
# --stack 65536: 64 KiB of shadow stack instead of 1 MiB; nothing here recurses or keeps
# big locals, and the initial memory (which counts against the host's guest-memory
# limit) drops from 17 pages to 2.
(cd "$HERE" && "$PY" -m ziglang build-exe buddy.zig \
    -target wasm32-freestanding -fno-entry -rdynamic -fsingle-threaded \
    -O ReleaseSafe -fstrip --stack 65536 \
    --name buddy -femit-bin="$TMP/buddy.wasm")

stamp_language "$TMP/buddy.wasm" Zig
deliver "$TMP/buddy.wasm" "$OUT"
