#!/usr/bin/env bash
# Installs the Zig toolchain for the `buddy` policy: PyPI's `ziglang` wheel (the official
# Zig release, compiler and standard library in one package) into the repo's venv.
# Idempotent; returns at once when the pinned version is already there.
set -euo pipefail

ZIG_VERSION=0.17.0
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="$ROOT/.venv/bin/python"

if [ ! -x "$PY" ]; then
    # The repo's venv is made by the project's own setup; make a bare one if it is not.
    python3 -m venv "$ROOT/.venv"
fi

# Fast path: read the wheel's metadata file instead of starting pip (well under 2 s).
if compgen -G "$ROOT/.venv/lib/python3*/site-packages/ziglang-$ZIG_VERSION.dist-info" >/dev/null; then
    exit 0
fi

"$PY" -m pip install --quiet --disable-pip-version-check "ziglang==$ZIG_VERSION"
