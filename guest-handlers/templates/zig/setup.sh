#!/usr/bin/env bash
# Installs the toolchain of this Zig policy: Zig 0.17.0, the version allocbox's own Zig
# policy is built with, from PyPI's `ziglang` wheel (the official release) into .venv in
# this folder. Idempotent: returns at once when that version is there.
set -euo pipefail

VERSION=0.17.0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if compgen -G "$HERE/.venv/lib/python3*/site-packages/ziglang-$VERSION.dist-info" >/dev/null; then
    exit 0
fi
[ -x "$HERE/.venv/bin/python" ] || python3 -m venv "$HERE/.venv"
"$HERE/.venv/bin/python" -m pip install --quiet --disable-pip-version-check "ziglang==$VERSION"
echo "setup: installed ziglang $VERSION into $HERE/.venv" >&2
