#!/usr/bin/env bash
# Installs the toolchain of this Python policy: componentize-py 0.25.1, the version
# allocbox's own Python policy is built with, from PyPI into .venv in this folder. It
# carries everything else (a CPython built for WASI, its standard library, the component
# tooling). Idempotent: returns at once when that version is there.
set -euo pipefail

VERSION=0.25.1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ -x "$HERE/.venv/bin/componentize-py" ] &&
    compgen -G "$HERE/.venv/lib/python3*/site-packages/componentize_py-$VERSION.dist-info" >/dev/null; then
    exit 0
fi
[ -x "$HERE/.venv/bin/python" ] || python3 -m venv "$HERE/.venv"
"$HERE/.venv/bin/python" -m pip install --quiet --disable-pip-version-check "componentize-py==$VERSION"
echo "setup: installed componentize-py $VERSION into $HERE/.venv" >&2
