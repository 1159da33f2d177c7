#!/usr/bin/env bash
# Builds the policy_name policy: a core module written to the canonical ABI of the
# `allocbox:policy` world (wit/policy.wit), which allocbox makes a component when it
# loads it.
#
#   ./build.sh [OUT]     # OUT defaults to policy_name.wasm in this folder
#
# Node.js >= 20 and assemblyscript 0.28.20 (with binaryen.js): this folder's
# node_modules (./setup.sh installs it), or the `slab` policy's in the allocbox checkout
# that ALLOCBOX_TOOLCHAINS names. Exits 3 when neither has it. Writes only OUT (through
# a temporary directory).
set -euo pipefail

VERSION=0.28.20
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:-$HERE/policy_name.wasm}

if ! command -v node >/dev/null 2>&1; then
    echo "missing node: install Node.js >= 20, then run ./setup.sh" >&2
    exit 3
fi
MODULES=""
for candidate in "$HERE/node_modules" ${ALLOCBOX_TOOLCHAINS:+"$ALLOCBOX_TOOLCHAINS/guest-handlers/policies/assemblyscript/slab/node_modules"}; do
    if grep -qs "\"version\": \"$VERSION\"" "$candidate/assemblyscript/package.json" &&
        [ -f "$candidate/binaryen/index.js" ]; then
        MODULES=$candidate
        break
    fi
done
if [ -z "$MODULES" ]; then
    echo "missing assemblyscript $VERSION: run ./setup.sh (or set ALLOCBOX_TOOLCHAINS to an allocbox checkout whose .ci/setup has run)" >&2
    exit 3
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# --runtime stub: no garbage collector; --use abort=: no `env.abort` import, which the
# world does not provide; -Oz: smallest code.
node "$MODULES/assemblyscript/bin/asc.js" "$HERE/assembly/policy.ts" -o "$TMP/policy.wasm" \
    -Oz --runtime stub --use abort= --noAssert
# Exports get their canonical-ABI names. rename.mjs imports binaryen, which node finds
# in the node_modules next to the script: run a copy beside a link to the toolchain.
cp "$HERE/rename.mjs" "$TMP/rename.mjs"
ln -s "$MODULES" "$TMP/node_modules"
node "$TMP/rename.mjs" "$TMP/policy.wasm" "$TMP/out.wasm"

# `allocbox inspect` shows the language: AssemblyScript records none itself.
python3 "$HERE/stamp_language.py" "$TMP/out.wasm" AssemblyScript
mkdir -p "$(dirname "$OUT")"
mv -f "$TMP/out.wasm" "$OUT"
