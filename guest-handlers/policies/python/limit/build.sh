#!/usr/bin/env bash
# Builds the `limit` policy into OUT: a component (CPython 3.x for WASI, snapshotted
# after importing app.py) made by componentize-py from app.py and the 0.2.0 world in wit/0.2.0/.
#
#   guest-handlers/policies/python/limit/build.sh OUT.wasm
#
# Writes only OUT, a temporary directory and this folder's gitignored build/:
#   build/bindings/  the Python bindings for the world, for editors and type checkers
#                    (componentize-py makes its own copy while it builds);
#   build/cache/     the last component built, named by a hash of everything it was
#                    built from.
#
# Reproducibility: componentize-py 0.25.1 runs app.py's imports inside the WASI CPython
# and snapshots its heap, and that heap depends on the build-time hash seed and random
# state, which componentize-py takes from the host and has no flag to fix (upstream
# issue bytecodealliance/componentize-py#247). So two fresh builds of the same sources
# behave the same but differ in bytes. To give the same bytes for the same sources,
# a build whose inputs (app.py, the WIT, this script, the componentize-py version) hash
# to the cached one copies that component instead of building again.
# BUILD_NO_CACHE=1 forces a fresh build.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"
OUT=$(out_path "$@")

VERSION=$(pin VERSION)
pip_require componentize-py "$VERSION"
TOOL="$VENV/bin/componentize-py"
[ -x "$TOOL" ] || missing componentize-py

BUILD="$HERE/build"
mkdir -p "$BUILD/cache"

# Bindings are cheap (50 ms): always fresh, so they never lag behind the WIT.
rm -rf "$BUILD/bindings"
"$TOOL" -q -d "$ROOT/wit/0.2.0" -w policy bindings "$BUILD/bindings"

key=$(cat "$HERE/app.py" "$HERE/build.sh" "$ROOT"/wit/0.2.0/*.wit <(echo "componentize-py $VERSION") \
    | sha256sum | cut -c1-16)
cached="$BUILD/cache/limit-$key.wasm"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

if [ -f "$cached" ] && [ "${BUILD_NO_CACHE:-0}" != 1 ]; then
    cp "$cached" "$TMP/out.wasm"
else
    # The app is built from a copy: the WASI CPython writes __pycache__ next to the
    # sources it imports, and the snapshot should not depend on what else is here.
    mkdir -p "$TMP/src" "$TMP/venv/lib/site-packages"
    cp "$HERE/app.py" "$TMP/src/app.py"
    # Without VIRTUAL_ENV componentize-py adds the host python3's site-packages (and
    # the user's) to the guest's path; an empty one keeps the build independent of
    # what this machine has installed.
    (cd "$TMP/src" && VIRTUAL_ENV="$TMP/venv" "$TOOL" -q -d "$ROOT/wit/0.2.0" -w policy \
        componentize -p "$TMP/src" app -o "$TMP/out.wasm")
    # Keep only the newest build in the cache.
    rm -f "$BUILD"/cache/limit-*.wasm
    cp "$TMP/out.wasm" "$cached"
fi

stamp_language "$TMP/out.wasm" Python
deliver "$TMP/out.wasm" "$OUT"
