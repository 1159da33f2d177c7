#!/usr/bin/env bash
# Installs the toolchain of this C policy: Debian's clang 14 and lld 14, the versions
# allocbox's own C policy is built with (1:14.0.6-12 on Debian 12). The policy is
# freestanding C, so no wasi-libc and no compiler-rt. Idempotent: returns at once when
# both tools are there.
set -euo pipefail

if command -v clang-14 >/dev/null 2>&1 && command -v wasm-ld-14 >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
# Lists may be missing (a fresh container) or stale (an old image): refresh them when
# the first try cannot find the packages.
install() {
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        clang-14 lld-14 >/dev/null
}
install 2>/dev/null || { $SUDO apt-get update -qq && install; }
echo "setup: installed clang-14 lld-14" >&2
