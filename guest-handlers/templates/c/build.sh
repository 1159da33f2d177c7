#!/usr/bin/env bash
# Builds the policy_name policy: a core module written to the canonical ABI of the
# `allocbox:policy` world (wit/policy.wit), which allocbox makes a component when it
# loads it.
#
#   ./build.sh [OUT]     # OUT defaults to policy_name.wasm in this folder
#
# Freestanding C with Debian's clang 14 and lld 14 (./setup.sh installs them): no libc,
# no WASI. Exits 3 when they are missing. Writes only OUT (through a temporary directory).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:-$HERE/policy_name.wasm}

for tool in clang-14 wasm-ld-14; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "missing $tool: run ./setup.sh (Debian: apt-get install clang-14 lld-14)" >&2
        exit 3
    fi
done

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# -mbulk-memory: __builtin_memcpy is memory.copy, not a call to libc's memcpy.
# -nostdlib: no crt1, libc or compiler-rt. --no-entry: a library, no _start.
# 16 KiB of stack: nothing here recurses.
clang-14 --target=wasm32 -std=c11 -O2 -ffreestanding -nostdlib -mbulk-memory \
    -Wall -Wextra -Werror \
    -fuse-ld="$(command -v wasm-ld-14)" -Wl,--no-entry -Wl,-z,stack-size=16384 \
    -o "$TMP/out.wasm" "$HERE/policy.c"

# `allocbox inspect` shows the language: clang records none itself.
python3 "$HERE/stamp_language.py" "$TMP/out.wasm" C
mkdir -p "$(dirname "$OUT")"
mv -f "$TMP/out.wasm" "$OUT"
