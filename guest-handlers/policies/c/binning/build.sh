#!/usr/bin/env bash
# Builds the `binning` policy into OUT: a core module written to the canonical ABI of the
# `allocbox:policy` world, which allocbox makes a component when it loads it.
#
#   guest-handlers/policies/c/binning/build.sh OUT.wasm
#
# Freestanding C: no libc, no WASI; the module imports only the world's functions.
# Deterministic (no debug info, no paths or dates in the output). Writes only OUT, by
# renaming a finished file from a temporary directory.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"
OUT=$(out_path "$@")

# Checked first, with shell builtins only, so a missing toolchain writes nothing.
for tool in clang-14 wasm-ld-14; do
    command -v "$tool" >/dev/null 2>&1 || missing "$tool"
done

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# -mbulk-memory: memcpy/memmove/memset become memory.copy/memory.fill instructions, so
#   nothing needs a libc. -nostdlib: no crt1, libc or compiler-rt (wasm has 64-bit
#   arithmetic natively; binning.c avoids what would need __multi3, see parse_u64). --no-entry: a library, no _start. The name section stays, so
#   a trap's backtrace names the function. The stack is 16 KiB: no recursion, and the
#   largest frame (init's settings) is under 1 KiB.
clang-14 --target=wasm32 -std=c11 -O2 -ffreestanding -nostdlib -mbulk-memory \
    -Wall -Wextra -Werror \
    -fuse-ld="$(command -v wasm-ld-14)" -Wl,--no-entry -Wl,-z,stack-size=16384 \
    -o "$TMP/binning.wasm" "$HERE/binning.c"

stamp_language "$TMP/binning.wasm" C
deliver "$TMP/binning.wasm" "$OUT"
