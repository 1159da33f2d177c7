#!/usr/bin/env bash
# Builds the policy_name policy: a core module written to the canonical ABI of the
# `allocbox:policy` world (wit/policy.wit), which allocbox makes a component when it
# loads it.
#
#   ./build.sh [OUT]     # OUT defaults to policy_name.wasm in this folder
#
# Zig 0.17.0 from PyPI's `ziglang`: this folder's .venv (./setup.sh installs it), or the
# .venv of the allocbox checkout that ALLOCBOX_TOOLCHAINS names. Exits 3 when neither
# has it. Writes only OUT and build/ (Zig's caches, unless ZIG_GLOBAL_CACHE_DIR is set).
set -euo pipefail

VERSION=0.17.0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:-$HERE/policy_name.wasm}

PY=""
for root in "$HERE" ${ALLOCBOX_TOOLCHAINS:+"$ALLOCBOX_TOOLCHAINS"}; do
    if [ -x "$root/.venv/bin/python" ] &&
        compgen -G "$root/.venv/lib/python3*/site-packages/ziglang-$VERSION.dist-info" >/dev/null; then
        PY="$root/.venv/bin/python"
        break
    fi
done
if [ -z "$PY" ]; then
    echo "missing zig $VERSION: run ./setup.sh (or set ALLOCBOX_TOOLCHAINS to an allocbox checkout whose .ci/setup has run)" >&2
    exit 3
fi

mkdir -p "$HERE/build"
export ZIG_GLOBAL_CACHE_DIR="${ZIG_GLOBAL_CACHE_DIR:-$HERE/build/zig-global}"
export ZIG_LOCAL_CACHE_DIR="$HERE/build/zig-local"
TMP=$(mktemp -d "$HERE/build/out.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

# wasm32-freestanding: no WASI. -fno-entry -rdynamic: every @export is a module export.
# ReleaseSafe: bounds and overflow checks stay in and trap. --stack 65536: 64 KiB of
# stack instead of 1 MiB, so the initial memory is 2 pages, not 17.
(cd "$HERE" && "$PY" -m ziglang build-exe policy.zig \
    -target wasm32-freestanding -fno-entry -rdynamic -fsingle-threaded \
    -O ReleaseSafe -fstrip --stack 65536 --name policy -femit-bin="$TMP/out.wasm")

# `allocbox inspect` shows the language: Zig records none itself.
python3 "$HERE/stamp_language.py" "$TMP/out.wasm" Zig
mkdir -p "$(dirname "$OUT")"
mv -f "$TMP/out.wasm" "$OUT"
