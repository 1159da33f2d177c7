#!/usr/bin/env bash
# Installs the Zig toolchain for the `buddy` policy: PyPI's `ziglang` wheel (the official
# Zig release, compiler and standard library in one package) into the repo's venv.
# Idempotent; returns at once when the pinned version is already there.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"

ZIG_VERSION=0.17.0

pip_setup ziglang "$ZIG_VERSION"
