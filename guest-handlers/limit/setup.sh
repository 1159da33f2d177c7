#!/usr/bin/env bash
# Installs the toolchain for the `limit` Python policy: componentize-py from PyPI, into
# the repository's venv (.venv at the repo root, made here if missing).
#
# componentize-py carries everything else itself (a CPython built for WASI, its
# standard library, the component tooling), so no apt packages are needed.
# Idempotent: when the pinned version is installed it returns at once.
set -euo pipefail

# Pinned: the version this policy was built and checked with.
VERSION=0.25.1

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY="$ROOT/.venv/bin/python"

# The fast path reads pip's record of the install instead of starting the tool (which
# loads a 46 MB extension).
shopt -s nullglob
installed=("$ROOT"/.venv/lib/python3*/site-packages/componentize_py-"$VERSION".dist-info)
if [ -x "$PY" ] && [ ${#installed[@]} -gt 0 ] && [ -x "$ROOT/.venv/bin/componentize-py" ]; then
    exit 0
fi

if [ ! -x "$PY" ]; then
    python3 -m venv "$ROOT/.venv"
fi
"$PY" -m pip install --quiet --disable-pip-version-check "componentize-py==$VERSION"
echo "limit: installed componentize-py $VERSION into $ROOT/.venv" >&2
