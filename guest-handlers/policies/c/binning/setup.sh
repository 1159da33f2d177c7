#!/usr/bin/env bash
# Installs the toolchain for the `binning` C policy: Debian's clang 14 and lld 14.
#
# The policy is freestanding C (`--target=wasm32 -nostdlib`): no libc, no WASI, no
# compiler-rt, so wasi-libc and libclang-rt-*-wasm32 are not needed. Idempotent: when
# both tools are present it returns at once.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"

# Clang 14 is what Debian bookworm ships (built and checked with 1:14.0.6-12); the major
# version is pinned by the package name, the point release by the distribution.
CLANG_PKG="clang-14"
LLD_PKG="lld-14"

if command -v clang-14 >/dev/null 2>&1 && command -v wasm-ld-14 >/dev/null 2>&1; then
    exit 0
fi
apt_install "$CLANG_PKG" "$LLD_PKG"
echo "binning: installed $CLANG_PKG $LLD_PKG" >&2
