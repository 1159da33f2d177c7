#!/usr/bin/env bash
# Builds the policy_name policy: a component of the `allocbox:policy` world
# (wit/policy.wit), made by componentize-py from app.py (CPython for WASI, snapshotted
# after importing app.py; about 18 MB).
#
#   ./build.sh [OUT]     # OUT defaults to policy_name.wasm in this folder
#
# componentize-py 0.25.1: this folder's .venv (./setup.sh installs it), or the .venv of
# the allocbox checkout that ALLOCBOX_TOOLCHAINS names. Exits 3 when neither has it.
# Writes only OUT and build/bindings/ (the world's Python bindings, for editors and type
# checkers). Takes 15-25 s.
set -euo pipefail

VERSION=0.25.1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:-$HERE/policy_name.wasm}

TOOL=""
for root in "$HERE" ${ALLOCBOX_TOOLCHAINS:+"$ALLOCBOX_TOOLCHAINS"}; do
    if [ -x "$root/.venv/bin/componentize-py" ] &&
        compgen -G "$root/.venv/lib/python3*/site-packages/componentize_py-$VERSION.dist-info" >/dev/null; then
        TOOL="$root/.venv/bin/componentize-py"
        break
    fi
done
if [ -z "$TOOL" ]; then
    echo "missing componentize-py $VERSION: run ./setup.sh (or set ALLOCBOX_TOOLCHAINS to an allocbox checkout whose .ci/setup has run)" >&2
    exit 3
fi

rm -rf "$HERE/build/bindings"
"$TOOL" -q -d "$HERE/wit" -w policy bindings "$HERE/build/bindings"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# Built from a copy: the WASI CPython writes __pycache__ next to what it imports. With
# VIRTUAL_ENV unset componentize-py would add this machine's site-packages to the
# guest's path; an empty one keeps them out.
mkdir -p "$TMP/src" "$TMP/venv/lib/site-packages"
cp "$HERE/app.py" "$TMP/src/app.py"
(cd "$TMP/src" && VIRTUAL_ENV="$TMP/venv" "$TOOL" -q -d "$HERE/wit" -w policy \
    componentize -p "$TMP/src" app -o "$TMP/out.wasm")

# `allocbox inspect` shows the language: componentize-py records none itself.
python3 "$HERE/stamp_language.py" "$TMP/out.wasm" Python
mkdir -p "$(dirname "$OUT")"
mv -f "$TMP/out.wasm" "$OUT"
